#include "safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "artifact.h"
#include "dsv4c/errors.h"
#include "json.h"

namespace dsv4c {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // a larger length field means a corrupt or foreign file
constexpr uint64_t kReadChunkBytes = 64ull << 20;    // a read job (runtime/weights.py, READ_CHUNK_BYTES)
const char* const kReexport = "the file is corrupt or truncated; re-download or re-export the checkpoint";

// The DLPack dtype of numpy's storage dtype for each safetensors dtype.
const std::map<std::string, DLDataType> kStorage = {
    {"F32", {kDLFloat, 32, 1}}, {"F16", {kDLFloat, 16, 1}}, {"BF16", {kDLUInt, 16, 1}},
    {"F8_E4M3", {kDLUInt, 8, 1}}, {"F8_E8M0", {kDLUInt, 8, 1}}, {"I8", {kDLInt, 8, 1}},
    {"U8", {kDLUInt, 8, 1}},      {"I32", {kDLInt, 32, 1}},     {"I64", {kDLInt, 64, 1}},
    {"BOOL", {kDLBool, 8, 1}}};

// Python's type(x).__name__ of a parsed JSON value.
std::string json_type_name(const json::Value& v) {
  if (json::as_object(v)) return "dict";
  if (json::as_array(v)) return "list";
  if (json::as_string(v)) return "str";
  if (json::as_int(v)) return "int";
  if (json::as_number(v)) return "float";
  return v.type_index() == tvm::ffi::TypeIndex::kTVMFFIBool ? "bool" : "NoneType";
}

// One tensor of the header: where its bytes lie in the file.
struct Entry {
  std::string name;
  std::string dtype;       // as the header spells it ("F32", "I64", ...)
  Tensor shape_and_dtype;  // no data
  uint64_t offset;         // from the start of the file
};

// A read-only map of a whole file; tensors share it (aliasing shared_ptr) and it is unmapped
// when the last of them goes.
struct Mapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (base != MAP_FAILED) ::munmap(base, size);
  }
};

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw CheckpointError(path_ + ": cannot open safetensors file: " + std::strerror(errno));
  }
  ~Reader() { ::close(fd_); }

  std::vector<Entry> entries() {
    struct stat st;
    ::fstat(fd_, &st);
    file_size_ = static_cast<uint64_t>(st.st_size);
    if (file_size_ < 8) {
      throw fail(std::to_string(file_size_) + " bytes is too short for a safetensors header length; " + kReexport);
    }
    unsigned char length[8];
    read_at(0, length, 8, "");
    uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = header_size << 8 | length[i];
    if (header_size > kMaxHeaderBytes) {
      throw fail("header length " + std::to_string(header_size) + " exceeds " + std::to_string(kMaxHeaderBytes) +
                 " bytes; this is not a safetensors file or " + kReexport);
    }
    if (8 + header_size > file_size_) {
      throw fail("header length " + std::to_string(header_size) + " exceeds the " + std::to_string(file_size_ - 8) +
                 " bytes after it; " + kReexport);
    }
    std::string text(header_size, '\0');
    read_at(8, text.data(), header_size, "");
    std::string problem;
    std::optional<json::Value> header = json::parse(text, &problem);
    if (!header) throw fail("header is not valid UTF-8 JSON (" + problem + "); " + kReexport);
    std::optional<json::Object> object = json::as_object(*header);
    if (!object) throw fail("header is a JSON " + json_type_name(*header) + ", not an object; " + kReexport);

    const uint64_t data_start = 8 + header_size, data_size = file_size_ - data_start;
    if (std::optional<json::Value> metadata = object->Get(tvm::ffi::String("__metadata__"))) read_metadata(*metadata);
    std::vector<Entry> out;
    for (const auto& [key, info] : *object) {
      std::string name = *json::as_string(key);
      if (name != "__metadata__") out.push_back(entry(name, info, data_start, data_size));
    }
    check_no_overlap(out, data_start);
    return out;
  }

  // Every tensor read into storage of its own, in pieces of at most kReadChunkBytes on up to 8
  // threads (Python: runtime/weights.py, _read_file): the page faults and copies into fresh
  // memory scale with the threads.
  std::map<std::string, Tensor> read_all() {
    struct Piece {
      uint64_t offset, size;
      char* to;
      std::string name;
    };
    std::map<std::string, Tensor> out;
    std::vector<Piece> pieces;
    for (Entry& e : entries()) {
      Tensor& t = out[e.name] = Tensor::for_reading(e.shape_and_dtype.shape, e.shape_and_dtype.dtype);
      for (uint64_t at = 0; at < t.nbytes(); at += kReadChunkBytes) {
        pieces.push_back({e.offset + at, std::min<uint64_t>(kReadChunkBytes, t.nbytes() - at), t.ptr<char>() + at, e.name});
      }
    }
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};  // a failed read stops the pieces not yet started
    std::exception_ptr failure;
    std::mutex failure_lock;
    auto work = [&] {
      for (size_t i; !failed && (i = next++) < pieces.size();) {
        try {
          read_at(pieces[i].offset, pieces[i].to, pieces[i].size, pieces[i].name);
        } catch (...) {
          std::lock_guard<std::mutex> hold(failure_lock);
          if (!failure) failure = std::current_exception();
          failed = true;
        }
      }
    };
    const size_t workers = std::clamp(std::thread::hardware_concurrency(), 1u, 8u);  // Python: default_workers()
    std::vector<std::thread> threads(std::min(pieces.size(), workers));
    for (std::thread& t : threads) t = std::thread(work);
    for (std::thread& t : threads) t.join();
    if (failure) std::rethrow_exception(failure);
    return out;
  }

  std::map<std::string, Tensor> map_all() {
    std::vector<Entry> all = entries();
    auto mapping = std::make_shared<Mapping>();
    mapping->size = file_size_;
    mapping->base = ::mmap(nullptr, file_size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (mapping->base == MAP_FAILED) throw fail(std::string("cannot map the file: ") + std::strerror(errno));
    std::map<std::string, Tensor> out;
    for (Entry& e : all) {
      Tensor t = e.shape_and_dtype;
      t.data = std::shared_ptr<void>(mapping, static_cast<char*>(mapping->base) + e.offset);
      out[e.name] = std::move(t);
    }
    return out;
  }

  // The header's __metadata__ (string to string), once entries() has run.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  void read_metadata(const json::Value& info) {
    std::optional<json::Object> object = json::as_object(info);
    bool strings = object.has_value();
    for (const auto& [key, value] : object ? *object : json::Object()) {
      std::optional<std::string> text = json::as_string(value);
      if (text) metadata_[*json::as_string(key)] = *text;
      strings = strings && text;
    }
    if (!strings) throw fail(std::string("__metadata__ must map strings to strings; ") + kReexport);
  }

  CheckpointError fail(const std::string& problem, const std::string& name = "") const {
    return CheckpointError((name.empty() ? path_ : path_ + ": tensor " + json::py_repr(tvm::ffi::String(name))) + ": " +
                           problem);
  }

  void read_at(uint64_t offset, void* out, uint64_t size, const std::string& name) const {
    auto* p = static_cast<char*>(out);
    while (size) {
      ssize_t got = ::pread(fd_, p, size, static_cast<off_t>(offset));
      if (got <= 0) throw fail(std::string("file ended while reading the tensor; ") + kReexport, name);
      p += got, offset += static_cast<uint64_t>(got), size -= static_cast<uint64_t>(got);
    }
  }

  Entry entry(const std::string& name, const json::Value& info, uint64_t data_start, uint64_t data_size) {
    std::optional<json::Object> object = json::as_object(info);
    if (!object) throw fail("header entry is a JSON " + json_type_name(info) + ", not an object; " + kReexport, name);
    json::Fields f(*object, path_);
    std::optional<json::Value> dtype_v = f.get("dtype"), shape_v = f.get("shape"), offsets_v = f.get("data_offsets");
    std::optional<std::string> dtype = dtype_v ? json::as_string(*dtype_v) : std::nullopt;
    if (!dtype) throw fail(std::string("missing or non-string 'dtype'; ") + kReexport, name);
    auto storage = kStorage.find(*dtype);
    if (storage == kStorage.end()) {
      throw fail("unsupported dtype " + json::py_repr(*dtype_v) +
                 " (dsv4c reads F32, F16, BF16, F8_E4M3, F8_E8M0, I8, U8, I32, I64, BOOL)", name);
    }
    std::optional<std::vector<int64_t>> shape = shape_v ? json::as_ints(*shape_v) : std::nullopt;
    std::string shape_repr = shape_v ? json::py_repr(*shape_v) : "None";
    if (!shape) throw fail("'shape' must be a list of integers, got " + shape_repr + "; " + kReexport, name);
    for (int64_t dim : *shape) {
      if (dim < 0) throw fail("negative dimension in shape " + shape_repr + "; " + kReexport, name);
    }
    std::optional<std::vector<int64_t>> offsets = offsets_v ? json::as_ints(*offsets_v) : std::nullopt;
    if (!offsets || offsets->size() != 2) {
      std::string got = offsets_v ? json::py_repr(*offsets_v) : "None";
      throw fail("'data_offsets' must be [begin, end] integers, got " + got + "; " + kReexport, name);
    }
    Tensor t{nullptr, storage->second, *shape};
    int64_t begin = (*offsets)[0], end = (*offsets)[1];
    if (end - begin != static_cast<int64_t>(t.nbytes())) {
      throw fail("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") hold " +
                 std::to_string(end - begin) + " bytes but " + *dtype + " " + shape_repr + " needs " +
                 std::to_string(t.nbytes()) + "; " + kReexport, name);
    }
    if (begin < 0 || static_cast<uint64_t>(end) > data_size) {
      throw fail("bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ") lie outside the " +
                 std::to_string(data_size) + "-byte data buffer; " + kReexport, name);
    }
    return Entry{name, *dtype, t, data_start + static_cast<uint64_t>(begin)};
  }

  // Sorted by start, any overlap shows up between neighbours; empty tensors own no bytes.
  void check_no_overlap(const std::vector<Entry>& all, uint64_t data_start) const {
    std::vector<std::tuple<uint64_t, uint64_t, std::string>> spans;
    for (const Entry& e : all) {
      uint64_t begin = e.offset - data_start, end = begin + e.shape_and_dtype.nbytes();
      if (end > begin) spans.emplace_back(begin, end, e.name);
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 0; i + 1 < spans.size(); ++i) {
      if (std::get<0>(spans[i + 1]) < std::get<1>(spans[i])) {
        throw fail("byte range overlaps that of tensor " + json::py_repr(tvm::ffi::String(std::get<2>(spans[i + 1]))) +
                   "; " + kReexport, std::get<2>(spans[i]));
      }
    }
  }

  std::string path_;
  int fd_;
  uint64_t file_size_ = 0;
  std::map<std::string, std::string> metadata_;
};

// The whole file, or nullopt when it cannot be read.
std::optional<std::string> read_text(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string out;
  char buf[1 << 16];
  ssize_t got;
  while ((got = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(got));
  ::close(fd);
  if (got < 0) return std::nullopt;
  return out;
}

}  // namespace

std::map<std::string, Tensor> read_safetensors(const std::string& path) { return Reader(path).read_all(); }

std::map<std::string, Tensor> map_safetensors(const std::string& path) { return Reader(path).map_all(); }

SafetensorsHeader read_safetensors_header(const std::string& path) {
  Reader reader(path);
  SafetensorsHeader header;
  for (const Entry& e : reader.entries()) {
    header.dtypes[e.name] = e.dtype;
    header.shapes[e.name] = e.shape_and_dtype.shape;
  }
  header.metadata = reader.metadata();
  return header;
}

namespace {

// A field of the manifest's "weights": {"index": file name, "files": [file names]}, where present.
std::optional<json::Value> weights_field(const json::Fields& manifest, const char* key) {
  std::optional<json::Value> weights_v = manifest.get("weights");
  std::optional<json::Object> weights = weights_v ? json::as_object(*weights_v) : std::nullopt;
  return weights ? weights->Get(tvm::ffi::String(key)) : std::nullopt;
}

// Bytes the kernel reports available (MemAvailable), or 0 where it does not say.
uint64_t available_memory() {
  std::optional<std::string> text = read_text("/proc/meminfo");
  size_t at = text ? text->find("MemAvailable:") : std::string::npos;
  return at == std::string::npos ? 0 : std::strtoull(text->c_str() + at + 13, nullptr, 10) * 1024;
}

}  // namespace

bool reads_weights(const std::string& artifact_dir, const json::Fields& manifest, const std::string& mode,
                   bool on_host) {
  if (mode != "auto") return mode == "read";
  if (!on_host) return false;  // a GPU copies every weight to the device: the map is only its source
  std::optional<json::Value> files_v = weights_field(manifest, "files");
  std::optional<json::Array> files = files_v ? json::as_array(*files_v) : std::nullopt;
  uint64_t total = 0;
  for (const json::Value& f : files ? *files : json::Array()) {
    struct stat st;
    std::optional<std::string> name = json::as_string(f);
    if (name && ::stat(join_path(artifact_dir, *name).c_str(), &st) == 0) total += static_cast<uint64_t>(st.st_size);
  }
  // No weight files (a --no-weights artifact): read_artifact_weights says so.
  return total > 0 && static_cast<double>(total) <= kReadShare * static_cast<double>(available_memory());
}

std::map<std::string, Tensor> read_artifact_weights(const std::string& artifact_dir, bool read) {
  return read_artifact_weights(artifact_dir, read_manifest(artifact_dir), read);
}

std::map<std::string, Tensor> read_artifact_weights(const std::string& artifact_dir, const json::Fields& manifest,
                                                    bool read) {
  const std::string d = python_path(artifact_dir);
  std::optional<json::Value> has = manifest.get("has_weights");
  if (!has || has->type_index() != tvm::ffi::TypeIndex::kTVMFFIBool || !has->cast<bool>()) {
    throw ArtifactError(d + ": compiled with --no-weights, so there are no weights to load; compile it again "
                        "from a model directory");
  }
  std::optional<json::Value> files_v = weights_field(manifest, "files"), index_v = weights_field(manifest, "index");
  std::optional<json::Array> files_a = files_v ? json::as_array(*files_v) : std::nullopt;
  std::optional<std::string> index_name = index_v ? json::as_string(*index_v) : std::nullopt;
  std::vector<std::string> files;
  for (const json::Value& f : files_a ? *files_a : json::Array()) {
    if (auto name = json::as_string(f)) files.push_back(*name);
  }
  if (!files_a || !index_name || files.size() != files_a->size()) {
    throw ArtifactError(join_path(d, "manifest.json") + ": manifest has no weight file list; recompile");
  }
  // The index: {"weight_map": {tensor: file}}, grouped by file.
  const std::string index_path = join_path(d, *index_name);
  std::map<std::string, std::set<std::string>> by_file;
  std::optional<std::string> text = read_text(index_path);
  std::string problem;
  std::optional<json::Value> index = text ? json::parse(*text, &problem) : std::nullopt;
  std::optional<json::Object> index_object = index ? json::as_object(*index) : std::nullopt;
  std::optional<json::Value> map_v = index_object ? index_object->Get(tvm::ffi::String("weight_map")) : std::nullopt;
  std::optional<json::Object> weight_map = map_v ? json::as_object(*map_v) : std::nullopt;
  bool valid = weight_map.has_value();
  for (const auto& [key, file] : weight_map ? *weight_map : json::Object()) {
    std::optional<std::string> name = json::as_string(file);
    if (!name) valid = false;
    if (name) by_file[*name].insert(*json::as_string(key));
  }
  if (!valid) throw ArtifactError(index_path + ": not a valid weight index; recompile");
  std::set<std::string> listed(files.begin(), files.end());
  if (by_file.size() != listed.size() ||
      !std::equal(by_file.begin(), by_file.end(), listed.begin(), [](const auto& a, const std::string& b) {
        return a.first == b;
      })) {
    throw ArtifactError(index_path + ": does not name the weight files the manifest lists; recompile");
  }
  std::map<std::string, Tensor> out;
  for (const std::string& file : files) {
    Reader reader(join_path(d, file));
    std::map<std::string, Tensor> mapped = read ? reader.read_all() : reader.map_all();
    std::set<std::string> names, stray;
    for (const auto& [name, tensor] : mapped) names.insert(name);
    std::set_symmetric_difference(names.begin(), names.end(), by_file[file].begin(), by_file[file].end(),
                                  std::inserter(stray, stray.begin()));
    if (!stray.empty()) {
      throw ArtifactError(d + ": " + file + " and " + *index_name + " disagree about tensor " + *stray.begin() +
                          "; recompile");
    }
    out.merge(mapped);
  }
  return out;
}

}  // namespace dsv4c

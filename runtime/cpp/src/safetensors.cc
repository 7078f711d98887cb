#include "safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "dsv4c/errors.h"
#include "json.h"

namespace dsv4c {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // a larger length field means a corrupt or foreign file
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

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw CheckpointError(path_ + ": cannot open safetensors file: " + std::strerror(errno));
  }
  ~Reader() { ::close(fd_); }

  std::map<std::string, Tensor> read_all() {
    struct stat st;
    ::fstat(fd_, &st);
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    if (file_size < 8) {
      throw fail(std::to_string(file_size) + " bytes is too short for a safetensors header length; " + kReexport);
    }
    unsigned char length[8];
    read_at(0, length, 8, "");
    uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = header_size << 8 | length[i];
    if (header_size > kMaxHeaderBytes) {
      throw fail("header length " + std::to_string(header_size) + " exceeds " + std::to_string(kMaxHeaderBytes) +
                 " bytes; this is not a safetensors file or " + kReexport);
    }
    if (8 + header_size > file_size) {
      throw fail("header length " + std::to_string(header_size) + " exceeds the " + std::to_string(file_size - 8) +
                 " bytes after it; " + kReexport);
    }
    std::string text(header_size, '\0');
    read_at(8, text.data(), header_size, "");
    std::string problem;
    std::optional<json::Value> header = json::parse(text, &problem);
    if (!header) throw fail("header is not valid UTF-8 JSON (" + problem + "); " + kReexport);
    std::optional<json::Object> entries = json::as_object(*header);
    if (!entries) throw fail("header is a JSON " + json_type_name(*header) + ", not an object; " + kReexport);

    const uint64_t data_start = 8 + header_size, data_size = file_size - data_start;
    std::map<std::string, Tensor> out;
    for (const auto& [key, info] : *entries) {
      std::string name = *json::as_string(key);
      if (name != "__metadata__") out[name] = read_tensor(name, info, data_start, data_size);
    }
    return out;
  }

 private:
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

  Tensor read_tensor(const std::string& name, const json::Value& info, uint64_t data_start, uint64_t data_size) {
    std::optional<json::Object> entry = json::as_object(info);
    if (!entry) throw fail("header entry is a JSON " + json_type_name(info) + ", not an object; " + kReexport, name);
    json::Fields f(*entry, path_);
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
    Tensor t{nullptr, storage->second, *shape};  // sized before any allocation
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
    t = Tensor::zeros(t.shape, t.dtype);
    read_at(data_start + static_cast<uint64_t>(begin), t.data.get(), t.nbytes(), name);
    return t;
  }

  std::string path_;
  int fd_;
};

}  // namespace

std::map<std::string, Tensor> read_safetensors(const std::string& path) { return Reader(path).read_all(); }

}  // namespace dsv4c

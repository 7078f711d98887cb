#include "engram.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

#include "artifact.h"
#include "dsv4c/errors.h"
#include "safetensors.h"

namespace dsv4c {
namespace {

// The tensors of a hash file and their dtypes, in the order EngramTables.load checks them.
const std::pair<const char*, const char*> kTensors[] = {
    {"token_map", "I32"}, {"layer_ids", "I64"}, {"primes", "I64"}, {"multipliers", "I64"}};
const char* const kSizeKey = "compressed_vocab_size";
const char* const kPadKey = "pad";

template <class T>
std::vector<T> values(const Tensor& t) {
  return std::vector<T>(t.ptr<T>(), t.ptr<T>() + t.numel());
}

// Python's int() of a metadata string, for the decimal integers EngramTables.save writes.
std::optional<int64_t> integer(const std::map<std::string, std::string>& metadata, const char* key) {
  auto it = metadata.find(key);
  if (it == metadata.end() || it->second.empty()) return std::nullopt;
  size_t used = 0;
  try {
    int64_t value = std::stoll(it->second, &used);
    if (used == it->second.size()) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

const char* const kEngramHash = "engram_hash.safetensors";  // Python: artifact/file_names.py, ENGRAM_HASH
const char* const kFp8Table = "fp8_e4m3_e8m0";              // Python: artifact/engram_tables.py, FP8_TABLE
const char* const kFp32Table = "fp32";

// The tensors of a table file: name -> (safetensors dtype, shape) (Python: engram_tables.table_tensors).
std::map<std::string, std::pair<std::string, std::vector<int64_t>>> table_tensors(const std::string& format,
                                                                                  int64_t rows, int64_t width) {
  if (format == kFp32Table) return {{"rows", {"F32", {rows, width}}}};
  return {{"rows", {"U8", {rows, width}}}, {"scales", {"U8", {rows, (width + 31) / 32}}}};
}

// What makes a table file's header not the table the manifest records, in a few words, or ""
// (Python: engram_tables.table_problem, same words).
std::string table_problem(const SafetensorsHeader& header, const std::string& format, int64_t rows, int64_t width) {
  const auto want = table_tensors(format, rows, width);
  std::vector<std::string> held, wanted;
  for (const auto& [name, dtype] : header.dtypes) held.push_back(name);
  for (const auto& [name, tensor] : want) wanted.push_back(name);
  if (held != wanted) {
    return "holds tensors " + json::py_list(held) + ", a " + format + " table holds " + json::py_list(wanted);
  }
  for (const auto& [name, tensor] : want) {
    const std::string& dtype = header.dtypes.at(name);
    const std::vector<int64_t>& shape = header.shapes.at(name);
    if (dtype != tensor.first || shape != tensor.second) {
      return "tensor '" + name + "' is " + dtype + " " + json::py_list(shape) + ", the manifest implies " +
             tensor.first + " " + json::py_list(tensor.second);
    }
  }
  return "";
}

}  // namespace

EngramHash EngramHash::load(const std::string& path) {
  auto fail = [&](const std::string& problem) {
    return ArtifactError(path + ": " + problem + "; recompile the artifact");
  };
  SafetensorsHeader header;
  std::map<std::string, Tensor> tensors;
  try {
    header = read_safetensors_header(path);
    std::set<std::string> missing;
    for (auto [name, dtype] : kTensors) {
      if (!header.dtypes.count(name)) missing.insert(name);
    }
    if (!missing.empty()) throw fail("not an Engram hash file (no tensor '" + *missing.begin() + "')");
    for (auto [name, dtype] : kTensors) {
      if (header.dtypes[name] != dtype) {
        throw fail(std::string("tensor '") + name + "' is " + header.dtypes[name] + ", not " + dtype);
      }
    }
    tensors = read_safetensors(path);
  } catch (const CheckpointError& error) {  // the reader names the file first: say it once
    std::string problem = error.what();
    if (problem.rfind(path + ": ", 0) == 0) problem = problem.substr(path.size() + 2);
    throw fail(problem);
  }
  std::optional<int64_t> size = integer(header.metadata, kSizeKey), pad = integer(header.metadata, kPadKey);
  if (!size || !pad) throw fail(std::string("metadata '") + kSizeKey + "' and '" + kPadKey + "' must be integers");

  const Tensor &token_map = tensors["token_map"], &primes = tensors["primes"], &multipliers = tensors["multipliers"];
  EngramHash h;
  h.layer_ids_ = values<int64_t>(tensors["layer_ids"]);
  const int64_t layers = h.layers();
  // EngramTables._inconsistency, check by check.
  if (token_map.shape.size() != 1 || primes.shape.size() != 3 || multipliers.shape.size() != 2) {
    throw fail("token_map, primes and multipliers must have 1, 3 and 2 axes");
  }
  if (primes.shape[0] != layers || multipliers.shape != std::vector<int64_t>{layers, primes.shape[1] + 1}) {
    throw fail("primes " + json::py_list(primes.shape) + " and multipliers " + json::py_list(multipliers.shape) +
               " do not fit " + std::to_string(layers) + " layers");
  }
  const std::string vocabulary = "the compressed vocabulary [0, " + std::to_string(*size) + ")";
  if (!(0 <= *pad && *pad < *size)) throw fail("pad " + std::to_string(*pad) + " is outside " + vocabulary);
  h.token_map_ = values<int32_t>(token_map);
  if (std::any_of(h.token_map_.begin(), h.token_map_.end(), [&](int32_t c) { return c < 0 || c >= *size; })) {
    throw fail("token_map holds ids outside " + vocabulary);
  }
  h.primes_ = values<int64_t>(primes);
  h.multipliers_ = values<int64_t>(multipliers);
  const int64_t largest = std::numeric_limits<int64_t>::max() / *size;  // no product overflows int64
  if (std::any_of(h.primes_.begin(), h.primes_.end(), [](int64_t p) { return p < 2; }) ||
      std::any_of(h.multipliers_.begin(), h.multipliers_.end(), [&](int64_t m) { return m < 1 || m > largest; })) {
    throw fail("primes or multipliers out of range (the hash could overflow int64)");
  }
  h.max_ngram_size_ = multipliers.shape[1];
  h.n_heads_ = primes.shape[2];
  h.pad_ = *pad;
  // Each layer's heads stack into one table, n-gram size major, head minor (EngramTables.offsets).
  const int64_t per_layer = h.rows_per_layer();
  h.offsets_.resize(h.primes_.size());
  for (int64_t e = 0; e < layers; ++e) {
    int64_t start = 0;
    for (int64_t k = e * per_layer; k < (e + 1) * per_layer; ++k) {
      h.offsets_[k] = start;
      start += h.primes_[k];
    }
  }
  return h;
}

void EngramHash::request_rows(const std::vector<int32_t>& tokens, int64_t start, int64_t stop,
                              std::vector<int32_t>& out) const {
  if (start < 0 || stop < start || static_cast<int64_t>(tokens.size()) < stop) {
    throw std::logic_error("request_rows: positions " + std::to_string(start) + ".." + std::to_string(stop) +
                           " are not within the request's " + std::to_string(tokens.size()) + " tokens");
  }
  const int64_t first = std::max<int64_t>(0, start - (max_ngram_size_ - 1));
  const int64_t vocab = static_cast<int64_t>(token_map_.size());
  for (int64_t p = first; p < stop; ++p) {
    if (tokens[p] < 0 || tokens[p] >= vocab) {
      throw UsageError("token id " + std::to_string(tokens[p]) + " is outside the vocabulary [0, " +
                       std::to_string(vocab) + ")");
    }
  }
  const int64_t heads = n_heads_, n_max = max_ngram_size_;
  for (int64_t p = start; p < stop; ++p) {
    for (int64_t e = 0; e < layers(); ++e) {
      // Look-back s reads the token at p - s, or the pad id before the sequence start; the hash
      // of the n-gram of size s + 1 is the XOR of the first s + 1 look-backs' products.
      int64_t hash = 0;
      for (int64_t s = 0; s < n_max; ++s) {
        const int64_t token = p - s < 0 ? pad_ : token_map_[tokens[p - s]];
        hash ^= token * multipliers_[e * n_max + s];
        for (int64_t j = 0; s > 0 && j < heads; ++j) {
          const int64_t k = (e * (n_max - 1) + s - 1) * heads + j;
          out.push_back(static_cast<int32_t>(hash % primes_[k] + offsets_[k]));
        }
      }
    }
  }
}

EngramHash load_engram_hash(const std::string& artifact, const json::Fields& manifest) {
  std::optional<std::string> file = kEngramHash;
  if (std::optional<json::Value> engram = manifest.get("engram")) {
    std::optional<json::Object> section = json::as_object(*engram);
    std::optional<json::Value> hash = section ? section->Get(tvm::ffi::String("hash")) : std::nullopt;
    file = hash ? json::as_string(*hash) : std::nullopt;
    if (!section || !hash || (!file && hash->type_index() != tvm::ffi::TypeIndex::kTVMFFINone)) {
      throw ArtifactError(manifest.file() + ": 'engram.hash' is missing or not a string or null; recompile");
    }
  }
  // null: compiled without a tokenizer; before the "engram" section, no file said the same
  if (!file || (!manifest.get("engram") && ::access(join_path(artifact, *file).c_str(), F_OK) != 0)) {
    throw ArtifactError(artifact + ": the model has Engram layers but the artifact has no " + kEngramHash +
                        "; compile it from a model directory that holds its tokenizer");
  }
  return EngramHash::load(join_path(artifact, *file));
}

std::vector<std::string> EngramTable::inputs() const {
  std::vector<std::string> names = {"engram_table." + std::to_string(layer)};
  if (scales.data) names.push_back("engram_scale." + std::to_string(layer));
  return names;
}

namespace {

// Rows `unique` (ascending) of `table` [R, ...], then zero rows up to `count` rows.
Tensor gathered(const Tensor& table, const std::vector<int32_t>& unique, size_t count) {
  std::vector<int64_t> shape = table.shape;
  shape[0] = static_cast<int64_t>(std::max(count, unique.size()));
  Tensor out = Tensor::zeros(shape, table.dtype);
  const size_t row_bytes = table.nbytes() / static_cast<size_t>(table.shape[0]);
  for (size_t i = 0; i < unique.size(); ++i) {
    std::memcpy(out.ptr<char>() + i * row_bytes, table.ptr<char>() + static_cast<size_t>(unique[i]) * row_bytes,
                row_bytes);
  }
  return out;
}

}  // namespace

EngramTable EngramTable::compact(std::vector<int32_t>& ids, bool padded) const {
  std::vector<int32_t> unique = ids;
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  if (!unique.empty() && (unique.front() < 0 || unique.back() >= rows.shape[0])) {
    throw std::logic_error("Engram row " + std::to_string(unique.front() < 0 ? unique.front() : unique.back()) +
                           " is outside the table of layer " + std::to_string(layer));
  }
  for (int32_t& id : ids) {
    id = static_cast<int32_t>(std::lower_bound(unique.begin(), unique.end(), id) - unique.begin());
  }
  const size_t count = padded ? ids.size() : unique.size();
  return EngramTable{layer, format, gathered(rows, unique, count),
                     scales.data ? gathered(scales, unique, count) : Tensor{}};
}

std::vector<EngramTable> open_engram_tables(const std::string& artifact, const json::Fields& manifest, bool read) {
  std::vector<EngramTable> out;
  std::optional<json::Value> engram = manifest.get("engram");
  if (!engram) return out;
  json::Fields section = manifest.object("engram");
  for (const json::Value& item : section.array("tables")) {
    std::optional<json::Object> object = json::as_object(item);
    if (!object) section.fail("tables", "a list of objects");
    json::Fields record(*object, manifest.file(), "engram.tables[].");
    const std::string path = join_path(artifact, record.string("file")), format = record.string("format");
    if (format != kFp8Table && format != kFp32Table) record.fail("format", "'fp8_e4m3_e8m0' or 'fp32'");
    std::string problem = table_problem(read_safetensors_header(path), format, record.integer("rows"),
                                        record.integer("width"));
    if (!problem.empty()) throw ArtifactError(path + ": " + problem + "; recompile");
    std::map<std::string, Tensor> tensors = read ? read_safetensors(path) : map_safetensors(path);
    out.push_back(EngramTable{record.integer("layer"), format, tensors["rows"],
                              format == kFp8Table ? tensors["scales"] : Tensor{}});
  }
  return out;
}

}  // namespace dsv4c

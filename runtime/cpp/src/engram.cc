#include "engram.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

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

std::string shape_list(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace

EngramHash EngramHash::load(const std::string& path) {
  auto fail = [&](const std::string& problem) { return ArtifactError(path + ": " + problem + "; recompile the artifact"); };
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
    throw fail("primes " + shape_list(primes.shape) + " and multipliers " + shape_list(multipliers.shape) +
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

}  // namespace dsv4c

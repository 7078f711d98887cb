// DeepSeek-V4.1's Engram hash: which table rows each token's n-grams read (Python twin:
// dsv4c/artifact/engram.py, EngramTables, whose docstring explains the hash). The constants are
// the artifact's engram_hash.safetensors, computed at compile time from the tokenizer.
#ifndef DSV4C_SRC_ENGRAM_H_
#define DSV4C_SRC_ENGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4c {

/// The hash file of an artifact whose manifest names none under "engram" (Python:
/// artifact/file_names.py, ENGRAM_HASH).
inline const char* const kEngramHash = "engram_hash.safetensors";
/// The modes of EngineOptions::engram_memory (Python: Engine(engram_memory=...)).
inline const char* const kEngramMemoryModes[] = {"map", "read"};

class EngramHash {
 public:
  /// Reads an Engram hash file (EngramTables.save's tensors token_map, layer_ids, primes,
  /// multipliers and metadata compressed_vocab_size, pad). Throws ArtifactError with
  /// EngramTables.load's messages for a file that is not such a record.
  static EngramHash load(const std::string& path);

  int64_t layers() const { return static_cast<int64_t>(layer_ids_.size()); }
  /// Rows per token and layer: one per (n-gram size 2 .. n_max, hash head).
  int64_t rows_per_layer() const { return (max_ngram_size_ - 1) * n_heads_; }

  /// Appends to `out` the table rows [stop - start, layers(), rows_per_layer()] of positions
  /// start .. stop - 1 of a request whose token ids by position are `tokens` (at least `stop`;
  /// only the n_max - 1 before `start` and those after it are read): EngramTables.request_rows,
  /// in int64 arithmetic, stored as the step's int32. Throws UsageError for an id outside the
  /// vocabulary.
  void request_rows(const std::vector<int32_t>& tokens, int64_t start, int64_t stop, std::vector<int32_t>& out) const;

 private:
  std::vector<int32_t> token_map_;    // [vocab]: the compressed id of each token id
  std::vector<int64_t> layer_ids_;    // [L_e]
  std::vector<int64_t> primes_;       // [L_e, n_max - 1, n_heads]: each hash head's modulus
  std::vector<int64_t> offsets_;      // [L_e, n_max - 1, n_heads]: where each head's rows start
  std::vector<int64_t> multipliers_;  // [L_e, n_max]: one per look-back distance
  int64_t max_ngram_size_ = 0, n_heads_ = 0, pad_ = 0;
};

}  // namespace dsv4c

#endif  // DSV4C_SRC_ENGRAM_H_

// DeepSeek-V4.1's Engram memory as the host sees it: the hash that says which table rows each
// token's n-grams read (Python twin: dsv4c/artifact/engram.py, EngramTables, whose docstring
// explains it; the constants are the artifact's engram_hash.safetensors, computed at compile
// time from the tokenizer), and the tables, one file per Engram layer (Python:
// artifact/engram_tables.py, runtime/weights.py's open_engram_tables; docs/artifact.md).
#ifndef DSV4C_SRC_ENGRAM_H_
#define DSV4C_SRC_ENGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "json.h"
#include "tensor.h"

namespace dsv4c {

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

/// The Engram hash of an artifact whose step takes Engram rows: the file its manifest's "engram"
/// section names (engram_hash.safetensors in an artifact compiled before that section). Throws
/// ArtifactError with Python's messages (runtime.loading.load_engram_hash) where there is none.
EngramHash load_engram_hash(const std::string& artifact, const json::Fields& manifest);

/// One Engram layer's table (Python: artifact.engram_tables.EngramTable): `rows` [R, de], uint8
/// e4m3fn codes with `scales` [R, ceil(de / 32)] uint8 E8M0 codes in format fp8_e4m3_e8m0, or
/// float32 rows without scales (`scales.data` null) in format fp32.
struct EngramTable {
  int64_t layer = 0;
  std::string format;
  Tensor rows, scales;

  /// The step inputs that carry the table, after engram_rows: its rows and, in FP8, their scales
  /// (Python: engram_tables.table_inputs).
  std::vector<std::string> inputs() const;
  /// The rows `ids` names, each once in row order (`padded`: then zero rows up to ids.size() rows,
  /// for a step whose shapes must depend on its tokens alone), with `ids` remapped into them
  /// (Python: EngramTable.compact). Throws std::logic_error for an id outside the table.
  EngramTable compact(std::vector<int32_t>& ids, bool padded) const;
};

/// The artifact's Engram tables (manifest "engram.tables", Engram-layer order; none without an
/// "engram" section), each file's header checked against the manifest's record: mapped, or with
/// `read` read into memory. Throws ArtifactError / CheckpointError with the messages of Python's
/// runtime.weights.open_engram_tables.
std::vector<EngramTable> open_engram_tables(const std::string& artifact, const json::Fields& manifest, bool read);

}  // namespace dsv4c

#endif  // DSV4C_SRC_ENGRAM_H_

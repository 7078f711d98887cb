// What the runtime needs of the model description in manifest.json: sizes, rope frequencies
// and the KV pool geometry (Python: frontend/config.py, PoolGeometry.build).
#ifndef DSV4C_SRC_MODEL_CONFIG_H_
#define DSV4C_SRC_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "dsv4c/kv_pool.h"
#include "json.h"

namespace dsv4c {

struct Rope {
  double theta = 0;
  bool yarn = false;  // YaRN extension (compress rope only); the fields below apply when set
  double factor = 1;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32;
  double beta_slow = 1;

  /// Per-pair inverse frequencies in float32, as Python's Rope.inv_freq computes them.
  std::vector<float> inv_freq(int64_t rope_dim) const;
};

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  int64_t head_dim = 0;
  int64_t rope_dim = 0;
  int64_t index_head_dim = 0;
  int64_t sliding_window = 0;
  Rope main_rope;
  Rope compress_rope;
};

/// From manifest["model"] (the transformers spelling `dsv4c compile` writes).
ModelConfig model_config(const json::Fields& manifest);

/// From manifest["pool_geometry"], cross-checked against the model description.
PoolGeometry pool_geometry(const json::Fields& manifest, const ModelConfig& config);

}  // namespace dsv4c

#endif  // DSV4C_SRC_MODEL_CONFIG_H_

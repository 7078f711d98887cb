// What the runtime needs of the model description in manifest.json: sizes and the KV pool
// geometry (Python: ModelConfig.from_json_dict in artifact/model_config.py,
// PoolGeometry.from_summary in artifact/pool.py). Rope tables and the rest are the compiled
// step's own (constants in the artifact).
#ifndef DSV4C_SRC_MODEL_CONFIG_H_
#define DSV4C_SRC_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "dsv4c/kv_pool.h"
#include "json.h"

namespace dsv4c {

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  int64_t num_mtp_layers = 0;
  int64_t sliding_window = 0;
};

/// From manifest["model"] (the transformers spelling `dsv4c compile` writes).
ModelConfig model_config(const json::Fields& manifest);

/// From manifest["pool_geometry"], cross-checked against the model description.
PoolGeometry pool_geometry(const json::Fields& manifest, const ModelConfig& config);

}  // namespace dsv4c

#endif  // DSV4C_SRC_MODEL_CONFIG_H_

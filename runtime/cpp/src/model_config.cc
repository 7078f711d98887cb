#include "model_config.h"

#include "dsv4c/errors.h"

namespace dsv4c {

ModelConfig model_config(const json::Fields& manifest) {
  json::Fields model = manifest.object("model");
  ModelConfig c;
  c.vocab_size = model.integer("vocab_size");
  c.num_layers = model.integer("num_hidden_layers");
  c.num_mtp_layers = model.integer("num_nextn_predict_layers");
  c.sliding_window = model.integer("sliding_window");
  return c;
}

PoolGeometry pool_geometry(const json::Fields& manifest, const ModelConfig& config) {
  json::Fields summary = manifest.object("pool_geometry");
  PoolGeometry g;
  g.window = config.sliding_window;
  g.window_layers = config.num_layers + config.num_mtp_layers;  // the MTP layer has a window too
  g.rows_per_envelope = summary.integer("rows_per_envelope");
  g.index_rows_per_envelope = summary.integer("index_rows_per_envelope");
  for (const json::Value& item : summary.array("layers")) {
    std::optional<json::Object> object = json::as_object(item);
    if (!object) summary.fail("layers", "a list of objects");
    json::Fields layer(*object, summary.file(), "pool_geometry.layers[].");
    CompressedLayerRows rows{layer.integer("layer"), layer.integer("ratio"), layer.integer("rows"),
                             layer.integer("offset"), -1, layer.integers("readers")};
    std::optional<json::Value> index_offset = layer.get("index_offset");
    if (index_offset && json::as_int(*index_offset)) rows.index_offset = *json::as_int(*index_offset);
    g.compressed.push_back(rows);
  }
  // The compressor rings as the compiler shaped them (overlapping windows or not is its business).
  for (const json::Value& item : summary.array("states")) {
    std::optional<json::Object> object = json::as_object(item);
    if (!object) summary.fail("states", "a list of objects");
    json::Fields state(*object, summary.file(), "pool_geometry.states[].");
    g.states.push_back(StateShape{state.integer("layer"), state.string("stream"), state.integer("rows"),
                                  state.integer("width")});
  }
  int64_t state_bytes = 0;
  for (const StateShape& s : g.states) state_bytes += 2 * s.rows * s.width * 4;
  if (summary.integer("window_rows_per_request") != g.window_rows_per_request() ||
      summary.integer("state_bytes_per_request") != state_bytes) {
    throw ArtifactError(summary.file() + ": pool_geometry disagrees with the model description; recompile");
  }
  return g;
}

}  // namespace dsv4c

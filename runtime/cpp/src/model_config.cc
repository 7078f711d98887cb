#include "model_config.h"

#include <algorithm>
#include <math.h>

#include <cmath>

#include "dsv4c/errors.h"

namespace dsv4c {

std::vector<float> Rope::inv_freq(int64_t rope_dim) const {
  // Every step is a float32 operation, rounded as numpy rounds it (the build disables FMA
  // contraction); the YaRN correction range is computed in double like Python's math module.
  const float dim = static_cast<float>(rope_dim);
  int64_t low = 0;
  double span = 1;  // high - low of the ramp
  if (yarn) {
    auto correction_dim = [&](double rotations) {
      return rope_dim * std::log(original_max_position_embeddings / (rotations * 2 * M_PI)) / (2 * std::log(theta));
    };
    low = std::max<int64_t>(static_cast<int64_t>(std::floor(correction_dim(beta_fast))), 0);
    int64_t high = std::min<int64_t>(static_cast<int64_t>(std::ceil(correction_dim(beta_slow))), rope_dim - 1);
    // The reference widens a zero-width ramp by 0.001 (in double, as Python adds it).
    span = (low == high ? static_cast<double>(high) + 0.001 : static_cast<double>(high)) - static_cast<double>(low);
  }
  std::vector<float> out;
  for (int64_t i = 0; 2 * i < rope_dim; ++i) {
    // glibc powf: what numpy computes on hosts without AVX-512 (see docs/cpp_host.md, "Numerics").
    float pos_freq = ::powf(static_cast<float>(theta), static_cast<float>(2 * i) / dim);
    float extrapolation = 1.0f / pos_freq;
    if (!yarn) {
      out.push_back(extrapolation);
      continue;
    }
    float interpolation = 1.0f / (static_cast<float>(factor) * pos_freq);
    float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(span), 0.0f, 1.0f);
    float extrapolation_factor = 1.0f - ramp;
    out.push_back(interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor);
  }
  return out;
}

namespace {

Rope read_rope(const json::Fields& rope) {
  Rope r;
  r.theta = rope.number("rope_theta");
  std::optional<json::Value> type = rope.get("rope_type");
  if (type && json::as_string(*type) == "yarn" && rope.integer("original_max_position_embeddings") != 0) {
    r.yarn = true;
    r.factor = rope.number("factor");
    r.original_max_position_embeddings = rope.integer("original_max_position_embeddings");
    r.beta_fast = rope.number("beta_fast");
    r.beta_slow = rope.number("beta_slow");
  }
  return r;
}

}  // namespace

ModelConfig model_config(const json::Fields& manifest) {
  json::Fields model = manifest.object("model");
  ModelConfig c;
  c.vocab_size = model.integer("vocab_size");
  c.num_layers = model.integer("num_hidden_layers");
  c.head_dim = model.integer("head_dim");
  c.rope_dim = model.integer("qk_rope_head_dim");
  c.index_head_dim = model.integer("index_head_dim");
  c.sliding_window = model.integer("sliding_window");
  json::Fields rope = model.object("rope_parameters");
  c.main_rope = read_rope(rope.object("main"));
  c.compress_rope = read_rope(rope.object("compress"));
  return c;
}

PoolGeometry pool_geometry(const json::Fields& manifest, const ModelConfig& config) {
  json::Fields summary = manifest.object("pool_geometry");
  PoolGeometry g;
  g.head_dim = config.head_dim;
  g.index_head_dim = config.index_head_dim;
  g.window = config.sliding_window;
  g.backbone_layers = config.num_layers;
  g.rows_per_envelope = summary.integer("rows_per_envelope");
  g.index_rows_per_envelope = summary.integer("index_rows_per_envelope");
  for (const json::Value& item : summary.array("layers")) {
    std::optional<json::Object> object = json::as_object(item);
    if (!object) summary.fail("layers", "a list of objects");
    json::Fields layer(*object, summary.file(), "pool_geometry.layers[].");
    CompressedLayerRows rows{layer.integer("layer"), layer.string("kind"), layer.integer("ratio"),
                             layer.integer("rows"), layer.integer("offset"), -1};
    std::optional<json::Value> index_offset = layer.get("index_offset");
    if (index_offset && json::as_int(*index_offset)) rows.index_offset = *json::as_int(*index_offset);
    g.compressed.push_back(rows);
    // A CSA layer pools overlapping windows: its rings hold two windows of two halves each.
    int64_t c = rows.kind == "csa" ? 2 : 1;
    g.states.push_back(StateShape{rows.layer, "main", c * rows.ratio, c * config.head_dim});
    if (rows.index_offset >= 0) {
      g.states.push_back(StateShape{rows.layer, "index", c * rows.ratio, c * config.index_head_dim});
    }
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

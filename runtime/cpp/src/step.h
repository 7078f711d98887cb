// The artifact's compiled step, called through TVM's Relax VM (Python twin:
// dsv4c/runtime/backend_tvm.py). The library holds the entry functions that run a whole step
// on the artifact's device; this class opens it, binds the weights and allocates the KV pool's
// tensors as the manifest's "vm" section describes them, and per step uploads the compact
// inputs and reads back the requested logits. It holds no model logic of its own.
#ifndef DSV4C_SRC_STEP_H_
#define DSV4C_SRC_STEP_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dsv4c/kv_pool.h"
#include "dsv4c/runtime.h"
#include "engram.h"
#include "json.h"
#include "tensor.h"

namespace dsv4c {

/// Each token's Engram table rows, row-major [tokens, layers, per_layer] (EngramHash::request_rows).
struct EngramRows {
  std::vector<int32_t> rows;
  int64_t layers = 0, per_layer = 0;
};

class CompiledStep {
 public:
  /// Opens `artifact`'s library on the device its target names (the CPU for llvm; the first
  /// CUDA / ROCm GPU otherwise, which must exist) and binds its weights, read or mapped as
  /// `weights_mode` (a checked EngineOptions::weights) says, and a V4.1 step's Engram tables,
  /// mapped or read as `engram_memory` ("map" / "read") says, gathered per step off the CPU or
  /// with `gather_engram_rows` (EngineOptions). Throws ArtifactError / CheckpointError.
  /// `release_every`: EngineOptions::release_cached_memory_every.
  CompiledStep(const std::string& artifact, const json::Fields& manifest, const KVPool& pool,
               const std::string& weights_mode, const std::string& engram_memory, bool gather_engram_rows,
               double release_every);

  /// Whether the step takes each token's Engram table rows (a V4.1 model with Engram layers).
  bool takes_engram_rows() const { return takes_engram_rows_; }

  /// One step over tokens of the pool's admitted requests (each request's tokens contiguous,
  /// consecutive positions); returns the logits of `logit_rows` (token indices), row-major
  /// [logit_rows.size(), vocab]. `engram_rows`: each token's Engram table rows when
  /// takes_engram_rows(), else empty.
  std::vector<float> run(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                         const std::vector<int32_t>& seq_ids, const std::vector<int32_t>& logit_rows,
                         const EngramRows& engram_rows);

  /// The library's encode_image (a V4.1 model with a vision tower, manifest "vision") on one
  /// image's pixels, row-major float32 [3, height, width]: its span's rows (Engine::encode_image).
  ImageRows encode_image(const std::vector<float>& pixels, int64_t height, int64_t width) const;

 private:
  void bind_engram_inputs(const std::string& artifact, const json::Fields& manifest,
                          const std::vector<std::string>& names, bool read);
  tvm::ffi::Tensor upload(const std::vector<int32_t>& values, std::vector<int64_t> shape) const;
  tvm::ffi::Tensor to_device(const Tensor& t) const;
  std::vector<tvm::ffi::Any> engram_arguments(const EngramRows& engram_rows, bool padded) const;

  const KVPool& pool_;
  DLDevice device_;
  tvm::ffi::Module vm_;
  tvm::ffi::Function decode_, prefill_;
  int64_t decode_max_tokens_ = 0;
  int64_t max_step_tokens_ = 0;
  std::vector<int64_t> entry_ratios_;
  bool context_buckets_ = false;  // decode replays CUDA graphs: inputs cover the context's bucket
  bool takes_engram_rows_ = false;
  bool takes_images_ = false;       // the prefill function takes image rows (vm.image_inputs)
  tvm::ffi::Tensor no_image_rows_;  // the one zero row a text prompt's prefill passes
  bool gathers_engram_rows_ = false;  // off the CPU (or asked to): only the rows a step reads go in
  std::vector<EngramTable> engram_tables_;       // manifest "engram.tables", in host memory
  std::vector<tvm::ffi::Tensor> whole_tables_;  // their step inputs, unless gathered
  std::optional<tvm::ffi::Function> encode_image_;  // manifest "vision.function", when the model has a tower
  int64_t patch_size_ = 0, max_patches_ = 0;         // manifest "vision": patch_size, tower.max_patches
  tvm::ffi::Array<tvm::ffi::Tensor> params_;
  tvm::ffi::Array<tvm::ffi::Tensor> pool_tensors_;
  double release_every_;  // seconds; see EngineOptions::release_cached_memory_every
  std::chrono::steady_clock::time_point released_at_ = std::chrono::steady_clock::now();
};

}  // namespace dsv4c

#endif  // DSV4C_SRC_STEP_H_

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

#include <cstdint>
#include <string>
#include <vector>

#include "dsv4c/kv_pool.h"
#include "json.h"

namespace dsv4c {

class CompiledStep {
 public:
  /// Opens `artifact`'s library on the device its target names (the CPU for llvm; the first
  /// CUDA / ROCm GPU otherwise, which must exist) and binds its weights, read or mapped as
  /// `weights_mode` (a checked EngineOptions::weights) says. Throws ArtifactError / CheckpointError.
  CompiledStep(const std::string& artifact, const json::Fields& manifest, const KVPool& pool,
               const std::string& weights_mode);

  /// One step over tokens of the pool's admitted requests (each request's tokens contiguous,
  /// consecutive positions); returns the logits of `logit_rows` (token indices), row-major
  /// [logit_rows.size(), vocab].
  std::vector<float> run(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                         const std::vector<int32_t>& seq_ids, const std::vector<int32_t>& logit_rows);

 private:
  tvm::ffi::Tensor upload(const std::vector<int32_t>& values, std::vector<int64_t> shape) const;

  const KVPool& pool_;
  DLDevice device_;
  tvm::ffi::Module vm_;
  tvm::ffi::Function decode_, prefill_;
  int64_t decode_max_tokens_ = 0;
  int64_t max_step_tokens_ = 0;
  std::vector<int64_t> entry_ratios_;
  bool context_buckets_ = false;  // decode replays CUDA graphs: inputs cover the context's bucket
  tvm::ffi::Array<tvm::ffi::Tensor> params_;
  tvm::ffi::Array<tvm::ffi::Tensor> pool_tensors_;
};

}  // namespace dsv4c

#endif  // DSV4C_SRC_STEP_H_

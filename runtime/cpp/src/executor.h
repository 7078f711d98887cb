// The CPU executor: runs the step function with the kernels of kernels.so on a KV pool
// (Python: dsv4c/runtime/backend_tvm.py, which it follows op by op).
#ifndef DSV4C_SRC_EXECUTOR_H_
#define DSV4C_SRC_EXECUTOR_H_

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <map>
#include <string>
#include <vector>

#include "dsv4c/kv_pool.h"
#include "json.h"
#include "model_config.h"
#include "program.h"
#include "tensor.h"

namespace dsv4c {

class Executor {
 public:
  /// Loads kernels.so, resolves every node's kernels and reads the weights. `pool` (fp32 planes)
  /// must outlive the executor. Throws ArtifactError / CheckpointError.
  Executor(const std::string& artifact, const json::Fields& manifest, const ModelConfig& config, StepFunction program,
           KVPool& pool);

  /// One call of the step function: T tokens of any number of requests (each request's tokens
  /// contiguous, at consecutive positions, already admitted and grown in the pool). Returns the
  /// logits [T, vocab].
  Tensor step(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
              const std::vector<int32_t>& seq_ids);

 private:
  struct StepContext;
  /// A node's kernels by role ("main", "gemv", "pool", ...).
  using Kernels = std::map<std::string, tvm::ffi::Function>;
  /// What an op handler gets: the node, its kernels, its operands (values; weights and KV-state
  /// tokens are empty tensors), the step's token count and its bookkeeping.
  struct Call {
    const Node& node;
    const Kernels& kernels;
    const std::vector<Tensor>& args;
    int64_t n;
    const StepContext& ctx;
    const tvm::ffi::Function& kernel(const std::string& role) const;
  };
  using Op = std::vector<Tensor> (Executor::*)(const Call&);
  static const std::map<std::string, Op>& ops();

  const Tensor& weight(const Operand& v) const;
  std::vector<Tensor> weight_and_scale(const Operand& v) const;
  const Tensor& ones(int64_t dim);
  Tensor matmul(const Call& c, const std::string& prefix, const Tensor& x, const std::vector<Tensor>& w);

  std::vector<Tensor> op_embed(const Call& c);
  std::vector<Tensor> op_hc_expand(const Call& c);
  std::vector<Tensor> op_mhc_pre(const Call& c);
  std::vector<Tensor> op_hc_head(const Call& c);
  std::vector<Tensor> op_mhc_seam(const Call& c);
  std::vector<Tensor> op_mhc_post_head(const Call& c);
  std::vector<Tensor> op_mhc_post(const Call& c);
  std::vector<Tensor> op_rmsnorm(const Call& c);
  std::vector<Tensor> op_linear(const Call& c);
  std::vector<Tensor> op_linear_split(const Call& c);
  std::vector<Tensor> op_reshape(const Call& c);
  std::vector<Tensor> op_add(const Call& c);
  std::vector<Tensor> op_rope(const Call& c);
  std::vector<Tensor> op_rmsnorm_rope(const Call& c);
  std::vector<Tensor> op_grouped_linear(const Call& c);
  std::vector<Tensor> op_moe_route(const Call& c);
  std::vector<Tensor> op_experts(const Call& c);
  std::vector<Tensor> op_shared_expert(const Call& c);
  std::vector<Tensor> op_kv_write(const Call& c);
  std::vector<Tensor> op_compress(const Call& c);
  std::vector<Tensor> op_index_score(const Call& c);
  std::vector<Tensor> op_index_topk(const Call& c);
  std::vector<Tensor> op_sparse_attn(const Call& c);

  std::string artifact_;
  KVPool& pool_;
  StepFunction program_;
  tvm::ffi::Module library_;
  std::vector<Kernels> kernels_;  // per node
  std::map<std::string, Tensor> weights_;
  std::map<std::string, Tensor> inv_freq_;  // "main", "compress"
  std::map<int64_t, Tensor> ones_;
  Tensor kv_plane_;
  Tensor index_plane_;
};

}  // namespace dsv4c

#endif  // DSV4C_SRC_EXECUTOR_H_

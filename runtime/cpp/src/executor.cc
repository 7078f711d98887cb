// Each op_* below mirrors the _op_* method of the same name in runtime/backend_tvm.py: same
// kernels (by role), same arguments in the same order, same host bookkeeping. Keep them in step.
#include "executor.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "artifact.h"
#include "dsv4c/errors.h"
#include "safetensors.h"

namespace dsv4c {
namespace ffi = tvm::ffi;
namespace {

// The matmul kernels' row blocking (llvm_kernels.GEMM_ROWS, backend_tvm.GEMV_MAX_ROWS): up to 4
// rows take the GEMV kernel, more take the GEMM kernel on rows zero-padded to blocks of 8.
constexpr int64_t kGemvMaxRows = 4;
constexpr int64_t kGemmRows = 8;

// Kernel arguments are tensors or lists of tensors (a weight and its scales), flattened in order;
// any that is not 64-byte aligned (a slice of stacked weights) is passed as an aligned copy, as
// backend_tvm._call does.
void append(std::vector<Tensor>& out, const Tensor& t) { out.push_back(t); }
void append(std::vector<Tensor>& out, const std::vector<Tensor>& ts) { out.insert(out.end(), ts.begin(), ts.end()); }

template <class... Args>
void call(const ffi::Function& kernel, const Args&... args) {
  std::vector<Tensor> tensors;
  (append(tensors, args), ...);
  for (Tensor& t : tensors) t = t.shareable();  // the copies live until the call returns
  std::vector<DLTensor> dl;
  dl.reserve(tensors.size());  // the views below point into it
  std::vector<ffi::AnyView> views;
  for (const Tensor& t : tensors) {
    if (!t.defined()) throw std::logic_error("a kernel argument is a weight or state slot, not a tensor");
    dl.push_back(t.dl());
    views.emplace_back(&dl.back());
  }
  ffi::Any ignored;
  kernel.CallPacked(views.data(), static_cast<int32_t>(views.size()), &ignored);
}

// `shape` with its first dimension replaced by n: (n,) + shape[1:].
std::vector<int64_t> with_rows(int64_t n, std::vector<int64_t> shape) {
  shape.at(0) = n;
  return shape;
}

// x[rows] along the first axis, as a new tensor.
Tensor take_rows(const Tensor& x, const std::vector<int64_t>& rows) {
  Tensor out = Tensor::zeros(with_rows(static_cast<int64_t>(rows.size()), x.shape), x.dtype);
  size_t row_bytes = x.shape[0] ? x.nbytes() / static_cast<size_t>(x.shape[0]) : 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(out.ptr<char>() + i * row_bytes, x.ptr<char>() + rows[i] * row_bytes, row_bytes);
  }
  return out;
}

Tensor floats(const std::vector<float>& values) {
  Tensor t = Tensor::zeros({static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.ptr<float>());
  return t;
}

std::vector<int64_t> arange(int64_t start, int64_t stop) {
  std::vector<int64_t> out;
  for (int64_t i = start; i < stop; ++i) out.push_back(i);
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------ step context

// Per-step bookkeeping shared by the stateful ops: each request's tokens and first position.
struct Executor::StepContext {
  struct Group {
    int64_t seq, begin, count, p0;  // tokens [begin, begin + count) at positions p0, p0 + 1, ...
  };
  std::vector<int64_t> positions, seq_ids, step_start;
  std::vector<Group> groups;  // in order of first appearance

  StepContext(const std::vector<int32_t>& pos, const std::vector<int32_t>& seqs)
      : positions(pos.begin(), pos.end()), seq_ids(seqs.begin(), seqs.end()), step_start(pos.size()) {
    std::vector<int64_t> order;
    std::map<int64_t, std::vector<int64_t>> tokens_of;
    for (size_t t = 0; t < seq_ids.size(); ++t) {
      if (!tokens_of.count(seq_ids[t])) order.push_back(seq_ids[t]);
      tokens_of[seq_ids[t]].push_back(static_cast<int64_t>(t));
    }
    for (int64_t seq : order) {
      const std::vector<int64_t>& idx = tokens_of[seq];
      for (size_t i = 1; i < idx.size(); ++i) {
        if (idx[i] != idx[i - 1] + 1 || positions[idx[i]] != positions[idx[i - 1]] + 1) {
          throw UsageError("request " + std::to_string(seq) +
                           ": its tokens must be contiguous in the step, at consecutive positions");
        }
      }
      groups.push_back(Group{seq, idx.front(), static_cast<int64_t>(idx.size()), positions[idx.front()]});
      for (int64_t t : idx) step_start[t] = positions[idx.front()];
    }
  }
};

// ------------------------------------------------------------------------------ loading

Executor::Executor(const std::string& artifact, const json::Fields& manifest, const ModelConfig& config,
                   StepFunction program, KVPool& pool)
    : artifact_(artifact),
      pool_(pool),
      program_(std::move(program)),
      library_(ffi::Module::LoadFromFile(join_path(artifact, manifest.object("kernels").string("library")))) {
  json::Fields kernels = manifest.object("kernels");
  json::Array per_node = kernels.array("per_node");
  if (per_node.size() != program_.nodes.size()) {
    throw ArtifactError(artifact + ": program.json and the manifest's kernel list disagree; recompile");
  }
  std::map<std::string, ffi::Function> by_symbol;
  for (size_t i = 0; i < per_node.size(); ++i) {
    const std::string& op = program_.nodes[i].op;
    if (!ops().count(op)) {
      throw ArtifactError(artifact + ": op " + op + " has no driver in this C++ runtime; update the runtime");
    }
    Kernels roles;
    std::optional<json::Object> entry = json::as_object(per_node[i]);
    if (!entry) kernels.fail("per_node", "a list of objects");
    for (const auto& [role, symbol_value] : *entry) {
      std::string symbol = json::as_string(symbol_value).value_or("");
      if (!by_symbol.count(symbol)) {
        ffi::Optional<ffi::Function> f = library_->GetFunction(symbol);
        if (!f.has_value()) throw ArtifactError(artifact + ": kernels.so has no kernel " + symbol + "; recompile");
        by_symbol[symbol] = f.value();
      }
      roles[*json::as_string(role)] = by_symbol[symbol];
    }
    kernels_.push_back(std::move(roles));
  }
  weights_ = read_safetensors(join_path(artifact, "weights.safetensors"));
  inv_freq_["main"] = floats(config.main_rope.inv_freq(config.rope_dim));
  inv_freq_["compress"] = floats(config.compress_rope.inv_freq(config.rope_dim));
  const PoolGeometry& g = pool.geometry();
  kv_plane_ = Tensor::borrow(pool.kv_plane(), {pool.total_rows(), g.head_dim});
  index_plane_ = Tensor::borrow(pool.index_plane(), {pool.index_plane_rows(), g.index_head_dim});
}

const std::map<std::string, Executor::Op>& Executor::ops() {
  static const std::map<std::string, Op> table = {
      {"embed", &Executor::op_embed},
      {"hc_expand", &Executor::op_hc_expand},
      {"mhc_pre", &Executor::op_mhc_pre},
      {"hc_head", &Executor::op_hc_head},
      {"mhc_seam", &Executor::op_mhc_seam},
      {"mhc_post_head", &Executor::op_mhc_post_head},
      {"mhc_post", &Executor::op_mhc_post},
      {"rmsnorm", &Executor::op_rmsnorm},
      {"linear", &Executor::op_linear},
      {"lm_head", &Executor::op_linear},
      {"linear_split", &Executor::op_linear_split},
      {"reshape", &Executor::op_reshape},
      {"add", &Executor::op_add},
      {"rope", &Executor::op_rope},
      {"rmsnorm_rope", &Executor::op_rmsnorm_rope},
      {"grouped_linear", &Executor::op_grouped_linear},
      {"moe_route", &Executor::op_moe_route},
      {"experts", &Executor::op_experts},
      {"shared_expert", &Executor::op_shared_expert},
      {"kv_write", &Executor::op_kv_write},
      {"compress", &Executor::op_compress},
      {"index_score", &Executor::op_index_score},
      {"index_topk", &Executor::op_index_topk},
      {"sparse_attn", &Executor::op_sparse_attn},
  };
  return table;
}

const ffi::Function& Executor::Call::kernel(const std::string& role) const {
  auto it = kernels.find(role);
  if (it == kernels.end()) throw std::logic_error("node " + node.op + " has no kernel for role " + role);
  return it->second;
}

const Tensor& Executor::weight(const Operand& v) const {
  auto it = weights_.find(v.name);
  if (it == weights_.end()) {
    throw CheckpointError(join_path(artifact_, "weights.safetensors") + ": tensor " +
                          json::py_repr(ffi::String(v.name)) + ": not in this file (" +
                          std::to_string(weights_.size()) +
                          " tensors); the checkpoint does not match the model configuration");
  }
  return it->second;
}

std::vector<Tensor> Executor::weight_and_scale(const Operand& v) const {
  auto scale = weights_.find(v.name + ".scale");
  if (scale == weights_.end()) return {weight(v)};
  return {weight(v), scale->second};
}

// The weight argument of an unweighted rmsnorm kernel (not read by it).
const Tensor& Executor::ones(int64_t dim) {
  auto it = ones_.find(dim);
  if (it == ones_.end()) it = ones_.emplace(dim, floats(std::vector<float>(static_cast<size_t>(dim), 1.0f))).first;
  return it->second;
}

// ------------------------------------------------------------------------------ step

Tensor Executor::step(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                      const std::vector<int32_t>& seq_ids) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<Tensor> env(static_cast<size_t>(program_.value_count));
  const std::vector<int32_t>* inputs[] = {&tokens, &positions, &seq_ids};
  for (size_t i = 0; i < 3; ++i) env[program_.inputs[i]] = Tensor::int32(*inputs[i]);
  StepContext ctx(positions, seq_ids);
  for (size_t i = 0; i < program_.nodes.size(); ++i) {
    const Node& node = program_.nodes[i];
    std::vector<Tensor> args;
    for (const Operand& v : node.inputs) args.push_back(v.weight ? Tensor{} : env[v.id]);
    std::vector<Tensor> outs = (this->*ops().at(node.op))(Call{node, kernels_[i], args, n, ctx});
    for (size_t j = 0; j < std::min(outs.size(), node.outputs.size()); ++j) env[node.outputs[j]] = outs[j];
  }
  return env[program_.outputs.at(0)];
}

// ------------------------------------------------------------------------------ ops

std::vector<Tensor> Executor::op_embed(const Call& c) {
  Tensor out = Tensor::zeros({c.n, c.node.inputs[1].type.shape[1]});
  call(c.kernel("main"), c.args[0], weight(c.node.inputs[1]), out);
  return {out};
}

std::vector<Tensor> Executor::op_hc_expand(const Call& c) {
  Tensor out = Tensor::zeros(with_rows(c.n, c.node.output_types[0].shape));
  call(c.kernel("main"), c.args[0], out);
  return {out};
}

std::vector<Tensor> Executor::op_mhc_pre(const Call& c) {
  const std::vector<int64_t>& h = c.args[0].shape;
  Tensor y = Tensor::zeros({c.n, h[2]}), post = Tensor::zeros({c.n, h[1]}), comb = Tensor::zeros({c.n, h[1], h[1]});
  const std::vector<Operand>& in = c.node.inputs;
  call(c.kernel("main"), c.args[0], weight(in[1]), weight(in[2]), weight(in[3]), y, post, comb);
  return {y, post, comb};
}

std::vector<Tensor> Executor::op_hc_head(const Call& c) {
  Tensor y = Tensor::zeros({c.n, c.args[0].shape[2]});
  const std::vector<Operand>& in = c.node.inputs;
  call(c.kernel("main"), c.args[0], weight(in[1]), weight(in[2]), weight(in[3]), y);
  return {y};
}

std::vector<Tensor> Executor::op_mhc_seam(const Call& c) {
  const std::vector<int64_t>& h = c.args[1].shape;
  std::vector<Tensor> outs = {Tensor::zeros(h), Tensor::zeros({c.n, h[2]}), Tensor::zeros({c.n, h[1]}),
                              Tensor::zeros({c.n, h[1], h[1]})};
  const std::vector<Operand>& in = c.node.inputs;
  call(c.kernel("main"), c.args[0], c.args[1], c.args[2], c.args[3], weight(in[4]), weight(in[5]), weight(in[6]),
       outs);
  return outs;
}

std::vector<Tensor> Executor::op_mhc_post_head(const Call& c) {
  const std::vector<int64_t>& h = c.args[1].shape;
  std::vector<Tensor> outs = {Tensor::zeros(h), Tensor::zeros({c.n, h[2]})};
  const std::vector<Operand>& in = c.node.inputs;
  call(c.kernel("main"), c.args[0], c.args[1], c.args[2], c.args[3], weight(in[4]), weight(in[5]), weight(in[6]),
       outs);
  return outs;
}

std::vector<Tensor> Executor::op_mhc_post(const Call& c) {
  Tensor out = Tensor::zeros(with_rows(c.n, c.args[1].shape));
  call(c.kernel("main"), c.args[0], c.args[1], c.args[2], c.args[3], out);
  return {out};
}

std::vector<Tensor> Executor::op_rmsnorm(const Call& c) {
  const Tensor& x = c.args[0];
  Tensor flat = x.reshape({-1, x.shape.back()});
  Tensor out = Tensor::zeros(x.shape);
  const Tensor& w = c.node.inputs.size() == 2 ? weight(c.node.inputs[1]) : ones(x.shape.back());
  call(c.kernel("main"), flat, w, out.reshape(flat.shape));
  return {out};
}

// y = x @ W.T through the GEMV kernel for decode-sized steps, else the 8-row-block GEMM. `w` is
// the tiled weight [out / tile, in, tile] and, when quantized, its scales.
Tensor Executor::matmul(const Call& c, const std::string& prefix, const Tensor& x, const std::vector<Tensor>& w) {
  const int64_t rows = x.shape[0], out_dim = w[0].shape[0] * w[0].shape[2];  // weights in column tiles
  if (rows <= kGemvMaxRows) {
    Tensor y = Tensor::zeros({rows, out_dim});
    call(c.kernel(prefix + "gemv"), x, w, y);
    return y;
  }
  const int64_t blocks = (rows + kGemmRows - 1) / kGemmRows;
  Tensor padded = Tensor::zeros({blocks * kGemmRows, x.shape[1]});
  std::memcpy(padded.ptr<char>(), x.ptr<char>(), x.nbytes());
  Tensor y = Tensor::zeros({blocks * kGemmRows, out_dim});
  call(c.kernel(prefix + "gemm"), padded.reshape({blocks, kGemmRows, -1}), w, y.reshape({blocks, kGemmRows, out_dim}));
  return y.first_rows(rows);
}

std::vector<Tensor> Executor::op_linear(const Call& c) {
  const Tensor& x = c.args[0];
  Tensor y = matmul(c, "", x.reshape({-1, x.shape.back()}), weight_and_scale(c.node.inputs[1]));
  std::vector<int64_t> shape(x.shape.begin(), x.shape.end() - 1);
  shape.push_back(y.shape.back());
  return {y.reshape(shape)};
}

std::vector<Tensor> Executor::op_linear_split(const Call& c) {
  Tensor y = op_linear(c)[0];
  const int64_t width = y.shape.back(), rows = y.numel() / width;
  std::vector<Tensor> parts;
  int64_t offset = 0;
  for (int64_t size : c.node.attrs.integers("sizes")) {
    std::vector<int64_t> shape(y.shape.begin(), y.shape.end() - 1);
    shape.push_back(size);
    Tensor part = Tensor::zeros(shape);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(y.ptr<float>() + r * width + offset, size, part.ptr<float>() + r * size);
    }
    parts.push_back(part);
    offset += size;
  }
  return parts;
}

std::vector<Tensor> Executor::op_reshape(const Call& c) {
  json::Array shape = c.node.attrs.array("shape");  // ["T", d1, d2, ...]
  std::vector<int64_t> dims{c.n};
  for (size_t i = 1; i < shape.size(); ++i) dims.push_back(json::as_int(shape[i]).value());
  return {c.args[0].reshape(dims)};
}

std::vector<Tensor> Executor::op_add(const Call& c) {
  Tensor out = Tensor::zeros(c.args[0].shape);
  call(c.kernel("main"), c.args[0].reshape({c.n, -1}), c.args[1].reshape({c.n, -1}), out.reshape({c.n, -1}));
  return {out};
}

std::vector<Tensor> Executor::op_rope(const Call& c) {
  const Tensor& x = c.args[0];
  Tensor out = Tensor::zeros(x.shape);
  std::vector<int64_t> heads{c.n, x.ndim() == 3 ? x.shape[1] : 1, x.shape.back()};
  call(c.kernel("main"), x.reshape(heads), c.args[1], inv_freq_.at(c.node.attrs.string("rope")), out.reshape(heads));
  return {out};
}

std::vector<Tensor> Executor::op_rmsnorm_rope(const Call& c) {
  const Tensor& x = c.args[0];
  std::vector<int64_t> heads{c.n, x.ndim() == 3 ? x.shape[1] : 1, x.shape.back()};
  const Tensor& w = c.node.inputs.size() == 3 ? weight(c.node.inputs[1]) : ones(x.shape.back());
  Tensor out = Tensor::zeros(x.shape);
  call(c.kernel("main"), x.reshape(heads), w, c.args.back(), inv_freq_.at(c.node.attrs.string("rope")),
       out.reshape(heads));
  return {out};
}

// One matmul per group on the contiguous copy of x[:, g], with the weight slice w[g]; the outputs
// stacked along axis 1.
std::vector<Tensor> Executor::op_grouped_linear(const Call& c) {
  const Tensor& x = c.args[0];  // [T, G, I]
  std::vector<Tensor> w = weight_and_scale(c.node.inputs[1]);  // [G, rank / tile, I, tile] (+ scales)
  const int64_t groups = x.shape[1], in = x.shape[2];
  std::vector<Tensor> outs;
  for (int64_t g = 0; g < groups; ++g) {
    Tensor xg = Tensor::zeros({c.n, in});
    for (int64_t t = 0; t < c.n; ++t) {
      std::copy_n(x.ptr<float>() + (t * groups + g) * in, in, xg.ptr<float>() + t * in);
    }
    std::vector<Tensor> wg;
    for (const Tensor& a : w) wg.push_back(a.index(g));
    outs.push_back(matmul(c, "", xg, wg));
  }
  const int64_t rank = outs.empty() ? 0 : outs[0].shape[1];
  Tensor out = Tensor::zeros({c.n, groups, rank});
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t t = 0; t < c.n; ++t) {
      std::copy_n(outs[g].ptr<float>() + t * rank, rank, out.ptr<float>() + (t * groups + g) * rank);
    }
  }
  return {out};
}

std::vector<Tensor> Executor::op_moe_route(const Call& c) {
  const int64_t k = c.node.attrs.integer("k");
  Tensor logits = matmul(c, "gate_", c.args[0], weight_and_scale(c.node.inputs[1]));
  const int64_t experts = logits.shape[1];
  Tensor scores = Tensor::zeros({c.n, experts});
  call(c.kernel("scores"), logits, scores);
  Tensor ids = Tensor::zeros({c.n, k}, kI32);
  if (c.node.attrs.string("mode") == "hash") {
    call(c.kernel("select"), weight(c.node.inputs[2]), c.args[3], ids);
  } else {
    Tensor biased = Tensor::zeros({c.n, experts});
    call(c.kernel("bias"), scores, weight(c.node.inputs[2]), biased);
    call(c.kernel("select"), biased, ids);
  }
  Tensor weights = Tensor::zeros({c.n, k});
  call(c.kernel("weights"), scores, ids, weights);
  return {weights, ids};
}

// Each routed expert, in ascending id order: its tokens' rows through gate / up matmuls, swiglu,
// the down matmul, then added into the output scaled by the routing weights.
std::vector<Tensor> Executor::op_experts(const Call& c) {
  const Tensor &y = c.args[0], &route_w = c.args[1], &ids = c.args[2];  // [T, D], [T, K] f32, [T, K] i32
  const std::vector<Operand>& in = c.node.inputs;  // ..., w1, w2, w3: [E, out / tile, in, tile] (+ scales)
  const std::vector<Tensor> w1 = weight_and_scale(in[3]), w2 = weight_and_scale(in[4]), w3 = weight_and_scale(in[5]);
  const int64_t k = ids.shape[1];
  const int32_t* id = ids.ptr<int32_t>();
  Tensor out = Tensor::zeros({c.n, y.shape[1]});
  auto slice = [](const std::vector<Tensor>& w, int64_t e) {
    std::vector<Tensor> out;
    for (const Tensor& a : w) out.push_back(a.index(e));
    return out;
  };
  for (int32_t e : std::set<int32_t>(id, id + ids.numel())) {  // np.unique: ascending
    std::vector<int64_t> tokens;  // np.nonzero(ids == e): (token, slot) pairs in row-major order
    std::vector<float> scales;    // route_w[tokens, slots]
    for (int64_t t = 0; t < c.n; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        if (id[t * k + j] == e) {
          tokens.push_back(t);
          scales.push_back(route_w.ptr<float>()[t * k + j]);
        }
      }
    }
    Tensor x = take_rows(y, tokens);
    Tensor gate = matmul(c, "up_", x, slice(w1, e));
    Tensor up = matmul(c, "up_", x, slice(w3, e));
    Tensor act = Tensor::zeros({static_cast<int64_t>(tokens.size()), gate.shape[1]});
    call(c.kernel("act"), gate, up, act);
    Tensor down = matmul(c, "down_", act, slice(w2, e));
    call(c.kernel("combine"), out, Tensor::int32(tokens), floats(scales), down);
  }
  return {out};
}

std::vector<Tensor> Executor::op_shared_expert(const Call& c) {
  Tensor gate = matmul(c, "up_", c.args[0], weight_and_scale(c.node.inputs[1]));
  Tensor up = matmul(c, "up_", c.args[0], weight_and_scale(c.node.inputs[3]));
  Tensor act = Tensor::zeros({c.n, gate.shape[1]});
  call(c.kernel("act"), gate, up, act);
  return {matmul(c, "down_", act, weight_and_scale(c.node.inputs[2]))};
}

// ------------------------------------------------------------------------------ KV state

std::vector<Tensor> Executor::op_kv_write(const Call& c) {
  const int64_t layer = c.node.attrs.integer("layer"), window = c.node.attrs.integer("window");
  std::vector<int64_t> keep, rows;  // each request's last `window` tokens and their window rows
  for (const StepContext::Group& g : c.ctx.groups) {
    for (int64_t t = g.begin + g.count - std::min(window, g.count); t < g.begin + g.count; ++t) {
      keep.push_back(t);
      rows.push_back(pool_.window_row(g.seq, layer, c.ctx.positions[t]));
    }
  }
  call(c.kernel("main"), kv_plane_, Tensor::int32(rows), take_rows(c.args[0], keep));
  return {Tensor{}};
}

std::vector<Tensor> Executor::op_compress(const Call& c) {
  const json::Fields& a = c.node.attrs;
  const int64_t r = a.integer("ratio"), d = a.integer("head_dim"), layer = a.integer("layer");
  const bool overlap = a.flag("overlap");
  const std::string stream = a.string("stream");
  const Tensor &kv = c.args[0], &gate = c.args[1], &pos = c.args[4], &ape = weight(c.node.inputs[2]);
  Ring& ring = pool_.ring(layer, stream);
  const int64_t rows_per_slot = ring.shape.rows;
  const std::vector<int64_t> ring_shape{pool_.max_slots() * rows_per_slot, ring.shape.width};
  Tensor ring_kv = Tensor::borrow(ring.kv.data(), ring_shape), ring_sc = Tensor::borrow(ring.score.data(), ring_shape);
  const int64_t cur = overlap ? r : 0;
  // Sources are token indices of this step, or ring rows encoded as -(row) - 1.
  std::vector<int64_t> windows, entry_pos, entry_rows, prev_src, prev_dst, cur_src, cur_dst;
  int64_t closed_total = 0;
  for (const StepContext::Group& g : c.ctx.groups) {
    const int64_t base = pool_.request(g.seq).slot * rows_per_slot, pending = g.p0 % r;
    // Every row of this request's open windows: ring rows first, then this step's tokens.
    std::vector<int64_t> sources;
    for (int64_t j = 0; j < pending; ++j) sources.push_back(-(base + cur + j) - 1);
    for (int64_t t = g.begin; t < g.begin + g.count; ++t) sources.push_back(t);
    const int64_t closed = static_cast<int64_t>(sources.size()) / r;
    if (closed) {
      for (int64_t w = 0; w < closed; ++w) {
        if (overlap) {  // a CSA window also pools the one before it; the first takes the ring's "previous" half
          for (int64_t j = 0; j < r; ++j) windows.push_back(w ? sources[(w - 1) * r + j] : -(base + j) - 1);
        }
        windows.insert(windows.end(), sources.begin() + w * r, sources.begin() + (w + 1) * r);
      }
      if (overlap) {
        prev_src.insert(prev_src.end(), sources.begin() + (closed - 1) * r, sources.begin() + closed * r);
        for (int64_t j = 0; j < r; ++j) prev_dst.push_back(base + j);
      }
      std::vector<int64_t> numbers = arange(g.p0 / r, g.p0 / r + closed);
      for (int64_t e : numbers) entry_pos.push_back(e * r);
      std::vector<int64_t> rows = pool_.entry_rows(g.seq, layer, numbers, stream == "index");
      entry_rows.insert(entry_rows.end(), rows.begin(), rows.end());
      closed_total += closed;
    }
    // The open window: after a close its rows all come from this step and start at slot 0;
    // without a close, this step's tokens join it at their slots pos % r.
    for (int64_t t = g.begin + std::max<int64_t>(0, closed * r - pending); t < g.begin + g.count; ++t) {
      cur_src.push_back(t);
      cur_dst.push_back(base + cur + c.ctx.positions[t] % r);
    }
  }
  if (closed_total) {
    Tensor src = Tensor::int32(windows, {closed_total, overlap ? 2 * r : r});
    Tensor pooled = Tensor::zeros({closed_total, d}), normed = Tensor::zeros({closed_total, d}),
           roped = Tensor::zeros({closed_total, d});
    call(c.kernel("pool"), ring_kv, ring_sc, kv, gate, pos, ape, src, pooled);
    call(c.kernel("norm"), pooled, weight(c.node.inputs[3]), normed);
    call(c.kernel("rope"), normed.reshape({-1, 1, d}), Tensor::int32(entry_pos), inv_freq_.at("compress"),
         roped.reshape({-1, 1, d}));
    call(c.kernel("store"), stream == "index" ? index_plane_ : kv_plane_, Tensor::int32(entry_rows), roped);
  }
  // Ring update after pooling read it: the last closed window becomes the "previous" half
  // (CSA), then this step's rows of the open window go to their "current" slots.
  for (const auto& [srcs, dsts] : {std::pair{&prev_src, &prev_dst}, std::pair{&cur_src, &cur_dst}}) {
    if (!srcs->empty()) {
      call(c.kernel("ring"), ring_kv, ring_sc, kv, gate, pos, ape, Tensor::int32(*srcs), Tensor::int32(*dsts));
    }
  }
  return {Tensor{}};
}

std::vector<Tensor> Executor::op_index_score(const Call& c) {
  const int64_t layer = c.node.attrs.integer("layer"), ratio = c.node.attrs.integer("ratio");
  std::vector<int64_t> visible;  // compressed entries each token sees
  for (int64_t p : c.ctx.positions) visible.push_back((p + 1) / ratio);
  const int64_t width = visible.empty() ? 0 : std::max<int64_t>(0, *std::max_element(visible.begin(), visible.end()));
  std::vector<int64_t> rows(static_cast<size_t>(c.n * width), -1);  // index-plane rows, -1 past a token's view
  for (const StepContext::Group& g : c.ctx.groups) {
    const int64_t count = *std::max_element(visible.begin() + g.begin, visible.begin() + g.begin + g.count);
    if (!count) continue;
    std::vector<int64_t> phys = pool_.entry_rows(g.seq, layer, arange(0, count), true);
    for (int64_t t = g.begin; t < g.begin + g.count; ++t) {
      std::copy_n(phys.begin(), visible[t], rows.begin() + t * width);
    }
  }
  Tensor out = Tensor::zeros({c.n, width});
  if (width) call(c.kernel("main"), c.args[0], c.args[1], index_plane_, Tensor::int32(rows, {c.n, width}), out);
  return {out};
}

std::vector<Tensor> Executor::op_index_topk(const Call& c) {
  Tensor out = Tensor::zeros({c.n, c.node.attrs.integer("k")}, kI32);
  if (c.args[0].shape[1] == 0) {
    std::fill_n(out.ptr<int32_t>(), out.numel(), -1);
  } else {
    call(c.kernel("main"), c.args[0], out);
  }
  return {out};
}

// Per query token, the rows the sparse-attention kernel reads, as CSR (Python: attention_indices).
// Rows below total_rows are pool rows; total_rows + t is row t of this step's fresh KV. Window rows
// come first (ascending positions), then compressed rows: every visible one (HCA) or the index
// top-k, -1 skipped (CSA).
std::vector<Tensor> Executor::op_sparse_attn(const Call& c) {
  const int64_t layer = c.node.attrs.integer("layer");
  const PoolGeometry& g = pool_.geometry();
  const StepContext& ctx = c.ctx;
  auto compressed = std::find_if(g.compressed.begin(), g.compressed.end(),
                                 [&](const CompressedLayerRows& rows) { return rows.layer == layer; });
  // Compressed entries each token reads, then their physical rows, request by request (ascending ids).
  std::vector<std::vector<int64_t>> entries(static_cast<size_t>(c.n)), entry_rows(static_cast<size_t>(c.n));
  if (compressed != g.compressed.end()) {
    for (int64_t t = 0; t < c.n; ++t) {
      if (compressed->index_offset >= 0) {
        const Tensor& topk = c.args.at(6);
        const int32_t* row = topk.ptr<int32_t>() + t * topk.shape[1];
        std::copy_if(row, row + topk.shape[1], std::back_inserter(entries[t]), [](int32_t e) { return e >= 0; });
      } else {
        entries[t] = arange(0, (ctx.positions[t] + 1) / compressed->ratio);
      }
    }
    for (int64_t seq : std::set<int64_t>(ctx.seq_ids.begin(), ctx.seq_ids.end())) {
      std::vector<int64_t> all;
      for (int64_t t = 0; t < c.n; ++t) {
        if (ctx.seq_ids[t] == seq) all.insert(all.end(), entries[t].begin(), entries[t].end());
      }
      std::vector<int64_t> rows = pool_.entry_rows(seq, layer, all);
      auto next = rows.begin();
      for (int64_t t = 0; t < c.n; ++t) {
        if (ctx.seq_ids[t] != seq) continue;
        entry_rows[t].assign(next, next + static_cast<std::ptrdiff_t>(entries[t].size()));
        next += static_cast<std::ptrdiff_t>(entries[t].size());
      }
    }
  }
  std::vector<int64_t> indptr{0}, indices;
  for (int64_t t = 0; t < c.n; ++t) {
    const int64_t pos = ctx.positions[t];
    const int64_t slot_base = pool_.slot_rows(pool_.request(ctx.seq_ids[t]).slot).first;
    for (int64_t p = std::max<int64_t>(0, pos - g.window + 1); p <= pos; ++p) {
      // A position inside this step is read from the fresh KV: its token is this many rows back.
      indices.push_back(p >= ctx.step_start[t] ? pool_.total_rows() + t - (pos - p)
                                               : slot_base + layer * g.window + p % g.window);
    }
    indices.insert(indices.end(), entry_rows[t].begin(), entry_rows[t].end());
    indptr.push_back(static_cast<int64_t>(indices.size()));
  }
  Tensor out = Tensor::zeros(with_rows(c.n, c.args[0].shape));
  call(c.kernel("main"), c.args[0], kv_plane_, c.args[1], weight(c.node.inputs[2]), Tensor::int32(indptr),
       Tensor::int32(indices), out);
  return {out};
}

}  // namespace dsv4c

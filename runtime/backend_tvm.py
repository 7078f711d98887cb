"""The CPU backend: runs the step program with the compiled kernels of ``kernels.so``.

Tensors live in 64-byte aligned numpy arrays shared zero-copy with TVM (DLPack), so the
host code that builds row lists and the kernels see the same memory. Host work per step is
bookkeeping only (which rows a request owns, which windows close); all arithmetic on
activations, weights and the pool runs in the kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tvm

from dsv4c.codegen.llvm_kernels import GEMM_ROWS
from dsv4c.errors import UsageError
from dsv4c.frontend.safetensors_io import SafetensorsFile
from dsv4c.runtime.artifact import ArtifactError
from dsv4c.ir.kernels import request_groups
from dsv4c.runtime.kv_pool import KVPool, aligned_empty, aligned_zeros, attention_indices

GEMV_MAX_ROWS = 4  # steps with more tokens than this take the prefill GEMM


def _tvm(a: np.ndarray):
    return tvm.runtime.from_dlpack(a)


def _shareable(a: np.ndarray) -> np.ndarray:
    """``a`` itself when DLPack can share it (contiguous, 64-byte aligned), else an aligned copy.
    Outputs are always allocated aligned, so only read-only inputs (a slice of stacked expert
    weights of odd sizes, say) are ever copied."""
    if a.flags.c_contiguous and a.ctypes.data % 64 == 0:
        return a
    return _aligned_copy(a)


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


class TvmBackend:
    def __init__(self, artifact: Path, manifest: dict, program, pool: KVPool):
        if pool.geometry.main_storage != "fp32" or pool.geometry.index_storage != "fp32":
            raise ArtifactError(f"{artifact}: the llvm backend runs fp32 pools (exact numerics) only")
        built_for, here = manifest["kernels"]["mcpu"], tvm.target.codegen.llvm_get_system_cpu()
        if built_for != here:
            # Vector instructions of another CPU would crash the process, not raise.
            raise ArtifactError(f"{artifact}: kernels were built for CPU {built_for!r}, this host is {here!r}; "
                                "recompile the artifact on this machine")
        self.lib = tvm.runtime.load_module(str(artifact / manifest["kernels"]["library"]))
        self.per_node = manifest["kernels"]["per_node"]
        self.program, self.pool, self.cfg = program, pool, program.config
        with SafetensorsFile(artifact / "weights.safetensors") as st:
            self.weights = {n: _aligned_copy(st.read_raw(n)) for n in st.names()}
        self.weight_tensors = {n: _tvm(a) for n, a in self.weights.items()}
        cfg = self.cfg
        self.inv_freq = {"main": _aligned_copy(cfg.main_rope.inv_freq(cfg.rope_dim)),
                         "compress": _aligned_copy(cfg.compress_rope.inv_freq(cfg.rope_dim))}
        self.layers = {l.index: l for l in cfg.layers}
        self.plane = pool.planes["kv"]
        self.plane_t = _tvm(self.plane)
        self.index_t = _tvm(pool.index_plane)
        self.state_t = {key: tuple(_tvm(a.reshape(-1, a.shape[-1])) for a in pair) for key, pair in pool.state.items()}
        self.fns: dict[str, object] = {}
        self._ones: dict[int, np.ndarray] = {}

    def ones(self, dim: int) -> np.ndarray:
        """The weight argument of an unweighted rmsnorm kernel (not read by it)."""
        if dim not in self._ones:
            self._ones[dim] = _aligned_copy(np.ones(dim, np.float32))
        return self._ones[dim]

    def _fn(self, symbol: str):
        if symbol not in self.fns:
            self.fns[symbol] = self.lib[symbol]
        return self.fns[symbol]

    def _call(self, symbol: str, *args) -> None:
        self._fn(symbol)(*[a if not isinstance(a, np.ndarray) else _tvm(_shareable(a)) for a in args])

    def _w(self, v):
        return self.weights[v.name]

    def _wq(self, v) -> list[np.ndarray]:
        """A weight and, when it is quantized, its scales (in kernel argument order)."""
        scale = self.weights.get(v.name + ".scale")
        return [self.weights[v.name]] if scale is None else [self.weights[v.name], scale]

    # ------------------------------------------------------------------ step
    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray) -> np.ndarray:
        fn = self.program.functions["step"]
        n = len(tokens)
        env: dict[int, np.ndarray] = {}
        for v, arr in zip(fn.inputs, (tokens, positions, seq_ids)):
            env[id(v)] = _aligned_copy(arr.astype(np.int32))
        ctx = _StepContext(positions.astype(np.int64), seq_ids.astype(np.int64))
        for node, roles in zip(fn.nodes, self.per_node):
            args = [env.get(id(v)) if v.kind != "weight" else None for v in node.inputs]
            outs = getattr(self, "_op_" + node.op)(node, roles, args, n, ctx)
            for o, arr in zip(node.outputs, outs):
                env[id(o)] = arr
        return env[id(fn.outputs[0])]

    @staticmethod
    def _out(n: int, *shape, dtype=np.float32) -> np.ndarray:
        return aligned_empty((n,) + tuple(shape), dtype)

    # ------------------------------------------------------------------ ops
    def _op_embed(self, node, roles, args, n, ctx):
        out = self._out(n, node.inputs[1].type.shape[1])
        self._call(roles["main"], args[0], self._w(node.inputs[1]), out)
        return [out]

    def _op_hc_expand(self, node, roles, args, n, ctx):
        out = self._out(n, *node.outputs[0].type.shape[1:])
        self._call(roles["main"], args[0], out)
        return [out]

    def _op_mhc_pre(self, node, roles, args, n, ctx):
        h = args[0]
        y, post, comb = self._out(n, h.shape[2]), self._out(n, h.shape[1]), self._out(n, h.shape[1], h.shape[1])
        self._call(roles["main"], h, *(self._w(v) for v in node.inputs[1:4]), y, post, comb)
        return [y, post, comb]

    def _op_hc_head(self, node, roles, args, n, ctx):
        y = self._out(n, args[0].shape[2])
        self._call(roles["main"], args[0], *(self._w(v) for v in node.inputs[1:4]), y)
        return [y]

    def _op_mhc_seam(self, node, roles, args, n, ctx):
        h = args[1]
        outs = [aligned_empty(h.shape, np.float32), self._out(n, h.shape[2]), self._out(n, h.shape[1]),
                self._out(n, h.shape[1], h.shape[1])]
        self._call(roles["main"], *args[:4], *(self._w(v) for v in node.inputs[4:7]), *outs)
        return outs

    def _op_mhc_post_head(self, node, roles, args, n, ctx):
        h = args[1]
        outs = [aligned_empty(h.shape, np.float32), self._out(n, h.shape[2])]
        self._call(roles["main"], *args[:4], *(self._w(v) for v in node.inputs[4:7]), *outs)
        return outs

    def _op_mhc_post(self, node, roles, args, n, ctx):
        out = self._out(n, *args[1].shape[1:])
        self._call(roles["main"], args[0], args[1], args[2], args[3], out)
        return [out]

    def _op_rmsnorm(self, node, roles, args, n, ctx):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        out = aligned_empty(x.shape, np.float32)
        w = self._w(node.inputs[1]) if len(node.inputs) == 2 else self.ones(x.shape[-1])
        self._call(roles["main"], flat, w, out.reshape(flat.shape))
        return [out]

    def _matmul(self, roles, prefix: str, x: np.ndarray, w: list[np.ndarray]) -> np.ndarray:
        """y = x @ W.T through the GEMV kernel for decode-sized steps, else the 8-row-block GEMM.
        ``w`` is the tiled weight [out / tile, in, tile] and, when quantized, its scales."""
        rows = x.shape[0]
        out_dim = w[0].shape[0] * w[0].shape[2]
        if rows <= GEMV_MAX_ROWS:
            y = aligned_empty((rows, out_dim), np.float32)
            self._call(roles[prefix + "gemv"], x, *w, y)
            return y
        blocks = -(-rows // GEMM_ROWS)
        padded = aligned_zeros((blocks * GEMM_ROWS, x.shape[1]), np.float32)
        padded[:rows] = x
        y = aligned_empty((blocks * GEMM_ROWS, out_dim), np.float32)
        self._call(roles[prefix + "gemm"], padded.reshape(blocks, GEMM_ROWS, -1), *w,
                   y.reshape(blocks, GEMM_ROWS, out_dim))
        return y[:rows]

    def _op_linear(self, node, roles, args, n, ctx):
        x = args[0]
        y = self._matmul(roles, "", x.reshape(-1, x.shape[-1]), self._wq(node.inputs[1]))
        return [y.reshape(x.shape[:-1] + (y.shape[-1],))]

    _op_lm_head = _op_linear

    def _op_linear_split(self, node, roles, args, n, ctx):
        (y,) = self._op_linear(node, roles, args, n, ctx)
        bounds = np.cumsum(node.attrs["sizes"])[:-1]
        return [_aligned_copy(part) for part in np.split(y, bounds, axis=-1)]

    def _op_reshape(self, node, roles, args, n, ctx):
        return [args[0].reshape((n,) + tuple(node.attrs["shape"][1:]))]

    def _op_add(self, node, roles, args, n, ctx):
        out = aligned_empty(args[0].shape, np.float32)
        self._call(roles["main"], args[0].reshape(n, -1), args[1].reshape(n, -1), out.reshape(n, -1))
        return [out]

    def _op_rope(self, node, roles, args, n, ctx):
        x = args[0]
        out = aligned_empty(x.shape, np.float32)
        heads = x.shape[1] if x.ndim == 3 else 1
        self._call(roles["main"], x.reshape(n, heads, x.shape[-1]), args[1], self.inv_freq[node.attrs["rope"]],
                   out.reshape(n, heads, x.shape[-1]))
        return [out]

    def _op_rmsnorm_rope(self, node, roles, args, n, ctx):
        x = args[0]
        heads = x.shape[1] if x.ndim == 3 else 1
        w = self._w(node.inputs[1]) if len(node.inputs) == 3 else self.ones(x.shape[-1])
        out = aligned_empty(x.shape, np.float32)
        self._call(roles["main"], x.reshape(n, heads, x.shape[-1]), w, args[-1], self.inv_freq[node.attrs["rope"]],
                   out.reshape(n, heads, x.shape[-1]))
        return [out]

    def _op_grouped_linear(self, node, roles, args, n, ctx):
        x = args[0]
        w = self._wq(node.inputs[1])  # [G, rank / tile, in, tile] (+ scales)
        outs = [self._matmul(roles, "", x[:, g], [a[g] for a in w]) for g in range(x.shape[1])]
        return [_aligned_copy(np.stack(outs, axis=1))]

    def _op_moe_route(self, node, roles, args, n, ctx):
        k = node.attrs["k"]
        logits = self._matmul(roles, "gate_", args[0], self._wq(node.inputs[1]))
        scores = self._out(n, logits.shape[1])
        self._call(roles["scores"], logits, scores)
        ids = self._out(n, k, dtype=np.int32)
        if node.attrs["mode"] == "hash":
            self._call(roles["select"], self._w(node.inputs[2]), args[3], ids)
        else:
            biased = self._out(n, logits.shape[1])
            self._call(roles["bias"], scores, self._w(node.inputs[2]), biased)
            self._call(roles["select"], biased, ids)
        weights = self._out(n, k)
        self._call(roles["weights"], scores, ids, weights)
        return [weights, ids]

    def _op_experts(self, node, roles, args, n, ctx):
        y, route_w, ids = args[:3]
        w1, w2, w3 = (self._wq(v) for v in node.inputs[3:])
        out = aligned_zeros((n, y.shape[1]), np.float32)
        for e in np.unique(ids):  # ascending expert ids, as the reference adds them
            tokens, slots = np.nonzero(ids == e)
            x = y[tokens]
            gate = self._matmul(roles, "up_", x, [a[e] for a in w1])
            up = self._matmul(roles, "up_", x, [a[e] for a in w3])
            act = self._out(len(tokens), gate.shape[1])
            self._call(roles["act"], gate, up, act)
            down = self._matmul(roles, "down_", act, [a[e] for a in w2])
            self._call(roles["combine"], out, _aligned_copy(tokens.astype(np.int32)),
                       _aligned_copy(route_w[tokens, slots]), _aligned_copy(down))
        return [out]

    def _op_shared_expert(self, node, roles, args, n, ctx):
        gate = self._matmul(roles, "up_", args[0], self._wq(node.inputs[1]))
        up = self._matmul(roles, "up_", args[0], self._wq(node.inputs[3]))
        act = self._out(n, gate.shape[1])
        self._call(roles["act"], gate, up, act)
        return [self._matmul(roles, "down_", act, self._wq(node.inputs[2]))]

    # ------------------------------------------------------------------ KV state
    def _op_kv_write(self, node, roles, args, n, ctx):
        layer, window = node.attrs["layer"], node.attrs["window"]
        keep = np.concatenate([idx[-window:] for _, idx, _ in ctx.groups])
        rows = np.concatenate([self.pool.window_row(seq, layer, ctx.positions[idx[-window:]])
                               for seq, idx, _ in ctx.groups]).astype(np.int32)
        self._call(roles["main"], self.plane, _aligned_copy(rows), _aligned_copy(args[0][keep]))
        return [None]

    def _op_compress(self, node, roles, args, n, ctx):
        a = node.attrs
        r, overlap, d = a["ratio"], a["overlap"], a["head_dim"]
        layer, stream = a["layer"], a["stream"]
        kv, gate, pos = args[0], args[1], args[4]
        ape = self._w(node.inputs[2])
        ring_kv, ring_sc = self.state_t[(layer, stream)]
        rows_per_slot = self.pool.state[(layer, stream)][0].shape[1]
        cur = r if overlap else 0
        windows, entry_pos, entry_rows, prev_src, prev_dst, cur_src, cur_dst = [], [], [], [], [], [], []
        for seq, idx, p0 in ctx.groups:
            base = self.pool.requests[seq].slot * rows_per_slot
            pending = p0 % r
            # Every row of this request's open windows: ring rows first, then this step's tokens.
            sources = np.concatenate([-(base + cur + np.arange(pending)) - 1, idx]).astype(np.int64)
            closed = len(sources) // r
            if closed:
                win = sources[:closed * r].reshape(closed, r)
                if overlap:
                    prev = np.concatenate([(-(base + np.arange(r)) - 1)[None], win[:-1]])
                    win = np.concatenate([prev, win], axis=1)
                    prev_src.append(sources[(closed - 1) * r:closed * r])
                    prev_dst.append(base + np.arange(r))
                windows.append(win)
                first = p0 // r
                numbers = np.arange(first, first + closed)
                entry_pos.append(numbers * r)
                entry_rows.append(self.pool.entry_rows(seq, layer, numbers, index=stream == "index"))
            # The open window: after a close its rows all come from this step and start at slot 0;
            # without a close, this step's tokens join it at their slots pos % r.
            rest = idx[max(0, closed * r - pending):]
            cur_src.append(rest)
            cur_dst.append(base + cur + ctx.positions[rest] % r)
        if windows:
            src = _aligned_copy(np.concatenate(windows).astype(np.int32))
            pooled = self._out(len(src), d)
            self._call(roles["pool"], ring_kv, ring_sc, kv, gate, pos, ape, src, pooled)
            normed = self._out(len(src), d)
            self._call(roles["norm"], pooled, self._w(node.inputs[3]), normed)
            roped = self._out(len(src), d)
            self._call(roles["rope"], normed.reshape(-1, 1, d), _aligned_copy(np.concatenate(entry_pos).astype(np.int32)),
                       self.inv_freq["compress"], roped.reshape(-1, 1, d))
            plane = self.index_t if stream == "index" else self.plane_t
            self._call(roles["store"], plane, _aligned_copy(np.concatenate(entry_rows).astype(np.int32)), roped)
        # Ring update after pooling read it: the last closed window becomes the "previous" half
        # (CSA), then this step's rows of the open window go to their "current" slots.
        for srcs, dsts in ((prev_src, prev_dst), (cur_src, cur_dst)):
            if srcs and sum(len(x) for x in srcs):
                self._call(roles["ring"], ring_kv, ring_sc, kv, gate, pos, ape,
                           _aligned_copy(np.concatenate(srcs).astype(np.int32)),
                           _aligned_copy(np.concatenate(dsts).astype(np.int32)))
        return [None]

    def _op_index_score(self, node, roles, args, n, ctx):
        layer, ratio = node.attrs["layer"], node.attrs["ratio"]
        visible = (ctx.positions + 1) // ratio
        width = int(visible.max(initial=0))
        rows = np.full((n, width), -1, np.int32)
        for seq, idx, _ in ctx.groups:
            count = int(visible[idx].max())
            if count:
                phys = self.pool.entry_rows(seq, layer, np.arange(count), index=True)
                block = np.broadcast_to(phys, (len(idx), count)).copy()
                block[np.arange(count)[None, :] >= visible[idx][:, None]] = -1
                rows[idx, :count] = block
        out = self._out(n, width)
        if width:
            self._call(roles["main"], args[0], args[1], self.index_t, _aligned_copy(rows), out)
        return [out]

    def _op_index_topk(self, node, roles, args, n, ctx):
        out = self._out(n, node.attrs["k"], dtype=np.int32)
        if args[0].shape[1] == 0:
            out[...] = -1
        else:
            self._call(roles["main"], args[0], out)
        return [out]

    def _op_sparse_attn(self, node, roles, args, n, ctx):
        layer = self.layers[node.attrs["layer"]]
        topk = args[6] if len(args) > 6 else None
        indptr, indices = attention_indices(self.pool, layer, ctx.seq_ids, ctx.positions, ctx.step_start, topk)
        out = self._out(n, *args[0].shape[1:])
        self._call(roles["main"], args[0], self.plane, args[1], self._w(node.inputs[2]), _aligned_copy(indptr),
                   _aligned_copy(indices), out)
        return [out]


class _StepContext:
    """Per-step bookkeeping shared by the stateful ops: each request's token indices and first position."""

    def __init__(self, positions: np.ndarray, seq_ids: np.ndarray):
        self.positions, self.seq_ids = positions, seq_ids
        self.groups = list(request_groups(positions, seq_ids))
        self.step_start = np.empty_like(positions)
        for seq, idx, first in self.groups:
            # CSR rows of this step's fresh KV are addressed by offset from the query token.
            if np.any(np.diff(idx) != 1):
                raise UsageError(f"request {seq}: its tokens must be contiguous in the step")
            self.step_start[idx] = first

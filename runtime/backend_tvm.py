"""The TVM backend: runs the step program with the compiled kernels of ``kernels.so`` on one
device (the CPU for llvm artifacts, a GPU for sm90 / gfx942 / gfx950 artifacts).

Activations, weights and the KV pool are TVM tensors on that device; the host only does
bookkeeping (which rows a request owns, which windows close), uploads those small index
arrays, and reads back what it must decide on (routed expert ids, the final logits). Every
rearrangement of activations is a kernel (``movement_kernels``), so the CPU runs exactly the
executor a GPU runs. On the CPU the pool planes are the :class:`KVPool`'s numpy arrays, shared
zero-copy through DLPack.
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
from dsv4c.runtime.kv_pool import KVPool, aligned_empty, attention_indices

GEMV_MAX_ROWS = 4  # steps with more tokens than this take the prefill GEMM
_PLANE_ORDER = ("kv", "nope", "rope")  # main pool planes in kernel argument order


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def _view(t, shape) -> tvm.runtime.Tensor:
    """The same memory under another shape (a prefix when smaller): no copy."""
    return t._create_view(tuple(int(s) for s in shape))


class TvmBackend:
    def __init__(self, artifact: Path, manifest: dict, program, pool: KVPool, device=None):
        self.device = device or tvm.cpu(0)
        self.on_host = self.device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type()
        if self.on_host:
            built_for, here = manifest["kernels"]["mcpu"], tvm.target.codegen.llvm_get_system_cpu()
            if built_for != here:
                # Vector instructions of another CPU would crash the process, not raise.
                raise ArtifactError(f"{artifact}: kernels were built for CPU {built_for!r}, this host is {here!r}; "
                                    "recompile the artifact on this machine")
        self.lib = tvm.runtime.load_module(str(artifact / manifest["kernels"]["library"]))
        self.per_node = manifest["kernels"]["per_node"]
        self.program, self.pool, self.cfg = program, pool, program.config
        # Stacked weights (routed experts, head groups) are held one tensor per index: kernels
        # take tensors that start at their allocation, not views into one.
        stacked = {v.name for node in program.functions["step"].nodes if node.op in ("experts", "grouped_linear")
                   for v in node.inputs if v.kind == "weight"}
        self.weights: dict[str, tvm.runtime.Tensor] = {}
        self.parts: dict[str, list[tvm.runtime.Tensor]] = {}
        with SafetensorsFile(artifact / "weights.safetensors") as st:
            for name in st.names():
                raw = st.read_raw(name)
                if name.removesuffix(".scale") in stacked:
                    self.parts[name] = [self.upload(part) for part in raw]
                else:
                    self.weights[name] = self.upload(raw)
        cfg = self.cfg
        self.inv_freq = {"main": self.upload(cfg.main_rope.inv_freq(cfg.rope_dim)),
                         "compress": self.upload(cfg.compress_rope.inv_freq(cfg.rope_dim))}
        self.layers = {l.index: l for l in cfg.layers}
        # The main planes in kernel argument order: (kv,) for fp32 rows, (nope, rope) for fp8.
        self.main_planes = tuple(self.pool_tensor(pool.planes[k]) for k in sorted(pool.planes, key=_PLANE_ORDER.index))
        self.index_plane = self.pool_tensor(pool.index_plane)
        self.state_t = {key: tuple(self.pool_tensor(a.reshape(-1, a.shape[-1])) for a in pair)
                        for key, pair in pool.state.items()}
        self.fns: dict[str, object] = {}
        self._ones: dict[int, object] = {}

    # ------------------------------------------------------------------ memory
    def upload(self, a: np.ndarray) -> tvm.runtime.Tensor:
        """A host array as a tensor on the device (zero-copy on the CPU when DLPack can share it)."""
        a = np.asarray(a)
        if self.on_host:
            if not (a.flags.c_contiguous and a.ctypes.data % 64 == 0):
                a = _aligned_copy(a)
            return tvm.runtime.from_dlpack(a)
        return tvm.runtime.tensor(np.ascontiguousarray(a), self.device)

    def pool_tensor(self, a: np.ndarray) -> tvm.runtime.Tensor:
        """A pool plane on the device: the KVPool's own array on the CPU, a device copy otherwise."""
        return tvm.runtime.from_dlpack(a) if self.on_host else tvm.runtime.tensor(a, self.device)

    def empty(self, shape, dtype: str = "float32") -> tvm.runtime.Tensor:
        return tvm.runtime.empty(tuple(int(s) for s in shape), dtype, self.device)

    def ones(self, dim: int):
        """The weight argument of an unweighted rmsnorm kernel (not read by it)."""
        if dim not in self._ones:
            self._ones[dim] = self.upload(np.ones(dim, np.float32))
        return self._ones[dim]

    def _fn(self, symbol: str):
        if symbol not in self.fns:
            self.fns[symbol] = self.lib[symbol]
        return self.fns[symbol]

    def _call(self, symbol: str, *args) -> None:
        """Run a kernel; host arrays among the arguments (row lists, indices) are uploaded first."""
        self._fn(symbol)(*[self.upload(a) if isinstance(a, np.ndarray) else a for a in args])

    def _w(self, v):
        return self.weights[v.name]

    def _wq(self, v) -> list:
        """A weight and, when it is quantized, its scales (in kernel argument order)."""
        scale = self.weights.get(v.name + ".scale")
        return [self.weights[v.name]] if scale is None else [self.weights[v.name], scale]

    def _wq_part(self, v, i: int) -> list:
        """Expert / group ``i`` of a stacked weight (and its scales)."""
        scale = self.parts.get(v.name + ".scale")
        return [self.parts[v.name][i]] if scale is None else [self.parts[v.name][i], scale[i]]

    def gather(self, x, idx: np.ndarray):
        """Rows ``idx`` of ``x`` (zeros where idx < 0) as a new tensor."""
        out = self.empty((len(idx), x.shape[1]))
        self._call("gather_rows", x, idx.astype(np.int32), out)
        return out

    def columns(self, x, start: int, width: int):
        """Columns [start, start + width) of a 2-d tensor as a new tensor."""
        out = self.empty((x.shape[0], width))
        self._call("copy_columns", x, start, out, 0, width)
        return out

    # ------------------------------------------------------------------ step
    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray) -> np.ndarray:
        fn = self.program.functions["step"]
        n = len(tokens)
        env: dict[int, object] = {}
        for v, arr in zip(fn.inputs, (tokens, positions, seq_ids)):
            env[id(v)] = self.upload(np.asarray(arr, np.int32))
        ctx = _StepContext(positions.astype(np.int64), seq_ids.astype(np.int64))
        for node, roles in zip(fn.nodes, self.per_node):
            args = [env.get(id(v)) if v.kind != "weight" else None for v in node.inputs]
            outs = getattr(self, "_op_" + node.op)(node, roles, args, n, ctx)
            for o, arr in zip(node.outputs, outs):
                env[id(o)] = arr
        return env[id(fn.outputs[0])].numpy()

    def _out(self, n: int, *shape, dtype: str = "float32"):
        return self.empty((n,) + tuple(shape), dtype)

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
        outs = [self.empty(h.shape), self._out(n, h.shape[2]), self._out(n, h.shape[1]),
                self._out(n, h.shape[1], h.shape[1])]
        self._call(roles["main"], *args[:4], *(self._w(v) for v in node.inputs[4:7]), *outs)
        return outs

    def _op_mhc_post_head(self, node, roles, args, n, ctx):
        h = args[1]
        outs = [self.empty(h.shape), self._out(n, h.shape[2])]
        self._call(roles["main"], *args[:4], *(self._w(v) for v in node.inputs[4:7]), *outs)
        return outs

    def _op_mhc_post(self, node, roles, args, n, ctx):
        out = self._out(n, *args[1].shape[1:])
        self._call(roles["main"], args[0], args[1], args[2], args[3], out)
        return [out]

    def _op_rmsnorm(self, node, roles, args, n, ctx):
        x = args[0]
        flat = (int(np.prod(x.shape[:-1])), x.shape[-1])
        out = self.empty(x.shape)
        w = self._w(node.inputs[1]) if len(node.inputs) == 2 else self.ones(x.shape[-1])
        self._call(roles["main"], _view(x, flat), w, _view(out, flat))
        return [out]

    def _matmul(self, roles, prefix: str, x, w: list):
        """y = x @ W.T through the GEMV kernel for decode-sized steps, else the 8-row-block GEMM.
        ``w`` is the tiled weight [out / tile, in, tile] and, when quantized, its scales."""
        rows = x.shape[0]
        out_dim = w[0].shape[0] * w[0].shape[2]
        if rows <= GEMV_MAX_ROWS:
            y = self.empty((rows, out_dim))
            self._call(roles[prefix + "gemv"], x, *w, y)
            return y
        blocks = -(-rows // GEMM_ROWS)
        padded = self.gather(x, np.concatenate([np.arange(rows), np.full(blocks * GEMM_ROWS - rows, -1)]))
        y = self.empty((blocks * GEMM_ROWS, out_dim))
        self._call(roles[prefix + "gemm"], _view(padded, (blocks, GEMM_ROWS, x.shape[1])), *w,
                   _view(y, (blocks, GEMM_ROWS, out_dim)))
        return _view(y, (rows, out_dim))

    def _op_linear(self, node, roles, args, n, ctx):
        x = args[0]
        y = self._matmul(roles, "", _view(x, (int(np.prod(x.shape[:-1])), x.shape[-1])), self._wq(node.inputs[1]))
        return [_view(y, tuple(x.shape[:-1]) + (y.shape[-1],))]

    _op_lm_head = _op_linear

    def _op_linear_split(self, node, roles, args, n, ctx):
        (y,) = self._op_linear(node, roles, args, n, ctx)
        starts = np.concatenate([[0], np.cumsum(node.attrs["sizes"])[:-1]])
        flat = _view(y, (n, y.shape[-1]))
        return [_view(self.columns(flat, int(s), size), (n,) + tuple(o.type.shape[1:]))
                for s, size, o in zip(starts, node.attrs["sizes"], node.outputs)]

    def _op_reshape(self, node, roles, args, n, ctx):
        return [_view(args[0], (n,) + tuple(node.attrs["shape"][1:]))]

    def _op_add(self, node, roles, args, n, ctx):
        out = self.empty(args[0].shape)
        flat = (n, int(np.prod(args[0].shape[1:])))
        self._call(roles["main"], _view(args[0], flat), _view(args[1], flat), _view(out, flat))
        return [out]

    def _rope_call(self, symbol, x, *rest):
        heads = x.shape[1] if len(x.shape) == 3 else 1
        shape = (x.shape[0], heads, x.shape[-1])
        out = self.empty(x.shape)
        self._call(symbol, _view(x, shape), *rest, _view(out, shape))
        return out

    def _op_rope(self, node, roles, args, n, ctx):
        return [self._rope_call(roles["main"], args[0], args[1], self.inv_freq[node.attrs["rope"]])]

    def _op_rmsnorm_rope(self, node, roles, args, n, ctx):
        x = args[0]
        w = self._w(node.inputs[1]) if len(node.inputs) == 3 else self.ones(x.shape[-1])
        return [self._rope_call(roles["main"], x, w, args[-1], self.inv_freq[node.attrs["rope"]])]

    def _op_grouped_linear(self, node, roles, args, n, ctx):
        x = args[0]  # [n, G, in]: group g's inputs are columns [g * in, (g + 1) * in)
        groups, width = x.shape[1], x.shape[2]
        flat = _view(x, (n, groups * width))
        tile = self._wq_part(node.inputs[1], 0)[0]  # [rank / t, in, t]
        rank = tile.shape[0] * tile.shape[2]
        out = self.empty((n, groups, rank))
        out_flat = _view(out, (n, groups * rank))
        for g in range(groups):
            y = self._matmul(roles, "", self.columns(flat, g * width, width), self._wq_part(node.inputs[1], g))
            self._call("copy_columns", y, 0, out_flat, g * rank, rank)
        return [out]

    def _op_moe_route(self, node, roles, args, n, ctx):
        k = node.attrs["k"]
        logits = self._matmul(roles, "gate_", args[0], self._wq(node.inputs[1]))
        scores = self._out(n, logits.shape[1])
        self._call(roles["scores"], logits, scores)
        ids = self._out(n, k, dtype="int32")
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
        y, route_w, ids_t = args[:3]
        w1, w2, w3 = node.inputs[3:]
        ids = ids_t.numpy()  # the host decides which experts run: one read-back per MoE layer
        k = ids.shape[1]
        out = self.gather(y, np.full(n, -1))  # zeros
        flat_w = _view(route_w, (n * k, 1))
        for e in np.unique(ids):  # ascending expert ids, as the reference adds them
            tokens, slots = np.nonzero(ids == e)
            x = self.gather(y, tokens)
            gate = self._matmul(roles, "up_", x, self._wq_part(w1, e))
            up = self._matmul(roles, "up_", x, self._wq_part(w3, e))
            act = self._out(len(tokens), gate.shape[1])
            self._call(roles["act"], gate, up, act)
            down = self._matmul(roles, "down_", act, self._wq_part(w2, e))
            weight = self.gather(flat_w, tokens * k + slots)
            self._call(roles["combine"], out, tokens.astype(np.int32), _view(weight, (len(tokens),)), down)
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
        self._call(roles["main"], *self.main_planes, rows, self.gather(args[0], keep))
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
            src = np.concatenate(windows).astype(np.int32)
            pooled = self._out(len(src), d)
            self._call(roles["pool"], ring_kv, ring_sc, kv, gate, pos, ape, src, pooled)
            normed = self._out(len(src), d)
            self._call(roles["norm"], pooled, self._w(node.inputs[3]), normed)
            roped = self._out(len(src), d)
            self._call(roles["rope"], _view(normed, (len(src), 1, d)), np.concatenate(entry_pos).astype(np.int32),
                       self.inv_freq["compress"], _view(roped, (len(src), 1, d)))
            planes = (self.index_plane,) if stream == "index" else self.main_planes
            self._call(roles["store"], *planes, np.concatenate(entry_rows).astype(np.int32), roped)
        # Ring update after pooling read it: the last closed window becomes the "previous" half
        # (CSA), then this step's rows of the open window go to their "current" slots.
        for srcs, dsts in ((prev_src, prev_dst), (cur_src, cur_dst)):
            if srcs and sum(len(x) for x in srcs):
                self._call(roles["ring"], ring_kv, ring_sc, kv, gate, pos, ape,
                           np.concatenate(srcs).astype(np.int32), np.concatenate(dsts).astype(np.int32))
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
            self._call(roles["main"], args[0], args[1], self.index_plane, rows, out)
        return [out]

    def _op_index_topk(self, node, roles, args, n, ctx):
        if args[0].shape[1] == 0:  # no compressed entry visible yet
            return [self.upload(np.full((n, node.attrs["k"]), -1, np.int32))]
        out = self._out(n, node.attrs["k"], dtype="int32")
        self._call(roles["main"], args[0], out)
        return [out]

    def _op_sparse_attn(self, node, roles, args, n, ctx):
        layer = self.layers[node.attrs["layer"]]
        # The selected entries decide which rows each query reads: read back (one per CSA layer).
        topk = args[6].numpy() if len(args) > 6 else None
        indptr, indices = attention_indices(self.pool, layer, ctx.seq_ids, ctx.positions, ctx.step_start, topk)
        out = self._out(n, *args[0].shape[1:])
        self._call(roles["main"], args[0], *self.main_planes, args[1], self._w(node.inputs[2]), indptr, indices, out)
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

"""The attention ops and the KV pool they read and write: ``kv_write`` (window rows),
``compress`` (compressor rings into compressed entries), ``index_score`` / ``index_topk``
(CSA's indexer) and ``sparse_attn``. Pool planes and rings are updated in place
(``call_inplace``); bookkeeping kernels (``step_kernels``) turn the step's per-request tables
into pool rows on the device."""

from __future__ import annotations

from tvm import relax, tirx

from dsv4c.codegen.kernels.attention import ATTN_PREFILL_HEAD_BLOCK
from dsv4c.codegen.ops.base import F32, I32, OpLowering, input_shapes, kernel
from dsv4c.codegen.ops.norm import rope_call, rope_table

# The pool rows' byte format is the same for the store kernels that write them and the kernels
# that read them: storage, and for low-bit rows the FP8 encoding and the index layout / rope width.


def index_row_format(plan) -> tuple:
    storage = plan.index_kv.storage
    return (storage,) if storage == "fp32" else (storage, plan.fp8_format, plan.index_kv.layout)


def main_row_format(cfg, plan) -> tuple:
    storage = plan.main_kv.storage
    return (storage,) if storage == "fp32" else (storage, cfg.rope_dim, plan.fp8_format)


def store_kernel(cfg, plan, stream: str, width: int):
    """The kernel that writes rows of ``width`` values into the ``stream`` (main / index) pool."""
    if stream == "index":
        return kernel("store_rows", width, *index_row_format(plan))
    if plan.main_kv.storage == "fp32":
        return kernel("store_rows", width, "fp32")
    return kernel("store_main_fp8", width - cfg.rope_dim, cfg.rope_dim, plan.fp8_format)


def _i64(value: int):
    return relax.prim_value(tirx.IntImm("int64", int(value)))


def main_planes(em) -> list[str]:
    return [p.name for p in em.pool_layout if p.rows == "main"]


def store_pool_rows(em, store, planes: list[str], rows, values) -> None:
    new = em.call_inplace(store, [em.pool[p] for p in planes] + [rows, values], list(range(len(planes))))
    for p, v in zip(planes, new):
        em.pool[p] = v


def pool_envelope(em, layer: int, index: bool) -> tuple:
    """(rows per envelope, offset of this layer's rows) of the main or the index pool."""
    g = em.geometry
    rows = g.rows_of(layer)
    if index:
        return _i64(g.index_rows_per_envelope), _i64(rows.index_offset)
    return _i64(g.rows_per_envelope), _i64(rows.offset)


class KvWrite(OpLowering):
    def kernels(self, node, cfg, plan):
        return {"rows": kernel("window_rows", cfg.sliding_window, cfg.window_rows_per_request),
                "store": store_kernel(cfg, plan, "main", input_shapes(node)[0][1])}

    def emit(self, em, node, roles, args):
        i = em.inputs
        rows = em.call(roles["rows"], [i["positions"], i["token_request"], i["requests"],
                                       _i64(node.attrs["layer"]), relax.prim_value(em.pool_rows)], ([em.t], I32))
        store_pool_rows(em, roles["store"], main_planes(em), rows, args[0])
        return [None]


class Compress(OpLowering):
    """Each window a step closes pooled from the compressor's ring and the step's rows, normed,
    roped and stored as one compressed entry; then the ring takes the step's rows."""

    def kernels(self, node, cfg, plan):
        a = node.attrs
        width, d, r = input_shapes(node)[0][1], a["head_dim"], a["ratio"]
        return {"reset": kernel("ring_reset", width, 2 * r if a["overlap"] else r),
                "windows": kernel("compress_windows", r, a["overlap"]),
                "pool": kernel("compress_pool", width, d, r, a["overlap"]),
                "norm": kernel("rmsnorm", d, a["eps"], True), "rope": kernel("rope", 1, d, a["rope_dim"], False),
                "store": store_kernel(cfg, plan, a["stream"], d), "ring": kernel("ring_update", width, r, a["overlap"])}

    def emit(self, em, node, roles, args):
        a, i = node.attrs, em.inputs
        ratio, d, stream = a["ratio"], a["head_dim"], a["stream"]
        kv, gate = args[0], args[1]
        slots = 2 * ratio if a["overlap"] else ratio
        windows = em.r + tirx.floordiv(em.t, ratio)  # closes at most one more window than T / ratio
        envelope = pool_envelope(em, a["layer"], stream == "index")
        win = em.call(roles["windows"], [i["requests"], i["block_table"], *envelope],
                      [([windows, slots], I32), ([windows], I32), ([windows], I32)])
        src, entry_pos, entry_rows = em.outputs(win, 3)
        ring = [f"state.{a['layer']}.{stream}.kv", f"state.{a['layer']}.{stream}.score"]
        em.pool[ring[0]], em.pool[ring[1]] = em.call_inplace(
            roles["reset"], [em.pool[ring[0]], em.pool[ring[1]], i["requests"]], [0, 1])
        ape = em.param(node.inputs[2].name)
        pooled = em.call(roles["pool"], [em.pool[ring[0]], em.pool[ring[1]], kv, gate, i["positions"], ape, src,
                                         entry_rows], ([windows, d], F32))
        normed = em.call(roles["norm"], [pooled, em.param(node.inputs[3].name)], ([windows, d], F32))
        roped = rope_call(em, roles["rope"], normed, entry_pos, rope_table(em, "compress"))
        store_pool_rows(em, roles["store"], ["index"] if stream == "index" else main_planes(em), entry_rows, roped)
        # The ring changes after pooling read it (bindings run in program order).
        new = em.call_inplace(roles["ring"], [em.pool[ring[0]], em.pool[ring[1]], kv, gate, i["positions"], ape,
                                              i["requests"]], [0, 1])
        em.pool[ring[0]], em.pool[ring[1]] = new
        return [None]


class IndexScore(OpLowering):
    def kernels(self, node, cfg, plan):
        x = input_shapes(node)[0]
        return {"rows": kernel("entry_rows", node.attrs["ratio"]),
                "main": kernel("index_score", x[1], x[2], *index_row_format(plan))}

    def emit(self, em, node, roles, args):
        i, extent = em.inputs, em.entries[node.attrs["ratio"]]
        rows = em.call(roles["rows"], [i["positions"], i["token_request"], i["block_table"],
                                       *pool_envelope(em, node.attrs["layer"], True)], ([em.t, extent], I32))
        return [em.call(roles["main"], [args[0], args[1], em.pool["index"], rows], ([em.t, extent], F32))]


class IndexTopk(OpLowering):
    def kernels(self, node, cfg, plan):
        return {"main": kernel("topk_rows", node.attrs["k"])}

    def emit(self, em, node, roles, args):
        return [em.call(roles["main"], [args[0]], ([em.t, node.attrs["k"]], I32))]


class SparseAttn(OpLowering):
    """Each query over its row list: the window, plus all HCA entries or the CSA top-k; or, for a
    DSpark draft block (kind ``block``), its request's window ring before the block and the
    whole block (``step_kernels.block_attention_rows``)."""

    def kernels(self, node, cfg, plan):
        a, q = node.attrs, input_shapes(node)[0]
        main_format = main_row_format(cfg, plan)
        # Prefill takes wider blocks of heads on the CPU (GPU builds block the heads their own
        # way either way, kernels.gpu_attention: the same code under two symbols).
        if a["kind"] == "block":
            rows = kernel("block_attention_rows", cfg.sliding_window, cfg.window_rows_per_request)
        else:
            compressed = {"sliding": "none", "hca": "all", "csa": "topk"}[a["kind"]]
            rows = kernel("attention_rows", cfg.sliding_window, cfg.window_rows_per_request, a["ratio"], compressed)
        return {"rows": rows,
                "main": kernel("sparse_attn", q[1], q[2], a["scale"], *main_format),
                "prefill": kernel("sparse_attn", q[1], q[2], a["scale"], plan.main_kv.storage,
                                  *(main_format[1:] or (0, None)), ATTN_PREFILL_HEAD_BLOCK)}

    def emit(self, em, node, roles, args):
        a, i = node.attrs, em.inputs
        window = em.cfg.sliding_window
        common = [i["positions"], i["token_request"], i["requests"]]
        layer = [_i64(a["layer"]), relax.prim_value(em.pool_rows)]
        if a["kind"] == "block":
            rows = em.call(roles["rows"], common[1:] + layer, ([em.t, window + em.t], I32))
        elif a["kind"] == "sliding":
            rows = em.call(roles["rows"], common + layer, ([em.t, window], I32))
        elif a["kind"] == "hca":
            rows = em.call(roles["rows"], common + [i["block_table"]] + layer + [*pool_envelope(em, a["layer"], False)],
                           ([em.t, window + em.entries[a["ratio"]]], I32))
        else:
            topk = args[6]
            rows = em.call(roles["rows"], common + [i["block_table"], topk] + layer +
                           [*pool_envelope(em, a["layer"], False)], ([em.t, window + em.shape(topk)[1]], I32))
        planes = [em.pool[p] for p in main_planes(em)]
        attend = roles["main" if em.gemv else "prefill"]  # prefill: wider blocks of heads
        out = em.call(attend, [args[0]] + planes + [args[1], em.param(node.inputs[2].name), rows],
                      (em.shape(args[0]), F32))
        return [out]

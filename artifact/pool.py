"""The KV pool's geometry: every number of the one row space, computed once from the layer
schedule (``LayerSpec`` roles), never from a layer kind.

* **Envelopes** hold compressed history: one envelope covers 256 tokens of one request and
  holds, compressor group by group, the group's compressed rows (256/ratio each). A group is
  a KV source and the layers that attend its rows: its rows are counted once. They are
  allocated from row 0 upward.
* **Slots** hold a live request's sliding windows (``W`` rows per layer, a ring indexed by
  ``pos % W``; the backbone's layers, then the MTP layer's); they are allocated from the top
  of the row space downward.
* **Planes**: a row number means the same row in every plane (FP8 NoPE + scales, BF16 rope;
  or one FP32 plane). The index keys of a group whose source runs an indexer live in a
  separate index plane addressed by the same envelope numbers. Compressor rings (one per KV
  source and stream) are fp32, one set per slot.

The compiler builds :class:`PoolGeometry` from the model and its quant plan and records
:meth:`PoolGeometry.summary` as the manifest's ``pool_geometry``; both runtimes rebuild it from
there (:meth:`PoolGeometry.from_summary`, C++ ``pool_geometry``), groups and rings as recorded,
without knowing which model family made them. :meth:`PoolGeometry.tensors`
is the one list of the pool's tensors: the compiled step takes them in that order and the
runtime allocates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4c.artifact.model_config import LayerSpec, ModelConfig
from dsv4c.artifact.pool_rows import FP4_PRESHUFFLED, PRESHUFFLE_TILE_ROWS, index_plane_row, main_nope_width
from dsv4c.errors import ArtifactError, UsageError

ENVELOPE_TOKENS = 256


def context_bucket(tokens: int) -> int:
    """The context a decode step that replays CUDA graphs covers for ``tokens`` positions: the
    next power of two, at least an envelope. Its block-table width and entry extents follow from
    it, so one graph serves every context length of the bucket (the kernels mask the entries
    past each token's own); the compiler bounds them by the bucket of max_position_embeddings."""
    return max(ENVELOPE_TOKENS, 1 << (max(tokens, 1) - 1).bit_length())


def graph_context_limit(config: ModelConfig) -> int:
    """The widest context a CUDA-graph artifact's decode buffers are planned for: the bucket of
    the model's max_position_embeddings (the compiler's bound, the engine's max_context limit)."""
    return context_bucket(config.max_position_embeddings)


@dataclass(frozen=True)
class CompressedLayerRows:
    """The rows of one compressor group inside an envelope: those of KV source ``layer``, which
    every layer of ``readers`` (the source first) attends."""
    layer: int
    kind: str  # the source's LayerSpec.attention, recorded for people reading the manifest
    ratio: int
    rows_per_envelope: int  # 256 / ratio
    offset: int  # first row of this group inside an envelope
    index_offset: int | None  # first row inside an index envelope (a source that runs an indexer)
    readers: tuple[int, ...]


@dataclass(frozen=True)
class StateShape:
    layer: int
    stream: str  # main / index
    rows: int  # ratio, or 2 * ratio where the compressor pools overlapping windows
    width: int  # head_dim, or 2 * head_dim with overlapping windows

    def to_json(self) -> dict:
        return {"layer": self.layer, "stream": self.stream, "rows": self.rows, "width": self.width}


def _ring_states(source: LayerSpec, head_dim: int, index_head_dim: int) -> list[StateShape]:
    """The compressor rings of one KV source: one that pools overlapping windows holds two
    windows of two halves each."""
    k = 2 if source.overlap else 1
    out = [StateShape(source.index, "main", k * source.compress_ratio, k * head_dim)]
    if source.owns_index_keys:
        out.append(StateShape(source.index, "index", k * source.compress_ratio, k * index_head_dim))
    return out


@dataclass(frozen=True)
class PoolTensor:
    """One tensor of the pool. ``rows`` names its row space: ``main`` (envelopes + slots, the
    pool's total rows), ``index`` (index envelopes) or ``slots`` (compressor rings: [slots,
    ring rows, width]); ``part`` is its plane (main: kv, or nope + rope; index) or ring (kv /
    score); ``shape`` is per row or per slot."""
    rows: str
    part: str
    shape: tuple[int, ...]
    dtype: str
    state: StateShape | None = None

    @property
    def name(self) -> str:
        if self.state is not None:
            return f"state.{self.state.layer}.{self.state.stream}.{self.part}"
        return "index" if self.rows == "index" else f"main.{self.part}"

    def to_json(self) -> dict:
        return {"name": self.name, "rows": self.rows, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class PoolGeometry:
    head_dim: int
    rope_dim: int
    index_head_dim: int
    window: int
    window_rows_per_request: int  # ModelConfig.window_rows_per_request: the backbone's layers, then MTP's
    compressed: tuple[CompressedLayerRows, ...]
    states: tuple[StateShape, ...]
    rows_per_envelope: int
    index_rows_per_envelope: int
    main_storage: str
    index_storage: str
    main_row_bytes: int
    index_row_bytes: int
    fp8_format: str  # e4m3fn / e4m3fnuz: the main NoPE codes and the FP8 index rows (QuantPlan.fp8_format)
    index_layout: str  # the index plane's byte layout (QuantPlan.index_kv.layout)

    @classmethod
    def build(cls, cfg: ModelConfig, plan) -> "PoolGeometry":
        """From the model and its quantization plan (``artifact.quant.QuantPlan``)."""
        compressed, offset, index_offset = [], 0, 0
        sources = [layer for layer in cfg.layers if layer.is_kv_source]
        for layer in sources:
            r = layer.compress_ratio
            if ENVELOPE_TOKENS % r:
                raise UsageError(
                    f"layer {layer.index}: compress ratio {r} does not divide the {ENVELOPE_TOKENS}-token envelope"
                )
            rows = ENVELOPE_TOKENS // r
            if layer.owns_index_keys and plan.index_kv.layout == FP4_PRESHUFFLED and rows % PRESHUFFLE_TILE_ROWS:
                # A tile is one layer's rows of one envelope: AITER's block, and whole tiles in every plane.
                raise UsageError(f"layer {layer.index}: gfx950's FP4 index tiles hold {PRESHUFFLE_TILE_ROWS} "
                                 f"rows of one envelope, and compress ratio {r} gives {rows}; "
                                 "use --kv-cache-dtype fp32")
            readers = tuple(l.index for l in cfg.layers if l.kv_source == layer.index)
            compressed.append(CompressedLayerRows(layer.index, layer.attention, r, rows, offset,
                                                  index_offset if layer.owns_index_keys else None, readers))
            offset += rows
            index_offset += rows if layer.owns_index_keys else 0
        return cls(
            head_dim=cfg.head_dim, rope_dim=cfg.rope_dim, index_head_dim=cfg.index_head_dim,
            window=cfg.sliding_window, window_rows_per_request=cfg.window_rows_per_request, compressed=tuple(compressed),
            states=tuple(s for l in sources for s in _ring_states(l, cfg.head_dim, cfg.index_head_dim)),
            rows_per_envelope=offset, index_rows_per_envelope=index_offset,
            main_storage=plan.main_kv.storage, index_storage=plan.index_kv.storage,
            main_row_bytes=plan.main_kv.row_bytes, index_row_bytes=plan.index_kv.row_bytes,
            fp8_format=plan.fp8_format, index_layout=plan.index_kv.layout,
        )

    @classmethod
    def from_summary(cls, summary: dict, cfg: ModelConfig, where: str = "manifest.json") -> "PoolGeometry":
        """The geometry an artifact was compiled for, from its manifest's ``pool_geometry``
        (:meth:`summary`), cross-checked against the model description as the C++ host does."""
        try:
            compressed = tuple(CompressedLayerRows(e["layer"], e["kind"], e["ratio"], e["rows"], e["offset"],
                                                   e["index_offset"], tuple(e["readers"])) for e in summary["layers"])
            g = cls(
                head_dim=cfg.head_dim, rope_dim=cfg.rope_dim, index_head_dim=cfg.index_head_dim,
                window=cfg.sliding_window, window_rows_per_request=cfg.window_rows_per_request,
                compressed=compressed,
                states=tuple(StateShape(e["layer"], e["stream"], e["rows"], e["width"]) for e in summary["states"]),
                rows_per_envelope=summary["rows_per_envelope"],
                index_rows_per_envelope=summary["index_rows_per_envelope"],
                main_storage=summary["main_storage"], index_storage=summary["index_storage"],
                main_row_bytes=summary["main_row_bytes"], index_row_bytes=summary["index_row_bytes"],
                fp8_format=summary["pool_fp8_format"], index_layout=summary["index_layout"],
            )
            recorded = (summary["window_rows_per_request"], summary["state_bytes_per_request"])
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{where}: pool_geometry lacks {e}; recompile") from None
        if recorded != (g.window_rows_per_request, g.state_bytes_per_request):
            raise ArtifactError(f"{where}: pool_geometry disagrees with the model description; recompile")
        return g

    # ----- derived numbers (one place each)
    @property
    def state_bytes_per_request(self) -> int:
        return sum(2 * s.rows * s.width * 4 for s in self.states)  # kv_state + score_state, fp32

    @property
    def envelope_bytes(self) -> int:
        return self.rows_per_envelope * self.main_row_bytes + self.index_rows_per_envelope * self.index_row_bytes

    def tensors(self) -> list[PoolTensor]:
        """The pool's tensors in the compiled step's order: main planes, the index plane, then per
        compressor state (layer, stream) its kv ring and its score ring."""
        if self.main_storage == "fp8":
            main = [PoolTensor("main", "nope", (main_nope_width(self.head_dim - self.rope_dim),), "uint8"),
                    PoolTensor("main", "rope", (self.rope_dim,), "uint16")]
        else:
            main = [PoolTensor("main", "kv", (self.head_dim,), {"bf16": "uint16", "fp32": "float32"}[self.main_storage])]
        width, dtype = index_plane_row(self.index_head_dim, self.index_storage)
        out = main + [PoolTensor("index", "index", (width,), dtype)]
        for s in self.states:
            out += [PoolTensor("slots", part, (s.rows, s.width), "float32", s) for part in ("kv", "score")]
        return out

    def bytewise(self, t: PoolTensor) -> bool:
        """Whether the bytes of a row of pool tensor ``t`` are scattered over it: gfx950's FP4
        index rows (tiles of 64 rows, ``pool_rows.FP4_PRESHUFFLED``). The pool functions that save
        and restore rows (``codegen.relax_step.emit_pool_functions``) see such a tensor as bytes."""
        return t.rows == "index" and self.index_storage == "fp4" and self.index_layout == FP4_PRESHUFFLED

    def plane_bytes_per_row(self) -> dict[str, int]:
        if self.main_storage == "fp8":
            rope = 2 * self.rope_dim
            return {"nope": self.main_row_bytes - rope, "rope": rope}
        return {"kv": self.main_row_bytes}

    def bytes_per_token(self) -> dict[str, float]:
        per_token = self.rows_per_envelope / ENVELOPE_TOKENS
        out = {plane: per_token * b for plane, b in self.plane_bytes_per_row().items()}
        out["index"] = self.index_rows_per_envelope / ENVELOPE_TOKENS * self.index_row_bytes
        return out

    @property
    def request_fixed_bytes(self) -> int:
        return self.window_rows_per_request * self.main_row_bytes + self.state_bytes_per_request

    def rows_of(self, layer: int) -> CompressedLayerRows:
        """The group whose rows ``layer`` attends."""
        for c in self.compressed:
            if layer in c.readers:
                return c
        raise KeyError(f"layer {layer} has no compressed rows")

    def request_bytes(self, context: int) -> int:
        """Pool bytes one request of ``context`` tokens takes: its window rows and compressor
        state, and the envelopes its tokens fill."""
        return self.request_fixed_bytes + -(-context // ENVELOPE_TOKENS) * self.envelope_bytes

    def budget(self, memory_bytes: int, contexts=(4096, 32768, 131072, 1048576)) -> dict:
        """How many tokens (one request) and requests (at given context lengths) fit."""
        env = self.envelope_bytes
        one = (memory_bytes - self.request_fixed_bytes) // env if env else 0
        requests = {str(ctx): max(0, memory_bytes // self.request_bytes(ctx)) for ctx in contexts}
        return {"max_tokens": int(max(0, one) * ENVELOPE_TOKENS), "max_requests_at_context": requests}

    def summary(self) -> dict:
        """The manifest's ``pool_geometry`` (read back by :meth:`from_summary` and the C++ host)."""
        return {
            "envelope_tokens": ENVELOPE_TOKENS,
            "rows_per_envelope": self.rows_per_envelope,
            "index_rows_per_envelope": self.index_rows_per_envelope,
            "main_storage": self.main_storage,
            "index_storage": self.index_storage,
            "main_row_bytes": self.main_row_bytes,
            "index_row_bytes": self.index_row_bytes,
            "pool_fp8_format": self.fp8_format,
            "index_layout": self.index_layout,
            "bytes_per_token": round(sum(self.bytes_per_token().values()), 3),
            "bytes_per_token_by_plane": {k: round(v, 3) for k, v in self.bytes_per_token().items()},
            "window_rows_per_request": self.window_rows_per_request,
            "window_bytes_per_request": self.window_rows_per_request * self.main_row_bytes,
            "state_bytes_per_request": self.state_bytes_per_request,
            "layers": [{"layer": c.layer, "kind": c.kind, "ratio": c.ratio, "rows": c.rows_per_envelope,
                        "offset": c.offset, "index_offset": c.index_offset, "readers": list(c.readers)}
                       for c in self.compressed],
            "states": [s.to_json() for s in self.states],
        }

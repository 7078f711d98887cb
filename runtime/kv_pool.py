"""The KV pool: one row space per device (SPEC §4).

* **Envelopes** hold compressed history: one envelope covers 256 tokens of one request and
  holds, layer by layer, that layer's compressed rows (256/ratio each). They are allocated
  from row 0 upward.
* **Slots** hold a live request's sliding windows (``W`` rows per layer, a ring indexed by
  ``pos % W``; the backbone's layers, then the MTP layer's); they are allocated from the top
  of the row space downward. The boundary
  between the two regions is a pair of counters.
* **Planes**: a row number means the same row in every plane (FP8 NoPE + scales, BF16 rope;
  or one BF16 / FP32 plane). CSA index rows live in a separate index pool addressed by the
  same envelope numbers. Compressor rings are fp32, one set per slot.

:class:`PoolGeometry` computes every number once; :class:`KVPool` allocates the arrays once
and hands out rows; :class:`PagedStore` lets the reference kernels run on the pool. The
compiled step turns a request's slot and block table into rows itself
(``codegen.step_kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from dsv4c.errors import DsvError, UsageError
from dsv4c.frontend import lowbit
from dsv4c.frontend.config import CSA, ModelConfig
from dsv4c.runtime.pool_layout import FP4_PRESHUFFLED, PRESHUFFLE_TILE_ROWS, fp4_code_offset, fp4_scale_offset

ENVELOPE_TOKENS = 256
F32 = np.float32


def aligned_empty(shape, dtype, allocate=np.empty) -> np.ndarray:
    """An uninitialised array on a 64-byte boundary, so TVM can share it zero-copy (DLPack)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = allocate(nbytes + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape, dtype) -> np.ndarray:
    # np.zeros maps zero pages lazily: a pool whose planes live on a GPU costs no host memory
    # for its (never written) host planes.
    return aligned_empty(shape, dtype, np.zeros)


class PoolExhausted(DsvError):
    """The pool has no room for the request; nothing was changed."""


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class CompressedLayerRows:
    layer: int
    kind: str
    ratio: int
    rows_per_envelope: int  # 256 / ratio
    offset: int  # first row of this layer inside an envelope
    index_offset: int | None  # first row inside an index envelope (CSA layers)


@dataclass(frozen=True)
class StateShape:
    layer: int
    stream: str  # main / index
    rows: int  # ratio (HCA) or 2 * ratio (CSA, overlapping windows)
    width: int  # head_dim (HCA) or 2 * head_dim (CSA)


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
        """From the model and its quantization plan (``passes.quant_plan.QuantPlan``)."""
        compressed, states, offset, index_offset = [], [], 0, 0
        for layer in cfg.layers:
            if not layer.is_compressed:
                continue
            r = layer.compress_ratio
            if ENVELOPE_TOKENS % r:
                raise UsageError(
                    f"layer {layer.index}: compress ratio {r} does not divide the {ENVELOPE_TOKENS}-token envelope"
                )
            rows = ENVELOPE_TOKENS // r
            compressed.append(CompressedLayerRows(layer.index, layer.attention, r, rows, offset,
                                                  index_offset if layer.has_indexer else None))
            offset += rows
            c = 2 if layer.attention == CSA else 1
            states.append(StateShape(layer.index, "main", c * r, c * cfg.head_dim))
            if layer.has_indexer:
                if plan.index_kv.layout == FP4_PRESHUFFLED and rows % PRESHUFFLE_TILE_ROWS:
                    # A tile is one layer's rows of one envelope: AITER's block, and whole tiles in every plane.
                    raise UsageError(f"layer {layer.index}: gfx950's FP4 index tiles hold {PRESHUFFLE_TILE_ROWS} "
                                     f"rows of one envelope, and compress ratio {r} gives {rows}; "
                                     "use --kv-cache-dtype fp32")
                index_offset += rows
                states.append(StateShape(layer.index, "index", c * r, c * cfg.index_head_dim))
        return cls(
            head_dim=cfg.head_dim, rope_dim=cfg.rope_dim, index_head_dim=cfg.index_head_dim,
            window=cfg.sliding_window, window_rows_per_request=cfg.window_rows_per_request, compressed=tuple(compressed),
            states=tuple(states), rows_per_envelope=offset, index_rows_per_envelope=index_offset,
            main_storage=plan.main_kv.storage, index_storage=plan.index_kv.storage,
            main_row_bytes=plan.main_kv.row_bytes, index_row_bytes=plan.index_kv.row_bytes,
            fp8_format=plan.fp8_format, index_layout=plan.index_kv.layout,
        )

    @classmethod
    def from_manifest(cls, cfg: ModelConfig, manifest: dict) -> "PoolGeometry":
        """The geometry an artifact was compiled for, from the quant plan its manifest records
        (the runtime reads it there rather than re-planning)."""
        plan = manifest["quant_plan"]
        view = SimpleNamespace(**{k: SimpleNamespace(**v) if k in ("main_kv", "index_kv") else v
                                  for k, v in plan.items()})
        return cls.build(cfg, view)

    # ----- derived numbers (one place each)
    @property
    def state_bytes_per_request(self) -> int:
        return sum(2 * s.rows * s.width * 4 for s in self.states)  # kv_state + score_state, fp32

    @property
    def envelope_bytes(self) -> int:
        return self.rows_per_envelope * self.main_row_bytes + self.index_rows_per_envelope * self.index_row_bytes

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
        for c in self.compressed:
            if c.layer == layer:
                return c
        raise KeyError(f"layer {layer} has no compressed rows")

    def budget(self, memory_bytes: int, contexts=(4096, 32768, 131072, 1048576)) -> dict:
        """How many tokens (one request) and requests (at given context lengths) fit."""
        env = self.envelope_bytes
        one = (memory_bytes - self.request_fixed_bytes) // env if env else 0
        requests = {}
        for ctx in contexts:
            per = self.request_fixed_bytes + -(-ctx // ENVELOPE_TOKENS) * env
            requests[str(ctx)] = max(0, memory_bytes // per)
        return {"max_tokens": int(max(0, one) * ENVELOPE_TOKENS), "max_requests_at_context": requests}

    def summary(self) -> dict:
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
                        "offset": c.offset, "index_offset": c.index_offset} for c in self.compressed],
        }


# --------------------------------------------------------------------------- row codecs


def _pow2_blocks(x: np.ndarray, block: int, amax_floor: float, qmax: float) -> np.ndarray:
    amax = np.abs(x.reshape(x.shape[0], -1, block)).max(axis=2)
    return lowbit.pow2_ceil_scale(np.maximum(amax, amax_floor), qmax)


class _MainCodec:
    """Encodes fp32 KV rows into the main planes and back (FP8 NoPE codes in the plan's fp8 format)."""

    def __init__(self, g: PoolGeometry):
        self.g = g
        self.nope = g.head_dim - g.rope_dim
        self.n_scales = -(-self.nope // 64)

    def allocate(self, rows: int) -> dict[str, np.ndarray]:
        g = self.g
        if g.main_storage == "fp8":
            return {"nope": aligned_zeros((rows, g.main_row_bytes - 2 * g.rope_dim), np.uint8),
                    "rope": aligned_zeros((rows, g.rope_dim), np.uint16)}
        dtype = {"bf16": np.uint16, "fp32": F32}[g.main_storage]
        return {"kv": aligned_zeros((rows, g.head_dim), dtype)}

    def write(self, planes, rows: np.ndarray, values: np.ndarray) -> None:
        s = self.g.main_storage
        if s == "fp32":
            planes["kv"][rows] = values
        elif s == "bf16":
            planes["kv"][rows] = lowbit.bf16_bits_from_f32(values)
        else:
            nope = values[:, :self.nope]
            scale = _pow2_blocks(nope, 64, lowbit.FP8_AMAX_FLOOR, lowbit.E4M3_MAX)
            codes = lowbit.encode_e4m3fn(np.clip(nope / np.repeat(scale, 64, axis=1), -448, 448))
            codes, scale = lowbit.fp8_in_format(codes, scale, self.g.fp8_format)
            planes["nope"][rows, :self.nope] = codes
            planes["nope"][rows, self.nope:self.nope + self.n_scales] = lowbit.encode_e8m0(scale)
            planes["rope"][rows] = lowbit.bf16_bits_from_f32(values[:, self.nope:])

    def read(self, planes, rows: np.ndarray) -> np.ndarray:
        s = self.g.main_storage
        if s == "fp32":
            return planes["kv"][rows]
        if s == "bf16":
            return lowbit.f32_from_bf16_bits(planes["kv"][rows])
        raw = planes["nope"][rows]
        scale = lowbit.decode_e8m0(raw[:, self.nope:self.nope + self.n_scales])
        nope = lowbit.decode_fp8(raw[:, :self.nope], self.g.fp8_format) * np.repeat(scale, 64, axis=1)
        return np.concatenate([nope, lowbit.f32_from_bf16_bits(planes["rope"][rows])], axis=1).astype(F32)


class _IndexCodec:
    """Encodes fp32 index rows into the index plane and back: FP8 rows row-major, FP4 rows in
    the plan's layout (row-major, or gfx950's tiles of 64 rows, see quant_plan.FP4_PRESHUFFLED;
    PoolGeometry.build makes every envelope whole tiles)."""

    def __init__(self, g: PoolGeometry):
        self.g = g

    def allocate(self, rows: int) -> np.ndarray:
        if self.g.index_storage == "fp32":
            return aligned_zeros((rows, self.g.index_head_dim), F32)
        return aligned_zeros((rows, self.g.index_row_bytes), np.uint8)

    def _fp4_offsets(self, plane, rows: np.ndarray) -> np.ndarray:
        """[len(rows), row bytes] offsets into the flat plane of each row's bytes, in row-major
        order (packed codes, then the scales)."""
        d, layout, r = self.g.index_head_dim, self.g.index_layout, len(plane)
        rows = rows.astype(np.int64)[:, None]
        return np.concatenate([fp4_code_offset(layout, rows, np.arange(d // 2), r, d),
                               fp4_scale_offset(layout, rows, np.arange(d // 32), r, d)], axis=1)

    def write(self, plane, rows: np.ndarray, values: np.ndarray) -> None:
        s, d = self.g.index_storage, self.g.index_head_dim
        if s == "fp32":
            plane[rows] = values
        elif s == "fp4":
            scale = _pow2_blocks(values, 32, lowbit.FP4_AMAX_FLOOR, lowbit.E2M1_MAX)
            codes = lowbit.encode_e2m1(np.clip(values / np.repeat(scale, 32, axis=1), -6, 6))
            row_bytes = np.concatenate([lowbit.pack_fp4(codes).view(np.uint8), lowbit.encode_e8m0(scale)], axis=1)
            plane.reshape(-1)[self._fp4_offsets(plane, rows)] = row_bytes
        else:  # fp8 with one fp32 scale per row
            scale = (np.maximum(np.abs(values).max(axis=1), lowbit.FP8_AMAX_FLOOR) / lowbit.E4M3_MAX).astype(F32)
            codes, scale = lowbit.fp8_in_format(lowbit.encode_e4m3fn(values / scale[:, None]), scale,
                                                self.g.fp8_format)
            plane[rows, :d] = codes
            plane[rows, d:] = scale.view(np.uint8).reshape(-1, 4)

    def read(self, plane, rows: np.ndarray) -> np.ndarray:
        s, d = self.g.index_storage, self.g.index_head_dim
        if s == "fp32":
            return plane[rows]
        if s == "fp4":
            raw = plane.reshape(-1)[self._fp4_offsets(plane, rows)]
            scale = lowbit.decode_e8m0(raw[:, d // 2:])
            return (lowbit.decode_e2m1(lowbit.unpack_fp4(raw[:, :d // 2])) * np.repeat(scale, 32, axis=1)).astype(F32)
        raw = plane[rows]
        scale = np.ascontiguousarray(raw[:, d:]).view(F32)[:, 0]
        return (lowbit.decode_fp8(raw[:, :d], self.g.fp8_format) * scale[:, None]).astype(F32)


# --------------------------------------------------------------------------- allocator


@dataclass
class RequestRows:
    slot: int
    blocks: list[int] = field(default_factory=list)  # block table: envelope numbers, in token order


class KVPool:
    """Owns the planes (allocated once) and hands out envelopes and slots."""

    def __init__(self, geometry: PoolGeometry, total_rows: int):
        g = geometry
        if total_rows < g.window_rows_per_request:
            raise UsageError(f"a pool of {total_rows} rows cannot hold even one request's windows "
                             f"({g.window_rows_per_request} rows)")
        self.geometry, self.total_rows = g, total_rows
        self.max_envelopes = total_rows // g.rows_per_envelope if g.rows_per_envelope else 0
        self.max_slots = total_rows // g.window_rows_per_request
        self._main, self._index = _MainCodec(g), _IndexCodec(g)
        self.planes = self._main.allocate(total_rows)
        self.index_plane = self._index.allocate(max(self.max_envelopes * g.index_rows_per_envelope, 1))
        self.state = {(s.layer, s.stream): (aligned_zeros((self.max_slots, s.rows, s.width), F32),
                                            aligned_zeros((self.max_slots, s.rows, s.width), F32)) for s in g.states}
        self.requests: dict[int, RequestRows] = {}
        self._env_high = 0  # envelopes [0, _env_high) may be in use; rows grow up
        self._slot_high = 0  # slots [0, _slot_high) may be in use; rows grow down from the top
        self._env_free: list[int] = []
        self._slot_free: list[int] = []

    @classmethod
    def for_memory(cls, geometry: PoolGeometry, memory_bytes: int) -> "KVPool":
        g = geometry
        per_row = g.main_row_bytes
        if g.rows_per_envelope:  # index rows and slot state, amortised per main row
            per_row += g.index_row_bytes * g.index_rows_per_envelope / g.rows_per_envelope
        per_row += g.state_bytes_per_request / g.window_rows_per_request
        return cls(g, int(memory_bytes // per_row))

    # ----- boundary
    def envelope_rows(self, block: int) -> tuple[int, int]:
        start = block * self.geometry.rows_per_envelope
        return start, start + self.geometry.rows_per_envelope

    def slot_rows(self, slot: int) -> tuple[int, int]:
        stop = self.total_rows - slot * self.geometry.window_rows_per_request
        return stop - self.geometry.window_rows_per_request, stop

    def _fits(self, env_high: int, slot_high: int) -> bool:
        g = self.geometry
        return env_high * g.rows_per_envelope <= self.total_rows - slot_high * g.window_rows_per_request

    @property
    def free_envelopes(self) -> int:
        """Envelopes that can still be allocated without moving any slot."""
        g = self.geometry
        if not g.rows_per_envelope:
            return 0
        room = (self.total_rows - self._slot_high * g.window_rows_per_request) // g.rows_per_envelope
        return len(self._env_free) + max(0, room - self._env_high)

    def _take(self, n_env: int, n_slots: int) -> tuple[list[int], list[int]]:
        """Pick envelopes and slots (freed ones first), or raise PoolExhausted having changed nothing."""
        reuse_env = sorted(self._env_free)[:n_env]
        reuse_slot = sorted(self._slot_free)[:n_slots]
        env_high = self._env_high + n_env - len(reuse_env)
        slot_high = self._slot_high + n_slots - len(reuse_slot)
        if not self._fits(env_high, slot_high):
            raise PoolExhausted(
                f"KV pool exhausted: need {n_env} envelope(s) and {n_slots} slot(s), "
                f"{self.free_envelopes} envelope(s) free; free a request or give the pool more memory"
            )
        for e in reuse_env:
            self._env_free.remove(e)
        for slot in reuse_slot:
            self._slot_free.remove(slot)
        envs = reuse_env + list(range(self._env_high, env_high))
        slots = reuse_slot + list(range(self._slot_high, slot_high))
        self._env_high, self._slot_high = env_high, slot_high
        return envs, slots

    # ----- requests
    def admit(self, seq: int, reserve_tokens: int = 0) -> RequestRows:
        """A slot for a new request, plus envelopes for ``reserve_tokens`` tokens up front."""
        if seq in self.requests:
            raise UsageError(f"request {seq} is already in the pool")
        if reserve_tokens < 0:
            raise UsageError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        envs, (slot,) = self._take(-(-reserve_tokens // ENVELOPE_TOKENS) if self.geometry.rows_per_envelope else 0, 1)
        for kv, score in self.state.values():
            kv[slot] = 0.0
            score[slot] = -np.inf  # an empty ring gives zero softmax weight
        req = self.requests[seq] = RequestRows(slot, envs)
        return req

    def ensure(self, seq: int, tokens: int) -> None:
        """Grow the block table so that positions ``< tokens`` have envelopes."""
        req = self._request(seq)
        if not self.geometry.rows_per_envelope:
            return
        need = -(-tokens // ENVELOPE_TOKENS) - len(req.blocks)
        if need > 0:
            envs, _ = self._take(need, 0)
            req.blocks.extend(envs)

    def free(self, seq: int) -> None:
        req = self._request(seq)
        del self.requests[seq]
        self._env_free.extend(req.blocks)
        self._slot_free.append(req.slot)
        # Give the high-water marks back so the other region can use the rows.
        while self._env_high and (self._env_high - 1) in self._env_free:
            self._env_high -= 1
            self._env_free.remove(self._env_high)
        while self._slot_high and (self._slot_high - 1) in self._slot_free:
            self._slot_high -= 1
            self._slot_free.remove(self._slot_high)

    def _request(self, seq: int) -> RequestRows:
        try:
            return self.requests[seq]
        except KeyError:
            raise UsageError(f"request {seq} is not in the pool") from None

    # ----- physical rows
    def window_row(self, seq: int, layer: int, positions: np.ndarray) -> np.ndarray:
        g = self.geometry
        base = self.slot_rows(self._request(seq).slot)[0]
        return base + layer * g.window + positions % g.window

    def entry_rows(self, seq: int, layer: int, entries: np.ndarray, index: bool = False) -> np.ndarray:
        """Physical rows of compressed entries (per-request numbers) of one layer."""
        lr = self.geometry.rows_of(layer)
        blocks = np.asarray(self._request(seq).blocks, np.int64)
        block_of = entries // lr.rows_per_envelope
        if len(entries) and block_of.max() >= len(blocks):
            raise UsageError(f"request {seq}: entry {int(entries.max())} of layer {layer} has no envelope yet")
        within = entries % lr.rows_per_envelope
        if index:
            return blocks[block_of] * self.geometry.index_rows_per_envelope + lr.index_offset + within
        return blocks[block_of] * self.geometry.rows_per_envelope + lr.offset + within

    def position_state(self, seq: int, positions) -> list[tuple[np.ndarray, tuple]]:
        """Every (array, index) of state that feeding ``positions`` of request ``seq`` writes:
        their window rows in each layer, their compressor ring rows (position p owns row
        p mod ring rows, see ``llvm_kernels.ring_update``), and the compressed and index entries
        of the windows they close. Speculative decoding saves these before a verify step and
        puts back those of the tokens it rejects, so the pool is what it would be had they
        never been fed; that holds while no two of the positions share a row (the engine keeps
        draft runs shorter than the window and the smallest ring)."""
        g, positions = self.geometry, np.asarray(positions, np.int64)
        slot = self._request(seq).slot
        out = []
        windows = (self.slot_rows(slot)[0] + np.arange(0, g.window_rows_per_request, g.window)[:, None]
                   + positions[None, :] % g.window).reshape(-1)
        out += [(plane, (windows,)) for plane in self.planes.values()]
        for c in g.compressed:
            closing = (positions + 1) % c.ratio == 0
            entries = (positions[closing] + 1) // c.ratio - 1
            out += [(plane, (self.entry_rows(seq, c.layer, entries),)) for plane in self.planes.values()]
            if c.index_offset is not None:
                out.append((self.index_plane, (self.entry_rows(seq, c.layer, entries, index=True),)))
        for s in g.states:
            out += [(ring, (slot, positions % s.rows)) for ring in self.state[(s.layer, s.stream)]]
        return out

    @staticmethod
    def save(state: list[tuple[np.ndarray, tuple]]) -> list[tuple[np.ndarray, tuple, np.ndarray]]:
        """A copy of the ``position_state`` rows, for :meth:`restore`."""
        return [(array, index, array[index].copy()) for array, index in state]

    @staticmethod
    def restore(saved: list[tuple[np.ndarray, tuple, np.ndarray]]) -> None:
        for array, index, values in saved:
            array[index] = values

    def read_main(self, rows: np.ndarray) -> np.ndarray:
        return self._main.read(self.planes, rows)

    def write_main(self, rows: np.ndarray, values: np.ndarray) -> None:
        self._main.write(self.planes, rows, values)

    def read_index(self, rows: np.ndarray) -> np.ndarray:
        return self._index.read(self.index_plane, rows)

    def write_index(self, rows: np.ndarray, values: np.ndarray) -> None:
        self._index.write(self.index_plane, rows, values)


# --------------------------------------------------------------------------- reference on the pool


class PagedStore:
    """The :class:`~dsv4c.ir.kernels.KVStore` interface over a :class:`KVPool` (every layer with
    a window, the MTP layer's included, has its rows in the request's slot)."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    def window_rows(self, layer, seq, start, stop):
        return self.pool.read_main(self.pool.window_row(seq, layer, np.arange(start, stop)))

    def write_window(self, layer, seq, positions, rows):
        self.pool.write_main(self.pool.window_row(seq, layer, np.asarray(positions)), rows)

    def ring(self, layer, stream, seq):
        kv, score = self.pool.state[(layer, stream)]
        slot = self.pool.requests[seq].slot
        return kv[slot], score[slot]

    def write_entries(self, layer, stream, seq, first, entries):
        numbers = np.arange(first, first + len(entries))
        if stream == "index":
            self.pool.write_index(self.pool.entry_rows(seq, layer, numbers, index=True), entries)
        else:
            self.pool.write_main(self.pool.entry_rows(seq, layer, numbers), entries)

    def entries(self, layer, stream, seq, count):
        numbers = np.arange(count)
        if stream == "index":
            return self.pool.read_index(self.pool.entry_rows(seq, layer, numbers, index=True))
        return self.pool.read_main(self.pool.entry_rows(seq, layer, numbers))

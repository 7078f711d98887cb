"""The bytes of one KV pool row in every format a plan can name: row sizes, byte layouts and the
numpy codecs that write and read them. The TIR kernels that store and load pool rows produce and
consume the same bytes (``codegen.kernels.pool_rows``); the layout formulas are integer
arithmetic only, so numpy arrays and TIR expressions both go through them.

Row formats, with FP8 codes in the plan's fp8 format (e4m3fn; gfx942: e4m3fnuz, the same bits
with doubled scales, see ``lowbit.fp8_in_format``):

* main fp8: a NoPE plane u8 [NoPE codes | one E8M0 scale per 64 | padding to 8 bytes] and a rope
  plane u16 [BF16 bits] (the 448 + 8 packing of vLLM / SGLang: 584 B per row for V4);
* main fp32: one plane [head_dim] float32;
* index fp8: u8 [codes | one fp32 scale, 4 bytes little-endian];
* index fp4: u8 [e2m1 pairs, element 2i in the low nibble | one E8M0 scale per 32], row-major,
  or (gfx950) the same bytes in tiles of 64 rows (:data:`FP4_PRESHUFFLED`);
* index fp32: [index_head_dim] float32.
"""

from __future__ import annotations

import numpy as np

from dsv4c.artifact import lowbit
from dsv4c.errors import UsageError

F32 = np.float32
MAIN_FP8_GROUP = 64  # NoPE channels per E8M0 scale of a main fp8 row


def main_nope_width(nope_dim: int) -> int:
    """Bytes per row of the main fp8 NoPE plane: codes, then the scales padded to 8 bytes."""
    scales = -(-nope_dim // MAIN_FP8_GROUP)
    return nope_dim + -(-scales // 8) * 8


def main_row_bytes(head_dim: int, rope_dim: int, storage: str) -> int:
    """Bytes of one main pool row: fp8 NoPE plane + BF16 rope plane (584 B for V4), or bf16 / fp32."""
    if storage == "fp8":
        return main_nope_width(head_dim - rope_dim) + 2 * rope_dim
    return head_dim * {"bf16": 2, "fp32": 4}[storage]


def index_row_bytes_of(d: int, storage: str) -> int:
    # FP4: packed e2m1 + one E8M0 per 32 (68 B for d=128); FP8: e4m3 + one fp32 scale (132 B).
    return {"fp4": d // 2 + d // FP4_GROUP, "fp8": d + 4, "fp32": 4 * d}[storage]


def index_plane_row(dim: int, storage: str) -> tuple[int, str]:
    """(elements per row, dtype) of the index plane for ``storage``."""
    if storage == "fp32":
        return dim, "float32"
    if storage == "fp4" and dim % FP4_GROUP:
        raise ValueError(f"fp4 index rows need a multiple of {FP4_GROUP} values, got {dim}")
    if storage not in ("fp8", "fp4"):
        raise ValueError(f"unknown index storage {storage!r}: fp32, fp8 or fp4")
    return index_row_bytes_of(dim, storage), "uint8"


# Byte layouts of pool rows (PoolLayout.layout). Every plane is row-major (a row's bytes are
# contiguous, in the order the codecs describe) except gfx950's FP4 index plane.
ROW_MAJOR = "row-major"
MAIN_FP8_LAYOUT = "nope_scales_rope"  # the NoPE plane (codes, E8M0 scales, padding) + the BF16 rope plane
# gfx950's FP4 index plane is laid out for AITER's paged FP4 MQA-logits kernel
# (aiter/ops/flydsl/kernels/mqa_logits/pa_mqa_logits_fp4*.py, which ATOM runs for V4's indexer
# on MI355X): rows in tiles of 64 (one envelope's rows of a ratio-4 CSA layer, that kernel's
# kv_block_size), all tiles' codes first, then all tiles' scales:
#   codes  [rows / 64, dim / 32, 64, 16]  16 bytes: the 32 e2m1 codes of one scale group, row-major
#   scales [rows / 64, dim / 32, 64]      E8M0; the 64 rows interleaved as (row % 16) * 4 + row // 16
# that is AITER's kv_cache [NB, dim / 128, 4, 64, 16] and kv_scale [NB, dim / 128, 4, 64], back
# to back in one plane (68 B per row for dim 128, as row-major).
FP4_PRESHUFFLED = "gfx950_fp4_preshuffled"
PRESHUFFLE_TILE_ROWS = 64
FP4_GROUP = 32


def _check_fp4_layout(layout: str) -> None:
    if layout != FP4_PRESHUFFLED:  # e.g. an artifact's plan from before the layouts were named row-major
        raise UsageError(f"unknown FP4 index layout {layout!r} ({ROW_MAJOR} or {FP4_PRESHUFFLED}); recompile")


def fp4_code_offset(layout: str, row, byte, rows, dim: int):
    """Byte offset, in an FP4 index plane of ``rows`` rows, of packed code byte ``byte`` (of
    ``dim / 2``) of row ``row``. Integer arithmetic only, so the numpy codec (arrays) and the TIR
    kernels (expressions) share it."""
    if layout == ROW_MAJOR:
        return row * index_row_bytes_of(dim, "fp4") + byte
    _check_fp4_layout(layout)
    t = PRESHUFFLE_TILE_ROWS
    return (row // t) * (t * dim // 2) + (byte // 16) * (t * 16) + (row % t) * 16 + byte % 16


def fp4_scale_offset(layout: str, row, group, rows, dim: int):
    """Byte offset, in an FP4 index plane of ``rows`` rows, of E8M0 scale ``group`` (of
    ``dim / 32``) of row ``row`` (see fp4_code_offset)."""
    if layout == ROW_MAJOR:
        return row * index_row_bytes_of(dim, "fp4") + dim // 2 + group
    _check_fp4_layout(layout)
    t = PRESHUFFLE_TILE_ROWS
    return rows * (dim // 2) + (row // t) * (t * dim // FP4_GROUP) + group * t + (row % 16) * 4 + (row % t) // 16


# --------------------------------------------------------------------------- numpy codecs


def _pow2_blocks(x: np.ndarray, block: int, amax_floor: float, qmax: float) -> np.ndarray:
    amax = np.abs(x.reshape(x.shape[0], -1, block)).max(axis=2)
    return lowbit.pow2_ceil_scale(np.maximum(amax, amax_floor), qmax)


class MainRowCodec:
    """Encodes fp32 KV rows into the main planes (``PoolGeometry.tensors``: ``kv``, or ``nope`` +
    ``rope``) and back."""

    def __init__(self, g):
        self.g = g
        self.nope = g.head_dim - g.rope_dim
        self.n_scales = -(-self.nope // MAIN_FP8_GROUP)

    def write(self, planes, rows: np.ndarray, values: np.ndarray) -> None:
        s = self.g.main_storage
        if s == "fp32":
            planes["kv"][rows] = values
        elif s == "bf16":
            planes["kv"][rows] = lowbit.bf16_bits_from_f32(values)
        else:
            nope = values[:, :self.nope]
            scale = _pow2_blocks(nope, MAIN_FP8_GROUP, lowbit.FP8_AMAX_FLOOR, lowbit.E4M3_MAX)
            codes = lowbit.encode_e4m3fn(np.clip(nope / np.repeat(scale, MAIN_FP8_GROUP, axis=1), -448, 448))
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
        nope = lowbit.decode_fp8(raw[:, :self.nope], self.g.fp8_format) * np.repeat(scale, MAIN_FP8_GROUP, axis=1)
        return np.concatenate([nope, lowbit.f32_from_bf16_bits(planes["rope"][rows])], axis=1).astype(F32)


class IndexRowCodec:
    """Encodes fp32 index rows into the index plane and back: FP8 rows row-major, FP4 rows in
    the plan's layout (row-major, or gfx950's tiles of 64 rows, :data:`FP4_PRESHUFFLED`;
    ``PoolGeometry.build`` makes every envelope whole tiles)."""

    def __init__(self, g):
        self.g = g

    def fp4_offsets(self, plane, rows: np.ndarray) -> np.ndarray:
        """[len(rows), row bytes] offsets into the flat plane of each row's bytes, in row-major
        order (packed codes, then the scales); also where the device's pool functions find a
        preshuffled row (``PoolGeometry.bytewise``)."""
        d, layout, r = self.g.index_head_dim, self.g.index_layout, len(plane)
        rows = rows.astype(np.int64)[:, None]
        return np.concatenate([fp4_code_offset(layout, rows, np.arange(d // 2), r, d),
                               fp4_scale_offset(layout, rows, np.arange(d // FP4_GROUP), r, d)], axis=1)

    def write(self, plane, rows: np.ndarray, values: np.ndarray) -> None:
        s, d = self.g.index_storage, self.g.index_head_dim
        if s == "fp32":
            plane[rows] = values
        elif s == "fp4":
            scale = _pow2_blocks(values, FP4_GROUP, lowbit.FP4_AMAX_FLOOR, lowbit.E2M1_MAX)
            codes = lowbit.encode_e2m1(np.clip(values / np.repeat(scale, FP4_GROUP, axis=1), -6, 6))
            row_bytes = np.concatenate([lowbit.pack_fp4(codes).view(np.uint8), lowbit.encode_e8m0(scale)], axis=1)
            plane.reshape(-1)[self.fp4_offsets(plane, rows)] = row_bytes
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
            raw = plane.reshape(-1)[self.fp4_offsets(plane, rows)]
            scale = lowbit.decode_e8m0(raw[:, d // 2:])
            return (lowbit.decode_e2m1(lowbit.unpack_fp4(raw[:, :d // 2]))
                    * np.repeat(scale, FP4_GROUP, axis=1)).astype(F32)
        raw = plane[rows]
        scale = np.ascontiguousarray(raw[:, d:]).view(F32)[:, 0]
        return (lowbit.decode_fp8(raw[:, :d], self.g.fp8_format) * scale[:, None]).astype(F32)

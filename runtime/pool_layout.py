"""Byte layouts of KV pool rows (a plan's ``PoolLayout.layout``), shared by the quant plan that
names them, the numpy codecs of ``runtime.kv_pool`` and the TIR kernels that write and read
them; integer arithmetic only, so arrays and TIR expressions both go through it."""

from __future__ import annotations

from dsv4c.errors import UsageError


def index_row_bytes_of(d: int, storage: str) -> int:
    # FP4: packed e2m1 + one E8M0 per 32 (68 B for d=128); FP8: e4m3 + one fp32 scale (132 B).
    return {"fp4": d // 2 + d // FP4_GROUP, "fp8": d + 4, "fp32": 4 * d}[storage]


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

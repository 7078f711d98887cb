"""Low-bit KV pool rows: the store kernels that encode them, and the per-value readers the
attention and index kernels decode them with."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from dsv4c.artifact.lowbit import E2M1_MAX, E4M3_MAX, FP4_AMAX_FLOOR, FP8_AMAX_FLOOR, FP8_FORMATS
from dsv4c.artifact.pool_rows import (FP4_GROUP, FP4_PRESHUFFLED, MAIN_FP8_GROUP, ROW_MAJOR, fp4_code_offset,
                                      fp4_scale_offset, index_plane_row, index_row_bytes_of, main_nope_width)
from dsv4c.codegen.kernels.codecs import (F32, DECODE_FP8, _u, abs_bits, amax_floor, bf16_bits, decode_bf16,
                                          decode_e2m1, decode_e8m0, decode_f32_le, encode_e2m1, encode_e8m0,
                                          encode_fp8, fp8_format_scale, pow2_ceil_scale)
from dsv4c.codegen.kernels.cpu import ON_STACK


# The byte layouts of ``artifact.pool_rows`` (its docstring lists them), one pool row each. The
# store kernels write the same bytes as its numpy codecs, the readers below decode to the same
# float32 values.
#
# Pool rows: a kernel that takes pool planes declares their row count int64, so that TVM computes
# every offset into them in 64 bits. A plane passes 2**31 elements in ordinary use: Flash's fp32
# main plane holds 5.7M rows of 512 floats at 1M tokens, its fp8 NoPE plane 2.6 GB at 8 x 128K
# tokens. With an int32 count the offsets wrapped and the kernels wrote outside the plane.

def _check_fp8_format(fp8_format) -> None:
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"low-bit pool rows need the pool's fp8 format, one of {FP8_FORMATS}; got {fp8_format!r}")


def check_index_format(storage: str, fp8_format, layout) -> None:
    """Low-bit index rows need the pool's fp8 format and index layout; only fp4 rows are shuffled."""
    if storage == "fp32":
        return
    _check_fp8_format(fp8_format)
    if layout != ROW_MAJOR and (storage, layout) != ("fp4", FP4_PRESHUFFLED):
        raise ValueError(f"{storage} index rows cannot be laid out {layout!r} (fp8: {ROW_MAJOR}; "
                         f"fp4: {ROW_MAJOR} or {FP4_PRESHUFFLED})")


def check_main_fp8(nope_dim: int, fp8_format) -> None:
    if nope_dim <= 0 or nope_dim % MAIN_FP8_GROUP:
        raise ValueError(f"fp8 main rows need a NoPE part of a multiple of {MAIN_FP8_GROUP} values, "
                         f"got {nope_dim}")
    _check_fp8_format(fp8_format)


def _fp4_byte(plane, row, byte, dim: int, layout: str, scale: bool):
    """(plane row, column) of an fp4 index row's code byte ``byte`` (or, ``scale``, its scale
    ``byte``): the row's own bytes when row-major, else the offset quant_plan's layout gives."""
    width = index_row_bytes_of(dim, "fp4")
    if layout == ROW_MAJOR:
        return row, (dim // 2 + byte if scale else byte)
    # In 64 bits, as every offset into a pool plane (see "Pool rows").
    offset = (fp4_scale_offset if scale else fp4_code_offset)(layout, tirx.Cast("int64", row), byte, plane.shape[0], dim)
    return offset // width, offset % width


def index_key(plane, row, d, dim: int, storage: str, fp8_format=None, layout=None):
    """Value d of index row ``row`` as float32, as _IndexCodec.read decodes it (code times
    scale, one float32 product); fp32 rows are read as they are."""
    if storage == "fp32":
        return plane[row, d]
    if storage == "fp8":
        return DECODE_FP8[fp8_format](plane[row, d]) * decode_f32_le(plane, row, dim)
    code_at = _fp4_byte(plane, row, d // 2, dim, layout, scale=False)
    scale_at = _fp4_byte(plane, row, d // FP4_GROUP, dim, layout, scale=True)
    nibble = tirx.shift_right(_u(plane[code_at]), (d % 2) * 4) & 15
    return decode_e2m1(nibble) * decode_e8m0(plane[scale_at])


def main_fp8_value(nope_plane, rope_plane, row, first, lane, nope_dim: int, fp8_format: str):
    """Value ``first + lane`` of a main fp8 row as float32, as _MainCodec.read decodes it: NoPE
    code times its group's E8M0 scale, or the BF16 rope value. ``first`` starts a chunk of
    lanes that lies wholly in one part and one scale group, so the branch and the scale index
    stay scalar when ``lane`` is vectorized. if_then_else evaluates only the part it picks, so
    the other part's column may lie outside its plane."""
    nope = DECODE_FP8[fp8_format](nope_plane[row, first + lane]) * \
        decode_e8m0(nope_plane[row, nope_dim + first // MAIN_FP8_GROUP])
    return tirx.if_then_else(first < nope_dim, nope, decode_bf16(rope_plane[row, first + lane - nope_dim]))


@T.macro
def _amax_bits(VALS, i, first, count, amax):
    """amax[0] = bits of max |VALS[i, first:first + count]| (see abs_bits)."""
    amax[0] = 0
    for j in range(count):
        amax[0] = T.max(amax[0], abs_bits(VALS[i, first + j]))


def store_main_fp8(nope_dim: int, rope_dim: int, fp8_format: str):
    """Main fp8 pool rows: nope_plane[rows[i]], rope_plane[rows[i]] = vals[i], the bytes
    _MainCodec.write stores. Per 64 NoPE values s = pow2_ceil(max(amax, 1e-4) / 448), codes
    e4m3fn(v / s) (the codec's clip to +-448 is the encoder's saturation) in ``fp8_format``, the
    E8M0 scales (fnuz: 2 s) after the codes (padding bytes untouched); rope values as BF16 bits.
    Rows must be distinct (-1: skipped)."""
    check_main_fp8(nope_dim, fp8_format)
    groups = nope_dim // MAIN_FP8_GROUP

    @T.prim_func
    def f(nope_plane: T.handle, rope_plane: T.handle, rows: T.handle, vals: T.handle):
        r = T.int64()  # 64-bit offsets (see "Pool rows")
        n = T.int32()
        NOPE = T.match_buffer(nope_plane, (r, main_nope_width(nope_dim)), "uint8")
        ROPE = T.match_buffer(rope_plane, (r, rope_dim), "uint16")
        ROWS = T.match_buffer(rows, (n,), "int32")
        VALS = T.match_buffer(vals, (n, nope_dim + rope_dim), F32)
        for i in T.parallel(n):
            if ROWS[i] >= 0:  # -1: no row (a step slot without an entry to store)
                amax = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
                scale = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
                for g in range(groups):
                    _amax_bits(VALS, i, g * MAIN_FP8_GROUP, MAIN_FP8_GROUP, amax)
                    scale[0] = pow2_ceil_scale(T.reinterpret(F32, amax[0]), FP8_AMAX_FLOOR, E4M3_MAX)
                    for j in range(MAIN_FP8_GROUP):
                        x = VALS[i, g * MAIN_FP8_GROUP + j] / scale[0]
                        NOPE[ROWS[i], g * MAIN_FP8_GROUP + j] = T.Cast("uint8", encode_fp8(x, fp8_format))
                    NOPE[ROWS[i], nope_dim + g] = T.Cast("uint8", encode_e8m0(fp8_format_scale(scale[0], fp8_format)))
                for j in range(rope_dim):
                    x = VALS[i, nope_dim + j]
                    ROPE[ROWS[i], j] = bf16_bits(x)
    return f


def store_rows(dim: int, storage: str, fp8_format=None, layout=None):
    """Pool rows of one plane: plane[rows[i]] = vals[i] in ``storage``: fp32 as they are (main or
    index rows), fp8 / fp4 index rows as the bytes _IndexCodec.write stores in the pool's
    ``fp8_format`` and ``layout``. fp8: one float32 scale s = max(amax, 1e-4) / 448 per row (not
    a power of two), codes e4m3fn(v / s) in ``fp8_format``, unclipped in the codec: v / s may
    exceed 448 by rounding and then saturates in the encoder as in lowbit; the stored scale is
    s (fnuz: 2 s). fp4: per 32 values s = pow2_ceil(max(amax, 6 * 2**-126) / 6), codes e2m1(v / s)
    packed in pairs, then the E8M0 scales, at the places ``layout`` gives them. Rows must be
    distinct (-1: skipped)."""
    width, dtype = index_plane_row(dim, storage)
    check_index_format(storage, fp8_format, layout)
    fp8 = storage == "fp8"

    @T.prim_func
    def f(plane: T.handle, rows: T.handle, vals: T.handle):
        r = T.int64()  # 64-bit offsets (see "Pool rows")
        n = T.int32()
        PLANE = T.match_buffer(plane, (r, width), dtype)
        ROWS = T.match_buffer(rows, (n,), "int32")
        VALS = T.match_buffer(vals, (n, dim), F32)
        for i in T.parallel(n):
            if ROWS[i] >= 0:  # -1: no row (a step slot without an entry to store)
                amax = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
                scale = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
                if storage == "fp32":
                    for j in range(dim):
                        PLANE[ROWS[i], j] = VALS[i, j]
                elif fp8:
                    _amax_bits(VALS, i, 0, dim, amax)
                    scale[0] = amax_floor(T.reinterpret(F32, amax[0]), FP8_AMAX_FLOOR) / T.float32(E4M3_MAX)
                    for j in range(dim):
                        x = VALS[i, j] / scale[0]
                        PLANE[ROWS[i], j] = T.Cast("uint8", encode_fp8(x, fp8_format))
                    for b in range(4):  # the scale's float32 bytes, little-endian like the codec's .view(uint8)
                        PLANE[ROWS[i], dim + b] = T.Cast(
                            "uint8", (T.reinterpret("int32", fp8_format_scale(scale[0], fp8_format)) >> (8 * b)) & 255)
                else:
                    for g in range(dim // FP4_GROUP):
                        _amax_bits(VALS, i, g * FP4_GROUP, FP4_GROUP, amax)
                        scale[0] = pow2_ceil_scale(T.reinterpret(F32, amax[0]), FP4_AMAX_FLOOR, E2M1_MAX)
                        for j in range(FP4_GROUP // 2):  # pack_fp4: element 2j in the low nibble
                            x_low = VALS[i, g * FP4_GROUP + 2 * j] / scale[0]
                            x_high = VALS[i, g * FP4_GROUP + 2 * j + 1] / scale[0]
                            low = encode_e2m1(x_low)
                            high = encode_e2m1(x_high)
                            code_at = _fp4_byte(PLANE, ROWS[i], g * (FP4_GROUP // 2) + j, dim, layout, scale=False)
                            PLANE[code_at[0], code_at[1]] = T.Cast("uint8", low | (high << 4))
                        scale_at = _fp4_byte(PLANE, ROWS[i], g, dim, layout, scale=True)
                        PLANE[scale_at[0], scale_at[1]] = T.Cast("uint8", encode_e8m0(scale[0]))
    return f

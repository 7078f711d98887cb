"""Each matmul weight format's TIR decode, keyed by the ``artifact.quant`` format name."""

from __future__ import annotations

from tvm import tirx

from dsv4c.codegen.kernels.codecs import (F32, DECODE_FP8, decode_bf16, decode_e8m0, decode_fp4_word, raw_e2m1,
                                          raw_e2m1_by_table, raw_e4m3)

FP8_DECODERS = {"fp8_b128": DECODE_FP8["e4m3fn"], "fp8fnuz_b128": DECODE_FP8["e4m3fnuz"]}  # by dense weight quant


def column_tile(out_dim: int) -> int:
    """Output columns per weight tile: weights are stored as [out / tile, in, tile] so that a
    thread streams one contiguous tile (the compile-time layout for these kernels)."""
    return next(t for t in (64, 16, 8, 1) if out_dim % t == 0)


def weight_storage(out_dim: int, in_dim: int, quant: str) -> list[tuple[tuple, str]]:
    """(shape, dtype) of each stored part of a matmul weight (see ``linear``): the codes or
    values in column tiles [O / tile, I, tile], then their scales when quantized."""
    tiles, tile = out_dim // column_tile(out_dim), column_tile(out_dim)
    if quant in FP8_DECODERS:
        return [((tiles, in_dim, tile), "uint8"), ((tiles, -(-in_dim // 128), tile), F32)]
    if quant == "fp4_g32":
        # Eight e2m1 codes per int32 word along the input dim (input 8i + j on bits 4j..4j+3: the
        # checkpoint's packed bytes, four at a time, little-endian), one E8M0 scale per 32 inputs
        # of a row: the checkpoint's own groups, tiled along the output.
        return [((tiles, in_dim // 8, tile), "int32"), ((tiles, in_dim // 32, tile), "uint8")]
    if quant == "bf16":
        return [((tiles, in_dim, tile), "uint16")]
    return [((tiles, in_dim, tile), F32)]


def weight_value(quant: str, parts, lead: tuple, a, kk, c):
    """float32 value of a stored weight (``parts`` as ``weight_storage`` lists them, TE tensors or
    TIR buffers, with leading indices ``lead``) at column tile a, input kk, tile column c."""
    w = parts[0]
    if quant in FP8_DECODERS:
        return FP8_DECODERS[quant](w[lead + (a, kk, c)]) * parts[1][lead + (a, kk // 128, c)]
    if quant == "fp4_g32":
        return decode_fp4_word(w[lead + (a, kk // 8, c)], kk % 8) * decode_e8m0(parts[1][lead + (a, kk // 32, c)])
    if quant == "bf16":
        return decode_bf16(w[lead + (a, kk, c)])  # BF16 bits: the float32 with the same top half
    return w[lead + (a, kk, c)]


# The CPU matmul kernels decode low-bit codes more cheaply than the decoders above: a code's
# sign and magnitude bits go straight into a float32 (exponent field = the code's exponent),
# whose value is the code's times 2**-RAW_POWER ("raw"; subnormal codes become float32
# subnormals, exact). No scale touches a weight: each scale group's products are summed raw and
# the sum is scaled once (``_matmul_loops``), which halves the vector operations per weight.
# Raw values are tiny, so the products are taken with x times 2**X_BOOST (exact): the GEMV
# boosts each x once for a whole row of weights, the GEMM's panel boosts the raw weights once
# for all rows, which gives the same products bit for bit; either way they stay far from
# float32's subnormal range, and the sums keep full precision. Float32 subnormals must not be
# flushed to zero (DAZ) in the threads that run the kernels: ``runtime.backend_tvm`` refuses a
# process that flushes them.
RAW_POWER = {"fp8_b128": 127 - 7, "fp8fnuz_b128": 127 - 8, "fp4_g32": 126}
X_BOOST = 64

def weight_raw(quant: str, parts, lead: tuple, a, kk, c, fp4_table: bool = False):
    """What the CPU matmul loops multiply x by, for a weight stored as ``weight_value`` reads it:
    the value itself (fp32, BF16), or for scaled formats (value / scale) * 2**-RAW_POWER.
    ``fp4_table``: c runs over vectors of 16 columns on AVX-512 (see raw_e2m1_by_table)."""
    w = parts[0]
    if quant in FP8_DECODERS:
        return raw_e4m3(w[lead + (a, kk, c)])
    if quant == "fp4_g32" and fp4_table:
        return raw_e2m1_by_table(w[lead + (a, kk // 8, c)], kk % 8, tirx.floormod(c, 16))
    if quant == "fp4_g32":
        return raw_e2m1(w[lead + (a, kk // 8, c)], kk % 8)
    if quant == "bf16":
        return decode_bf16(w[lead + (a, kk, c)])
    return w[lead + (a, kk, c)]


def boosted(value):
    """x (in the GEMV) or a raw weight (in the GEMM panel) times 2**X_BOOST, exact."""
    return value * tirx.const(2.0 ** X_BOOST, F32)


def group_scale(quant: str, parts, lead: tuple, a, kk, c):
    """What a sum of boosted raw products over one scale group (the group holding input kk) is
    multiplied by to give a sum of x times weight values: the group's scale times
    2**(RAW_POWER - X_BOOST). Multiplying by the power of two first is exact (scales far below
    2**66), so raw_sum * group_scale has the bits of (raw_sum * 2**(...)) * scale, and a matmul
    loop computes it once per column vector for all its rows."""
    if quant in FP8_DECODERS:
        scale = parts[1][lead + (a, kk // 128, c)]
    else:
        scale = decode_e8m0(parts[1][lead + (a, kk // 32, c)])
    return scale * tirx.const(2.0 ** (RAW_POWER[quant] - X_BOOST), F32)

"""Low-bit scalar codecs as TIR expressions, shared by the kernels.

Low-bit weights and pool rows are decoded, and pool rows encoded, inside the kernels with
integer bit operations (TVM's own float8 cast rounds subnormals wrongly on llvm and its float4
type does not build). The encoders reproduce ``artifact.lowbit`` bit for bit, so a low-bit pool
written here holds the same bytes as one written by ``runtime.kv_pool``'s numpy codecs.
"""

from __future__ import annotations

import struct

from tvm import tirx
from tvm.script import tirx as T

from dsv4c.artifact.lowbit import E2M1_MAX, E4M3_MAX, FP8_EXPONENT_BIAS, FP8_SCALE_FACTOR

F32 = "float32"
NEG_INF = -3.4028234663852886e38


# --------------------------------------------------------------------------- low-bit decoding (TIR exprs)


def _u(x, dtype="int32"):
    return tirx.Cast(dtype, x)


# The low-bit decoders place a code's sign and magnitude bits in a float16, whose exponent field
# takes the code's exponent: the float16 -> float32 conversion is exact, subnormal codes included
# (float16 subnormals; one vcvtph2ps per vector with F16C, whatever the MXCSR denormal flags),
# and a power of two then fixes the exponent bias. A handful of vector operations per code, and
# no selects.


def _i16(value: int):
    return tirx.const(value - 0x10000 if value >= 0x8000 else value, "int16")


def _f16_scaled(bits, power: int):
    """float32 of the float16 with int16 ``bits``, times 2**power (exact)."""
    return tirx.Cast(F32, tirx.reinterpret("float16", bits)) * tirx.const(2.0 ** power, F32)


def _decode_e4m3(code, bias: int):
    """float32 value of an e4m3 byte with exponent bias ``bias``: the sign-extended byte shifted so
    its 7 magnitude bits land on float16 bits 7..13 (sign on 15), then times 2**(15 - bias)."""
    c = tirx.Cast("int16", tirx.reinterpret("int8", code))  # code: a uint8 load
    return _f16_scaled(tirx.shift_left(c, _i16(7)) & _i16(0xBF80), 15 - bias)


def decode_e4m3fn(code):
    """float32 value of an e4m3fn byte (0x7F / 0xFF, NaN, decode as +-480; never in weights)."""
    return _decode_e4m3(code, FP8_EXPONENT_BIAS["e4m3fn"])


def decode_e4m3fnuz(code):
    """float32 value of an e4m3fnuz byte (gfx942): bias 8, no negative zero (0x80, NaN, decodes as -0)."""
    return _decode_e4m3(code, FP8_EXPONENT_BIAS["e4m3fnuz"])


DECODE_FP8 = {"e4m3fn": decode_e4m3fn, "e4m3fnuz": decode_e4m3fnuz}  # by FP8 format (quant_plan.fp8_format)


def decode_e2m1(nibble):
    """float32 value of an e2m1 code (0..15): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6. The sign and
    magnitude bits are placed on float16 bits 15 and 9..11 (then times 2**14) with int32
    operations, not by an arithmetic right shift of the code at the top of an int16: CUDA C
    promotes a 16-bit operand to int before a shift, so that shift did not spread the sign on
    sm90 (negative codes decoded positive; found by scripts/device_check on an H200)."""
    code = tirx.Cast("int32", nibble)
    bits = tirx.shift_left(code & 8, tirx.const(12, "int32")) | tirx.shift_left(code & 7, tirx.const(9, "int32"))
    return _f16_scaled(tirx.Cast("uint16", bits), 14)


def decode_fp4_word(word, index):
    """float32 value of e2m1 code ``index`` (0..7, may be an expression) of an int32 word holding
    eight on bits 4 * index .. 4 * index + 3."""
    return decode_e2m1(tirx.Cast("uint8", tirx.shift_right(word, tirx.Cast("int32", 4 * index)) & tirx.const(15, "int32")))


def decode_e8m0(code):
    return tirx.reinterpret(F32, tirx.shift_left(_u(code, "uint32"), tirx.const(23, "uint32")))


def decode_bf16(bits):
    """float32 value of BF16 bits in a uint16 (exact: the float32 with the same top half)."""
    return tirx.reinterpret(F32, tirx.shift_left(_u(bits, "uint32"), tirx.const(16, "uint32")))


def decode_f32_le(plane, row, first):
    """float32 stored as 4 little-endian bytes at plane[row, first:first + 4]."""
    word = _u(plane[row, first], "uint32")
    for b in range(1, 4):
        word = word | tirx.shift_left(_u(plane[row, first + b], "uint32"), tirx.const(8 * b, "uint32"))
    return tirx.reinterpret(F32, word)


def vector_exp(x):
    """e**x for float32 x in plain arithmetic, so a vectorized loop keeps it in vectors (LLVM calls
    libm's expf once per lane for T.exp): Cephes' expf, x = n ln2 + f with |f| <= ln2 / 2 (ln2 in
    two parts), a degree-6 polynomial for e**f, 2**n built in the exponent field; within ~2 ulp
    of expf. x is clamped to [-87.3, 88.4], where 2**n stays a normal float (e**x of less is ~0)."""
    x = tirx.max(tirx.min(x, tirx.const(88.3762626647949, F32)), tirx.const(-87.3365447505531, F32))
    n = tirx.floor(x * tirx.const(1.44269504088896341, F32) + tirx.const(0.5, F32))
    f = x - n * tirx.const(0.693359375, F32) - n * tirx.const(-2.12194440e-4, F32)
    p = tirx.const(1.9875691500e-4, F32)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * f + tirx.const(c, F32)
    two_n = tirx.reinterpret(F32, tirx.shift_left(tirx.Cast("int32", n) + 127, tirx.const(23, "int32")))
    return (p * f * f + f + tirx.const(1.0, F32)) * two_n


# --------------------------------------------------------------------------- low-bit encoding (TIR exprs)
#
# Mirrors of ``frontend.lowbit``'s encoders in int32 arithmetic on float32 bit patterns, exact
# for every float32 input (NaN included). The Python names below are shared subexpressions, so
# the IR repeats them and TIR's CSE folds them back. (Let-binding them instead trips TVM 0.27's
# NarrowDataType pass: "Detected bound for ... conflicts with memorization".) Kernels bind the
# input to a name first (x = v / s): the encoders repeat x, and repeated loads under a Select
# become one branch per copy, which CSE cannot merge.


def _f32_bits(value: float) -> int:
    """Bit pattern of ``value`` rounded to float32, as a non-negative int."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _bits(x):
    return tirx.reinterpret("int32", x)


def _flag(cond):
    return tirx.Cast("int32", cond)


def abs_bits(x):
    """int32 bits of |x| for float32 x. Bits of non-negative floats order like their values and
    NaNs sort above +inf, so an integer max of these is np.abs(...).max() exactly, NaN included."""
    return _bits(x) & 0x7FFFFFFF


def amax_floor(amax, floor: float):
    """max(amax, floor) as float32, for amax >= 0 (or a NaN without its sign bit): the maximum of
    bit patterns, which keeps a NaN amax like np.maximum does."""
    return tirx.reinterpret(F32, tirx.max(_bits(amax), tirx.const(_f32_bits(floor), "int32")))


def _encode_minifloat(x, man_bits: int, emin: int, max_value: float, sign_bit: int, nan_code=None):
    """int32 code of float32 ``x`` rounded to nearest-even onto a small float, saturating at
    ``max_value``: ``lowbit._encode_minifloat`` step by step. A NaN gives ``nan_code``, or (None)
    the zero code with the NaN's sign bit, as lowbit's e2m1 does."""
    bits = _bits(x)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    # Saturation on bit patterns: min(|x|, max_value) for every non-NaN x; NaN magnitudes are 0.
    magnitude = tirx.Select(is_nan, 0, tirx.min(bits & 0x7FFFFFFF, _f32_bits(max_value)))
    exp_field = magnitude >> 23
    # float32 subnormals share the exponent of the smallest normal and lack the implicit one.
    exponent = tirx.max(exp_field, 1) - 127
    mantissa = (magnitude & 0x7FFFFF) | tirx.shift_left(_flag(exp_field > 0), 23)
    # Right shift from units of 2**(exponent - 23) to the target grid 2**(max(exponent, emin) -
    # man_bits); capped at 25, where every float32 mantissa (< 2**24) rounds to 0.
    shift = tirx.min(23 - man_bits + tirx.max(emin - exponent, 0), 25)
    steps = tirx.shift_right(mantissa, shift)
    remainder = mantissa - tirx.shift_left(steps, shift)
    half = tirx.shift_left(tirx.const(1, "int32"), shift - 1)
    round_up = _flag(remainder > half) | (_flag(remainder == half) & (steps & 1))
    # steps holds the implicit one (normals), so adding it to the shifted exponent field carries.
    code = tirx.shift_left(tirx.max(exponent, emin) - emin, man_bits) + steps + round_up
    code = code | tirx.shift_left((bits >> 31) & 1, sign_bit)
    return code if nan_code is None else tirx.Select(is_nan, nan_code, code)


def encode_e4m3fn(x):
    """e4m3fn code (int32 0..255) of float32 x as ``lowbit.encode_e4m3fn``: nearest-even,
    |x| > 448 saturates to 0x7E / 0xFE, NaN -> 0x7F."""
    return _encode_minifloat(x, 3, -6, E4M3_MAX, 7, nan_code=0x7F)


def e4m3fn_to_fnuz(code):
    """``lowbit.e4m3fn_to_fnuz`` of an int32 e4m3fn code: the same bits, except -0 (0x80, NaN in
    fnuz) becomes +0 and the fn NaNs (0x7F / 0xFF) become the fnuz NaN 0x80."""
    return tirx.Select((code & 0x7F) == 0x7F, 0x80, tirx.Select(code == 0x80, 0, code))


def encode_fp8(x, fp8_format: str):
    """Code (int32) of float32 x, already divided by its e4m3fn scale, in ``fp8_format``: the
    e4m3fn code, re-encoded for fnuz (whose scale is then fp8_format_scale's)."""
    code = encode_e4m3fn(x)
    return code if fp8_format == "e4m3fn" else e4m3fn_to_fnuz(code)


def fp8_format_scale(scale, fp8_format: str):
    """The scale stored with codes of ``encode_fp8``: ``lowbit.fp8_in_format``'s (fnuz: doubled)."""
    factor = FP8_SCALE_FACTOR[fp8_format]
    return scale if factor == 1 else scale * tirx.const(factor, F32)


def encode_e2m1(x):
    """e2m1 code (int32 0..15) of float32 x as ``lowbit.encode_e2m1``: nearest, ties to the even
    code, |x| > 6 saturates, NaN -> a zero code."""
    return _encode_minifloat(x, 1, 0, E2M1_MAX, 3)


def pow2_ceil_scale(amax, floor: float, qmax: float):
    """``lowbit.pow2_ceil_scale(max(amax, floor), qmax)`` as float32, for amax >= 0: the float32
    quotient max(amax, floor) / qmax, then rounded up to a power of two on its bits (exact powers
    stay; inf and NaN pass through). The floor keeps the quotient a normal float32, where adding
    one to the exponent field and clearing the mantissa is that rounding."""
    if floor / qmax < 2.0 ** -126:
        raise ValueError(f"amax floor {floor} / {qmax} would allow subnormal scales")
    ratio = _bits(amax_floor(amax, floor) / tirx.const(qmax, F32))
    exp_field = ratio >> 23
    exact = tirx.Or((ratio & 0x7FFFFF) == 0, exp_field == 255)
    return tirx.reinterpret(F32, tirx.Select(exact, ratio, tirx.shift_left(exp_field + 1, 23)))


def encode_e8m0(scale):
    """e8m0 code (int32) of a power-of-two float32 scale 2**-127..2**127 (its exponent field;
    2**-127 is the subnormal 0x00400000, code 0); NaN -> 0xFF."""
    return (_bits(scale) >> 23) & 0xFF


def bf16_bits(x):
    """uint16 BF16 bits of float32 x as ``lowbit.bf16_bits_from_f32``: nearest-even by adding
    0x7FFF plus the lowest kept bit before truncating; a NaN keeps its top half with the quiet bit."""
    u32 = lambda v: tirx.const(v, "uint32")  # noqa: E731  (uint32: the rounding add may wrap, as in numpy)
    bits = tirx.reinterpret("uint32", x)
    rounded = tirx.shift_right(bits + u32(0x7FFF) + (tirx.shift_right(bits, u32(16)) & u32(1)), u32(16))
    is_nan = (bits & u32(0x7FFFFFFF)) > u32(0x7F800000)
    quiet = tirx.shift_right(bits, u32(16)) | u32(0x40)
    return tirx.Cast("uint16", tirx.Select(is_nan, quiet, rounded))



RAW_E4M3_BITS = 0x87F00000 - (1 << 32)  # a raw e4m3 float's sign and magnitude bits (31, 20..26), as int32


def raw_e4m3(code):
    """float32 with an e4m3 byte's sign and 7 magnitude bits on bits 31 and 20..26: the byte
    sign-extended, shifted, masked."""
    bits = tirx.shift_left(tirx.Cast("int32", tirx.reinterpret("int8", code)), tirx.const(20, "int32"))
    return tirx.reinterpret(F32, bits & tirx.const(RAW_E4M3_BITS, "int32"))


def raw_e4m3_slot(codes, slot: int, lanes: int):
    """raw_e4m3 of every fourth code of a vector of 4 x ``lanes`` FP8 codes (uint8): codes slot,
    slot + 4, ... as a float32 vector of ``lanes``. Each int32 word holds four codes: 16-bit
    arithmetic shifts bring them to the top of either half with the sign spread over the
    exponent's top bits (the odd codes of both halves in one shift, the even ones after one
    more), a 32-bit shift moves the low half's up, a mask clears the rest. Nine operations
    for the four slots where vpmovsxbd + shift + mask take twelve, four of them shuffles
    competing with the shifts for the same vector pipes."""
    halves = T.reinterpret(f"int16x{2 * lanes}", codes)
    four = T.Broadcast(T.int16(4), 2 * lanes)
    top = halves >> four if slot % 2 else (halves << T.Broadcast(T.int16(8), 2 * lanes)) >> four
    bits = T.reinterpret(f"int32x{lanes}", top)
    if slot < 2:
        bits = bits << T.Broadcast(T.int32(16), lanes)
    return T.reinterpret(f"float32x{lanes}", bits & T.Broadcast(T.int32(RAW_E4M3_BITS), lanes))


def raw_e2m1(word, index):
    """float32 with the sign and 3 magnitude bits of e2m1 code ``index`` of an int32 word of
    eight (bits 4 * index .. 4 * index + 3) on bits 31 and 22..24: the code shifted to the top,
    shifted back arithmetically (the sign spreads over the exponent field), masked; the top code
    needs no first shift."""
    top = tirx.shift_left(word, tirx.Cast("int32", 28 - 4 * index))
    bits = tirx.shift_right(top, tirx.const(6, "int32")) & tirx.const(0x81C00000 - (1 << 32), "int32")
    return tirx.reinterpret(F32, bits)


def raw_e2m1_by_table(word, index, lane):
    """raw_e2m1 in a vector of 16 columns on AVX-512 (``lane``: the column's place in it): vpermps
    reads the low 4 bits of each lane's word, shifted (none for code 0), as a place in a vector
    whose lane i holds code i's raw value (a constant). Two operations a code where raw_e2m1
    takes three, with the same bits."""
    table = raw_e2m1(tirx.Cast("int32", lane), 0)
    return T.call_llvm_pure_intrin(F32, "llvm.x86.avx512.permvar.sf.512", table,
                                   tirx.shift_right(word, tirx.Cast("int32", 4 * index)))

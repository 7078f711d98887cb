"""TIR kernels for the CPU (llvm) target, one factory per kernel shape.

Every factory takes only static sizes and returns a ``PrimFunc`` whose token dimension is
symbolic, so one kernel serves every layer of that shape and every step size. Kernel names
encode their parameters; :func:`node_kernels` maps an IR node to the kernels it calls, and is
the single source of those names for the builder (which compiles them) and the manifest
(which the runtime reads).

Low-bit weights and pool rows are decoded, and pool rows encoded, inside the kernels with
integer bit operations (TVM's own float8 cast rounds subnormals wrongly on llvm and its float4
type does not build). The encoders reproduce ``frontend.lowbit`` bit for bit, so a low-bit pool
written here holds the same bytes as one written by ``runtime.kv_pool``'s numpy codecs.
"""

from __future__ import annotations

import functools
import math
import struct

from tvm import te, tirx
from tvm.script import tirx as T

from dsv4c.artifact.lowbit import E2M1_MAX, E4M3_MAX, FP4_AMAX_FLOOR, FP8_AMAX_FLOOR, FP8_FORMATS, FP8_SCALE_FACTOR
from dsv4c.artifact.pool_rows import (FP4_GROUP, FP4_PRESHUFFLED, MAIN_FP8_GROUP, ROW_MAJOR, fp4_code_offset,
                                      fp4_scale_offset, index_plane_row, index_row_bytes_of, main_nope_width)


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
    return _decode_e4m3(code, 7)


def decode_e4m3fnuz(code):
    """float32 value of an e4m3fnuz byte (gfx942): bias 8, no negative zero (0x80, NaN, decodes as -0)."""
    return _decode_e4m3(code, 8)


DECODE_FP8 = {"e4m3fn": decode_e4m3fn, "e4m3fnuz": decode_e4m3fnuz}  # by FP8 format (quant_plan.fp8_format)
FP8_DECODERS = {"fp8_b128": DECODE_FP8["e4m3fn"], "fp8fnuz_b128": DECODE_FP8["e4m3fnuz"]}  # by dense weight quant


def decode_e2m1_high(bits):
    """float32 value of the e2m1 code in bits 12..15 of int16 ``bits`` (lower bits ignored): an
    arithmetic shift puts the magnitude on float16 bits 9..11 and keeps the sign, times 2**14."""
    return _f16_scaled(tirx.shift_right(bits, _i16(3)) & _i16(0x8E00), 14)


def decode_e2m1(nibble):
    """float32 value of an e2m1 code (0..15): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6."""
    return decode_e2m1_high(tirx.shift_left(tirx.Cast("int16", nibble), _i16(12)))


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


# --------------------------------------------------------------------------- GEMM / GEMV


GEMM_ROWS = 8  # the prefill function pads a matmul's rows to blocks of 8 (see relax_step.matmul)
GEMV_ROWS = 4  # rows the decode loop accumulates together, each weight decoded once for all of them
# The GEMM takes its rows in chunks whose x k block (rows x k block of fp32) fits in this many
# bytes, so that the block stays in L2 while each of the tile's panels runs over it. All rows at
# once, 2048 rows' FP8 k block (2 MiB) spilled to L3: chunks of 256 KiB ran 1.26-1.40x faster at
# 2048 rows, 1.0-1.22x at 1024 and 1.0-1.13x at 512 (FP8 Flash shapes; FP4 experts of 768 rows
# 1.12x; Zen 4, AVX-512 and x86-64-v3 code, interleaved A/B, bench/RESULTS.md session 13);
# 128 KiB and 512 KiB did no better.
X_CHUNK_BYTES = 256 * 1024
PANEL_FLOATS = 4096  # a decoded weight panel (columns x k block): 16 KiB, L1-resident
SCALED_PANEL_COLUMNS = 16  # a scaled format's panel: 16 columns by 256 inputs (see _matmul_loops)
SCALED_ROWS = 6  # rows of a scaled format's register tile (see register_tile)
# How far ahead (bytes) the decode loop prefetches the weight tile it streams, by format: the
# best of 512-4096 on Zen 3 (FP8, BF16) and of 0-32768 on Zen 4 (FP4; see _matmul_loops).
# CPUs measured otherwise override it (an LLVM CPU name: what the kernels are built for). Zen 4
# streams BF16 at the rate of a plain streaming sum over the same bytes without the prefetch,
# 1.1-1.3x faster than with 1024 (AVX-512 and x86-64-v3 code, weights in huge pages or not,
# interleaved A/B, bench/RESULTS.md session 14); its FP8 and FP4 rates did not change with it.
# Zen 5 (znver5) keeps the defaults: each was the best or within noise of it there (session 15).
PREFETCH_BYTES = {"fp8_b128": 2048, "fp8fnuz_b128": 2048, "bf16": 1024, "fp4_g32": 2048}
PREFETCH_BYTES_BY_CPU = {"znver4": {"bf16": 0}}
ACC_VECTORS = 8  # vector registers of the direct loop's accumulators: half of AVX2's
# Scratch buffers of the matmul loops live on the thread's stack, where LLVM keeps accumulators
# in registers: TVM would otherwise allocate any of 1 KiB or more from its workspace pool, per
# parallel job, and its StorageRewrite pass merges the buffers of different branches into one
# (dropping this annotation), so CPU builds run without it (CPU_PASS_CONFIG). Python assignments
# inside TVMScript kernels would become such buffers too.
ON_STACK = {"disable_lower_builtin": True}
CPU_PASS_CONFIG = {"tirx.disable_storage_rewrite": True}


def column_tile(out_dim: int) -> int:
    """Output columns per weight tile: weights are stored as [out / tile, in, tile] so that a
    thread streams one contiguous tile (the compile-time layout for these kernels)."""
    return next(t for t in (64, 16, 8, 1) if out_dim % t == 0)


def _cpu_target():
    """The TVM target of the CPU the kernels are built for: the current one (the builder enters
    it), else this host's."""
    import tvm

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        from dsv4c.targets import target_info

        target = target_info("llvm").tvm_target()
    return target


def cpu_vector() -> tuple[int, int]:
    """(float32 lanes, vector registers) of the CPU the kernels are built for. AVX-512: 16 lanes
    and 32 registers; AVX / AVX2: 8 and 16; any other CPU is taken as 4 lanes and 16 registers."""
    from tvm.target import codegen

    target = _cpu_target()
    if codegen.target_has_features("avx512f", target):
        return 16, 32
    return (8 if codegen.target_has_features("avx", target) else 4), 16


def prefetch_bytes(quant: str) -> int:
    """How far ahead the decode loop prefetches a ``quant`` weight tile on the CPU the kernels are
    built for (PREFETCH_BYTES, PREFETCH_BYTES_BY_CPU); 0: not at all."""
    by_cpu = PREFETCH_BYTES_BY_CPU.get(str(_cpu_target().attrs.get("mcpu", "")), {})
    return by_cpu.get(quant, PREFETCH_BYTES.get(quant, 0))


def register_tile(tile: int, scaled: bool) -> tuple[int, int]:
    """(rows, columns) of the GEMM micro-kernel's accumulators, which stay in vector registers:
    two vectors of columns (at most the weight tile) by as many rows as fill 3/8 of the
    registers (AVX2: 6 x 16, 12 accumulators; AVX-512: 12 x 32, 24), leaving the rest to the two
    weight vectors and a broadcast. More independent FMA chains than the 8 that two FMA pipes
    of latency 4 need: 4 rows ran 3-13% slower on Zen 3 (bench/RESULTS.md).

    Scaled formats (FP8, FP4) keep each output's running total beside its group sum, so they
    take SCALED_ROWS rows: on AVX-512 the 6 accumulators and 6 totals of a 16-column panel stay
    in registers (12 rows, which spill the totals, ran 1.25x slower on Zen 4); AVX2 spills its
    totals to the stack either way, and 6 rows beat 3 or 4 there (x86-64-v3 code on Zen 4)."""
    lanes, registers = cpu_vector()
    return SCALED_ROWS if scaled else registers * 3 // 8, math.gcd(tile, 2 * lanes)


# Kernels built with TE as compute definitions: CPU kernels are written out below, GPU targets
# schedule these definitions with dlight.
COMPUTE_DEFINITIONS = frozenset({"linear"})


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


def _matmul_loops(out_dim: int, in_dim: int, quant: str, grouped_rows: bool, columns=T.vectorized, cpu: bool = True,
                  group_major_x: bool = False):
    """The CPU matmul's loops over a range of rows of x [P, (G,) I] (``group_major_x``: x [G, P, I])
    -> y [P, (G,) O] for one column
    tile ``a`` of weight ``w`` (a group or an expert: the parts' leading index), shared by
    ``linear`` and ``expert_linear``. Every output is summed in input order the same way, whichever
    loop runs it and however many rows there are, so results do not depend on the step's size
    (the decode and prefill functions agree bit for bit): from zero with one accumulator; for
    scaled formats (FP8, FP4), the boosted raw products (``weight_raw``, ``boosted``) of each
    group of ``group`` inputs (within one scale group) are summed from zero, and each group's
    sum, scaled (``group_scale``), is added to the output's total in group order.

    ``direct``: up to GEMV_ROWS rows at a time, the weight tile streamed once in memory order
    and decoded in registers (decode steps). For each group, the tile's columns go in chunks
    whose accumulators (rows x chunk) fill ``ACC_VECTORS`` vector registers (FP4: half; FP8
    chunks of four vectors or more sum in slot order, see ``slotted``); the group's codes are
    re-read from L1 by the later chunks, and (scaled formats) its x, boosted once into a stack
    buffer, is broadcast from there.
    ``panel``: for each chunk of rows (X_CHUNK_BYTES), each k block of whole groups and each
    panel of columns, the weights are decoded once into an L1 panel (fp32 weights are read in
    place), then a register-tiled micro-kernel (``register_tile``) runs every block of rows over it: unscaled, its running
    sums go to y; scaled, each group's sum is added to the output's total, which it keeps beside
    the sums over the k block's groups (from y, zero in the first block) and then writes to y.

    GPU builds (not ``cpu``) run the direct loop on weight values (``weight_value``): their
    float32 arithmetic may flush the raw codes' subnormals."""
    tile = column_tile(out_dim)
    decoded = quant != "fp32"
    scaled = cpu and quant in RAW_POWER
    # Groups: FP8 blocks of 128, FP4 scale groups of 32. The CPU's direct loop unrolls k by up
    # to 4 inside a group, FP4 by a word's 8 codes with half the accumulators (with 8, LLVM keeps
    # the words of all chunks live at once and spills them). GPU builds take one input at a
    # time: unrolled, LLVM's AMDGPU backend spent ~27 s on each FP4 expert kernel of Flash (2 s
    # rolled), for a thread whose tile of accumulators does not fit in registers anyway.
    group = math.gcd(in_dim, {"fp4_g32": 32}.get(quant, 128 if scaled else 4))
    unroll = math.gcd(group, 8 if quant == "fp4_g32" else 4) if cpu else 1
    acc_vectors = ACC_VECTORS // 2 if quant == "fp4_g32" else ACC_VECTORS
    # The panel: kc inputs (whole groups when scaled) x pw columns, at most PANEL_FLOATS floats.
    # Scaled formats take narrow panels of many inputs: the micro-kernel writes its totals to y
    # once per k block, and 16 x 256 ran 1.1-1.4x faster than 32 x 128 for FP8 and FP4 on Zen 4
    # (AVX-512 and x86-64-v3 code alike, except FP8 on AVX2: even), single-threaded A/Bs.
    pw = math.gcd(tile, SCALED_PANEL_COLUMNS) if scaled else tile
    kc = next(b for b in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
              if in_dim % b == 0 and b * pw <= max(PANEL_FLOATS, pw * group) and (not scaled or b % group == 0))
    rb, cols = register_tile(pw, scaled) if columns is T.vectorized else (1, 1)
    chunk_rows = max(rb, X_CHUNK_BYTES // (4 * kc) // rb * rb)  # see X_CHUNK_BYTES
    half = rb // 2
    lanes = cpu_vector()[0] if cpu and columns is T.vectorized else tile
    # FP4 codes by table where every vector holds 16 columns (AVX-512; see raw_e2m1_by_table):
    # the GEMV streamed 1.04x and in cache 1.06x faster on Zen 4, interleaved A/B (the decode
    # shares the vector pipes with the FMAs, which the table does not remove).
    fp4_table = cpu and columns is T.vectorized and lanes == 16 and tile % 16 == 0
    decode = functools.partial(weight_raw, fp4_table=fp4_table) if cpu else weight_value
    at = (lambda r, g, i: (r, g, i)) if grouped_rows else (lambda r, g, i: (r, i))  # noqa: E731
    x_index = (lambda r, g, i: (g, r, i)) if group_major_x else at  # noqa: E731

    panel_value = boosted if scaled else (lambda w: w)  # noqa: E731  (the panel's decoded weights)

    def chunk(R):  # the direct loop's columns per chunk for R rows: a power-of-two count of vectors
        vectors = max(1, acc_vectors // R)
        return math.gcd(tile, (1 << (vectors.bit_length() - 1)) * lanes)

    def vector(R):  # the columns of one vector of a chunk (the whole chunk if narrower)
        return math.gcd(chunk(R), lanes)

    # Software prefetch of the streamed FP8 / BF16 / FP4 tile, prefetch_bytes ahead: each unrolled
    # step of the direct loop's first chunk touches the cache lines the reads will need that far
    # on. On Zen 3 (~35 GB/s read bandwidth), interleaved A/B on 8192 x 4096 weights: FP8 ~24 ->
    # ~30 GB/s, BF16 ~24 -> ~26.5. fp32 streams near the bandwidth without it (and lost ~10% with
    # it: four lines a row). FP4 experts (6 of 16, 128 KiB per expert's tile) on Zen 4, where the
    # table decodes fast enough for memory to matter: 20-23 -> 26.7-29.0 GB/s, near their
    # in-cache rate; 2048-4096 bytes were best. A stored row of the tile (``parts[0]``'s
    # second-to-last index) holds one input of FP8 / BF16, a word of eight of FP4.
    ahead_bytes = prefetch_bytes(quant) if cpu else 0
    prefetched = ahead_bytes > 0
    inputs_per_row = 8 if quant == "fp4_g32" else 1
    row_bytes = tile * {"bf16": 2, "fp4_g32": 4}.get(quant, 1)
    step_lines = max(1, unroll // inputs_per_row * row_bytes // 64)
    ahead = max(1, ahead_bytes // row_bytes)

    @T.macro
    def prefetch(parts, w, a, k):  # k: the input the step starts at
        for line in T.unroll(step_lines):
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(parts[0][
                w, a, k // inputs_per_row + ahead + line * 64 // row_bytes, line * 64 % row_bytes * tile // row_bytes]),
                0, 3, 1))

    def x_at(X, xs, g, first, r, kg, i):  # the direct loop's x: input i of group kg, boosted when scaled
        return xs[r, i] if scaled else X[x_index(first + r, g, kg * group + i)]

    def total(previous, raw_sum, scale):  # a group's sum added to the total
        return previous + raw_sum * scale if scaled else raw_sum

    # FP8 chunks of at least four vectors go in slot order: each input's codes for the chunk's C
    # columns are read as C / 4 int32 words, and accumulator vector j (of C / 4) sums byte j of
    # every word, columns j, j + 4, ... (raw_e4m3_slot). Each group's sums are shuffled back to
    # column order before they are scaled; each column is still summed in input order, so the
    # bits do not change. In-cache GEMV, one row, three shapes: 40-45 -> 50-60 GB/s on Zen 4,
    # x86-64-v3 code 32-34 -> 40-44 (scratch A/B, bench/RESULTS.md session 9).
    def slotted(R):
        return cpu and quant in FP8_DECODERS and chunk(R) >= 4 * lanes

    def quarter(R):  # columns per slot vector
        return chunk(R) // 4

    @T.macro
    def slot_fma(X, xs, parts, part, w, g, a, first, kg, i, cc, R, j):  # input i of group kg, slot j
        for r in T.unroll(R):
            part[r, T.Ramp(j * quarter(R), 1, quarter(R))] = part[r, T.Ramp(j * quarter(R), 1, quarter(R))] + \
                T.Broadcast(x_at(X, xs, g, first, r, kg, i), quarter(R)) * raw_e4m3_slot(
                    parts[0][w, a, kg * group + i, T.Ramp(cc * chunk(R), 1, chunk(R))], j, quarter(R))

    @T.macro
    def slot_total(parts, acc, part, w, a, kg, cc, R, q):  # the group's sums of columns q * C / 4 ..
        for r in T.unroll(R):
            acc[r, T.Ramp(cc * chunk(R) + q * quarter(R), 1, quarter(R))] = total(
                acc[r, T.Ramp(cc * chunk(R) + q * quarter(R), 1, quarter(R))],
                T.Shuffle([part[r, T.Ramp(j * quarter(R), 1, quarter(R))] for j in range(4)],
                          [n % 4 * quarter(R) + n // 4 for n in range(q * quarter(R), (q + 1) * quarter(R))]),
                group_scale(quant, parts, (w,), a, kg * group, T.Ramp(cc * chunk(R) + q * quarter(R), 1, quarter(R))))

    @T.macro
    def direct(X, parts, Y, w, g, a, first, R):
        acc = T.alloc_buffer((R, tile), F32, scope="local", annotations=ON_STACK)
        for r in T.unroll(R):
            for c in columns(tile):
                acc[r, c] = T.float32(0)
        for kg in range(in_dim // group):
            # Scaled formats: the group's x boosted once for all chunks of columns, which then
            # broadcast it from memory (a load, no vector operation).
            xs = T.alloc_buffer((R, group) if scaled else (1, 1), F32, scope="local", annotations=ON_STACK)
            if scaled:
                for r in T.unroll(R):
                    for i in columns(group):
                        xs[r, i] = boosted(X[x_index(first + r, g, kg * group + i)])
            for cc in range(tile // chunk(R)):
                # This chunk's accumulators, which LLVM keeps in registers over the group.
                part = T.alloc_buffer((R, chunk(R)), F32, scope="local", annotations=ON_STACK)
                for r in T.unroll(R):
                    for c in columns(chunk(R)):
                        part[r, c] = T.float32(0) if scaled else acc[r, cc * chunk(R) + c]
                for ko in range(group // unroll):
                    if prefetched and cc == 0:
                        prefetch(parts, w, a, kg * group + ko * unroll)
                    if slotted(R):
                        for u in T.unroll(unroll):
                            # The slot is a Python value in each call: it picks the decode's operations.
                            slot_fma(X, xs, parts, part, w, g, a, first, kg, ko * unroll + u, cc, R, 3)
                            slot_fma(X, xs, parts, part, w, g, a, first, kg, ko * unroll + u, cc, R, 2)
                            slot_fma(X, xs, parts, part, w, g, a, first, kg, ko * unroll + u, cc, R, 1)
                            slot_fma(X, xs, parts, part, w, g, a, first, kg, ko * unroll + u, cc, R, 0)
                    else:
                        for v in T.unroll(chunk(R) // vector(R)):
                            for u in T.unroll(unroll):
                                for r in T.unroll(R):
                                    for c in columns(vector(R)):
                                        part[r, v * vector(R) + c] = part[r, v * vector(R) + c] + \
                                            x_at(X, xs, g, first, r, kg, ko * unroll + u) * \
                                            decode(quant, parts, (w,), a, kg * group + ko * unroll + u,
                                                   cc * chunk(R) + v * vector(R) + c)
                if slotted(R):
                    slot_total(parts, acc, part, w, a, kg, cc, R, 0)
                    slot_total(parts, acc, part, w, a, kg, cc, R, 1)
                    slot_total(parts, acc, part, w, a, kg, cc, R, 2)
                    slot_total(parts, acc, part, w, a, kg, cc, R, 3)
                else:
                    for r in T.unroll(R):
                        for c in columns(chunk(R)):
                            acc[r, cc * chunk(R) + c] = total(acc[r, cc * chunk(R) + c], part[r, c], group_scale(
                                quant, parts, (w,), a, kg * group, cc * chunk(R) + c) if scaled else 1)
        for r in T.unroll(R):
            for c in columns(tile):
                Y[at(first + r, g, a * tile + c)] = acc[r, c]

    @T.macro
    def direct_rows(X, parts, Y, w, g, a, first, count):
        for b in range((count + GEMV_ROWS - 1) // GEMV_ROWS):
            if count - b * GEMV_ROWS >= 4:
                direct(X, parts, Y, w, g, a, first + b * GEMV_ROWS, 4)
            elif count - b * GEMV_ROWS == 3:
                direct(X, parts, Y, w, g, a, first + b * GEMV_ROWS, 3)
            elif count - b * GEMV_ROWS == 2:
                direct(X, parts, Y, w, g, a, first + b * GEMV_ROWS, 2)
            else:
                direct(X, parts, Y, w, g, a, first + b * GEMV_ROWS, 1)

    def weight(panel, parts, w, a, k, ki, pb, pc):  # input k (ki in the k block), panel pb's column pc
        return panel[ki, pc] if decoded else weight_raw(quant, parts, (w,), a, k, pb * pw + pc)

    @T.macro
    def micro(X, panel, parts, Y, w, g, a, row, pb, cs, kb, R):
        acc = T.alloc_buffer((R, cols), F32, scope="local", annotations=ON_STACK)
        scales = T.alloc_buffer((cols,) if scaled else (1,), F32, scope="local", annotations=ON_STACK)
        # Scaled formats: each output's total so far (zero before the first group, then y) beside
        # the group's sum, written back once after the k block's groups.
        totals = T.alloc_buffer((R, cols) if scaled else (1, 1), F32, scope="local", annotations=ON_STACK)
        if scaled:
            for r in T.unroll(R):
                for c in T.vectorized(cols):
                    totals[r, c] = T.if_then_else(kb == 0, T.float32(0), Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)])
        for kg in range(kc // group if scaled else 1):
            if scaled or kb == 0:
                for r in T.unroll(R):
                    for c in T.vectorized(cols):
                        acc[r, c] = T.float32(0)
            else:
                for r in T.unroll(R):
                    for c in T.vectorized(cols):
                        acc[r, c] = Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)]
            for ki in range(group if scaled else kc):
                for r in T.unroll(R):
                    for c in T.vectorized(cols):
                        acc[r, c] = acc[r, c] + X[x_index(row + r, g, kb * kc + kg * group + ki)] * \
                            weight(panel, parts, w, a, kb * kc + kg * group + ki, kg * group + ki, pb, cs * cols + c)
            if scaled:
                # The group's scales, once for all rows.
                for c in T.vectorized(cols):
                    scales[c] = group_scale(quant, parts, (w,), a, kb * kc + kg * group, pb * pw + cs * cols + c)
                for r in T.unroll(R):
                    for c in T.vectorized(cols):
                        totals[r, c] = total(totals[r, c], acc[r, c], scales[c])
            else:
                for r in T.unroll(R):
                    for c in T.vectorized(cols):
                        Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)] = acc[r, c]
        if scaled:
            for r in T.unroll(R):
                for c in T.vectorized(cols):
                    Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)] = totals[r, c]

    @T.macro
    def panel_chunk(X, parts, Y, w, g, a, first, count):
        panel = T.alloc_buffer((kc, pw) if decoded else (1, 1), F32, scope="local", annotations=ON_STACK)
        for kb in range(in_dim // kc):
            for pb in range(tile // pw):
                if decoded:
                    for ki in range(kc):
                        for c in T.vectorized(pw):
                            panel[ki, c] = panel_value(decode(quant, parts, (w,), a, kb * kc + ki, pb * pw + c))
                # Row blocks of rb, then one of rb / 2 if that many are left, then single rows; each
                # block's x (rows x k block) stays in L1 across the panel's column strips.
                for b in range(count // rb):
                    for cs in range(pw // cols):
                        micro(X, panel, parts, Y, w, g, a, first + b * rb, pb, cs, kb, rb)
                if half > 0:
                    if count % rb >= half:
                        for cs in range(pw // cols):
                            micro(X, panel, parts, Y, w, g, a, first + count // rb * rb, pb, cs, kb, half)
                    for r in range(count % rb % half):
                        for cs in range(pw // cols):
                            micro(X, panel, parts, Y, w, g, a, first + count - count % rb % half + r, pb, cs, kb, 1)

    @T.macro
    def panel_rows(X, parts, Y, w, g, a, first, count):
        # Chunks of rows whose x k block stays in L2 across the tile's panels.
        for rc in range((count + chunk_rows - 1) // chunk_rows):
            panel_chunk(X, parts, Y, w, g, a, first + rc * chunk_rows, T.min(chunk_rows, count - rc * chunk_rows))

    return direct_rows, panel_rows


def linear(out_dim: int, in_dim: int, quant: str, gemv: bool, groups: int = 0, schedule: bool = True):
    """y = x @ W.T with the weight stored in column tiles [O / tile, I, tile]: fp32; FP8 e4m3 (or
    e4m3fnuz) codes with their 128x128 block scales expanded per column and tiled the same way,
    [O / tile, ceil(I/128), tile] (a vector of columns then reads a vector of scales); FP4; or
    BF16 (half the bytes of fp32 for the BF16 tensors of the checkpoint, such as the head).
    GEMV: x [N, I] -> y [N, O]; GEMM: x [B, 8, I] -> y [B, 8, O] (rows padded to blocks of 8).
    ``groups`` > 0: G independent projections, weights [G, O / tile, I, tile], y [..., G, O]; the
    GEMV's x is [N, G, I], the GEMM's group-major, [G, B, 8, I] (step_kernels.pad_rows writes it
    so). Its rows are then 4 * I bytes apart, not G times that: Flash's wo_a (8 groups of 4096
    inputs) had rows 128 KiB apart, which maps every row of a k block to the same few L2 sets;
    group-major, it ran 1.14-1.22x faster over 512 rows (Zen 4, AVX-512 and x86-64-v3 code,
    interleaved A/B, bench/RESULTS.md session 13).

    The CPU kernel (``schedule``) runs ``_matmul_loops`` in parallel over (group, column tile):
    the direct loop for GEMV, the panel loop for GEMM. ``schedule=False`` gives the compute
    definition, which GPU targets schedule."""
    if schedule:
        return _cpu_linear(out_dim, in_dim, quant, gemv, groups)
    if gemv:
        n = te.var("N")
        rows = (n,)
    else:
        n = te.var("B")
        rows = (n, GEMM_ROWS)
    lead = (groups,) if groups else ()
    x = te.placeholder((rows + lead if gemv else lead + rows) + (in_dim,), F32, name="x")
    tile = column_tile(out_dim)
    args = [te.placeholder(lead + shape, dtype, name=name)
            for (shape, dtype), name in zip(weight_storage(out_dim, in_dim, quant), ("w", "s"))]
    tiled = lambda *i: weight_value(quant, args, i[:-3], *i[-3:])  # noqa: E731
    if quant != "fp32" and not gemv:
        # Prefill decodes each weight tile once into a scratch tile that every row block reuses.
        decoded = te.compute(lead + (out_dim // tile, in_dim, tile), tiled, name="w_decoded")
        tiled = lambda *i: decoded[i]  # noqa: E731
    k = te.reduce_axis((0, in_dim), "k")
    x_row = (lambda idx: idx[:-1]) if gemv else (lambda idx: idx[len(rows):-1] + idx[:len(rows)])  # noqa: E731
    y = te.compute(rows + lead + (out_dim,), lambda *idx: te.sum(
        x[x_row(idx) + (k,)] * tiled(*idx[len(rows):-1], idx[-1] // tile, k, idx[-1] % tile), axis=k), name="y")
    return te.create_prim_func([x] + args + [y])


def _cpu_linear(out_dim: int, in_dim: int, quant: str, gemv: bool, groups: int):
    g = max(groups, 1)
    tiles = out_dim // column_tile(out_dim)
    direct_rows, panel_rows = _matmul_loops(out_dim, in_dim, quant, True, group_major_x=not gemv)
    run = direct_rows if gemv else panel_rows
    lead = (groups,) if groups else ()
    outer = (lambda n: (n,)) if gemv else (lambda n: (n, GEMM_ROWS))  # noqa: E731
    rows = (lambda n: n) if gemv else (lambda n: n * GEMM_ROWS)  # noqa: E731
    x_shape = (lambda n: outer(n) + lead) if gemv else (lambda n: lead + outer(n))  # noqa: E731
    x_flat = (lambda n: (rows(n), g)) if gemv else (lambda n: (g, rows(n)))  # noqa: E731
    storage = weight_storage(out_dim, in_dim, quant)
    (w_shape, w_dtype), (s_shape, s_dtype) = storage[0], storage[-1]

    if len(storage) == 2:
        @T.prim_func
        def f(x: T.handle, w: T.handle, s: T.handle, y: T.handle):
            n = T.int32()
            X0 = T.match_buffer(x, x_shape(n) + (in_dim,), F32)
            W0 = T.match_buffer(w, lead + w_shape, w_dtype)
            S0 = T.match_buffer(s, lead + s_shape, s_dtype)
            Y0 = T.match_buffer(y, outer(n) + lead + (out_dim,), F32)
            X = T.decl_buffer(x_flat(n) + (in_dim,), F32, data=X0.data)
            W = T.decl_buffer((g,) + w_shape, w_dtype, data=W0.data)
            S = T.decl_buffer((g,) + s_shape, s_dtype, data=S0.data)
            Y = T.decl_buffer((rows(n), g, out_dim), F32, data=Y0.data)
            for job in T.parallel(g * tiles):
                run(X, (W, S), Y, job // tiles, job // tiles, job % tiles, 0, rows(n))
        return f

    @T.prim_func
    def f(x: T.handle, w: T.handle, y: T.handle):
        n = T.int32()
        X0 = T.match_buffer(x, x_shape(n) + (in_dim,), F32)
        W0 = T.match_buffer(w, lead + w_shape, w_dtype)
        Y0 = T.match_buffer(y, outer(n) + lead + (out_dim,), F32)
        X = T.decl_buffer(x_flat(n) + (in_dim,), F32, data=X0.data)
        W = T.decl_buffer((g,) + w_shape, w_dtype, data=W0.data)
        Y = T.decl_buffer((rows(n), g, out_dim), F32, data=Y0.data)
        for job in T.parallel(g * tiles):
            run(X, (W,), Y, job // tiles, job // tiles, job % tiles, 0, rows(n))
    return f


def expert_linear(out_dim: int, in_dim: int, quant: str, n_experts: int, max_lanes: int = 0):
    """y[p] = x[p] @ W[e].T for the rows p of each expert e's group, offsets[e] <= p <
    offsets[e + 1] (rows sorted by expert, see step_kernels.moe_group); weights stacked
    [E, O / tile, I, tile] in any ``linear`` format. One kernel for decode and prefill, in
    parallel over (column tile, expert), tile-major so both halves of the jobs hold every
    expert: a group of up to GEMV_ROWS rows runs ``_matmul_loops``' direct loop, a larger one
    the panel loop; an expert without rows costs nothing. Summed like ``linear``, so an
    expert's rows get the same bits whatever the group's size. GPU builds (``max_lanes``) run
    the direct loop, with column vectors of at most ``max_lanes``."""
    tile = column_tile(out_dim)
    tiles = out_dim // tile
    columns = T.vectorized if not max_lanes or tile <= max_lanes else T.serial
    cpu = not max_lanes
    direct_rows, panel_rows = _matmul_loops(out_dim, in_dim, quant, False, columns, cpu)
    storage = [((n_experts,) + shape, dtype) for shape, dtype in weight_storage(out_dim, in_dim, quant)]
    (w_shape, w_dtype), (s_shape, s_dtype) = storage[0], storage[-1]

    @T.macro
    def body(X, OFF, parts, Y, job):  # expert job % E, column tile job // E
        if cpu and OFF[job % n_experts + 1] - OFF[job % n_experts] > GEMV_ROWS:
            panel_rows(X, parts, Y, job % n_experts, 0, job // n_experts, OFF[job % n_experts],
                       OFF[job % n_experts + 1] - OFF[job % n_experts])
        else:
            direct_rows(X, parts, Y, job % n_experts, 0, job // n_experts, OFF[job % n_experts],
                        OFF[job % n_experts + 1] - OFF[job % n_experts])

    if len(storage) == 2:
        @T.prim_func
        def f(x: T.handle, offsets: T.handle, w: T.handle, s: T.handle, y: T.handle):
            p = T.int32()
            X = T.match_buffer(x, (p, in_dim), F32)
            OFF = T.match_buffer(offsets, (n_experts + 1,), "int32")
            W = T.match_buffer(w, w_shape, w_dtype)
            S = T.match_buffer(s, s_shape, s_dtype)
            Y = T.match_buffer(y, (p, out_dim), F32)
            for job in T.parallel(n_experts * tiles):
                body(X, OFF, (W, S), Y, job)
        return f

    @T.prim_func
    def f(x: T.handle, offsets: T.handle, w: T.handle, y: T.handle):
        p = T.int32()
        X = T.match_buffer(x, (p, in_dim), F32)
        OFF = T.match_buffer(offsets, (n_experts + 1,), "int32")
        W = T.match_buffer(w, w_shape, w_dtype)
        Y = T.match_buffer(y, (p, out_dim), F32)
        for job in T.parallel(n_experts * tiles):
            body(X, OFF, (W,), Y, job)
    return f


# --------------------------------------------------------------------------- elementwise / small


def embed(vocab: int, dim: int):
    @T.prim_func
    def f(tok: T.handle, tab: T.handle, out: T.handle):
        n = T.int32()
        TOK = T.match_buffer(tok, (n,), "int32")
        TAB = T.match_buffer(tab, (vocab, dim), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for i in T.parallel(n):
            for j in range(dim):
                OUT[i, j] = TAB[TOK[i], j]
    return f


def rmsnorm(dim: int, eps: float, weighted: bool):
    @T.prim_func
    def f(x: T.handle, w: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, dim), F32)
        W = T.match_buffer(w, (dim,), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for i in T.parallel(n):
            acc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            acc[0] = T.float32(0)
            for j in range(dim):
                acc[0] = acc[0] + X[i, j] * X[i, j]
            for j in range(dim):
                OUT[i, j] = X[i, j] * (T.float32(1) / T.sqrt(acc[0] / T.float32(dim) + T.float32(eps))) * \
                    T.if_then_else(weighted, W[j], T.float32(1))
    return f


ROPE_HEAD_BLOCK = 8  # heads per parallel job of the rope kernels, which share one token's cos / sin


# A job of the rope kernels is (token, block of hb heads). Their indices are written out where
# they are used: named (a Bind), each one cost a workspace allocation per head on the CPU.
def _job_token(job, heads: int, hb: int):
    return job // (heads // hb)


def _job_head(job, heads: int, hb: int, hh):
    return job % (heads // hb) * hb + hh


def _rotation(half: int):
    """A macro that fills trig[p] = (cos, sin) of the angle of pair p at token i's position."""
    @T.macro
    def rotation(POS, INV, i, trig):
        for p in range(half):
            trig[p, 0] = T.cos(T.Cast(F32, POS[i]) * INV[p])
            trig[p, 1] = T.sin(T.Cast(F32, POS[i]) * INV[p])
    return rotation


def _pair_rotation(half: int, nope: int, value, sign: float = 1.0):
    """A macro that writes the GPT-J rotation of channel pairs (nope + 2p, nope + 2p + 1) of
    token i's head h: OUT from ``value(src, i, h, channel)``, the channel's value before the
    rotation (``src``: the buffers it reads), by trig from ``_rotation``; sign -1 rotates back."""
    @T.macro
    def rotate_pairs(src, OUT, trig, i, h):
        for p in range(half):
            OUT[i, h, nope + 2 * p] = value(src, i, h, nope + 2 * p) * trig[p, 0] - \
                value(src, i, h, nope + 2 * p + 1) * (trig[p, 1] * T.float32(sign))
            OUT[i, h, nope + 2 * p + 1] = value(src, i, h, nope + 2 * p + 1) * trig[p, 0] + \
                value(src, i, h, nope + 2 * p) * (trig[p, 1] * T.float32(sign))
    return rotate_pairs


def rope(heads: int, dim: int, rope_dim: int, inverse: bool):
    """GPT-J rotation of the trailing rope_dim channels of x [N, heads, dim] at positions [N], in
    parallel over (token, block of heads)."""
    half = rope_dim // 2
    nope = dim - rope_dim
    sign = -1.0 if inverse else 1.0
    hb = math.gcd(heads, ROPE_HEAD_BLOCK)
    rotation = _rotation(half)
    rotate_pairs = _pair_rotation(half, nope, lambda src, i, h, j: src[0][i, h, j], sign)

    @T.macro
    def rotate(X, OUT, trig, i, h):  # token i's head h
        for j in range(nope):
            OUT[i, h, j] = X[i, h, j]
        rotate_pairs((X,), OUT, trig, i, h)

    @T.prim_func
    def f(x: T.handle, pos: T.handle, inv: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, heads, dim), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        INV = T.match_buffer(inv, (half,), F32)
        OUT = T.match_buffer(out, (n, heads, dim), F32)
        for ib in T.parallel(n * (heads // hb)):
            trig = T.alloc_buffer((half, 2), F32, scope="local", annotations=ON_STACK)
            rotation(POS, INV, _job_token(ib, heads, hb), trig)
            for hh in range(hb):
                rotate(X, OUT, trig, _job_token(ib, heads, hb), _job_head(ib, heads, hb, hh))
    return f


def rmsnorm_rope(heads: int, dim: int, rope_dim: int, eps: float, weighted: bool, max_lanes: int = 0):
    """rmsnorm over each head's ``dim`` channels (times w when weighted), then the GPT-J rotation
    of the trailing ``rope_dim`` channels at the token's position; in parallel over (token,
    block of heads). On the CPU the sum of squares runs in vector lanes (each lane in channel
    order, the lanes added last) and the scaling in vectors; GPU builds (``max_lanes``) sum in
    one lane."""
    half = rope_dim // 2
    nope = dim - rope_dim
    hb = math.gcd(heads, ROPE_HEAD_BLOCK)
    rotation = _rotation(half)
    lanes = 1 if max_lanes else math.gcd(dim, cpu_vector()[0])
    columns = T.serial if max_lanes else T.vectorized

    def normed(X, W, acc, i, h, j):
        return X[i, h, j] * acc[0] * T.if_then_else(weighted, W[j], T.float32(1))

    rotate_pairs = _pair_rotation(half, nope, lambda src, i, h, j: normed(*src, i, h, j))

    @T.macro
    def normalize(X, W, OUT, acc, part, trig, i, h):
        for l in columns(lanes):
            part[l] = T.float32(0)
        for jj in range(dim // lanes):
            for l in columns(lanes):
                part[l] = part[l] + X[i, h, jj * lanes + l] * X[i, h, jj * lanes + l]
        acc[0] = T.float32(0)
        for l in range(lanes):
            acc[0] = acc[0] + part[l]
        acc[0] = T.float32(1) / T.sqrt(acc[0] / T.float32(dim) + T.float32(eps))
        for jj in range(nope // lanes):
            for l in columns(lanes):
                OUT[i, h, jj * lanes + l] = normed(X, W, acc, i, h, jj * lanes + l)
        for j in range(nope // lanes * lanes, nope):
            OUT[i, h, j] = normed(X, W, acc, i, h, j)
        rotate_pairs((X, W, acc), OUT, trig, i, h)

    @T.prim_func
    def f(x: T.handle, w: T.handle, pos: T.handle, inv: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, heads, dim), F32)
        W = T.match_buffer(w, (dim,), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        INV = T.match_buffer(inv, (half,), F32)
        OUT = T.match_buffer(out, (n, heads, dim), F32)
        for ib in T.parallel(n * (heads // hb)):
            acc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            part = T.alloc_buffer((lanes,), F32, scope="local", annotations=ON_STACK)
            trig = T.alloc_buffer((half, 2), F32, scope="local", annotations=ON_STACK)
            rotation(POS, INV, _job_token(ib, heads, hb), trig)
            for hh in range(hb):
                normalize(X, W, OUT, acc, part, trig, _job_token(ib, heads, hb), _job_head(ib, heads, hb, hh))
    return f


def add(dim: int):
    @T.prim_func
    def f(a: T.handle, b: T.handle, out: T.handle):
        n = T.int32()
        A = T.match_buffer(a, (n, dim), F32)
        B = T.match_buffer(b, (n, dim), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for i in T.parallel(n):
            for j in range(dim):
                OUT[i, j] = A[i, j] + B[i, j]
    return f


def swiglu(dim: int, limit: float, max_lanes: int = 0):
    """In parallel over (row, block of 256 columns): a decode step's few rows still use every core.
    Vectorized along the columns on the CPU (no Python names inside the loop: a name becomes a
    Let, which TVM's vectorizer evaluates for one lane only); GPU builds (``max_lanes``) loop."""
    cb = math.gcd(dim, 256)
    columns = T.serial if max_lanes else T.vectorized

    def silu_clamped(g):
        return g / (tirx.const(1.0, F32) + vector_exp(-g))

    @T.prim_func
    def f(g: T.handle, u: T.handle, out: T.handle):
        n = T.int32()
        G = T.match_buffer(g, (n, dim), F32)
        U = T.match_buffer(u, (n, dim), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for ib in T.parallel(n * (dim // cb)):
            for jj in columns(cb):
                OUT[ib // (dim // cb), ib % (dim // cb) * cb + jj] = silu_clamped(
                    T.min(G[ib // (dim // cb), ib % (dim // cb) * cb + jj], T.float32(limit))) * T.max(
                    T.min(U[ib // (dim // cb), ib % (dim // cb) * cb + jj], T.float32(limit)), T.float32(-limit))
    return f


# --------------------------------------------------------------------------- mHC


def mhc(hc: int, dim: int, iters: int, hc_eps: float, norm_eps: float, with_post: bool, head: bool,
        max_lanes: int = 0):
    """One launch per mHC seam. ``with_post`` first forms the streams h' = post * out + comb^T h
    of the finished sub-layer; then (mhc_pre) the next sub-layer's pre / post / Sinkhorn comb
    are computed from rmsnorm(h') @ fn^T and h' is collapsed with pre; ``head`` computes the
    hc_head's pre only. Per token, everything stays in fp32. On the CPU the sums over h' run in
    vector lanes (each lane in input order, the lanes added last); GPU builds (``max_lanes``)
    sum in one lane."""
    flat = hc * dim
    mix = hc if head else (2 + hc) * hc
    n_scale = 1 if head else 3
    rows = math.gcd(mix, 8)  # mixing rows summed together (8 chains hide the FMA latency)
    lanes = 1 if max_lanes else math.gcd(dim, cpu_vector()[0])
    columns = T.serial if max_lanes else T.vectorized

    @T.macro
    def streams(O, H, POST, COMB, H_OUT, t):
        for k in range(hc):
            for dd in range(dim // lanes):
                for l in columns(lanes):
                    H_OUT[t, k, dd * lanes + l] = POST[t, k] * O[t, dd * lanes + l]
            for j in range(hc):
                for dd in range(dim // lanes):
                    for l in columns(lanes):
                        H_OUT[t, k, dd * lanes + l] = H_OUT[t, k, dd * lanes + l] + \
                            COMB[t, j, k] * H[t, j, dd * lanes + l]

    @T.macro
    def coefficients(SRC, FN, BASE, SCALE, Y, PRE_OUT, POST_OUT, COMB_OUT, t):
        acc = T.alloc_buffer((2,), F32, scope="local", annotations=ON_STACK)
        part = T.alloc_buffer((rows, lanes), F32, scope="local", annotations=ON_STACK)
        m = T.alloc_buffer((mix,), F32, scope="local", annotations=ON_STACK)
        pre = T.alloc_buffer((hc,), F32, scope="local", annotations=ON_STACK)
        c = T.alloc_buffer((hc, hc), F32, scope="local", annotations=ON_STACK)
        for l in columns(lanes):  # the sum of squares (rmsnorm), in part's first row
            part[0, l] = T.float32(0)
        for k in range(hc):
            for dd in range(dim // lanes):
                for l in columns(lanes):
                    part[0, l] = part[0, l] + SRC[t, k, dd * lanes + l] * SRC[t, k, dd * lanes + l]
        acc[0] = T.float32(0)
        for l in range(lanes):
            acc[0] = acc[0] + part[0, l]
        acc[0] = T.float32(1) / T.sqrt(acc[0] / T.float32(flat) + T.float32(norm_eps))
        for rr in range(mix // rows):  # rows of fn together: independent sums
            for u in T.unroll(rows):
                for l in columns(lanes):
                    part[u, l] = T.float32(0)
            for k in range(hc):
                for dd in range(dim // lanes):
                    for u in T.unroll(rows):
                        for l in columns(lanes):
                            part[u, l] = part[u, l] + SRC[t, k, dd * lanes + l] * FN[rr * rows + u, k * dim + dd * lanes + l]
            for u in T.unroll(rows):
                acc[1] = T.float32(0)
                for l in range(lanes):
                    acc[1] = acc[1] + part[u, l]
                m[rr * rows + u] = acc[1] * acc[0]
        for j in range(hc):
            pre[j] = T.float32(1) / (T.float32(1) + T.exp(-(m[j] * SCALE[0] + BASE[j]))) + T.float32(hc_eps)
        if not head:
            for j in range(hc):
                POST_OUT[t, j] = T.float32(2) / (T.float32(1) + T.exp(-(m[hc + j] * SCALE[1] + BASE[hc + j])))
            for r in range(hc):  # row softmax + eps
                acc[0] = T.float32(NEG_INF)
                for k in range(hc):
                    acc[0] = T.max(acc[0], m[2 * hc + r * hc + k] * SCALE[2] + BASE[2 * hc + r * hc + k])
                acc[1] = T.float32(0)
                for k in range(hc):
                    c[r, k] = T.exp(m[2 * hc + r * hc + k] * SCALE[2] + BASE[2 * hc + r * hc + k] - acc[0])
                    acc[1] = acc[1] + c[r, k]
                for k in range(hc):
                    c[r, k] = c[r, k] / acc[1] + T.float32(hc_eps)
            for it in range(2 * iters - 1):  # columns first, then rows / columns alternately
                if it % 2 == 0:
                    for k in range(hc):
                        acc[0] = T.float32(0)
                        for r in range(hc):
                            acc[0] = acc[0] + c[r, k]
                        for r in range(hc):
                            c[r, k] = c[r, k] / (acc[0] + T.float32(hc_eps))
                else:
                    for r in range(hc):
                        acc[0] = T.float32(0)
                        for k in range(hc):
                            acc[0] = acc[0] + c[r, k]
                        for k in range(hc):
                            c[r, k] = c[r, k] / (acc[0] + T.float32(hc_eps))
            for r in range(hc):
                for k in range(hc):
                    COMB_OUT[t, r, k] = c[r, k]
        for dd in range(dim // lanes):
            for l in columns(lanes):
                Y[t, dd * lanes + l] = T.float32(0)
            for j in range(hc):
                for l in columns(lanes):
                    Y[t, dd * lanes + l] = Y[t, dd * lanes + l] + pre[j] * SRC[t, j, dd * lanes + l]

    if with_post and not head:
        @T.prim_func
        def f(o: T.handle, h: T.handle, post: T.handle, comb: T.handle, fn: T.handle, base: T.handle,
              scale: T.handle, h_out: T.handle, y: T.handle, post_out: T.handle, comb_out: T.handle):
            n = T.int32()
            O = T.match_buffer(o, (n, dim), F32)
            H = T.match_buffer(h, (n, hc, dim), F32)
            POST = T.match_buffer(post, (n, hc), F32)
            COMB = T.match_buffer(comb, (n, hc, hc), F32)
            FN = T.match_buffer(fn, (mix, flat), F32)
            BASE = T.match_buffer(base, (mix,), F32)
            SCALE = T.match_buffer(scale, (n_scale,), F32)
            H_OUT = T.match_buffer(h_out, (n, hc, dim), F32)
            Y = T.match_buffer(y, (n, dim), F32)
            POST_OUT = T.match_buffer(post_out, (n, hc), F32)
            COMB_OUT = T.match_buffer(comb_out, (n, hc, hc), F32)
            for t in T.parallel(n):
                streams(O, H, POST, COMB, H_OUT, t)
                coefficients(H_OUT, FN, BASE, SCALE, Y, Y, POST_OUT, COMB_OUT, t)
        return f
    if with_post:
        @T.prim_func
        def f(o: T.handle, h: T.handle, post: T.handle, comb: T.handle, fn: T.handle, base: T.handle,
              scale: T.handle, h_out: T.handle, y: T.handle):
            n = T.int32()
            O = T.match_buffer(o, (n, dim), F32)
            H = T.match_buffer(h, (n, hc, dim), F32)
            POST = T.match_buffer(post, (n, hc), F32)
            COMB = T.match_buffer(comb, (n, hc, hc), F32)
            FN = T.match_buffer(fn, (mix, flat), F32)
            BASE = T.match_buffer(base, (mix,), F32)
            SCALE = T.match_buffer(scale, (n_scale,), F32)
            H_OUT = T.match_buffer(h_out, (n, hc, dim), F32)
            Y = T.match_buffer(y, (n, dim), F32)
            for t in T.parallel(n):
                streams(O, H, POST, COMB, H_OUT, t)
                coefficients(H_OUT, FN, BASE, SCALE, Y, Y, Y, Y, t)
        return f
    if not head:
        @T.prim_func
        def f(h: T.handle, fn: T.handle, base: T.handle, scale: T.handle, y: T.handle, post_out: T.handle,
              comb_out: T.handle):
            n = T.int32()
            H = T.match_buffer(h, (n, hc, dim), F32)
            FN = T.match_buffer(fn, (mix, flat), F32)
            BASE = T.match_buffer(base, (mix,), F32)
            SCALE = T.match_buffer(scale, (n_scale,), F32)
            Y = T.match_buffer(y, (n, dim), F32)
            POST_OUT = T.match_buffer(post_out, (n, hc), F32)
            COMB_OUT = T.match_buffer(comb_out, (n, hc, hc), F32)
            for t in T.parallel(n):
                coefficients(H, FN, BASE, SCALE, Y, Y, POST_OUT, COMB_OUT, t)
        return f

    @T.prim_func
    def f(h: T.handle, fn: T.handle, base: T.handle, scale: T.handle, y: T.handle):
        n = T.int32()
        H = T.match_buffer(h, (n, hc, dim), F32)
        FN = T.match_buffer(fn, (mix, flat), F32)
        BASE = T.match_buffer(base, (mix,), F32)
        SCALE = T.match_buffer(scale, (n_scale,), F32)
        Y = T.match_buffer(y, (n, dim), F32)
        for t in T.parallel(n):
            coefficients(H, FN, BASE, SCALE, Y, Y, Y, Y, t)
    return f


def hc_expand(hc: int, dim: int):
    @T.prim_func
    def f(x: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, dim), F32)
        OUT = T.match_buffer(out, (n, hc, dim), F32)
        for t in T.parallel(n):
            for j in range(hc):
                for d in range(dim):
                    OUT[t, j, d] = X[t, d]
    return f


def mhc_post(hc: int, dim: int):
    """h'[k] = post[k] * out + sum_j comb[j, k] * h[j]."""
    @T.prim_func
    def f(o: T.handle, h: T.handle, post: T.handle, comb: T.handle, out: T.handle):
        n = T.int32()
        O = T.match_buffer(o, (n, dim), F32)
        H = T.match_buffer(h, (n, hc, dim), F32)
        POST = T.match_buffer(post, (n, hc), F32)
        COMB = T.match_buffer(comb, (n, hc, hc), F32)
        OUT = T.match_buffer(out, (n, hc, dim), F32)
        for t in T.parallel(n):
            for k in range(hc):
                for d in range(dim):
                    OUT[t, k, d] = POST[t, k] * O[t, d]
                    for j in range(hc):
                        OUT[t, k, d] = OUT[t, k, d] + COMB[t, j, k] * H[t, j, d]
    return f


# --------------------------------------------------------------------------- MoE routing and top-k


def route_scores(n_experts: int):
    """sqrt(softplus(logits)), the router's scores (softplus written overflow-free)."""
    @T.prim_func
    def f(lg: T.handle, out: T.handle):
        n = T.int32()
        LG = T.match_buffer(lg, (n, n_experts), F32)
        OUT = T.match_buffer(out, (n, n_experts), F32)
        for t in T.parallel(n):
            for e in range(n_experts):
                OUT[t, e] = T.sqrt(T.max(LG[t, e], T.float32(0)) + T.log(T.float32(1) + T.exp(-T.fabs(LG[t, e]))))
    return f


def add_bias(n_experts: int):
    @T.prim_func
    def f(x: T.handle, b: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, n_experts), F32)
        B = T.match_buffer(b, (n_experts,), F32)
        OUT = T.match_buffer(out, (n, n_experts), F32)
        for t in T.parallel(n):
            for e in range(n_experts):
                OUT[t, e] = X[t, e] + B[e]
    return f


TOPK_LANES = 16  # columns topk_rows compares at a time
INT32_MIN = -(1 << 31)


def _order_key(x):
    """An int32 whose signed order is the float order of x, for x above NEG_INF (-0 and +0 one
    key: the sign bit spread over the magnitude bits of negative floats, flipping them); INT32_MIN
    for NEG_INF, -inf and NaN, which are never picked."""
    bits = T.Select(x == T.float32(0), T.int32(0), tirx.reinterpret("int32", x))
    return T.Select(x > T.float32(NEG_INF), bits ^ ((bits >> 31) & T.int32(0x7FFFFFFF)), T.int32(INT32_MIN))


def topk_rows(k: int, max_lanes: int = 0):
    """Per row, the column numbers of the k largest values, best first, lower columns first
    among equal values; NEG_INF (and -inf, NaN) columns are never picked (-1 fills the rest).

    In O(columns + k^2 / lanes) vector steps per row, without sorting the row: a binary search
    over order keys (``_order_key``) finds the k-th largest, counting the keys above a candidate
    16 at a time (32 counts); one pass keeps the columns above it and, in column order, as many
    equal to it as fit; each kept column's place is the number of kept columns that beat it.
    Same ids as an insertion sort, which cost O(columns x k) scalar steps: 2.7% of a 512-token
    flash prefill at 2048 tokens of context, growing with the context. GPU builds
    (``max_lanes``) count in vectors of at most that many lanes, a row per thread."""
    lanes = min(TOPK_LANES, max_lanes or TOPK_LANES)
    kept_lanes = -(-k // lanes) * lanes

    @T.macro
    def lane_sum(lane_count, total):  # total[0]: the lanes' counts added
        total[0] = 0
        for l in range(lanes):
            total[0] = total[0] + lane_count[l]

    @T.macro
    def count_above(X, t, c, lane_count, total, threshold):  # total[0]: columns whose key > threshold
        for l in T.vectorized(lanes):
            lane_count[l] = 0
        for co in range((c + lanes - 1) // lanes):
            for l in T.vectorized(lanes):
                lane_count[l] = lane_count[l] + T.Select(T.And(
                    co * lanes + l < c, _order_key(X[t, T.min(co * lanes + l, c - 1)]) > threshold), 1, 0)
        lane_sum(lane_count, total)

    @T.prim_func
    def f(x: T.handle, ids: T.handle):
        n = T.int32()
        c = T.int32()
        X = T.match_buffer(x, (n, c), F32)
        IDS = T.match_buffer(ids, (n, k), "int32")
        for t in T.parallel(n):
            lane_count = T.alloc_buffer((lanes,), "int32", scope="local", annotations=ON_STACK)
            total = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            # The largest key below the k-th largest, lo: at least k keys above lo, in [lo, hi].
            lo = T.alloc_buffer((1,), "int64", scope="local", annotations=ON_STACK)
            hi = T.alloc_buffer((1,), "int64", scope="local", annotations=ON_STACK)
            mid = T.alloc_buffer((1,), "int64", scope="local", annotations=ON_STACK)
            threshold = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            key = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            ties = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            kept = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            kept_key = T.alloc_buffer((kept_lanes,), "int32", scope="local", annotations=ON_STACK)
            kept_col = T.alloc_buffer((kept_lanes,), "int32", scope="local", annotations=ON_STACK)
            lo[0] = T.int64(INT32_MIN)
            hi[0] = T.int64(-INT32_MIN - 2)
            count_above(X, t, c, lane_count, total, T.int32(INT32_MIN))
            if total[0] > k:  # else every pickable column is kept
                for _ in range(32):
                    if lo[0] < hi[0]:
                        mid[0] = lo[0] + (hi[0] - lo[0] + 1) // 2
                        count_above(X, t, c, lane_count, total, T.Cast("int32", mid[0]))
                        if total[0] >= k:
                            lo[0] = mid[0]
                        else:
                            hi[0] = mid[0] - 1
            # Keep the keys above the k-th largest, and as many equal to it as fit, in column order.
            threshold[0] = T.Cast("int32", lo[0] + 1)
            count_above(X, t, c, lane_count, total, threshold[0])
            ties[0] = k - total[0]
            kept[0] = 0
            for col in range(c):
                key[0] = _order_key(X[t, col])
                if key[0] > threshold[0] or (key[0] == threshold[0] and ties[0] > 0):
                    if key[0] == threshold[0]:
                        ties[0] = ties[0] - 1
                    kept_key[kept[0]] = key[0]
                    kept_col[kept[0]] = col
                    kept[0] = kept[0] + 1
            # A kept column's place: the kept columns with a larger key, or an equal one to its left.
            for i in range(kept[0]):
                for l in T.vectorized(lanes):
                    lane_count[l] = 0
                for jo in range((kept[0] + lanes - 1) // lanes):
                    for l in T.vectorized(lanes):
                        lane_count[l] = lane_count[l] + T.Select(T.And(jo * lanes + l < kept[0], T.Or(
                            kept_key[jo * lanes + l] > kept_key[i],
                            T.And(kept_key[jo * lanes + l] == kept_key[i], jo * lanes + l < i))), 1, 0)
                lane_sum(lane_count, total)
                IDS[t, total[0]] = kept_col[i]
            for j in range(k - kept[0]):
                IDS[t, kept[0] + j] = -1
    return f


def hash_ids(vocab: int, k: int):
    @T.prim_func
    def f(table: T.handle, tok: T.handle, ids: T.handle):
        n = T.int32()
        TABLE = T.match_buffer(table, (vocab, k), "int32")
        TOK = T.match_buffer(tok, (n,), "int32")
        IDS = T.match_buffer(ids, (n, k), "int32")
        for t in T.parallel(n):
            for j in range(k):
                IDS[t, j] = TABLE[TOK[t], j]
    return f


def route_weights(n_experts: int, k: int, scale: float):
    @T.prim_func
    def f(sc: T.handle, ids: T.handle, w: T.handle):
        n = T.int32()
        SC = T.match_buffer(sc, (n, n_experts), F32)
        IDS = T.match_buffer(ids, (n, k), "int32")
        W = T.match_buffer(w, (n, k), F32)
        for t in T.parallel(n):
            acc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            acc[0] = T.float32(0)
            for j in range(k):
                acc[0] = acc[0] + SC[t, IDS[t, j]]
            for j in range(k):
                W[t, j] = SC[t, IDS[t, j]] / (acc[0] + T.float32(1e-20)) * T.float32(scale)
    return f



# --------------------------------------------------------------------------- low-bit pool rows
#
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


def _check_index_format(storage: str, fp8_format, layout) -> None:
    """Low-bit index rows need the pool's fp8 format and index layout; only fp4 rows are shuffled."""
    if storage == "fp32":
        return
    _check_fp8_format(fp8_format)
    if layout != ROW_MAJOR and (storage, layout) != ("fp4", FP4_PRESHUFFLED):
        raise ValueError(f"{storage} index rows cannot be laid out {layout!r} (fp8: {ROW_MAJOR}; "
                         f"fp4: {ROW_MAJOR} or {FP4_PRESHUFFLED})")


def _check_main_fp8(nope_dim: int, fp8_format) -> None:
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
    _check_main_fp8(nope_dim, fp8_format)
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
    _check_index_format(storage, fp8_format, layout)
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


def _compressor_source(width: int, ratio: int):
    """Reads (kv, score) of a compressor source row: ``src >= 0`` is a row of this step (its
    score is the gate plus ``ape[pos % ratio]``), ``src < 0`` is ring row ``-src - 1`` (stored
    with its ape already added)."""
    @T.macro
    def read(RKV, RSC, KV, GATE, POS, APE, src, col, kv_out, score_out, slot):
        if src >= 0:
            kv_out[slot] = KV[src, col]
            score_out[slot] = GATE[src, col] + APE[POS[src] % ratio, col]
        else:
            kv_out[slot] = RKV[-src - 1, col]
            score_out[slot] = RSC[-src - 1, col]
    return read


def ring_reset(width: int, ring_rows: int):
    """Empties the ring of every request that starts at position 0 in this step (kv 0, score
    -inf: zero weight in pooling), whatever an earlier request left in its slot; runs before
    the step's pooling reads the ring (window -1 of overlapping windows reads it)."""
    @T.prim_func
    def f(ring_kv: T.handle, ring_sc: T.handle, req: T.handle):
        r = T.int32()
        nr = T.int32()
        RKV = T.match_buffer(ring_kv, (r, width), F32)
        RSC = T.match_buffer(ring_sc, (r, width), F32)
        REQ = T.match_buffer(req, (nr, 4), "int32")  # slot, first token, count, first position
        for q in T.parallel(nr):
            if REQ[q, 3] == 0:
                for i in range(ring_rows):
                    for c in range(width):
                        RKV[REQ[q, 0] * ring_rows + i, c] = T.float32(0)
                        RSC[REQ[q, 0] * ring_rows + i, c] = T.float32(NEG_INF)
    return f


def ring_update(width: int, ratio: int, overlap: bool):
    """The compressor ring after this step's closed windows were pooled from it: per request,
    each of its last ``slots`` positions p of the step goes to ring row p mod slots (slots =
    2 ratio with overlap: the previous window and the open one; else ratio). Every position
    owns its row, so what a step writes depends only on the positions it feeds, never on how
    the tokens were chunked, and taking a token back (speculative decoding) restores its rows
    alone (``runtime.kv_pool.KVPool.position_rows``)."""
    read = _compressor_source(width, ratio)
    slots = 2 * ratio if overlap else ratio

    def skipped(REQ, q):  # request q's positions in the step beyond the ring's last ``slots``
        return T.max(REQ[q, 2] - slots, 0)

    def ring_row(REQ, q, i):  # the ring row of request q's i-th position after the skipped ones
        return REQ[q, 0] * slots + T.floormod(REQ[q, 3] + skipped(REQ, q) + i, slots)

    @T.prim_func
    def f(ring_kv: T.handle, ring_sc: T.handle, kv: T.handle, gate: T.handle, pos: T.handle, ape: T.handle,
          req: T.handle):
        r = T.int32()
        n = T.int32()
        nr = T.int32()
        RKV = T.match_buffer(ring_kv, (r, width), F32)
        RSC = T.match_buffer(ring_sc, (r, width), F32)
        KV = T.match_buffer(kv, (n, width), F32)
        GATE = T.match_buffer(gate, (n, width), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        APE = T.match_buffer(ape, (ratio, width), F32)
        REQ = T.match_buffer(req, (nr, 4), "int32")  # slot, first token, count, first position
        for q in T.parallel(nr):
            kv_val = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            score_val = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            # The first skipped(q) positions are overwritten by later ones of this step.
            for i in range(REQ[q, 2] - skipped(REQ, q)):
                for c in range(width):
                    read(RKV, RSC, KV, GATE, POS, APE, REQ[q, 1] + skipped(REQ, q) + i, c, kv_val, score_val, 0)
                    RKV[ring_row(REQ, q, i), c] = kv_val[0]
                    RSC[ring_row(REQ, q, i), c] = score_val[0]
    return f


def compress_pool(width: int, head_dim: int, ratio: int, overlap: bool):
    """Gated pooling of closed windows: out[w, c] = sum_s softmax_s(score)[c] * kv[c] over the
    window's slots src[w, s] (step row if >= 0, ring row -src-1 otherwise), for the windows
    whose entry has a pool row (``rows[w] >= 0``; the others are zero and cost nothing). With
    overlap the first ``ratio`` slots read the first half of the columns, the rest the second half."""
    slots = 2 * ratio if overlap else ratio
    read = _compressor_source(width, ratio)

    @T.prim_func
    def f(ring_kv: T.handle, ring_sc: T.handle, kv: T.handle, gate: T.handle, pos: T.handle, ape: T.handle,
          src: T.handle, rows: T.handle, out: T.handle):
        r = T.int32()
        n = T.int32()
        nw = T.int32()
        RKV = T.match_buffer(ring_kv, (r, width), F32)
        RSC = T.match_buffer(ring_sc, (r, width), F32)
        KV = T.match_buffer(kv, (n, width), F32)
        GATE = T.match_buffer(gate, (n, width), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        APE = T.match_buffer(ape, (ratio, width), F32)
        SRC = T.match_buffer(src, (nw, slots), "int32")
        ROWS = T.match_buffer(rows, (nw,), "int32")
        OUT = T.match_buffer(out, (nw, head_dim), F32)
        for w in T.parallel(nw):
            sc = T.alloc_buffer((slots,), F32, scope="local", annotations=ON_STACK)
            val = T.alloc_buffer((slots,), F32, scope="local", annotations=ON_STACK)
            acc = T.alloc_buffer((3,), F32, scope="local", annotations=ON_STACK)
            if ROWS[w] < 0:  # a window slot this step does not close: nothing to pool
                for c in range(head_dim):
                    OUT[w, c] = T.float32(0)
            else:
                for c in range(head_dim):
                    for s in range(slots):
                        read(RKV, RSC, KV, GATE, POS, APE, SRC[w, s],
                             T.if_then_else(overlap and s >= ratio, c + head_dim, c), val, sc, s)
                    acc[0] = T.float32(NEG_INF)
                    for s in range(slots):
                        acc[0] = T.max(acc[0], sc[s])
                    acc[1] = T.float32(0)
                    acc[2] = T.float32(0)
                    for s in range(slots):
                        acc[1] = acc[1] + T.exp(sc[s] - acc[0])
                        acc[2] = acc[2] + T.exp(sc[s] - acc[0]) * val[s]
                    OUT[w, c] = acc[2] / acc[1]
    return f


INDEX_ENTRY_BLOCK = 32  # index entries scored together on the CPU: 4 AVX2 / 2 AVX-512 accumulators


def index_score(heads: int, dim: int, storage: str = "fp32", fp8_format=None, layout=None, max_lanes: int = 0):
    """I[t, e] = sum_h w[t,h] H^-0.5 relu(<q[t,h], k[rows[t,e]]>) d^-0.5; -inf where rows < 0.
    The key rows are index pool rows in ``storage`` (fp32, or fp8 / fp4 bytes in the pool's
    ``fp8_format`` and ``layout``, decoded value by value exactly as _IndexCodec.read does, see
    index_key).

    In parallel over (query, block of entries): the block's keys are decoded once into an L1
    panel [dim, block], then every head's dot products with the block run as one vector per
    input (the entries are the lanes), several heads at a time, each summed in input order as a
    single dot product would be. GPU builds (``max_lanes``) take blocks of at most that many entries."""
    scale = (heads ** -0.5) * (dim ** -0.5)
    width, dtype = index_plane_row(dim, storage)
    _check_index_format(storage, fp8_format, layout)
    block = min(INDEX_ENTRY_BLOCK, max_lanes) if max_lanes else INDEX_ENTRY_BLOCK
    # Heads whose dot products run together, their accumulators in half of the vector registers
    # (AVX-512: 8 heads x 2 vectors, AVX2: 2 x 4). One head's 2 or 4 chains of dependent FMAs
    # kept the pipes half idle: 1.4x (AVX2) and 1.65x (AVX-512) slower over 512 queries, Flash's
    # 64 x 128 index heads on Zen 4 (bench/RESULTS.md session 13). GPU builds: one head.
    lanes, registers = cpu_vector()
    hi = 1 if max_lanes else math.gcd(heads, max(1, registers // 2 // max(1, block // lanes)))

    @T.macro
    def score_block(Q, W, PLANE, ROWS, OUT, keys, part, acc, e, t, first):  # query t's entries first ..
        for j in range(block):  # entries past e or without a row decode row 0; their score is dropped
            for d in range(dim):
                keys[d, j] = index_key(PLANE, T.max(T.if_then_else(first + j < e, ROWS[t, first + j], 0), 0), d,
                                       dim, storage, fp8_format, layout)
        for j in T.vectorized(block):
            acc[j] = T.float32(0)
        for hq in range(heads // hi):
            for hh in T.unroll(hi):
                for j in T.vectorized(block):
                    part[hh, j] = T.float32(0)
            for d in range(dim):
                for hh in T.unroll(hi):
                    for j in T.vectorized(block):
                        part[hh, j] = part[hh, j] + Q[t, hq * hi + hh, d] * keys[d, j]
            for hh in range(hi):  # added in head order
                for j in T.vectorized(block):
                    acc[j] = acc[j] + T.max(part[hh, j], T.float32(0)) * (W[t, hq * hi + hh] * T.float32(scale))
        for j in range(block):
            if first + j < e:
                OUT[t, first + j] = T.if_then_else(ROWS[t, first + j] < 0, T.float32(NEG_INF), acc[j])

    @T.prim_func
    def f(q: T.handle, w: T.handle, plane: T.handle, rows: T.handle, out: T.handle):
        n = T.int32()
        r = T.int64()  # 64-bit offsets (see "Pool rows")
        e = T.int32()
        Q = T.match_buffer(q, (n, heads, dim), F32)
        W = T.match_buffer(w, (n, heads), F32)
        PLANE = T.match_buffer(plane, (r, width), dtype)
        ROWS = T.match_buffer(rows, (n, e), "int32")
        OUT = T.match_buffer(out, (n, e), F32)
        for i in T.parallel(n * ((e + block - 1) // block)):  # (query, block of entries)
            keys = T.alloc_buffer((dim, block), F32, scope="local", annotations=ON_STACK)
            part = T.alloc_buffer((hi, block), F32, scope="local", annotations=ON_STACK)
            acc = T.alloc_buffer((block,), F32, scope="local", annotations=ON_STACK)
            score_block(Q, W, PLANE, ROWS, OUT, keys, part, acc, e, i // ((e + block - 1) // block),
                        i % ((e + block - 1) // block) * block)
    return f


VECTOR_KERNELS = frozenset({"sparse_attn", "expert_linear", "index_score", "swiglu", "mhc", "rmsnorm_rope",
                            "topk_rows"})
GPU_MAX_LANES = 4


# Heads that share each KV row read on the CPU (MQA: every head reads the same rows): a task's
# heads. Decode steps take 8, so that one query's heads make tasks for every core; prefill takes
# 64, whose panel copies (the rows gathered from L3 for each block of heads) cost less: 1.14x
# faster than 8 over 256 queries of Flash's shape, AVX-512 and x86-64-v3 code alike, 32 1.12x
# (Zen 4, interleaved A/B, bench/RESULTS.md session 13).
ATTN_HEAD_BLOCK = 8
ATTN_PREFILL_HEAD_BLOCK = 64
ATTN_ROW_BLOCK = 8  # KV rows decoded together into an L1 panel, one online-softmax update each


def sparse_attn(heads: int, dim: int, scale: float, main_storage: str = "fp32", rope_dim: int = 0,
                fp8_format=None, head_block: int = ATTN_HEAD_BLOCK, max_lanes: int = 0, heads_at_once: int = 0):
    """Softmax attention over each query's row list (``rows [N, M]``, -1 = none, see
    ``step_kernels.attention_rows``); rows >= R are this step's fresh KV.
    The per-head sink enters the denominator only.

    In parallel over (query, block of ``head_block`` heads); the query's rows go in blocks of
    ATTN_ROW_BLOCK, each decoded once into an L1 panel that every head of the block reads twice:
    for its scores (vector dot products along the head dim) and, after an online-softmax update
    of the running max, denominator and output (rescaled when the max grows), for its weighted
    sum; ``heads_at_once`` heads (0: two) share each of those reads, which changes no bits. GPU
    builds (``max_lanes``) take one head and one row at a time, in vectors of at most
    ``max_lanes`` along the head dim.

    ``main_storage`` is the pool's: fp32 takes one plane ``pool [R, dim]``; fp8 takes the two
    planes of that layout, ``nope_plane`` and ``rope_plane`` (the last ``rope_dim`` values are the
    rope part, the NoPE codes in the pool's ``fp8_format``), decoded value by value as
    _MainCodec.read does (see main_fp8_value). So the arguments are (q, pool, step, sink, rows,
    out) or (q, nope_plane, rope_plane, step, sink, rows, out)."""
    nope_dim = dim - rope_dim
    # A vector chunk never straddles the NoPE / rope boundary (nor, lanes dividing 64, a scale group).
    widest = max_lanes or cpu_vector()[0]
    lanes = next(l for l in (16, 8, 4, 2, 1) if dim % l == 0 and nope_dim % l == 0 and l <= widest)
    chunks = dim // lanes
    hb, rb = (1, 1) if max_lanes else (math.gcd(heads, head_block), ATTN_ROW_BLOCK)
    # Heads whose scores and weighted sums accumulate together, each panel vector loaded once
    # for all of them (two on any CPU), and the accumulator vectors a head keeps in registers:
    # half of the registers between the heads, at most 8. AVX-512: 2 x 8 of 32. AVX2: 2 x 4 of 16,
    # so a head's scores take the block's rows 4 at a time and its weighted sums strips of 4
    # vectors. One head with 8 (9 vector loads per 8 FMAs where two heads with 4 load 6) ran
    # 1.03-1.18x slower over 256 queries (x86-64-v3 code on Zen 4, bench/RESULTS.md session 12).
    hp = math.gcd(hb, heads_at_once or 2)  # GPU builds: one (hb = 1)
    per_head = 8 if max_lanes else max(1, min(8, cpu_vector()[1] // 2 // hp))
    strip = math.gcd(dim, per_head * lanes)  # the weighted sums' strip of the head dim
    rh = math.gcd(rb, per_head)  # rows a score pass takes
    wide = T.serial if max_lanes else T.vectorized  # loops wider than a vector (GPU code generators refuse them)
    if main_storage == "fp8":
        _check_main_fp8(nope_dim, fp8_format)
    elif main_storage != "fp32":
        raise ValueError(f"sparse_attn reads fp32 or fp8 main pools, not {main_storage!r}")

    def row_at(ROWS, m, t, k):
        """Entry k of query t's row list, -1 (no row) past its end m."""
        return T.if_then_else(k < m, ROWS[t, k], -1)

    def stored(pool, row, c, l):
        """Value c * lanes + l of pool row ``row`` (decoded)."""
        if main_storage == "fp32":
            return pool[0][row, c * lanes + l]
        return main_fp8_value(pool[0], pool[1], row, c * lanes, l, nope_dim, fp8_format)

    def lane_total(part, hh, j):
        """The lanes of part[hh, j] added as a tree, halving the vector at each step: log2(lanes)
        shuffles and adds where a lane at a time took a scalar extract and add per lane."""
        if lanes == 1:
            return part[hh, j, 0]
        total, width = part[hh, j, T.Ramp(0, 1, lanes)], lanes
        while width > 1:
            width //= 2
            total = T.Shuffle([total], list(range(width))) + T.Shuffle([total], list(range(width, 2 * width)))
        return total

    @T.macro
    def online_softmax(ROWS, o, score, state, part, m, t, kb, h, hh):
        # Head h's scores of the block (from its accumulators part[hh]), its running max, the
        # denominator and output rescaled to it; then the block's weights in score[h].
        state[h, 2] = state[h, 0]
        for j in range(rb):
            score[h, j] = T.float32(NEG_INF)
            if row_at(ROWS, m, t, kb * rb + j) >= 0:
                score[h, j] = lane_total(part, hh, j) * T.float32(scale)
                state[h, 2] = T.max(state[h, 2], score[h, j])
        if state[h, 2] > state[h, 0]:  # a new max: rescale what was summed so far
            state[h, 3] = T.exp(state[h, 0] - state[h, 2])
            state[h, 1] = state[h, 1] * state[h, 3]
            for d in wide(dim):
                o[h, d] = o[h, d] * state[h, 3]
            state[h, 0] = state[h, 2]
        for j in wide(rb):
            score[h, j] = T.if_then_else(score[h, j] == T.float32(NEG_INF), T.float32(0),
                                         vector_exp(score[h, j] - state[h, 0]))
        for j in range(rb):
            state[h, 1] = state[h, 1] + score[h, j]

    # r: the pool's rows as int32, like the row ids it is compared with (only offsets need 64 bits).
    @T.macro
    def attend(Q, pool, STEP, SINK, ROWS, OUT, r, m, t, h0):
        panel = T.alloc_buffer((rb, dim), F32, scope="local", annotations=ON_STACK)  # the block's KV rows
        o = T.alloc_buffer((hb, dim), F32, scope="local", annotations=ON_STACK)  # running weighted sums
        score = T.alloc_buffer((hb, rb), F32, scope="local", annotations=ON_STACK)  # scaled, then weights
        state = T.alloc_buffer((hb, 4), F32, scope="local", annotations=ON_STACK)  # max, denominator, new max, factor
        part = T.alloc_buffer((hp, rb, lanes), F32, scope="local", annotations=ON_STACK)
        acc = T.alloc_buffer((hp, strip), F32, scope="local", annotations=ON_STACK)
        live = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)  # the block has a row
        for h in range(hb):
            state[h, 0] = SINK[h0 + h]  # the sink takes part in the max (for stability)
            state[h, 1] = T.float32(1)  # and in the denominator: exp(sink - max)
            for d in wide(dim):
                o[h, d] = T.float32(0)
        for kb in range((m + rb - 1) // rb):
            # A block without rows changes nothing (its weights are 0): skipped. Row lists hold
            # whole blocks of them, a CSA query's top-k slots past the entries it can see above all.
            live[0] = 0
            for j in range(rb):
                live[0] = live[0] | T.Cast("int32", row_at(ROWS, m, t, kb * rb + j) >= 0)
            if live[0] != 0:
                for j in range(rb):
                    # Zeros where there is no row: its weight is 0, and 0 times stale bits could be NaN.
                    if row_at(ROWS, m, t, kb * rb + j) < 0:
                        for d in wide(dim):
                            panel[j, d] = T.float32(0)
                    elif ROWS[t, kb * rb + j] >= r:  # this step's fresh KV
                        for d in wide(dim):
                            panel[j, d] = STEP[ROWS[t, kb * rb + j] - r, d]
                    else:
                        for c in range(chunks):
                            for l in T.vectorized(lanes):
                                panel[j, c * lanes + l] = stored(pool, ROWS[t, kb * rb + j], c, l)
                for hq in range(hb // hp):
                    # The heads' scores against the block's rows, a vector accumulator per head and
                    # row, rh rows a pass.
                    for jp in T.unroll(rb // rh):
                        for hh in T.unroll(hp):
                            for j in T.unroll(rh):
                                for l in T.vectorized(lanes):
                                    part[hh, jp * rh + j, l] = T.float32(0)
                        for c in range(chunks):
                            for j in T.unroll(rh):
                                for hh in T.unroll(hp):
                                    for l in T.vectorized(lanes):
                                        part[hh, jp * rh + j, l] = part[hh, jp * rh + j, l] + \
                                            Q[t, h0 + hq * hp + hh, c * lanes + l] * panel[jp * rh + j, c * lanes + l]
                    for hh in range(hp):
                        online_softmax(ROWS, o, score, state, part, m, t, kb, hq * hp + hh, hh)
                    # The weighted sums, in strips of the head dim that stay in registers over the rows.
                    for cs in range(dim // strip):
                        for hh in T.unroll(hp):
                            for u in wide(strip):
                                acc[hh, u] = o[hq * hp + hh, cs * strip + u]
                        for j in T.unroll(rb):
                            for hh in T.unroll(hp):
                                for u in wide(strip):
                                    acc[hh, u] = acc[hh, u] + score[hq * hp + hh, j] * panel[j, cs * strip + u]
                        for hh in T.unroll(hp):
                            for u in wide(strip):
                                o[hq * hp + hh, cs * strip + u] = acc[hh, u]
        for h in range(hb):
            for d in wide(dim):
                OUT[t, h0 + h, d] = o[h, d] / state[h, 1]

    if main_storage == "fp8":
        @T.prim_func
        def f(q: T.handle, nope_plane: T.handle, rope_plane: T.handle, step: T.handle, sink: T.handle,
              rows: T.handle, out: T.handle):
            n = T.int32()
            r = T.int64()  # 64-bit offsets (see "Pool rows")
            s = T.int32()
            m = T.int32()
            Q = T.match_buffer(q, (n, heads, dim), F32)
            NOPE = T.match_buffer(nope_plane, (r, main_nope_width(nope_dim)), "uint8")
            ROPE = T.match_buffer(rope_plane, (r, rope_dim), "uint16")
            STEP = T.match_buffer(step, (s, dim), F32)
            SINK = T.match_buffer(sink, (heads,), F32)
            ROWS = T.match_buffer(rows, (n, m), "int32")
            OUT = T.match_buffer(out, (n, heads, dim), F32)
            for i in T.parallel(n * (heads // hb)):  # (query, block of heads)
                attend(Q, (NOPE, ROPE), STEP, SINK, ROWS, OUT, T.Cast("int32", r), m, i // (heads // hb), i % (heads // hb) * hb)
        return f

    @T.prim_func
    def f(q: T.handle, pool: T.handle, step: T.handle, sink: T.handle, rows: T.handle, out: T.handle):
        n = T.int32()
        r = T.int64()  # 64-bit offsets (see "Pool rows")
        s = T.int32()
        m = T.int32()
        Q = T.match_buffer(q, (n, heads, dim), F32)
        POOL = T.match_buffer(pool, (r, dim), F32)
        STEP = T.match_buffer(step, (s, dim), F32)
        SINK = T.match_buffer(sink, (heads,), F32)
        ROWS = T.match_buffer(rows, (n, m), "int32")
        OUT = T.match_buffer(out, (n, heads, dim), F32)
        for i in T.parallel(n * (heads // hb)):  # (query, block of heads)
            attend(Q, (POOL,), STEP, SINK, ROWS, OUT, T.Cast("int32", r), m, i // (heads // hb), i % (heads // hb) * hb)
    return f

"""The pieces of the ``bf16`` compute mode of the CPU GEMMs (``matmul._matmul_loops``): activations
rounded to BF16 (nearest-even, as ``codecs.bf16_bits``), weights widened exactly to BF16 (FP8 e4m3,
FP4 e2m1 and BF16 values all fit its 8 exponent and 7 mantissa bits), products summed in fp32.

Where the CPU has AVX512-BF16, ``vdpbf16ps`` multiplies and sums two inputs per fp32 lane: a
32-bit lane holds a pair of BF16 values, input k in the low half and k + 1 in the high half
(``pair``). TVM lowers every bfloat16 vector to float32 before LLVM sees it (its BF16 legalize
passes), while LLVM's intrinsic takes ``<32 x bfloat>``: the kernels pass the pairs as int32
vectors to a small LLVM function (``DOT_IR``, linked into the kernel's module by the
``pragma_import_llvm`` attribute and inlined) that reinterprets them for the intrinsic.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32
from dsv4c.codegen.kernels.cpu import cpu_target

DOT_LANES = 16  # fp32 lanes of one vdpbf16ps (512 bits)
DOT_FUNCTION = "dsv4c_dpbf16ps"
DOT_IR = f"""
define internal <16 x float> @{DOT_FUNCTION}(<16 x float> %acc, <16 x i32> %x, <16 x i32> %w) alwaysinline {{
  %xb = bitcast <16 x i32> %x to <32 x bfloat>
  %wb = bitcast <16 x i32> %w to <32 x bfloat>
  %sum = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %xb, <32 x bfloat> %wb)
  ret <16 x float> %sum
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
"""


def has_bf16_dot() -> bool:
    """Whether the CPU the kernels are built for has AVX512-BF16 (``vdpbf16ps``); without it the
    bf16 mode multiplies the same BF16 values with fp32 FMAs."""
    from tvm.target import codegen

    return bool(codegen.target_has_features("avx512bf16", cpu_target()))


def _rounded_bits(x, lanes: int):
    """uint32 bits of float32 x (``lanes`` of them) rounded to the nearest BF16 value, ties to
    even, as ``codecs.bf16_bits`` rounds (activations are never NaN): the top half is the BF16."""
    u32 = lambda v: tirx.const(v, "uint32") if lanes == 1 else T.Broadcast(tirx.const(v, "uint32"), lanes)  # noqa: E731
    bits = tirx.reinterpret("uint32" if lanes == 1 else f"uint32x{lanes}", x)
    return (bits + u32(0x7FFF) + (tirx.shift_right(bits, u32(16)) & u32(1))) & u32(0xFFFF0000)


def rounded(x):
    """float32 x rounded to the nearest BF16 value (ties to even), as float32."""
    return tirx.reinterpret(F32, _rounded_bits(x, 1))


def pair(even, odd):
    """The uint32 lane of two float32 weights that BF16 holds exactly (their low halves are zero):
    ``even``'s top half in the low 16 bits, ``odd``'s in the high 16."""
    u32 = lambda v: tirx.const(v, "uint32")  # noqa: E731
    return tirx.shift_right(tirx.reinterpret("uint32", even), u32(16)) | \
        (tirx.reinterpret("uint32", odd) & u32(0xFFFF0000))


def rounded_pairs(values, lanes: int):
    """The ``lanes // 2`` uint32 pairs of a vector of ``lanes`` consecutive float32 inputs, each
    rounded to BF16: the rounded BF16 array in input order is the pair array."""
    halves = tirx.Cast(f"uint16x{lanes}", tirx.shift_right(_rounded_bits(values, lanes), T.Broadcast(
        tirx.const(16, "uint32"), lanes)))
    return tirx.reinterpret(f"uint32x{lanes // 2}", halves)


def dot(acc, x_pair, w_pairs):
    """acc (float32 x 16) plus, in each lane, the sum of its two BF16 products (vdpbf16ps)."""
    return T.call_pure_extern(f"{F32}x{DOT_LANES}", DOT_FUNCTION, acc, tirx.reinterpret(f"int32x{DOT_LANES}", x_pair),
                              tirx.reinterpret(f"int32x{DOT_LANES}", w_pairs))


def bf16_matmuls(cpu: str, dot: bool) -> str:
    """What the matmuls of a bf16-numerics build for LLVM CPU ``cpu`` run (``dsv4c inspect``):
    ``dot``, whether that CPU has AVX512-BF16."""
    how = f"vdpbf16ps (AVX512-BF16 on {cpu})" if dot else \
        f"fp32 FMAs on BF16-rounded activations ({cpu} has no AVX512-BF16: the same products, no vdpbf16ps)"
    return f"prefill GEMMs in bf16 by {how}; decode GEMVs fp32"

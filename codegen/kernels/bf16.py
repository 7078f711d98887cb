"""The pieces of the ``bf16`` compute mode of the CPU GEMMs (``matmul._matmul_loops``): activations
rounded to BF16 (nearest-even, as ``codecs.bf16_bits``), weights widened exactly to BF16 (FP8 e4m3,
FP4 e2m1 and BF16 values all fit its 8 exponent and 7 mantissa bits), products summed in fp32.

Where the CPU has AVX512-BF16, ``vdpbf16ps`` multiplies and sums two inputs per fp32 lane: a
32-bit lane holds a pair of BF16 values, input k in the low half and k + 1 in the high half
(``pair``). TVM lowers every bfloat16 vector to float32 before LLVM sees it (its BF16 legalize
passes), while LLVM's intrinsic takes ``<32 x bfloat>``: the kernels pass the pairs as int32
vectors to a small LLVM function (``DOT_IR``, linked into the kernel's module by the
``pragma_import_llvm`` attribute and inlined) that reinterprets them for the intrinsic.

Where the CPU has AMX-BF16 (Sapphire Rapids and later), the GEMM's micro-kernel runs on AMX tiles
instead (``tile_ir``): the panel of pairs is AMX's B operand as it stands (a row of 16 columns of
pairs is a 64-byte tile row) and the chunk's x in pairs its A operand.

What the two instructions compute, per Intel's pseudocode (SDM: VDPBF16PS, TDPBF16PS), for one
fp32 output c and pairs (x0, x1) . (w0, w1) of BF16 inputs; both treat BF16 subnormal inputs as
zero, flush subnormal results to zero and round to nearest even, whatever MXCSR says:
  vdpbf16ps, one pair:   c = (c + x1 * w1) + x0 * w0  (two FMAs, the odd product first; this
                         Zen 5 gives those bits: tests/test_amx_matmul.py)
  tdpbf16ps, 16 pairs:   e = sum of x0 * w0 over the pairs, o = sum of x1 * w1 (each from zero,
                         in pair order), c = c + (e + o)
Every product is exact in fp32 (8 by 8 significant bits; in range for the kernels' values), so
the two give the same bits wherever every partial sum is exact, and otherwise differ in their
roundings (each within the fp32 summation bound the tests hold the GEMMs to). No AMX machine was
available: the AMX kernels are checked in their object code and, with a C model of TDPBF16PS's
pseudocode in place of the instructions, against a numpy model bit for bit.
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


def has_amx_bf16() -> bool:
    """Whether the CPU the kernels are built for has AMX-BF16 (``tdpbf16ps``): the bf16 GEMM's
    micro-kernel then runs on tiles (``tile_ir``)."""
    from tvm.target import codegen

    return bool(codegen.target_has_features("amx-bf16", cpu_target()))


AMX_ROWS = 16  # rows of a tile: the AMX micro-kernel's block of rows
AMX_ROW_BYTES = 64  # bytes of a tile row: 16 fp32 sums, or 16 BF16 pairs


def tile_function(col_tiles: int, k_pairs: int, zero: bool) -> str:
    """The name of ``tile_ir``'s function for these parameters."""
    return f"dsv4c_tdpbf16ps_{col_tiles}x{k_pairs}{'_zero' if zero else ''}"


def tile_ir(col_tiles: int, k_pairs: int, zero: bool) -> str:
    """An LLVM function (``tile_function``) of the AMX micro-kernel:

        f(sums, x, x_stride, panel, panel_stride, rows, groups, steps)

    For each of ``groups`` groups g, the sums [rows, 16 * col_tiles] fp32 at sums + g * 16 rows
    (rows of 64 * col_tiles bytes) start from zero (``zero``) or from what is there, and take
    ``steps`` tdpbf16ps steps of ``k_pairs`` pairs each: step s (s = g * steps + i) multiplies
    the x tile (rows x k_pairs pairs at x + 4 * k_pairs * s, rows ``x_stride`` bytes apart) by
    the panel tile of each 16 columns t (k_pairs rows at panel + k_pairs * s * panel_stride + 64 t,
    rows ``panel_stride`` bytes apart). The C tiles stay in tile registers over a group. LLVM
    inlines the function into the kernel and configures the tiles there (its X86 pre-tile-config
    pass writes the shapes, the runtime rows included, and emits ldtilecfg where they are known,
    and tilerelease before the kernel returns). rows: 1 to 16."""
    name = tile_function(col_tiles, k_pairs, zero)
    c_stride = AMX_ROW_BYTES * col_tiles
    a_bytes = 4 * k_pairs
    tiles = range(col_tiles)
    amx = "x86_amx"
    init = "\n".join(
        f"  %c{t} = call {amx} @llvm.x86.tilezero.internal(i16 %rows, i16 {AMX_ROW_BYTES})" if zero else
        f"  %cp{t} = getelementptr i8, ptr %cg, i64 {AMX_ROW_BYTES * t}\n"
        f"  %c{t} = call {amx} @llvm.x86.tileloadd64.internal(i16 %rows, i16 {AMX_ROW_BYTES}, ptr %cp{t}, "
        f"i64 {c_stride})"
        for t in tiles)
    sums = "\n".join(f"  %acc{t} = phi {amx} [%c{t}, %group], [%next{t}, %step]" for t in tiles)
    products = "\n".join(
        f"  %bp{t} = getelementptr i8, ptr %bs, i64 {AMX_ROW_BYTES * t}\n"
        f"  %b{t} = call {amx} @llvm.x86.tileloadd64.internal(i16 {k_pairs}, i16 {AMX_ROW_BYTES}, ptr %bp{t}, "
        f"i64 %panel_stride)\n"
        f"  %next{t} = call {amx} @llvm.x86.tdpbf16ps.internal(i16 %rows, i16 {AMX_ROW_BYTES}, i16 {a_bytes}, "
        f"{amx} %acc{t}, {amx} %a, {amx} %b{t})"
        for t in tiles)
    stores = "\n".join(
        f"  %sp{t} = getelementptr i8, ptr %cg, i64 {AMX_ROW_BYTES * t}\n"
        f"  call void @llvm.x86.tilestored64.internal(i16 %rows, i16 {AMX_ROW_BYTES}, ptr %sp{t}, i64 {c_stride}, "
        f"{amx} %next{t})"
        for t in tiles)
    return f"""
define internal void @{name}(ptr %sums, ptr %x, i64 %x_stride, ptr %panel, i64 %panel_stride, i16 %rows, i32 %groups,
    i32 %steps) {{
entry:
  br label %group
group:
  %g = phi i32 [0, %entry], [%g_next, %stored]
  %g64 = zext i32 %g to i64
  %c_offset = mul i64 %g64, {AMX_ROWS * c_stride}
  %cg = getelementptr i8, ptr %sums, i64 %c_offset
{init}
  br label %step
step:
  %i = phi i32 [0, %group], [%i_next, %step]
{sums}
  %gs = mul i32 %g, %steps
  %s = add i32 %gs, %i
  %s64 = zext i32 %s to i64
  %a_offset = mul i64 %s64, {a_bytes}
  %ap = getelementptr i8, ptr %x, i64 %a_offset
  %a = call {amx} @llvm.x86.tileloadd64.internal(i16 %rows, i16 {a_bytes}, ptr %ap, i64 %x_stride)
  %b_row = mul i64 %s64, {k_pairs}
  %b_offset = mul i64 %b_row, %panel_stride
  %bs = getelementptr i8, ptr %panel, i64 %b_offset
{products}
  %i_next = add i32 %i, 1
  %more = icmp slt i32 %i_next, %steps
  br i1 %more, label %step, label %stored
stored:
{stores}
  %g_next = add i32 %g, 1
  %more_groups = icmp slt i32 %g_next, %groups
  br i1 %more_groups, label %group, label %done
done:
  ret void
}}
declare {amx} @llvm.x86.tilezero.internal(i16, i16)
declare {amx} @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare {amx} @llvm.x86.tdpbf16ps.internal(i16, i16, i16, {amx}, {amx}, {amx})
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, {amx})
"""


def tile_products(col_tiles: int, k_pairs: int, zero: bool, sums, x, x_stride: int, panel, panel_stride: int, rows,
                  groups: int, steps: int):
    """A call of ``tile_ir``'s function: sums, x and panel are the addresses (``T.address_of``)
    of the first sum, pair of x and pair of the panel; strides in bytes."""
    return T.call_extern("void", tile_function(col_tiles, k_pairs, zero), sums, x, T.int64(x_stride), panel,
                         T.int64(panel_stride), tirx.Cast("int16", rows), T.int32(groups), T.int32(steps))


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


def bf16_matmuls(cpu: str, dot: bool, amx: bool = False) -> str:
    """What the matmuls of a bf16-numerics build for LLVM CPU ``cpu`` run (``dsv4c inspect``):
    ``dot``, whether that CPU has AVX512-BF16; ``amx``, AMX-BF16."""
    how = f"AMX tiles, tdpbf16ps (AMX-BF16 on {cpu})" if amx else f"vdpbf16ps (AVX512-BF16 on {cpu})" if dot else \
        f"fp32 FMAs on BF16-rounded activations ({cpu} has no AVX512-BF16: the same products, no vdpbf16ps)"
    return f"prefill GEMMs in bf16 by {how}; decode GEMVs fp32"

"""Each matmul weight format's TIR decode, in one place, keyed by the ``artifact.quant`` format
name (:func:`tir_format`): the kernel side of the format objects there, whose parameters (FP8
block size and encoding, FP4 group) it reads rather than repeats.

A weight ``[out, in]`` is stored in column tiles ``[out / tile, in, tile]`` (:func:`column_tile`),
so that a thread streams one contiguous tile. A format's :class:`TirFormat` lists its stored
parts and reads them, as TE tensors or TIR buffers alike: the float32 ``value`` of a weight, and
for the CPU matmul loops the cheaper ``raw`` decode summed per scale group (``group_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from dsv4c.artifact.lowbit import FP8_EXPONENT_BIAS
from dsv4c.artifact.quant import FP32, WEIGHT_FORMATS, Bf16Bits, Fp4Groups, Fp8Blocks, WeightFormat
from dsv4c.artifact.safetensors_io import STORAGE_DTYPES
from dsv4c.codegen.kernels.codecs import (F32, DECODE_FP8, decode_bf16, decode_e8m0, decode_fp4_word, raw_e2m1,
                                          raw_e2m1_by_table, raw_e4m3)


def column_tile(out_dim: int) -> int:
    """Output columns per weight tile: weights are stored as [out / tile, in, tile] so that a
    thread streams one contiguous tile (the compile-time layout for these kernels)."""
    return next(t for t in (64, 16, 8, 1) if out_dim % t == 0)


def _tiled(out_dim: int, rows: int) -> tuple[int, int, int]:
    """Shape of a stored part with ``rows`` rows per output column, in column tiles."""
    tile = column_tile(out_dim)
    return out_dim // tile, rows, tile


# The CPU matmul kernels decode low-bit codes more cheaply than ``value``: a code's sign and
# magnitude bits go straight into a float32 (exponent field = the code's exponent), whose value
# is the code's times 2**-raw_power ("raw"; subnormal codes become float32 subnormals, exact).
# No scale touches a weight: each scale group's products are summed raw and the sum is scaled
# once (``matmul._matmul_loops``), which halves the vector operations per weight. Raw values are
# tiny, so the products are taken with x times 2**X_BOOST (exact): the GEMV boosts each x once
# for a whole row of weights, the GEMM's panel boosts the raw weights once for all rows, which
# gives the same products bit for bit; either way they stay far from float32's subnormal range,
# and the sums keep full precision. Float32 subnormals must not be flushed to zero (DAZ) in the
# threads that run the kernels: ``runtime.backend_tvm`` refuses a process that flushes them.
X_BOOST = 64


def boosted(value):
    """x (in the GEMV) or a raw weight (in the GEMM panel) times 2**X_BOOST, exact."""
    return value * tirx.const(2.0 ** X_BOOST, F32)


@dataclass(frozen=True)
class TirFormat:
    """The TIR side of ``weight``, an ``artifact.quant`` format. A part is read at leading
    indices ``lead`` (a group or an expert), column tile a, input kk, tile column c."""
    weight: WeightFormat
    prefetch_bytes: int = 0  # how far ahead the CPU's decode loop prefetches a streamed tile; 0: not at all
    decoded = True  # the stored values need decoding (fp32 weights are read in place)

    @property
    def name(self) -> str:
        return self.weight.name

    @property
    def scaled(self) -> bool:
        return self.weight.scaled

    @property
    def group(self) -> int:
        return self.weight.group

    @property
    def inputs_per_word(self) -> int:
        """Inputs in one stored element of the tile (FP4: a word of eight codes)."""
        return self.weight.inputs_per_word

    @property
    def word_bytes(self) -> int:
        """Bytes of one stored element of the tile."""
        dtype, _ = self.weight.stored(self.inputs_per_word)[""]
        return STORAGE_DTYPES[dtype].itemsize

    def parts(self, out_dim: int, in_dim: int) -> list[tuple[tuple, str]]:
        """(shape, dtype) of each stored part of an [out_dim, in_dim] weight: the artifact tensors
        of the format (the codes or values, then their scales when scaled) in column tiles
        [O / tile, stored columns, tile]."""
        return [(_tiled(out_dim, cols), STORAGE_DTYPES[dtype].name)
                for dtype, cols in self.weight.stored(in_dim).values()]

    def value(self, parts, lead: tuple, a, kk, c):
        """float32 value of the weight."""
        raise NotImplementedError

    def raw(self, parts, lead: tuple, a, kk, c, avx512_vectors: bool = False):
        """What the CPU matmul loops multiply x by: the value itself, or for scaled formats
        (value / scale) * 2**-raw_power. ``avx512_vectors``: c runs over vectors of 16 columns on
        AVX-512."""
        return self.value(parts, lead, a, kk, c)


@dataclass(frozen=True)
class TirFp32(TirFormat):
    decoded = False

    def value(self, parts, lead, a, kk, c):
        return parts[0][lead + (a, kk, c)]


@dataclass(frozen=True)
class TirBf16(TirFormat):
    def value(self, parts, lead, a, kk, c):
        return decode_bf16(parts[0][lead + (a, kk, c)])  # BF16 bits: the float32 with the same top half


@dataclass(frozen=True)
class TirScaled(TirFormat):
    """Codes with a scale per group of ``group`` inputs of a row."""
    raw_power: int = 0  # 127 - the code's exponent bias: raw values are the codes' times 2**-raw_power

    def code(self, parts, lead, a, kk, c):
        """float32 value of the code (unscaled)."""
        raise NotImplementedError

    def scale(self, parts, lead, a, kk, c):
        """float32 scale of input kk's group."""
        raise NotImplementedError

    def value(self, parts, lead, a, kk, c):
        return self.code(parts, lead, a, kk, c) * self.scale(parts, lead, a, kk, c)

    def group_scale(self, parts, lead, a, kk, c):
        """What a sum of boosted raw products over one scale group (the group holding input kk)
        is multiplied by to give a sum of x times weight values: the group's scale times
        2**(raw_power - X_BOOST). Multiplying by the power of two first is exact (scales far
        below 2**66), so raw_sum * group_scale has the bits of (raw_sum * 2**(...)) * scale, and
        a matmul loop computes it once per column vector for all its rows."""
        return self.scale(parts, lead, a, kk, c) * tirx.const(2.0 ** (self.raw_power - X_BOOST), F32)


@dataclass(frozen=True)
class TirFp8Blocks(TirScaled):
    """e4m3 codes (e4m3fn, or e4m3fnuz on gfx942), one byte an input, with the float32 scales of
    their B x B blocks (B = ``group``) expanded per column and tiled the same way, [O / tile,
    ceil(I/B), tile] (a vector of columns then reads a vector of scales)."""

    def code(self, parts, lead, a, kk, c):
        return DECODE_FP8[self.weight.fp8_format](parts[0][lead + (a, kk, c)])

    def scale(self, parts, lead, a, kk, c):
        return parts[1][lead + (a, kk // self.group, c)]

    def raw(self, parts, lead, a, kk, c, avx512_vectors=False):
        return raw_e4m3(parts[0][lead + (a, kk, c)])


@dataclass(frozen=True)
class TirFp4Groups(TirScaled):
    """Eight e2m1 codes per int32 word along the input dim (input 8i + j on bits 4j..4j+3: the
    checkpoint's packed bytes, four at a time, little-endian), one E8M0 scale per 32 inputs of a
    row: the checkpoint's own groups, tiled along the output."""

    def code(self, parts, lead, a, kk, c):
        return decode_fp4_word(self._word(parts, lead, a, kk, c), kk % self.inputs_per_word)

    def scale(self, parts, lead, a, kk, c):
        return decode_e8m0(parts[1][lead + (a, kk // self.group, c)])

    def raw(self, parts, lead, a, kk, c, avx512_vectors=False):
        """On AVX-512 vectors of 16 columns, by table (see raw_e2m1_by_table)."""
        if avx512_vectors:
            return raw_e2m1_by_table(self._word(parts, lead, a, kk, c), kk % self.inputs_per_word, tirx.floormod(c, 16))
        return raw_e2m1(self._word(parts, lead, a, kk, c), kk % self.inputs_per_word)

    def _word(self, parts, lead, a, kk, c):
        """The int32 word holding input kk's code."""
        return parts[0][lead + (a, kk // self.inputs_per_word, c)]


# Prefetch distances: the best measured for each format, FP8 and BF16 on Zen 3, FP4 on Zen 4
# (bench/RESULTS.md); ``matmul.PREFETCH_BYTES_BY_CPU`` overrides them where a CPU differs.
def _tir_side(fmt: WeightFormat) -> TirFormat:
    if isinstance(fmt, Fp8Blocks):
        return TirFp8Blocks(fmt, prefetch_bytes=2048, raw_power=127 - FP8_EXPONENT_BIAS[fmt.fp8_format])
    if isinstance(fmt, Fp4Groups):
        return TirFp4Groups(fmt, prefetch_bytes=2048, raw_power=127 - 1)  # e2m1: exponent bias 1
    if isinstance(fmt, Bf16Bits):
        return TirBf16(fmt, prefetch_bytes=1024)
    return TirFp32(fmt)


# Every format a matmul reads: the low-bit ones, BF16 and fp32 (integer weights are not multiplied).
TIR_FORMATS = {name: _tir_side(f) for name, f in WEIGHT_FORMATS.items()
               if f.scaled or isinstance(f, Bf16Bits) or f is FP32}


def tir_format(name: str) -> TirFormat:
    """The TIR side of the matmul weight format named ``name`` (``artifact.quant``)."""
    if name not in TIR_FORMATS:
        raise ValueError(f"no matmul kernel reads weight format {name!r}; they read {', '.join(TIR_FORMATS)}")
    return TIR_FORMATS[name]

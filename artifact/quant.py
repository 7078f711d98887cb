"""Weight formats and the per-target quantization plan (docs/artifact.md lists the stored bytes).

A :class:`WeightFormat` is one way the artifact stores a weight matrix ``[rows, cols]``, the
way a vLLM quantization method owns its format: its artifact tensors (:meth:`stored`), how
rows read from a checkpoint become their bytes (:meth:`lay_out`, which takes the checkpoint's
own codes where it holds this format and quantizes anything else), and a numpy codec back to
float32 (:meth:`dequantize`). Its parameters (block size, scale group, FP8 encoding) are
defined here once; the kernels' TIR side of each format (``codegen.kernels.formats``) reads
them from the same object. The formats, by name (the IR's ``quant`` attribute and the
kernels' key), all in :data:`WEIGHT_FORMATS`:

* ``fp8_b<B>`` / ``fp8fnuz_b<B>``: e4m3 codes (U8) with float32 scales of B x B blocks, stored
  per row as the scale of each B-column block (``.scale``); fnuz (gfx942) keeps the e4m3fn bits
  and doubles the scale. B is the checkpoint's ``weight_block_size``: 128 for V4, 32 for V4.1's
  dense weights (:data:`FP8_BLOCK_SIZES`);
* ``fp4_g32``: e2m1 codes, eight to an int32 word (input 8i + j on bits 4j..4j+3: the
  checkpoint's packed pairs, four bytes little-endian), with one E8M0 scale per 32 (``.scale``);
* ``bf16``: BF16 bits (U16); ``fp32``, ``i32``, ``i64``: plain values.

:class:`QuantPlan` says which format every weight kind and pool plane takes on a target
(``passes.quant_plan.plan_for`` chooses); the lowering reads each weight's format from it and
the manifest records it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from dsv4c.artifact import lowbit
from dsv4c.artifact.safetensors_io import STORAGE_DTYPES
from dsv4c.errors import UsageError

FP8_BLOCK_SIZES = (128, 32)  # square FP8 weight blocks: V4's, V4.1's dense weights'

# The numerics a compile chooses (``--numerics``; the plan and the manifest record it): exact and
# qat are traced graphs (``frontend.trace``); bf16 runs exact's graph whose CPU GEMMs multiply
# activations rounded to BF16 by the weights (``WeightQuant.compute`` "bf16", docs/numerics.md).
NUMERICS = ("exact", "qat", "bf16")


def traced_numerics(numerics: str) -> str:
    """The numerics of the graph a compile in ``numerics`` traces."""
    return "exact" if numerics == "bf16" else numerics
FP4_GROUP = 32


def _joined(parts) -> np.ndarray:
    """Row blocks stacked; a single block as it is (one copy fewer of every byte)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass(frozen=True)
class WeightFormat:
    name: str
    scaled: bool = False  # codes + a ``.scale`` tensor; the kernels sum each scale group raw
    group: int = 0  # inputs per scale along a row (scaled formats)
    inputs_per_word: ClassVar[int] = 1  # inputs in one element of the codes / values tensor

    def stored(self, cols: int) -> dict[str, tuple[str, int]]:
        """Artifact tensor suffix ("" for the codes / values, ".scale") -> (safetensors dtype,
        stored columns per weight row)."""
        raise NotImplementedError

    def row_bytes(self, cols: int) -> dict[str, int]:
        """Bytes one weight row takes in each artifact tensor (by suffix)."""
        return {suffix: n * STORAGE_DTYPES[dtype].itemsize for suffix, (dtype, n) in self.stored(cols).items()}

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a weight of ``shape`` takes in this format (every row of its last axis)."""
        return math.prod(shape[:-1]) * sum(self.row_bytes(shape[-1]).values())

    def lay_out(self, name: str, parts) -> dict[str, np.ndarray]:
        """The artifact arrays (by suffix, row-major ``[n, stored cols]``) of consecutive rows, given
        as the checkpoint holds them: one ``artifact.rows.Rows`` per tensor they come from."""
        raise NotImplementedError

    def dequantize(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """float32 ``[n, cols]`` of row-major artifact arrays (by suffix): the values the kernels
        multiply by."""
        raise NotImplementedError


@dataclass(frozen=True)
class Fp8Blocks(WeightFormat):
    """e4m3 codes with one scale per ``group`` x ``group`` block (square blocks: the row block
    only matters where rows are quantized here, which starts them on a block, ``row_step``)."""
    fp8_format: str = "e4m3fn"

    def stored(self, cols):
        return {"": ("U8", cols), ".scale": ("F32", -(-cols // self.group))}

    def lay_out(self, name, parts):
        codes, scales = [], []
        for p in parts:
            # The checkpoint's codes and scales as they are where its column blocks are these
            # (per-row scales: the row block does not matter), else requantized.
            if p.storage == "FP8" and p.scales.shape[1] == -(-p.values.shape[1] // self.group):
                c, s = p.values, p.scales
            else:  # quantized with E8M0 scales: the rows start on a block boundary (row_step)
                c, grid = lowbit.quantize_fp8_blocks(p.decode(), self.group, "e8m0")
                s = np.repeat(lowbit.decode_e8m0(grid), self.group, axis=0)[:c.shape[0]]
            codes.append(c)
            scales.append(s)
        codes, scales = _joined(codes), _joined(scales).astype(np.float32, copy=False)
        codes, scales = lowbit.fp8_in_format(codes, scales, self.fp8_format)
        return {"": codes, ".scale": scales}

    def dequantize(self, arrays):
        codes = arrays[""]
        scale = np.repeat(arrays[".scale"], self.group, axis=1)[:, :codes.shape[1]]
        return (lowbit.decode_fp8(codes, self.fp8_format) * scale).astype(np.float32)


@dataclass(frozen=True)
class Fp4Groups(WeightFormat):
    inputs_per_word: ClassVar[int] = 8  # eight e2m1 codes to an int32 word (fp4_words)

    def stored(self, cols):
        return {"": ("I32", cols // self.inputs_per_word), ".scale": ("U8", cols // self.group)}

    def lay_out(self, name, parts):
        packed, scales = [], []
        for p in parts:
            if p.storage == "FP4":
                packed.append(p.values)
                scales.append(p.scales)
            else:
                codes, s = lowbit.quantize_fp4_groups(p.decode(), FP4_GROUP)
                packed.append(codes.view(np.uint8))
                scales.append(s)
        return {"": fp4_words(_joined(packed)), ".scale": _joined(scales)}

    def dequantize(self, arrays):
        packed = np.ascontiguousarray(arrays[""]).view(np.uint8)
        return lowbit.dequantize_fp4_groups(packed, arrays[".scale"], FP4_GROUP).astype(np.float32)


@dataclass(frozen=True)
class Bf16Bits(WeightFormat):
    def stored(self, cols):
        return {"": ("BF16", cols)}

    def lay_out(self, name, parts):
        bits = []
        for p in parts:
            if p.storage == "BF16":
                bits.append(p.values)
                continue
            value = p.decode()
            if not np.array_equal(lowbit.bf16_roundtrip(value), value):
                raise UsageError(f"weight {name} is declared BF16 but holds values BF16 cannot represent; "
                                 "fix the checkpoint's config (torch_dtype / quantization_config)")
            bits.append(lowbit.bf16_bits_from_f32(value))
        return {"": _joined(bits)}

    def dequantize(self, arrays):
        return lowbit.f32_from_bf16_bits(arrays[""])


@dataclass(frozen=True)
class PlainValues(WeightFormat):
    dtype: str = "F32"  # F32 / I32 / I64

    def stored(self, cols):
        return {"": (self.dtype, cols)}

    def lay_out(self, name, parts):
        values = _joined([p.decode() for p in parts])
        return {"": values.astype(STORAGE_DTYPES[self.dtype], copy=False)}

    def dequantize(self, arrays):
        return arrays[""].astype(np.float32)


def fp8_format_name(block: int, fp8_format: str = "e4m3fn") -> str:
    """The name of the FP8 format of ``block`` x ``block`` blocks in ``fp8_format``."""
    return f"fp8{'fnuz' if fp8_format == 'e4m3fnuz' else ''}_b{block}"


FP8_FORMATS = tuple(Fp8Blocks(fp8_format_name(b, f), True, b, f) for b in FP8_BLOCK_SIZES for f in lowbit.FP8_FORMATS)
FP4_G32 = Fp4Groups("fp4_g32", True, FP4_GROUP)
BF16 = Bf16Bits("bf16")
FP32 = PlainValues("fp32")
I32 = PlainValues("i32", dtype="I32")
I64 = PlainValues("i64", dtype="I64")
WEIGHT_FORMATS = {f.name: f for f in (*FP8_FORMATS, FP4_G32, BF16, FP32, I32, I64)}


def fp4_words(packed: np.ndarray) -> np.ndarray:
    """Packed e2m1 pairs ``[n, cols / 2]`` (U8, input 2i in the low nibble) as int32 words of
    eight codes ``[n, cols / 8]``: four bytes read little-endian, so input 8i + j lies on bits
    4j..4j+3, which the CPU kernels decode in registers."""
    return np.ascontiguousarray(packed, dtype=np.uint8).view("<i4")


def checkpoint_quants(weights) -> dict[str, str]:
    """The format each matmul storage kind arrives in from a checkpoint whose config says
    ``weights`` (``model_config.WeightFormats``): the IR's ``quant`` attributes (``frontend.trace``).
    Compressors, weights_proj, the gate and the head ship as BF16 (fp32 in an fp32 checkpoint)."""
    def name(storage: str) -> str:
        return {"fp8": fp8_format_name(weights.fp8_block), "fp4": FP4_G32.name}.get(storage, storage)

    return {"dense": name(weights.dense), "expert": name(weights.experts),
            "bf16": FP32.name if weights.dense == "fp32" else BF16.name}


def dense_format(quant: str, fp8_format: str = "e4m3fn") -> WeightFormat:
    """The format a compiled target multiplies a dense weight of IR ``quant`` in: FP8 blocks stay
    FP8 blocks of the same size (fnuz on gfx942), BF16 stays BF16; the rest fp32. The rule
    ``passes.quant_plan`` writes into the plan, which the lowering reads."""
    if quant == BF16.name:
        return BF16
    fmt = WEIGHT_FORMATS.get(quant)
    if not isinstance(fmt, Fp8Blocks):
        return FP32
    return WEIGHT_FORMATS[fp8_format_name(fmt.group, fp8_format)]


def expert_format(quant: str) -> WeightFormat:
    """The format of routed experts of IR ``quant``: FP4 stays FP4, the rest fp32."""
    return FP4_G32 if quant == FP4_G32.name else FP32


# --------------------------------------------------------------------------- the plan


# A plan entry's storage -> its format's name (FP8: by block and encoding, fp8_format_name).
_PLAIN_FORMAT = {"fp4": FP4_G32.name, "bf16": BF16.name, "fp32": FP32.name, "int": I32.name}


@dataclass(frozen=True)
class WeightQuant:
    """How one checkpoint storage kind is stored and multiplied on a target."""
    storage: str  # fp8 / fp8_fnuz / fp4 / bf16 / fp32 / int
    block: tuple[int, int] | None  # quantization block (rows, cols); None when unquantized
    scale: str | None  # e8m0 / fp32 / None
    # What the matmul kernels multiply: fp32 on CPUs (decoded values, fp32 sums), or bf16 in the
    # bf16 numerics (the prefill GEMMs: BF16-rounded activations, fp32 sums; decode's GEMVs stay
    # fp32); on GPUs fp16, the tensor-core GEMMs' operands (prefill; fp32 sums), where decode's
    # GEMVs multiply the decoded fp32 values; int32 ids are not multiplied.
    compute: str

    @property
    def format(self) -> WeightFormat:
        """The artifact format of this entry: the lowering's kernels read it, the converter writes it."""
        if self.storage in ("fp8", "fp8_fnuz"):
            encoding = "e4m3fnuz" if self.storage == "fp8_fnuz" else "e4m3fn"
            return WEIGHT_FORMATS[fp8_format_name(self.block[1], encoding)]
        return WEIGHT_FORMATS[_PLAIN_FORMAT[self.storage]]

    @classmethod
    def of(cls, fmt: WeightFormat, compute: str) -> "WeightQuant":
        """The entry that stores weights in ``fmt`` (the inverse of :attr:`format`)."""
        if isinstance(fmt, Fp8Blocks):
            storage = "fp8_fnuz" if fmt.fp8_format == "e4m3fnuz" else "fp8"
            return cls(storage, (fmt.group, fmt.group), "e8m0", compute)
        if fmt is FP4_G32:
            return cls("fp4", (1, fmt.group), "e8m0", compute)
        storage = next(s for s, name in _PLAIN_FORMAT.items() if name == fmt.name)
        return cls(storage, None, None, compute)


@dataclass(frozen=True)
class PoolLayout:
    storage: str  # fp8 / bf16 / fp32 (main); fp4 / fp8 / fp32 (index)
    row_bytes: int
    layout: str  # a tag of the byte layout, separate from the quant mode (gfx950 vs gfx1250 FP4)
    hadamard: bool = False  # index rows are Hadamard-rotated before quantization


@dataclass(frozen=True)
class QuantPlan:
    target: str
    numerics: str
    fp8_format: str  # e4m3fn / e4m3fnuz: dense FP8 weights, the main pool's NoPE codes, FP8 index rows
    weights: dict[str, WeightQuant]  # by checkpoint storage kind (see frontend.tensor_inventory)
    main_kv: PoolLayout
    index_kv: PoolLayout

    @property
    def expert_format(self) -> str:
        return self.weights["expert"].storage

    def weight_format(self, kind: str) -> WeightFormat:
        """The artifact format of the weights of checkpoint storage ``kind`` (a ``weights`` key)."""
        return self.weights[kind].format

    def format_of(self, quant: str) -> WeightFormat:
        """The format of a dense (not routed-expert) weight the IR marks ``quant`` (the checkpoint's
        own format, ``frontend.trace``): FP8 blocks are the dense kind's, BF16 / fp32 their own."""
        return self.weight_format(self._dense_kind(quant))

    def compute_of(self, quant: str) -> str:
        """What the matmuls of a dense weight the IR marks ``quant`` multiply in (``WeightQuant.compute``)."""
        return self.weights[self._dense_kind(quant)].compute

    @staticmethod
    def _dense_kind(quant: str) -> str:
        return "dense" if isinstance(WEIGHT_FORMATS.get(quant), Fp8Blocks) else quant

    def to_json(self) -> dict:
        return asdict(self)

"""Per-target quantization plan (SPEC §5): how every weight kind and every pool plane is
stored, its block shape, scale format and compute dtype. Computed once per (model, target,
numerics) and passed on: the pool geometry, the weight converter, the kernels and the
artifact manifest all read it from here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsv4c.errors import UsageError
from dsv4c.frontend.config import ModelConfig

TARGETS = ("llvm", "sm90", "gfx942", "gfx950")


@dataclass(frozen=True)
class WeightLayout:
    storage: str  # fp8 / fp4 / bf16 / fp32 / int
    block: tuple[int, int] | None  # quantization block (rows, cols); None when unquantized
    scale: str | None  # e8m0 / fp32 / None
    compute: str  # dtype the kernel multiplies in


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
    weights: dict[str, WeightLayout]  # by checkpoint storage kind (see frontend.checkpoint)
    main_kv: PoolLayout
    index_kv: PoolLayout

    @property
    def expert_format(self) -> str:
        return self.weights["expert"].storage

    def to_json(self) -> dict:
        return asdict(self)


def main_row_bytes(cfg: ModelConfig, storage: str) -> int:
    if storage == "fp8":
        # NoPE e4m3 values + one E8M0 scale per 64, padded to 8 bytes (the 448 + 8 packing of
        # vLLM / SGLang), then the BF16 rope plane: 584 B for V4.
        scales = -(-cfg.nope_dim // 64)
        return cfg.nope_dim + (-(-scales // 8) * 8) + 2 * cfg.rope_dim
    return cfg.head_dim * {"bf16": 2, "fp32": 4}[storage]


def index_row_bytes(cfg: ModelConfig, storage: str) -> int:
    return index_row_bytes_of(cfg.index_head_dim, storage)


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


KV_CACHE_DTYPES = ("auto", "fp32", "fp8")


def plan_for(cfg: ModelConfig, target: str, numerics: str = "exact", kv_cache_dtype: str = "auto") -> QuantPlan:
    if target not in TARGETS and target != "reference":
        raise UsageError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)} (or reference)")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UsageError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    fnuz = target == "gfx942"
    fp8 = "fp8_fnuz" if fnuz else "fp8"
    # gfx942 keeps the e4m3fn bits and doubles the (still power-of-two) scale.
    blocks = WeightLayout(fp8, (128, 128), "e8m0", "bf16" if target != "llvm" else "fp32")
    if target == "gfx950":
        expert = WeightLayout("fp4", (1, 32), "e8m0", "fp4")  # native MX FP4 math
    else:
        # No FP4 math on sm90 / gfx942: the kernels dequantize FP4 to BF16 (CPU: fp32).
        expert = WeightLayout("fp4", (1, 32), "e8m0", "fp32" if target == "llvm" else "bf16")
    compute = "fp32" if target in ("llvm", "reference") else "bf16"
    weights = {
        "dense": blocks,
        "expert": expert,
        "bf16": WeightLayout("bf16", None, None, compute),
        "fp32": WeightLayout("fp32", None, None, "fp32"),  # mHC, sinks, router bias, norms: fp32 everywhere
        "index": WeightLayout("int", None, None, "int32"),
    }
    cpu = target in ("llvm", "reference")
    if kv_cache_dtype == "auto":
        # The CPU pool follows the numerics: fp32 rows reproduce transformers exactly, the
        # official FP8 / FP4 rows reproduce the QAT reference exactly. GPUs keep low-bit rows.
        kv_cache_dtype = "fp32" if cpu and numerics == "exact" else "fp8"
    if kv_cache_dtype == "fp32":  # full-precision rows on any target (parity, debugging)
        main = index = "fp32"
    else:
        # Index rows: FP4 where the hardware has FP4 math (gfx950) and in the QAT reference,
        # FP8 with a per-row scale elsewhere.
        main = "fp8"
        index = "fp4" if target == "gfx950" or (cpu and numerics == "qat") else "fp8"
    # gfx950 has an FP4 logits kernel to feed (see FP4_PRESHUFFLED); the CPU's FP4 rows (qat) are
    # read by our own kernels only.
    index_layout = FP4_PRESHUFFLED if target == "gfx950" and index == "fp4" else ROW_MAJOR
    nope = cfg.head_dim - cfg.rope_dim
    if main == "fp8" and nope % 64:
        raise UsageError(f"an fp8 KV cache scales NoPE channels in groups of 64, and this model has {nope} "
                         f"(head_dim {cfg.head_dim} - rope {cfg.rope_dim}); use --kv-cache-dtype fp32")
    if index == "fp4" and cfg.index_head_dim % 32:
        raise UsageError(f"fp4 index rows scale groups of 32 channels, and index_head_dim is {cfg.index_head_dim}; "
                         "use --kv-cache-dtype fp32")
    return QuantPlan(
        target=target,
        numerics=numerics,
        fp8_format="e4m3fnuz" if fnuz else "e4m3fn",
        weights=weights,
        main_kv=PoolLayout(main, main_row_bytes(cfg, main), MAIN_FP8_LAYOUT if main == "fp8" else ROW_MAJOR),
        index_kv=PoolLayout(index, index_row_bytes(cfg, index), index_layout, hadamard=index == "fp4"),
    )

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
    d = cfg.index_head_dim
    # FP4: packed e2m1 + one E8M0 per 32 (68 B for d=128); FP8: e4m3 + one fp32 scale (132 B).
    return {"fp4": d // 2 + d // 32, "fp8": d + 4, "fp32": 4 * d}[storage]


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
    index_layout = "gfx950_fp4_preshuffled" if target == "gfx950" and index == "fp4" else "rowmajor"
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
        main_kv=PoolLayout(main, main_row_bytes(cfg, main), "nope_scales_rope" if main == "fp8" else "rowmajor"),
        index_kv=PoolLayout(index, index_row_bytes(cfg, index), index_layout, hadamard=index == "fp4"),
    )

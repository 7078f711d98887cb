"""Choosing the per-target quantization plan (the plan itself is ``artifact.quant.QuantPlan``):
how every weight kind and every pool plane is stored, its block shape, scale format and the
dtype the kernels multiply in. Computed once per (model, target, numerics) and passed on: the
pool geometry, the lowering (each weight's format), the weight converter and the artifact
manifest read it.
"""

from __future__ import annotations

from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.pool_rows import FP4_PRESHUFFLED, MAIN_FP8_LAYOUT, ROW_MAJOR, index_row_bytes_of, main_row_bytes
from dsv4c.artifact.quant import (NUMERICS, PoolLayout, QuantPlan, WeightQuant, checkpoint_quants, dense_format,
                                  expert_format)
from dsv4c.errors import UsageError
from dsv4c.targets import target_info

KV_CACHE_DTYPES = ("auto", "fp32", "fp8")


def plan_for(cfg: ModelConfig, target: str, numerics: str = "exact", kv_cache_dtype: str = "auto") -> QuantPlan:
    info = target_info(target)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UsageError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    cpu = not info.gpu
    if numerics not in NUMERICS:
        raise UsageError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if numerics == "bf16" and not (cpu and info.compiled):
        raise UsageError(f"bf16 numerics are the llvm target's compiled GEMMs; {target} does not build them")
    # The kernels multiply decoded fp32 values on CPUs; GPU tensor cores take fp16 operands (the
    # MMA / MFMA GEMMs of kernels.gpu_matmul, gfx950 included: its FP4 math is not used for weights).
    compute = "fp32" if cpu else "fp16"
    quants = checkpoint_quants(cfg.weights)

    def stored(fmt):  # bf16 numerics: FP8, FP4 and BF16 weights widen to BF16 exactly, fp32 ones do not
        return WeightQuant.of(fmt, "bf16" if numerics == "bf16" and fmt.name != "fp32" else compute)

    # FP8 blocks keep their block size (fnuz bits with doubled scales on gfx942), FP4 experts their
    # groups, BF16 its bits; other experts are stored fp32 (artifact.quant.dense_format / expert_format).
    weights = {
        "dense": stored(dense_format(quants["dense"], info.fp8_format)),
        "expert": stored(expert_format(quants["expert"])),
        "bf16": stored(dense_format(quants["bf16"])),
        "fp32": WeightQuant("fp32", None, None, "fp32"),  # mHC, sinks, router bias, norms: fp32 everywhere
        "index": WeightQuant("int", None, None, "int32"),
    }
    if cfg.family == "v4.1":
        # V4.1's rows are already on its own FP8 / FP4 grids (its fake-quant round trips, part of
        # the model's numerics): V4's pool codecs would quantize them a second time, differently.
        if kv_cache_dtype == "fp8":
            raise UsageError(f"{cfg.name}: DeepSeek-V4.1's pool keeps its own round-tripped rows in fp32; "
                             "an fp8 KV cache is not implemented for it (use --kv-cache-dtype fp32 or auto)")
        kv_cache_dtype = "fp32"
    if kv_cache_dtype == "auto":
        # The CPU pool follows the numerics: fp32 rows reproduce transformers exactly, the
        # official FP8 / FP4 rows reproduce the QAT reference exactly. GPUs keep low-bit rows.
        kv_cache_dtype = "fp32" if cpu and numerics in ("exact", "bf16") else "fp8"
    if kv_cache_dtype == "fp32":  # full-precision rows on any target (parity, debugging)
        main = index = "fp32"
    else:
        # Index rows: FP4 where the hardware has FP4 math (gfx950) and in the QAT reference,
        # FP8 with a per-row scale elsewhere.
        main = "fp8"
        index = "fp4" if info.fp4_math or (cpu and numerics == "qat") else "fp8"
    # gfx950 has an FP4 logits kernel to feed (see FP4_PRESHUFFLED); the CPU's FP4 rows (qat) are
    # read by our own kernels only.
    index_layout = FP4_PRESHUFFLED if info.fp4_math and index == "fp4" else ROW_MAJOR
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
        fp8_format=info.fp8_format,
        weights=weights,
        main_kv=PoolLayout(main, main_row_bytes(cfg.head_dim, cfg.rope_dim, main), MAIN_FP8_LAYOUT if main == "fp8" else ROW_MAJOR),
        index_kv=PoolLayout(index, index_row_bytes_of(cfg.index_head_dim, index), index_layout, hadamard=index == "fp4"),
    )

"""``dsv4c compile``: trace, run the pass pipeline, lay out weights, build kernels, write the artifact."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from dsv4c import __version__
from dsv4c.errors import UsageError
from dsv4c.frontend.checkpoint import ir_weights, load_weights, random_weights
from dsv4c.frontend.config import ModelConfig, resolve_model
from dsv4c.frontend.safetensors_io import write_safetensors
from dsv4c.frontend.trace import trace
from dsv4c.ir.core import Program
from dsv4c.ir.serialize import program_to_json
from dsv4c.passes.merge_projections import base_weight_names, materialize_weights
from dsv4c.passes.pipeline import PipelineOptions, run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.runtime.artifact import staging, write_manifest
from dsv4c.runtime.kv_pool import PoolGeometry
from dsv4c.targets import target_info


def _weights_for(cfg: ModelConfig, model: str, program: Program, no_weights: bool, progress: bool):
    """Checkpoint weights by their IR names (routed experts stacked), or None."""
    if no_weights:
        return None
    names = base_weight_names(program)
    if Path(model).is_dir():
        return load_weights(cfg, model, names, progress=progress)
    if model == "tiny":
        # The built-in tiny preset compiles with the same weights `dsv4c make-tiny --seed 0` writes.
        weights = ir_weights(random_weights(cfg, 0))
        return {k: v for k, v in weights.items() if k in names}
    raise UsageError(f"model {model!r} has no weights here; pass a model directory, or --no-weights to compile "
                     "the structure only")


def step_constants(program: Program) -> dict[str, tuple[str, np.ndarray]]:
    """The constant tensors the compiled step takes beside the weights: both rope frequency
    tables (computed once, here, so every runtime uses the same bits) and ones vectors for
    the unweighted norms (their kernels share the weighted signature)."""
    from dsv4c.codegen.relax_step import constant_names

    cfg = program.config
    tables = {"const.rope.main": cfg.main_rope.inv_freq(cfg.rope_dim),
              "const.rope.compress": cfg.compress_rope.inv_freq(cfg.rope_dim)}
    out = {}
    for name in constant_names(program):
        if name in tables:
            out[name] = ("F32", np.ascontiguousarray(tables[name], np.float32))
        elif name.startswith("const.ones."):
            out[name] = ("F32", np.ones(int(name.rsplit(".", 1)[1]), np.float32))
    return out


def compile_model(model: str, target: str, out: str | Path, numerics: str = "exact", no_weights: bool = False,
                  progress: bool | None = None, log=print, passes: PipelineOptions | None = None,
                  kv_cache_dtype: str = "auto") -> Path:
    info = target_info(target)
    progress = sys.stderr.isatty() if progress is None else progress
    cfg = resolve_model(model)
    program = run_pipeline(trace(cfg, numerics), passes)
    plan = plan_for(cfg, target, numerics, kv_cache_dtype)
    geometry = PoolGeometry.build(cfg, plan)
    weights = _weights_for(cfg, model, program, no_weights, progress)
    if weights is not None:
        weights = materialize_weights(program, weights)
    with staging(out, log) as tmp:
        if weights is not None:
            if not info.compiled:
                stored = {k: ("F32", np.ascontiguousarray(v, np.float32)) if v.dtype.kind == "f"
                          else ("I64", v.astype(np.int64)) for k, v in weights.items()}
            else:
                from dsv4c.codegen.lowering import weight_layout

                stored = {**weight_layout(program, weights, plan.fp8_format), **step_constants(program)}
            write_safetensors(tmp / "weights.safetensors", stored)
        (tmp / "program.json").write_text(json.dumps(program_to_json(program)))
        # tokenizer_config.json carries the chat template `dsv4c serve` renders chat requests with.
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if Path(model).is_dir() and (Path(model) / name).is_file():
                shutil.copyfile(Path(model) / name, tmp / name)
        entry_points = {"step": {"inputs": ["tokens:i32[T]", "positions:i32[T]", "seq_ids:i32[T]"],
                                 "outputs": ["logits:f32[T,vocab]", "streams:f32[T,hc,D]"]}}
        kernels, vm = {}, None
        if info.compiled:
            from dsv4c.codegen.build import build_step

            kernels, vm = build_step(program, plan, geometry, tmp, target, progress=progress)
        import tvm

        write_manifest(tmp, {
            "dsv4c_version": __version__,
            "tvm_version": tvm.__version__,
            "target": target,
            "numerics": numerics,
            "kv_cache_dtype": kv_cache_dtype,
            "model_name": cfg.name,
            "model": cfg.to_json_dict("hf"),
            "has_weights": weights is not None,
            "quant_plan": plan.to_json(),
            "pool_geometry": geometry.summary(),
            "entry_points": entry_points,
            "kernels": kernels,
            **({"vm": vm} if vm else {}),
        })
    log(f"compiled {cfg.name} for {target} ({numerics}) -> {out}")
    return Path(out)

"""``dsv4c compile``, the driver of the whole pipeline, phase by phase:

1. frontend: resolve the model (preset or directory) and trace it into the IR;
2. passes: the pass pipeline, then the target's quantization plan;
3. artifact: the pool geometry that plan implies;
4. frontend: open the checkpoint and check every tensor it must supply (before anything is written);
5. codegen: build the compiled step in a thread while the weights convert into the artifact's layout;
6. artifact: write the manifest last, into a staging directory renamed into place at the end.

It sits above the layers it drives; ``codegen/`` only lowers and builds.
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from dsv4c import __version__
from dsv4c.artifact.file_names import CONSTANTS, COPIED_FROM_MODEL, ENGRAM_HASH, PROGRAM, TOKENIZER, rank_prefix
from dsv4c.artifact.engram_tables import table_format, table_weight
from dsv4c.artifact.manifest import (EngramFiles, EntryPoint, Kernels, Manifest, RankWeights, Vm, Weights, staging,
                                     write_manifest)
from dsv4c.artifact.json_record import parse_record
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.pool import PoolGeometry
from dsv4c.artifact.quant import QuantPlan, WeightFormat
from dsv4c.artifact.safetensors_io import write_safetensors
from dsv4c.artifact.sharding import RANK_VALUES, ShardingPlan
from dsv4c.artifact.vision import vision_manifest
from dsv4c.errors import UsageError
from dsv4c.frontend.checkpoint import Checkpoint, ir_sources, skipped_v41_tensors
from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.draft_model import resolve_drafter
from dsv4c.frontend.engram import engram_tables
from dsv4c.frontend.random_model import iter_random_weights
from dsv4c.frontend.config import resolve_model
from dsv4c.frontend.trace import trace
from dsv4c.frontend.vision import model_vision, vision_sources
from dsv4c.ir.core import Program, concat_parts
from dsv4c.ir.serialize import program_to_json
from dsv4c.passes.merge_projections import base_weight_names, weight_sources
from dsv4c.passes.pipeline import PipelineOptions, run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.targets import target_info


def _checkpoint_dir(cfg: ModelConfig, model: str, stack: ExitStack) -> Path:
    """The checkpoint directory to read weights from."""
    if Path(model).is_dir():
        return Path(model)
    if model == "tiny":
        # The built-in tiny preset compiles with the weights `dsv4c make-tiny --seed 0` writes.
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dsv4c-tiny-")))
        return write_checkpoint(cfg, iter_random_weights(cfg, 0), tmp / "model")
    raise UsageError(f"model {model!r} has no weights here; pass a model directory, or --no-weights to compile "
                     "the structure only")


def step_constants(program: Program) -> dict:
    """The constant tensors the compiled step takes beside the weights: both rope frequency
    tables (computed once, here, so every runtime uses the same bits) and ones vectors for
    the unweighted norms (their kernels share the weighted signature)."""
    import numpy as np

    from dsv4c.codegen.relax_step import constant_names

    cfg = program.config
    tables = {"const.rope.main": cfg.main_rope.inv_freq(cfg.rope_dim),
              "const.rope.compress": cfg.compress_rope.inv_freq(cfg.rope_dim)}
    out = {}
    for name in constant_names(program):
        if name in tables:
            out[name] = ("F32", np.ascontiguousarray(tables[name], np.float32))
        else:
            out[name] = ("F32", np.ones(int(name.rsplit(".", 1)[1]), np.float32))
    return out


def rank_sources(program: Program, sharding: ShardingPlan, rank: int, checkpoint: dict) -> dict:
    """The row sources of rank ``rank``'s weights by the program's names: its part of each
    checkpoint weight (``artifact.rows.ShardRows``), merged projections of those parts,
    and the rank's ``tp.*`` values."""
    from dsv4c.artifact.rows import ConstantRows, ShardRows

    base = {name: ShardRows(source, sharding.shard(name, source.shape, rank)) for name, source in checkpoint.items()}
    if sharding.tensor_parallel > 1:
        base.update((name, ConstantRows([value])) for name, value in sharding.rank_values(rank).items())
    return weight_sources(program, base)


def weights_entry(reports: list) -> Weights | None:
    """The manifest's ``weights``: the index and files of the one device, or with several ranks
    every rank's (``ranks``, in rank order) and all their files (``files``)."""
    if not reports:
        return None
    if len(reports) == 1:
        return Weights(index=reports[0].index, files=tuple(reports[0].files))
    return Weights(files=tuple(f for r in reports for f in r.files),
                   ranks=tuple(RankWeights(index=r.index, files=tuple(r.files)) for r in reports))


# The IR step function's signature, recorded for readers of the program (the runtimes call the
# compiled entry functions, ``vm.inputs``).
STEP_ENTRY_POINT = EntryPoint(inputs=("tokens:i32[T]", "positions:i32[T]", "seq_ids:i32[T]"),
                              outputs=("logits:f32[T,vocab]", "streams:f32[T,hc,D]"))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def stored_weights(cfg: ModelConfig, plan: QuantPlan) -> list[tuple[str, tuple[int, ...], WeightFormat]]:
    """Every weight an artifact of ``cfg`` under quantization ``plan`` stores, as (checkpoint name,
    shape, the format its layout stores it in), merged projections as their parts: what
    ``dsv4c inspect`` sizes per device under a sharding plan."""
    from dsv4c.codegen.lowering import weight_layouts

    program = trace(cfg, plan.numerics)
    shapes = {name: tuple(v.type.shape) for fn in program.functions.values() for name, v in fn.weights.items()}
    layouts = weight_layouts(run_pipeline(program), plan)
    return [(part, shapes[part], layout.format) for layout in layouts.values()
            for part in concat_parts(layout.name) or [layout.name]]


def _write_engram_hash(cfg: ModelConfig, model: str, out: Path, log) -> str | None:
    """The Engram hash constants, derived from the model directory's tokenizer, and their file;
    a model without one (a preset) compiles, but its artifact cannot run a step (None)."""
    if not (Path(model).is_dir() and (Path(model) / TOKENIZER).is_file()):
        log(f"dsv4c: note: {cfg.name} has no {TOKENIZER}: the artifact has no Engram hash constants and "
            "cannot run; compile a model directory with its tokenizer")
        return None
    engram_tables(cfg, model).save(out / ENGRAM_HASH)
    return ENGRAM_HASH


def compile_model(model: str, target: str, out: str | Path, numerics: str = "exact", no_weights: bool = False,
                  progress: bool | None = None, log=print, passes: PipelineOptions | None = None,
                  kv_cache_dtype: str = "auto", shard_bytes: int | None = None, cpu: str | None = None,
                  tensor_parallel: int = 1, expert_parallel: bool = True,
                  draft_model: str | Path | None = None) -> Path:
    """Compile ``model`` for ``target`` into the artifact directory ``out``. The kernels build
    in a thread while the weights convert (see :mod:`dsv4c.codegen.convert`); ``shard_bytes``
    caps each weight file (default 4 GiB); ``cpu`` (llvm only) is the LLVM CPU name to build
    for, or native (the default: this machine's). ``tensor_parallel`` N > 1 builds one library
    every rank runs and each rank's weights (``rank<r>-weights*.safetensors``), per the model's
    sharding plan (``artifact.sharding``; a model that does not split so is refused). A DSpark
    drafter comes from the model's checkpoint or from ``draft_model``'s (``frontend.draft_model``)."""
    info = target_info(target, cpu)
    progress = sys.stderr.isatty() if progress is None else progress
    cfg = resolve_model(model)
    cfg = resolve_drafter(cfg, Path(model) if Path(model).is_dir() and not no_weights else None, draft_model)
    sharding = ShardingPlan.build(cfg, tensor_parallel, expert_parallel)
    if tensor_parallel > 1 and not info.compiled:
        raise UsageError(f"--tensor-parallel {tensor_parallel}: the {target} target runs one process on one device; "
                         "compile for llvm or a GPU target to split the model")
    program = run_pipeline(trace(cfg, numerics, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel),
                           passes)
    plan = plan_for(cfg, target, numerics, kv_cache_dtype)
    geometry = PoolGeometry.build(cfg, plan)
    # A V4.1 vision tower compiles into the library as encode_image (codegen.relax_vision).
    vision = model_vision(model, cfg) if info.compiled else None
    from dsv4c.codegen.convert import SHARD_BYTES, convert_engram_tables, convert_weights
    from dsv4c.codegen.lowering import weight_layouts

    with ExitStack() as stack:
        sources = None
        vision_rows = {}
        if not no_weights:
            ckpt = stack.enter_context(Checkpoint(_checkpoint_dir(cfg, model, stack), drafter=draft_model))
            # Every tensor's storage and shape is checked here, before anything is written.
            vision_rows = vision_sources(ckpt, *vision) if vision is not None else {}
            skipped_v41_tensors(cfg, [n for n in ckpt.names() if n not in vision_rows])
            sources = ir_sources(cfg, ckpt, {n for n in base_weight_names(program) if n not in RANK_VALUES})
        with staging(out, log) as tmp:
            (tmp / PROGRAM).write_text(json.dumps(program_to_json(program)))
            # tokenizer_config.json carries the chat template `dsv4c serve` renders chat requests with.
            for name in COPIED_FROM_MODEL:
                if Path(model).is_dir() and (Path(model) / name).is_file():
                    shutil.copyfile(Path(model) / name, tmp / name)
            engram_hash = _write_engram_hash(cfg, model, tmp, log) if cfg.engram is not None else None
            with ThreadPoolExecutor(1, thread_name_prefix="dsv4c-kernels") as builder:
                building = None
                if info.compiled:
                    from dsv4c.codegen.build import build_step

                    from dsv4c.codegen.relax_vision import vision_constants

                    constants = step_constants(program)
                    if vision is not None:
                        constants.update(vision_constants(vision[1]))
                    write_safetensors(tmp / CONSTANTS, constants)
                    # Alongside the weights: the build spends most of its time in TVM / LLVM,
                    # which release the GIL. Only one progress bar: the weights' when there are any.
                    building = builder.submit(build_step, program, plan, geometry, tmp, info,
                                              progress=progress and sources is None, vision=vision)
                reports = []
                if sources is not None:
                    layouts = weight_layouts(program, plan)
                    if vision is not None:  # every rank's whole tower, after the text model's weights
                        from dsv4c.codegen.relax_vision import vision_layouts

                        layouts.update(vision_layouts(*vision))
                    for rank in range(tensor_parallel):  # each rank's parts, read from the checkpoint alone
                        rank_rows = {**rank_sources(program, sharding, rank, sources), **vision_rows}
                        reports.append(convert_weights(layouts, rank_rows, tmp, shard_bytes or SHARD_BYTES,
                                                       progress=progress, prefix=rank_prefix(rank, tensor_parallel)))
                engram = None
                if cfg.engram is not None:  # the tables in files of their own, once for every rank
                    tables = [] if sources is None else convert_engram_tables(
                        {layer: sources[table_weight(layer)] for layer in cfg.engram.layer_ids}, table_format(cfg),
                        tmp, progress=progress)
                    engram = EngramFiles(hash=engram_hash, tables=tuple(tables))
                kernels, vm = building.result() if building is not None else ({}, None)
            import tvm

            where = f"{out}: the compiled step's description"
            manifest = write_manifest(tmp, Manifest(
                dsv4c_version=__version__,
                tvm_version=tvm.__version__,
                target=target,
                numerics=numerics,
                kv_cache_dtype=kv_cache_dtype,
                model_name=cfg.name,
                model=cfg.to_json_dict("hf"),
                has_weights=bool(reports),
                weights=weights_entry(reports),
                engram=engram,
                tensor_parallel=tensor_parallel,
                expert_parallel=expert_parallel if tensor_parallel > 1 else None,
                quant_plan=plan.to_json(),
                pool_geometry=geometry.summary(),
                entry_points={"step": STEP_ENTRY_POINT},
                kernels=parse_record(Kernels, kernels, where, "kernels"),
                vm=parse_record(Vm, {**vm, "constants": CONSTANTS}, where, "vm") if vm else None,
                vision=vision_manifest(*vision) if vision is not None else None,
                files={},  # write_manifest records the files
            ))
    built_for = f"{manifest.kernels.mcpu}, " if manifest.kernels.mcpu else ""
    ranks = f", tensor parallel {tensor_parallel}{'' if expert_parallel else ', experts split'}" \
        if tensor_parallel > 1 else ""
    summary = f"compiled {cfg.name} for {target} ({built_for}{numerics}{ranks}) -> {out}"
    if reports:
        written, seconds = sum(r.bytes_written for r in reports), sum(r.seconds for r in reports)
        summary += (f": weights {written / 1e9:.2f} GB in {sum(len(r.files) for r in reports)} file(s), "
                    f"{seconds:.1f} s ({written / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
        tables = manifest.engram_table_files()
        if tables:
            table_bytes = sum(manifest.files[f].bytes for f in tables)
            summary += f", Engram tables {table_bytes / 1e9:.2f} GB in {len(tables)} file(s)"
    log(f"{summary}; peak RSS {_peak_rss_gib():.2f} GiB")
    return Path(out)

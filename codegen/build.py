"""Build the compiled step: the kernels of a program, specialised for the target, and the
Relax entry functions that call them, into one library the runtime opens with
``relax.VirtualMachine`` (the ``vm`` section of the manifest describes it)."""

from __future__ import annotations

import time
from pathlib import Path

import tvm
from tvm import relax, tirx

from dsv4c.artifact.file_names import LIBRARY
from dsv4c.codegen.gpu import export_options, toolchain
from dsv4c.codegen.kernels.cpu import CPU_PASS_CONFIG
from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.codegen.lowering import kernel_table, replays_cuda_graphs
from dsv4c.codegen.relax_vision import VisionEmitter, vision_kernels, vision_params
from dsv4c.codegen.relax_step import (GEMV_MAX_ROWS, IMAGE_INPUTS, MTP_INPUTS, POOL_FUNCTIONS, STEP_INPUTS,
                                     build_step_module, engram_table_inputs)
from dsv4c.ir.core import Program
from dsv4c.targets import TargetInfo

DEFAULT_MAX_STEP_TOKENS = 2048  # the prefill function's memory bound (Engine max_step_tokens)


def relax_pipeline(target: tvm.target.Target, cuda_graph: bool) -> tvm.transform.Pass:
    """The passes that turn our call_tir-only functions into VM code: no fusion or legalization
    (every call already is a scheduled kernel), static memory planning under the declared
    token bounds, and on CUDA the rewrite of static regions into captured CUDA graphs."""
    t = relax.transform
    passes = [t.ToNonDataflow(), t.RemovePurityChecking(), t.CallTIRRewrite(), t.StaticPlanBlockMemory()]
    if cuda_graph:
        passes.append(t.RewriteCUDAGraph())
    passes += [t.LowerAllocTensor(), t.KillAfterLastUse(), t.LowerRuntimeBuiltin(), t.ComputePrimValue(),
               t.VMShapeLower(), t.AttachGlobalSymbol()]
    seq = tvm.transform.Sequential(passes)

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return seq(mod)

    return pipeline


def serial_when_single(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A kernel whose outer loop is parallel runs that loop inline when it has one iteration
    (one token or request: most kernels of a batch-1 decode step). Waking the CPU thread pool
    for a single task costs more than the task, and far more on a loaded machine."""
    body = func.body
    if not (isinstance(body, tirx.For) and body.kind == tirx.ForKind.PARALLEL):
        return func
    inline = tirx.For(body.loop_var, body.min, body.extent, tirx.ForKind.SERIAL, body.body)
    # The two copies define the same variables; ConvertSSA renames the second.
    return tirx.transform.ConvertSSA()(tvm.IRModule({"main": func.with_body(
        tirx.IfThenElse(body.extent > 1, body, inline))}))["main"]


def lower_step(program: Program, plan, geometry, info: TargetInfo, max_step_tokens: int, progress: bool = False,
               vision=None):
    """(the Relax module after our pipeline, the step description, the TVM target): what
    ``build_step`` compiles. Tests inspect the lowered module (e.g. for CUDA graphs). ``vision``
    (an ``artifact.vision`` (VisionGeometry, VisionTower)) adds ``encode_image``."""
    specs, _ = kernel_table(program, plan)
    if vision is not None:
        specs.update(vision_kernels(*vision))
    target = info.tvm_target()
    items = list(specs.items())
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="generating kernels", unit="kernel", leave=False)
    if info.kind == "cpu":
        with target:  # the CPU kernels read its vector width (kernels.cpu.cpu_vector)
            kernels = {symbol: serial_when_single(KERNELS[spec.factory](*spec.params)) for symbol, spec in items}
    else:
        from dsv4c.codegen.gpu import gpu_kernel

        kernels = {symbol: gpu_kernel(spec, target) for symbol, spec in items}
    cuda_graph = replays_cuda_graphs(program, plan)
    extra = {} if vision is None else {
        "extra_params": vision_params(*vision),
        "emit_extra": lambda bb, gvars, params: VisionEmitter(bb, gvars, params).encode_image(*vision)}
    step = build_step_module(program, plan, geometry, kernels, max_step_tokens, cuda_graph, **extra)
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": cuda_graph}):
        lowered = relax_pipeline(target, cuda_graph)(step.module)
    return lowered, step, target


def build_step(program: Program, plan, geometry, out_dir: Path, info: TargetInfo,
               max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS, progress: bool = False,
               vision=None) -> tuple[dict, dict]:
    """Compile the step (and with ``vision`` encode_image) into ``out_dir / LIBRARY``; the
    manifest's ``kernels`` and ``vm`` sections."""
    start = time.perf_counter()
    lowered, step, target = lower_step(program, plan, geometry, info, max_step_tokens, progress, vision)
    config = CPU_PASS_CONFIG if info.kind == "cpu" else {}
    with toolchain(info), tvm.transform.PassContext(config=config):
        executable = tvm.compile(lowered, target=target, relax_pipeline=None)
        executable.export_library(str(out_dir / LIBRARY), **export_options(info, target))
    symbols = list(kernel_table(program, plan)[0])
    kernels = {"count": len(symbols), "build_seconds": round(time.perf_counter() - start, 2),
               **info.library_facts(target)}
    # A V4.1 step with Engram layers takes each token's table rows, then the tables, last (codegen.relax_step).
    engram = ["engram_rows", *engram_table_inputs(program.config)] \
        if any(v.name == "engram_rows" for v in program.functions["step"].inputs) else []
    vm = {"library": LIBRARY, "functions": step.functions, "inputs": list(STEP_INPUTS) + engram,
          "mtp_inputs": list(STEP_INPUTS + MTP_INPUTS), "outputs": ["logits", "streams"], "params": step.params,
          "pool": [p.to_json() for p in step.pool], "entry_ratios": step.entry_ratios,
          "max_step_tokens": step.max_step_tokens, "decode_max_tokens": GEMV_MAX_ROWS,
          "cuda_graph": step.cuda_graph, "pool_functions": POOL_FUNCTIONS,
          "profile": {"kernels": symbols, "calls": {name: call_runs(calls) for name, calls in step.call_families.items()}}}
    if any(v.name == "image_index" for v in program.functions["step"].inputs):
        vm["image_inputs"] = list(IMAGE_INPUTS)  # the prefill function's, after vm.inputs (docs/artifact.md)
    if "dspark_draft" in program.functions:  # a DSpark drafter (docs/artifact.md, "The compiled step")
        vm["dspark"] = {"draft_inputs": list(STEP_INPUTS), "draft_outputs": ["logits", "y"],
                        "markov_inputs": list(STEP_INPUTS + MTP_INPUTS), "markov_outputs": ["bias", "confidence"]}
    return kernels, vm


def call_runs(call_families: list[dict[str, float]]) -> list[list]:
    """An entry function's kernel calls as runs ``[families, count]`` of consecutive calls with
    the same families: a family's name, or ``{family: share}`` for a merged projection's parts
    (the manifest's ``vm.profile.calls``; runs keep it small for 61-layer models)."""
    runs: list[list] = []
    for families in call_families:
        key = next(iter(families)) if len(families) == 1 else {f: round(s, 4) for f, s in families.items()}
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    return runs

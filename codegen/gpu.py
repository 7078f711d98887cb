"""GPU targets: the same kernels as the CPU target, bound to GPU threads, built ahead of time.

Where the CPU kernel's parallelism (one task per row) would starve a GPU or hold a row's whole
working set in one thread, a GPU-only kernel of the same arguments replaces it: decode's GEMVs
(``kernels.gpu_gemv``), prefill's GEMMs that tile onto tensor cores (``kernels.gpu_matmul``:
MMA / MFMA, float16 operands), the expert grouping (``kernels.gpu_moe``), sparse attention,
index scoring and top-k (``kernels.gpu_attention`` / ``gpu_index`` / ``gpu_topk``: a block of
threads per query or block of entries, in shared memory). Every other kernel of
``codegen.kernels`` is either a compute definition (GEMMs of other widths: built with TE and
scheduled by dlight's GPU rules) or hand-written TIR whose outermost loop runs over independent
rows (tokens, windows, pool rows); that loop is mapped onto blocks x threads (one thread per
row), which is exactly the parallelism the CPU schedule uses. :data:`SCHEDULE_RULES` lists these
choices in order, each with the kernel families it applies to. The kernels and the Relax entry
functions that call them are one library holding machine code for the GPU: for sm90 a fatbin
of sm_90a code that nvcc compiles from TVM's CUDA C++ at build time (:func:`export_options`);
for gfx942 / gfx950 AMDGPU code objects from TVM's LLVM backend, linked by ``ld.lld`` >= 19
against the ROCm device bitcode.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import tvm
from tvm import tirx

from dsv4c.artifact.device_code import device_module, unpack_imports
from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.codegen.kernels.gpu_attention import sparse_attn_kernel
from dsv4c.codegen.kernels.gpu_gemv import gemv_kernel
from dsv4c.codegen.kernels.gpu_index import index_score_kernel
from dsv4c.codegen.kernels.gpu_matmul import mma_kernel
from dsv4c.codegen.kernels.gpu_moe import moe_group_kernel
from dsv4c.codegen.kernels.gpu_topk import topk_rows_kernel
from dsv4c.errors import DsvError

THREADS = 64


class ToolchainError(DsvError):
    """A compiler or library needed to build for a GPU target is missing or too old."""


# --------------------------------------------------------------------------- schedule rules


def _thread_var(name: str, extent, tag: str) -> tuple[tirx.Var, tirx.IterVar]:
    var = tirx.Var(name, "int32")
    return var, tirx.IterVar(tvm.ir.Range(0, extent), var, tirx.IterVar.ThreadIndex, tag)


def _bind_rows(loop: tirx.For) -> tirx.Stmt:
    """``for t in parallel(n): body`` -> one GPU thread per t, blocks of THREADS."""
    n = loop.extent
    bx, bx_iv = _thread_var("bx", tirx.floordiv(n + THREADS - 1, THREADS), "blockIdx.x")
    tx, tx_iv = _thread_var("tx", THREADS, "threadIdx.x")
    row = bx * THREADS + tx
    body = tirx.IfThenElse(row < n, tirx.SeqStmt([tirx.Bind(loop.loop_var, row), loop.body]), None)
    inner = tirx.For(tx, 0, THREADS, tirx.ForKind.THREAD_BINDING, body, thread_binding=tx_iv)
    return tirx.For(bx, 0, bx_iv.dom.extent, tirx.ForKind.THREAD_BINDING, inner, thread_binding=bx_iv)


def _single_thread(stmt: tirx.Stmt) -> tirx.Stmt:
    """Sequential kernels (ring updates that must not race) run on one GPU thread."""
    bx, bx_iv = _thread_var("bx", 1, "blockIdx.x")
    tx, tx_iv = _thread_var("tx", 1, "threadIdx.x")
    inner = tirx.For(tx, 0, 1, tirx.ForKind.THREAD_BINDING, stmt, thread_binding=tx_iv)
    return tirx.For(bx, 0, 1, tirx.ForKind.THREAD_BINDING, inner, thread_binding=bx_iv)


def _bind_threads(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A CPU kernel on GPU threads: its parallel outer loop one thread per row, else one thread."""
    body = func.body
    if isinstance(body, tirx.For) and body.kind == tirx.ForKind.PARALLEL:
        return func.with_body(_bind_rows(body))
    return func.with_body(_single_thread(body))


GPU_MAX_LANES = 4  # the widest column vector one GPU thread computes (``max_lanes`` of the kernels)


def dlight_schedule(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel's compute definition (built with TE), scheduled by dlight's GPU rules."""
    from tvm.s_tir import dlight as dl

    mod = tvm.IRModule({"main": KERNELS[spec.factory](*spec.params, schedule=False)})
    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                      dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
    return mod["main"]


def capped_vectors(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """The CPU kernel with its column vectors capped at GPU_MAX_LANES lanes, a thread per row."""
    return _bind_threads(KERNELS[spec.factory](*spec.params, max_lanes=GPU_MAX_LANES))


def rows_on_threads(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """The CPU kernel as it is, a thread per row of its parallel loop (one thread if it has none)."""
    return _bind_threads(KERNELS[spec.factory](*spec.params))


@dataclass(frozen=True)
class ScheduleRule:
    """How GPU targets build the kernels of some families (as dlight's rules): ``build`` gives the
    kernel of a spec, or None where this instance is not its case (the next rule is tried).
    ``families`` None: every family."""

    families: frozenset[str] | None
    build: Callable[[object, tvm.target.Target], tirx.PrimFunc | None]

    def applies(self, spec) -> bool:
        return self.families is None or spec.factory in self.families


MATMULS = frozenset({"linear", "expert_linear"})
# In order: the first rule that applies and builds a kernel wins (module docstring).
SCHEDULE_RULES = (
    ScheduleRule(MATMULS, gemv_kernel),  # decode's GEMVs
    ScheduleRule(MATMULS, mma_kernel),  # prefill's GEMMs whose sizes tile onto tensor cores
    ScheduleRule(frozenset({"moe_group"}), moe_group_kernel),
    ScheduleRule(frozenset({"sparse_attn"}), sparse_attn_kernel),
    ScheduleRule(frozenset({"index_score"}), index_score_kernel),
    ScheduleRule(frozenset({"topk_rows"}), topk_rows_kernel),
    ScheduleRule(frozenset({"linear"}), dlight_schedule),  # other GEMMs: a compute definition
    ScheduleRule(frozenset({"expert_linear", "swiglu", "mhc", "rmsnorm_rope", "candidate_mask", "vision_attention"}),
                 capped_vectors),
    ScheduleRule(None, rows_on_threads),
)


def gpu_kernel(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """The kernel of ``spec`` for a GPU ``target``: the first of :data:`SCHEDULE_RULES` that builds one."""
    return next(func for rule in SCHEDULE_RULES
                if rule.applies(spec) and (func := rule.build(spec, target)) is not None)


# --------------------------------------------------------------------------- toolchains


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def rocm_environment() -> dict[str, str]:
    """PATH with an ``ld.lld`` >= 19 and ROCM_PATH with amdgcn/bitcode, or a ToolchainError
    saying what to install (Debian: lld-19, rocm-device-libs)."""
    lld = None
    for name in ("ld.lld", "ld.lld-21", "ld.lld-20", "ld.lld-19"):
        path = shutil.which(name)
        m = re.search(r"LLD (\d+)", _version([path, "--version"])) if path else None
        if m and int(m[1]) >= 19:
            lld = path
            break
    if lld is None:
        raise ToolchainError("gfx942/gfx950 need ld.lld >= 19 on PATH; install Debian's lld-19 (apt-get install lld-19)")
    candidates = [os.environ.get("ROCM_PATH"), "/opt/rocm", "/usr/lib/x86_64-linux-gnu", "/usr/lib"]
    rocm = next((c for c in candidates if c and (Path(c) / "amdgcn" / "bitcode").is_dir()), None)
    if rocm is None:
        raise ToolchainError("gfx942/gfx950 need the ROCm device bitcode (amdgcn/bitcode) under $ROCM_PATH; install "
                             "Debian's rocm-device-libs (apt-get install rocm-device-libs)")
    shim = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsv4c" / "lld-bin"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "ld.lld"
    if not link.exists() or os.path.realpath(link) != os.path.realpath(lld):
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.realpath(lld))  # TVM calls it as plain `ld.lld`
    return {"PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}", "ROCM_PATH": rocm}


CUDA_FOR_SM90A = (12, 0)  # the first CUDA release whose nvcc targets sm_90a


def nvcc_environment() -> dict[str, str]:
    """PATH led by an nvcc that compiles sm_90a (CUDA >= 12.0), found on PATH or under $CUDA_HOME /
    $CUDA_PATH / /usr/local/cuda, and TVM's switch that keeps its CUDA codegen from compiling at
    all (see :func:`export_options`); or a ToolchainError saying what to install."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [shutil.which("nvcc"), *(str(Path(h) / "bin" / "nvcc") for h in homes if h)]
    for path in dict.fromkeys(c for c in candidates if c and os.access(c, os.X_OK)):
        m = re.search(r"release (\d+)\.(\d+)", _version([path, "--version"]))
        if m and (int(m[1]), int(m[2])) >= CUDA_FOR_SM90A:
            # Without this TVM compiles the CUDA C++ during tvm.compile where its CUDA runtime is
            # loaded (a machine with a driver; NVRTC by default) and leaves it to the load
            # otherwise: the same build would differ by machine. Forced, it never compiles, and
            # export_options compiles with nvcc everywhere.
            return {"PATH": f"{Path(path).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                    "TVM_COMPILE_FORCE_FALLBACK": "1"}
    raise ToolchainError("sm90 needs nvcc from CUDA >= 12.0 (for sm_90a) on PATH or under $CUDA_HOME; "
                         "install NVIDIA's CUDA toolkit")


@contextmanager
def toolchain(info):
    """The environment a build for target ``info`` needs (nvcc, ld.lld + ROCm bitcode), checked
    and set for the duration; nothing for the CPU."""
    env = toolchain_environment(info) if info.gpu else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def toolchain_environment(info) -> dict[str, str]:
    """Environment variables a build for GPU target ``info`` needs, or a ToolchainError saying what
    to install. sm90: nvcc, which compiles the kernels to sm_90a machine code at build time.
    ROCm: TVM's LLVM backend links AMDGPU code objects with ld.lld against the ROCm device
    bitcode."""
    return nvcc_environment() if info.kind == "cuda" else rocm_environment()


# --------------------------------------------------------------------------- sm90 machine code


def export_options(info, target: tvm.target.Target) -> dict:
    """``export_library``'s options for target ``info``. sm90: TVM's CUDA codegen leaves CUDA C++
    for TVM's CUDA runtime to compile when the library loads (NVRTC or nvcc, through a Python
    callback of ``tvm.support.nvcc``; the C++ host has neither). Here the packer of the
    library's imported modules compiles that module with nvcc to a fatbin of sm_90a machine code
    instead, and the library keeps no CUDA source: TVM's loader hands a module whose format is
    not ``cuda`` to the driver (``cuModuleLoadData``) as it is."""
    return {"fpack_imports": functools.partial(_pack_compiled_cuda, target)} if info.kind == "cuda" else {}


def _pack_compiled_cuda(target: tvm.target.Target, mod, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
    """What export_library's default packer writes (``runtime.ModulePackImportsToLLVM``: the
    serialized imports as one object file), with each CUDA module's code compiled."""
    get = tvm.get_global_func
    packed = unpack_imports(get("runtime.ModulePackImportsToTensor")(mod).numpy().tobytes())
    modules = tuple(replace(m, payload=compile_cuda_module(m.payload, target)) if m.key == "cuda" else m
                    for m in packed.modules)
    host = next(m for m in mod._collect_dso_modules() if m.kind == "llvm")
    obj = get("codegen.codegen_blob")(replace(packed, modules=modules).to_bytes(), is_system_lib,
                                      host["_get_target_string"](), prefix)
    path = os.path.join(workspace_dir, f"{prefix}devc.o")
    obj.write_to_file(path)
    return path


def compile_cuda_module(payload: bytes, target: tvm.target.Target) -> bytes:
    """A serialized CUDA module of CUDA C++, as a fatbin of the target's machine code only (no
    PTX, so no driver JIT either), with the same function table. TVM's nvcc flags: -O3 and
    --use_fast_math, as its load-time compile used (``TVM_CUDA_*`` variables still apply)."""
    from tvm.support import nvcc

    module = device_module(payload)
    if module.fmt != "cuda":
        raise ToolchainError(f"TVM's CUDA codegen gave a {module.fmt} module, expected CUDA C++ "
                             "(TVM_COMPILE_FORCE_FALLBACK unset?)")
    arch = target.attrs["arch"]  # sm_90a
    with target:  # compile_cuda reads the compute version from the current target
        fatbin = nvcc.compile_cuda(module.code.decode(), target_format="fatbin", compiler="nvcc",
                                   arch=["-gencode", f"arch=compute_{arch[3:]},code={arch}"])
    return module.with_code("fatbin", bytes(fatbin)).to_bytes()

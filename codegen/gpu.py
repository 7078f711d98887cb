"""GPU targets: the same kernels as the CPU target, bound to GPU threads, built ahead of time.

Every kernel of ``llvm_kernels`` is either a compute definition (matmuls, experts: built with
TE and scheduled by dlight's GPU rules) or hand-written TIR whose outermost loop runs over
independent rows (tokens, windows, pool rows). For the latter, that loop is mapped onto
blocks x threads (one thread per row), which is exactly the parallelism the CPU schedule
uses. Artifacts carry compiled device code: a cubin for sm_90a linked by ``nvcc`` (a C++ host
has no Python callback to compile CUDA source at load), AMDGPU code objects for gfx942 /
gfx950 from TVM's LLVM backend, linked by ``ld.lld`` >= 19 against the ROCm device bitcode.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import tvm
from tvm import tirx

from dsv4c.errors import DsvError

THREADS = 64
TARGETS = {
    "sm90": {"kind": "cuda", "arch": "sm_90a"},
    "gfx942": {"kind": "rocm", "mcpu": "gfx942"},
    "gfx950": {"kind": "rocm", "mcpu": "gfx950"},
}


class ToolchainError(DsvError):
    """A compiler or library needed to build for a GPU target is missing or too old."""


# --------------------------------------------------------------------------- thread binding


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


def gpu_kernel(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """GPU version of a CPU kernel: dlight for compute definitions, thread binding for TIR."""
    from dsv4c.codegen import llvm_kernels
    from dsv4c.codegen.lowering import kernel_factory

    factory = kernel_factory(spec.factory)
    if spec.factory in llvm_kernels.COMPUTE_DEFINITIONS:
        from tvm.s_tir import dlight as dl

        func = factory(*spec.params, schedule=False)
        mod = tvm.IRModule({"main": func})
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                          dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
        return mod["main"]
    if spec.factory in llvm_kernels.VECTOR_KERNELS:
        func = factory(*spec.params, max_lanes=llvm_kernels.GPU_MAX_LANES)
    else:
        func = factory(*spec.params)
    body = func.body
    if isinstance(body, tirx.For) and body.kind == tirx.ForKind.PARALLEL:
        body = _bind_rows(body)
    else:
        body = _single_thread(body)
    return func.with_body(body)


# --------------------------------------------------------------------------- toolchains


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc") or (os.environ.get("CUDA_HOME") and str(Path(os.environ["CUDA_HOME"]) / "bin/nvcc"))
    if not nvcc or not Path(nvcc).exists():
        raise ToolchainError("sm90 needs nvcc (CUDA >= 12 for sm_90a) on PATH or in $CUDA_HOME/bin; install the "
                             "CUDA toolkit")
    m = re.search(r"release (\d+)\.(\d+)", _version([nvcc, "--version"]))
    if not m or int(m[1]) < 12:
        raise ToolchainError(f"sm90 needs nvcc from CUDA >= 12 (sm_90a); {nvcc} reports "
                             f"{m[0] if m else 'no version'}")
    return nvcc


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


# --------------------------------------------------------------------------- build


def build_gpu(specs: dict, target_name: str, out_dir: Path) -> dict:
    """Compile the kernels for a GPU target into ``kernels.so`` holding device code."""
    if target_name == "sm90":
        nvcc = find_nvcc()
        target = tvm.target.Target(TARGETS["sm90"], host={"kind": "cuda_host"})
        gpu_funcs = {k: gpu_kernel(spec, target).with_attr("global_symbol", k) for k, spec in specs.items()}
        executable = tvm.compile(tvm.IRModule(gpu_funcs), target=target)
        from tvm.backend.cuda import export_cuda_host

        source = out_dir.parent / f".{out_dir.name}-kernels.cu"
        source.write_text(export_cuda_host(executable.mod))
        import tvm_ffi

        ffi_root = Path(tvm_ffi.__file__).parent
        cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "-O3", "-gencode",
               "arch=compute_90a,code=sm_90a", f"-I{ffi_root / 'include'}", str(source), "-o",
               str(out_dir / "kernels.so"), f"-L{ffi_root / 'lib'}", "-ltvm_ffi"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        source.unlink(missing_ok=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ToolchainError(f"nvcc failed to build the sm_90a kernels: {last}")
        return {"library": "kernels.so", "device_code": "cubin sm_90a", "count": len(specs)}
    env = rocm_environment()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        target = tvm.target.Target(TARGETS[target_name])
        gpu_funcs = {k: gpu_kernel(spec, target).with_attr("global_symbol", k) for k, spec in specs.items()}
        executable = tvm.compile(tvm.IRModule(gpu_funcs), target=target)
        executable.export_library(str(out_dir / "kernels.so"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"library": "kernels.so", "device_code": f"amdgcn {TARGETS[target_name]['mcpu']}", "count": len(specs)}

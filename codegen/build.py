"""Build the kernels of a program into ``kernels.so`` for the CPU target."""

from __future__ import annotations

import os
import time
from pathlib import Path

import tvm

from dsv4c.codegen.lowering import kernel_factory, kernel_table
from dsv4c.ir.core import Program


def host_cpu() -> str:
    """LLVM's name for this machine's CPU (e.g. znver4): kernels use its vector width."""
    return tvm.target.codegen.llvm_get_system_cpu()


def llvm_target(mcpu: str | None = None) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu or host_cpu(), "num-cores": os.cpu_count() or 1})


def build_kernels(program: Program, plan, out_dir: Path, progress: bool = False) -> dict:
    specs, per_node = kernel_table(program, plan)
    if plan.target != "llvm":
        from dsv4c.codegen.gpu import build_gpu

        start = time.perf_counter()
        info = build_gpu(specs, plan.target, out_dir)
        return {**info, "build_seconds": round(time.perf_counter() - start, 2), "per_node": per_node}
    funcs = {}
    items = specs.items()
    if progress:
        from tqdm import tqdm

        items = tqdm(list(items), desc="generating kernels", unit="kernel", leave=False)
    for symbol, spec in items:
        funcs[symbol] = kernel_factory(spec.factory)(*spec.params).with_attr("global_symbol", symbol)
    start = time.perf_counter()
    mcpu = host_cpu()
    executable = tvm.compile(tvm.IRModule(funcs), target=llvm_target(mcpu))
    executable.export_library(str(out_dir / "kernels.so"))
    return {"library": "kernels.so", "mcpu": mcpu, "count": len(funcs), "build_seconds": round(time.perf_counter() - start, 2),
            "per_node": per_node}

"""The targets dsv4c compiles for: one registry of what each one is, read by the CLI, the quant
plan, the code generator and the runtime (which imports nothing of the compiler).

TVM is imported lazily: looking up a target's facts costs nothing.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

from dsv4c.errors import UsageError


@dataclass(frozen=True)
class TargetInfo:
    name: str
    kind: str  # reference (numpy interpreter), cpu, cuda, rocm
    fp8_format: str  # how FP8 bytes are read there: e4m3fn, or e4m3fnuz (gfx942)
    fp4_math: bool  # native MX FP4 matmuls (gfx950)
    tvm: dict = field(default_factory=dict)  # TVM target (llvm: mcpu filled in for this host)
    cuda_graph: bool = False  # the decode / prefill functions' static regions run as CUDA graphs

    @property
    def compiled(self) -> bool:
        return self.kind != "reference"

    @property
    def gpu(self) -> bool:
        return self.kind in ("cuda", "rocm")

    def tvm_target(self):
        import tvm

        if self.kind == "cpu":
            return tvm.target.Target({**self.tvm, "mcpu": host_cpu(), "num-cores": os.cpu_count() or 1})
        return tvm.target.Target(self.tvm, host={"kind": "llvm"})

    def device(self):
        """This host's device for the target, or None when it has none (another GPU model included)."""
        import tvm

        if self.kind == "cpu":
            return tvm.cpu(0)
        if self.kind == "cuda":
            device = tvm.cuda(0)
            return device if device.exist and device.compute_version == self.tvm["arch"][3:4] + ".0" else None
        if self.kind == "rocm":
            import re

            device = tvm.rocm(0)
            if not device.exist:
                return None
            # ROCm reports the ISA (gfx942) in the name or the compute version depending on the
            # driver; refuse a named other ISA, accept when none is named.
            arch = re.search(r"gfx\d+", f"{device.device_name} {device.compute_version}")
            return device if arch is None or arch[0] == self.tvm["mcpu"] else None
        return None

    @contextmanager
    def toolchain(self):
        """The environment a build for this target needs (nvcc, ld.lld + ROCm bitcode), checked."""
        if not self.gpu:
            yield
            return
        from dsv4c.codegen import gpu

        env = gpu.toolchain_environment(self)
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

    def library_facts(self, target) -> dict:
        """What the manifest records of a built library: the CPU it needs, or its device code."""
        if self.kind == "cpu":
            return {"mcpu": str(target.attrs["mcpu"])}
        if self.kind == "cuda":
            return {"device_code": f"cuda {self.tvm['arch']}"}
        return {"device_code": f"amdgcn {self.tvm['mcpu']}"}


TARGETS: dict[str, TargetInfo] = {t.name: t for t in (
    TargetInfo("llvm", "cpu", "e4m3fn", False, {"kind": "llvm"}),
    TargetInfo("sm90", "cuda", "e4m3fn", False, {"kind": "cuda", "arch": "sm_90a"}, cuda_graph=True),
    TargetInfo("gfx942", "rocm", "e4m3fnuz", False, {"kind": "rocm", "mcpu": "gfx942"}),
    TargetInfo("gfx950", "rocm", "e4m3fn", True, {"kind": "rocm", "mcpu": "gfx950"}),
    TargetInfo("reference", "reference", "e4m3fn", False),
)}
COMPILED_TARGETS = tuple(name for name, t in TARGETS.items() if t.compiled)


def target_info(name: str) -> TargetInfo:
    try:
        return TARGETS[name]
    except KeyError:
        raise UsageError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}") from None


def host_cpu() -> str:
    """LLVM's name for this machine's CPU (e.g. znver4): CPU kernels use its vector width."""
    import tvm

    return tvm.target.codegen.llvm_get_system_cpu()

"""The targets dsv4c compiles for: one registry of what each one is, read by the CLI, the quant
plan, the code generator and the runtime (which imports nothing of the compiler).

TVM is imported lazily: looking up a target's facts costs nothing.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, replace

from dsv4c.errors import UsageError


@dataclass(frozen=True)
class TargetInfo:
    name: str
    kind: str  # reference (numpy interpreter), cpu, cuda, rocm
    fp8_format: str  # how FP8 bytes are read there: e4m3fn, or e4m3fnuz (gfx942)
    fp4_math: bool  # native MX FP4 matmuls (gfx950)
    tvm: dict = field(default_factory=dict)  # TVM target (llvm: mcpu filled in, see cpu)
    cuda_graph: bool = False  # the decode / prefill functions' static regions run as CUDA graphs
    cpu: str | None = None  # llvm: the LLVM CPU name the kernels are built for; None: this host's

    def for_cpu(self, cpu: str | None) -> TargetInfo:
        """This target with its kernels built for ``cpu``: an LLVM CPU name (x86-64-v3, znver4,
        ...) or ``native`` (this host's); None keeps the default, this host's. llvm only."""
        if cpu is None:
            return self
        if self.kind != "cpu":
            raise UsageError(f"--cpu applies to --target llvm only, not {self.name}")
        return replace(self, cpu=host_cpu() if cpu == "native" else checked_cpu_name(cpu))

    @property
    def compiled(self) -> bool:
        return self.kind != "reference"

    @property
    def gpu(self) -> bool:
        return self.kind in ("cuda", "rocm")

    def tvm_target(self):
        import tvm

        if self.kind == "cpu":
            return tvm.target.Target({**self.tvm, "mcpu": self.cpu or host_cpu(), "num-cores": os.cpu_count() or 1})
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

    def library_facts(self, target) -> dict:
        """What the manifest records of a built library: the CPU it was built for and the
        instruction-set extensions that lets it use, or its device code: the format TVM's device
        module records (a fatbin of sm_90a machine code, an AMDGPU code object) and its ISA."""
        if self.kind == "cpu":
            return {"mcpu": str(target.attrs["mcpu"]), "cpu_features": cpu_features(target)}
        if self.kind == "cuda":  # compiled by nvcc at build time (codegen/gpu.py: export_options)
            return {"device_code": f"fatbin {self.tvm['arch']}"}
        return {"device_code": f"hsaco {self.tvm['mcpu']}"}


TARGETS: dict[str, TargetInfo] = {t.name: t for t in (
    TargetInfo("llvm", "cpu", "e4m3fn", False, {"kind": "llvm"}),
    TargetInfo("sm90", "cuda", "e4m3fn", False, {"kind": "cuda", "arch": "sm_90a"}, cuda_graph=True),
    TargetInfo("gfx942", "rocm", "e4m3fnuz", False, {"kind": "rocm", "mcpu": "gfx942"}),
    TargetInfo("gfx950", "rocm", "e4m3fn", True, {"kind": "rocm", "mcpu": "gfx950"}),
    TargetInfo("reference", "reference", "e4m3fn", False),
)}
COMPILED_TARGETS = tuple(name for name, t in TARGETS.items() if t.compiled)


def target_info(name: str, cpu: str | None = None) -> TargetInfo:
    """The target ``name``; with ``cpu`` (llvm only) its kernels built for that CPU."""
    try:
        info = TARGETS[name]
    except KeyError:
        raise UsageError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}") from None
    return info.for_cpu(cpu)


def host_cpu() -> str:
    """LLVM's name for this machine's CPU (e.g. znver4): CPU kernels use its vector width."""
    import tvm

    return tvm.target.codegen.llvm_get_system_cpu()


CPU_EXAMPLES = ("x86-64-v3", "x86-64-v4", "znver3", "znver4", "skylake-avx512", "sapphirerapids")


def checked_cpu_name(cpu: str) -> str:
    """``cpu`` if LLVM knows it for this host's target triple, else a UsageError naming some it knows."""
    import tvm

    codegen = tvm.target.codegen
    triple = codegen.llvm_get_system_triple()
    if codegen.llvm_is_valid_cpu(cpu, triple):
        return cpu
    known = list(codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm", "mtriple": triple})))
    examples = dict.fromkeys([*difflib.get_close_matches(cpu, known, 3), *(c for c in CPU_EXAMPLES if c in known)])
    raise UsageError(f"unknown CPU {cpu!r} for --cpu; LLVM knows {len(known)} for {triple}, e.g. "
                     f"{', '.join(list(examples)[:6])}, or native (this machine's)")


# The x86 instruction-set extensions LLVM's code generator may use, in LLVM's spelling, and the
# flag Linux lists in /proc/cpuinfo for each. An llvm artifact records those its CPU has (in
# Linux's spelling, what the runtimes check); LLVM's other features are tuning hints or
# system instructions that generated code does not use.
X86_ISA_FLAGS = {
    "cmov": "cmov", "cx8": "cx8", "mmx": "mmx", "fxsr": "fxsr", "sse": "sse", "sse2": "sse2", "sse3": "pni",
    "ssse3": "ssse3", "cx16": "cx16", "sahf": "lahf_lm", "sse4.1": "sse4_1", "sse4.2": "sse4_2",
    "sse4a": "sse4a", "popcnt": "popcnt", "lzcnt": "abm", "movbe": "movbe", "aes": "aes", "pclmul": "pclmulqdq",
    "avx": "avx", "f16c": "f16c", "fma": "fma", "fma4": "fma4", "xop": "xop", "bmi": "bmi1", "bmi2": "bmi2",
    "avx2": "avx2", "adx": "adx", "sha": "sha_ni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq", "gfni": "gfni",
    "avxvnni": "avx_vnni", "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd",
    "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2", "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
}


def cpu_features(target) -> list[str]:
    """The instruction-set extensions (Linux's flag names) code built for an llvm ``target`` may use."""
    import tvm

    implied = tvm.target.codegen.llvm_get_cpu_features(target)
    return [flag for feature, flag in X86_ISA_FLAGS.items() if feature in implied]


@dataclass(frozen=True)
class HostCpu:
    model: str  # /proc/cpuinfo "model name", e.g. AMD EPYC 7B13
    flags: frozenset[str]  # /proc/cpuinfo "flags": the instruction-set extensions Linux reports


def host_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> HostCpu | None:
    """This machine's CPU as Linux describes it (the first processor's entry); None where there
    is no /proc/cpuinfo, or it lists no x86 flags (not Linux, not x86)."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    if "flags" not in fields:
        return None
    return HostCpu(fields.get("model name", "unknown model"), frozenset(fields["flags"].split()))

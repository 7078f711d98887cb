"""What the kernels know of the CPU they are built for: its vector width, and where their
scratch buffers live."""

from __future__ import annotations

# Scratch buffers of the kernels live on the thread's stack, where LLVM keeps accumulators
# in registers: TVM would otherwise allocate any of 1 KiB or more from its workspace pool, per
# parallel job, and its StorageRewrite pass merges the buffers of different branches into one
# (dropping this annotation), so CPU builds run without it (CPU_PASS_CONFIG). Python assignments
# inside TVMScript kernels would become such buffers too.
ON_STACK = {"disable_lower_builtin": True}
CPU_PASS_CONFIG = {"tirx.disable_storage_rewrite": True}


def cpu_target():
    """The TVM target of the CPU the kernels are built for: the current one (the builder enters
    it), else this host's."""
    import tvm

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        from dsv4c.targets import target_info

        target = target_info("llvm").tvm_target()
    return target


def cpu_vector() -> tuple[int, int]:
    """(float32 lanes, vector registers) of the CPU the kernels are built for. AVX-512: 16 lanes
    and 32 registers; AVX / AVX2: 8 and 16; any other CPU is taken as 4 lanes and 16 registers."""
    from tvm.target import codegen

    target = cpu_target()
    if codegen.target_has_features("avx512f", target):
        return 16, 32
    return (8 if codegen.target_has_features("avx", target) else 4), 16

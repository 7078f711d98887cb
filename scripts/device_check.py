"""Device check for the sm90 target (run by `scripts/device_check` on a machine with an H200).

1. Builds the sm90 artifact of the tiny model (with weights) and of the flash-slice structure,
   and checks that each holds sm_90a device code.
2. When a CUDA GPU is present: runs representative kernels of those artifacts on the GPU
   (FP8 GEMV, FP4 expert GEMV, sparse attention, the fused mHC seam) against the same kernels
   built for the CPU on identical inputs, and prints GPU timings.

The runtime does not execute whole GPU artifacts yet (no device-resident KV pool), so the
parity check is per kernel, not per model; this script says so when it runs.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tvm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from dsv4c.codegen import llvm_kernels  # noqa: E402
from dsv4c.codegen.build import llvm_target  # noqa: E402
from dsv4c.codegen.lowering import KernelSpec  # noqa: E402

# (spec, argument builder): inputs first, outputs last (the outputs are compared).
CASES = {
    "fp8 GEMV 4096x4096": KernelSpec("linear", (4096, 4096, "fp8_b128", True)),
    "fp4 expert GEMV 2048x4096": KernelSpec("linear", (2048, 4096, "fp4_g32", True)),
    "sparse attention 64x512, 640 rows": KernelSpec("sparse_attn", (64, 512, 512 ** -0.5)),
    "mHC seam 4x4096": KernelSpec("mhc", (4, 4096, 20, 1e-6, 1e-6, True, False)),
}


def _inputs(name: str, rng) -> tuple[list[np.ndarray], list[tuple]]:
    """Random inputs and output shapes for one case."""
    if name.startswith("fp8"):
        return [rng.standard_normal((2, 4096), np.float32), rng.integers(0, 120, (64, 4096, 64), np.uint8),
                np.full((64, 32, 64), 2.0 ** -8, np.float32)], [(2, 4096)]
    if name.startswith("fp4"):
        return [rng.standard_normal((2, 4096), np.float32), rng.integers(0, 255, (32, 2048, 64), np.uint8),
                np.full((32, 128, 64), 120, np.uint8)], [(2, 2048)]
    if name.startswith("sparse"):
        n, rows, pool = 4, 640, 20000
        return [rng.standard_normal((n, 64, 512), np.float32), rng.standard_normal((pool, 512), np.float32),
                rng.standard_normal((n, 512), np.float32), rng.standard_normal(64, np.float32),
                (np.arange(n + 1) * rows).astype(np.int32), rng.integers(0, pool + n, n * rows).astype(np.int32)], \
            [(n, 64, 512)]
    hc, d, n = 4, 4096, 4
    mix = (2 + hc) * hc
    return [rng.standard_normal((n, d), np.float32), rng.standard_normal((n, hc, d), np.float32),
            rng.random((n, hc), np.float32), rng.random((n, hc, hc), np.float32),
            (rng.standard_normal((mix, hc * d)) * 0.01).astype(np.float32), rng.standard_normal(mix, np.float32),
            rng.random(3, np.float32)], [(n, hc, d), (n, d), (n, hc), (n, hc, hc)]


def kernel_parity(device) -> None:
    from dsv4c.codegen.gpu import TARGETS, gpu_kernel

    target = tvm.target.Target(TARGETS["sm90"])
    rng = np.random.default_rng(0)
    for name, spec in CASES.items():
        factory = getattr(llvm_kernels, spec.factory)
        cpu = tvm.compile(tvm.IRModule({"k": factory(*spec.params).with_attr("global_symbol", "k")}),
                          target=llvm_target())["k"]
        gpu = tvm.compile(tvm.IRModule({"k": gpu_kernel(spec, target).with_attr("global_symbol", "k")}),
                          target=target)["k"]
        inputs, shapes = _inputs(name, rng)
        cpu_out = [tvm.runtime.empty(s, "float32") for s in shapes]
        cpu(*[tvm.runtime.tensor(a) for a in inputs], *cpu_out)
        dev_in = [tvm.runtime.tensor(a, device) for a in inputs]
        dev_out = [tvm.runtime.empty(s, "float32", device) for s in shapes]
        gpu(*dev_in, *dev_out)
        device.sync()
        err = max(float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(cpu_out, dev_out))
        start = time.perf_counter()
        for _ in range(20):
            gpu(*dev_in, *dev_out)
        device.sync()
        print(f"  {name:<38} max |gpu - cpu| = {err:.2e}   {(time.perf_counter() - start) / 20 * 1e6:9.1f} us")


def main() -> int:
    from flash_slice import FLASH_SLICE

    from dsv4c.cli import main as cli
    from dsv4c.frontend.config import config_from_dict

    work = Path(tempfile.mkdtemp(prefix="dsv4c-device-"))
    cli(["make-tiny", "--out", str(work / "tiny")])
    (work / "flash-slice.json").write_text(json.dumps(config_from_dict(FLASH_SLICE, "flash-slice").to_json_dict()))
    for label, model, extra in (("tiny", str(work / "tiny"), []),
                                ("flash-slice", str(work / "flash-slice.json"), ["--no-weights"])):
        start = time.perf_counter()
        if cli(["compile", "--model", model, "--target", "sm90", "-o", str(work / f"{label}-sm90")] + extra):
            return 1
        blob = (work / f"{label}-sm90" / "kernels.so").read_bytes()
        print(f"{label}: sm90 artifact in {time.perf_counter() - start:.1f} s, sm_90a code: {b'sm_90a' in blob}")
    device = tvm.cuda(0)
    if not device.exist:
        print("no CUDA GPU on this machine: built and checked the artifacts only")
        return 0
    print(f"GPU: {device.device_name}; kernel parity against the CPU build of the same kernels "
          "(whole-model GPU execution is not implemented yet):")
    kernel_parity(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

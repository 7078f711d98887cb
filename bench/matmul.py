"""Benchmark: the CPU matmul kernels alone against the machine's read bandwidth and torch.

GEMV (decode, one row): GB/s of weight bytes streamed (several copies of each weight, ~0.5 GB,
back to back, as a decode step's matmuls follow each other), against a parallel read of as many
bytes (torch ``sum``, the machine's read bandwidth as this process sees it) in the same run; and
the same kernel's GB/s on ~4 MB of weights read over and over from the cache, the ceiling its
decode arithmetic sets whatever the memory (below the read bandwidth: that format cannot stream
at it).
GEMM (prefill rows): GFLOP/s against torch's fp32 matmul on the same shapes (its BLAS) in the
same run. Flash widths: hidden 4096, FP8 128x128 blocks, FP4 experts (inter 2048, 16 experts,
6 routed rows per token), the BF16 head.

    python bench/matmul.py [--rows 512] [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import numpy as np


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    import tvm

    return f"{model} (LLVM {tvm.target.codegen.llvm_get_system_cpu()}, {os.cpu_count()} cores)"


def _best(fn, repeat: int) -> float:
    """Fastest of ``repeat`` timed calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _weights(rng, out_dim: int, in_dim: int, quant: str, lead: tuple = ()) -> list[np.ndarray]:
    from dsv4c.codegen.kernels.formats import tir_format

    parts = []
    for shape, dtype in tir_format(quant).parts(out_dim, in_dim):
        shape = lead + shape
        if dtype == "float32" and quant in ("fp8_b128", "fp8fnuz_b128"):  # block scales
            parts.append(rng.uniform(1e-3, 2e-3, shape).astype(np.float32))
        elif dtype == "float32":
            parts.append(rng.standard_normal(shape, np.float32))
        elif quant == "fp4_g32" and len(parts) == 1:  # E8M0 scales near 2**-6
            parts.append(rng.integers(118, 124, shape, dtype=np.uint8))
        elif dtype == "int32":  # FP4 codes, eight per word (every code is a number)
            parts.append(rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32))
        elif dtype == "uint16":  # BF16 bits of normal values
            parts.append((rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16))
        else:
            codes = rng.integers(0, 256, shape, dtype=np.uint8)
            parts.append(np.where((codes & 0x7F) == 0x7F, 0, codes).astype(np.uint8))  # no NaN codes
    return parts


def _compile(func):
    import tvm

    from dsv4c.codegen.build import serial_when_single
    from dsv4c.codegen.kernels.cpu import CPU_PASS_CONFIG
    from dsv4c.targets import target_info

    with tvm.transform.PassContext(config=CPU_PASS_CONFIG):
        return tvm.compile(tvm.IRModule({"k": serial_when_single(func).with_attr("global_symbol", "k")}),
                           target=target_info("llvm").tvm_target())["k"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512, help="GEMM rows (prefill tokens)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    args = p.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    import torch
    import tvm

    from dsv4c.codegen.kernels.matmul import GEMM_ROWS, expert_linear, linear

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_model()}; {args.threads} threads")

    # GEMV weights come from memory as in a decode step, where each matmul's weights follow the
    # last one's: each timed pass runs the kernel over several copies of its weights, together
    # ~0.5 GB (far past the last-level cache), back to back. Every shape's copies are allocated
    # before any is timed (weights allocated into memory another shape freed ran ~2x slower:
    # the pages, not the kernel). The machine's read bandwidth is a parallel sum over a buffer of
    # that size (torch), timed the same way.
    gemv = [("fp8_b128", 32768, 4096), ("fp4_g32 experts 6/16", 2048, 4096), ("bf16", 32000, 4096),
            ("fp32", 8192, 4096)]
    def gemv_case(name, out_dim, in_dim, copies=None):
        """(kernel, a list of argument sets: one per copy of the weights, bytes a call reads);
        ``copies`` None: as many as make ~0.5 GB."""
        quant = name.split()[0]
        experts = 16 if "experts" in name else 0
        x = rng.standard_normal((6 if experts else 1, in_dim), np.float32)
        if experts:
            kernel = _compile(expert_linear(out_dim, in_dim, quant, experts))
            offsets = np.array([0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 6, 6, 6, 6], np.int32)  # 6 experts, a row each
            call_args = lambda parts: [x, offsets, *parts, np.zeros((6, out_dim), np.float32)]  # noqa: E731
            share = 6 / experts  # the bytes a token reads: its experts' share
        else:
            kernel = _compile(linear(out_dim, in_dim, quant, True))
            call_args = lambda parts: [x, *parts, np.zeros((1, out_dim), np.float32)]  # noqa: E731
            share = 1
        parts = [_weights(rng, out_dim, in_dim, quant, (experts,) if experts else ())]
        size = sum(part.nbytes for part in parts[0])
        copies = copies or max(2, -(-2**29 // size))
        parts += [_weights(rng, out_dim, in_dim, quant, (experts,) if experts else ()) for _ in range(copies - 1)]
        return kernel, [[tvm.runtime.tensor(a) for a in call_args(p)] for p in parts], size * share

    def gb_per_s(kernel, sets, nbytes):
        def run_all():
            for tensors in sets:
                kernel(*tensors)

        seconds = _best(run_all, args.repeat) / len(sets)
        return seconds, nbytes / seconds / 1e9

    cases = []
    for name, out_dim, in_dim in gemv[:2] if args.quick else gemv:
        streamed = gemv_case(name, out_dim, in_dim)
        # The cached case: as many columns (whole 64-column tiles) as read ~4 MB a call.
        columns = max(64, int(4e6 * out_dim / streamed[2]) // 64 * 64)
        cases.append((name, streamed, gemv_case(name, min(columns, out_dim), in_dim, copies=1)))
    evict = torch.ones(2**29 // 8, dtype=torch.int64)
    read = evict.numel() * 8 / _best(lambda: evict.sum(), args.repeat) / 1e9
    evict = None  # freed before the GEMVs run
    print(f"\nGEMV, one row (decode): weight GB/s, ~0.5 GB of weight copies per pass, vs a parallel read of "
          f"512 MiB: {read:.1f} GB/s")
    print(f"{'kernel':<34}{'MB':>8}{'ms':>9}{'GB/s':>8}{'ratio':>8}{'in cache':>10}{'ratio':>8}")
    for name, streamed, cached in cases:
        t_ours, ours = gb_per_s(*streamed)
        _, ceiling = gb_per_s(cached[0], cached[1] * 64, cached[2])  # one copy, 64 calls a pass
        print(f"{name:<34}{streamed[2] / 1e6:>8.1f}{t_ours * 1e3:>9.2f}{ours:>8.1f}{ours / read:>7.2f}x"
              f"{ceiling:>10.1f}{ceiling / read:>7.2f}x")
    del cases

    print(f"\nGEMM, {args.rows} rows (prefill): GFLOP/s vs torch fp32 matmul (weights dequantized); the bf16 "
          "compute mode (x rounded to BF16) beside, vs the exact kernel")
    print(f"{'kernel':<34}{'ms':>9}{'GFLOP/s':>9}{'torch':>9}{'ratio':>8}{'bf16 ms':>9}{'GFLOP/s':>9}{'vs exact':>9}")
    gemm = [("fp8_b128", 4096, 4096), ("fp4_g32 experts", 2048, 4096), ("fp32", 4096, 1024), ("bf16", 8192, 4096)]
    rows = -(-args.rows // GEMM_ROWS) * GEMM_ROWS
    for name, out_dim, in_dim in gemm[:2] if args.quick else gemm:
        quant = name.split()[0]
        experts = 16 if "experts" in name else 0
        m = rows * 6 // experts if experts else rows  # an expert's share of the routed rows
        x = rng.standard_normal((m, in_dim), np.float32)
        if experts:
            parts = _weights(rng, out_dim, in_dim, quant, (experts,))
            offsets = np.minimum(np.arange(experts + 1) * m, m * experts).astype(np.int32)
            xs = np.tile(x, (experts, 1))
            kernels = [_compile(expert_linear(out_dim, in_dim, quant, experts, False, compute))
                       for compute in ("fp32", "bf16")]
            tensors = [tvm.runtime.tensor(a) for a in (xs, offsets, *parts, np.zeros((m * experts, out_dim), np.float32))]
            flops = 2 * m * experts * out_dim * in_dim
        else:
            parts = _weights(rng, out_dim, in_dim, quant)
            # fp32 weights have no bf16 kernel: they would not widen exactly
            kernels = [_compile(linear(out_dim, in_dim, quant, False, 0, compute))
                       for compute in (("fp32", "bf16") if quant != "fp32" else ("fp32",))]
            tensors = [tvm.runtime.tensor(a) for a in (x.reshape(-1, GEMM_ROWS, in_dim), *parts,
                                                       np.zeros((m // GEMM_ROWS, GEMM_ROWS, out_dim), np.float32))]
            flops = 2 * m * out_dim * in_dim
        t_ours, *t_bf16 = (_best(lambda: kernel(*tensors), args.repeat) for kernel in kernels)
        xt = torch.from_numpy(x)
        wt = torch.from_numpy(rng.standard_normal((in_dim, out_dim), np.float32))
        t_torch = _best(lambda: xt @ wt, args.repeat) * (experts or 1)
        ours, ref = flops / t_ours / 1e9, flops / t_torch / 1e9
        bf16 = f"{t_bf16[0] * 1e3:>9.1f}{flops / t_bf16[0] / 1e9:>9.1f}{t_ours / t_bf16[0]:>8.2f}x" if t_bf16 else ""
        print(f"{name:<34}{t_ours * 1e3:>9.1f}{ours:>9.1f}{ref:>9.1f}{ours / ref:>7.2f}x{bf16}")


if __name__ == "__main__":
    main()

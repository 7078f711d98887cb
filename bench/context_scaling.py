"""Benchmark: decode ms/token of a compiled artifact at growing contexts, against the cost model.

Does the cost of a token grow with its context as the cost model says? For each context N the
script decodes ``--decode-steps`` tokens of a request at positions N - 1, N, ... (the requests
of all contexts taking turns step by step) and takes the median step, and prices the same steps with the cost model (``token_cost.artifact_step_costs``:
the artifact's own program, each node the longer of its bytes at this machine's streaming-read
bandwidth and its FLOPs at its fp32 matmul rate, both measured in the same run).

The context is not prefilled token by token: at the flash slice's widths prefill runs tens of
tokens a second on 2 cores, so 64K tokens would take most of an hour. The request's pool rows
(compressed entries, index rows, window rows, compressor rings) are filled with random values
instead: a decode step reads and computes over the same rows whatever they hold (every kernel's
work depends on the positions, not on the values), so its time is that of a decode after a real
prompt of N tokens. ``--prefill`` also times a real chunked prefill of that many tokens, for
scale.

With ``--families`` a second engine, profiled (``runtime.profile``), decodes the same steps and
the measured kernel time by op family is printed beside the predicted one per context (the
profiler's instrument adds VM overhead, so those steps are not the timed ones).

With ``--llama-cpp CACHE`` llama.cpp decodes the same slice too (``llama_cpp_bench.py``: its
``llama-bench``, built from the source bundled in ``llama-cpp-python``, and its own conversion of
the checkpoint, FP8 as Q8_0 and FP4 as MXFP4, both made in CACHE when missing). Per context,
``llama-bench -p 0 -n TOKENS -d CONTEXT`` (decode after an untimed prefill of CONTEXT tokens:
llama.cpp's pool cannot be filled with random rows, so this prefill takes minutes at long
contexts) runs between two halves of our ``--decode-steps`` at the same context, so the
machine's drift between the two systems is that of one bracket, and the ratio of their ms per
token is printed per context (medians, and bests: with another process on one of 2 cores a
thread pool of 2 waits a time slice at many barriers, llama.cpp's ggml pool far more often than
ours, so ``--llama-threads 1`` may be its faster setting there). The question: llama.cpp's
lightning indexer scores every compressed key and masks all but the top-k where ours gathers
the top-k rows, so does its cost grow faster with context than ours?

The default artifact is the flash slice of ``flash_slice.py`` (hidden 4096, 64 heads x 512, 2
layers: HCA + CSA), made and compiled in ``--workdir`` when missing.

    python bench/context_scaling.py [--artifact DIR --checkpoint DIR | --workdir DIR]
                                    [--contexts 1024 ... 65536] [--decode-steps 16] [--prefill 512]
                                    [--families] [--llama-cpp CACHE [--llama-tokens 32] [--llama-reps 3]
                                                               [--llama-threads N]]
                                    [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]


def fill_pool(pool, rng) -> None:
    """Random finite values in every float tensor of the pool (integer ones keep zeros): what a
    prompt would have left there, as far as a decode step's work is concerned."""
    for a in pool.tensors.values():
        if a.dtype.kind == "f":
            a[...] = rng.standard_normal(a.shape, np.float32) * 0.5


def decode_at(engine, contexts: list[int], steps: int) -> dict[int, list[float]]:
    """Seconds of each of ``steps`` decode steps per context, one request per context (its first
    token at position context - 1 sees ``context`` tokens, itself included). The requests take
    turns step by step, so the machine's drift over seconds falls on every context alike."""
    for seq, context in enumerate(contexts):
        engine.pool.admit(seq)
        engine.pool.ensure(seq, context + steps)
    times: dict[int, list[float]] = {c: [] for c in contexts}
    try:
        for i in range(steps):
            order = list(enumerate(contexts))
            for seq, context in order[::1 if i % 2 == 0 else -1]:
                start = time.perf_counter()
                engine.backend.step(np.array([7 + i], np.int32), np.array([context - 1 + i], np.int32),
                                    np.array([seq], np.int32), np.array([0], np.int32))
                times[context].append(time.perf_counter() - start)
    finally:
        for seq in range(len(contexts)):
            engine.pool.free(seq)
    return times


def prefill_tok_s(engine, tokens: int, chunk: int) -> float:
    """Tokens per second of a real prefill of ``tokens`` random tokens in chunks of ``chunk``."""
    from dsv4c.runtime.sampling import SamplingParams

    prompt = np.random.default_rng(1).integers(0, engine.config.vocab_size, tokens).tolist()
    engine.prefill_chunk = chunk
    start = time.perf_counter()
    engine.generate(prompt, SamplingParams(max_new_tokens=1))
    return tokens / (time.perf_counter() - start)


def predicted_ms(artifact: Path, engine, context: int, steps: int, read_gb_s: float, gflop_s: float) -> dict:
    """The cost model's ms by family of the same steps (mean over them)."""
    from dsv4c.token_cost import artifact_step_costs, roofline_seconds

    out: dict[str, float] = {}
    for i in range(steps):
        parts = artifact_step_costs(artifact, engine.config, engine.pool.geometry, 1, context + i)
        for family, seconds in roofline_seconds(parts, read_gb_s * 1e9, gflop_s * 1e9).items():
            out[family] = out.get(family, 0.0) + 1e3 * seconds / steps
    return out


def ensure_flash_slice(workdir: Path) -> Path:
    """The flash slice's artifact in ``workdir``, made and compiled (``flash_slice.py``'s stages,
    each in its own process) when missing."""
    script = Path(__file__).with_name("flash_slice.py")
    for stage, done in (("make", "fp8"), ("compile", "artifact")):
        if not (workdir / done).exists():
            subprocess.run([sys.executable, str(script), "--stage", stage, "--workdir", str(workdir)], check=True)
    return workdir / "artifact"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, help="a compiled llvm artifact (default: the flash slice in --workdir)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/dsv4c-flash-slice"),
                   help="where the flash slice is made and compiled when --artifact is not given")
    p.add_argument("--contexts", type=int, nargs="+", default=DEFAULT_CONTEXTS)
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps per context, the contexts taking turns")
    p.add_argument("--prefill", type=int, default=0, help="also time a real prefill of this many tokens")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--families", action="store_true", help="also profile the steps by op family")
    p.add_argument("--llama-cpp", type=Path, metavar="CACHE",
                   help="also decode with llama.cpp, its build and GGUF made in this folder when missing")
    p.add_argument("--checkpoint", type=Path,
                   help="the checkpoint the artifact was compiled from, for llama.cpp (default: the flash slice's)")
    p.add_argument("--llama-tokens", type=int, default=32, help="llama-bench's decode tokens per repetition")
    p.add_argument("--llama-reps", type=int, default=3, help="llama-bench's repetitions per context")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count(),
                   help="llama-bench's threads (default: this machine's cores, as ours use)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = p.parse_args()
    if min(args.contexts) < 1 or args.decode_steps < 1:
        p.error("contexts and --decode-steps must be positive")
    if args.llama_cpp and args.artifact and not args.checkpoint:
        p.error("--llama-cpp with --artifact needs --checkpoint")
    if args.llama_cpp and args.decode_steps < 2:
        p.error("--llama-cpp needs --decode-steps of 2 or more (half before, half after llama-bench)")

    from dsv4c.ir.cost import FAMILIES
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.profile import matmul_gflop_s, read_bandwidth
    from dsv4c.targets import host_cpu, host_cpu_flags

    artifact = args.artifact or ensure_flash_slice(args.workdir)
    if args.llama_cpp:  # built and converted before our engine holds memory and timings start
        from llama_cpp_bench import gguf_of, llama_bench

        bench_bin = llama_bench(args.llama_cpp)
        gguf = gguf_of(args.llama_cpp, args.checkpoint or args.workdir / "fp8")
    contexts = sorted(args.contexts)
    longest = contexts[-1] + args.decode_steps + 1

    def engine_for(profile: bool):
        engine = Engine(artifact, max_context=max(longest, args.prefill + 2), max_requests=len(contexts),
                        max_step_tokens=max(args.prefill_chunk, 4), profile=profile)
        fill_pool(engine.pool, np.random.default_rng(0))
        return engine

    engine = engine_for(False)
    host = host_cpu_flags()
    report = {"cpu": {"model": host.model if host else None, "llvm_cpu": host_cpu()}, "artifact": str(artifact),
              "decode_steps": args.decode_steps}
    decode_at(engine, contexts, 2)  # warm-up: the thread pool, first touches of weights and pool
    # The machine's rates before and after the decode steps (a shared machine drifts); their mean prices them.
    rates = [(read_bandwidth(), matmul_gflop_s())]
    times = decode_at(engine, contexts, args.decode_steps)
    rates.append((read_bandwidth(), matmul_gflop_s()))
    read_gb_s, gflop_s = (statistics.mean(r) for r in zip(*rates))
    report.update(read_gb_s=read_gb_s, matmul_gflop_s=gflop_s, rates=rates)
    if args.prefill:
        report["prefill_tok_s"] = prefill_tok_s(engine, args.prefill, args.prefill_chunk)
    rows = report["contexts"] = {}
    for context in contexts:
        predicted = predicted_ms(artifact, engine, context, args.decode_steps, read_gb_s, gflop_s)
        rows[str(context)] = {"measured_ms": 1e3 * statistics.median(times[context]),
                              "steps_ms": [1e3 * t for t in times[context]],
                              "predicted_ms": sum(predicted.values()), "predicted_families_ms": predicted}
    if args.llama_cpp:
        from llama_cpp_bench import decode_ms

        report["llama_cpp"] = {"gguf": str(gguf), "tokens": args.llama_tokens, "reps": args.llama_reps,
                               "threads": args.llama_threads}
        half = args.decode_steps // 2
        for context in contexts:
            print(f"llama-bench at depth {context} (its prefill of the depth is untimed and slow)", file=sys.stderr)
            # Each half after one untimed step, as llama-bench warms up with one: the first step
            # after the other process ran wakes our thread pool and refills caches.
            ours = decode_at(engine, [context], half + 1)[context][1:]
            llama = decode_ms(bench_bin, gguf, context, args.llama_tokens, args.llama_threads, args.llama_reps)
            ours += decode_at(engine, [context], args.decode_steps - half + 1)[context][1:]
            llama_ms = llama.pop("ms_per_rep")
            report["llama_cpp"]["build"] = llama
            # Medians, and bests: on a loaded machine a thread pool of 2 on 2 cores waits a time
            # slice at many of its barriers, so steps fall into a fast and a slow mode.
            rows[str(context)].update(
                beside_llama_ms=1e3 * statistics.median(ours), beside_llama_best_ms=1e3 * min(ours),
                beside_llama_steps_ms=[1e3 * t for t in ours], llama_cpp_ms=statistics.median(llama_ms),
                llama_cpp_best_ms=min(llama_ms), llama_cpp_reps_ms=llama_ms)
    del engine
    if args.families:
        profiled = engine_for(True)
        decode_at(profiled, contexts, 2)
        profiled.profiler.steps.clear()
        decode_at(profiled, contexts, args.decode_steps)
        for context in contexts:  # the steps of one context: those whose mean context is in its range
            steps = [s for s in profiled.profiler.steps if context <= s.context < context + args.decode_steps]
            rows[str(context)]["measured_families_ms"] = {
                f: 1e3 * statistics.mean(s.families.get(f, 0.0) for s in steps) for f in FAMILIES}

    first, last = rows[str(contexts[0])], rows[str(contexts[-1])]
    growth = {kind: {"ratio": last[f"{kind}_ms"] / first[f"{kind}_ms"], "added_ms": last[f"{kind}_ms"] - first[f"{kind}_ms"]}
              for kind in ("measured", "predicted")}
    report["growth"] = growth
    print(f"decode of one request on {report['cpu']['model']} (LLVM {report['cpu']['llvm_cpu']}), {artifact}: median "
          f"of {args.decode_steps} steps per context, the contexts taking turns; predicted at {read_gb_s:.1f} GB/s "
          f"(streaming read) and {gflop_s:.1f} GFLOP/s (numpy fp32 matmul), the means of "
          + " and ".join(f"{b:.1f} / {g:.1f}" for b, g in rates) + " measured before and after")
    print(f"{'context':>8} {'measured ms':>12} {'predicted ms':>13} {'measured / predicted':>21}")
    for context in contexts:
        row = rows[str(context)]
        print(f"{context:>8} {row['measured_ms']:>12.1f} {row['predicted_ms']:>13.1f} "
              f"{row['measured_ms'] / row['predicted_ms']:>21.2f}")
    for kind, g in growth.items():
        print(f"{kind} growth {contexts[0]} -> {contexts[-1]}: x{g['ratio']:.3f} (+{g['added_ms']:.1f} ms)")
    print(f"measured added ms / predicted added ms: {growth['measured']['added_ms'] / growth['predicted']['added_ms']:.2f}")
    if args.families:
        for context in contexts:
            row = rows[str(context)]
            print(f"context {context}: family ms measured (profiled) / predicted: " + ", ".join(
                f"{FAMILIES[f]} {row['measured_families_ms'].get(f, 0.0):.1f} / {row['predicted_families_ms'][f]:.1f}"
                for f in FAMILIES if row['measured_families_ms'].get(f) or row['predicted_families_ms'][f] > 0.05))
    if args.llama_cpp:
        build = report["llama_cpp"]["build"]
        print(f"beside llama.cpp (build {build['build_number']} {build['build_commit']}, {build['model_type']}, "
              f"KV {build['type_k']}/{build['type_v']}, flash attention {build['flash_attn']}), "
              f"threads ours {os.cpu_count()}, llama.cpp {args.llama_threads}: ours the median of "
              f"{args.decode_steps} steps around llama-bench's {args.llama_reps} x {args.llama_tokens} tokens "
              "at the same context; medians (bests)")
        print(f"{'context':>8} {'ours ms (best)':>16} {'llama.cpp ms (best)':>20} {'llama.cpp / ours (best)':>24}")
        for context in contexts:
            row = rows[str(context)]
            print(f"{context:>8} {row['beside_llama_ms']:>8.1f} ({row['beside_llama_best_ms']:>5.1f}) "
                  f"{row['llama_cpp_ms']:>12.1f} ({row['llama_cpp_best_ms']:>5.1f}) "
                  f"{row['llama_cpp_ms'] / row['beside_llama_ms']:>16.2f} "
                  f"({row['llama_cpp_best_ms'] / row['beside_llama_best_ms']:>5.2f})")
    if "prefill_tok_s" in report:
        print(f"prefill of {args.prefill} tokens in chunks of {args.prefill_chunk}: {report['prefill_tok_s']:.1f} tok/s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

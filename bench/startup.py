"""Benchmark: engine start-up, each run in a fresh process, against this machine's copy bandwidth.

A run times the runtime's import (``dsv4c.runtime.engine`` and the TVM backend) and then
``Engine(ARTIFACT)`` until it is ready; "ready" is the two together. The target (issue 36): a
ready engine in under 1.5 s plus the weight bytes at half the copy bandwidth. The copy
bandwidth is measured in the same run, in its own process, alternating with the engine's runs:
numpy copies of COPY_BYTES into memory already touched, on one thread and on the threads the
weight reader uses (the best of the two is the machine's copy speed), and once into fresh
memory ("first touch", huge pages as the read weights): reading weights into new memory cannot
beat that, and on a VM whose host takes freed memory back (a balloon) it runs far below the
copy speed. ``--pause`` seconds of rest before each child let such a host take the memory of
the previous one back, as on a machine that was idle.

    python bench/startup.py ARTIFACT [--runs 5] [--pause 5] [--weights auto|read|map] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_FIXED_S = 1.5
COPY_BYTES = 1 << 30
COPY_PIECE = 64 << 20  # a copy job, as the weight reader's (runtime.weights.READ_CHUNK_BYTES)


def engine_child(artifact: str, weights: str) -> dict:
    start = time.perf_counter()
    from dsv4c.runtime.engine import Engine

    importlib.import_module("dsv4c.runtime.backend_tvm")  # what Engine imports for a compiled artifact

    imported = time.perf_counter()
    engine = Engine(artifact, weights=weights)
    ready = time.perf_counter()
    return {"import_s": imported - start, "engine_s": ready - imported, "ready_s": ready - start,
            "reads_weights": getattr(engine.backend, "reads_weights", False),
            "modules_tvm": sorted(m for m in sys.modules if m == "tvm" or m.startswith("tvm."))[:3]}


def copy_child() -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from dsv4c.threads import default_workers

    def copy(dst, src, threads: int) -> float:
        def piece(first: int) -> None:
            dst[first:first + COPY_PIECE] = src[first:first + COPY_PIECE]

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(piece, range(0, COPY_BYTES, COPY_PIECE)))
        return COPY_BYTES / (time.perf_counter() - start) / 1e9

    threads = default_workers()
    src = np.ones(COPY_BYTES, np.uint8)
    first_touch = copy(np.empty(COPY_BYTES, np.uint8), src, threads)
    dst = np.ones(COPY_BYTES, np.uint8)
    return {"threads": threads, "copy_gb_s_1": max(copy(dst, src, 1) for _ in range(3)),
            f"copy_gb_s_{threads}": max(copy(dst, src, threads) for _ in range(3)), "first_touch_gb_s": first_touch}


def weight_bytes(artifact: Path) -> int:
    from dsv4c.artifact.manifest import read_manifest

    return sum((artifact / f).stat().st_size for f in read_manifest(artifact).weight_files())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--pause", type=float, default=5.0, help="seconds of rest before each child process")
    p.add_argument("--weights", choices=["auto", "read", "map"], default="auto")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    p.add_argument("--child", choices=["engine", "copy"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        figures = engine_child(str(args.artifact), args.weights) if args.child == "engine" else copy_child()
        print(json.dumps(figures))
        return
    if args.runs < 1:
        p.error(f"--runs must be at least 1, not {args.runs}")

    def child(kind: str) -> dict:
        cmd = [sys.executable, __file__, str(args.artifact), "--child", kind, "--weights", args.weights]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])

    engines, copies = [], []
    for _ in range(args.runs):  # each child after the same rest: the first touch depends on it
        time.sleep(args.pause)
        engines.append(child("engine"))
        time.sleep(args.pause)
        copies.append(child("copy"))
    threads = copies[0]["threads"]
    median = {key: statistics.median(run[key] for run in runs) for runs, keys in
              ((engines, ("import_s", "engine_s", "ready_s")),
               (copies, ("copy_gb_s_1", f"copy_gb_s_{threads}", "first_touch_gb_s"))) for key in keys}
    nbytes = weight_bytes(args.artifact)
    copy_gb_s = max(median["copy_gb_s_1"], median[f"copy_gb_s_{threads}"])
    target = TARGET_FIXED_S + nbytes / 1e9 / (copy_gb_s / 2)
    report = {"artifact": str(args.artifact), "runs": args.runs, "pause_s": args.pause, "weights": args.weights,
              "reads_weights": engines[0]["reads_weights"], "weight_bytes": nbytes, "median": median,
              "copy_gb_s": copy_gb_s, "target_s": target, "ratio": median["ready_s"] / target,
              "engine_runs": engines, "copy_runs": copies}
    print(f"{args.artifact}: {nbytes / 1e9:.2f} GB of weights ({'read into memory' if report['reads_weights'] else 'mapped'}), "
          f"median of {args.runs} fresh processes, {args.pause:g} s rest before each")
    each = ", ".join(f"{run['ready_s']:.2f}" for run in engines)
    print(f"  runtime import {median['import_s']:.2f} s, Engine() {median['engine_s']:.2f} s: "
          f"ready in {median['ready_s']:.2f} s (runs: {each})")
    print(f"  copy bandwidth {median['copy_gb_s_1']:.1f} GB/s on 1 thread, {median[f'copy_gb_s_{threads}']:.1f} on "
          f"{threads}; first touch of fresh memory {median['first_touch_gb_s']:.2f} GB/s")
    print(f"  target {TARGET_FIXED_S} s + {nbytes / 1e9:.2f} GB / ({copy_gb_s:.1f} / 2) GB/s = {target:.2f} s: "
          f"ready / target = {report['ratio']:.2f}")
    if engines[0]["modules_tvm"]:
        print(f"  note: the runtime imported tvm ({', '.join(engines[0]['modules_tvm'])}, ...)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

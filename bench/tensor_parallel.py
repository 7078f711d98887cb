"""Benchmark: the flash slice's decode step on one process (2 threads) and on two ranks (2
processes x 1 thread, ``compile --tensor-parallel 2``), same machine, same run.

Each configuration runs in a child process of its own, alternating, ``--rounds`` times: the
engine feeds a ``--context``-token prompt, then times ``--steps`` decode steps of one request
(``Engine.step``, the whole step: both ranks' kernels, the broadcast of the step's inputs and the
collectives). Each round keeps its median step, each configuration its best round; the ratio
TP 2 / TP 1 is the figure to compare (the goal: at most 1.25), and beside it the median over
rounds of each round's own ratio, which a drifting machine moves less. The ranks are pinned one per
core (``runtime.tensor_parallel.core_shares``), the one-process engine runs 2 threads.

It also prints what a decode step moves: the collectives' payload (every ``all_reduce`` /
``all_gather`` of the step program at one token, from the artifact's ``program.json``) and the
bytes each rank sends over gloo's ring for it, beside the weight bytes each rank reads per token
(``flash_slice.decode_weight_bytes``: dense weights whole, the routed experts' top-k share).
Last, the collective choice: two ranks time an all-reduce of a decode step's and a 512-token
prefill chunk's partial sums against a reduce-scatter + all-gather and an all-to-all of them, and
a broadcast of the same (one round trip). And why ranks poll while they wait
(``Group.finish``): two ranks run a head-sized BF16 GEMV in lockstep, meeting in a barrier between
calls, once sleeping in the barrier's wait and once polling it; the kernel's own time is what
differs (a VM halts an idle vCPU). ``--kernels`` prints instead, per configuration, rank 0's most
expensive kernels and collectives per decode step (the VM's instrument hook).

    python bench/tensor_parallel.py ONE_DEVICE_ARTIFACT TP2_ARTIFACT [--expert-parallel EP2_ARTIFACT]
                                    [--context 1024] [--steps 32] [--rounds 3] [--json out.json]

Both artifacts are the flash slice (``bench/flash_slice.py`` builds the checkpoint; compile it with
``dsv4c compile --model CKPT --target llvm [-tp 2]``).
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

sys.path.insert(0, str(Path(__file__).parent))
from flash_slice import decode_weight_bytes  # noqa: E402


def child(artifact: str, context: int, steps: int) -> dict:
    """Decode ``steps`` tokens after a ``context``-token prompt; the seconds of each decode step."""
    import numpy as np

    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    with Engine(artifact, max_requests=1, max_context=context + steps + 8, max_step_tokens=512,
                prefix_caching=False) as engine:
        prompt = np.random.default_rng(0).integers(0, engine.config.vocab_size, context).tolist()
        rid = engine.submit(prompt, SamplingParams(max_new_tokens=steps + 2))
        request = engine.requests[rid]
        while not request.generated:  # prefill
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return {"decode_s": times}


def collectives_child(rank: int, port: int, hidden: int, tokens: list[int], repeats: int) -> dict:
    """One of two ranks (pinned to core ``rank``, as the engine's are): microseconds per call of
    the MoE / attention join at a step of ``tokens`` tokens of ``hidden`` floats, by the three ways
    to do it: an all-reduce, a reduce-scatter then an all-gather (what a sequence-parallel split
    would do), an all-to-all of the same bytes (what an expert dispatch sends)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, [rank % os.cpu_count()])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    out = {}
    for t in tokens:
        x, half, whole = torch.ones(t * hidden), torch.empty(t * hidden // 2), torch.empty(t * hidden)
        ways = {"all_reduce": lambda: pg.allreduce([x]).wait(),
                "reduce_scatter+all_gather": lambda: (pg._reduce_scatter_base(half, x).wait(),
                                                      pg._allgather_base(whole, half).wait()),
                "all_to_all": lambda: pg.alltoall_base(whole, x, [], []).wait()}
        options = dist.BroadcastOptions()
        options.rootRank = 0
        ways["broadcast (one round trip)"] = lambda: pg.broadcast([x], options).wait()
        for name, call in ways.items():
            for _ in range(3):
                call()
            pg.barrier().wait()
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            out[f"{name} @ {t} tokens"] = (time.perf_counter() - start) / repeats * 1e6
    return out


def collective_choice(hidden: int, tokens: list[int], repeats: int) -> dict:
    """Both ranks of :func:`collectives_child`; rank 0's figures."""
    from dsv4c.runtime.tensor_parallel import free_port

    port = free_port()
    args = [str(hidden), ",".join(map(str, tokens)), str(repeats)]
    procs = [subprocess.Popen([sys.executable, __file__, "x", "x", "--collectives-child", str(rank), str(port), *args],
                              stdout=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [p.communicate()[0] for p in procs]
    return json.loads(outs[0].splitlines()[-1])


def wakeup_child(rank: int, port: int, poll: bool, rows: int, calls: int) -> dict:
    """One of two ranks (pinned to core ``rank``, one TVM thread): milliseconds of a [rows, 4096]
    BF16 GEMV, each call after a barrier with the other rank, which this rank waits for by
    polling (``Group.finish``) or by sleeping in the wait."""
    import numpy as np
    import tvm

    from dsv4c.codegen.kernels import KERNELS, formats
    from dsv4c.codegen.kernels.cpu import CPU_PASS_CONFIG
    from dsv4c.runtime import tvm_runtime as rt
    from dsv4c.runtime.kv_pool import aligned_empty
    from dsv4c.runtime.tensor_parallel import Group, pin_to
    from dsv4c.targets import target_info

    pin_to([rank % os.cpu_count()])
    target = target_info("llvm").tvm_target()
    with target:
        func = KERNELS["linear"](rows, 4096, "bf16", True)
    with tvm.transform.PassContext(config=CPU_PASS_CONFIG):
        kernel = tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target=target)["k"]
    shape = formats.tir_format("bf16").parts(rows, 4096)[0][0]
    w, x, y = aligned_empty(shape, np.uint16), aligned_empty((1, 4096), np.float32), aligned_empty((1, rows), np.float32)
    w[...], x[...] = np.random.default_rng(rank).integers(0, 1 << 14, shape, dtype=np.uint16), 1.0
    args = [rt.from_numpy(a) for a in (x, w, y)]
    group = Group(f"127.0.0.1:{port}", rank, 2, 60.0, gpu=False)
    times = []
    for i in range(calls + 10):
        work = group.control.barrier()
        group.finish(work) if poll else work.wait()
        start = time.perf_counter()
        kernel(*args)
        if i >= 10:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return {"ms": ms, "gb_s": w.nbytes / ms / 1e6}


def wakeup_cost(rows: int, calls: int) -> dict:
    """Both ranks of :func:`wakeup_child`, sleeping then polling: each rank's GEMV figures."""
    from dsv4c.runtime.tensor_parallel import free_port

    out = {}
    for way in ("sleeping", "polling"):
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "x", "x", "--wakeup-child", str(rank), str(port),
                                   str(int(way == "polling")), str(rows), str(calls)], stdout=subprocess.PIPE, text=True)
                 for rank in range(2)]
        out[way] = [json.loads(p.communicate()[0].splitlines()[-1]) for p in procs]
    return out


def kernels_child(artifact: str, context: int, steps: int) -> dict:
    """Rank 0's milliseconds per decode step in each kernel and collective the VM calls (its
    instrument hook), the most expensive first."""
    import numpy as np

    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    spent: dict[str, float] = {}
    timing = {"on": False, "start": 0.0}

    def instrument(_func, symbol, before, _ret, *_args):
        if timing["on"]:
            if before:
                timing["start"] = time.perf_counter()
            else:
                spent[symbol] = spent.get(symbol, 0.0) + time.perf_counter() - timing["start"]
        return 0

    with Engine(artifact, max_requests=1, max_context=context + steps + 8, max_step_tokens=512,
                prefix_caching=False) as engine:
        engine.backend.vm.set_instrument(instrument)
        prompt = np.random.default_rng(0).integers(0, engine.config.vocab_size, context).tolist()
        request = engine.requests[engine.submit(prompt, SamplingParams(max_new_tokens=steps + 2))]
        while not request.generated:
            engine.step()
        timing["on"] = True
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
    return {"wall_ms": wall * 1e3,
            "ms": dict(sorted(((k, v / steps * 1e3) for k, v in spent.items()), key=lambda kv: -kv[1])[:12])}


def collective_bytes(artifact: Path) -> dict:
    """Payload of the step's collectives at one token, and what each rank sends for them over a
    ring of N ranks (all-reduce: 2 (N-1) / N of the tensor; all-gather: (N-1) / N of the result)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    n = manifest.get("tensor_parallel", 1)
    step = next(f for f in json.loads((artifact / "program.json").read_text())["functions"] if f["name"] == "step")
    payload = wire = 0.0
    counts = {"all_reduce": 0, "all_gather": 0}
    for node in step["nodes"]:
        if node["op"] in counts:
            counts[node["op"]] += 1
            size = 4
            for d in node["outputs"][0]["type"]["shape"][1:]:
                size *= d
            payload += size
            wire += size * (2 if node["op"] == "all_reduce" else 1) * (n - 1) / n
    return {"calls": counts, "payload_bytes": payload, "sent_bytes_per_rank": wire}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("one_device", type=Path)
    p.add_argument("tp2", type=Path)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--expert-parallel", type=Path, metavar="EP2_ARTIFACT",
                   help="also the same model compiled with -tp 2 --expert-parallel (whole experts per rank)")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--collectives-child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--kernels", action="store_true",
                   help="instead: each configuration's most expensive kernels and collectives (rank 0), one run each")
    p.add_argument("--kernels-child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--wakeup-child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.wakeup_child:
        rank, port, poll, rows, calls = map(int, args.wakeup_child)
        result = wakeup_child(rank, port, bool(poll), rows, calls)
        print(json.dumps(result), flush=True)
        os._exit(0)  # a process holding gloo groups aborts in interpreter shutdown
    if args.kernels_child:
        print(json.dumps(kernels_child(args.kernels_child[0], int(args.kernels_child[1]), int(args.kernels_child[2]))))
        return
    if args.collectives_child:
        rank, port, hidden, tokens, repeats = args.collectives_child
        print(json.dumps(collectives_child(int(rank), int(port), int(hidden), [int(t) for t in tokens.split(",")],
                                           int(repeats))))
        return
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return
    from dsv4c.targets import host_cpu_flags

    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    configs = {"tp1": (args.one_device, {**env, "TVM_NUM_THREADS": "2"}), "tp2": (args.tp2, env)}
    if args.expert_parallel:
        configs["ep2"] = (args.expert_parallel, env)
    if args.kernels:
        for name, (artifact, child_env) in configs.items():
            out = subprocess.run([sys.executable, __file__, "x", "x", "--kernels-child", str(artifact),
                                  str(args.context), str(args.steps)],
                                 capture_output=True, text=True, env=child_env, check=True)
            report = json.loads(out.stdout.splitlines()[-1])
            print(f"{name}: {report['wall_ms']:.2f} ms per decode step; rank 0's most expensive calls (ms per step):")
            for symbol, ms in report["ms"].items():
                print(f"  {ms:8.3f}  {symbol}")
        return
    rounds: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (artifact, child_env) in configs.items():
            out = subprocess.run([sys.executable, __file__, str(args.one_device), str(args.tp2),
                                  "--child", str(artifact), str(args.context), str(args.steps)],
                                 capture_output=True, text=True, env=child_env, check=True)
            rounds[name].append(statistics.median(json.loads(out.stdout.splitlines()[-1])["decode_s"]))
    host = host_cpu_flags()
    best = {name: min(values) for name, values in rounds.items()}
    weights = {"tp1": decode_weight_bytes(args.one_device)["total"],
               "tp2": [decode_weight_bytes(args.tp2, rank)["total"] for rank in range(2)]}
    # TP 1 and TP 2 of a round run one after the other: their ratio drifts less with the machine
    # than the best rounds' (bench/RESULTS.md: TP 1's round medians varied by 1.5x in one run).
    paired = {name: statistics.median(b / a for a, b in zip(rounds["tp1"], rounds[name])) for name in rounds
              if name != "tp1"}
    report = {"cpu": host.model if host else None, "context": args.context, "steps": args.steps,
              "rounds_median_s": rounds, "best_median_ms": {k: v * 1e3 for k, v in best.items()},
              "tp2_over_tp1": best["tp2"] / best["tp1"], "paired_round_ratio": paired,
              "weight_bytes_per_token": weights,
              "collectives": collective_bytes(args.tp2),
              "collective_choice_us": collective_choice(4096, [1, 512], 50),
              "wakeup": wakeup_cost(16000, 100)}
    c = report["collectives"]
    print(f"CPU: {report['cpu']}; flash slice, context {args.context}, {args.steps} decode steps x {args.rounds} rounds")
    print(f"decode step  TP 1 (1 process x 2 threads) {best['tp1'] * 1e3:8.2f} ms   "
          f"TP 2 (2 processes x 1 thread) {best['tp2'] * 1e3:8.2f} ms   TP 2 / TP 1 = {report['tp2_over_tp1']:.3f}")
    if "ep2" in best:
        print(f"decode step  TP 2 with --expert-parallel {best['ep2'] * 1e3:8.2f} ms   EP 2 / TP 1 = "
              f"{best['ep2'] / best['tp1']:.3f} (a token's experts fall unevenly on the ranks)")
    print("median over rounds of (this round's TP 2 / its TP 1): " +
          ", ".join(f"{name.upper()} {ratio:.3f}" for name, ratio in paired.items()))
    print(f"weights read per token: TP 1 {weights['tp1'] / 2**20:.1f} MiB; TP 2 per rank "
          f"{' / '.join(f'{w / 2**20:.1f}' for w in weights['tp2'])} MiB")
    print(f"collectives per decode step: {c['calls']['all_reduce']} all-reduce + {c['calls']['all_gather']} "
          f"all-gather, payload {c['payload_bytes'] / 2**10:.1f} KiB, each rank sends "
          f"{c['sent_bytes_per_rank'] / 2**10:.1f} KiB ({c['sent_bytes_per_rank'] / weights['tp2'][0]:.2e} of its "
          "weight reads)")
    print("joining two ranks' partial sums (hidden 4096, us per call):")
    for name, us in report["collective_choice_us"].items():
        print(f"  {name:<40} {us:10.1f}")
    print("two ranks' [16000, 4096] BF16 GEMV in lockstep, a barrier between calls (ms per call, GB/s per rank):")
    for way, ranks in report["wakeup"].items():
        print(f"  {way + ' in the barrier':<28} " + "   ".join(f"rank {r}: {x['ms']:6.2f} ms {x['gb_s']:5.1f} GB/s"
                                                      for r, x in enumerate(ranks)))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

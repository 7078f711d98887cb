"""Benchmark: the flash slice's decode step on one process (2 threads) and on two ranks (2
processes x 1 thread, ``compile --tensor-parallel 2``), same machine, same run.

Each configuration runs in a child process of its own, alternating, ``--rounds`` times: the
engine feeds a ``--context``-token prompt, then times ``--steps`` decode steps of one request
(``Engine.step``, the whole step: both ranks' kernels, the broadcast of the step's inputs and the
collectives). Each round keeps its median step, each configuration its best round; the ratio
TP 2 / TP 1 is the figure to compare (the goal: at most 1.25), and beside it the median over
rounds of each round's own ratio. A round's processes are fresh, and on this project's VM each
process's memory lands in fast or slow memory (two cores stream 33-35 or 58-64 GB/s, drawn per
process: bench/RESULTS.md), so a TP 2 round needs both ranks to draw well: the default of 5
rounds gives that a fair chance. The ranks are pinned one per core
(``runtime.tensor_parallel.core_shares``), the one-process engine runs 2 threads.

It also prints what a decode step moves: the collectives' payload (every ``all_reduce`` /
``all_gather`` of the step program at one token, from the artifact's ``program.json``) and the
bytes each rank sends over gloo's ring for it, beside the weight bytes each rank reads per token
(``flash_slice.decode_weight_bytes``: dense weights whole, the routed experts' top-k share).
Last, the collective choice: two ranks time an all-reduce of a decode step's and a 512-token
prefill chunk's partial sums against a reduce-scatter + all-gather and an all-to-all of them, and
a broadcast of the same (one round trip); a plain loopback round trip between two pinned
processes, both spinning and both sleeping (why waiting ranks poll: ``Group.finish``). And how the
cores share the memory bandwidth, which bounds what two ranks can gain: a rank's half of the head
(a BF16 GEMV) run by one rank alone, by both ranks at once (meeting in a barrier before each call,
as a step's collectives make them), and the whole head in one process on 2 threads. ``--kernels``
prints instead, per configuration, rank 0's most expensive kernels and collectives per decode step
(the VM's instrument hook).

    python bench/tensor_parallel.py ONE_DEVICE_ARTIFACT TP2_ARTIFACT [--expert-parallel EP2_ARTIFACT]
                                    [--context 1024] [--steps 32] [--rounds 5] [--json out.json]

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
    from dsv4c.runtime.tensor_parallel.ranks import free_port

    port = free_port()
    args = [str(hidden), ",".join(map(str, tokens)), str(repeats)]
    procs = [subprocess.Popen([sys.executable, __file__, "x", "x", "--collectives-child", str(rank), str(port), *args],
                              stdout=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [p.communicate()[0] for p in procs]
    return json.loads(outs[0].splitlines()[-1])


def _head_gemv(rows: int, seed: int):
    """A [rows, 4096] BF16 GEMV (the head's kernel) over fresh random weights: (call, weight bytes)."""
    import numpy as np
    import tvm

    from dsv4c.codegen.kernel_factories import KERNELS
    from dsv4c.codegen.kernels import formats
    from dsv4c.codegen.kernels.cpu import CPU_PASS_CONFIG
    from dsv4c.runtime import tvm_runtime as rt
    from dsv4c.runtime.kv_pool import aligned_empty
    from dsv4c.targets import target_info

    target = target_info("llvm").tvm_target()
    with target:
        func = KERNELS["linear"](rows, 4096, "bf16", True)
    with tvm.transform.PassContext(config=CPU_PASS_CONFIG):
        kernel = tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target=target)["k"]
    shape = formats.tir_format("bf16").parts(rows, 4096)[0][0]
    w, x, y = aligned_empty(shape, np.uint16), aligned_empty((1, 4096), np.float32), aligned_empty((1, rows), np.float32)
    w[...], x[...] = np.random.default_rng(seed).integers(0, 1 << 14, shape, dtype=np.uint16), 1.0
    args = [rt.from_numpy(a) for a in (x, w, y)]
    return (lambda: kernel(*args)), w.nbytes


def _timed(call, nbytes: int, calls: int, before=lambda: None) -> dict:
    """Median milliseconds and GB/s of ``calls`` calls (after 10 untimed), ``before`` ahead of each."""
    times = []
    for i in range(calls + 10):
        before()
        start = time.perf_counter()
        call()
        if i >= 10:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return {"ms": ms, "gb_s": nbytes / ms / 1e6}


def bandwidth_child(rank: int, port: int, together: bool, rows: int, calls: int) -> dict:
    """One of two ranks (pinned to core ``rank``, one TVM thread) running a [rows, 4096] BF16 GEMV:
    ``together``, both ranks, meeting in a (polled) barrier before each call as a step's
    collectives make them; else rank 0 alone while rank 1 waits in a barrier (its result: {})."""
    from dsv4c.runtime.tensor_parallel.collectives import Group
    from dsv4c.runtime.tensor_parallel.ranks import pin_to

    pin_to([rank % os.cpu_count()])
    call, nbytes = _head_gemv(rows, rank)
    group = Group(f"127.0.0.1:{port}", rank, 2, 600.0, gpu=False)
    result = {}
    if together:
        result = _timed(call, nbytes, calls, lambda: group.finish(group.control.barrier()))
    elif rank == 0:
        result = _timed(call, nbytes, calls)
    group.finish(group.control.barrier())
    return result


def _two_ranks(flag: str, *args) -> list[dict]:
    """Run this script's child ``flag`` as ranks 0 and 1 (rank, a free port, ``args``): the
    results of the ranks that report one."""
    from dsv4c.runtime.tensor_parallel.ranks import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "x", "x", flag, str(rank), str(port), *map(str, args)],
                              stdout=subprocess.PIPE, text=True) for rank in range(2)]
    return [r for r in (json.loads(p.communicate()[0].splitlines()[-1]) for p in procs) if r]


def bandwidth(rows: int, calls: int) -> dict:
    """How the cores share the memory bandwidth: :func:`bandwidth_child` alone and together, and
    the GEMV twice the size in one process on 2 threads (TP 1's head)."""
    out = {way: _two_ranks("--bandwidth-child", int(way == "together"), rows, calls) for way in ("alone", "together")}
    env = {**os.environ, "TVM_NUM_THREADS": "2"}
    one = subprocess.run([sys.executable, __file__, "x", "x", "--one-process-child", str(2 * rows), str(calls)],
                         capture_output=True, text=True, env=env, check=True)
    out["one_process"] = json.loads(one.stdout.splitlines()[-1])
    return out


def roundtrip_child(rank: int, port: int, spin: bool, calls: int) -> dict:
    """One end (pinned to core ``rank``) of a 16 KiB TCP ping-pong over loopback, both ends
    spinning on non-blocking sockets or sleeping in blocking ones: rank 0's round trips in us."""
    import socket

    from dsv4c.runtime.tensor_parallel.ranks import pin_to

    pin_to([rank % os.cpu_count()])
    if rank == 0:
        server = socket.create_server(("127.0.0.1", port))
        sock = server.accept()[0]
    else:
        deadline = time.monotonic() + 60
        while True:  # until rank 0 listens
            try:
                sock = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(not spin)
    size = 16 << 10
    message, received = memoryview(b"x" * size), memoryview(bytearray(size))

    def move(op, view) -> None:
        done = 0
        while done < size:
            try:
                done += op(view[done:])
            except BlockingIOError:
                pass

    times = []
    for _ in range(calls + 100):
        start = time.perf_counter()
        if rank == 0:
            move(sock.send, message)
            move(sock.recv_into, received)
        else:
            move(sock.recv_into, received)
            move(sock.send, message)
        times.append(time.perf_counter() - start)
    return {"us": statistics.median(times[100:]) * 1e6} if rank == 0 else {}


def roundtrips(calls: int) -> dict:
    """Median loopback round trips (us) of :func:`roundtrip_child`, both ends spinning and sleeping."""
    return {way: _two_ranks("--roundtrip-child", int(way == "spinning"), calls)[0]["us"]
            for way in ("spinning", "sleeping")}


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
    from dsv4c.artifact.file_names import PROGRAM
    from dsv4c.artifact.manifest import read_manifest

    n = read_manifest(artifact).tensor_parallel
    step = next(f for f in json.loads((artifact / PROGRAM).read_text())["functions"] if f["name"] == "step")
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
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--expert-parallel", type=Path, metavar="EP2_ARTIFACT",
                   help="also the same model compiled with -tp 2 --expert-parallel (whole experts per rank)")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--collectives-child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--kernels", action="store_true",
                   help="instead: each configuration's most expensive kernels and collectives (rank 0), one run each")
    p.add_argument("--kernels-child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--bandwidth-child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--one-process-child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--roundtrip-child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bandwidth_child:
        rank, port, together, rows, calls = map(int, args.bandwidth_child)
        result = bandwidth_child(rank, port, bool(together), rows, calls)
        print(json.dumps(result), flush=True)
        os._exit(0)  # a process holding gloo groups aborts in interpreter shutdown
    if args.roundtrip_child:
        rank, port, spin, calls = map(int, args.roundtrip_child)
        print(json.dumps(roundtrip_child(rank, port, bool(spin), calls)))
        return
    if args.one_process_child:
        rows, calls = map(int, args.one_process_child)
        print(json.dumps(_timed(*_head_gemv(rows, 0), calls)))
        return
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
              "bandwidth": bandwidth(16000, 100), "loopback_roundtrip_us": roundtrips(2000)}
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
    r = report["loopback_roundtrip_us"]
    print(f"a 16 KiB loopback round trip between two pinned processes (why waiting ranks poll): both spinning "
          f"{r['spinning']:.0f} us, both sleeping in recv {r['sleeping']:.0f} us")
    b = report["bandwidth"]
    print("how the cores share the memory bandwidth: a [16000, 4096] BF16 GEMV (a TP 2 rank's half of the head):")
    print(f"  one rank alone, the other idle           rank 0: {b['alone'][0]['ms']:6.2f} ms {b['alone'][0]['gb_s']:5.1f} GB/s")
    print("  both ranks at once, a barrier per call   " +
          "   ".join(f"rank {r}: {x['ms']:6.2f} ms {x['gb_s']:5.1f} GB/s" for r, x in enumerate(b["together"])) +
          f"   together {sum(x['gb_s'] for x in b['together']):5.1f} GB/s")
    print(f"  the whole head [32000, 4096] in one process, 2 threads: {b['one_process']['ms']:6.2f} ms "
          f"{b['one_process']['gb_s']:5.1f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

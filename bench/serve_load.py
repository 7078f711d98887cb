"""Serving overhead: N concurrent clients against `dsv4c serve` vs the same requests through the
Engine directly, in the same run.

Each of the N clients sends its requests one after another (a closed loop: the next when the
last has finished), greedy, streaming. The offline side replays the same closed loop on an
Engine in a child process (N virtual clients, each submitting its next request when its last
finishes); the server runs in another child process and the clients in this one, all on the
same machine. Rounds alternate between the sides. Both sides must produce the same tokens (checked). Printed: output tokens/s,
p50 / p99 time to first token and inter-token latency, and the server / offline ratios.

    python bench/serve_load.py [--artifact ART] [--clients 8] [--requests 4] [--prompt-tokens 32]
                               [--max-tokens 64] [--rounds 10]

Without --artifact it makes the tiny model and compiles it for llvm in a temporary directory.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np


def workload(args, vocab: int) -> list[list[list[int]]]:
    """Per client, its prompts: random ids (fixed seed), the same on both sides."""
    rng = np.random.default_rng(0)
    return [[rng.integers(2, vocab, args.prompt_tokens).tolist() for _ in range(args.requests)]
            for _ in range(args.clients)]


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(wall: float, cpu: float, tokens: list[list[int]], first: list[float], gaps: list[float]) -> dict:
    n = sum(map(len, tokens))
    return {"tokens_per_s": n / wall, "cpu_ms_per_token": 1e3 * cpu / n, "ttft_p50": float(np.percentile(first, 50)),
            "ttft_p99": float(np.percentile(first, 99)), "itl_p50": float(np.percentile(gaps, 50)),
            "itl_p99": float(np.percentile(gaps, 99)), "tokens": tokens}


# --------------------------------------------------------------------------- offline (child process)


def offline_worker(args) -> None:
    """Loads the engine once, then runs the closed loop once per line on stdin, a JSON line each."""
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    engine = Engine(args.artifact, max_requests=args.clients, max_context=args.prompt_tokens + args.max_tokens)
    params = SamplingParams(max_new_tokens=args.max_tokens, stop_token_ids=tuple(engine.config.eos_token_ids))
    engine.generate([2, 3, 4], params)  # warm up
    prompts = workload(args, engine.config.vocab_size)
    times: dict[int, list[float]] = {}  # rid -> submit time, then token times

    def submit(client: int, index: int) -> tuple[int, int, int]:
        rid = engine.submit(prompts[client][index], params, on_token=lambda r, _t: times[r].append(time.perf_counter()))
        times[rid] = [time.perf_counter()]
        return rid, client, index

    for _ in sys.stdin:
        start, cpu = time.perf_counter(), cpu_seconds()
        live = [submit(c, 0) for c in range(args.clients)]
        tokens: dict[tuple[int, int], list[int]] = {}
        first, gaps = [], []
        while live:
            engine.step()
            for rid, client, index in [x for x in live if engine.is_finished(x[0])]:
                live.remove((rid, client, index))
                tokens[client, index] = engine.result(rid).tokens
                stamps = times.pop(rid)
                first.append(stamps[1] - stamps[0])
                gaps += np.diff(stamps[1:]).tolist()
                if index + 1 < args.requests:
                    live.append(submit(client, index + 1))
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        ordered = [tokens[c, i] for c in range(args.clients) for i in range(args.requests)]
        print(json.dumps(summary(wall, cpu, ordered, first, gaps)), flush=True)


# --------------------------------------------------------------------------- through the server


def through_server(url: str, pid: int, args, vocab: int) -> dict:
    """The clients: one thread each, with the standard library's HTTP client, which costs a third of
    httpx's CPU per streamed token; they share this machine's cores with the server."""
    prompts = workload(args, vocab)
    address = urlsplit(url)
    first, gaps = [], []

    def request(conn: http.client.HTTPConnection, prompt: list[int]) -> list[int]:
        body = json.dumps({"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True})
        sent, stamps, ids = time.perf_counter(), [], []
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            sys.exit(f"the server answered {response.status}: {response.read()!r}")
        for line in response:
            if line.startswith(b"data: {"):
                new = json.loads(line[6:])["choices"][0]["token_ids"]
                stamps += [time.perf_counter()] * len(new)
                ids += new
        first.append(stamps[0] - sent)
        gaps.extend(np.diff(stamps).tolist())
        return ids

    def client(mine: list[list[int]], out: list) -> None:
        conn = http.client.HTTPConnection(address.hostname, address.port)
        out.extend(request(conn, p) for p in mine)
        conn.close()

    client([[2, 3, 4]], [])  # warm up
    first.clear()
    gaps.clear()
    results = [[] for _ in prompts]
    threads = [threading.Thread(target=client, args=(mine, out)) for mine, out in zip(prompts, results)]
    start, cpu, client_cpu = time.perf_counter(), cpu_seconds(pid), cpu_seconds()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu, client_cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu, cpu_seconds() - client_cpu
    out = summary(wall, cpu, [ids for mine in results for ids in mine], first, gaps)
    return {**out, "client_cpu_ms_per_token": 1e3 * client_cpu / sum(map(len, out["tokens"]))}


def start_server(args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "dsv4c", "serve", str(args.artifact), "--port", "0",
                             "--max-requests", str(args.clients), "--max-context",
                             str(args.prompt_tokens + args.max_tokens)], stdout=subprocess.PIPE, text=True)
    banner = proc.stdout.readline()
    url = re.search(r"http://\S+", banner)
    if url is None:
        proc.kill()
        sys.exit(f"the server did not start: {banner!r}")
    return proc, url[0]


def compare(args) -> None:
    from dsv4c.artifact.directory import open_artifact

    vocab = open_artifact(args.artifact).config.vocab_size
    rounds = {"offline": [], "server": []}
    worker = subprocess.Popen([sys.executable, __file__, "--side", "offline", "--artifact", str(args.artifact),
                               "--clients", str(args.clients), "--requests", str(args.requests), "--prompt-tokens",
                               str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc, url = start_server(args)

    def offline_round() -> dict:
        worker.stdin.write("run\n")
        worker.stdin.flush()
        return json.loads(worker.stdout.readline())

    sides = {"offline": offline_round, "server": lambda: through_server(url, proc.pid, args, vocab)}
    try:
        # Rounds alternate which side goes first, so that the drift of a shared machine hits both alike.
        for i in range(args.rounds):
            for side in ("offline", "server") if i % 2 == 0 else ("server", "offline"):
                rounds[side].append(sides[side]())
    finally:
        worker.stdin.close()
        worker.wait(60)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    if any(r["tokens"] != rounds["offline"][0]["tokens"] for side in rounds.values() for r in side):
        sys.exit("the server's tokens differ from the engine's: the comparison is void")
    n_tokens = sum(map(len, rounds["offline"][0]["tokens"]))
    print(f"{args.clients} clients x {args.requests} requests, {args.prompt_tokens}-token prompts, up to "
          f"{args.max_tokens} new tokens ({n_tokens} in all), greedy; {args.rounds} rounds of both sides; medians, and "
          "the median of each round's server / engine ratio")
    print(f"{'metric':<18}{'engine':>10}{'server':>10}{'server/engine':>15}")
    rows = [("tokens_per_s", "output tokens/s", 1), ("ttft_p50", "TTFT p50 ms", 1e3), ("ttft_p99", "TTFT p99 ms", 1e3),
            ("itl_p50", "ITL p50 ms", 1e3), ("itl_p99", "ITL p99 ms", 1e3), ("cpu_ms_per_token", "CPU ms / token", 1)]
    ratios = {}
    for key, name, scale in rows:
        off, srv = ([r[key] for r in rounds[side]] for side in ("offline", "server"))
        ratios[key] = float(np.median([b / a for a, b in zip(off, srv)]))
        print(f"{name:<18}{np.median(off) * scale:>10.2f}{np.median(srv) * scale:>10.2f}{ratios[key]:>15.3f}")
    client_cpu = np.median([r["client_cpu_ms_per_token"] for r in rounds["server"]])
    print(f"(the clients, in this process: {client_cpu:.2f} CPU ms / token)")
    print(f"serving overhead: {100 * (1 - ratios['tokens_per_s']):.1f}% of offline throughput")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", help="artifact to serve (default: the tiny model, compiled for llvm here)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--side", choices=("offline",), help=argparse.SUPPRESS)  # the child process's part
    args = p.parse_args()
    if args.side == "offline":
        offline_worker(args)
        return
    if args.artifact is not None:
        compare(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for argv in (["make-tiny", "--out", f"{tmp}/model"],
                     ["compile", "--model", f"{tmp}/model", "--target", "llvm", "-o", f"{tmp}/art"]):
            subprocess.run([sys.executable, "-m", "dsv4c", *argv], check=True, stdout=subprocess.DEVNULL)
        args.artifact = f"{tmp}/art"
        compare(args)


if __name__ == "__main__":
    main()

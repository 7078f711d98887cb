"""Soak: `dsv4c serve` under mixed streaming load with random client disconnects, for minutes.

16 clients (threads, the standard library's HTTP client) each send one request after another:
streamed completions, streamed chat completions and plain completions, random prompt lengths and
``max_tokens``; a fifth of the streams are dropped by their client after a random number of
tokens, and a fifth of the plain requests before their answer. Every 10 s the server process's RSS
is sampled. At the end, with the server idle, ``/metrics`` must account for every request sent:
each request counted once in ``dsv4c_http_requests_total`` (by endpoint), and each one the server
admitted either finished (``dsv4c_choices_finished_total``) or cut short
(``dsv4c_choices_unfinished_total``). Printed: requests by outcome, RSS growth after the first
minute (target under 5%), p50 / p99 inter-token latency and time to first token as the clients
saw them, the accounting.

Then (``--standard-seconds``, default 60) the same concurrency for a minute measured by
guidellm (a standard LLM load tool: its figures compare with other servers'), if its command is
found (``--guidellm``, default ``guidellm`` on PATH; it pulls in torch, so it may live in a
virtual environment of its own), offline, with the artifact's tokenizer.

    python bench/serve_soak.py [--artifact ART] [--minutes 10] [--clients 16] [--standard-seconds 60]

Without --artifact it makes the tiny model (with the tests' word-level tokenizer and chat
template) and compiles it for llvm in a temporary directory.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

RSS_EVERY = 10.0  # seconds
DROP = 0.2  # the share of requests whose client leaves early


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1]) * 1024


def metrics(host: str, port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(dsv4c_[^ ]+) (\S+)$", text, re.M)}


class Soak:
    """The clients' shared record: what was sent, how each request ended, token timings."""

    def __init__(self, host: str, port: int, vocab: int, deadline: float):
        self.host, self.port, self.vocab, self.deadline = host, port, vocab, deadline
        self.lock = threading.Lock()
        self.sent: Counter[str] = Counter()  # by endpoint
        self.outcomes: Counter[str] = Counter()
        self.first: list[float] = []
        self.gaps: list[np.ndarray] = []

    def record(self, endpoint: str, outcome: str, first: float | None = None, stamps: list[float] = ()) -> None:
        with self.lock:
            self.sent[endpoint] += 1
            self.outcomes[outcome] += 1
            if first is not None:
                self.first.append(first)
            if len(stamps) > 1:
                self.gaps.append(np.diff(stamps))

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        conn = None
        while time.monotonic() < self.deadline:
            if conn is None:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
            kind = rng.choices(("stream", "chat", "plain"), (0.6, 0.2, 0.2))[0]
            prompt = [rng.randrange(6, self.vocab) for _ in range(rng.randint(4, 96))]
            body = {"max_tokens": rng.randint(4, 64), "temperature": rng.choice((0, 0.8)), "ignore_eos": True}
            if kind == "chat":
                endpoint = "/v1/chat/completions"
                body["messages"] = [{"role": "user", "content": " ".join(f"w{t}" for t in prompt)}]
            else:
                endpoint = "/v1/completions"
                body["prompt"] = prompt
            body["stream"] = kind != "plain"
            drop = rng.random() < DROP
            try:
                keep = self.request(conn, endpoint, body, drop, rng)
            except (OSError, http.client.HTTPException) as e:
                self.record(endpoint, f"client error {type(e).__name__}")
                keep = False
            if not keep:
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def request(self, conn: http.client.HTTPConnection, endpoint: str, body: dict, drop: bool,
                rng: random.Random) -> bool:
        """One request; whether the connection can carry the next."""
        sent = time.perf_counter()
        conn.request("POST", endpoint, json.dumps(body), {"Content-Type": "application/json"})
        if drop and not body["stream"]:
            time.sleep(rng.uniform(0, 0.05))  # gone before the answer
            self.record(endpoint, "dropped before the answer")
            return False
        response = conn.getresponse()
        if response.status != 200:
            response.read()
            self.record(endpoint, f"status {response.status}")
            return True
        if not body["stream"]:
            answer = json.loads(response.read())
            self.record(endpoint, "complete" if answer["choices"][0]["finish_reason"] else "no finish reason",
                        time.perf_counter() - sent)
            return True
        stamps, leave_after = [], rng.randint(1, body["max_tokens"]) if drop else None
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                self.record(endpoint, "error event")
                return False
            choice = chunk["choices"][0] if chunk["choices"] else None
            if choice is not None and (choice.get("text") or choice.get("delta", {}).get("content")
                                       or choice.get("token_ids")):
                stamps.append(time.perf_counter())
            if leave_after is not None and len(stamps) >= leave_after:
                self.record(endpoint, "dropped mid-stream", stamps[0] - sent, stamps)
                return False
        self.record(endpoint, "complete", stamps[0] - sent if stamps else None, stamps)
        return True


def start_server(artifact: Path, clients: int) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([sys.executable, "-m", "dsv4c", "serve", str(artifact), "--port", "0",
                             "--max-context", "256", "--max-waiting", str(4 * clients)],
                            stdout=subprocess.PIPE, text=True)
    match = re.search(r"http://([\d.]+):(\d+)", proc.stdout.readline())
    if match is None:
        proc.kill()
        sys.exit("the server did not start")
    return proc, match[1], int(match[2])


def soak(args, proc: subprocess.Popen, host: str, port: int, vocab: int) -> None:
    start = time.monotonic()
    state = Soak(host, port, vocab, start + 60 * args.minutes)
    threads = [threading.Thread(target=state.client, args=(seed,), daemon=True) for seed in range(args.clients)]
    for t in threads:
        t.start()
    samples = []  # (seconds since start, RSS bytes), every RSS_EVERY seconds and once the clients are done
    while any(t.is_alive() for t in threads):
        if not samples or time.monotonic() - start >= samples[-1][0] + RSS_EVERY:
            samples.append((time.monotonic() - start, rss_bytes(proc.pid)))
        time.sleep(0.2)
    samples.append((time.monotonic() - start, rss_bytes(proc.pid)))
    while (m := metrics(host, port))["dsv4c_requests_running"] + m["dsv4c_requests_waiting"] > 0:
        time.sleep(0.2)  # the server lets go of what dropped clients left
    time.sleep(1.0)
    m = metrics(host, port)

    sent = sum(state.sent.values())
    print(f"{args.minutes:g} min, {args.clients} clients: {sent} requests "
          f"({', '.join(f'{n} {e}' for e, n in sorted(state.sent.items()))})")
    for outcome, n in state.outcomes.most_common():
        print(f"  {n:>7}  {outcome}")
    after_minute = [rss for t, rss in samples if t >= 60] or [samples[-1][1]]
    base = after_minute[0]
    print(f"RSS: {samples[0][1] / 2**20:.0f} MiB at start, {base / 2**20:.0f} MiB after the first minute, "
          f"{samples[-1][1] / 2**20:.0f} MiB at the end, at most {max(r for _, r in samples) / 2**20:.0f} MiB; "
          f"last sample against the first after a minute {100 * (samples[-1][1] - base) / base:+.1f}%, "
          f"{len(samples)} samples")
    # The CPU backend gives back its allocators' cached buffers every RELEASE_EVERY_S (30 s), and
    # the next steps take them again: RSS is a sawtooth, and two single samples compare its
    # phases. Its level is the high water of a minute (two periods): the second minute's against
    # the last minute's is the growth.
    second = [rss for t, rss in samples if 60 <= t < 120]
    last = [rss for t, rss in samples if t >= samples[-1][0] - 60]
    if second and samples[-1][0] >= 180:
        print(f"RSS high water: {max(second) / 2**20:.1f} MiB in the second minute, {max(last) / 2**20:.1f} MiB "
              f"in the last; growth after the first minute {100 * (max(last) - max(second)) / max(second):+.1f}% "
              "(target < 5%)")
    late = [(t, rss) for t, rss in samples if t >= 60]
    if len(late) >= 3:  # a leak keeps its slope; a warm-up's flattens
        half = len(late) // 2
        slopes = [np.polyfit([t / 60 for t, _ in part], [r / 2**20 for _, r in part], 1)[0]
                  for part in (late[:half + 1], late[half:])]
        print(f"RSS slope after the first minute: {slopes[0]:+.2f} MiB/min in the first half, "
              f"{slopes[1]:+.2f} MiB/min in the second")
    print("RSS samples (MiB): " + " ".join(f"{rss / 2**20:.1f}" for _, rss in samples))
    gaps = np.concatenate(state.gaps) if state.gaps else np.zeros(1)
    print(f"inter-token latency p50 {1e3 * np.percentile(gaps, 50):.2f} ms, "
          f"p99 {1e3 * np.percentile(gaps, 99):.2f} ms; time to first token p50 {1e3 * np.percentile(state.first, 50):.1f} ms, "
          f"p99 {1e3 * np.percentile(state.first, 99):.1f} ms (clients' clocks)")
    counted = {e: sum(v for k, v in m.items() if k.startswith(f'dsv4c_http_requests_total{{endpoint="{e}"'))
               for e in state.sent}
    admitted = sum(v for k, v in m.items() if k.startswith('dsv4c_http_requests_total{endpoint="/v1/')
                   and (k.endswith('status="200"}') or k.endswith('status="499"}')))
    ended = sum(v for k, v in m.items() if k.startswith("dsv4c_choices_finished_total")) \
        + m["dsv4c_choices_unfinished_total"]
    ok = all(counted[e] == n for e, n in state.sent.items()) and ended == admitted
    print(f"/metrics: requests counted {json.dumps({e: int(v) for e, v in counted.items()})} vs sent "
          f"{json.dumps(dict(state.sent))}; admitted (200 + 499) {admitted:.0f} = finished "
          f"{ended - m['dsv4c_choices_unfinished_total']:.0f} + unfinished {m['dsv4c_choices_unfinished_total']:.0f}"
          f" -> {'every request accounted for' if ok else 'MISMATCH'}")
    print(f"server: {m['dsv4c_generation_tokens_total']:.0f} tokens generated, engine up {m['dsv4c_engine_up']:.0f}")


def standard_tool(args, artifact: Path, host: str, port: int, vocab: int) -> None:
    """guidellm at the soak's concurrency for ``--standard-seconds``: streamed chat completions of
    48-token prompts (random ids as the artifact's tokenizer writes them) and 32 new tokens, the
    artifact's tokenizer as guidellm's, nothing from the network."""
    from tokenizers import Tokenizer

    tool = shutil.which(args.guidellm) or (args.guidellm if Path(args.guidellm).is_file() else None)
    if tool is None:
        print(f"guidellm: not found ({args.guidellm}); skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # transformers reads special tokens as strings: a config that spells one as an object
        # ({"content": ...}, as the tests' does) gets its content.
        config = json.loads((artifact / "tokenizer_config.json").read_text())
        (tmp / "tokenizer").mkdir()
        shutil.copy(artifact / "tokenizer.json", tmp / "tokenizer")
        (tmp / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
            {k: v["content"] if isinstance(v, dict) and "content" in v else v for k, v in config.items()
             if k != "chat_template"}))
        tok, rng = Tokenizer.from_file(str(artifact / "tokenizer.json")), random.Random(0)
        with open(tmp / "prompts.jsonl", "w") as f:
            for _ in range(4000):
                text = tok.decode([rng.randrange(6, vocab) for _ in range(48)])
                f.write(json.dumps({"prompt": text, "prompt_tokens_count": 48, "output_tokens_count": 32}) + "\n")
        backend = {"kind": "openai_http", "target": f"http://{host}:{port}"}
        cmd = [tool, "run", "--backend", json.dumps(backend), "--profile", f"kind=concurrent,streams={args.clients}",
               "--constraint", f"kind=max_duration,seconds={args.standard_seconds}",
               "--tokenizer", f"kind=huggingface_auto,model={tmp / 'tokenizer'}",
               "--data", f"kind=json_file,path={tmp / 'prompts.jsonl'}", "--disable-progress"]
        print("$ " + " ".join(cmd), flush=True)
        offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **offline}, cwd=tmp)
        out = run.stdout
        print(out[out.find("Request Latency Statistics"):].rstrip() if "Request Latency Statistics" in out
              else out[-3000:])
        if run.returncode != 0:
            print(f"guidellm failed (status {run.returncode}): {run.stderr.strip().splitlines()[-5:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, help="artifact to serve (default: the tiny model, compiled for llvm here)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--standard-seconds", type=int, default=60, help="guidellm's run; 0 skips it")
    p.add_argument("--guidellm", default="guidellm", help="the guidellm command (default: on PATH)")
    args = p.parse_args()
    print(f"CPU: {cpu_model()}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.artifact is None:
            args.artifact = tiny_artifact(Path(tmp))
        from dsv4c.artifact.directory import open_artifact

        vocab = open_artifact(args.artifact).config.vocab_size
        proc, host, port = start_server(args.artifact, args.clients)
        try:
            soak(args, proc, host, port, vocab)
            if args.standard_seconds > 0:
                standard_tool(args, args.artifact, host, port, vocab)
        finally:
            proc.send_signal(signal.SIGTERM)
            print(f"server exit status {proc.wait(120)}")


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return re.search(r"Model name:\s+(.*)", out)[1].strip()


def tiny_artifact(tmp: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serving import write_tokenizer  # the tests' word-level tokenizer and chat template

    subprocess.run([sys.executable, "-m", "dsv4c", "make-tiny", "--out", str(tmp / "model")], check=True,
                   stdout=subprocess.DEVNULL)
    write_tokenizer(tmp / "model")
    subprocess.run([sys.executable, "-m", "dsv4c", "compile", "--model", str(tmp / "model"), "--target", "llvm",
                    "-o", str(tmp / "art")], check=True, stdout=subprocess.DEVNULL)
    return tmp / "art"


if __name__ == "__main__":
    main()

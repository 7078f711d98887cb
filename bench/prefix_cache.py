"""Prefix caching on a multi-turn chat workload: the flash slice with and without the cache, in
the same run.

The workload: one shared system prompt (``--system-tokens``, default 2,048), ``--conversations``
conversations (default 8) of ``--turns`` turns (default 4). Every turn re-sends the whole
conversation: the system prompt, each earlier user message and the model's answer to it, then a
new user message (``--user-tokens`` random ids, default 64; random weights, so ids stand for
text and no tokenizer is needed). The model answers greedily with ``--answer-tokens`` tokens
(default 32). Requests run one at a time, in turn order across conversations (turn 1 of every
conversation, then turn 2 of every conversation, ...), so the cache holds every conversation at
once as it would for concurrent clients, while each time to first token (submit to the first
token's callback) is the prefill alone, not queueing behind other requests.

Two engines on the same artifact, the server's defaults (``max_requests`` 8, ``max_context``
4096, the default pool size), one with ``prefix_caching=False`` and one with it on, take every
request in alternation (the order flips each request, so that the shared machine's drift falls
on both); their answers must be identical (checked: the cache is exact). Printed: the mean TTFT of
turn 1 and of turns 2-4 for each, the ratio, per turn, and the hit ratio (prompt tokens found
cached / prompt tokens looked up, the engine's counters behind ``/metrics``), with the CPU model.

    python bench/prefix_cache.py [--artifact DIR | --workdir DIR] [--conversations 8] [--turns 4]
                                 [--system-tokens 2048] [--user-tokens 64] [--answer-tokens 32]
                                 [--cache-only]

``--cache-only`` runs the engine with the cache alone: the hit ratio and the cached TTFTs of a
workload whose uncached prefills (20-35 minutes for the default one on a shared 2-core VM) take too long.

Without ``--artifact`` it builds the flash slice (``bench/flash_slice.py``'s checkpoint and llvm
compile) in ``--workdir`` (default: a temporary directory), or reuses the one there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FLASH_SLICE_SCRIPT = Path(__file__).with_name("flash_slice.py")


@dataclass
class Configuration:
    name: str
    engine: object
    ttft: dict[int, list[float]] = field(default_factory=dict)  # turn -> seconds, one per conversation


def build_flash_slice(workdir: Path) -> Path:
    """The flash slice's llvm artifact in ``workdir``, made by flash_slice.py's own stages (each in
    a child process, as that script runs them) unless it is there already."""
    for stage, done in (("make", "fp8"), ("compile", "artifact")):
        if not (workdir / done).exists():
            subprocess.run([sys.executable, str(FLASH_SLICE_SCRIPT), "--stage", stage, "--workdir", str(workdir)],
                           check=True)
    return workdir / "artifact"


def serve(config: Configuration, turn: int, prompt: list[int], answer_tokens: int) -> list[int]:
    """Run one request alone on ``config``'s engine; record its time to first token."""
    from dsv4c.runtime.sampling import SamplingParams

    engine = config.engine
    firsts: list[float] = []
    start = time.perf_counter()
    rid = engine.submit(prompt, SamplingParams(max_new_tokens=answer_tokens),
                        on_token=lambda _rid, _token: firsts.append(time.perf_counter()))
    engine.run()
    config.ttft.setdefault(turn, []).append(firsts[0] - start)
    return engine.result(rid).tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, help="a flash-slice llvm artifact (default: build one in --workdir)")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--cache-only", action="store_true", help="run the engine with the cache alone (no ratio)")
    args = p.parse_args()
    if args.turns < 2 or args.conversations < 1:
        p.error("the workload needs at least one conversation of at least two turns")

    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams
    from dsv4c.targets import host_cpu, host_cpu_flags

    artifact = args.artifact or build_flash_slice(args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-prefix-")))
    configs = [] if args.cache_only else [Configuration("no cache", Engine(artifact, prefix_caching=False))]
    configs.append(Configuration("cache", Engine(artifact, prefix_caching=True)))
    vocab = configs[0].engine.config.vocab_size
    longest = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    if longest > configs[0].engine.max_context:
        p.error(f"the last turn's {longest} tokens exceed the engine's max_context {configs[0].engine.max_context}")
    # One short request each first, untimed: the first step pays one-off costs (TVM's thread
    # pool, first touches of the weights) that are no part of either configuration.
    warm_up = np.random.default_rng(1).integers(2, vocab, 16).tolist()
    for config in configs:
        config.engine.generate(warm_up, SamplingParams(max_new_tokens=2))
    cache = configs[-1].engine.prefix_cache
    queried_before, hit_before = cache.queried_tokens, cache.hit_tokens
    hits_by_turn: dict[int, list[int]] = {}  # turn -> [tokens found, tokens looked up]

    rng = np.random.default_rng(0)
    system = rng.integers(2, vocab, args.system_tokens).tolist()
    conversations = [list(system) for _ in range(args.conversations)]
    load_before = os.getloadavg()
    started = time.perf_counter()
    request = 0
    for turn in range(1, args.turns + 1):
        for c, conversation in enumerate(conversations):
            conversation += rng.integers(2, vocab, args.user_tokens).tolist()
            answers = {}
            found_before, looked_before = cache.hit_tokens, cache.queried_tokens
            for config in configs[::1 if request % 2 == 0 else -1]:
                answers[config.name] = serve(config, turn, conversation, args.answer_tokens)
            request += 1
            counts = hits_by_turn.setdefault(turn, [0, 0])
            counts[0] += cache.hit_tokens - found_before
            counts[1] += cache.queried_tokens - looked_before
            if answers.get("no cache", answers["cache"]) != answers["cache"]:
                sys.exit(f"error: conversation {c} turn {turn}: the answer with the cache differs from the one "
                         f"without ({answers['cache']} vs {answers['no cache']})")
            conversation += answers["cache"]
            print(f"turn {turn} conversation {c}: prompt {len(conversation) - args.answer_tokens} tokens, TTFT "
                  + ", ".join(f"{cf.name} {cf.ttft[turn][-1]:.2f} s" for cf in configs), file=sys.stderr, flush=True)
    wall = time.perf_counter() - started

    host = host_cpu_flags()
    print(f"prefix cache bench: flash slice ({artifact}) on {host.model if host else 'unknown CPU'} (LLVM {host_cpu()}), "
          f"{os.cpu_count()} cores, load average {load_before[0]:.1f} before / {os.getloadavg()[0]:.1f} after, "
          f"{wall / 60:.1f} min")
    print(f"workload: {args.system_tokens}-token shared system prompt, {args.conversations} conversations x "
          f"{args.turns} turns, {args.user_tokens}-token user messages, {args.answer_tokens}-token greedy answers, "
          "each turn re-sending the conversation; requests one at a time"
          + (", the cache alone" if args.cache_only else
             ", the two configurations alternating; answers identical with and without the cache"))
    print(f"{'turn':<8}{'prompt tokens':>15}" + "".join(f"{'TTFT ' + cf.name + ' s':>17}" for cf in configs)
          + ("" if args.cache_only else f"{'ratio':>8}") + f"{'hit ratio':>11}")
    for turn in range(1, args.turns + 1):
        means = [float(np.mean(cf.ttft[turn])) for cf in configs]
        found, looked = hits_by_turn[turn]
        print(f"{turn:<8}{looked / args.conversations:>15.0f}" + "".join(f"{m:>17.2f}" for m in means)
              + ("" if args.cache_only else f"{means[0] / means[1]:>7.1f}x") + f"{found / looked:>11.3f}")
    later = [float(np.mean([t for turn in range(2, args.turns + 1) for t in cf.ttft[turn]])) for cf in configs]
    print(f"mean TTFT turns 2-{args.turns}: " + ", ".join(f"{cf.name} {m:.2f} s" for cf, m in zip(configs, later))
          + ("" if args.cache_only else f": {later[0] / later[1]:.1f}x lower with the cache (target: at least 5x)"))
    found, looked = cache.hit_tokens - hit_before, cache.queried_tokens - queried_before
    print(f"hit ratio: {found} of {looked} prompt tokens found cached = {found / looked:.3f} (target: at least 0.9)")


if __name__ == "__main__":
    main()

"""Benchmark: DSpark block speculation against plain decoding and MTP on the flash slice.

Two artifacts of the flash slice (``flash_slice.py``: flash widths, 2 layers HCA + CSA, FP8 /
FP4 weights): one with V4-Flash-0731's DSpark drafter (3 stages of the slice's own layout,
block 5, Markov rank 256, tapping both slice layers) and ``mtp.py``'s with V4-Flash's MTP layer.
In one process, rounds interleaved so that drift hits every figure alike, at batch 1 and 8:

* kernel level: a plain decode step, verify steps with k = 1 .. 5 drafts per request, DSpark's
  drafting of k tokens (one ``dspark_draft`` call over the block, k ``dspark_markov`` calls) and
  MTP's (its first draft and a chained one), with the implied tokens/s against plain decoding
  at acceptance 0.5 / 0.7 / 0.9 (a round with k drafts yields 1 + a + ... + a^k tokens), beside
  the cost model's prediction by bytes (``token_cost.SpeculationCost``, ``inspect --cost``);
* end to end: the engine's greedy decode, plain, DSpark and MTP, with drafts forced right at
  those rates (the drafters' functions still run on every row; random weights would accept ~0).

    python bench/dspark.py [--context 1024] [--rounds 8] [--tokens 24] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dsv4c.runtime.drafter import Drafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_slice import FLASH_SLICE  # noqa: E402
from mtp import MTP_SLICE  # noqa: E402

DSPARK_SLICE = {**FLASH_SLICE, "num_nextn_predict_layers": 3, "compress_ratios": [128, 4, 0, 0, 0],
                "dspark_block_size": 5, "dspark_target_layer_ids": [0, 1], "dspark_markov_rank": 256,
                "dspark_noise_token_id": 31999}
SLICES = {"dspark": DSPARK_SLICE, "mtp": MTP_SLICE}
ACCEPTANCES = (0.5, 0.7, 0.9)
BATCHES = (1, 8)


def prepare(workdir: Path, stage: str, method: str) -> None:
    from dsv4c.frontend.config import config_from_dict

    if stage == "make":
        from dsv4c.frontend.checkpoint_writer import write_checkpoint
        from dsv4c.frontend.random_model import iter_random_weights

        cfg = config_from_dict(SLICES[method], f"flash-slice-{method}")
        write_checkpoint(cfg, iter_random_weights(cfg, 0), workdir / f"{method}-fp8")
    else:
        from dsv4c.compile import compile_model

        compile_model(str(workdir / f"{method}-fp8"), "llvm", workdir / f"{method}-artifact", progress=False)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure_kernels(workdir: Path, context: int, rounds: int) -> dict:
    """Median ms of each call, by batch: plain / verify<k> on both artifacts, DSpark drafting of k
    tokens, MTP's first and chained draft."""
    from dsv4c.runtime.engine import Engine

    engines = {m: Engine(workdir / f"{m}-artifact", max_step_tokens=2048, max_requests=max(BATCHES),
                         max_context=context + 16 * rounds + 64) for m in SLICES}
    rng = np.random.default_rng(0)
    position = {}
    for method, engine in engines.items():
        for rid in range(max(BATCHES)):
            engine.pool.admit(rid, context)
            engine.backend.step(rng.integers(0, 32000, context).astype(np.int32), np.arange(context, dtype=np.int32),
                                np.full(context, rid, np.int32), np.array([context - 1], np.int32))
            position[method, rid] = context
    times: dict[str, list[float]] = {}

    def step(method: str, batch: int, width: int) -> float:
        backend, pool = engines[method].backend, engines[method].pool
        positions, seqs = [], []
        for rid in range(batch):
            pool.ensure(rid, position[method, rid] + width)
            positions += range(position[method, rid], position[method, rid] + width)
            seqs += [rid] * width
            position[method, rid] += width
        n = len(positions)
        return _timed(lambda: backend.step(rng.integers(0, 32000, n).astype(np.int32), np.array(positions, np.int32),
                                           np.array(seqs, np.int32), np.arange(n, dtype=np.int32)))

    def dspark_drafting(batch: int, k: int) -> float:
        backend, b = engines["dspark"].backend, DSPARK_SLICE["dspark_block_size"]
        positions = [p for rid in range(batch) for p in range(position["dspark", rid], position["dspark", rid] + b)]

        def run():
            backend.dspark_draft(rng.integers(0, 32000, batch * b).astype(np.int32), np.array(positions, np.int32),
                                 np.repeat(np.arange(batch, dtype=np.int32), b))
            for i in range(k):
                backend.dspark_markov(rng.integers(0, 32000, batch).astype(np.int32),
                                      np.arange(batch, dtype=np.int32) * b + i)
        return _timed(run)

    def mtp_draft(batch: int, chain: bool) -> float:
        backend = engines["mtp"].backend
        at = np.array([position["mtp", rid] - 1 for rid in range(batch)], np.int32)
        rows = np.arange(batch, dtype=np.int32)
        return _timed(lambda: backend.draft(rng.integers(0, 32000, batch).astype(np.int32), at, rows, rows, rows,
                                            chain=chain))

    for _ in range(rounds):
        for batch in BATCHES:
            for method in SLICES:
                times.setdefault(f"{method}.plain.{batch}", []).append(step(method, batch, 1))
                for k in range(1, 6 if method == "dspark" else 3):
                    times.setdefault(f"{method}.verify{k}.{batch}", []).append(step(method, batch, k + 1))
            for k in range(1, 6):
                times.setdefault(f"dspark.draft{k}.{batch}", []).append(dspark_drafting(batch, k))
            times.setdefault(f"mtp.draft.{batch}", []).append(mtp_draft(batch, False))
            times.setdefault(f"mtp.chain.{batch}", []).append(mtp_draft(batch, True))
    return {k: float(np.median(v) * 1e3) for k, v in times.items()}


class Forced(Drafter):
    """A drafter whose drafts are the plain greedy run's next tokens with probability ``rate``
    each, else a wrong token, after the wrapped drafter computed its own (its cost is real)."""

    def __init__(self, inner, truth: dict[int, list[int]], rate: float, seed: int):
        self.inner, self.truth, self.rate = inner, truth, rate
        self.rng = np.random.default_rng(seed)
        self.prompt_tail, self.block_size = inner.prompt_tail, inner.block_size

    def propose(self, parts):
        drafts = self.inner.propose(parts)
        for part in parts:
            draft, r = drafts.get(part.request.rid), part.request
            if draft is None:
                continue
            sequence = self.truth[r.rid]
            for i in range(len(draft.tokens)):
                at = r.fed + 1 + i  # the anchor sits at r.fed
                right = sequence[at] if at < len(sequence) else 0
                draft.tokens[i] = right if self.rng.random() < self.rate else (right + 1) % 32000
        return drafts

    def verified(self, request, draft, accepted):
        self.inner.verified(request, draft, accepted)

    def release(self, rid):
        self.inner.release(rid)


def measure_engine(workdir: Path, tokens: int, drafts: dict) -> dict:
    """ms per generated token of greedy decoding (after the first token), by batch: plain and
    each method at each forced acceptance, with ``drafts[method, batch, acceptance]`` drafts a step."""
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 32000, 48)) for _ in range(max(BATCHES))]
    out = {}

    def decode(method, batch, spec, rate):
        engine = Engine(workdir / f"{method}-artifact", max_step_tokens=2048, max_context=256,
                        max_requests=batch, speculative=spec,
                        num_draft_tokens=drafts[method, batch, rate] if spec else None)
        if rate is not None:
            engine.speculation.drafter = Forced(engine.speculation.drafter, truth[method], rate, 7)
        stamps: list[float] = []
        rids = [engine.submit(p, SamplingParams(max_new_tokens=tokens),
                              on_token=lambda *_: stamps.append(time.perf_counter())) for p in prompts[:batch]]
        engine.run()
        result = [engine.result(r).tokens for r in rids]
        first = sorted(stamps)[batch - 1]  # every request has its first token
        return (stamps[-1] - first) * 1e3 / (batch * (tokens - 1)), result, engine

    truth = {}
    for batch in BATCHES:
        for method in SLICES:
            ms, plain_tokens, _ = decode(method, batch, None, None)
            out[f"{method}.plain.{batch}"] = ms
            truth[method] = {rid: prompts[rid] + t for rid, t in enumerate(plain_tokens)}
            for rate in ACCEPTANCES:
                ms, got, engine = decode(method, batch, method, rate)
                assert got == plain_tokens, f"{method} at {rate}: greedy speculation left plain greedy"
                out[f"{method}.{rate}.{batch}"] = ms
                out[f"{method}.{rate}.{batch}.per_step"] = engine.spec_stats.to_json()["tokens_per_step"]
    return out


def predicted(workdir: Path, context: int, batch: int):
    """The cost model's SpeculationCost of each slice at ``context`` and ``batch`` (llvm formats)."""
    from dsv4c.artifact.directory import open_artifact
    from dsv4c.frontend.trace import trace
    from dsv4c.ir.cost import Decode
    from dsv4c.passes.pipeline import run_pipeline
    from dsv4c.token_cost import speculation_cost

    out = {}
    for method in SLICES:
        a = open_artifact(workdir / f"{method}-artifact")
        g = a.geometry
        program = run_pipeline(trace(a.config))
        out[method] = speculation_cost(program, a.config, Decode(batch, context, g.main_row_bytes, g.index_row_bytes,
                                                                 g.fp8_format))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24, help="tokens each request generates end to end")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--stage", choices=["make", "compile"], help=argparse.SUPPRESS)
    p.add_argument("--method", choices=sorted(SLICES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        prepare(args.workdir, args.stage, args.method)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-dspark-bench-"))
    for method in SLICES:
        for stage, done in (("make", "fp8"), ("compile", "artifact")):
            if not (workdir / f"{method}-{done}").exists():  # one child per stage: no process holds two copies
                subprocess.run([sys.executable, __file__, "--stage", stage, "--method", method, "--workdir",
                                str(workdir)], check=True)
    from dsv4c.targets import host_cpu, host_cpu_flags

    host = host_cpu_flags()
    print(f"flash slice + DSpark (3 stages, block 5) / + MTP, context {args.context}, {os.cpu_count()} threads, "
          f"CPU: {host.model if host else 'unknown'} (LLVM {host_cpu()})")
    r = measure_kernels(workdir, args.context, args.rounds)
    drafts = {}
    for batch in BATCHES:
        cost = predicted(workdir, args.context, batch)
        print(f"batch {batch}: kernel level, ms (x a plain step of the same artifact; predicted by bytes)")
        for method in SLICES:
            plain = r[f"{method}.plain.{batch}"]
            s = cost[method]
            rounds = {}
            for k in s.rounds:
                verify = r[f"{method}.verify{k}.{batch}"]
                draft = (r[f"dspark.draft{k}.{batch}"] if method == "dspark" else
                         r[f"mtp.draft.{batch}"] + (k - 1) * r[f"mtp.chain.{batch}"])
                rounds[k] = verify + draft
                pv, pd = (x / s.plain for x in s.rounds[k])
                print(f"  {method} {k} draft(s): verify {verify:.1f} ms ({verify / plain:.2f}x; {pv:.2f}x), drafting "
                      f"{draft:.1f} ms ({draft / plain:.2f}x; {pd:.2f}x)")
            for a in ACCEPTANCES:
                implied = {k: sum(a ** i for i in range(k + 1)) * plain / ms for k, ms in rounds.items()}
                best = max(implied, key=implied.get)
                drafts[method, batch, a] = best
                print(f"  {method} at acceptance {a}: implied {implied[best]:.2f}x with {best} draft(s) "
                      f"(predicted {s.speedup(best, a):.2f}x); plain step {plain:.1f} ms")
    e = measure_engine(workdir, args.tokens, drafts)
    for batch in BATCHES:
        print(f"batch {batch}, engine end to end, greedy (== plain asserted), the best draft count above:")
        for method in SLICES:
            plain = e[f"{method}.plain.{batch}"]
            print(f"  {method}: plain {plain:.1f} ms/token; " + ", ".join(
                f"a={a}: {plain / e[f'{method}.{a}.{batch}']:.2f}x ({drafts[method, batch, a]} drafts, "
                f"{e[f'{method}.{a}.{batch}.per_step']} tokens a verify step)" for a in ACCEPTANCES))


if __name__ == "__main__":
    main()

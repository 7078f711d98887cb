"""Benchmark: what MTP speculative decoding costs and buys on the flash slice with an MTP layer.

The flash slice of ``flash_slice.py`` (flash widths, 2 layers: HCA + CSA, FP8 / FP4 weights)
plus V4-Flash's MTP layer (sliding window, its own routed experts). In one process, rounds
interleaved so that drift hits every figure alike, at a given context:

* a plain decode step (1 token), a verify step with 1 and with 2 drafts (2 and 3 tokens);
* the MTP draft: the first draft (MTP layer over the kept positions, here 1) and a chained one;
* the rollback bookkeeping of a rejected draft (save + restore of its pool rows);

then the implied decode tokens/s at acceptance 0.5, 0.8 and 1.0 relative to plain decode
(a verify round yields 1 + a tokens with one draft, 1 + a + a^2 with two). Random weights make
the real acceptance ~0, so the engine end to end (last line) shows the cost at acceptance 0.
A 2-layer slice has 2 of V4-Flash's 43 layers but all of its head, so the MTP layer (a block
and the shared head) is a far larger share of a slice step than of a real one: the bench also
prints the draft's share at V4-Flash depth projected from weight bytes (decode is
bandwidth-bound).

    python bench/mtp.py [--context 2048] [--rounds 12] [--workdir DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_slice import FLASH_SLICE, decode_weight_bytes  # noqa: E402

MTP_SLICE = {**FLASH_SLICE, "num_nextn_predict_layers": 1, "compress_ratios": [128, 4, 0]}
FLASH_LAYERS = 43


def prepare(workdir: Path, stage: str) -> None:
    from dsv4c.frontend.checkpoint_writer import write_checkpoint
    from dsv4c.frontend.random_model import iter_random_weights
    from dsv4c.frontend.config import config_from_dict

    if stage == "make":
        cfg = config_from_dict(MTP_SLICE, "flash-slice-mtp")
        write_checkpoint(cfg, iter_random_weights(cfg, 0), workdir / "fp8")
    else:
        from dsv4c.compile import compile_model

        compile_model(str(workdir / "fp8"), "llvm", workdir / "artifact", progress=False)


def measure(workdir: Path, context: int, rounds: int) -> dict:
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    artifact = workdir / "artifact"
    engine = Engine(artifact, max_step_tokens=2048, max_context=context + 8 * rounds + 64, max_requests=1)
    backend, pool = engine.backend, engine.pool
    rng = np.random.default_rng(0)
    pool.admit(0, context)
    for start in range(0, context, 2048):
        n = min(2048, context - start)
        backend.step(rng.integers(0, 32000, n).astype(np.int32), np.arange(start, start + n, dtype=np.int32),
                     np.zeros(n, np.int32), np.array([n - 1], np.int32))
    position = context
    times: dict[str, list[float]] = {k: [] for k in ("plain", "verify2", "verify3", "draft", "chain", "rollback")}

    def step(n: int) -> float:
        nonlocal position
        pool.ensure(0, position + n)
        toks = rng.integers(0, 32000, n).astype(np.int32)
        t = time.perf_counter()
        backend.step(toks, np.arange(position, position + n, dtype=np.int32), np.zeros(n, np.int32),
                     np.arange(n, dtype=np.int32))
        position += n
        return time.perf_counter() - t

    for _ in range(rounds):
        times["plain"].append(step(1))
        times["verify3"].append(step(3))
        times["verify2"].append(step(2))
        # The first draft after a verify step whose draft was rejected: the MTP layer at the
        # one kept position (from the step's streams), then one chained on its own streams.
        t = time.perf_counter()
        backend.draft(np.array([7], np.int32), np.array([position - 2], np.int32), np.zeros(1, np.int32),
                      np.array([0], np.int32), np.array([0], np.int32))
        times["draft"].append(time.perf_counter() - t)
        t = time.perf_counter()
        backend.draft(np.array([9], np.int32), np.array([position - 1], np.int32), np.zeros(1, np.int32),
                      np.array([0], np.int32), np.array([0], np.int32), chain=True)
        times["chain"].append(time.perf_counter() - t)
        t = time.perf_counter()
        pool.restore(pool.save(pool.position_state(0, [position - 1])))
        times["rollback"].append(time.perf_counter() - t)
    out = {k: float(np.median(v) * 1e3) for k, v in times.items()}
    # End to end at the acceptance random weights give (~0): the engine's decode, plain vs
    # speculative, from the first generated token to the last (the prompt's prefill excluded).
    prompt = list(rng.integers(0, 32000, 64))
    for label, spec in (("engine_plain", None), ("engine_mtp", "mtp")):
        e = Engine(artifact, max_step_tokens=2048, max_context=512, max_requests=1, speculative=spec)
        stamps: list[float] = []
        e.generate(prompt, SamplingParams(max_new_tokens=rounds + 1), on_token=lambda *_: stamps.append(
            time.perf_counter()))
        out[label] = (stamps[-1] - stamps[0]) * 1e3 / rounds
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--stage", choices=["make", "compile"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        prepare(args.workdir, args.stage)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-mtp-bench-"))
    for stage, done in (("make", "fp8"), ("compile", "artifact")):
        if not (workdir / done).exists():  # one child per stage: no process holds two copies
            subprocess.run([sys.executable, __file__, "--stage", stage, "--workdir", str(workdir)], check=True)
    r = measure(workdir, args.context, args.rounds)
    plain = r["plain"]
    from dsv4c.targets import host_cpu, host_cpu_flags

    host = host_cpu_flags()
    print(f"flash slice + MTP layer, context {args.context}, {os.cpu_count()} threads, CPU: "
          f"{host.model if host else 'unknown'} (LLVM {host_cpu()})")
    print(f"plain step {plain:.1f} ms | verify step: 2 tokens {r['verify2']:.1f} ms ({r['verify2'] / plain:.2f}x), "
          f"3 tokens {r['verify3']:.1f} ms ({r['verify3'] / plain:.2f}x)")
    print(f"MTP draft {r['draft']:.1f} ms ({r['draft'] / plain:.2f} of a step), chained draft {r['chain']:.1f} ms, "
          f"rollback of one position {r['rollback']:.2f} ms")
    b = decode_weight_bytes(workdir / "artifact")
    slice_step, layer = b["total"], (b["dense"] + b["routed_experts"]) / MTP_SLICE["num_hidden_layers"]
    flash_step = FLASH_LAYERS * layer + b["head"]
    draft_bytes = b["mtp"] + b["head"]
    print(f"weight bytes per token: slice step {slice_step / 1e6:.0f} MB, MTP draft {draft_bytes / 1e6:.0f} MB "
          f"({draft_bytes / slice_step:.2f} of the slice step; {draft_bytes / flash_step:.3f} of a V4-Flash step "
          f"of {FLASH_LAYERS} such layers, {flash_step / 1e9:.2f} GB, projected by bytes)")
    draft_share_flash = draft_bytes / flash_step
    # A second token of a verify step brings its own routed experts: at batch 1 a 2-token
    # step reads the dense weights once but on average k + k (E - k) / E experts' weights.
    k = MTP_SLICE["num_experts_per_tok"]
    floors = []
    for experts, step_bytes, layers_bytes in ((MTP_SLICE["n_routed_experts"], slice_step, b["routed_experts"]),
                                              (256, flash_step, FLASH_LAYERS * b["routed_experts"] /
                                               MTP_SLICE["num_hidden_layers"])):
        more = (experts - k) / experts  # expected share of the second token's experts the first lacks
        floors.append((step_bytes + layers_bytes * more) / step_bytes)
    print(f"a 2-token verify step's floor by weight bytes (its experts): {floors[0]:.2f}x a step on the slice "
          f"(16 experts), {floors[1]:.2f}x at V4-Flash depth (256 experts)")
    for k, verify, drafts in ((1, r["verify2"], r["draft"]), (2, r["verify3"], r["draft"] + r["chain"])):
        rounds_ms = verify + drafts + r["rollback"]
        line = []
        for a in (0.5, 0.8, 1.0):
            tokens = sum(a ** i for i in range(k + 1))
            line.append(f"a={a}: {tokens * plain / rounds_ms:.2f}x")
        # At V4-Flash depth: the step grows with the layers, the draft does not.
        flash_plain = plain * flash_step / slice_step
        flash_round = verify * flash_step / slice_step + draft_share_flash * flash_plain * k + r["rollback"]
        projected = [f"{sum(a ** i for i in range(k + 1)) * flash_plain / flash_round:.2f}x" for a in (0.5, 0.8, 1.0)]
        print(f"{k} draft(s): implied tokens/s vs plain on the slice {', '.join(line)}; "
              f"at V4-Flash depth (projected) {', '.join(projected)}")
    print(f"engine end to end at the random weights' acceptance (~0): plain {r['engine_plain']:.1f} ms/token, "
          f"speculative {r['engine_mtp']:.1f} ms/token ({r['engine_plain'] / r['engine_mtp']:.2f}x)")


if __name__ == "__main__":
    main()

"""Benchmark: the accuracy budget of the bf16 numerics against exact, measured.

One release-stored checkpoint (FP8 dense weights, FP4 experts where the widths take groups of
32, else FP8; BF16 head; random weights) is
compiled twice for this CPU, ``--numerics exact`` and ``--numerics bf16``; both artifacts
prefill the same random prompts, in chunks of ``--chunk`` tokens (prefill steps: the GEMMs,
where the two differ), keeping every position's logits. Reported: the largest |logit
difference| (and relative to the largest |logit|), the share of positions whose top-1 token
agrees, and the mean KL divergence KL(exact || bf16) of the next-token distributions, over
all positions. Models: ``tiny`` and the parity configs (``tests/parity_configs.py``, stored as
the release stores V4); ``--pair NAME EXACT BF16`` compares two artifacts compiled already,
such as the flash slice's that ``bench/bf16_prefill.py`` leaves in its workdir (its random
checkpoint takes more memory to write than a small machine has to spare beside it).

    python bench/numerics_budget.py [--models tiny mixed_hc4 official_hc2 odd_ratios_hc2]
                                    [--pair flash-slice DIR/exact DIR/bf16]
                                    [--prompts 8] [--length 512] [--chunk 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the parity configs


def model_config(name: str):
    """The release-stored config of ``name``: a preset or a parity config."""
    from dsv4c.frontend.config import config_from_dict, preset, with_weights

    if name == "tiny":
        cfg = preset("tiny")
    else:
        from parity_configs import PARITY_CONFIGS

        cfg = config_from_dict(PARITY_CONFIGS[name], name)
    # FP4 groups are 32 inputs: a parity config narrower than that keeps FP8 experts.
    fp4 = cfg.hidden_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0
    return with_weights(cfg, dense="fp8", experts="fp4" if fp4 else "fp8")


def all_logits(artifact: Path, prompts: np.ndarray, chunk: int) -> np.ndarray:
    """Every position's logits [prompts, length, vocab] of each prompt prefilled in chunks."""
    from dsv4c.runtime.engine import Engine

    n, length = prompts.shape
    engine = Engine(artifact, max_step_tokens=chunk, max_context=length + 16, max_requests=1)
    out = []
    for p in range(n):
        engine.pool.admit(p)
        rows = []
        for start in range(0, length, chunk):
            tokens = prompts[p, start:start + chunk]
            engine.pool.ensure(p, start + len(tokens))
            rows.append(engine.backend.step(tokens.astype(np.int32), np.arange(start, start + len(tokens), dtype=np.int32),
                                            np.full(len(tokens), p, np.int32)))
        engine.pool.free(p)
        out.append(np.concatenate(rows))
    return np.stack(out)


def budget(exact: np.ndarray, bf16: np.ndarray) -> dict:
    """max |delta logit| (absolute, and relative to max |logit|), top-1 agreement, mean KL(exact || bf16)."""
    e, b = exact.reshape(-1, exact.shape[-1]).astype(np.float64), bf16.reshape(-1, bf16.shape[-1]).astype(np.float64)
    delta = np.abs(e - b).max()
    log_p = e - e.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    log_q = b - b.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    return {"positions": len(e), "max_abs_delta_logit": float(delta), "max_rel_delta_logit": float(delta / np.abs(e).max()),
            "top1_agreement": float((e.argmax(-1) == b.argmax(-1)).mean()), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["tiny", "mixed_hc4", "official_hc2", "odd_ratios_hc2"])
    p.add_argument("--pair", nargs=3, metavar=("NAME", "EXACT", "BF16"), help="also compare these two artifacts")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from dsv4c.compile import compile_model
    from dsv4c.frontend.checkpoint_writer import write_checkpoint
    from dsv4c.frontend.random_model import random_weights

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from matmul import cpu_model

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-numerics-"))
    print(f"CPU: {cpu_model()}")
    print(f"{'model':<16}{'positions':>10}{'max|dlogit|':>13}{'rel':>10}{'top-1':>9}{'mean KL':>11}{'max KL':>11}")
    report = {}

    def row(name, exact, bf16, vocab):
        prompts = np.random.default_rng(1).integers(0, vocab, (args.prompts, args.length))
        r = report[name] = budget(all_logits(exact, prompts, args.chunk), all_logits(bf16, prompts, args.chunk))
        print(f"{name:<16}{r['positions']:>10}{r['max_abs_delta_logit']:>13.2e}{r['max_rel_delta_logit']:>10.2e}"
              f"{r['top1_agreement']:>9.4f}{r['mean_kl']:>11.2e}{r['max_kl']:>11.2e}", flush=True)

    for name in args.models:
        cfg = model_config(name)
        ckpt = workdir / name / "model"
        if not ckpt.exists():
            write_checkpoint(cfg, random_weights(cfg, 0), ckpt)
        for numerics in ("exact", "bf16"):
            if not (workdir / name / numerics).exists():
                compile_model(str(ckpt), "llvm", workdir / name / numerics, numerics=numerics, progress=False,
                              log=lambda *_: None)
        row(name, workdir / name / "exact", workdir / name / "bf16", cfg.vocab_size)
    if args.pair:
        from dsv4c.artifact.manifest import read_manifest

        name, exact, bf16 = args.pair
        row(name, Path(exact), Path(bf16), read_manifest(Path(exact)).model["vocab_size"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Device check for the sm90 target (run by `scripts/device_check` on a machine with an H200).

1. Builds the sm90 artifacts of the tiny model and of the flash slice (bench/flash_slice.py's
   config with random FP8 / FP4 weights) and checks that each holds sm_90a device code.
2. When a CUDA GPU of that architecture is present: runs both artifacts on the GPU through the
   engine and compares their logits and greedy tokens with the reference backend (the IR
   interpreter in numpy) on a KV pool of the same format (FP8 rows), then prints prefill and
   decode timings of the GPU artifact.

Without such a GPU it says so and stops after step 1. Budget: under 8 minutes on an H200 host.

    scripts/device_check [--prompt-tokens 256] [--decode-steps 16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

PARITY_BOUND = 1e-3  # fp32 kernels on both sides; only summation order differs


def _compile(model: str, target: str, out: Path) -> float:
    from dsv4c.codegen.compile import compile_model

    start = time.perf_counter()
    compile_model(model, target, out, progress=False, log=lambda *_: None)
    return time.perf_counter() - start


def build(work: Path) -> dict[str, Path]:
    """The checkpoints and the sm90 + reference artifacts of both models."""
    from flash_slice import FLASH_SLICE

    from dsv4c.frontend.checkpoint import random_weights, write_checkpoint
    from dsv4c.frontend.config import config_from_dict, preset

    start = time.perf_counter()
    write_checkpoint(preset("tiny"), random_weights(preset("tiny"), 0), work / "tiny")
    flash = config_from_dict(FLASH_SLICE, "flash-slice")
    write_checkpoint(flash, random_weights(flash, 0), work / "flash-slice")
    print(f"checkpoints written in {time.perf_counter() - start:.1f} s")
    models = {}
    for label in ("tiny", "flash-slice"):
        seconds = _compile(str(work / label), "sm90", work / f"{label}-sm90")
        blob = (work / f"{label}-sm90" / "kernels.so").read_bytes()
        print(f"{label}: sm90 artifact in {seconds:.1f} s; holds sm_90a code: {b'sm_90a' in blob}")
        models[label] = work / label
    return models


def _greedy(artifact: Path, prompt: list[int], steps: int):
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    engine = Engine(artifact, max_step_tokens=len(prompt), max_requests=1, max_context=len(prompt) + steps + 1)
    return engine.generate(prompt, SamplingParams(max_new_tokens=steps), record_logits=True)


def parity(work: Path, label: str, steps: int) -> None:
    """GPU artifact vs the reference backend on the same FP8 pool format, same prompt."""
    manifest = json.loads((work / f"{label}-sm90" / "manifest.json").read_text())
    vocab = manifest["model"]["vocab_size"]
    prompt = np.random.default_rng(1).integers(0, vocab, 40).tolist()
    reference = work / f"{label}-reference"
    from dsv4c.codegen.compile import compile_model

    # The reference artifact stores the same weights as fp32 and runs an FP8 pool like sm90's.
    compile_model(str(work / label), "reference", reference, progress=False, log=lambda *_: None,
                  kv_cache_dtype="fp8")
    gpu = _greedy(work / f"{label}-sm90", prompt, steps)
    ref = _greedy(reference, prompt, steps)
    shutil.rmtree(reference)
    err = float(np.abs(gpu.logits - ref.logits).max())
    scale = float(np.abs(ref.logits).max())
    same = gpu.tokens == ref.tokens
    verdict = "PASS" if err <= PARITY_BOUND * max(1.0, scale) and same else "FAIL"
    print(f"{label}: prompt 40 + {steps} greedy tokens: max |gpu - reference| logit = {err:.2e} "
          f"(max |logit| {scale:.1f}), same tokens: {same}  -> {verdict}")
    return verdict == "PASS"


def timings(work: Path, label: str, prompt_tokens: int, steps: int) -> None:
    from dsv4c.runtime.engine import Engine

    engine = Engine(work / f"{label}-sm90", max_step_tokens=prompt_tokens, max_requests=1,
                    max_context=prompt_tokens + steps + 1)
    backend, pool = engine.backend, engine.pool
    tokens = np.random.default_rng(2).integers(0, engine.config.vocab_size, prompt_tokens).astype(np.int32)

    def forward(seq: int, start: int, toks: np.ndarray) -> None:
        pool.ensure(seq, start + len(toks))
        backend.step(toks, np.arange(start, start + len(toks), dtype=np.int32), np.full(len(toks), seq, np.int32))

    pool.admit(0)
    forward(0, 0, tokens[:16])  # warm-up: loads every kernel once
    pool.free(0)
    pool.admit(1)
    start = time.perf_counter()
    forward(1, 0, tokens)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(steps):
        forward(1, prompt_tokens + i, tokens[i:i + 1])
    decode = (time.perf_counter() - start) / steps
    print(f"{label}: prefill {prompt_tokens} tokens {prefill:.3f} s ({prompt_tokens / prefill:,.0f} tok/s); "
          f"decode at {prompt_tokens} context {decode * 1e3:.2f} ms/token")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--keep", help="build in this directory and keep it")
    args = parser.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dsv4c-device-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        build(work)
        from dsv4c.runtime.engine import gpu_device

        device = gpu_device("sm90")
        if device is None:
            print("no sm_90 CUDA GPU on this machine: built and checked the artifacts only")
            return 0
        print(f"GPU: {device.device_name}")
        ok = all([parity(work, label, 8) for label in ("tiny", "flash-slice")])
        for label in ("tiny", "flash-slice"):
            timings(work, label, args.prompt_tokens, args.decode_steps)
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

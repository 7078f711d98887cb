"""Benchmark: what a step costs beyond its arithmetic. A V4-Pro-shaped model at tiny widths
(61 layers: HCA, HCA, then CSA / HCA alternating; 384 experts, top-6, 3 hash layers; hidden
64, vocab 1024), where the arithmetic is nothing and a step is dispatch: kernel launches,
host work and round trips. Decode steps at batch 1 and batch 8 after a short prompt each,
dsv4c's compiled step against transformers eager fp32 on the same config and weights, both
in this run; it prints the CPU model and ratios (these machines are noisy).

    python bench/dispatch.py [--prompt 32] [--steps 12] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def pro_shaped() -> dict:
    """The official V4-Pro config.json with its widths shrunk and its structure kept."""
    raw = json.loads((REPO / "tests" / "data" / "reference_configs" / "v4-pro.config.json").read_text())
    raw.update({
        "vocab_size": 1024, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32, "moe_intermediate_size": 32,
        "index_n_heads": 4, "index_head_dim": 32, "num_nextn_predict_layers": 0, "torch_dtype": "float32",
        "compress_ratios": raw["compress_ratios"][:raw["num_hidden_layers"]],
    })
    for key in ("quantization_config", "expert_dtype"):
        raw.pop(key, None)
    return raw


def prepare(workdir: Path) -> None:
    from dsv4c.compile import compile_model
    from dsv4c.frontend.config import config_from_dict
    from reference_harness import fp32_checkpoint

    cfg = config_from_dict(pro_shaped(), "pro-shaped")
    assert cfg.num_layers == 61 and cfg.n_routed_experts == 384 and cfg.n_experts_per_tok == 6
    if not (workdir / "model").exists():
        fp32_checkpoint(cfg, workdir / "model")
    start = time.perf_counter()
    compile_model(str(workdir / "model"), "llvm", workdir / "artifact", progress=False)
    print(f"compile: {time.perf_counter() - start:.1f} s", file=sys.stderr)


def run_system(system: str, workdir: Path, batch: int, prompt: int, steps: int) -> float:
    """Median wall time of a decode step (every request decodes one token) in ms."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, 1024, (batch, prompt))
    times = []
    if system == "dsv4c":
        from dsv4c.runtime.engine import Engine
        from dsv4c.runtime.sampling import SamplingParams

        engine = Engine(workdir / "artifact", max_requests=batch, max_context=prompt + steps + 8)
        for p in prompts:
            engine.submit(p.tolist(), SamplingParams(max_new_tokens=steps + 2))
        engine.step()  # every prompt in one prefill step; each request has its first token
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    else:
        import torch
        from transformers import DeepseekV4ForCausalLM, DynamicCache

        model = DeepseekV4ForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32).eval()
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            logits = model(torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            for _ in range(steps):
                start = time.perf_counter()
                ids = logits[:, -1].argmax(-1, keepdim=True)
                logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--workdir", type=Path)
    p.add_argument("--system", choices=["dsv4c", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    if args.system:  # child process: one system, one batch size
        print(json.dumps(run_system(args.system, args.workdir, args.batch, args.prompt, args.steps)))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-dispatch-"))
    if not (workdir / "artifact").exists():
        prepare(workdir)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TVM_NUM_THREADS": str(args.threads)}
    ms = {}
    for system in ("dsv4c", "transformers"):
        for batch in (1, 8):
            cmd = [sys.executable, __file__, "--system", system, "--batch", str(batch), "--workdir", str(workdir),
                   "--prompt", str(args.prompt), "--steps", str(args.steps)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            ms[system, batch] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"Pro-shaped tiny-width model, decode step after a {args.prompt}-token prompt, {args.threads} threads, "
          f"{cpu_model()}")
    print(f"{'batch':<8}{'dsv4c ms':>10}{'transformers ms':>17}{'speed-up':>10}")
    for batch in (1, 8):
        ours, ref = ms["dsv4c", batch], ms["transformers", batch]
        print(f"{batch:<8}{ours:>10.2f}{ref:>17.2f}{ref / ours:>9.1f}x")
    print(f"dsv4c batch-8 step / batch-1 step: {ms['dsv4c', 8] / ms['dsv4c', 1]:.2f}")


if __name__ == "__main__":
    main()

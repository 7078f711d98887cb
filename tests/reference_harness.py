"""Shared machinery of the parity tests: build a checkpoint, run it through transformers'
DeepseekV4ForCausalLM and through our reference interpreter with the same chunking."""

from __future__ import annotations

import numpy as np

from dsv4c.frontend.checkpoint import load_weights
from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.random_model import random_weights
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.frontend.config import with_weights
from dsv4c.frontend.trace import trace
from dsv4c.ir.interpreter import Interpreter
from dense_cache import DenseCache


def fp32_checkpoint(cfg: ModelConfig, out_dir, seed: int = 0) -> ModelConfig:
    """Write an official-name fp32 checkpoint of random weights; return its config."""
    cfg = with_weights(cfg, dense="fp32", experts="fp32")
    write_checkpoint(cfg, random_weights(cfg, seed), out_dir)
    return cfg


class TieGuard:
    """Hook on index_topk: records, for every query with more visible entries than k, the gap
    between the k-th and (k+1)-th best score relative to the score scale. transformers breaks
    ties by torch.topk order, so a parity check is only meaningful on tie-free selections."""

    def __init__(self):
        self.min_gap = np.inf
        self.checked = 0

    def __call__(self, node, args, result):
        if node.op != "index_topk":
            return
        scores, k = args[0], node.attrs["k"]
        for row in scores:
            finite = np.sort(row[np.isfinite(row)])[::-1]
            if len(finite) > k:
                scale = max(float(np.abs(finite).max()), 1e-30)
                self.min_gap = min(self.min_gap, float(finite[k - 1] - finite[k]) / scale)
                self.checked += 1


def run_ours(cfg: ModelConfig, ckpt_dir, tokens: np.ndarray, chunks: list[int], numerics: str = "exact",
             hook=None) -> np.ndarray:
    """Logits of every position of one request, fed in the given chunk sizes."""
    program = trace(cfg, numerics)
    weights = load_weights(cfg, ckpt_dir)
    interp = Interpreter(program, weights, DenseCache(cfg), hook=hook)
    out, start = [], 0
    for c in chunks:
        pos = np.arange(start, start + c)
        logits, _ = interp.run("step", tokens=tokens[start:start + c], positions=pos, seq_ids=np.zeros(c))
        out.append(logits)
        start += c
    return np.concatenate(out)


def run_hf(ckpt_dir, tokens: np.ndarray, chunks: list[int] | None) -> np.ndarray:
    """transformers logits; ``chunks=None`` is one uncached forward over the whole sequence."""
    import torch
    from transformers import DeepseekV4ForCausalLM, DynamicCache

    model = DeepseekV4ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        if chunks is None:
            return model(torch.tensor(tokens[None]), use_cache=False).logits[0].numpy()
        cache = DynamicCache(config=model.config)
        out, start = [], 0
        for c in chunks:
            ids = torch.tensor(tokens[None, start:start + c])
            out.append(model(ids, past_key_values=cache, use_cache=True).logits[0].numpy())
            start += c
        return np.concatenate(out)

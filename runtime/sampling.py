"""Token sampling: greedy, temperature and nucleus (top-p), reproducible per request seed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dsv4c.errors import UsageError


# Temperatures below this sample greedily: dividing logits by a tiny (or subnormal) temperature
# overflows to inf, and the softmax of those is NaN (vLLM draws the same line).
GREEDY_TEMPERATURE = 1e-5
# The most alternatives a request may ask for per position (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


class LogitsProcessor(Protocol):
    """A request's own rule on which tokens may come next (constrained decoding): ``mask`` the
    logits of each step before sampling, then ``accept`` the token taken."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # below GREEDY_TEMPERATURE (0 included) means greedy
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # None: no log-probabilities; k: each generated (prompt) token's log-probability and the k most
    # likely tokens at its position, under the model's distribution (before temperature and top_p).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logits_processor: LogitsProcessor | None = field(default=None, compare=False)  # stateful: one per request

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise UsageError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UsageError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise UsageError(f"{name} must be in [0, {MAX_LOGPROBS}] (or None), got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability at its position, and the ``top`` most likely tokens there
    (id, log-probability), most likely first (the lower id first among equals)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s entry under log-softmax(``logits``), in float64."""
    z = logits.astype(np.float64)
    z -= z.max()
    logp = z - np.log(np.exp(z).sum())
    best = np.argpartition(-logp, top - 1)[:top] if top else np.empty(0, np.int64)
    best = sorted(best.tolist(), key=lambda t: (-logp[t], t))
    return TokenLogprob(int(token), float(logp[token]), tuple((t, float(logp[t])) for t in best))


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        processor = self.params.logits_processor
        if processor is not None:
            logits = processor.mask(logits)
        # Greedy: the lowest id wins ties.
        token = int(np.argmax(logits)) if self.params.greedy else self.draw(self.probs(logits))
        if processor is not None:
            processor.accept(token)
        return token

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a non-greedy request samples from: softmax at the temperature,
        restricted to the nucleus when top_p < 1 (float64)."""
        p = self.params
        z = logits.astype(np.float64) / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if p.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, p.top_p)) + 1]  # smallest set reaching top_p
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return probs

    def draw(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(len(probs), p=probs))

    def uniform(self) -> float:
        return float(self.rng.random())

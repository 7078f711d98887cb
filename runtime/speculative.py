"""Speculative decoding with the model's MTP layer: drafting and acceptance.

A decode step of a speculating request feeds its last token and its pending drafts
``d_1..d_k``; the backbone's logits at those k + 1 rows verify the drafts left to right
(:func:`accept`). The MTP layer then drafts again from the streams of the accepted positions
(``Engine``). The output distribution is exactly the non-speculative one:

* greedy: a draft is accepted iff it is the backbone's argmax; the first rejected draft is
  replaced by that argmax, so the tokens are plain greedy's, token for token;
* sampling: the draft was drawn from the MTP layer's own distribution ``q`` (same temperature
  and top-p), and is accepted with probability ``min(1, p(d) / q(d))`` under the backbone's
  ``p``; a rejection draws from ``max(p - q, 0)`` normalised (standard speculative
  sampling: Leviathan et al. 2023, Chen et al. 2023). After k acceptances a bonus token
  comes from the last row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dsv4c.runtime.sampling import Sampler

METHODS = ("mtp",)


@dataclass
class Draft:
    """A request's pending drafts and, when it samples, the distribution each was drawn from."""
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)


@dataclass
class SpecStats:
    steps: int = 0  # verify steps that carried drafts
    drafted: int = 0
    accepted: int = 0

    def add(self, other: "SpecStats") -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted

    def to_json(self) -> dict:
        return {"verify_steps": self.steps, "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                # tokens a verify step produces: its accepted drafts and the one the backbone adds
                "tokens_per_step": round((self.accepted + self.steps) / self.steps, 4) if self.steps else None}


def propose(sampler: Sampler, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
    """A draft from the MTP layer's logits: its argmax (greedy) or a sample of its distribution,
    which acceptance needs again."""
    if sampler.params.greedy:
        return int(np.argmax(logits)), None
    q = sampler.probs(logits)
    return sampler.draw(q), q


def accept(sampler: Sampler, logits: np.ndarray, draft: Draft) -> tuple[list[int], int]:
    """(the tokens this verify step yields, how many drafts were accepted) from the backbone's
    logits at the request's k + 1 rows."""
    out = []
    for i, d in enumerate(draft.tokens):
        if sampler.params.greedy:
            target = int(np.argmax(logits[i]))
            if target != d:
                return out + [target], i
        else:
            p, q = sampler.probs(logits[i]), draft.probs[i]
            if sampler.uniform() * q[d] >= p[d]:  # rejected: u >= p(d) / q(d)
                residual = np.maximum(p - q, 0.0)
                return out + [sampler.draw(residual / residual.sum())], i
        out.append(d)
    return out + [sampler(logits[len(draft.tokens)])], len(draft.tokens)

"""What speculative decoding asks of a drafter: draft tokens per request, from what the target
step returned.

After every target step the engine's speculative loop (``runtime.speculative``) hands the
drafter each running request's part of the step (:class:`StepPart`) and takes back a
:class:`Draft` for each request that decodes next; the next step feeds those drafts after the
request's last token and verifies them. Verification, rejection sampling, putting back the
pool rows of rejected drafts and the acceptance statistics are the loop's, the same for every
drafter. A drafter may propose its tokens one at a time (the MTP layer chains on its own
output) or as a block of k at once; one that scores its tokens cuts the block where its
confidence ends, since the loop verifies every token it is given. A drafter that keeps
per-request state of its own is told what verification kept (:meth:`Drafter.verified`) and
when a request leaves the pool (:meth:`Drafter.release`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from dsv4c.runtime.sampling import Sampler


@dataclass
class Draft:
    """A request's pending drafts and, when it samples, the distribution each was drawn from
    (rejection sampling needs it: ``runtime.speculative.accept``); empty when greedy."""
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)

    def truncate(self, keep: int) -> None:
        del self.tokens[keep:], self.probs[keep:]


@dataclass(frozen=True)
class StepPart:
    """One running request's part of the target step just run, after the engine took its tokens."""
    request: object  # the engine's Request: its sequence, how much of it is fed, its sampler
    first: int  # the first position the step fed
    count: int  # positions the step fed: first .. first + count - 1
    row: int  # where they start among the step's rows (the backend's streams of the step)
    wanted: int  # drafts the request takes for its next step (0: none, it does not decode next)


class Drafter(ABC):
    # How many of the prompt's last positions the drafter reads from the target step's output:
    # the engine feeds them even when a cached prefix holds their KV rows.
    prompt_tail: int = 0
    # The most drafts one proposal holds when the drafter drafts a block at once (the default
    # number of drafts per step, within the pool's ring limit); None: it chains one token at a
    # time, with no limit of its own (default one draft).
    block_size: int | None = None

    @abstractmethod
    def propose(self, parts: list[StepPart]) -> dict[int, Draft]:
        """Drafts by request id, at most ``wanted`` tokens each, for the parts that want any.
        Every running request of the step is in ``parts``, in the step's order."""

    def verified(self, request, draft: Draft, accepted: int) -> None:
        """The engine verified ``draft`` for ``request`` and kept its first ``accepted`` tokens:
        state derived from the others is to be dropped. Nothing to drop by default."""

    def release(self, rid: int) -> None:
        """Request ``rid`` left the pool (finished, cancelled, or preempted to be recomputed)."""


def draw_draft(sampler: Sampler, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
    """A draft from a drafter's logits: their argmax (greedy) or a sample of their distribution,
    which acceptance needs again."""
    if sampler.params.greedy:
        return int(np.argmax(logits)), None
    q = sampler.probs(logits)
    return sampler.draw(q), q

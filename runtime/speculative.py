"""Speculative decoding: the engine's loop around a drafter, and acceptance.

A decode step of a speculating request feeds its last token and its pending drafts
``d_1..d_k`` (proposed by a :class:`~dsv4c.runtime.drafter.Drafter` after the step before);
the backbone's logits at those k + 1 rows verify the drafts left to right (:func:`accept`),
the pool rows of every position that is not part of the sequence afterwards are put back
(``KVPool.position_state``; on a device by the backend's pool functions), and the drafter
proposes again from the step's output (:class:`SpeculativeDecoding`). The output
distribution is exactly the non-speculative one:

* greedy: a draft is accepted iff it is the backbone's argmax; the first rejected draft is
  replaced by that argmax, so the tokens are plain greedy's, token for token;
* sampling: the draft was drawn from the drafter's own distribution ``q`` (same temperature
  and top-p), and is accepted with probability ``min(1, p(d) / q(d))`` under the backbone's
  ``p``; a rejection draws from ``max(p - q, 0)`` normalised (standard speculative
  sampling: Leviathan et al. 2023, Chen et al. 2023). After k acceptances a bonus token
  comes from the last row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.pool import PoolGeometry
from dsv4c.errors import UsageError
from dsv4c.runtime.backend import Backend
from dsv4c.runtime.drafter import Draft, Drafter, StepPart
from dsv4c.runtime.drafter_dspark import DsparkDrafter
from dsv4c.runtime.drafter_mtp import MtpDrafter
from dsv4c.runtime.kv_pool import KVPool
from dsv4c.runtime.sampling import Sampler

METHODS = ("mtp", "dspark")  # speculative=: the drafters by name (or a Drafter of one's own)


@dataclass
class SpecStats:
    steps: int = 0  # verify steps that carried drafts
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # [j]: verify steps that accepted j drafts

    @classmethod
    def of_step(cls, drafted: int, accepted: int) -> "SpecStats":
        """One verify step's: ``drafted`` drafts, the first ``accepted`` of them accepted."""
        return cls(1, drafted, accepted, [0] * accepted + [1])

    def add(self, other: "SpecStats") -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.accepted_lengths += [0] * (len(other.accepted_lengths) - len(self.accepted_lengths))
        for j, steps in enumerate(other.accepted_lengths):
            self.accepted_lengths[j] += steps

    def to_json(self) -> dict:
        return {"verify_steps": self.steps, "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                # tokens a verify step produces: its accepted drafts and the one the backbone adds
                "tokens_per_step": round((self.accepted + self.steps) / self.steps, 4) if self.steps else None,
                "accepted_lengths": list(self.accepted_lengths)}


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


class SpeculativeDecoding:
    """The engine's speculative loop around a drafter: what a verify step saves of the pool
    before it writes drafts' rows, the verification of a request's drafts, and the drafter's next
    proposals after every step. ``method``: a drafter's name (:data:`METHODS`) or a drafter."""

    def __init__(self, method: str | Drafter, num_draft_tokens: int | None, backend: Backend, pool: KVPool,
                 config: ModelConfig, artifact: Path, target: str, ranks: int, draft_confidence: float = 0.0):
        if isinstance(method, Drafter):
            self.drafter = method
        elif method == "mtp":
            self.drafter = MtpDrafter(backend, config, artifact, target)
        elif method == "dspark":
            self.drafter = DsparkDrafter(backend, config, artifact, target, ranks, draft_confidence)
        else:
            raise UsageError(f"speculative must be one of {', '.join(METHODS)} (or None), got {method!r}")
        if backend.device_rows:
            if ranks > 1:
                raise UsageError("speculative decoding of a multi-rank artifact puts rejected drafts' pool rows back "
                                 "through the host's pool journal: it runs on llvm (CPU) artifacts for now")
            backend.check_pool_functions()
        # Positions of one verify step must own distinct window and ring rows (position_state).
        geometry: PoolGeometry = pool.geometry
        # A one-row ring (ratio 1) never holds a pending token: every token closes its window.
        longest = min([geometry.window] + [s.rows for s in geometry.states if s.rows > 1])
        most, why = longest - 1, f"its smallest window or compressor ring holds {longest} positions"
        block = self.drafter.block_size
        if block is not None and block < longest:
            most, why = block, f"its drafter's block holds {block}"
        if num_draft_tokens is None:  # a block drafter drafts its block, another one token
            num_draft_tokens = most if block is not None else 1
        if not 1 <= num_draft_tokens <= most:
            raise UsageError(f"num_draft_tokens must be in [1, {most}] for this model ({why}), got {num_draft_tokens}")
        self.backend, self.pool, self.num_draft_tokens = backend, pool, num_draft_tokens
        self.stats = SpecStats()  # over every request this loop verified drafts for

    def wanted(self, r) -> int:
        """How many drafts a request takes for its next step: none unless it decodes next, else
        one fewer than the tokens it may still generate (the verify step adds one of its own), at
        most ``num_draft_tokens``."""
        if not r.decoding:
            return 0
        return max(0, min(self.num_draft_tokens, r.params.max_new_tokens - len(r.generated) - 1))

    def save(self, r, n: int) -> list:
        """Before a step feeds ``r``'s last token and ``n - 1`` drafts: what each draft's position
        overwrites in the pool, to put back those rejected (:meth:`verify`)."""
        return [(p, self._save_rows(self.pool.position_state(r.rid, [p]))) for p in range(r.fed + 1, r.fed + n)]

    def verify(self, r, rows: np.ndarray, saved: list) -> None:
        """Accept drafts, take the tokens, and put back the pool rows of every position the step
        fed that is not part of the sequence now (rejected drafts; accepted ones past a stop)."""
        draft = r.draft
        out, accepted = accept(r.sampler, rows, draft)
        stats = SpecStats.of_step(len(draft.tokens), accepted)
        r.spec.add(stats)
        self.stats.add(stats)
        r.draft = Draft()
        for token, row in zip(out, rows):  # out[i] was drawn from rows[i]
            if r.done_sampling:
                break
            r.take(token, row)
        r.fed = len(r.sequence) - 1  # as after plain decoding: every token but the last is fed
        for position, state in saved:
            if position >= r.fed:
                self._restore_rows(state)
        self.drafter.verified(r, draft, accepted)

    def propose(self, fed: list[tuple], running) -> None:
        """After a step that fed ``(request, first position, count)`` each: the drafter's drafts
        for the requests still ``running`` that decode next."""
        parts, row = [], 0
        for r, first, n in fed:
            if running(r):
                parts.append(StepPart(r, first, n, row, self.wanted(r)))
            row += n
        drafts = self.drafter.propose(parts)
        for part in parts:
            if part.request.rid in drafts:
                part.request.draft = drafts[part.request.rid]
                part.request.draft.truncate(part.wanted)

    def _save_rows(self, state: list):
        """A copy of the pool rows a ``KVPool.position_state`` names: on the backend's device where
        the pool lives there (the KVPool's arrays are then not the pool), else from those arrays."""
        return self.backend.save_rows(state) if self.backend.device_rows else self.pool.save(state)

    def _restore_rows(self, saved) -> None:
        if self.backend.device_rows:
            self.backend.restore_rows(saved)
        else:
            self.pool.restore(saved)

"""The model's DSpark block drafter as a drafter (``speculative="dspark"``).

DSpark (DeepSeek-V4-Flash-0731, V4-Pro-0813) drafts a block at once: its stages run over B =
``dspark_block_size`` rows, the anchor (the request's last token, which the next step feeds) and
B - 1 noise tokens at the positions that follow, which see each other and the stages' window
rings of the context. Row i's logits, plus a low-rank Markov bias from the token before it (the
anchor for row 0, else draft i), propose draft i + 1; the Markov step is sequential, one batched
call per row. A confidence head rates each row's draft before it is drawn: with
``draft_confidence`` T > 0 a request's drafts stop at the first row rated below T.

The target step writes the stages' ring rows of every position it feeds (their context is
projected from the target's hidden states), so the drafter keeps nothing of its own: the rings
are pool rows, which the prefix cache shares and the speculative loop puts back for rejected
drafts like any window row.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dsv4c.artifact.model_config import ModelConfig
from dsv4c.errors import UsageError
from dsv4c.runtime.backend import Backend
from dsv4c.runtime.drafter import Draft, Drafter, StepPart, draw_draft


class DsparkDrafter(Drafter):
    def __init__(self, backend: Backend, config: ModelConfig, artifact: Path, target: str, ranks: int,
                 draft_confidence: float = 0.0):
        dspark = config.dspark
        if dspark is None:
            raise UsageError(f"{artifact} has no DSpark drafter (its model has no dspark_block_size and "
                             "dspark_target_layer_ids); speculative decoding with dspark needs one (compile a "
                             "checkpoint that carries it, or add one with `dsv4c compile --draft-model DIR`)")
        if ranks > 1:
            raise UsageError(f"{artifact} is compiled for {ranks} ranks, and the DSpark drafter is compiled for one "
                             "rank only: run it without --speculative dspark, or compile it without --tensor-parallel")
        if not backend.has_dspark:
            raise UsageError(f"{artifact} is a {target} artifact without the DSpark drafter's functions; compile it "
                             "again with this dsv4c")
        if not 0 <= draft_confidence <= 1:
            raise UsageError(f"draft_confidence must be in [0, 1] (0: off), got {draft_confidence}")
        if draft_confidence and not dspark.confidence_head:
            raise UsageError(f"{artifact}'s DSpark drafter has no confidence head (confidence_head.proj); run "
                             "without draft_confidence")
        self.backend = backend
        self.block_size, self.noise = dspark.block_size, dspark.noise_token_id
        self.draft_confidence = draft_confidence

    def propose(self, parts: list[StepPart]) -> dict[int, Draft]:
        drafting = [part for part in parts if part.wanted]
        drafts = {part.request.rid: Draft() for part in drafting}
        if not drafting:
            return drafts
        b = self.block_size
        # Every request that decodes next feeds its last token at r.fed: the block's anchor.
        prev = [part.request.sequence[part.request.fed] for part in drafting]
        base = self.backend.dspark_draft(
            np.array([t for a in prev for t in [a] + [self.noise] * (b - 1)], np.int32),
            np.array([p for part in drafting for p in range(part.request.fed, part.request.fed + b)], np.int32),
            np.repeat(np.array([part.request.rid for part in drafting], np.int32), b))
        live = list(range(len(drafting)))  # requests still drafting, by their index in ``drafting``
        for i in range(b):
            rows = [j * b + i for j in live]
            bias, confidence = self.backend.dspark_markov(np.array([prev[j] for j in live], np.int32),
                                                          np.array(rows, np.int32))
            still = []
            for n, j in enumerate(live):
                if self.draft_confidence and _sigmoid(float(confidence[n])) < self.draft_confidence:
                    continue  # the drafts before this row are kept; this one and the rest are not drawn
                part = drafting[j]
                draft = drafts[part.request.rid]
                prev[j], q = draw_draft(part.request.sampler, base[rows[n]] + bias[n])
                draft.tokens.append(prev[j])
                if q is not None:
                    draft.probs.append(q)
                if len(draft.tokens) < part.wanted:
                    still.append(j)
            live = still
            if not live:
                break
        return drafts


def _sigmoid(x: float) -> float:
    """The confidence head's probability from its logit (without overflow at either end)."""
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))

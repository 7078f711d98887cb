"""The model's MTP layer as a drafter (``speculative="mtp"``).

After a target step the MTP layer runs over the positions each request of the step fed and
kept (those its sliding window will read), from the step's streams, which the backend left on
its device; then it drafts for the requests that decode next, chained on its own output
streams: one batched call of the layer per draft depth. Its window rows of rejected drafts are
pool rows, which the speculative loop puts back with the backbone's.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from dsv4c.artifact.model_config import ModelConfig
from dsv4c.errors import UsageError
from dsv4c.runtime.backend import Backend
from dsv4c.runtime.drafter import Draft, Drafter, StepPart, draw_draft


class MtpDrafter(Drafter):
    def __init__(self, backend: Backend, config: ModelConfig, artifact: Path, target: str):
        if config.dspark is not None:
            raise UsageError(f"{artifact} has a DSpark drafter in place of an MTP layer; use speculative decoding "
                             "with dspark")
        if not backend.has_mtp:
            why = ("has no MTP layer (num_nextn_predict_layers is 0)" if not config.mtp_layers else
                   f"is a {target} artifact")
            raise UsageError(f"{artifact} {why}; speculative decoding with mtp needs a compiled MTP layer "
                             "(compile a model with num_nextn_predict_layers >= 1)")
        self.backend = backend
        # Its first draft reads the window of the prompt's last position.
        self.prompt_tail = config.sliding_window

    def propose(self, parts: list[StepPart]) -> dict[int, Draft]:
        tokens, positions, seqs, rows, drafting = [], [], [], [], []
        for part in parts:
            r = part.request
            # MTP at position p reads the token of p + 1. Earlier prompt positions than the
            # window of the prompt's end are never read.
            start = max(part.first, len(r.prompt) - self.prompt_tail)
            kept = range(start, r.fed)
            tokens += r.sequence[start + 1:r.fed + 1]
            positions += kept
            seqs += [r.rid] * len(kept)
            rows += range(part.row + start - part.first, part.row + r.fed - part.first)
            if len(kept) and part.wanted:
                drafting.append((part, len(tokens) - 1))
        drafts = {part.request.rid: Draft() for part, _ in drafting}
        if not tokens:
            return drafts
        stream_rows = [row for _, row in drafting]
        logits = self.backend.draft(np.array(tokens, np.int32), np.array(positions, np.int32),
                                    np.array(seqs, np.int32), np.array(rows, np.int32),
                                    np.array(stream_rows, np.int32))
        parts = [part for part, _ in drafting]
        for depth in itertools.count():
            for part, row in zip(parts, logits):
                self.choose(part.request, drafts[part.request.rid], row)
            # Chain: the MTP layer at the next position, from its own streams at the last one.
            wants = [len(drafts[part.request.rid].tokens) < part.wanted for part in parts]
            stream_rows = [i if depth else stream_rows[i] for i, want in enumerate(wants) if want]
            parts = [part for part, want in zip(parts, wants) if want]
            if not parts:
                return drafts
            logits = self.backend.draft(
                np.array([drafts[p.request.rid].tokens[-1] for p in parts], np.int32),
                np.array([p.request.fed + depth for p in parts], np.int32),
                np.array([p.request.rid for p in parts], np.int32),
                np.array(stream_rows, np.int32), np.arange(len(parts), dtype=np.int32), chain=True)

    @staticmethod
    def choose(request, draft: Draft, logits: np.ndarray) -> None:
        """The next draft token of ``request`` from the MTP layer's ``logits``."""
        token, q = draw_draft(request.sampler, logits)
        draft.tokens.append(token)
        if q is not None:
            draft.probs.append(q)

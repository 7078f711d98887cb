"""The reference backend: the IR interpreter running on the engine's KV pool."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsv4c.artifact.engram_tables import table_weight
from dsv4c.artifact.manifest import Manifest
from dsv4c.ir.interpreter import Interpreter
from dsv4c.runtime.backend import Backend, StepImages
from dsv4c.runtime.kv_pool import KVPool, PagedStore
from dsv4c.runtime.weights import open_engram_tables, open_weights


class ReferenceBackend(Backend):
    """On the host, without an MTP layer (MTP speculation needs a compiled artifact); a DSpark
    drafter runs here too (the numpy reference of its functions)."""

    def __init__(self, artifact: Path, manifest: Manifest, program, pool: KVPool, engram_memory: str = "map"):
        # Reference artifacts store float32 and int64 weights, which the interpreter reads as they
        # are; an Engram table decodes the rows a step looks up (``artifact.engram_tables``).
        weights = dict(open_weights(artifact, manifest))
        weights.update((table_weight(t.layer), t) for t in
                       open_engram_tables(artifact, manifest, read=engram_memory == "read"))
        self.interpreter = Interpreter(program, weights, PagedStore(pool))
        self.has_dspark = "dspark_draft" in program.functions
        self._block = None  # the last dspark_draft call: (positions, seq_ids, head hidden rows)

    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
             logit_rows: np.ndarray | None = None, engram_rows: np.ndarray | None = None,
             images: StepImages | None = None) -> np.ndarray:
        """Run one step; the logits of ``logit_rows`` (token indices; default every token)."""
        extra = {} if engram_rows is None else {"engram_rows": engram_rows}
        if self.interpreter.program.config.image_token_id is not None:
            if images is None:
                images = StepImages(np.zeros((0, self.interpreter.program.config.hidden_size), np.float32),
                                    np.full(len(tokens), -1, np.int32))
            extra.update(image_rows=images.rows, image_index=images.index)
        logits, _ = self.interpreter.run("step", tokens=tokens, positions=positions, seq_ids=seq_ids, **extra)
        return logits if logit_rows is None else logits[logit_rows]

    def dspark_draft(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray) -> np.ndarray:
        """Base logits [T, V] of a block call (every row); keeps its head hidden rows y for dspark_markov."""
        logits, hidden = self.interpreter.run("dspark_draft", tokens=tokens, positions=positions, seq_ids=seq_ids)
        self._block = (np.asarray(positions), np.asarray(seq_ids), hidden)
        return logits

    def dspark_markov(self, prev_tokens: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """For rows ``rows`` of the last dspark_draft: the Markov bias [R, V] from each row's previous
        token, and the confidence logits [R] (None: the drafter has no confidence head)."""
        positions, seq_ids, hidden = self._block
        rows = np.asarray(rows)
        bias, conf = self.interpreter.run("dspark_markov", tokens=prev_tokens, positions=positions[rows],
                                          seq_ids=seq_ids[rows], streams=hidden[rows])
        return bias, conf[:, 0] if self.interpreter.program.config.dspark.confidence_head else None

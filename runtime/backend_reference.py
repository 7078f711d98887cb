"""The reference backend: the IR interpreter running on the engine's KV pool."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsv4c.artifact.manifest import Manifest
from dsv4c.ir.interpreter import Interpreter
from dsv4c.runtime.backend import Backend
from dsv4c.runtime.kv_pool import KVPool, PagedStore
from dsv4c.runtime.weights import open_weights


class ReferenceBackend(Backend):
    """On the host, without an MTP layer (speculative decoding needs a compiled artifact)."""

    def __init__(self, artifact: Path, manifest: Manifest, program, pool: KVPool):
        # Reference artifacts store float32 and int64 weights, which the interpreter reads as they are.
        weights = open_weights(artifact, manifest)
        self.interpreter = Interpreter(program, weights, PagedStore(pool))

    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
             logit_rows: np.ndarray | None = None) -> np.ndarray:
        """Run one step; the logits of ``logit_rows`` (token indices; default every token)."""
        logits, _ = self.interpreter.run("step", tokens=tokens, positions=positions, seq_ids=seq_ids)
        return logits if logit_rows is None else logits[logit_rows]

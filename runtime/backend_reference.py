"""The reference backend: the IR interpreter running on the engine's KV pool."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsv4c.frontend.safetensors_io import SafetensorsFile
from dsv4c.ir.interpreter import Interpreter
from dsv4c.runtime.dense_cache import DenseCache
from dsv4c.runtime.kv_pool import KVPool, PagedStore


def load_ir_weights(path: Path) -> dict[str, np.ndarray]:
    with SafetensorsFile(path) as st:
        return {name: st.read_f32(name) if st.dtype(name) in ("F32", "BF16", "F16") else st.read_raw(name)
                for name in st.names()}


class ReferenceBackend:
    def __init__(self, artifact: Path, manifest: dict, program, pool: KVPool):
        weights = load_ir_weights(artifact / "weights.safetensors")
        self.interpreter = Interpreter(program, weights, PagedStore(pool, DenseCache(program.config)))

    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
             logit_rows: np.ndarray | None = None) -> np.ndarray:
        """Run one step; the logits of ``logit_rows`` (token indices; default every token)."""
        logits, _ = self.interpreter.run("step", tokens=tokens, positions=positions, seq_ids=seq_ids)
        return logits if logit_rows is None else logits[logit_rows]

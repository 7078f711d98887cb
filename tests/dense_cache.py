"""A simple per-request KV store for the reference interpreter.

Everything is fp32 and grows with the request; the paged pool (``dsv4c.runtime.kv_pool``)
implements the same :class:`~dsv4c.ir.reference_ops.KVStore` interface over a shared row space.
"""

from __future__ import annotations

import numpy as np

from dsv4c.artifact.model_config import ModelConfig

F32 = np.float32


class _Growing:
    """A row array that doubles its capacity as rows are written further out."""

    def __init__(self, width: int):
        self.rows = np.zeros((0, width), F32)
        self.filled = 0  # rows [0, filled) have been written

    def write(self, start: int, rows: np.ndarray) -> None:
        stop = start + len(rows)
        if stop > len(self.rows):
            grown = np.zeros((max(stop, 2 * len(self.rows)), self.rows.shape[1]), F32)
            grown[:len(self.rows)] = self.rows
            self.rows = grown
        self.rows[start:stop] = rows
        self.filled = max(self.filled, stop)


class DenseCache:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._windows: dict[tuple[int, int], _Growing] = {}
        self._entries: dict[tuple[int, str, int], _Growing] = {}
        self._rings: dict[tuple[int, str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._layers = {l.index: l for l in cfg.layers + cfg.mtp_layers}

    def window_rows(self, layer: int, seq: int, start: int, stop: int) -> np.ndarray:
        rows = self._windows.get((layer, seq))
        if rows is None:
            return np.zeros((0, self.cfg.head_dim), F32)
        return rows.rows[start:min(stop, rows.filled)]

    def write_window(self, layer: int, seq: int, positions: np.ndarray, rows: np.ndarray) -> None:
        store = self._windows.setdefault((layer, seq), _Growing(self.cfg.head_dim))
        store.write(int(positions[0]), rows)

    def ring(self, layer: int, stream: str, seq: int) -> tuple[np.ndarray, np.ndarray]:
        key = (layer, stream, seq)
        if key not in self._rings:
            spec = self._layers[layer]
            overlap = spec.overlap
            d = self.cfg.head_dim if stream == "main" else self.cfg.index_head_dim
            shape = ((2 if overlap else 1) * spec.compress_ratio, (2 if overlap else 1) * d)
            self._rings[key] = (np.zeros(shape, F32), np.full(shape, -np.inf, F32))
        return self._rings[key]

    def write_entries(self, layer: int, stream: str, seq: int, first: int, entries: np.ndarray) -> None:
        self._entries.setdefault((layer, stream, seq), _Growing(entries.shape[1])).write(first, entries)

    def entries(self, layer: int, stream: str, seq: int, count: int) -> np.ndarray:
        store = self._entries.get((layer, stream, seq))
        d = self.cfg.head_dim if stream == "main" else self.cfg.index_head_dim
        if store is None or count == 0:
            return np.zeros((0, d), F32)
        if count > store.filled:
            raise ValueError(f"layer {layer} {stream}: request {seq} has fewer than {count} compressed entries")
        return store.rows[:count]

    def free(self, seq: int) -> None:
        for table in (self._windows, self._entries, self._rings):
            for key in [k for k in table if k[-1] == seq]:
                del table[key]

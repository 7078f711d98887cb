"""Row sources: a tensor read as consecutive rows of the matrix ``[rows, cols]``, a range at a
time, in the storage that holds it (FP8 / FP4 codes with their scales, BF16 bits, floats, ids).

The checkpoint reader (``frontend/checkpoint.py``) makes the sources of stored tensors; the
ones here stack them (``ConcatRows``), cut a rank's part out of them (``ShardRows``) or supply
small compiler-made tensors (``ConstantRows``). The weight conversion (``codegen/convert.py``)
reads every source a range at a time and the weight formats (``artifact/quant.py``) take the
rows' own bytes where they already hold their format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dsv4c.artifact import lowbit


@dataclass(frozen=True)
class Rows:
    """Consecutive rows of a tensor seen as a matrix ``[rows, cols]`` (cols: its last axis; the
    experts of a stack one after another), as the checkpoint stores them.

    ``storage`` says what ``values`` and ``scales`` hold: ``F32`` / ``F16`` / ``BF16``: float32,
    float16 or uint16 bits ``[n, cols]``; ``FP8``: e4m3fn codes ``[n, cols]`` and, per row, the
    float32 scale of each ``block``-column block ``[n, ceil(cols / block)]``; ``FP4``: e2m1 pairs (element
    2i in the low nibble) ``[n, cols / 2]`` and their E8M0 scale codes ``[n, cols / 32]``; ``INT``:
    int64 ``[n, cols]``. The artifact's weight formats (``artifact.quant``) take the checkpoint's
    own bytes where it holds their format and quantize only rows stored in another."""

    storage: str
    values: np.ndarray
    scales: np.ndarray | None = None
    block: int = 128  # FP8: the checkpoint's square block size (its scales' columns span this many)

    def decode(self) -> np.ndarray:
        """float32 values (int64 for INT); FP8 / FP4 codes times the scale of their block / 32-group."""
        if self.storage == "FP8":
            scale = np.repeat(self.scales, self.block, axis=1)[:, :self.values.shape[1]]
            return lowbit.decode_e4m3fn(self.values) * scale
        if self.storage == "FP4":
            return lowbit.dequantize_fp4_groups(self.values, self.scales, 32)
        if self.storage == "BF16":
            return lowbit.f32_from_bf16_bits(self.values)
        return self.values.astype(np.int64 if self.storage == "INT" else np.float32, copy=False)


class RowSource:
    """A tensor of logical ``shape`` read as :class:`Rows` of the matrix ``[rows, cols]``
    (cols = ``shape[-1]``), a range at a time; ``read`` may be called from several threads."""

    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    def read(self, start: int, stop: int) -> list[Rows]:
        """Rows ``[start, stop)``, one :class:`Rows` per stored tensor they come from, in order."""
        raise NotImplementedError

    def read_all(self) -> np.ndarray:
        """The whole tensor decoded: float32 (int64 for ids) of ``shape``."""
        return np.concatenate([part.decode() for part in self.read(0, self.rows)]).reshape(self.shape)


class ConcatRows(RowSource):
    """Sources stacked along their rows: the routed experts of a layer ``[E, out, in]``, or
    projections merged along ``out`` (``concat(a,b)``)."""

    def __init__(self, parts: list[RowSource], shape: tuple[int, ...]):
        self.parts, self.shape = parts, shape

    def read(self, start: int, stop: int) -> list[Rows]:
        out, base = [], 0
        for part in self.parts:
            lo, hi = max(start, base), min(stop, base + part.rows)
            if lo < hi:
                out += part.read(lo - base, hi - base)
            base += part.rows
        return out


class ShardRows(RowSource):
    """One rank's part of a weight (an ``artifact.sharding.WeightShard`` of ``base``'s shape),
    read as only those bytes: a range along the first axis (whole experts of a stack ``[E, out,
    in]``) padded with zero rows up to the shard's extent (a vocab the ranks do not divide), a
    range along a middle axis (each expert's share of its rows), or a range of columns (the last
    axis; FP8 / FP4 ranges start on their scale blocks, which the plan ensures)."""

    def __init__(self, base: RowSource, shard):
        self.base, self.shard = base, shard
        self.shape = shard.held_shape(base.shape)
        self.columns = shard.axis is not None and shard.axis == len(base.shape) - 1
        if shard.axis is not None and not self.columns:
            # Matrix rows per index of the split axis; the base's rows per index of the axes before it.
            self.inner = math.prod(base.shape[shard.axis + 1:-1])
            self.outer_rows = base.shape[shard.axis] * self.inner
            self.local_rows = (shard.stop - shard.start) * self.inner  # real (not padded) rows per outer index
            self.held_rows = shard.extent * self.inner

    def read(self, start: int, stop: int) -> list[Rows]:
        if self.shard.axis is None:
            return self.base.read(start, stop)
        if self.columns:
            return [_columns(rows, self.shard.start, self.shard.stop) for rows in self.base.read(start, stop)]
        out = []
        while start < stop:  # one index of the axes before the split at a time
            outer, row = divmod(start, self.held_rows)
            end = min(stop, (outer + 1) * self.held_rows)
            first = outer * self.outer_rows + self.shard.start * self.inner
            real = min(end - outer * self.held_rows, self.local_rows)
            if row < real:
                out += self.base.read(first + row, first + real)
            pad = end - outer * self.held_rows - max(row, self.local_rows)
            if pad > 0:
                out.append(Rows("F32", np.zeros((pad, self.shape[-1]), np.float32)))
            start = end
        return out


def _columns(rows: Rows, start: int, stop: int) -> Rows:
    """Columns ``[start, stop)`` of some rows, in their storage."""
    if rows.storage == "FP8":
        b = rows.block
        return Rows("FP8", rows.values[:, start:stop], rows.scales[:, start // b:-(-stop // b)], b)
    if rows.storage == "FP4":
        return Rows("FP4", rows.values[:, start // 2:stop // 2], rows.scales[:, start // 32:stop // 32])
    return Rows(rows.storage, rows.values[:, start:stop])


class ConstantRows(RowSource):
    """A small integer tensor the compiler supplies (a rank's ``tp.*`` offsets), not the checkpoint."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values, np.int64).reshape(-1, np.shape(values)[-1])
        self.shape = tuple(np.shape(values))

    def read(self, start: int, stop: int) -> list[Rows]:
        return [Rows("INT", self.values[start:stop])]

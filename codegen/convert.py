"""Streaming conversion of checkpoint weights into the artifact's weight files.

The artifact's tensors are known before any data is read (:class:`WeightLayout` gives their
names, dtypes and shapes), so the shard files are laid out first; then a bounded pool of
threads converts the weights a range of rows at a time, reading only those rows from the
checkpoint and writing their bytes straight to their place in the shard. Memory holds a few
such pieces whatever the model's size, and FP8 / FP4 / BF16 bytes are only re-tiled.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from dsv4c.artifact.file_names import WEIGHTS_INDEX, weight_files
from dsv4c.artifact.safetensors_io import STORAGE_DTYPES, SafetensorsWriter
from dsv4c.codegen.lowering import WeightLayout
from dsv4c.artifact.rows import RowSource
from dsv4c.threads import BoundedPool

SHARD_BYTES = 4 << 30  # at most this much per weight file (a larger single tensor gets a file of its own)
# Weight elements one job converts: a few MiB of codes or floats, and bounded temporaries even
# where a piece must be quantized (about ten int64 per element).
PIECE_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class ConversionReport:
    files: list[str]  # the weight files, in order
    bytes_written: int
    seconds: float
    index: str  # the file naming which weight file holds which tensor


def _nbytes(entry: tuple[str, tuple[int, ...]]) -> int:
    dtype, shape = entry
    return math.prod(shape) * STORAGE_DTYPES[dtype].itemsize


def _convert_rows(layout: WeightLayout, source: RowSource, writer: SafetensorsWriter, start: int, stop: int) -> int:
    """Convert rows ``[start, stop)`` of one weight and write them; the bytes written."""
    written = 0
    row_bytes = layout.row_bytes()
    for name, array in layout.lay_out(source.read(start, stop)).items():
        writer.write(name, array, start * row_bytes[name])
        written += array.nbytes
    return written


def convert_weights(layouts: dict[str, WeightLayout], sources: dict[str, RowSource], out_dir: Path,
                    shard_bytes: int = SHARD_BYTES, workers: int | None = None,
                    progress: bool = False, prefix: str = "") -> ConversionReport:
    """Write the weights of ``layouts`` (read from ``sources``, same names) into ``out_dir``
    as safetensors shards of at most ``shard_bytes`` plus the index ``prefix`` + :data:`WEIGHTS_INDEX`
    (``{"metadata": {"total_size"}, "weight_map": {tensor: file}}``); ``prefix`` names one rank's
    files of a multi-rank artifact (``rank1-``)."""
    start_time = time.perf_counter()
    shards: list[list[WeightLayout]] = [[]]
    size = 0
    for layout in layouts.values():  # program order: a layer's weights stay together
        nbytes = sum(_nbytes(entry) for entry in layout.stored().values())
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(layout)
        size += nbytes
    files = weight_files(len(shards), prefix)
    total = sum(_nbytes(e) for layout in layouts.values() for e in layout.stored().values())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"converting {prefix}weights", unit="B", unit_scale=True, unit_divisor=1024, leave=False)
    writers: list[SafetensorsWriter] = []
    try:
        weight_map = {}
        with BoundedPool(workers, on_result=bar.update if bar is not None else None) as pool:
            for fname, shard in zip(files, shards):
                stored = {name: entry for layout in shard for name, entry in layout.stored().items()}
                writers.append(SafetensorsWriter(out_dir / fname, stored))
                weight_map.update({name: fname for name in stored})
                for layout in shard:
                    per_row = max(layout.shape[-1], 1)
                    step = max(layout.row_step, PIECE_ELEMENTS // per_row // layout.row_step * layout.row_step)
                    for first in range(0, layout.rows, step):
                        pool.submit(_convert_rows, layout, sources[layout.name], writers[-1], first,
                                    min(first + step, layout.rows))
        for writer in writers:
            writer.finish()
    finally:
        for writer in writers:
            writer.close()
        if bar is not None:
            bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / (prefix + WEIGHTS_INDEX)).write_text(json.dumps(index, indent=2))
    return ConversionReport(files, total, time.perf_counter() - start_time, prefix + WEIGHTS_INDEX)

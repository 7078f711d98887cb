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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dsv4c.artifact.engram_tables import lay_out_rows, table_tensors
from dsv4c.artifact.file_names import WEIGHTS_INDEX, engram_table_file, weight_files
from dsv4c.artifact.manifest import EngramTableFile
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


@contextmanager
def _writing(total: int, desc: str, workers: int | None, progress: bool):
    """(a pool of conversion jobs, ``open_file(path, {tensor: (dtype, shape)})`` -> the writer of a
    new file the jobs fill): when the block ends every file is checked complete and synced; on
    failure every file is closed (the staging directory then goes). ``progress``: a bar of the
    ``total`` bytes the jobs report."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
    writers: list[SafetensorsWriter] = []

    def open_file(path: Path, entries) -> SafetensorsWriter:
        writers.append(SafetensorsWriter(path, entries))
        return writers[-1]

    try:
        with BoundedPool(workers, on_result=bar.update if bar is not None else None) as pool:
            yield pool, open_file
        for writer in writers:
            writer.finish()
    finally:
        for writer in writers:
            writer.close()
        if bar is not None:
            bar.close()


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
    weight_map = {}
    with _writing(total, f"converting {prefix}weights", workers, progress) as (pool, open_file):
        for fname, shard in zip(files, shards):
            stored = {name: entry for layout in shard for name, entry in layout.stored().items()}
            writer = open_file(out_dir / fname, stored)
            weight_map.update({name: fname for name in stored})
            for layout in shard:
                per_row = max(layout.shape[-1], 1)
                step = max(layout.row_step, PIECE_ELEMENTS // per_row // layout.row_step * layout.row_step)
                for first in range(0, layout.rows, step):
                    pool.submit(_convert_rows, layout, sources[layout.name], writer, first,
                                min(first + step, layout.rows))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / (prefix + WEIGHTS_INDEX)).write_text(json.dumps(index, indent=2))
    return ConversionReport(files, total, time.perf_counter() - start_time, prefix + WEIGHTS_INDEX)


def _convert_table_rows(table: EngramTableFile, source: RowSource, writer: SafetensorsWriter, start: int,
                        stop: int) -> int:
    """Convert rows ``[start, stop)`` of one Engram table and write them; the bytes written."""
    written = 0
    for name, array in lay_out_rows(table.format, source.read(start, stop), table.file).items():
        writer.write(name, array, start * array[0].nbytes)
        written += array.nbytes
    return written


def convert_engram_tables(tables: dict[int, RowSource], fmt: str, out_dir: Path, workers: int | None = None,
                          progress: bool = False) -> list[EngramTableFile]:
    """Write each Engram layer's table (decoder layer -> its checkpoint rows, in Engram-layer
    order) into a file of its own in format ``fmt`` (``artifact.engram_tables``), a range of rows
    at a time as the weights are; the manifest's records of the files."""
    records = [EngramTableFile(layer=layer, file=engram_table_file(layer), rows=source.shape[0],
                               width=source.shape[1], format=fmt) for layer, source in tables.items()]
    entries = [table_tensors(fmt, t.rows, t.width) for t in records]
    total = sum(_nbytes(e) for tensors in entries for e in tensors.values())
    with _writing(total, "converting Engram tables", workers, progress) as (pool, open_file):
        for table, tensors, source in zip(records, entries, tables.values()):
            writer = open_file(out_dir / table.file, tensors)
            step = max(1, PIECE_ELEMENTS // table.width)
            for first in range(0, table.rows, step):
                pool.submit(_convert_table_rows, table, source, writer, first, min(first + step, table.rows))
    return records

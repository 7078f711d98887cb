"""The one loader of an artifact's weights, for every backend.

:func:`open_weights` maps the weight files by default instead of reading them: start-up costs
the headers, the OS pages weights in as the kernels first touch them (at the disk's speed) and
can drop them again under memory pressure. Read instead (``read=True``), each tensor is copied
into memory of its own, which numpy backs with transparent huge pages from 4 MiB on: the CPU
kernels stream such pages faster than the page cache's 4 KiB ones (``WEIGHTS_MODES``,
``reads_weights``). Each array is read-only, in its storage dtype
(``SafetensorsFile.read_raw``'s: uint8 for FP8 / FP4 / E8M0 codes, uint16 for BF16 bits,
float32, int32, int64), stacked weights as one array. Tensors of a 64-byte multiple size
start 64-byte aligned in the file (and the map is page aligned), so TVM can share them
without a copy; numpy refuses to export read-only arrays through plain ``__dlpack__()``, so
hand TVM the versioned capsule (``runtime.tvm_runtime.from_numpy``).
"""

from __future__ import annotations

import ctypes
import json
import mmap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import numpy as np

from dsv4c.artifact.engram_tables import ROWS, SCALES, EngramTable, table_problem
from dsv4c.artifact.file_names import MANIFEST
from dsv4c.artifact.manifest import Manifest
from dsv4c.artifact.safetensors_io import STORAGE_DTYPES, SafetensorsFile
from dsv4c.errors import ArtifactError, UsageError
from dsv4c.runtime.kv_pool import aligned_empty
from dsv4c.threads import default_workers

# How a backend holds the weights: "map" the files, "read" them into memory, or "auto": read on
# the CPU when the weight files take at most READ_SHARE of the memory available, map otherwise.
# Read weights sit in huge pages, which decode streams faster than mapped page-cache pages
# (bench/RESULTS.md).
WEIGHTS_MODES = ("auto", "read", "map")
READ_SHARE = 0.5
READ_CHUNK_BYTES = 64 << 20  # a read job: the threads share a large tensor (see _read_file)
# How a backend holds the Engram tables: "map" their files (the default: a step reads the few
# rows its n-grams hash to, and a table need not fit in memory) or "read" them into memory.
ENGRAM_MEMORY_MODES = ("map", "read")


def check_weights_mode(mode: str) -> None:
    if mode not in WEIGHTS_MODES:
        raise UsageError(f"weights mode {mode!r} is not one of {', '.join(WEIGHTS_MODES)}")


def check_engram_memory(mode: str) -> None:
    if mode not in ENGRAM_MEMORY_MODES:
        raise UsageError(f"Engram memory mode {mode!r} is not one of {', '.join(ENGRAM_MEMORY_MODES)}")


def reads_weights(artifact: str | Path, manifest: Manifest, mode: str, on_host: bool) -> bool:
    """Whether a backend (on the CPU: ``on_host``) reads the weights into memory for ``mode``."""
    check_weights_mode(mode)
    if mode != "auto":
        return mode == "read"
    if not on_host:
        return False  # a GPU backend copies every weight to the device: the map is only its source
    files = manifest.weight_files()
    if not files:
        return False  # a --no-weights artifact: open_weights says so
    return sum((Path(artifact) / f).stat().st_size for f in files) <= READ_SHARE * available_memory()


def available_memory() -> int:
    """Bytes the kernel reports available (MemAvailable), or 0 where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def _bar(total: int, desc: str):
    """A progress bar of bytes read, shown after the first second (reading a large model takes a while)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, delay=1.0)


def _read_file(st: SafetensorsFile, bar) -> dict[str, np.ndarray]:
    """Every tensor of ``st``, read-only, read into 64-byte aligned memory of its own in jobs of
    at most READ_CHUNK_BYTES on default_workers() threads: preadv releases the GIL, and the
    page faults and copies into fresh memory scale with the threads (bench/RESULTS.md)."""
    arrays, jobs = {}, []  # a job: (name, first row, end row, the bytes they go to)
    for name in st.names():
        arrays[name] = aligned_empty(st.shape(name), STORAGE_DTYPES[st.dtype(name)])
        data, rows = arrays[name].reshape(-1).view(np.uint8), st.matrix_shape(name)[0]
        row_bytes = data.nbytes // rows if rows else 0
        step = max(1, READ_CHUNK_BYTES // max(1, row_bytes))
        jobs += [(name, first, min(rows, first + step), data[first * row_bytes:(first + step) * row_bytes])
                 for first in range(0, rows, step)]

    def read(job) -> int:
        st.read_rows_into(*job)
        return job[3].nbytes

    pool = ThreadPoolExecutor(default_workers(), thread_name_prefix="dsv4c-read")
    try:
        for done in pool.map(read, jobs):
            bar.update(done)
    finally:  # a failed read or Ctrl-C drops the jobs not yet started
        pool.shutdown(cancel_futures=True)
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


def open_weights(artifact: str | Path, manifest: Manifest, read: bool = False,
                 rank: int = 0) -> Mapping[str, np.ndarray]:
    """Every weight of the artifact by name (read-only arrays), memory-mapped from its shards,
    or with ``read`` read from them into 64-byte aligned memory; of a multi-rank artifact, rank
    ``rank``'s (``weights.ranks``).

    ``manifest`` is :func:`~dsv4c.artifact.manifest.read_manifest`'s, which has checked that
    every file is there with its size. Here each shard's header is parsed and checked
    (:class:`~dsv4c.errors.CheckpointError` naming the file), and the index against the
    shards: every tensor in exactly the file the index names. Mapped, no tensor data is read."""
    d = Path(artifact)
    if not manifest.has_weights:
        raise ArtifactError(f"{d}: compiled with --no-weights, so there are no weights to load; compile it again "
                            "from a model directory")
    if manifest.weights is None or (manifest.weights.index is None) == (manifest.weights.ranks is None):
        raise ArtifactError(f"{d / MANIFEST}: manifest has no weight file list; recompile")
    weights = manifest.weights.of_rank(rank)
    if weights is None:
        raise ArtifactError(f"{d / MANIFEST}: manifest has no weights for rank {rank}; recompile")
    files = weights.files
    index_path = d / weights.index
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        by_file: dict[str, set[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, set()).add(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ArtifactError(f"{index_path}: not a valid weight index; recompile") from None
    if sorted(by_file) != sorted(files):
        raise ArtifactError(f"{index_path}: does not name the weight files the manifest lists; recompile")
    out: dict[str, np.ndarray] = {}
    bar = _bar(sum((d / f).stat().st_size for f in files), "reading weights") if read else None
    try:
        for file in files:
            with SafetensorsFile(d / file) as st:
                if set(st.names()) != by_file[file]:
                    stray = sorted(set(st.names()) ^ by_file[file])[0]
                    raise ArtifactError(f"{d}: {file} and {weights.index} disagree about tensor {stray}; recompile")
                if read:
                    out.update(_read_file(st, bar))
                else:
                    out.update(st.mapped())
    finally:
        if bar is not None:
            bar.close()
    return MappingProxyType(out)


def open_engram_tables(artifact: str | Path, manifest: Manifest, read: bool = False) -> list[EngramTable]:
    """The Engram tables of the artifact (``engram.tables``, Engram-layer order; none without an
    ``engram`` section), each file's header checked against the manifest's record
    (``ArtifactError`` naming the file): memory-mapped, or with ``read`` read into 64-byte
    aligned memory (with a progress bar, as the weights are)."""
    d = Path(artifact)
    records = manifest.engram.tables if manifest.engram is not None else ()
    bar = _bar(sum((d / t.file).stat().st_size for t in records), "reading Engram tables") if read else None
    out = []
    try:
        for t in records:
            with SafetensorsFile(d / t.file) as st:
                problem = table_problem({n: (st.dtype(n), st.shape(n)) for n in st.names()}, t.format, t.rows,
                                        t.width)
                if problem:
                    raise ArtifactError(f"{d / t.file}: {problem}; recompile")
                arrays = _read_file(st, bar) if read else st.mapped()
            out.append(EngramTable(t.layer, t.format, arrays[ROWS], arrays.get(SCALES)))
    finally:
        if bar is not None:
            bar.close()
    return out


_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def prefetch_rows(tables: list[EngramTable], ids: np.ndarray) -> None:
    """Ask the OS to start reading, all at once, the pages of the rows ``ids`` ``[T, L_e, C]``
    names in each of the mapped ``tables`` (``madvise(MADV_WILLNEED)`` on each run of adjacent
    pages), so that a step whose table pages are cold waits for one round of reads rather than
    for one page fault after another (bench/RESULTS.md, the V4.1 slice)."""
    for e, table in enumerate(tables):
        rows = np.unique(ids[:, e]).astype(np.int64)  # ascending: so are the rows' page ranges
        for a in table.arrays:
            first = (a.ctypes.data + rows * a.strides[0]) // _PAGE
            last = (a.ctypes.data + (rows + 1) * a.strides[0] - 1) // _PAGE
            starts = np.flatnonzero(np.r_[True, first[1:] > last[:-1] + 1])  # where a run of pages begins
            ends = np.r_[starts[1:], len(rows)] - 1
            for lo, hi in zip(first[starts].tolist(), last[ends].tolist()):
                _libc.madvise(lo * _PAGE, (hi - lo + 1) * _PAGE, mmap.MADV_WILLNEED)

"""Streaming safetensors reader and writer, numpy only (no pickle, no torch).

File layout: an 8-byte little-endian u64 header length N, N bytes of UTF-8 JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the data buffer, which the offsets index. The reader loads only the header up front
and then a tensor's rows on request (or maps the file), so a multi-GB shard never sits in
memory whole. The writer lays the file out from names, dtypes and shapes alone and then
takes the tensors in pieces, in any order, from any thread.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from typing import Mapping, NamedTuple

import numpy as np

from dsv4c.artifact.lowbit import f32_from_bf16_bits
from dsv4c.errors import CheckpointError

# numpy storage dtype of each safetensors dtype; formats numpy lacks are kept as raw bits.
STORAGE_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E8M0": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "BOOL": np.dtype("?"),
}

# A real header is a few MB at most; a larger length field means a corrupt or foreign file.
MAX_HEADER_BYTES = 100 * 2**20

_REEXPORT = "the file is corrupt or truncated; re-download or re-export the checkpoint"

# Tensors whose size is a multiple of this start on such a file offset (see _layout): the
# runtime maps the files, and TVM shares an array without a copy only when it is 64-byte aligned.
ALIGNMENT = 64


class _Entry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


class SafetensorsFile:
    """One safetensors file, opened for tensor-by-tensor reads.

    The constructor reads and validates only the header; any inconsistency raises
    :class:`CheckpointError` with a one-line message naming the file (and tensor).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as error:
            raise CheckpointError(f"{self.path}: cannot open safetensors file: {error.strerror}") from None
        try:
            self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _fail(self, problem: str, name: str | None = None) -> CheckpointError:
        where = self.path if name is None else f"{self.path}: tensor {name!r}"
        return CheckpointError(f"{where}: {problem}")

    def _read_header(self) -> None:
        file_size = os.fstat(self._file.fileno()).st_size
        if file_size < 8:
            raise self._fail(f"{file_size} bytes is too short for a safetensors header length; {_REEXPORT}")
        (header_size,) = struct.unpack("<Q", self._file.read(8))
        if header_size > MAX_HEADER_BYTES:
            raise self._fail(f"header length {header_size} exceeds {MAX_HEADER_BYTES} bytes; "
                             f"this is not a safetensors file or {_REEXPORT}")
        if 8 + header_size > file_size:
            raise self._fail(f"header length {header_size} exceeds the {file_size - 8} bytes after it; {_REEXPORT}")
        try:
            header = json.loads(self._file.read(header_size).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._fail(f"header is not valid UTF-8 JSON ({error}); {_REEXPORT}") from None
        if not isinstance(header, dict):
            raise self._fail(f"header is a JSON {type(header).__name__}, not an object; {_REEXPORT}")

        self._data_start = 8 + header_size
        metadata = header.pop("__metadata__", {})
        if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise self._fail(f"__metadata__ must map strings to strings; {_REEXPORT}")
        self._metadata = metadata
        entries = {name: self._parse_entry(name, info, file_size - self._data_start)
                   for name, info in header.items()}
        self._check_no_overlap(entries)
        # Byte order, so reading names() in turn streams the file front to back.
        self._entries = dict(sorted(entries.items(), key=lambda item: item[1].begin))

    def _parse_entry(self, name: str, info, data_size: int) -> _Entry:
        if not isinstance(info, dict):
            raise self._fail(f"header entry is a JSON {type(info).__name__}, not an object; {_REEXPORT}", name)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str):
            raise self._fail(f"missing or non-string 'dtype'; {_REEXPORT}", name)
        if dtype not in STORAGE_DTYPES:
            raise self._fail(f"unsupported dtype {dtype!r} (dsv4c reads {', '.join(STORAGE_DTYPES)})", name)
        if not _is_int_list(shape):
            raise self._fail(f"'shape' must be a list of integers, got {shape!r}; {_REEXPORT}", name)
        if any(dim < 0 for dim in shape):
            raise self._fail(f"negative dimension in shape {shape}; {_REEXPORT}", name)
        if not (_is_int_list(offsets) and len(offsets) == 2):
            raise self._fail(f"'data_offsets' must be [begin, end] integers, got {offsets!r}; {_REEXPORT}", name)
        begin, end = offsets
        nbytes = math.prod(shape) * STORAGE_DTYPES[dtype].itemsize
        if end - begin != nbytes:
            raise self._fail(f"data_offsets [{begin}, {end}) hold {end - begin} bytes but {dtype} {shape} "
                             f"needs {nbytes}; {_REEXPORT}", name)
        if begin < 0 or end > data_size:
            raise self._fail(f"bytes [{begin}, {end}) lie outside the {data_size}-byte data buffer; {_REEXPORT}",
                             name)
        return _Entry(dtype, tuple(shape), begin, end)

    def _check_no_overlap(self, entries: dict[str, _Entry]) -> None:
        # Sorted by start, any overlap shows up between neighbours; empty tensors own no bytes.
        spans = sorted((entry.begin, entry.end, name) for name, entry in entries.items() if entry.end > entry.begin)
        for (_, end, name), (next_begin, _, next_name) in zip(spans, spans[1:]):
            if next_begin < end:
                raise self._fail(f"byte range overlaps that of tensor {next_name!r}; {_REEXPORT}", name)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise self._fail(f"not in this file ({len(self._entries)} tensors); "
                             "the checkpoint does not match the model configuration", name) from None

    def names(self) -> list[str]:
        """Tensor names in the order their bytes lie in the file."""
        return list(self._entries)

    def dtype(self, name: str) -> str:
        return self._entry(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def matrix_shape(self, name: str) -> tuple[int, int]:
        """The tensor seen as a matrix [rows, cols]: cols is its last axis, rows all the others."""
        shape = self._entry(name).shape
        return math.prod(shape[:-1]), (shape[-1] if shape else 1)

    def read_rows(self, name: str, start: int, stop: int, empty=np.empty) -> np.ndarray:
        """Rows ``[start, stop)`` of the tensor seen as a matrix (see matrix_shape), in its storage
        dtype, reading only their bytes into ``empty(nbytes, np.uint8)``. Safe to call from
        several threads at once."""
        row_bytes, dtype, cols = self._rows(name, start, stop)
        buffer = empty((stop - start) * row_bytes, np.uint8)
        self.read_rows_into(name, start, stop, buffer)
        return buffer.view(dtype).reshape(stop - start, cols)

    def read_rows_into(self, name: str, start: int, stop: int, out: np.ndarray) -> None:
        """Rows ``[start, stop)`` (see read_rows) into ``out``, uint8 holding exactly their bytes.
        Safe to call from several threads at once."""
        row_bytes = self._rows(name, start, stop)[0]
        if out.dtype != np.uint8 or out.nbytes != (stop - start) * row_bytes:
            raise ValueError(f"rows [{start}, {stop}) of tensor {name!r} need {(stop - start) * row_bytes} bytes, "
                             f"not a {out.dtype} array of {out.nbytes}")
        offset, done = self._data_start + self._entry(name).begin + start * row_bytes, 0
        while done < out.size:  # pread may return less than asked for
            got = os.preadv(self._file.fileno(), [out[done:]], offset + done)
            if got <= 0:
                raise self._fail(f"file ended while reading the tensor; {_REEXPORT}", name)
            done += got

    def _rows(self, name: str, start: int, stop: int) -> tuple[int, np.dtype, int]:
        """(bytes per row, storage dtype, columns) of a checked row range of the tensor."""
        rows, cols = self.matrix_shape(name)
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"rows [{start}, {stop}) of tensor {name!r} with {rows} rows")
        dtype = STORAGE_DTYPES[self._entry(name).dtype]
        return cols * dtype.itemsize, dtype, cols

    def read_raw(self, name: str, empty=np.empty) -> np.ndarray:
        """The tensor in its storage dtype (see STORAGE_DTYPES), reading only its own bytes (into
        ``empty(nbytes, np.uint8)``)."""
        return self.read_rows(name, 0, self.matrix_shape(name)[0], empty).reshape(self._entry(name).shape)

    def mapped(self) -> dict[str, np.ndarray]:
        """Every tensor as a read-only array over one memory map of the file, in its storage
        dtype: nothing is read until used, and pages the OS drops are read again on demand."""
        whole = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        out = {}
        for name, entry in self._entries.items():
            dtype = STORAGE_DTYPES[entry.dtype]
            out[name] = np.frombuffer(whole, dtype, count=math.prod(entry.shape),
                                      offset=self._data_start + entry.begin).reshape(entry.shape)
        return out

    def read_f32(self, name: str) -> np.ndarray:
        """A float tensor (F32, F16 or BF16) converted to float32."""
        dtype = self.dtype(name)
        if dtype not in ("F32", "F16", "BF16"):
            raise self._fail(f"is {dtype}, not a float tensor; read it with read_raw", name)
        raw = self.read_raw(name)
        return f32_from_bf16_bits(raw) if dtype == "BF16" else raw.astype(np.float32, copy=False)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _layout(entries: Mapping[str, tuple[str, tuple[int, ...]]],
            metadata: Mapping[str, str] | None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header of a file holding ``{name: (dtype, shape)}`` and each tensor's [begin, end).

    The data buffer has no holes (the safetensors package refuses files with gaps), so
    alignment comes from the order: the header is padded with spaces until the buffer starts
    on an ALIGNMENT boundary, tensors whose size is a multiple of ALIGNMENT come first, and
    each of the two groups is in name order."""
    header: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    sizes = {}
    for name, (dtype, shape) in entries.items():
        _check_entry(name, dtype)
        sizes[name] = math.prod(shape) * STORAGE_DTYPES[dtype].itemsize
    spans, offset = {}, 0
    for name in sorted(entries, key=lambda n: (sizes[n] % ALIGNMENT != 0, n)):
        dtype, shape = entries[name]
        spans[name] = (offset, offset + sizes[name])
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": list(spans[name])}
        offset += sizes[name]
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return header_bytes + b" " * (-(8 + len(header_bytes)) % ALIGNMENT), spans


def _check_entry(name, dtype) -> None:
    if not isinstance(name, str) or name == "__metadata__":
        raise ValueError(f"tensor names must be strings other than '__metadata__', got {name!r}")
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")


class SafetensorsWriter:
    """A safetensors file laid out up front from names, dtypes and shapes (header written,
    file sized), whose tensors are then written in pieces, in any order and from any thread.

    Writes go straight to the file at their offsets (no buffering), so writing a tensor
    holds only the piece in hand. :meth:`finish` checks that every byte was written and
    syncs; the caller decides where the file ends up (an artifact's staging directory, or
    :func:`write_safetensors`' temporary name)."""

    def __init__(self, path, entries: Mapping[str, tuple[str, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None):
        self.path = os.fspath(path)
        header, self._spans = _layout(entries, metadata)
        self._dtypes = {name: entries[name][0] for name in entries}
        self._data_start = 8 + len(header)
        self._unwritten = {name: end - begin for name, (begin, end) in self._spans.items()}
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            self._pwrite(struct.pack("<Q", len(header)), 0)
            self._pwrite(header, 8)
            os.ftruncate(self._fd, self._data_start + max((end for _, end in self._spans.values()), default=0))
        except BaseException:
            self.close()
            raise

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def write(self, name: str, array: np.ndarray, byte_offset: int = 0) -> None:
        """Write ``array`` (in the tensor's storage dtype) ``byte_offset`` bytes into tensor ``name``."""
        if name not in self._spans:
            raise ValueError(f"tensor {name!r} is not in the layout of {self.path}")
        _check_tensor(name, self._dtypes[name], array)
        begin, end = self._spans[name]
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if byte_offset < 0 or begin + byte_offset + data.size > end:
            raise ValueError(f"tensor {name!r}: {data.size} bytes at offset {byte_offset} overrun its {end - begin}")
        self._pwrite(data, self._data_start + begin + byte_offset)
        with self._lock:
            self._unwritten[name] -= data.size

    def finish(self) -> None:
        """Check that every tensor was written in full, sync the data to disk and close."""
        missing = [name for name, left in self._unwritten.items() if left]
        if missing:
            raise RuntimeError(f"{self.path}: tensor {missing[0]!r} was not written in full "
                               f"({len(missing)} such tensors)")
        os.fsync(self._fd)  # a rename or manifest that follows must not outlive the data in a crash
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _check_tensor(name, dtype, array) -> None:
    _check_entry(name, dtype)
    if not isinstance(array, np.ndarray) or array.dtype != STORAGE_DTYPES[dtype]:
        got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise ValueError(f"tensor {name!r}: {dtype} is stored as numpy {STORAGE_DTYPES[dtype]}, got {got}")


def write_safetensors(path, tensors: Mapping[str, tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``{name: (dtype, array in its storage dtype)}`` as a safetensors file.

    The file is written to ``path + ".tmp"`` and renamed into place, so ``path`` only ever
    holds a complete file; on any error the temporary file is removed.
    """
    path = os.fspath(path)
    for name, (dtype, array) in tensors.items():
        _check_tensor(name, dtype, array)
    tmp_path = path + ".tmp"
    try:
        with SafetensorsWriter(tmp_path, {n: (d, a.shape) for n, (d, a) in tensors.items()}, metadata) as file:
            for name, (_, array) in tensors.items():
                file.write(name, array)
            file.finish()
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise

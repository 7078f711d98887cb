"""Streaming safetensors reader and atomic writer, numpy only (no pickle, no torch).

File layout: an 8-byte little-endian u64 header length N, N bytes of UTF-8 JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the data buffer, which the offsets index. The reader loads only the header up front
and each tensor's own bytes on request, so a multi-GB shard never sits in memory whole.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import NamedTuple

import numpy as np

from dsv4c.errors import CheckpointError
from dsv4c.frontend.lowbit import f32_from_bf16_bits

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

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor in its storage dtype (see STORAGE_DTYPES), reading only its own bytes."""
        entry = self._entry(name)
        buffer = np.empty(entry.end - entry.begin, np.uint8)
        self._file.seek(self._data_start + entry.begin)
        if self._file.readinto(buffer) != buffer.size:
            raise self._fail(f"file ended while reading the tensor; {_REEXPORT}", name)
        return buffer.view(STORAGE_DTYPES[entry.dtype]).reshape(entry.shape)

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


def _check_tensor(name, dtype, array) -> None:
    if not isinstance(name, str) or name == "__metadata__":
        raise ValueError(f"tensor names must be strings other than '__metadata__', got {name!r}")
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
    if not isinstance(array, np.ndarray) or array.dtype != STORAGE_DTYPES[dtype]:
        got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise ValueError(f"tensor {name!r}: {dtype} is stored as numpy {STORAGE_DTYPES[dtype]}, got {got}")


def write_safetensors(path, tensors: dict[str, tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``{name: (dtype, array in its storage dtype)}`` as a safetensors file.

    Tensors are laid out in name order. The file is written to ``path + ".tmp"`` and
    renamed into place, so ``path`` only ever holds a complete file; on any error the
    temporary file is removed.
    """
    path = os.fspath(path)
    header: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    names = sorted(tensors)
    offset = 0
    for name in names:
        dtype, array = tensors[name]
        _check_tensor(name, dtype, array)
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # keeps the data buffer 8-byte aligned

    tmp_path = path + ".tmp"
    try:
        with open(tmp_path, "wb") as file:
            file.write(struct.pack("<Q", len(header_bytes)))
            file.write(header_bytes)
            for name in names:
                file.write(np.ascontiguousarray(tensors[name][1]).reshape(-1).view(np.uint8))
            file.flush()
            os.fsync(file.fileno())  # the rename must not outlive the data in a crash
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise

"""Ways to break an artifact's weight file, shared by the Python and C++ loader tests."""

import json
import os
from pathlib import Path


def flip_byte(path: Path, offset: int = -3) -> None:
    """Same size, same header: one data byte differs (only a hash finds it)."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        byte = f.read(1)
        f.seek(offset, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def corrupt_header(path: Path) -> None:
    """Same size: the header is no longer JSON."""
    blob = bytearray(path.read_bytes())
    blob[8:10] = b"[}"
    path.write_bytes(bytes(blob))


def offsets_past_the_end(path: Path) -> None:
    """Same size, a header that parses, but the last tensor's offsets point past the data."""
    blob = path.read_bytes()
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + size])
    name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 64, end + 64]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size  # the writer pads the header, so a few more digits fit
    path.write_bytes(blob[:8] + text + b" " * (size - len(text)) + blob[8 + size:])

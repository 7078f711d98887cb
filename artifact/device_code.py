"""The device code inside a GPU artifact's library (``model.so``), read without TVM or a GPU.

TVM's ``export_library`` packs the modules a host library imports (the Relax VM executable,
the CUDA or ROCm kernels) into one blob behind the exported symbol ``__tvm_ffi__library_bin``:
a little-endian u64 byte count, the import tree (two u64 vectors), then per module its type key
and, unless it is the host code itself (``_lib``), its serialized bytes. A device module's
bytes are its format (``fatbin``, ``cubin``, ``cuda`` for CUDA C++, ``hsaco``), its function
table, and its code, each length-prefixed. The build rewrites the CUDA module's code to sm_90a
machine code (``codegen.gpu``); the tests and ``scripts/kernel_resources.py`` read it back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from dsv4c.errors import DsvError

LIBRARY_SYMBOL = b"__tvm_ffi__library_bin"
GPU_MODULE_KEYS = ("cuda", "hip")  # TVM's type keys of CUDA and ROCm device modules


class LibraryFormatError(DsvError):
    """A library's packed modules are not laid out as TVM 0.27 writes them."""


class _Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def u64(self) -> int:
        if self.pos + 8 > len(self.data):
            raise LibraryFormatError("truncated TVM module blob")
        (value,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return value

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise LibraryFormatError("truncated TVM module blob")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def string(self) -> bytes:
        return self.take(self.u64())


def _string(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


@dataclass(frozen=True)
class PackedModule:
    key: str  # TVM's type key: relax.VMExecutable, _lib (the host code), cuda, hip, ...
    payload: bytes | None  # its serialized bytes; None for _lib


@dataclass(frozen=True)
class PackedImports:
    tree: bytes  # the import tree, kept as written
    modules: tuple[PackedModule, ...]

    def to_bytes(self) -> bytes:
        """The blob ``codegen.codegen_blob`` embeds: byte count, tree, modules."""
        body = self.tree + b"".join(_string(m.key.encode()) + (b"" if m.payload is None else _string(m.payload))
                                    for m in self.modules)
        return struct.pack("<Q", len(body)) + body


def unpack_imports(blob: bytes) -> PackedImports:
    """The modules of a packed blob (as ``runtime.ModulePackImportsToTensor`` returns it)."""
    reader = _Reader(blob)
    end = 8 + reader.u64()
    if end != len(blob):
        raise LibraryFormatError(f"TVM module blob says {end - 8} bytes, holds {len(blob) - 8}")
    start = reader.pos
    row_ptr = [reader.u64() for _ in range(reader.u64())]
    reader.take(8 * reader.u64())  # child indices
    tree = blob[start:reader.pos]
    modules = []
    for _ in range(max(len(row_ptr) - 1, 0)):
        key = reader.string().decode()
        modules.append(PackedModule(key, None if key == "_lib" else reader.string()))
    if reader.pos != end:
        raise LibraryFormatError(f"{end - reader.pos} bytes after the last packed module")
    return PackedImports(tree, tuple(modules))


@dataclass(frozen=True)
class DeviceModule:
    fmt: str  # fatbin / cubin (CUDA machine code), cuda (CUDA C++), ptx, hsaco (AMDGPU code object)
    functions: tuple[str, ...]  # the kernels it holds (TVM's names: a kernel symbol + "_kernel")
    function_table: bytes  # TVM's FunctionInfo map, kept as written
    code: bytes

    def to_bytes(self) -> bytes:
        return _string(self.fmt.encode()) + self.function_table + _string(self.code)

    def with_code(self, fmt: str, code: bytes) -> DeviceModule:
        return replace(self, fmt=fmt, code=code)


def device_module(payload: bytes) -> DeviceModule:
    """A CUDA / ROCm module's bytes: format, function table, code (the last field)."""
    reader = _Reader(payload)
    fmt = reader.string().decode()
    table_start = reader.pos
    functions = []
    for _ in range(reader.u64()):  # name -> FunctionInfo(name, arg dtypes, launch tags, arg tags)
        functions.append(reader.string().decode())
        reader.string()
        reader.take(4 * reader.u64())
        for _ in range(reader.u64()):
            reader.string()
        reader.take(4 * reader.u64())
    table = payload[table_start:reader.pos]
    code = reader.string()
    if reader.pos != len(payload):
        raise LibraryFormatError(f"{len(payload) - reader.pos} bytes after a {fmt} module's code")
    return DeviceModule(fmt, tuple(functions), table, code)


class ElfSection(NamedTuple):
    type: int
    addr: int
    offset: int
    size: int
    link: int
    entsize: int


def elf_sections(data: bytes, what: str) -> list[ElfSection]:
    """The section headers of a 64-bit little-endian ELF file (``what`` names it in errors)."""
    if data[:6] != b"\x7fELF\x02\x01":
        raise LibraryFormatError(f"{what} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    headers = (struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum))
    return [ElfSection(h[1], h[3], h[4], h[5], h[6], h[9]) for h in headers]


def library_imports(library: Path) -> PackedImports:
    """The packed modules of an exported library (a 64-bit little-endian ELF shared object)."""
    data = Path(library).read_bytes()
    sections = elf_sections(data, str(library))
    for symtab in (s for s in sections if s.type == 11):  # SHT_DYNSYM: the exported symbols
        names = sections[symtab.link].offset
        for pos in range(symtab.offset, symtab.offset + symtab.size, symtab.entsize):
            name, _, _, shndx, value, _ = struct.unpack_from("<IBBHQQ", data, pos)
            if data[names + name:data.index(b"\0", names + name)] == LIBRARY_SYMBOL:
                start = value - sections[shndx].addr + sections[shndx].offset
                size, = struct.unpack_from("<Q", data, start)
                return unpack_imports(data[start:start + 8 + size])
    raise LibraryFormatError(f"{library} exports no {LIBRARY_SYMBOL.decode()}: not a TVM library with device code")


def device_modules(library: Path) -> list[tuple[str, DeviceModule]]:
    """(type key, module) of every CUDA / ROCm module a library holds; empty for a CPU library."""
    return [(m.key, device_module(m.payload)) for m in library_imports(library).modules if m.key in GPU_MODULE_KEYS]

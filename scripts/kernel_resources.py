#!/usr/bin/env python3
"""Per-kernel register use and spills of a GPU artifact's device code, without a GPU.

    scripts/kernel_resources.py ARTIFACT [--json]

sm90: the library's fatbin through NVIDIA's ``cuobjdump --dump-resource-usage`` (PATH, or the
``nvidia-cuda-cuobjdump`` wheel): registers, stack frame, shared and local memory per thread.
cuobjdump does not count spills; a spill needs a stack slot, so a kernel with a 0-byte stack frame
has none (``spills`` 0), and one with a stack frame may spill or keep local arrays there
(``spills`` unknown: ``?`` / null).
gfx942 / gfx950: the AMDGPU code object's metadata note (``amdhsa.kernels``), read here:
VGPRs, SGPRs, AGPRs, their spill counts (``spills`` is their sum), scratch and LDS bytes.

Kernels are named as the library holds them: the manifest's kernel symbol + ``_kernel``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from dsv4c.artifact.device_code import LibraryFormatError, device_modules, elf_sections
from dsv4c.artifact.manifest import read_manifest
from dsv4c.errors import ArtifactError, DsvError, UsageError

GPU_TARGETS = ("sm90", "gfx942", "gfx950")


def cuobjdump() -> str:
    """NVIDIA's cuobjdump: on PATH, else from the nvidia-cuda-cuobjdump wheel (nvidia/cu*/bin)."""
    found = shutil.which("cuobjdump")
    spec = importlib.util.find_spec("nvidia")
    if found is None and spec is not None:
        found = next((str(p) for root in spec.submodule_search_locations for p in Path(root).glob("cu*/bin/cuobjdump")),
                     None)
    if found is None:
        raise UsageError("sm90 kernel resources need NVIDIA's cuobjdump; pip install nvidia-cuda-cuobjdump")
    return found


def cuda_resources(fatbin: bytes) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".fatbin") as f:
        f.write(fatbin)
        f.flush()
        out = subprocess.run([cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    rows = []
    # " Function NAME:\n  REG:32 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:556 ..."
    for name, usage in re.findall(r"^\s*Function (\S+):\s*\n\s*(REG:.*)$", out, re.M):
        fields = dict(item.split(":") for item in usage.split())
        stack = int(fields["STACK"])
        rows.append({"kernel": name, "registers": int(fields["REG"]), "spills": 0 if stack == 0 else None,
                     "stack": stack, "shared": int(fields["SHARED"]), "local": int(fields["LOCAL"])})
    return rows


def _msgpack(data: bytes, pos: int = 0):
    """(value, next position) of one MessagePack value: the format of AMDGPU metadata notes."""
    b = data[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if b >= 0xE0:
        return b - 0x100, pos
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        n, pos = (b & 0x0F, pos) if b <= 0x8F else _length(data, pos, 2 if b == 0xDE else 4)
        out = {}
        for _ in range(n):
            key, pos = _msgpack(data, pos)
            out[key], pos = _msgpack(data, pos)
        return out, pos
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        n, pos = (b & 0x0F, pos) if b <= 0x9F else _length(data, pos, 2 if b == 0xDC else 4)
        out = []
        for _ in range(n):
            value, pos = _msgpack(data, pos)
            out.append(value)
        return out, pos
    if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6):
        size = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}
        n, pos = (b & 0x1F, pos) if b <= 0xBF else _length(data, pos, size[b])
        raw = data[pos:pos + n]
        return (raw if b >= 0xC4 and b <= 0xC6 else raw.decode()), pos + n
    scalars = {0xCC: "B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: "b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
               0xCA: ">f", 0xCB: ">d"}
    if b in scalars:
        (value,) = struct.unpack_from(scalars[b], data, pos)
        return value, pos + struct.calcsize(scalars[b])
    if b in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[b], pos
    raise LibraryFormatError(f"unsupported MessagePack type 0x{b:02x} in an AMDGPU metadata note")


def _length(data: bytes, pos: int, size: int) -> tuple[int, int]:
    return int.from_bytes(data[pos:pos + size], "big"), pos + size


NT_AMDGPU_METADATA = 32


def amdgpu_kernels(code_object: bytes) -> list[dict]:
    """``amdhsa.kernels`` of an AMDGPU code object's metadata note (ELF SHT_NOTE, owner AMDGPU)."""
    for note in (s for s in elf_sections(code_object, "the AMDGPU code object") if s.type == 7):
        pos = note.offset
        while pos < note.offset + note.size:
            namesz, descsz, kind = struct.unpack_from("<III", code_object, pos)
            name_at = pos + 12
            desc_at = name_at + (namesz + 3) // 4 * 4
            if kind == NT_AMDGPU_METADATA and code_object[name_at:name_at + namesz].rstrip(b"\0") == b"AMDGPU":
                return _msgpack(code_object, desc_at)[0]["amdhsa.kernels"]
            pos = desc_at + (descsz + 3) // 4 * 4
    raise LibraryFormatError("the AMDGPU code object has no AMDGPU metadata note")


def amdgpu_resources(code_object: bytes) -> list[dict]:
    return [{"kernel": k[".name"], "registers": k[".vgpr_count"],
             "spills": k[".vgpr_spill_count"] + k[".sgpr_spill_count"], "sgprs": k[".sgpr_count"],
             "agprs": k.get(".agpr_count", 0), "vgpr_spills": k[".vgpr_spill_count"],
             "sgpr_spills": k[".sgpr_spill_count"], "scratch": k[".private_segment_fixed_size"],
             "lds": k[".group_segment_fixed_size"]} for k in amdgpu_kernels(code_object)]


def kernel_resources(artifact: Path) -> tuple[str, list[dict]]:
    """(target, one row per kernel) of a GPU artifact."""
    manifest = read_manifest(artifact)
    target = manifest.target
    if target not in GPU_TARGETS:
        raise ArtifactError(f"{artifact} is an artifact for {target}: it holds no GPU kernels (only "
                            f"{', '.join(GPU_TARGETS)} artifacts do)")
    rows = []
    for _, module in device_modules(artifact / manifest.vm.library):
        if module.fmt in ("fatbin", "cubin"):
            rows += cuda_resources(module.code)
        elif module.fmt == "hsaco":
            rows += amdgpu_resources(module.code)
        else:
            raise ArtifactError(f"{artifact}: its device code is {module.fmt}, not machine code; recompile it")
    return target, sorted(rows, key=lambda row: row["kernel"])


def table(rows: list[dict]) -> str:
    columns = list(rows[0]) if rows else ["kernel"]
    cells = [columns] + [["?" if row[c] is None else str(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))) for line in cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--json", action="store_true", help="print {target, kernels: [rows]} as JSON")
    args = parser.parse_args(argv)
    try:
        target, rows = kernel_resources(args.artifact)
    except (DsvError, subprocess.CalledProcessError) as e:
        print(f"kernel_resources: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(json.dumps({"target": target, "kernels": rows}, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

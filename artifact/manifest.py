"""The artifact directory: what ``dsv4c compile`` writes and the runtime loads.

::

    ART/
      manifest.json          format version, target, numerics, model description, quant plan,
                             pool geometry, entry points, TVM version, weight files, and the
                             size and sha256 of every file
      weights.safetensors    weights in the target's layout (IR names); several
                             weights-0000i-of-0000N.safetensors when they exceed one file
      weights.safetensors.index.json   which file holds which tensor
      kernels.so             compiled kernels (TVM targets only)
      program.json           the IR program the runtime executes
      tokenizer.json         copied from the model directory when it has one
      tokenizer_config.json  copied likewise (its chat_template serves chat requests)

Written into a temporary sibling directory and renamed at the end, so an interrupted
compile leaves no artifact. A killed compile cannot remove its temporary directory; the next
compile to the same output removes it (a live compile holds a lock on its own). Loading
checks the format version, that every file is there with its recorded size, and the sha256 of
every file but the weight shards (:func:`read_manifest`: the library, the program, constants
and tokenizer files, milliseconds; the weight loader then checks each shard's header), and
that this host can run the target; hashing every byte is :func:`verify_artifact`, run on
request (``dsv4c verify``, ``generate --verify``). Any mismatch is an :class:`ArtifactError`
with a one-line message naming the file.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from dsv4c.errors import ArtifactError

FORMAT_VERSION = 4
MANIFEST = "manifest.json"
WEIGHTS_INDEX = "weights.safetensors.index.json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)  # hashlib releases the GIL for large updates: files hash in parallel
    return h.hexdigest()


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def _still_at(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the directory open as ``fd`` (not removed or renamed since)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _sweep_stale_partials(out: Path, log: Callable[[str], Any]) -> None:
    """Remove the partial directories of earlier compiles to ``out`` that no live compile holds:
    a compile holds an exclusive flock on its own for its lifetime, and a killed one's lock is
    released by the kernel."""
    removed = []
    for partial in sorted(out.parent.glob(glob.escape(_partial_prefix(out)) + "*")):
        try:
            fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _still_at(fd, partial):  # not finished and renamed to ``out`` since we opened it
                shutil.rmtree(partial)
                removed.append(partial.name)
        except OSError:
            continue  # held by a live compile, or a filesystem without flock: cannot tell, keep it
        finally:
            os.close(fd)
    if removed:
        log(f"removed {len(removed)} partial output(s) of interrupted compiles to {out}: {', '.join(removed)}")


def _held_partial(out: Path) -> tuple[Path, int | None]:
    """A new partial directory for ``out`` and the descriptor whose flock marks it live."""
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(out), dir=out.parent))
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            # Blocks only while another compile's sweep, which found the directory before this
            # lock, removes it; then the loop makes a new one.
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            # A filesystem without flock: no sweep can lock the directory either, so none removes it.
            os.close(fd)
            return tmp, None
        if _still_at(fd, tmp):
            return tmp, fd
        os.close(fd)


def _hash_all(paths: list[Path]) -> list[str]:
    """sha256 of each file, several files at a time."""
    with ThreadPoolExecutor(max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(sha256_of, paths))


@contextmanager
def staging(out: str | os.PathLike, log: Callable[[str], Any] = print) -> Iterator[Path]:
    """A temporary directory that becomes ``out`` only if the block completes; first removes
    what killed compiles to ``out`` left behind (and says so through ``log``)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArtifactError(f"{out}: already exists; remove it or choose another output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_partials(out, log)
    tmp, lock = _held_partial(out)
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)  # after the rename: a sweep never sees this directory unlocked under its partial name


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Record the size and sha256 of every file already in ``directory`` and write the manifest last."""
    paths = [p for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST]
    files = {p.name: {"bytes": p.stat().st_size, "sha256": digest} for p, digest in zip(paths, _hash_all(paths))}
    full = {"format_version": FORMAT_VERSION, **manifest, "files": files}
    (directory / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=False))


def _listed_files(manifest: dict[str, Any], path: Path) -> dict[str, dict[str, Any]]:
    files = manifest.get("files")
    entry_ok = lambda e: (isinstance(e, dict) and type(e.get("bytes")) is int  # noqa: E731
                          and isinstance(e.get("sha256"), str))
    if not isinstance(files, dict) or not all(entry_ok(e) for e in files.values()):
        raise ArtifactError(f"{path}: manifest has no file list; recompile")
    return files


def read_manifest(directory: str | os.PathLike, verify: bool = False) -> dict[str, Any]:
    """The manifest of an artifact, checked: format version, every listed file present with its
    recorded size, and the sha256 of every file but the weight shards (small: the shards are
    not read). ``verify`` hashes every byte instead (see :func:`verify_artifact`)."""
    d = Path(directory)
    path = d / MANIFEST
    if not d.is_dir():
        raise ArtifactError(f"{d}: not an artifact directory (run `dsv4c compile` first)")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{d}: no {MANIFEST}; not a dsv4c artifact or an interrupted compile") from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path}: unreadable manifest ({e.__class__.__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        got = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ArtifactError(f"{d}: artifact format version {got!r}, this runtime reads {FORMAT_VERSION}; recompile")
    files = _listed_files(manifest, path)
    for name, entry in files.items():
        f = d / name
        if not f.is_file():
            raise ArtifactError(f"{d}: file {name} listed in the manifest is missing")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise ArtifactError(f"{d}: {name} has {size} bytes, the manifest records {entry['bytes']} (truncated or "
                                "modified); compile again or copy the artifact again")
    # Everything but the weight shards is small (the library, the program, constants, tokenizer
    # files): hashed at every load, in milliseconds, so a damaged library is named here rather
    # than failing inside TVM. The shards keep the size and header checks unless ``verify``.
    weights = () if verify else set((manifest.get("weights") or {}).get("files") or ())
    _check_hashes(d, {name: entry for name, entry in files.items() if name not in weights})
    return manifest


def _check_hashes(d: Path, files: dict[str, dict[str, Any]]) -> None:
    """Each file's sha256 against the manifest's, several files at a time, in name order."""
    names = sorted(files)
    for name, digest in zip(names, _hash_all([d / n for n in names])):
        if digest != files[name]["sha256"]:
            raise ArtifactError(f"{d}: {name} does not match its sha256 in the manifest (modified or corrupt)")


def verify_artifact(directory: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """Hash every file of the artifact (several at a time, each once) against the manifest: the
    manifest and the bytes checked. Raises :class:`ArtifactError` naming the first file that
    does not match."""
    manifest = read_manifest(directory, verify=True)
    return manifest, sum(entry["bytes"] for entry in manifest["files"].values())

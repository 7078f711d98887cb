"""The artifact directory: what ``dsv4c compile`` writes and the runtimes load, and its
manifest as one typed record, :class:`Manifest` (every key: docs/artifact.md).

::

    ART/
      manifest.json          format version, target, numerics, model description, quant plan,
                             pool geometry, entry points, TVM version, weight files, and the
                             size and sha256 of every file (:class:`Manifest`)
      weights.safetensors    weights in the target's layout (IR names); several
                             weights-0000i-of-0000N.safetensors when they exceed one file
      weights.safetensors.index.json   which file holds which tensor
      model.so               the compiled step (compiled targets only)
      constants.safetensors  the compiled step's constants (compiled targets only)
      program.json           the IR program after the passes
      tokenizer.json         copied from the model directory when it has one
      tokenizer_config.json  copied likewise (its chat_template serves chat requests)
      engram_hash.safetensors, engram-table-<L>.safetensors   a V4.1 model's Engram hash
                             constants and each Engram layer's table (``engram``)

(names: :mod:`dsv4c.artifact.file_names`). Written into a temporary sibling directory and
renamed at the end, so an interrupted compile leaves no artifact. A killed compile cannot
remove its temporary directory; the next compile to the same output removes it (a live compile
holds a lock on its own). Loading checks the format version, the manifest's keys and types,
that every file is there with its recorded size, and the sha256 of every file but the weight
shards and Engram tables (:func:`read_manifest`: the library, the program, constants and
tokenizer files, milliseconds; the loaders then check each shard's and table's header); the
runtime then checks that this host can run the target. Hashing every byte is :func:`verify_artifact`, run on request
(``dsv4c verify``, ``generate --verify``, ``serve --verify``, with a progress bar on a terminal);
:func:`check_large_files` hashes the files a load skipped (``serve``'s background check). Any
mismatch is an :class:`ArtifactError` with a one-line message naming the file or the key.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from dsv4c.artifact.file_names import MANIFEST
from dsv4c.artifact.json_record import parse_record, to_json
from dsv4c.errors import ArtifactError

# The one version of the artifact format: raise it when a key changes meaning or shape (the
# runtimes refuse any other: "recompile"), and say what changed in docs/artifact.md.
FORMAT_VERSION = 5


def sha256_of(path: Path, hashed: Callable[[int], Any] = lambda _n: None) -> str:
    """The file's sha256; ``hashed`` is called with each chunk's size (a progress bar's update)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)  # hashlib releases the GIL for large updates: files hash in parallel
            hashed(len(chunk))
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


def _hash_all(paths: list[Path], workers: int | None = None,
              hashed: Callable[[int], Any] = lambda _n: None) -> list[str]:
    """sha256 of each file, ``workers`` files at a time (default: one per CPU)."""
    with ThreadPoolExecutor(max(1, min(len(paths), workers or os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda p: sha256_of(p, hashed), paths))


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


# --------------------------------------------------------------------------- the manifest


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    MALFORMED = "manifest has no file list"  # the C++ host's words for any damage in ``files``
    bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class RankWeights:
    index: str  # the file naming which weight file holds which tensor
    files: tuple[str, ...]  # the weight files, in order


@dataclass(frozen=True, kw_only=True)
class Weights:
    """The weight files: one device's (``index`` and ``files``), or of a multi-rank artifact
    every rank's (``ranks``) and all their files (``files``)."""
    MALFORMED = "manifest has no weight file list"  # the C++ host's words
    index: str | None = None
    files: tuple[str, ...]
    ranks: tuple[RankWeights, ...] | None = None

    def of_rank(self, rank: int) -> RankWeights | None:
        """Rank ``rank``'s index and files (rank 0 of a one-device artifact: all of them)."""
        if self.ranks is not None:
            return self.ranks[rank] if 0 <= rank < len(self.ranks) else None
        return RankWeights(index=self.index, files=self.files) if rank == 0 and self.index is not None else None


@dataclass(frozen=True, kw_only=True)
class EngramTableFile:
    """One Engram layer's table file (``artifact.engram_tables``)."""
    layer: int  # the decoder layer
    file: str
    rows: int
    width: int  # columns of a row (the config's engram_head_dim)
    format: str  # engram_tables.TABLE_FORMATS


@dataclass(frozen=True, kw_only=True)
class EngramFiles:
    """A V4.1 model's Engram files: the hash constants (None: compiled without a tokenizer, so
    it cannot run) and the tables, in Engram-layer order (none: compiled with --no-weights)."""
    hash: str | None
    tables: tuple[EngramTableFile, ...]


@dataclass(frozen=True, kw_only=True)
class EntryPoint:
    inputs: tuple[str, ...]  # "name:dtype[shape]"
    outputs: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """What was built: none on the reference target, ``mcpu`` / ``cpu_features`` on llvm,
    ``device_code`` on GPU targets (``TargetInfo.library_facts``)."""
    count: int | None = None  # distinct kernels
    build_seconds: float | None = None
    mcpu: str | None = None  # the LLVM CPU the code is built for
    cpu_features: tuple[str, ...] | None = None  # instruction sets it may use, /proc/cpuinfo spelling
    device_code: str | None = None  # "fatbin sm_90a", "hsaco gfx942", ...


@dataclass(frozen=True, kw_only=True)
class VmPoolTensor:
    name: str  # ``artifact.pool.PoolTensor.to_json``
    rows: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, kw_only=True)
class VmProfile:
    kernels: tuple[str, ...]  # the library's kernel symbols
    calls: dict[str, tuple[Any, ...]]  # per entry function its kernel calls as runs [families, count]


@dataclass(frozen=True, kw_only=True)
class VmDspark:
    """The DSpark drafter's entry functions' arguments and results (``dspark_draft_*``, ``dspark_markov_*``)."""
    draft_inputs: tuple[str, ...]
    draft_outputs: tuple[str, ...]
    markov_inputs: tuple[str, ...]
    markov_outputs: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Vm:
    """The compiled step (``codegen.build.build_step``; docs/artifact.md, "The compiled step")."""
    library: str
    functions: tuple[str, ...]
    inputs: tuple[str, ...]
    mtp_inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...]  # the params tuple: stored weight and constant names
    pool: tuple[VmPoolTensor, ...]
    entry_ratios: tuple[int, ...]
    max_step_tokens: int
    decode_max_tokens: int
    cuda_graph: bool
    pool_functions: dict[str, str] | None = None  # by role; absent in artifacts built before them
    profile: VmProfile | None = None  # absent in artifacts built before the profiler
    dspark: VmDspark | None = None  # a model with a DSpark drafter only
    image_inputs: tuple[str, ...] = ()  # a model that sees images: the prefill function's, after ``inputs``
    constants: str


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """``manifest.json``, every key (docs/artifact.md). ``model``, ``quant_plan`` and
    ``pool_geometry`` are kept as the JSON their own modules write and parse
    (``ModelConfig.to_json_dict`` / ``from_json_dict``, ``QuantPlan.to_json``,
    ``PoolGeometry.summary`` / ``from_summary``); :func:`dsv4c.artifact.directory.open_artifact`
    parses them."""
    dsv4c_version: str
    tvm_version: str
    target: str
    numerics: str
    kv_cache_dtype: str
    model_name: str
    model: dict[str, Any]
    has_weights: bool
    weights: Weights | None  # None: compiled with --no-weights
    engram: EngramFiles | None = None  # a model with Engram layers only
    tensor_parallel: int = 1  # ranks, one process each
    expert_parallel: bool | None = None  # multi-rank artifacts: whole experts per rank
    quant_plan: dict[str, Any]
    pool_geometry: dict[str, Any]
    entry_points: dict[str, EntryPoint]
    kernels: Kernels
    vm: Vm | None = None  # compiled targets
    # A V4.1 model's vision tower compiled as encode_image: artifact.vision's geometry, "tower"
    # and "function" (compiled targets with a vision_config only).
    vision: dict[str, Any] | None = None
    files: dict[str, FileRecord]  # every other file; write_manifest records them

    def to_json(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, **to_json(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> "Manifest":
        """The manifest of format version :data:`FORMAT_VERSION` in ``d``, checked key by key."""
        return parse_record(cls, {k: v for k, v in d.items() if k != "format_version"}, where)

    def weight_files(self) -> tuple[str, ...]:
        """Every weight file of every rank (none without weights)."""
        return self.weights.files if self.weights is not None else ()

    def engram_table_files(self) -> tuple[str, ...]:
        """The Engram table files (none for a model without Engram layers or weights)."""
        return tuple(t.file for t in self.engram.tables) if self.engram is not None else ()


def write_manifest(directory: Path, manifest: Manifest) -> Manifest:
    """Write ``manifest`` last, its ``files`` the size and sha256 of every file already in
    ``directory``; the manifest as a reader reads it back (checked here too)."""
    paths = [p for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST]
    files = {p.name: FileRecord(bytes=p.stat().st_size, sha256=digest) for p, digest in zip(paths, _hash_all(paths))}
    text = json.dumps(replace(manifest, files=files).to_json(), indent=2, sort_keys=False)
    written = Manifest.from_json(json.loads(text), str(directory / MANIFEST))
    (directory / MANIFEST).write_text(text)
    return written


def read_manifest(directory: str | os.PathLike, verify: bool = False) -> Manifest:
    """The manifest of an artifact, checked: format version, keys and types, every listed file
    present with its recorded size, and the sha256 of every file but the weight shards and Engram
    tables (small: those are not read). ``verify`` hashes every byte instead (see
    :func:`verify_artifact`)."""
    d = Path(directory)
    path = d / MANIFEST
    if not d.is_dir():
        raise ArtifactError(f"{d}: not an artifact directory (run `dsv4c compile` first)")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{d}: no {MANIFEST}; not a dsv4c artifact or an interrupted compile") from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path}: unreadable manifest ({e.__class__.__name__})") from None
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        got = raw.get("format_version") if isinstance(raw, dict) else None
        raise ArtifactError(f"{d}: artifact format version {got!r}, this runtime reads {FORMAT_VERSION}; recompile")
    manifest = Manifest.from_json(raw, str(path))
    for name, entry in manifest.files.items():
        f = d / name
        if not f.is_file():
            raise ArtifactError(f"{d}: file {name} listed in the manifest is missing")
        size = f.stat().st_size
        if size != entry.bytes:
            raise ArtifactError(f"{d}: {name} has {size} bytes, the manifest records {entry.bytes} (truncated or "
                                "modified); compile again or copy the artifact again")
    # Everything but the weight shards and Engram tables is small (the library, the program,
    # constants, tokenizer files): hashed at every load, in milliseconds, so a damaged library is
    # named here rather than failing inside TVM. The large files keep the size and header checks
    # unless ``verify``.
    large = () if verify else _large_files(manifest)
    _check_hashes(d, {name: entry for name, entry in manifest.files.items() if name not in large}, progress=verify)
    return manifest


def _large_files(manifest: Manifest) -> set[str]:
    return {*manifest.weight_files(), *manifest.engram_table_files()}


def _check_hashes(d: Path, files: dict[str, FileRecord], workers: int | None = None, progress: bool = False) -> None:
    """Each file's sha256 against the manifest's, ``workers`` files at a time, in name order;
    ``progress``: a bar of the bytes hashed on stderr (on a terminal, once it takes a second)."""
    from tqdm import tqdm

    names = sorted(files)
    with tqdm(total=sum(files[n].bytes for n in names), desc="checking sha256", unit="B", unit_scale=True,
              unit_divisor=1024, leave=False, delay=1.0, disable=None if progress else True) as bar:
        digests = _hash_all([d / n for n in names], workers, bar.update)
    for name, digest in zip(names, digests):
        if digest != files[name].sha256:
            raise ArtifactError(f"{d}: {name} does not match its sha256 in the manifest (modified or corrupt)")


def verify_artifact(directory: str | os.PathLike) -> tuple[Manifest, int]:
    """Hash every file of the artifact (several at a time, each once) against the manifest: the
    manifest and the bytes checked. Raises :class:`ArtifactError` naming the first file that
    does not match."""
    manifest = read_manifest(directory, verify=True)
    return manifest, sum(entry.bytes for entry in manifest.files.values())


def check_large_files(directory: str | os.PathLike, manifest: Manifest) -> None:
    """Hash the files :func:`read_manifest` does not (the weight shards and Engram tables), one at a
    time, against ``manifest`` (as read from ``directory``); after both, every file is checked.
    Raises :class:`ArtifactError` naming the first file that does not match."""
    _check_hashes(Path(directory), {name: manifest.files[name] for name in _large_files(manifest)}, workers=1)

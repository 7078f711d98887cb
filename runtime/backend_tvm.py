"""The TVM backend: one call of the artifact's compiled step per engine step.

The artifact's library holds Relax entry functions (``decode``, ``prefill``) that run a whole
step on the artifact's device (the CPU for llvm artifacts, a GPU for sm90 / gfx942 / gfx950):
this backend opens the library, makes the VM, binds the weights and the KV pool tensors once,
and per step uploads the step's compact inputs (O(tokens + requests) integers, see
``codegen.relax_step``) and reads back the requested logits. Nothing here walks the IR. On the
CPU the pool tensors are the :class:`KVPool`'s numpy arrays, shared zero-copy through DLPack.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from dsv4c import targets
from dsv4c.artifact.engram_tables import EngramTable, table_inputs
from dsv4c.artifact.file_names import MANIFEST
from dsv4c.artifact.manifest import Kernels, Manifest
from dsv4c.artifact.pool import ENVELOPE_TOKENS, context_bucket
from dsv4c.artifact.pool_rows import IndexRowCodec
from dsv4c.artifact.step_requests import request_groups
from dsv4c.artifact.vision import read_vision_manifest
from dsv4c.artifact.safetensors_io import SafetensorsFile
from dsv4c.errors import ArtifactError, UsageError
from dsv4c.runtime import tvm_runtime as rt
from dsv4c.runtime.backend import Backend, StepImages
from dsv4c.runtime.kv_pool import KVPool, aligned_empty
from dsv4c.runtime.weights import open_engram_tables, open_weights, prefetch_rows, reads_weights


NO_ROW = np.array([-1], np.int32)  # a pool tensor's row list when a save names none of its rows


# How often a CPU backend gives back the buffers its allocators keep (rt.release_cached_memory):
# the next step then allocates and faults in its buffers again, a few tens of milliseconds for a
# large model's prefill, well under 1% at this interval.
RELEASE_EVERY_S = 30.0


class TvmBackend(Backend):
    # Whether speculative decoding saves and restores pool rows through the artifact's pool
    # functions (``codegen.relax_step.emit_pool_functions``) on the device rather than in the
    # KVPool's arrays: always off the host, where those arrays are not the pool. Tests set it on
    # the class to run the device path on a CPU artifact.
    device_rows = False
    # Whether a step's Engram rows are gathered on the host (per table the distinct rows the
    # step's ids name, uploaded with its inputs, and the ids remapped into them) rather than read
    # by the step from the whole tables: always off the host, where the tables stay in host
    # memory. Tests set it on the class to run that path on a CPU artifact.
    engram_host_gather = False

    def __init__(self, artifact: Path, manifest: Manifest, pool: KVPool, device, weights_mode: str = "auto",
                 rank: int = 0, engram_memory: str = "map"):
        """``rank``: which rank's weights of a multi-rank artifact to bind (``runtime.tensor_parallel``);
        ``engram_memory``: "map" or "read" the Engram tables (``runtime.weights.open_engram_tables``)."""
        self.device = device
        self.on_host = rt.on_host(device)
        vm = manifest.vm
        if self.on_host:
            check_cpu(artifact, manifest.kernels)
            check_subnormals(artifact)
            use_physical_cores()
        self.vm = rt.load_vm(artifact / vm.library, device)
        self.functions = {name: self.vm[name] for name in vm.functions}
        # The MTP layer's entry functions, when the model has one (``codegen.relax_step.entry_functions``).
        self.has_mtp = "mtp0_decode" in self.functions
        # DSpark's block drafter, when the model has one (``vm.dspark``); its Markov function
        # returns confidence logits only where the checkpoint has a confidence head.
        self.has_dspark = "dspark_draft_decode" in self.functions
        self.dspark_confidence = bool(manifest.model.get("dspark_confidence_head"))
        self.decode_max_tokens, self.max_step_tokens = vm.decode_max_tokens, vm.max_step_tokens
        # A model that sees images: its prefill function also takes the step's image rows, and
        # runs every step with an image position (the decode function takes none).
        self.no_image_rows = np.zeros((1, manifest.model["hidden_size"]), np.float32) if vm.image_inputs else None
        self.entry_ratios = vm.entry_ratios
        # Decode steps replaying CUDA graphs cover their context's bucket (artifact.pool.context_bucket).
        self.context_buckets = vm.cuda_graph
        self.pool = pool
        # Weights mapped from their shards or read into memory (``weights_mode``, see
        # runtime.weights); on the CPU shared with the kernels as they are. Constants from theirs.
        self.reads_weights = reads_weights(artifact, manifest, weights_mode, self.on_host)
        weights = dict(open_weights(artifact, manifest, read=self.reads_weights, rank=rank))
        with SafetensorsFile(artifact / vm.constants) as st:
            weights.update((name, st.read_raw(name)) for name in st.names())
        missing = [name for name in vm.params if name not in weights]
        if missing:
            raise ArtifactError(f"{artifact}: the weights lack {missing[0]!r} ({len(missing)} tensors the step "
                                "reads); recompile with weights")
        # ffi Arrays made once: a Python list would be converted on every call.
        self.params = rt.tvm_ffi.convert([self._upload(weights[name]) for name in vm.params])
        self.pool_tensors = rt.tvm_ffi.convert([self._pool_tensor(self.pool.tensors[p.name]) for p in vm.pool])
        self.device_rows = self.device_rows or not self.on_host
        self.engram_tables = open_engram_tables(artifact, manifest, read=engram_memory == "read")
        check_table_inputs(artifact, vm.inputs, self.engram_tables)
        self.engram_host_gather = self.engram_host_gather or not self.on_host
        self.engram_mapped = engram_memory == "map"  # its pages may be cold: prefetched each step
        # On the CPU the step reads the whole tables, shared with the kernels as they are.
        self.whole_tables = () if self.engram_host_gather else \
            tuple(self._upload(a) for t in self.engram_tables for a in t.arrays)
        # An artifact compiled before the pool functions existed has none (``check_pool_functions``).
        self.pool_functions = {role: self.vm[name] for role, name in (vm.pool_functions or {}).items()}
        self._artifact = artifact
        self._pool_names = [p.name for p in vm.pool]
        # What the last step uploaded and read back (a test checks they stay compact).
        self.uploaded_ints = self.read_back = 0
        self.last_step: dict[str, int] = {}
        # The last streams of the last step and of the last draft, left on the device for the next draft;
        # the head's hidden rows y of the last DSpark draft (with its rows' positions and requests),
        # for its Markov function.
        self.step_streams = self.draft_streams = None
        self.dspark_rows = self.dspark_block = None
        # A V4.1 vision tower compiled as its own function (artifact.vision; docs/vision.md).
        self.vision = read_vision_manifest(manifest.vision) if manifest.vision is not None else None
        self.has_vision = self.vision is not None
        self.released_at = time.monotonic()

    # ------------------------------------------------------------------ memory
    def _upload(self, a: np.ndarray):
        """A host array as a tensor on the device (zero-copy on the CPU when DLPack can share it)."""
        a = np.asarray(a)
        if self.on_host:
            if not (a.flags.c_contiguous and a.ctypes.data % 64 == 0):
                aligned = aligned_empty(a.shape, a.dtype)
                aligned[...] = a
                a = aligned
            return rt.from_numpy(a)
        return rt.to_device(a, self.device)

    def _pool_tensor(self, a: np.ndarray):
        """A pool tensor on the device: the KVPool's own array on the CPU, a device copy otherwise."""
        return rt.from_numpy(a) if self.on_host else rt.to_device(a, self.device)

    # ------------------------------------------------------------------ pool rows
    def check_pool_functions(self) -> None:
        """Refuse an artifact without the pool functions (``vm.pool_functions``: save, restore)."""
        if set(self.pool_functions) != {"save", "restore"}:
            raise ArtifactError(f"{self._artifact}: its library lacks the pool save / restore functions (compiled "
                                "by an older dsv4c) that speculative decoding on its device needs; recompile it")

    def save_rows(self, state: list[tuple[np.ndarray, tuple]]):
        """``KVPool.save`` on the device: a copy of the rows of a ``KVPool.position_state``, made by
        the artifact's pool_save; for :meth:`restore_rows`."""
        rows = rt.tvm_ffi.convert([self._upload(r) for r in pool_function_rows(self.pool, self._pool_names, state)])
        return rows, self.pool_functions["save"](self.pool_tensors, rows)

    def restore_rows(self, saved) -> None:
        """``KVPool.restore`` on the device: rows saved by :meth:`save_rows` put back."""
        rows, values = saved
        self.pool_functions["restore"](self.pool_tensors, rows, values)

    # ------------------------------------------------------------------ step
    def _run(self, prefix: str, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
             logit_rows: np.ndarray | None, stream_rows: np.ndarray | None = None, chain: bool = False,
             second: bool = False, engram_rows: np.ndarray | None = None, images: StepImages | None = None):
        """Call entry function ``<prefix>decode`` or ``<prefix>prefill``; the logits of ``logit_rows``
        (``second``: and its second output, read back too)."""
        n = len(tokens)
        if n > self.max_step_tokens:
            raise UsageError(f"a step of {n} tokens exceeds the artifact's max_step_tokens ({self.max_step_tokens})")
        positions = np.asarray(positions, np.int32)
        decode = n <= self.decode_max_tokens and images is None
        inputs = step_inputs(self.pool, positions, np.asarray(seq_ids), self.entry_ratios,
                             bucketed=decode and self.context_buckets)
        rows = np.arange(n, dtype=np.int32) if logit_rows is None else np.asarray(logit_rows, np.int32)
        # A step that needs no logits (a prefill chunk) still computes one row: no empty tensors.
        arrays = [np.asarray(tokens, np.int32), positions, *inputs[:3], rows if len(rows) else np.array([n - 1], np.int32)]
        self.uploaded_ints = sum(a.size for a in arrays) + len(inputs[3])
        self.last_step = {"tokens": n, "requests": len(inputs[1]), "blocks": inputs[2].shape[1], "logit_rows": len(rows)}
        name = prefix + ("decode" if decode else "prefill")
        image_inputs = {}
        if self.no_image_rows is not None and name == "prefill":
            image_inputs = {"image_rows": self.no_image_rows, "image_index": np.full(n, -1, np.int32)} \
                if images is None else {"image_rows": images.rows, "image_index": images.index}
        logits, other = self.call(name, arrays, inputs[3], stream_rows, chain, engram_rows, **image_inputs)
        logits = rt.to_numpy(logits)[:len(rows)]
        self.read_back = logits.size
        if not second:
            return logits
        other = rt.to_numpy(other)
        self.read_back += other.size
        return logits, other

    def call(self, name: str, arrays: list[np.ndarray], extents: list[int], stream_rows: np.ndarray | None = None,
             chain: bool = False, engram_rows: np.ndarray | None = None, image_rows: np.ndarray | None = None,
             image_index: np.ndarray | None = None):
        """One call of entry function ``name`` on the step inputs ``arrays`` (``STEP_INPUTS`` but the
        entry extents) and ``extents``; an MTP function also reads rows ``stream_rows`` of the last
        step's streams (``chain``: of the last draft's), DSpark's Markov function rows of the last
        DSpark draft's y. Its two outputs, left on the device; the streams a step or an MTP draft
        returns, and a DSpark draft's y, are kept for the next draft. Every rank of a multi-rank
        artifact makes the same calls (``runtime.tensor_parallel``). A V4.1 step with Engram layers
        also takes each token's table rows ``engram_rows`` ``[T, L_e, C]``; the prefill function of
        a model that sees images its ``image_rows`` and ``image_index`` (``vm.image_inputs``)."""
        if self.on_host and time.monotonic() - self.released_at >= RELEASE_EVERY_S:
            rt.release_cached_memory()
            self.released_at = time.monotonic()
        markov = name.startswith("dspark_markov_")
        extra = ()
        if stream_rows is not None:
            streams = self.dspark_rows if markov else self.draft_streams if chain else self.step_streams
            extra = (streams, self._upload(np.asarray(stream_rows, np.int32)))
        if engram_rows is not None:
            # A decode step that replays a CUDA graph takes tables of T * C rows (codegen.relax_step).
            padded = name.endswith("decode") and self.context_buckets
            extra += self._engram_inputs(np.ascontiguousarray(engram_rows, np.int32), padded)
        if image_index is not None:
            extra += (self._upload(np.asarray(image_rows, np.float32)), self._upload(np.asarray(image_index, np.int32)))
        first, second = self.functions[name](*(self._upload(a) for a in arrays), rt.Shape(extents), *extra,
                                             self.params, self.pool_tensors)
        if name.startswith("dspark_draft_"):
            self.dspark_rows = second
        elif markov:
            pass  # confidence logits: the caller's
        elif stream_rows is None:
            self.step_streams = second
        else:
            self.draft_streams = second
        return first, second

    def _engram_inputs(self, ids: np.ndarray, padded: bool) -> tuple:
        """The step inputs ``engram_rows`` and the tables (``vm.inputs``' order): the ids and the
        whole tables, or with ``engram_host_gather`` per table the rows its ids name, once each
        (``padded``: with zero rows up to one per id), and the ids remapped into them."""
        if self.engram_mapped:
            prefetch_rows(self.engram_tables, ids)
        if not self.engram_host_gather:
            return (self._upload(ids), *self.whole_tables)
        remapped, arrays = np.empty_like(ids), []
        for e, table in enumerate(self.engram_tables):
            compact, remapped[:, e] = table.compact(ids[:, e], ids[:, e].size if padded else None)
            arrays += compact.arrays
        return tuple(self._upload(a) for a in [remapped, *arrays])

    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
             logit_rows: np.ndarray | None = None, engram_rows: np.ndarray | None = None,
             images: StepImages | None = None) -> np.ndarray:
        """Run one step; the logits of ``logit_rows`` (token indices; default every token)."""
        return self._run("", tokens, positions, seq_ids, logit_rows, engram_rows=engram_rows, images=images)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        """One image's span rows ``[token_count, text_hidden]`` (float32, prompt order: image_start,
        each token row and its image_newline, image_end) from its pixels, float32 ``[3, H, W]``
        normalized, H and W multiples of the patch size (``artifact.vision``)."""
        if self.vision is None:
            return super().encode_image(pixels)
        geometry, tower, function = self.vision
        pixels = np.ascontiguousarray(pixels, np.float32)
        geometry.check_pixels(pixels.shape, tower.max_patches)
        return rt.to_numpy(self.vm[function](self._upload(pixels), self.params))

    def draft(self, next_tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, stream_rows: np.ndarray,
              logit_rows: np.ndarray | None = None, chain: bool = False) -> np.ndarray:
        """Run the MTP layer (docs/v4.md, "Forward pass") at ``positions``: token i reads row ``stream_rows[i]`` of
        the last step's streams (``chain``: of the last draft's own output streams) and the
        token of its next position, ``next_tokens[i]``; it writes the MTP layer's window rows.
        The draft logits of ``logit_rows``."""
        if not self.has_mtp:
            raise UsageError("this artifact has no MTP layer (num_nextn_predict_layers is 0); "
                             "speculative decoding with mtp needs one")
        if (self.draft_streams if chain else self.step_streams) is None:
            raise UsageError("draft() needs the streams of a step (or of a draft, to chain) first")
        return self._run("mtp0_", next_tokens, positions, seq_ids, logit_rows, stream_rows, chain)

    def dspark_draft(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray) -> np.ndarray:
        """Run DSpark's draft stages over blocks (each request's rows consecutive: its anchor, then
        noise tokens, at the positions after its last fed one); the base logits of every row. The
        head's hidden rows y stay on the device for :meth:`dspark_markov`."""
        if not self.has_dspark:
            raise UsageError("this artifact has no DSpark drafter (no dspark_block_size in its model); "
                             "speculative decoding with dspark needs one")
        self.dspark_block = (np.asarray(positions, np.int32), np.asarray(seq_ids))
        return self._run("dspark_draft_", tokens, positions, seq_ids, None)

    def dspark_markov(self, prev_tokens: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """For rows ``rows`` of the last :meth:`dspark_draft`: the Markov bias [R, V] from each row's
        previous token ``prev_tokens``, and the confidence logits [R] (None: the drafter has no
        confidence head). The rows keep their positions and requests, so a request's rows
        must be consecutive in ``rows``."""
        if self.dspark_rows is None:
            raise UsageError("dspark_markov() needs a dspark_draft() first")
        rows = np.asarray(rows, np.int32)
        positions, seq_ids = (a[rows] for a in self.dspark_block)
        if not self.dspark_confidence:
            return self._run("dspark_markov_", prev_tokens, positions, seq_ids, None, rows), None
        bias, confidence = self._run("dspark_markov_", prev_tokens, positions, seq_ids, None, rows, second=True)
        return bias, confidence[:, 0]


def pool_function_rows(pool: KVPool, names: list[str], state: list[tuple[np.ndarray, tuple]]) -> list[np.ndarray]:
    """Per pool tensor of ``names`` (the pool tuple's order), the rows of a ``KVPool.position_state``
    as the pool functions see the tensor (``codegen.relax_step.emit_pool_functions``): a ring's
    (slot, ring row) is row slot * ring rows + ring row, and a row of a bytewise tensor
    (``PoolGeometry.bytewise``) is its bytes; ``[-1]`` (no row) where the state names none."""
    g = pool.geometry
    order = {id(pool.tensors[name]): i for i, name in enumerate(names)}
    bytewise = {id(pool.tensors[t.name]) for t in g.tensors() if g.bytewise(t)}
    per_tensor: list[list[np.ndarray]] = [[np.empty(0, np.int64)] for _ in names]
    for array, index in state:
        if id(array) in bytewise:
            rows = IndexRowCodec(g).fp4_offsets(array, np.asarray(index[0]))
        else:
            index = np.broadcast_arrays(*(np.asarray(i, np.int64) for i in index))
            rows = np.ravel_multi_index(index, array.shape[:len(index)])
        per_tensor[order[id(array)]].append(rows.reshape(-1))
    flat = [np.concatenate(rows).astype(np.int32) for rows in per_tensor]
    return [rows if len(rows) else NO_ROW for rows in flat]


def check_table_inputs(artifact: Path, inputs: tuple[str, ...], tables: list[EngramTable]) -> None:
    """Refuse a library whose step does not take the manifest's Engram tables after ``engram_rows``
    (one compiled before the tables had files of their own takes none)."""
    if "engram_rows" not in inputs:
        return
    want = [name for t in tables for name in table_inputs(t.layer, t.format)]
    if list(inputs[inputs.index("engram_rows") + 1:]) != want:
        raise ArtifactError(f"{artifact}: the step's inputs after engram_rows are not the Engram tables "
                            f"{want} the manifest lists (an older layout); recompile")


def check_cpu(artifact: Path, kernels: Kernels) -> None:
    """Refuse an llvm artifact whose code uses instructions this CPU lacks: running it would
    kill the process (SIGILL), not raise. C++ twin: step.cc, check_cpu."""
    mcpu, needs = kernels.mcpu, kernels.cpu_features
    for key, value, kind in (("mcpu", mcpu, "a string"), ("cpu_features", needs, "a list")):
        if value is None:
            raise ArtifactError(f"{artifact / MANIFEST}: 'kernels.{key}' is missing or not {kind}; recompile")
    host = targets.host_cpu_flags()
    if host is None:
        return  # no /proc/cpuinfo flags to check against (not Linux on x86)
    missing = [f for f in needs if f not in host.flags]
    if missing:
        raise ArtifactError(f"{artifact}: compiled for CPU {mcpu}, which needs {', '.join(missing)} "
                            f"that this CPU ({host.model}) lacks; recompile with --cpu native (this CPU) or "
                            "--cpu x86-64-v3 (any AVX2 CPU)")
    if "amx_tile" in needs:
        request_tile_data(artifact)


# Linux's arch_prctl request for a process to use an extended state component, and AMX's tile
# data component (asm/prctl.h, XFEATURE_XTILEDATA); x86-64's arch_prctl system call number.
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158


def request_tile_data(artifact: Path) -> None:
    """Ask Linux to let this process use AMX tiles, which the kernels of an artifact built for a
    CPU with AMX (``kernels.cpu_features`` amx_tile) run on: until a process asks, its first tile
    instruction kills it (SIGILL). The permission covers every thread of the process, and asking
    again is harmless. C++ twin: step.cc, request_tile_data."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return  # check_cpu found /proc/cpuinfo x86 flags: an x86-64 Linux, or its emulation
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                    ctypes.c_long(XFEATURE_XTILEDATA)) != 0:
        raise ArtifactError(f"{artifact}: its kernels use AMX tiles, and Linux refused this process their state "
                            f"(arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(ctypes.get_errno())}; Linux 5.16 and "
                            "later grant it where AMX is enabled); recompile with --cpu x86-64-v4 (AVX-512, no AMX)")


def use_physical_cores() -> None:
    """Run the CPU kernels on every physical core this process may use. TVM sizes its thread pool
    once, when the process first runs a parallel kernel, from TVM_NUM_THREADS (else
    OMP_NUM_THREADS); without either it takes half the logical CPUs on x86, assuming two
    hyperthreads per core, so a VM with 2 vCPUs and no SMT would run every kernel on one of them.
    A user's setting of either variable wins. C++ twin: step.cc, use_physical_cores."""
    if "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(physical_cores())


def physical_cores() -> int:
    """Cores this process may run on, hyperthreads of one core counted once (Linux topology;
    elsewhere every allowed CPU). C++ twin: step.cc, physical_cores."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def check_subnormals(artifact: Path) -> None:
    """Refuse a process whose float32 arithmetic flushes subnormals to zero (MXCSR DAZ / FTZ, as
    a library built with -ffast-math may set when it loads): the CPU kernels decode FP8 / FP4
    codes through float32 subnormals (``codegen.kernels.formats``) and would silently
    drop the small weights. Threads inherit the flags of the thread that starts them.
    C++ twin: step.cc, check_subnormals."""
    tiny = np.array([2.0 ** -140], np.float32)
    if not (tiny * np.float32(2.0))[0] > 0:
        raise UsageError(f"{artifact}: this process flushes float32 subnormals to zero (DAZ / FTZ, set by a library "
                         "built with -ffast-math?); the CPU kernels need them: load the artifact before importing "
                         "that library, or in another process")


def step_inputs(pool: KVPool, positions: np.ndarray, seq_ids: np.ndarray, entry_ratios: list[int],
                bucketed: bool = False):
    """The step's compact inputs besides tokens, positions and logit rows: each token's request
    (index into the step's requests), per request (slot, first token, token count, first
    position), the requests' block tables (padded with 0), and per compress ratio the widest
    visibility of compressed entries among the tokens (at least 1). ``bucketed``: the block
    tables and extents cover the context's bucket (``artifact.pool.context_bucket``) instead."""
    groups = list(request_groups(positions, seq_ids))
    token_request = np.empty(len(positions), np.int32)
    requests = np.empty((len(groups), 4), np.int32)
    tables = []
    for i, (seq, idx, first) in enumerate(groups):
        if np.any(np.diff(idx) != 1):
            raise UsageError(f"request {seq}: its tokens must be contiguous in the step")
        rows = pool.requests[int(seq)]
        token_request[idx] = i
        requests[i] = (rows.slot, idx[0], len(idx), first)
        tables.append(rows.blocks)
    last = int(positions.max(initial=0)) + 1
    width = max([len(t) for t in tables] + [1])
    if bucketed:
        last = context_bucket(last)
        width = max(width, -(-last // ENVELOPE_TOKENS))
    block_table = np.zeros((len(groups), width), np.int32)
    for i, t in enumerate(tables):
        block_table[i, :len(t)] = t
    extents = [max(1, last // ratio) for ratio in entry_ratios]
    return token_request, requests, block_table, extents

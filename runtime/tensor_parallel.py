"""Running a multi-rank artifact (``compile --tensor-parallel N``): one process per rank.

Rank 0 is the engine's own process: it schedules, samples and keeps the pool's bookkeeping.
Every rank binds its own weights (``weights.ranks[r]``) and holds a whole pool (V4 has one KV
head: each rank computes and stores all of it) and runs the same compiled step. Before each
call of an entry function rank 0 broadcasts the call (which function, its compact step
inputs, and what changed in the pool outside the compiled step since the last call: a
:class:`PoolJournal`), and every other rank makes the same call. Inside the step the ranks meet
in the collectives (``all_reduce``, ``all_gather``), which are ``torch.distributed`` calls
registered as the packed functions the compiled step calls in destination-passing style
(``codegen.ops.tensor_parallel``); tensors pass between TVM and torch through DLPack, without
copies. Gloo carries them on the CPU (and the control messages everywhere), NCCL / RCCL the
collectives on GPUs.

Rank 0 starts the other ranks itself (:class:`RankGroup`, on this host, each pinned to its
share of the CPU cores), or joins ranks ``torchrun`` started (``WORLD_SIZE`` / ``RANK`` set: the
other ranks run :func:`serve_rank` from the same command line, ``cli``). A rank that dies ends
the collectives of the others: rank 0 raises :class:`TensorParallelError` naming it, workers
whose rank 0 is gone exit, and workers of a local group also die with their parent (Linux
``PR_SET_PDEATHSIG``). A rank that hangs is found by the collective timeout
(``--distributed-timeout``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

from dsv4c.artifact.manifest import Manifest
from dsv4c.artifact.sharding import ALL_GATHER, ALL_REDUCE
from dsv4c.errors import DsvError
from dsv4c.runtime import tvm_runtime as rt
from dsv4c.runtime.backend_tvm import TvmBackend

DEFAULT_TIMEOUT_S = 60.0  # --distributed-timeout
# A broadcast call: [op, function, T, R, B, L, stream rows (-1: none), chain, journal bytes, extents].
HEADER_WORDS = 10
MESSAGE_WORDS = 4096  # a call's first broadcast (StepChannel)
IDLE_TIMEOUT = timedelta(days=365)  # waits that end when a rank does, not on a clock
START_TIMEOUT = timedelta(minutes=5)  # for the ranks to start and meet
EXCHANGE_BYTES = 16 << 20  # Group.exchange_bytes on the CPU
# How long a CPU rank polls for a broadcast call before it sleeps in the wait (Group.finish): the
# gap between two steps of a generation is far shorter, an idle server's ranks then sleep.
IDLE_POLL_S = 0.05
OP_CALL, OP_STOP = 1, 2


class TensorParallelError(DsvError):
    """A rank of a multi-rank artifact failed, died or could not start: the step cannot complete."""


# --------------------------------------------------------------------------- collectives


# Set when Ctrl-C lands inside a collective: TVM hands the step's caller a plain RuntimeError.
_interrupted = threading.Event()
# The ranks the calling thread's step joins: process groups are objects of their own (not torch's
# one default group), so several engines of multi-rank artifacts can live in one process.
_active = threading.local()


class Group:
    """One engine's ranks: ``data`` carries the collectives inside the step (gloo on the CPU,
    NCCL / RCCL on GPUs), ``control`` the calls rank 0 broadcasts (gloo)."""

    def __init__(self, address: str, rank: int, world: int, timeout: float, gpu: bool):
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        # Under torchrun the agent already serves a store at MASTER_PORT: every rank is its client.
        serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        # Meeting takes as long as the ranks take to start (imports, a loaded machine): the groups
        # wait for that; each collective then waits ``timeout`` at most (its options).
        meet = max(timedelta(seconds=timeout), START_TIMEOUT)
        store = dist.PrefixStore("dsv4c", dist.TCPStore(host, int(port), world, is_master=serves, timeout=meet))
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, meet)
        self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world) if gpu else self.control
        self.rank, self.world = rank, world
        from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions  # not in torch.distributed

        self.all_reduce, self.all_gather, self.all_to_all = dist.AllreduceOptions(), AllgatherOptions(), \
            AllToAllOptions()
        for options in (self.all_reduce, self.all_gather, self.all_to_all):
            options.timeout = timedelta(seconds=timeout)
        # Gloo's ring all-reduce and all-gather take several round trips where one all-to-all
        # exchange of every rank's partial sums takes one (bench/tensor_parallel.py: 3-4x faster at
        # decode sizes): up to this many bytes received per rank, the CPU exchanges and sums.
        # NCCL's collectives are the GPU's own; None there.
        self.exchange_bytes = None if gpu else EXCHANGE_BYTES
        self.polls, self.timeout_s = not gpu, timeout

    def finish(self, work, poll_s: float | None = None) -> None:
        """Wait for ``work`` (one of this group's collectives): on the CPU by :func:`poll_then_wait`
        for up to ``poll_s`` seconds (default: the collectives' timeout); a GPU rank's kernels
        run on its device, so its process sleeps in the wait."""
        poll_then_wait(work, (self.timeout_s if poll_s is None else poll_s) if self.polls else 0.0)

    def loaded(self) -> None:
        """Wait for every rank to have loaded its weights, however long that takes (a rank that
        dies on the way closes its connections, which ends the wait)."""
        import torch.distributed as dist

        options = dist.BarrierOptions()
        options.timeout = IDLE_TIMEOUT
        self.control.barrier(options).wait()


def register_collectives() -> None:
    """The packed functions the compiled step calls to join the ranks of the calling thread's
    active :class:`Group`: (input, output) tensors."""
    import torch

    def every_ranks(group, t):
        """``[world, *t.shape]``: every rank's ``t``, by one all-to-all (each rank sends its ``t``
        to every rank)."""
        parts = torch.empty((group.world, *t.shape), dtype=t.dtype, device=t.device)
        copies = t.reshape(1, -1).expand(group.world, -1).contiguous()
        group.finish(group.data.alltoall_base(parts.view(-1), copies.view(-1), [], [], group.all_to_all))
        return parts

    def all_reduce(x, out):
        group = _active.group
        t, o = torch.from_dlpack(x), torch.from_dlpack(out)
        if group.exchange_bytes is not None and t.numel() * t.element_size() * group.world <= group.exchange_bytes:
            # Every rank sums the same parts in the same order: the same bits everywhere.
            torch.sum(every_ranks(group, t.contiguous()), dim=0, out=o)
        else:
            o.copy_(t)
            group.finish(group.data.allreduce([o], group.all_reduce))

    def all_gather(x, out):
        group = _active.group
        t, o = torch.from_dlpack(x).contiguous(), torch.from_dlpack(out)
        n, cols = t.shape
        if group.exchange_bytes is not None:
            parts = every_ranks(group, t)
        else:
            parts = torch.empty((group.world, n, cols), dtype=t.dtype, device=t.device)
            group.finish(group.data.allgather([list(parts.unbind(0))], [t], group.all_gather))
        o.copy_(parts.permute(1, 0, 2).reshape(n, group.world * cols)[:, :o.shape[1]])

    def noting_interrupts(collective):
        def run(x, out):
            try:
                collective(x, out)
            except KeyboardInterrupt:
                _interrupted.set()
                raise
        return run

    rt.tvm_ffi.register_global_func(ALL_REDUCE, noting_interrupts(all_reduce), override=True)
    rt.tvm_ffi.register_global_func(ALL_GATHER, noting_interrupts(all_gather), override=True)


def poll_then_wait(work, poll_s: float) -> None:
    """Wait for ``work`` (a gloo collective), polling for up to ``poll_s`` seconds before sleeping
    in its wait. A CPU rank that sleeps gives its core back, a VM halts the idle vCPU, and the
    message that ends the wait must wake it first: on this project's VM a loopback round trip
    between two pinned processes takes 15-19 us when both spin and 67-87 us when both sleep in
    ``recv`` (bench/RESULTS.md). Each rank has its core to itself, so polling takes nothing from
    other work. A rank that stops answering still ends the collective at its timeout, which
    ``wait`` raises; Ctrl-C lands between polls."""
    end = time.monotonic() + poll_s
    while time.monotonic() < end and not work.is_completed():
        os.sched_yield()  # the gloo threads that complete the work share this core
    work.wait()


# --------------------------------------------------------------------------- pool changes


class PoolJournal:
    """What rank 0's engine changes in its pool outside the compiled step (a slot cleared for a
    new request, a cached slot copied, rows of rejected drafts put back), for the other ranks
    to change theirs alike before the next call. Every rank's pool holds the same bytes: the
    step computes the KV rows from the same all-reduced activations everywhere."""

    def __init__(self, pool):
        self.names = {id(array): name for name, array in pool.tensors.items()}
        self.ops: list[list] = []
        self.blobs: list[bytes] = []
        self.size = 0

    def clear_slot(self, slot: int) -> None:
        self.ops.append(["clear_slot", int(slot)])

    def copy_slot(self, source: int, target: int, at_block_boundary: bool) -> None:
        self.ops.append(["copy_slot", int(source), int(target), bool(at_block_boundary)])

    def restore(self, saved) -> None:
        for array, index, values in saved:
            values = np.ascontiguousarray(values)
            self.ops.append(["write", self.names[id(array)], [np.asarray(i).tolist() for i in index],
                             values.dtype.str, list(values.shape), self.size])
            self.blobs.append(values.tobytes())
            self.size += values.nbytes

    def take(self) -> bytes:
        """The changes since the last ``take``, encoded (empty: none), and forget them."""
        if not self.ops:
            return b""
        head = json.dumps(self.ops).encode()
        data = len(head).to_bytes(8, "little") + head + b"".join(self.blobs)
        self.ops, self.blobs, self.size = [], [], 0
        return data


def apply_journal(pool, data: bytes) -> None:
    """Make the changes a :class:`PoolJournal` recorded on another rank's pool in ``pool``."""
    if not data:
        return
    n = int.from_bytes(data[:8], "little")
    blob = memoryview(data)[8 + n:]
    for op in json.loads(data[8:8 + n]):
        if op[0] == "clear_slot":
            pool.clear_slot(op[1])
        elif op[0] == "copy_slot":
            pool.copy_slot(op[1], op[2], op[3])
        else:
            _, name, index, dtype, shape, offset = op
            count = int(np.prod(shape, dtype=np.int64))
            values = np.frombuffer(blob, np.dtype(dtype), count, offset).reshape(shape)
            pool.tensors[name][tuple(np.asarray(i, np.int64) if isinstance(i, list) else i for i in index)] = values


# --------------------------------------------------------------------------- calls


class StepChannel:
    """Rank 0's calls to the other ranks over the control group, each one int32 message: a header,
    the step inputs, the pool journal's bytes. A broadcast costs a round trip whatever its size up
    to tens of KiB, so every message starts with one of :data:`MESSAGE_WORDS` words (a decode
    step's whole message) and only a larger one (a long prefill chunk, a large journal) takes a
    second broadcast for the rest."""

    def __init__(self, group: Group):
        import torch
        import torch.distributed as dist

        self.torch, self.group = torch, group
        self.options = dist.BroadcastOptions()
        self.options.rootRank, self.options.timeout = 0, group.all_reduce.timeout
        # A rank waits for rank 0's next call as long as the engine is idle (a server between
        # requests); rank 0 going away closes the connection, which ends the wait.
        self.idle = dist.BroadcastOptions()
        self.idle.rootRank, self.idle.timeout = 0, IDLE_TIMEOUT

    def _broadcast(self, array: np.ndarray, idle: bool = False) -> np.ndarray:
        tensor = self.torch.from_numpy(array)
        work = self.group.control.broadcast([tensor], self.idle if idle else self.options)
        self.group.finish(work, IDLE_POLL_S if idle else None)
        return tensor.numpy()

    def _send(self, message: np.ndarray) -> None:
        first = np.zeros(MESSAGE_WORDS, np.int32)
        first[:min(len(message), MESSAGE_WORDS)] = message[:MESSAGE_WORDS]
        self._broadcast(first)
        if len(message) > MESSAGE_WORDS:
            self._broadcast(np.ascontiguousarray(message[MESSAGE_WORDS:]))

    def send_call(self, function: int, arrays: list[np.ndarray], extents, stream_rows, chain: bool,
                  journal: bytes) -> None:
        tokens, _, _, requests, blocks, logit_rows = arrays
        streams = -1 if stream_rows is None else len(stream_rows)
        header = [OP_CALL, function, len(tokens), len(requests), blocks.shape[1], len(logit_rows), streams, int(chain),
                  len(journal), len(extents)]
        parts = [np.array(header, np.int32)] + [np.asarray(a, np.int32).reshape(-1) for a in arrays] + \
            [np.asarray(extents, np.int32)]
        if stream_rows is not None:
            parts.append(np.asarray(stream_rows, np.int32))
        parts.append(np.frombuffer(journal + b"\0" * (-len(journal) % 4), np.int32))
        self._send(np.concatenate(parts))

    def send_stop(self) -> None:
        self._send(np.array([OP_STOP], np.int32))

    def send_setup(self, values: list[int]) -> None:
        self._broadcast(np.array(values, np.int64))

    def receive_setup(self, count: int) -> list[int]:
        return self._broadcast(np.zeros(count, np.int64), idle=True).tolist()

    def receive(self):
        """(function index, arrays, extents, stream rows or None, chain, journal bytes), or None at stop."""
        message = self._broadcast(np.zeros(MESSAGE_WORDS, np.int32), idle=True)
        op, function, t, r, b, lr, s, chain, journal, e = message[:HEADER_WORDS].tolist()
        if op == OP_STOP:
            return None
        sizes = [t, t, t, r * 4, r * b, lr, e, max(s, 0), -(-journal // 4)]
        total = HEADER_WORDS + sum(sizes)
        if total > MESSAGE_WORDS:
            message = np.concatenate([message, self._broadcast(np.zeros(total - MESSAGE_WORDS, np.int32))])
        cut = np.split(message[HEADER_WORDS:total], np.cumsum(sizes)[:-1])
        arrays = cut[:3] + [cut[3].reshape(r, 4), cut[4].reshape(r, b), cut[5]]
        return function, arrays, cut[6].tolist(), cut[7] if s >= 0 else None, bool(chain), \
            cut[8].tobytes()[:journal]


# --------------------------------------------------------------------------- rank 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_shares(world: int) -> list[list[int]]:
    """This process's CPUs cut into ``world`` contiguous shares (one per rank; ranks share CPUs
    when there are fewer CPUs than ranks)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < world:
        return [[cpus[r % len(cpus)]] for r in range(world)]
    per = len(cpus) // world
    return [cpus[r * per:(r + 1) * per] for r in range(world)]


def pin_to(cpus: list[int]):
    """Run this thread's kernels on ``cpus``, one TVM thread each (a user's TVM_NUM_THREADS wins;
    TVM sizes its thread pool when it first runs a parallel kernel); a function that undoes it
    (rank 0 may be part of a larger program, a test session)."""
    before, threads = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None,
                       os.environ.get("TVM_NUM_THREADS"))
    if before is not None:
        os.sched_setaffinity(0, cpus)
    os.environ.setdefault("TVM_NUM_THREADS", str(len(cpus)))

    def undo() -> None:
        if before is not None:
            os.sched_setaffinity(0, before)
        if threads is None:
            os.environ.pop("TVM_NUM_THREADS", None)
    return undo


class RankGroup:
    """The other ranks, seen from rank 0: started here (a process each) or by torchrun."""

    def __init__(self, artifact: Path, world: int, gpu: bool, timeout: float, weights_mode: str):
        self.world, self.timeout, self.procs = world, timeout, {}
        self.stopped = False
        self.in_call = False  # a call is under way: the others may be inside its collectives
        self.unpin = lambda: None
        launched = os.environ.get("WORLD_SIZE")
        if launched is not None:  # torchrun started every rank: join it
            if int(launched) != world:
                raise TensorParallelError(f"{artifact} is compiled for {world} ranks, but WORLD_SIZE is {launched}; "
                                          f"launch {world} processes (torchrun --nproc-per-node {world} ...)")
            address = torchrun_address()
            self.group = self._wait(lambda: Group(address, 0, world, timeout, gpu), "joining the ranks")
        else:
            shares = core_shares(world)
            address = f"127.0.0.1:{free_port()}"
            for rank in range(1, world):
                self.procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "dsv4c.runtime.tensor_parallel", str(artifact), "--rank", str(rank),
                     "--world-size", str(world), "--address", address, "--timeout", str(timeout),
                     "--weights", weights_mode, "--parent", str(os.getpid()),
                     "--cpus", ",".join(map(str, shares[rank]))],
                    start_new_session=True)  # a terminal's Ctrl-C reaches rank 0, which stops them
            if not gpu:
                self.unpin = pin_to(shares[0])
            self.group = self._wait(lambda: Group(address, 0, world, timeout, gpu), "starting the ranks")
        register_collectives()
        self.channel = StepChannel(self.group)
        atexit.register(self.close)

    def _dead(self) -> str | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) died ({how})"
        return None

    def _wait(self, work, what: str):
        """Run ``work`` (a collective) while watching the ranks started here: the first that dies
        ends the wait with a TensorParallelError."""
        result, error = [], []
        thread = threading.Thread(target=lambda: _capture(work, result, error), daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            dead = self._dead()
            if dead and thread.is_alive():
                self.close()
                raise TensorParallelError(f"{dead} while {what}")
        if error:
            raise self.failure(error[0], what) from None
        return result[0]

    def loaded(self) -> None:
        """Wait until every rank has loaded its weights."""
        self._wait(self.group.loaded, "loading the weights")

    def failure(self, error: BaseException, what: str = "running a step") -> TensorParallelError:
        """The one-line error for a collective that failed: the rank that died, if one did."""
        time.sleep(0.2)  # a rank that dies ends the others' collectives a moment before it is reaped
        dead = self._dead()
        self.close()
        if dead:
            return TensorParallelError(f"{dead} while {what}")
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return TensorParallelError(f"tensor parallel: {what} failed on rank 0: {first}")

    def close(self) -> None:
        """Stop every rank started here (told to stop, then killed if they do not within 5 s)."""
        if self.stopped:
            return
        self.stopped = True
        self.unpin()
        if self._dead() is None and not self.in_call:  # torchrun's ranks too: they have no other way to know
            try:
                self.channel.send_stop()
            except Exception:  # noqa: BLE001 - the group is broken: the ranks are killed below
                pass
        deadline = time.monotonic() + (0 if self.in_call else 5)
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # The process groups' threads end with them, here: left to interpreter shutdown, their
        # destruction aborts the process (a joinable std::thread destroyed), exit status 134.
        group = getattr(self, "group", None)
        self.group = self.channel = None
        if getattr(_active, "group", None) is group:
            _active.group = None
        del group


class TensorParallelBackend(TvmBackend):
    """Rank 0 of a multi-rank artifact: a :class:`TvmBackend` over rank 0's weights whose every
    call is first broadcast to the other ranks (:class:`RankGroup`), with the pool's changes."""

    def __init__(self, artifact: Path, manifest: Manifest, pool, device, weights_mode: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT_S):
        self.ranks = RankGroup(artifact, manifest.tensor_parallel, not rt.on_host(device), timeout, weights_mode)
        try:
            self.ranks.channel.send_setup([pool.total_rows])
            super().__init__(artifact, manifest, pool, device, weights_mode, rank=0)
            self.ranks.loaded()
        except BaseException:
            self.ranks.close()
            raise
        pool.journal = PoolJournal(pool)
        self.function_index = {name: i for i, name in enumerate(self.functions)}

    def call(self, name: str, arrays: list[np.ndarray], extents: list[int], stream_rows: np.ndarray | None = None,
             chain: bool = False):
        if self.ranks.stopped:
            raise TensorParallelError("the tensor-parallel ranks have stopped; start the engine again")
        self.ranks.in_call = True
        _active.group = self.ranks.group
        try:
            self.ranks.channel.send_call(self.function_index[name], arrays, extents, stream_rows, chain,
                                         self.pool.journal.take())
            out = super().call(name, arrays, extents, stream_rows, chain)
        except Exception as e:  # a collective failed: a rank died or timed out, or Ctrl-C
            if _interrupted.is_set():
                _interrupted.clear()  # this interrupt is handled; a later engine's errors are errors
                self.ranks.close()
                raise KeyboardInterrupt from None
            raise self.ranks.failure(e) from None
        self.ranks.in_call = False
        return out

    def close(self) -> None:
        self.ranks.close()

    def __del__(self) -> None:
        # An engine dropped without close() (a test's fixture, a user's variable) stops its ranks
        # now, not at interpreter exit (atexit holds the group, not the backend).
        ranks = getattr(self, "ranks", None)
        if ranks is not None:
            ranks.close()


def torchrun_address() -> str:
    """Where torchrun's ranks meet (MASTER_ADDR / MASTER_PORT)."""
    return f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"


def _capture(work, result: list, error: list) -> None:
    try:
        result.append(work())
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        error.append(e)


# --------------------------------------------------------------------------- ranks > 0


def serve_rank(artifact: Path, rank: int, world: int, address: str, timeout: float, weights_mode: str) -> None:
    """A rank other than 0: join the group, load this rank's weights and a pool like rank 0's,
    then make every call rank 0 broadcasts until it says stop."""
    from dsv4c.artifact.directory import open_artifact
    from dsv4c.runtime.kv_pool import KVPool
    from dsv4c.targets import target_info

    opened = open_artifact(artifact)
    manifest = opened.manifest
    info = target_info(manifest.target)
    if manifest.tensor_parallel != world:
        raise TensorParallelError(f"{artifact} is compiled for {manifest.tensor_parallel} ranks, not {world}")
    group = _active.group = Group(address, rank, world, timeout, info.kind != "cpu")
    register_collectives()
    channel = StepChannel(group)
    (rows,) = channel.receive_setup(1)
    pool = KVPool(opened.geometry, rows)
    index = int(os.environ.get("LOCAL_RANK", rank))  # this host's GPU of the rank
    device = rt.CPU if info.kind == "cpu" else rt.tvm_ffi.device(info.device().dlpack_device_type(), index)
    backend = TvmBackend(artifact, manifest, pool, device, weights_mode, rank=rank)
    functions = list(backend.functions)
    group.loaded()
    while (call := channel.receive()) is not None:
        function, arrays, extents, stream_rows, chain, journal = call
        apply_journal(pool, journal)
        backend.call(functions[function], arrays, extents, stream_rows, chain)


def _die_with_parent(parent: int) -> None:
    """A worker started by rank 0 ends when rank 0's process does, however it ends (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it ended before the line above
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """``python -m dsv4c.runtime.tensor_parallel ARTIFACT --rank R ...``: a rank RankGroup starts."""
    p = argparse.ArgumentParser(prog="dsv4c-rank")
    p.add_argument("artifact", type=Path)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--address", required=True, help="host:port of rank 0's store")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--weights", default="auto")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--cpus", default="")
    args = p.parse_args(argv)
    _die_with_parent(args.parent)
    if args.cpus:
        pin_to([int(c) for c in args.cpus.split(",")])
    run_rank(args.artifact, args.rank, args.world_size, args.address, args.timeout, args.weights)


def run_rank(artifact: Path, rank: int, world: int, address: str, timeout: float, weights_mode: str):
    """:func:`serve_rank`, then end the process: its failures as one line on stderr and exit code
    2 (a user error) or 1 (a collective failed: another rank is gone). Not through ``sys.exit``:
    interpreter shutdown with gloo's threads still up aborts the process (SIGABRT), which rank 0
    (or torchrun) would report instead of the exit code."""
    code = 0
    try:
        serve_rank(artifact, rank, world, address, timeout, weights_mode)
    except DsvError as e:
        print(f"dsv4c rank {rank}: error: {e}", file=sys.stderr)
        code = 2
    except Exception as e:  # noqa: BLE001 - a collective failed: rank 0 (or another rank) is gone
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"dsv4c rank {rank}: stopped: {first}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

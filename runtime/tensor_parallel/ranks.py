"""The ranks seen from rank 0: started here as processes (each pinned to its share of the CPU
cores) or joined under torchrun, watched for failure, and stopped."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dsv4c.runtime.tensor_parallel.collectives import Group, TensorParallelError, active, register_collectives
from dsv4c.runtime.tensor_parallel.messages import StepChannel


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

    def __init__(self, artifact: Path, world: int, gpu: bool, timeout: float, weights_mode: str,
                 options: dict):
        """``weights_mode`` and ``options``: how the ranks started here load the artifact (the
        :class:`TvmBackend` keywords; JSON values)."""
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
                     "--weights", weights_mode, "--options", json.dumps(options), "--parent", str(os.getpid()),
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
        if getattr(active, "group", None) is group:
            active.group = None
        del group


def torchrun_address() -> str:
    """Where torchrun's ranks meet (MASTER_ADDR / MASTER_PORT)."""
    return f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"


def _capture(work, result: list, error: list) -> None:
    try:
        result.append(work())
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        error.append(e)

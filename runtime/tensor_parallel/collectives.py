"""The collectives the compiled step calls (``all_reduce``, ``all_gather``) as torch.distributed
calls on one engine's process groups, and how a rank waits for one."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

from dsv4c.artifact.sharding import ALL_GATHER, ALL_REDUCE
from dsv4c.errors import DsvError
from dsv4c.runtime import tvm_runtime as rt

DEFAULT_TIMEOUT_S = 60.0  # --distributed-timeout
IDLE_TIMEOUT = timedelta(days=365)  # waits that end when a rank does, not on a clock
START_TIMEOUT = timedelta(minutes=5)  # for the ranks to start and meet
EXCHANGE_BYTES = 16 << 20  # Group.exchange_bytes on the CPU


class TensorParallelError(DsvError):
    """A rank of a multi-rank artifact failed, died or could not start: the step cannot complete."""


# Set when Ctrl-C lands inside a collective: TVM hands the step's caller a plain RuntimeError.
interrupted = threading.Event()
# The ranks the calling thread's step joins: process groups are objects of their own (not torch's
# one default group), so several engines of multi-rank artifacts can live in one process.
active = threading.local()


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
        group = active.group
        t, o = torch.from_dlpack(x), torch.from_dlpack(out)
        if group.exchange_bytes is not None and t.numel() * t.element_size() * group.world <= group.exchange_bytes:
            # Every rank sums the same parts in the same order: the same bits everywhere.
            torch.sum(every_ranks(group, t.contiguous()), dim=0, out=o)
        else:
            o.copy_(t)
            group.finish(group.data.allreduce([o], group.all_reduce))

    def all_gather(x, out):
        group = active.group
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
                interrupted.set()
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

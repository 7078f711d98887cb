"""A rank other than 0 (``python -m dsv4c.runtime.tensor_parallel``, or torchrun's ranks through
``cli``): it makes every call rank 0 broadcasts, on its own weights and its copy of the pool."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from dsv4c.errors import DsvError
from dsv4c.runtime import tvm_runtime as rt
from dsv4c.runtime.backend_tvm import TvmBackend
from dsv4c.runtime.tensor_parallel.collectives import (DEFAULT_TIMEOUT_S, Group, TensorParallelError, active,
                                                       register_collectives)
from dsv4c.runtime.tensor_parallel.messages import StepChannel, apply_journal, unpack_inputs
from dsv4c.runtime.tensor_parallel.ranks import pin_to


def serve_rank(artifact: Path, rank: int, world: int, address: str, timeout: float, weights_mode: str,
               **options) -> None:
    """A rank other than 0: join the group, load this rank's weights (``weights_mode``, and the
    backend's other load ``options``, as rank 0 loads its own) and a pool like rank 0's, then make
    every call rank 0 broadcasts until it says stop."""
    from dsv4c.artifact.directory import open_artifact
    from dsv4c.runtime.kv_pool import KVPool
    from dsv4c.targets import target_info

    opened = open_artifact(artifact)
    manifest = opened.manifest
    info = target_info(manifest.target)
    if manifest.tensor_parallel != world:
        raise TensorParallelError(f"{artifact} is compiled for {manifest.tensor_parallel} ranks, not {world}")
    group = active.group = Group(address, rank, world, timeout, info.kind != "cpu")
    register_collectives()
    channel = StepChannel(group)
    (rows,) = channel.receive_setup(1)
    pool = KVPool(opened.geometry, rows)
    index = int(os.environ.get("LOCAL_RANK", rank))  # this host's GPU of the rank
    device = rt.CPU if info.kind == "cpu" else rt.tvm_ffi.device(info.device().dlpack_device_type(), index)
    backend = TvmBackend(artifact, manifest, pool, device, weights_mode, rank=rank, **options)
    functions = list(backend.functions)
    group.loaded()
    while (call := channel.receive()) is not None:
        function, arrays, extents, stream_rows, chain, journal, packed = call
        apply_journal(pool, journal)
        inputs, named_inputs = unpack_inputs(packed)
        backend.call(functions[function], arrays, extents, stream_rows, chain, *inputs, **named_inputs)


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
    p.add_argument("--options", type=json.loads, default={}, help="the backend's other load options (JSON)")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--cpus", default="")
    args = p.parse_args(argv)
    _die_with_parent(args.parent)
    if args.cpus:
        pin_to([int(c) for c in args.cpus.split(",")])
    run_rank(args.artifact, args.rank, args.world_size, args.address, args.timeout, args.weights, **args.options)


def run_rank(artifact: Path, rank: int, world: int, address: str, timeout: float, weights_mode: str, **options):
    """:func:`serve_rank`, then end the process: its failures as one line on stderr and exit code
    2 (a user error) or 1 (a collective failed: another rank is gone). Not through ``sys.exit``:
    interpreter shutdown with gloo's threads still up aborts the process (SIGABRT), which rank 0
    (or torchrun) would report instead of the exit code."""
    code = 0
    try:
        serve_rank(artifact, rank, world, address, timeout, weights_mode, **options)
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

"""Rank 0's backend of a multi-rank artifact."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsv4c.artifact.manifest import Manifest
from dsv4c.runtime import tvm_runtime as rt
from dsv4c.runtime.backend_tvm import TvmBackend
from dsv4c.runtime.tensor_parallel.collectives import (DEFAULT_TIMEOUT_S, TensorParallelError, active,
                                                       interrupted)
from dsv4c.runtime.tensor_parallel.messages import PoolJournal, pack_inputs
from dsv4c.runtime.tensor_parallel.ranks import RankGroup


class TensorParallelBackend(TvmBackend):
    """Rank 0 of a multi-rank artifact: a :class:`TvmBackend` over rank 0's weights whose every
    call is first broadcast to the other ranks (:class:`RankGroup`), with the pool's changes."""

    def __init__(self, artifact: Path, manifest: Manifest, pool, device, weights_mode: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT_S, **options):
        """``weights_mode`` and ``options`` (a model's other :class:`TvmBackend` load options, e.g.
        V4.1's Engram memory) apply to every rank's backend alike."""
        self.ranks = RankGroup(artifact, manifest.tensor_parallel, not rt.on_host(device), timeout, weights_mode,
                               options)
        try:
            self.ranks.channel.send_setup([pool.total_rows])
            super().__init__(artifact, manifest, pool, device, weights_mode, rank=0, **options)
            self.ranks.loaded()
        except BaseException:
            self.ranks.close()
            raise
        pool.journal = PoolJournal(pool)
        self.function_index = {name: i for i, name in enumerate(self.functions)}

    def call(self, name: str, arrays: list[np.ndarray], extents: list[int], stream_rows: np.ndarray | None = None,
             chain: bool = False, *inputs, **named_inputs):
        """:meth:`TvmBackend.call` on every rank; the step inputs a model adds (``inputs``,
        ``named_inputs``: V4.1's Engram inputs) go to every rank as they are."""
        if self.ranks.stopped:
            raise TensorParallelError("the tensor-parallel ranks have stopped; start the engine again")
        self.ranks.in_call = True
        active.group = self.ranks.group
        try:
            self.ranks.channel.send_call(self.function_index[name], arrays, extents, stream_rows, chain,
                                         self.pool.journal.take(), pack_inputs(inputs, named_inputs))
            out = super().call(name, arrays, extents, stream_rows, chain, *inputs, **named_inputs)
        except Exception as e:  # a collective failed: a rank died or timed out, or Ctrl-C
            if interrupted.is_set():
                interrupted.clear()  # this interrupt is handled; a later engine's errors are errors
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

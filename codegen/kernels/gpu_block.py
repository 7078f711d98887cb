"""What the GPU-only kernels (``gpu_*.py``) share: phases run by a block's threads, with a barrier
between phases, or emulated on the CPU.

On a GPU a kernel's grid loop binds to ``blockIdx.x`` and each phase's loop to ``threadIdx.x``;
its scratch lives in shared memory and a thread's registers in local buffers. Emulated
(``emulate``), the CPU runs the blocks in parallel and each phase as a loop over the threads,
one after another, which is what the barrier between phases guarantees on the GPU; scratch is
global memory, and what a thread keeps in registers across phases is a row per thread of one
buffer (index it ``[tx * own, ...]``: ``own`` is 0 on the GPU, where the buffer is the thread's
own). So tests compare a GPU kernel's logic with the CPU kernels on the CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from tvm.script import tirx as T


class BlockPhases(NamedTuple):
    block_loop: object  # for b in block_loop(blocks)
    thread_loop: object  # for tx in thread_loop(threads): one phase
    barrier: object  # a macro: between phases
    scope: str  # block scratch
    register_scope: str  # a thread's registers kept across phases
    own: int  # 1 emulated, 0 on the GPU


def block_phases(emulate: bool) -> BlockPhases:
    @T.macro
    def barrier():
        if not emulate:
            T.tvm_storage_sync("shared")

    if emulate:
        return BlockPhases(T.parallel, T.serial, barrier, "global", "global", 1)
    return BlockPhases(functools.partial(T.thread_binding, thread="blockIdx.x"),
                       functools.partial(T.thread_binding, thread="threadIdx.x"), barrier, "shared", "local", 0)

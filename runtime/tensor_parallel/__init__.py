"""Running a multi-rank artifact (``compile --tensor-parallel N``): one process per rank.

Rank 0 is the engine's own process: it schedules, samples and keeps the pool's bookkeeping.
Every rank binds its own weights (``weights.ranks[r]``) and holds a whole pool (V4 and V4.1 have one
KV head: each rank computes and stores all of it) and runs the same compiled step. Before each
call of an entry function rank 0 broadcasts the call (which function, its compact step
inputs, the inputs a model adds to them as the backend got them, such as DeepSeek-V4.1's Engram
rows, and what changed in the pool outside the compiled step since the last call: a
:class:`PoolJournal`), and every other rank makes the same call. The ranks it starts load the
artifact with its backend options (weights mode and any a model adds). Inside the step the ranks meet
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

Modules: ``collectives`` (the process groups and the step's collectives), ``messages`` (rank 0's
calls and pool journal), ``ranks`` (starting, watching and stopping the other ranks),
``backend`` (rank 0's :class:`~dsv4c.runtime.tensor_parallel.backend.TensorParallelBackend`),
``rank_loop`` (every other rank).
"""

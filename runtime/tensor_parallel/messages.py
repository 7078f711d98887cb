"""What rank 0 sends the other ranks: each call of an entry function (:class:`StepChannel`)
with the changes it made to its pool outside the compiled step (:class:`PoolJournal`) and the
call's model-specific step inputs (:func:`pack_inputs`: V4.1's Engram inputs)."""

from __future__ import annotations

import json

import numpy as np

from dsv4c.runtime.tensor_parallel.collectives import IDLE_TIMEOUT, Group

# A broadcast call: [op, function, T, R, B, L, stream rows (-1: none), chain, journal bytes, extents,
# packed step input bytes].
HEADER_WORDS = 11
MESSAGE_WORDS = 4096  # a call's first broadcast (StepChannel)
# How long a CPU rank polls for a broadcast call before it sleeps in the wait (Group.finish): the
# gap between two steps of a generation is far shorter, an idle server's ranks then sleep.
IDLE_POLL_S = 0.05
OP_CALL, OP_STOP = 1, 2


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
        data = _pack(self.ops, self.blobs)
        self.ops, self.blobs, self.size = [], [], 0
        return data


def _pack(head: list, blobs: list[bytes]) -> bytes:
    """A JSON description and the bytes its entries point into (by offset), as one byte string."""
    text = json.dumps(head).encode()
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def _unpack(data: bytes) -> tuple[list, memoryview]:
    """What :func:`_pack` packed: the description and the bytes after it."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), memoryview(data)[8 + n:]


def _array(blob: memoryview, dtype: str, shape: list[int], offset: int) -> np.ndarray:
    return np.frombuffer(blob, np.dtype(dtype), int(np.prod(shape, dtype=np.int64)), offset).reshape(shape)


def pack_inputs(inputs: tuple, named: dict) -> bytes:
    """The step inputs a model adds to a backend call beyond the common ones (V4.1's Engram
    inputs), positional (``inputs``) and by keyword (``named``), each an array of any dtype or
    None, encoded for :func:`unpack_inputs` on the other ranks (empty: none). Rank 0 passes
    them on as it gets them, so a model's new step input needs nothing here."""
    if not inputs and not named:
        return b""
    head, blobs, offset = [], [], 0
    for key, value in [*enumerate(inputs), *named.items()]:
        if value is None:
            head.append([key, None])
            continue
        value = np.ascontiguousarray(value)
        head.append([key, value.dtype.str, list(value.shape), offset])
        blobs.append(value.tobytes())
        offset += value.nbytes
    return _pack(head, blobs)


def unpack_inputs(data: bytes) -> tuple[list, dict]:
    """The positional and keyword step inputs :func:`pack_inputs` encoded."""
    if not data:
        return [], {}
    head, blob = _unpack(data)
    values = [(key, None if spec[0] is None else _array(blob, *spec)) for key, *spec in head]
    return [v for k, v in values if isinstance(k, int)], {k: v for k, v in values if isinstance(k, str)}


def apply_journal(pool, data: bytes) -> None:
    """Make the changes a :class:`PoolJournal` recorded on another rank's pool in ``pool``."""
    if not data:
        return
    ops, blob = _unpack(data)
    for op in ops:
        if op[0] == "clear_slot":
            pool.clear_slot(op[1])
        elif op[0] == "copy_slot":
            pool.copy_slot(op[1], op[2], op[3])
        else:
            _, name, index, dtype, shape, offset = op
            values = _array(blob, dtype, shape, offset)
            pool.tensors[name][tuple(np.asarray(i, np.int64) if isinstance(i, list) else i for i in index)] = values


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
                  journal: bytes, inputs: bytes) -> None:
        """One call: ``journal`` from :meth:`PoolJournal.take`, ``inputs`` from :func:`pack_inputs`."""
        tokens, _, _, requests, blocks, logit_rows = arrays
        streams = -1 if stream_rows is None else len(stream_rows)
        header = [OP_CALL, function, len(tokens), len(requests), blocks.shape[1], len(logit_rows), streams, int(chain),
                  len(journal), len(extents), len(inputs)]
        parts = [np.array(header, np.int32)] + [np.asarray(a, np.int32).reshape(-1) for a in arrays] + \
            [np.asarray(extents, np.int32)]
        if stream_rows is not None:
            parts.append(np.asarray(stream_rows, np.int32))
        parts += [np.frombuffer(data + b"\0" * (-len(data) % 4), np.int32) for data in (journal, inputs)]
        self._send(np.concatenate(parts))

    def send_stop(self) -> None:
        self._send(np.array([OP_STOP], np.int32))

    def send_setup(self, values: list[int]) -> None:
        self._broadcast(np.array(values, np.int64))

    def receive_setup(self, count: int) -> list[int]:
        return self._broadcast(np.zeros(count, np.int64), idle=True).tolist()

    def receive(self):
        """(function index, arrays, extents, stream rows or None, chain, journal bytes, packed step
        input bytes), or None at stop."""
        message = self._broadcast(np.zeros(MESSAGE_WORDS, np.int32), idle=True)
        op, function, t, r, b, lr, s, chain, journal, e, inputs = message[:HEADER_WORDS].tolist()
        if op == OP_STOP:
            return None
        sizes = [t, t, t, r * 4, r * b, lr, e, max(s, 0), -(-journal // 4), -(-inputs // 4)]
        total = HEADER_WORDS + sum(sizes)
        if total > MESSAGE_WORDS:
            message = np.concatenate([message, self._broadcast(np.zeros(total - MESSAGE_WORDS, np.int32))])
        cut = np.split(message[HEADER_WORDS:total], np.cumsum(sizes)[:-1])
        arrays = cut[:3] + [cut[3].reshape(r, 4), cut[4].reshape(r, b), cut[5]]
        return function, arrays, cut[6].tolist(), cut[7] if s >= 0 else None, bool(chain), \
            cut[8].tobytes()[:journal], cut[9].tobytes()[:inputs]

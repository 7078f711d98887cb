"""The KV pool's allocator: one row space per device (docs/v4.md, "KV pool"; the geometry, the tensors and
the row formats are ``artifact.pool`` and ``artifact.pool_rows``, shared with the compiler).

:class:`KVPool` allocates the tensors once and hands out rows: envelopes from row 0 upward,
slots from the top downward; the boundary between the two regions is a pair of counters.
Envelopes are reference-counted: the prefix cache (``runtime.prefix_cache``) shares a cached
block's envelope between the requests whose prompts start with it, and keeps it when they end.
:class:`PagedStore` lets the reference ops run on the pool. The compiled step turns a
request's slot and block table into rows itself (``codegen.step_kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry
from dsv4c.artifact.pool_rows import IndexRowCodec, MainRowCodec
from dsv4c.errors import DsvError, UsageError



def aligned_empty(shape, dtype, allocate=np.empty) -> np.ndarray:
    """An uninitialised array on a 64-byte boundary, so TVM can share it zero-copy (DLPack)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = allocate(nbytes + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape, dtype) -> np.ndarray:
    # np.zeros maps zero pages lazily: a pool whose planes live on a GPU costs no host memory
    # for its (never written) host planes.
    return aligned_empty(shape, dtype, np.zeros)


class PoolExhausted(DsvError):
    """The pool has no room for the request; nothing was changed."""


# --------------------------------------------------------------------------- allocator


@dataclass
class RequestRows:
    slot: int
    blocks: list[int] = field(default_factory=list)  # block table: envelope numbers, in token order


class KVPool:
    """Owns the planes (allocated once) and hands out envelopes and slots."""

    def __init__(self, geometry: PoolGeometry, total_rows: int):
        g = geometry
        if total_rows < g.window_rows_per_request:
            raise UsageError(f"a pool of {total_rows} rows cannot hold even one request's windows "
                             f"({g.window_rows_per_request} rows)")
        self.geometry, self.total_rows = g, total_rows
        self.max_envelopes = total_rows // g.rows_per_envelope if g.rows_per_envelope else 0
        self.max_slots = total_rows // g.window_rows_per_request
        self._main, self._index = MainRowCodec(g), IndexRowCodec(g)
        count = self._counts(g, total_rows)
        layout = g.tensors()
        # By PoolTensor.name, in the compiled step's order; the views below are the same arrays.
        self.tensors = {t.name: aligned_zeros((count[t.rows], *t.shape), t.dtype) for t in layout}
        self.planes = {t.part: self.tensors[t.name] for t in layout if t.rows == "main"}
        self.index_plane = next(self.tensors[t.name] for t in layout if t.rows == "index")
        rings = [t for t in layout if t.state is not None]
        self.state = {(s.layer, s.stream): tuple(self.tensors[t.name] for t in rings if t.state == s) for s in g.states}
        self.requests: dict[int, RequestRows] = {}
        self._env_high = 0  # envelopes [0, _env_high) may be in use; rows grow up
        self._slot_high = 0  # slots [0, _slot_high) may be in use; rows grow down from the top
        self._env_free: list[int] = []
        self._slot_free: list[int] = []
        self._env_refs: dict[int, int] = {}  # envelope in use -> its holders (requests, the prefix cache)
        # Called when rows run out: frees rows nobody needs (cached blocks no request uses) and says
        # whether it freed any; the prefix cache installs it.
        self.reclaim: Callable[[], bool] = lambda: False
        # What changes the tensors outside the compiled step, for the other ranks of a multi-rank
        # artifact to change theirs alike (``runtime.tensor_parallel.PoolJournal``); None alone.
        self.journal = None

    @staticmethod
    def _counts(g: PoolGeometry, total_rows: int) -> dict[str, int]:
        """How many of each kind of row a pool of ``total_rows`` main rows allocates."""
        envelopes = total_rows // g.rows_per_envelope if g.rows_per_envelope else 0
        return {"main": total_rows, "index": max(envelopes * g.index_rows_per_envelope, 1),
                "slots": total_rows // g.window_rows_per_request}

    @classmethod
    def nbytes_for(cls, g: PoolGeometry, total_rows: int) -> int:
        """The bytes of a pool of ``total_rows`` rows (its planes, index rows and rings)."""
        count = cls._counts(g, total_rows)
        return sum(count[t.rows] * int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
                   for t in g.tensors())

    @classmethod
    def rows_for_bytes(cls, g: PoolGeometry, nbytes: int) -> int:
        """The most rows a pool of at most ``nbytes`` bytes holds."""
        low, high = 0, 1
        while cls.nbytes_for(g, high) <= nbytes:
            low, high = high, 2 * high
        while high - low > 1:  # nbytes_for(low) <= nbytes < nbytes_for(high)
            mid = (low + high) // 2
            low, high = (mid, high) if cls.nbytes_for(g, mid) <= nbytes else (low, mid)
        return low

    # ----- boundary
    def envelope_rows(self, block: int) -> tuple[int, int]:
        start = block * self.geometry.rows_per_envelope
        return start, start + self.geometry.rows_per_envelope

    def slot_rows(self, slot: int) -> tuple[int, int]:
        stop = self.total_rows - slot * self.geometry.window_rows_per_request
        return stop - self.geometry.window_rows_per_request, stop

    def _fits(self, env_high: int, slot_high: int) -> bool:
        g = self.geometry
        return env_high * g.rows_per_envelope <= self.total_rows - slot_high * g.window_rows_per_request

    @property
    def free_envelopes(self) -> int:
        """Envelopes that can still be allocated without moving any slot."""
        g = self.geometry
        if not g.rows_per_envelope:
            return 0
        room = (self.total_rows - self._slot_high * g.window_rows_per_request) // g.rows_per_envelope
        return len(self._env_free) + max(0, room - self._env_high)

    def _take(self, n_env: int, n_slots: int) -> tuple[list[int], list[int]]:
        """Pick envelopes and slots (freed ones first, then reclaimed ones), or raise PoolExhausted
        having changed nothing but the reclaimed cache."""
        while True:
            try:
                envs, slots = self._take_free(n_env, n_slots)
            except PoolExhausted:
                if not self.reclaim():
                    raise
                continue
            for e in envs:
                self._env_refs[e] = 1
            return envs, slots

    def _take_free(self, n_env: int, n_slots: int) -> tuple[list[int], list[int]]:
        reuse_env = sorted(self._env_free)[:n_env]
        reuse_slot = sorted(self._slot_free)[:n_slots]
        env_high = self._env_high + n_env - len(reuse_env)
        slot_high = self._slot_high + n_slots - len(reuse_slot)
        if not self._fits(env_high, slot_high):
            raise PoolExhausted(
                f"KV pool exhausted: need {n_env} envelope(s) and {n_slots} slot(s), "
                f"{self.free_envelopes} envelope(s) free; free a request or give the pool more memory"
            )
        for e in reuse_env:
            self._env_free.remove(e)
        for slot in reuse_slot:
            self._slot_free.remove(slot)
        envs = reuse_env + list(range(self._env_high, env_high))
        slots = reuse_slot + list(range(self._slot_high, slot_high))
        self._env_high, self._slot_high = env_high, slot_high
        return envs, slots

    # ----- requests
    def admit(self, seq: int, reserve_tokens: int = 0, shared: list[int] = ()) -> RequestRows:
        """A slot for a new request, plus envelopes for ``reserve_tokens`` tokens up front; its
        block table starts with the ``shared`` envelopes (a cached prefix), which it then holds."""
        if seq in self.requests:
            raise UsageError(f"request {seq} is already in the pool")
        if reserve_tokens < 0:
            raise UsageError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        blocks = -(-reserve_tokens // ENVELOPE_TOKENS) if self.geometry.rows_per_envelope else 0
        envs, (slot,) = self._take(max(blocks - len(shared), 0), 1)
        for e in shared:
            self.hold(e)
        self.clear_slot(slot)
        req = self.requests[seq] = RequestRows(slot, list(shared) + envs)
        return req

    def clear_slot(self, slot: int) -> None:
        for kv, score in self.state.values():
            kv[slot] = 0.0
            score[slot] = -np.inf  # an empty ring gives zero softmax weight
        if self.journal is not None:
            self.journal.clear_slot(slot)

    def hold(self, envelope: int) -> None:
        """One more holder of an envelope in use."""
        self._env_refs[envelope] += 1

    def release(self, envelope: int) -> None:
        """One holder fewer; the last one gives the envelope back."""
        self._env_refs[envelope] -= 1
        if not self._env_refs[envelope]:
            del self._env_refs[envelope]
            self._env_free.append(envelope)
            self._lower_high_water()

    def holders(self, envelope: int) -> int:
        return self._env_refs.get(envelope, 0)

    def take_slot(self) -> int:
        """A slot outside any request (the prefix cache keeps a block boundary's windows and rings in it)."""
        return self._take(0, 1)[1][0]

    def release_slot(self, slot: int) -> None:
        self._slot_free.append(slot)
        self._lower_high_water()

    def copy_slot(self, source: int, target: int, at_block_boundary: bool = False) -> None:
        """Slot ``target`` becomes what ``source`` holds: every layer's window rows and compressor
        rings. ``at_block_boundary``: the source has fed a whole number of 256-token blocks, where
        every ratio's window has just closed, so only overlapping rings (2 ratio rows) hold positions that
        later windows read; the others are left as they are (overwritten before they are read)."""
        (a, b), (c, d) = self.slot_rows(source), self.slot_rows(target)
        for plane in self.planes.values():
            plane[c:d] = plane[a:b]
        ratios = {cl.layer: cl.ratio for cl in self.geometry.compressed}
        for s in self.geometry.states:
            if at_block_boundary and s.rows == ratios[s.layer]:
                continue  # non-overlapping: its next window starts at the boundary
            for array in self.state[(s.layer, s.stream)]:
                array[target] = array[source]
        if self.journal is not None:
            self.journal.copy_slot(source, target, at_block_boundary)

    def ensure(self, seq: int, tokens: int) -> None:
        """Grow the block table so that positions ``< tokens`` have envelopes."""
        req = self._request(seq)
        if not self.geometry.rows_per_envelope:
            return
        need = -(-tokens // ENVELOPE_TOKENS) - len(req.blocks)
        if need > 0:
            envs, _ = self._take(need, 0)
            req.blocks.extend(envs)

    def free(self, seq: int) -> None:
        req = self._request(seq)
        del self.requests[seq]
        for e in req.blocks:
            self.release(e)
        self.release_slot(req.slot)

    def _lower_high_water(self) -> None:
        """Give the high-water marks back so the other region can use the rows."""
        while self._env_high and (self._env_high - 1) in self._env_free:
            self._env_high -= 1
            self._env_free.remove(self._env_high)
        while self._slot_high and (self._slot_high - 1) in self._slot_free:
            self._slot_high -= 1
            self._slot_free.remove(self._slot_high)

    def _request(self, seq: int) -> RequestRows:
        try:
            return self.requests[seq]
        except KeyError:
            raise UsageError(f"request {seq} is not in the pool") from None

    # ----- physical rows
    def window_row(self, seq: int, layer: int, positions: np.ndarray) -> np.ndarray:
        g = self.geometry
        base = self.slot_rows(self._request(seq).slot)[0]
        return base + layer * g.window + positions % g.window

    def entry_rows(self, seq: int, layer: int, entries: np.ndarray, index: bool = False) -> np.ndarray:
        """Physical rows of compressed entries (per-request numbers) of one layer."""
        lr = self.geometry.rows_of(layer)
        blocks = np.asarray(self._request(seq).blocks, np.int64)
        block_of = entries // lr.rows_per_envelope
        if len(entries) and block_of.max() >= len(blocks):
            raise UsageError(f"request {seq}: entry {int(entries.max())} of layer {layer} has no envelope yet")
        within = entries % lr.rows_per_envelope
        if index:
            return blocks[block_of] * self.geometry.index_rows_per_envelope + lr.index_offset + within
        return blocks[block_of] * self.geometry.rows_per_envelope + lr.offset + within

    def position_state(self, seq: int, positions) -> list[tuple[np.ndarray, tuple]]:
        """Every (array, index) of state that feeding ``positions`` of request ``seq`` writes:
        their window rows in each layer, their compressor ring rows (position p owns row
        p mod ring rows, see the compressor kernels' ``ring_update``), and the compressed and index entries
        of the windows they close. Speculative decoding saves these before a verify step and
        puts back those of the tokens it rejects, so the pool is what it would be had they
        never been fed; that holds while no two of the positions share a row (the engine keeps
        draft runs shorter than the window and the smallest ring)."""
        g, positions = self.geometry, np.asarray(positions, np.int64)
        slot = self._request(seq).slot
        out = []
        windows = (self.slot_rows(slot)[0] + np.arange(0, g.window_rows_per_request, g.window)[:, None]
                   + positions[None, :] % g.window).reshape(-1)
        out += [(plane, (windows,)) for plane in self.planes.values()]
        for c in g.compressed:
            closing = (positions + 1) % c.ratio == 0
            entries = (positions[closing] + 1) // c.ratio - 1
            out += [(plane, (self.entry_rows(seq, c.layer, entries),)) for plane in self.planes.values()]
            if c.index_offset is not None:
                out.append((self.index_plane, (self.entry_rows(seq, c.layer, entries, index=True),)))
        for s in g.states:
            out += [(ring, (slot, positions % s.rows)) for ring in self.state[(s.layer, s.stream)]]
        return out

    @staticmethod
    def save(state: list[tuple[np.ndarray, tuple]]) -> list[tuple[np.ndarray, tuple, np.ndarray]]:
        """A copy of the ``position_state`` rows, for :meth:`restore`."""
        return [(array, index, array[index].copy()) for array, index in state]

    def restore(self, saved: list[tuple[np.ndarray, tuple, np.ndarray]]) -> None:
        for array, index, values in saved:
            array[index] = values
        if self.journal is not None:
            self.journal.restore(saved)

    def read_main(self, rows: np.ndarray) -> np.ndarray:
        return self._main.read(self.planes, rows)

    def write_main(self, rows: np.ndarray, values: np.ndarray) -> None:
        self._main.write(self.planes, rows, values)

    def read_index(self, rows: np.ndarray) -> np.ndarray:
        return self._index.read(self.index_plane, rows)

    def write_index(self, rows: np.ndarray, values: np.ndarray) -> None:
        self._index.write(self.index_plane, rows, values)


# --------------------------------------------------------------------------- reference on the pool


class PagedStore:
    """The :class:`~dsv4c.ir.reference_ops.KVStore` interface over a :class:`KVPool` (every layer with
    a window, the MTP layer's included, has its rows in the request's slot)."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    def window_rows(self, layer, seq, start, stop):
        return self.pool.read_main(self.pool.window_row(seq, layer, np.arange(start, stop)))

    def write_window(self, layer, seq, positions, rows):
        self.pool.write_main(self.pool.window_row(seq, layer, np.asarray(positions)), rows)

    def ring(self, layer, stream, seq):
        kv, score = self.pool.state[(layer, stream)]
        slot = self.pool.requests[seq].slot
        return kv[slot], score[slot]

    def write_entries(self, layer, stream, seq, first, entries):
        numbers = np.arange(first, first + len(entries))
        if stream == "index":
            self.pool.write_index(self.pool.entry_rows(seq, layer, numbers, index=True), entries)
        else:
            self.pool.write_main(self.pool.entry_rows(seq, layer, numbers), entries)

    def entries(self, layer, stream, seq, count):
        numbers = np.arange(count)
        if stream == "index":
            return self.pool.read_index(self.pool.entry_rows(seq, layer, numbers, index=True))
        return self.pool.read_main(self.pool.entry_rows(seq, layer, numbers))

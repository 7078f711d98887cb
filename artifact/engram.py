"""Engram n-gram memory, the parts that are not neural: the hash constants and compressed
vocabulary an artifact carries, the hash that turns a request's recent tokens into table rows,
and the per-request n-gram history that hash reads.

DeepSeek-V4.1's Engram layers look up, for each token, one table row per (n-gram size, hash
head) and gate their sum into the hyper-connection streams (docs/v4.md's vocabulary; the
lookup and gate are neural and live elsewhere). Which rows is decided here:

* a token id is first mapped to a *compressed* id (tokens that read the same after Unicode
  normalisation share one; :mod:`dsv4c.frontend.engram` derives the map from the tokenizer at
  compile time);
* for a token at absolute position ``p`` with compressed history ``c``, look-back ``s`` (0 = the
  token itself) reads ``t_s = c[p - s]``, or the compressed pad id once the look-back is
  *blocked*: ``blocked_s = blocked_{s-1} or p < s or c[p - s] is DEAD``. DEAD marks tokens a
  request masks out (padding, image-span tokens), so that no n-gram spans them: a request's
  image spans are DEAD here (:meth:`EngramTables.request_rows`' ``dead``), padding never occurs;
* per Engram layer ``e``: ``v = t_0 * m[e, 0]``, then for n = 2 .. n_max ``v ^= t_{n-1} * m[e,
  n-1]`` and head ``j`` of that n-gram size reads row ``v mod prime[e, n-2, j] + offset[e,
  (n-2) * n_heads + j]``, where the offsets stack the heads' ranges into one table per layer.

All arithmetic is int64 and cannot overflow: compressed ids are below the compressed vocabulary
size ``C`` and the multipliers below ``(2**63 - 1) // C``, so every product is below 2**63 and
so is every XOR of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from dsv4c.artifact.safetensors_io import STORAGE_DTYPES, SafetensorsFile, write_safetensors
from dsv4c.errors import ArtifactError, CheckpointError, UsageError

# The tensors and metadata keys of an Engram hash file (EngramTables.save / .load).
_TENSORS = {"token_map": "I32", "layer_ids": "I64", "primes": "I64", "multipliers": "I64"}
_SIZE_KEY, _PAD_KEY = "compressed_vocab_size", "pad"
DEAD = -1  # the compressed id of a masked-out position: no n-gram reads across it


@dataclass(frozen=True, eq=False)
class EngramTables:
    """What the hash needs, computed once per model at compile time.

    ``token_map`` ``[vocab_size]`` int32: the compressed id of each token id of the model (ids the
    tokenizer does not have map to ``pad``; see :func:`dsv4c.frontend.engram.build_engram_tables`).
    ``layer_ids`` ``[L_e]``: the decoder layers that hold an Engram table, in the config's order.
    ``primes`` ``[L_e, n_max - 1, n_heads]`` int64: each hash head's modulus.
    ``multipliers`` ``[L_e, n_max]`` int64 (odd): one per look-back distance, 0 = the token itself.
    ``compressed_vocab_size``: the number of distinct compressed ids the tokenizer yields.
    ``pad``: the compressed id that stands for positions before the sequence start.
    """

    token_map: np.ndarray
    layer_ids: tuple[int, ...]
    primes: np.ndarray
    multipliers: np.ndarray
    compressed_vocab_size: int
    pad: int

    @property
    def max_ngram_size(self) -> int:
        return self.multipliers.shape[1]

    @property
    def n_heads(self) -> int:
        return self.primes.shape[2]

    @property
    def offsets(self) -> np.ndarray:
        """``[L_e, (n_max - 1) * n_heads]`` int64: where each hash head's rows start in its
        layer's table (the running sum of that layer's primes, n-gram size major, head minor)."""
        flat = self.primes.reshape(len(self.layer_ids), -1)
        return np.cumsum(flat, axis=1) - flat

    @property
    def rows_per_layer(self) -> tuple[int, ...]:
        """The table rows each Engram layer's hash can address (the sum of its primes)."""
        return tuple(int(n) for n in self.primes.sum(axis=(1, 2)))

    def compress(self, token_ids) -> np.ndarray:
        """The compressed ids (int32) of ``token_ids``."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= len(self.token_map))]
        if bad.size:
            raise UsageError(f"token id {int(bad[0])} is outside the vocabulary [0, {len(self.token_map)})")
        return self.token_map[ids]

    def row_ids(self, context: np.ndarray, context_start: int, positions) -> np.ndarray:
        """The table rows ``[T, L_e, (n_max - 1) * n_heads]`` (int64) the tokens at absolute
        ``positions`` hash to, given ``context[i]``, the compressed id at absolute position
        ``context_start + i`` (:data:`DEAD` where the position is masked out). The context must
        cover each position and its ``n_max - 1`` predecessors that lie at or after the sequence
        start."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        n_layers, n_max = len(self.layer_ids), self.max_ngram_size
        if positions.size == 0:
            return np.zeros((0, n_layers, (n_max - 1) * self.n_heads), np.int64)
        if positions.min() < 0:
            raise ValueError(f"position {int(positions.min())} is negative")
        lookback = positions[:, None] - np.arange(n_max)  # [T, n_max], absolute positions read
        blocked = lookback < 0  # before the sequence start; once blocked, every farther look-back is too
        read = lookback[~blocked]
        if read.min() < context_start or read.max() >= context_start + len(context):
            raise ValueError(f"positions {int(read.min())}..{int(read.max())} are not all in the context, which "
                             f"holds positions {context_start}..{context_start + len(context) - 1}")
        read_ids = np.full(lookback.shape, DEAD, np.int64)
        read_ids[~blocked] = context[read - context_start]
        blocked = np.logical_or.accumulate(read_ids == DEAD, axis=1)  # a DEAD look-back blocks the farther ones
        tokens = np.where(blocked, self.pad, read_ids)
        products = tokens[:, None, :] * self.multipliers[None]  # [T, L_e, n_max]
        # v for n = 2 .. n_max: the XOR of the first n look-backs' products
        ngram_hash = np.bitwise_xor.accumulate(products, axis=2)[:, :, 1:]
        rows = ngram_hash[..., None] % self.primes[None] + self.offsets.reshape(self.primes.shape)[None]
        return rows.reshape(len(positions), n_layers, -1)

    def request_rows(self, tokens, start: int, stop: int, dead: tuple[tuple[int, int], ...] = ()) -> np.ndarray:
        """The table rows ``[stop - start, L_e, C]`` of positions ``start .. stop - 1`` of a request
        whose token ids by position are ``tokens`` (at least ``stop`` of them); the positions of
        each ``dead`` span ``(first, end)`` (its image spans) are DEAD."""
        first = max(0, start - (self.max_ngram_size - 1))
        context = self.compress(tokens[first:stop]).astype(np.int64)
        for a, b in dead:
            context[max(a - first, 0):max(b - first, 0)] = DEAD
        return self.row_ids(context, first, np.arange(start, stop))

    # ------------------------------------------------------------------ storage
    def save(self, path) -> None:
        """Write the tables as a safetensors file (arrays and string metadata, no pickle)."""
        arrays = {"token_map": self.token_map, "layer_ids": np.asarray(self.layer_ids, np.int64),
                  "primes": self.primes, "multipliers": self.multipliers}
        write_safetensors(path, {name: (_TENSORS[name], np.ascontiguousarray(a, STORAGE_DTYPES[_TENSORS[name]]))
                                 for name, a in arrays.items()},
                          metadata={_SIZE_KEY: str(self.compressed_vocab_size), _PAD_KEY: str(self.pad)})

    @classmethod
    def load(cls, path) -> EngramTables:
        """Read what :meth:`save` wrote; a file that is not such a record raises ArtifactError."""
        path = os.fspath(path)

        def fail(problem: str) -> ArtifactError:
            return ArtifactError(f"{path}: {problem}; recompile the artifact")

        try:
            with SafetensorsFile(path) as file:
                missing = sorted(set(_TENSORS) - set(file.names()))
                if missing:
                    raise fail(f"not an Engram hash file (no tensor {missing[0]!r})")
                wrong = [n for n, dtype in _TENSORS.items() if file.dtype(n) != dtype]
                if wrong:
                    raise fail(f"tensor {wrong[0]!r} is {file.dtype(wrong[0])}, not {_TENSORS[wrong[0]]}")
                arrays = {name: file.read_raw(name) for name in _TENSORS}
                metadata = file.metadata
        except CheckpointError as error:
            raise fail(str(error).removeprefix(f"{path}: ")) from None
        try:
            size, pad = int(metadata[_SIZE_KEY]), int(metadata[_PAD_KEY])
        except (KeyError, ValueError):
            raise fail(f"metadata {_SIZE_KEY!r} and {_PAD_KEY!r} must be integers") from None
        tables = cls(token_map=arrays["token_map"], layer_ids=tuple(int(i) for i in arrays["layer_ids"]),
                     primes=arrays["primes"], multipliers=arrays["multipliers"], compressed_vocab_size=size, pad=pad)
        problem = tables._inconsistency()
        if problem:
            raise fail(problem)
        return tables

    def _inconsistency(self) -> str | None:
        """What makes the record unusable by the hash, in a few words, or None."""
        n_layers = len(self.layer_ids)
        if self.token_map.ndim != 1 or self.primes.ndim != 3 or self.multipliers.ndim != 2:
            return "token_map, primes and multipliers must have 1, 3 and 2 axes"
        if self.primes.shape[0] != n_layers or self.multipliers.shape != (n_layers, self.primes.shape[1] + 1):
            return (f"primes {list(self.primes.shape)} and multipliers {list(self.multipliers.shape)} do not fit "
                    f"{n_layers} layers")
        if not 0 <= self.pad < self.compressed_vocab_size:
            return f"pad {self.pad} is outside the compressed vocabulary [0, {self.compressed_vocab_size})"
        if self.token_map.size and not (0 <= self.token_map.min() and self.token_map.max() < self.compressed_vocab_size):
            return f"token_map holds ids outside the compressed vocabulary [0, {self.compressed_vocab_size})"
        if (self.primes < 2).any() or (self.multipliers < 1).any() or \
                (self.multipliers > np.iinfo(np.int64).max // self.compressed_vocab_size).any():
            return "primes or multipliers out of range (the hash could overflow int64)"
        return None


class NgramHistory:
    """One request's compressed ids by absolute position: what the Engram hash of its next
    tokens reads.

    A step needs only the ``n_max - 1`` ids before its first token, but the whole history is
    kept (4 bytes a token, like the request's token list) so that truncating to any position
    (a speculative rollback, a preempted request resumed from fewer tokens) stays exact without
    recomputing anything. Appending at a position before the end overwrites from there.
    """

    def __init__(self, tables: EngramTables):
        self.tables = tables
        self._ids = np.zeros(64, np.int32)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def append(self, position: int, token_ids) -> None:
        """Record ``token_ids`` at absolute positions ``position, position + 1, ...``; everything
        from ``position`` on that was recorded before is dropped."""
        if not 0 <= position <= self._length:
            raise ValueError(f"cannot record tokens at position {position}: the history holds positions "
                             f"0..{self._length - 1} and must stay gap-free")
        compressed = self.tables.compress(token_ids)
        end = position + len(compressed)
        if end > len(self._ids):
            grown = np.zeros(max(end, 2 * len(self._ids)), np.int32)
            grown[:position] = self._ids[:position]
            self._ids = grown
        self._ids[position:end] = compressed
        self._length = end

    def truncate(self, length: int) -> None:
        """Forget every position at or after ``length``."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a history of {self._length} positions to {length}")
        self._length = length

    def row_ids(self, positions) -> np.ndarray:
        """The table rows of the recorded tokens at ``positions`` (see EngramTables.row_ids)."""
        return self.tables.row_ids(self._ids[:self._length], 0, positions)

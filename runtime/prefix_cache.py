"""Prefix caching: whole 256-token blocks of a sequence, found again by the hash chain of their
tokens, so that a prompt starting with a cached prefix skips its prefill.

What a block is worth to a later request is more than its envelope (the compressed and index
entries of its 256 positions, which depend on the tokens up to the block's end only): at its end
the request that computed it also held its sliding windows and compressor rings (the last
positions of every layer, and the partial windows that the next entries will close over). These
depend on the whole prefix too, and are not in any envelope, so the cache keeps them: a copy of
that request's slot taken at the block's end (a slot of the pool: its window rows and its rings).
A hit shares the envelopes (reference-counted, never written by the requests that share them: a
request writes only the entries of positions it feeds) and copies the last block's slot into the
request's own. The request then continues exactly as the one that computed the prefix did, so
its logits are those of the same request run without the cache (``tests/test_prefix_cache.py``).

An image span's positions all hold the same image token, so a block's key also names each image
span it overlaps by its start, length and the image's digest: the same image at the same place
in a later prompt hits, another image with the same tokens never does.

Blocks no request holds stay cached until their rows are needed: the pool then evicts the least
recently used block that no cached block continues (a chain is evicted from its end).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from dsv4c.artifact.pool import ENVELOPE_TOKENS
from dsv4c.runtime.kv_pool import KVPool, PoolExhausted
from dsv4c.runtime.request import ImageSpan

BLOCK_TOKENS = ENVELOPE_TOKENS


@dataclass
class CachedBlock:
    key: bytes  # the hash chain of the tokens up to the block's end
    parent: bytes | None  # the previous block's key
    envelope: int | None  # None when the model has no compressed layers (no envelopes)
    slot: int  # the windows and rings at the block's end
    children: int = 0  # cached blocks that continue this one
    pins: int = 0  # admissions in progress that will share it


def block_keys(tokens: list[int], count: int, images: tuple[ImageSpan, ...] = ()) -> list[bytes]:
    """The hash chain of the first ``count`` whole blocks of ``tokens`` whose image spans are
    ``images``."""
    keys, key = [], b""
    for b in range(count):
        first, end = b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS
        block = np.asarray(tokens[first:end], np.int64).tobytes()
        block += "".join(f"|{s.start}:{s.token_count}:{s.digest}" for s in images
                         if s.start < end and s.end > first).encode()
        key = hashlib.blake2b(key + block, digest_size=16).digest()
        keys.append(key)
    return keys


class PrefixCache:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()  # least recently used first
        self.queried_tokens = 0  # tokens of sequences looked up
        self.hit_tokens = 0  # of those, tokens found cached
        pool.reclaim = self.evict_one

    def lookup(self, tokens: list[int], max_blocks: int, images: tuple[ImageSpan, ...] = ()) -> list[CachedBlock]:
        """The cached blocks ``tokens`` (with image spans ``images``) start with (at most
        ``max_blocks``), marked recently used. Not counted: ``count`` does that once the request
        is admitted."""
        found = []
        for key in block_keys(tokens, min(max_blocks, len(tokens) // BLOCK_TOKENS), images):
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            self.blocks.move_to_end(block.key)
        return found

    def count(self, looked_up: int, found: int) -> None:
        """One admitted request's lookup: ``looked_up`` tokens, ``found`` of them cached. Counted at
        admission, not at lookup, since a request that waits for rows looks up again every step."""
        self.queried_tokens += looked_up
        self.hit_tokens += found

    @contextlib.contextmanager
    def pinned(self, blocks: list[CachedBlock]):
        """Keeps ``blocks`` from eviction while the pool makes room for the request that shares them."""
        for block in blocks:
            block.pins += 1
        try:
            yield
        finally:
            for block in blocks:
                block.pins -= 1

    def insert(self, tokens: list[int], index: int, envelope: int | None, slot: int,
               images: tuple[ImageSpan, ...] = ()) -> None:
        """Cache block ``index`` of ``tokens`` (with image spans ``images``), which a request has
        just fed up to the block's end: its envelope (shared from now on) and a copy of the
        request's slot. Skipped when the block is cached already or no slot is free."""
        keys = block_keys(tokens, index + 1, images)
        key, parent = keys[-1], keys[-2] if index else None
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return
        if parent is not None and parent not in self.blocks:
            return  # unreachable: a lookup walks the chain from its first block
        try:
            snapshot = self.pool.take_slot()
        except PoolExhausted:
            return
        self.pool.copy_slot(slot, snapshot, at_block_boundary=True)
        if envelope is not None:
            self.pool.hold(envelope)
        self.blocks[key] = CachedBlock(key, parent, envelope, snapshot)
        if parent is not None:
            self.blocks[parent].children += 1

    def _evictable(self, block: CachedBlock) -> bool:
        # Nobody but the cache holds it, no admission is about to, and no cached block continues it.
        return (not block.pins and not block.children
                and (block.envelope is None or self.pool.holders(block.envelope) == 1))

    def evict_one(self) -> bool:
        """Free the least recently used evictable block; whether there was one."""
        block = next((b for b in self.blocks.values() if self._evictable(b)), None)
        if block is None:
            return False
        del self.blocks[block.key]
        if block.parent is not None:
            self.blocks[block.parent].children -= 1
        if block.envelope is not None:
            self.pool.release(block.envelope)
        self.pool.release_slot(block.slot)
        return True

    def clear(self) -> None:
        """Evict every block no request holds."""
        while self.evict_one():
            pass

    @property
    def cached_rows(self) -> int:
        """Rows the cache holds that no running request does (it gives them up when rows run out)."""
        g = self.pool.geometry
        alone = sum(1 for b in self.blocks.values() if b.envelope is None or self.pool.holders(b.envelope) == 1)
        return alone * g.rows_per_envelope + len(self.blocks) * g.window_rows_per_request

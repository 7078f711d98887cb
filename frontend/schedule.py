"""The layer schedule's roles (``artifact.model_config.LayerSpec``): checking any schedule, and
reading the shared-KV fields a V4.1-style config adds to ``compress_ratios``.

A V4.1-style config names the roles by layer id: ``kv_source_layer_ids`` own a compressor and
publish their group's compressed rows and index keys (the layers up to the next source reuse
them), ``index_source_layer_ids`` run an indexer (a source that is not a KV source scores the
shared keys with its own weights; the other compressed layers reuse the last top-k),
``candidate_source_layer_id`` keeps the top ``candidate_topk_blocks`` blocks of
``candidate_block_size`` positions for the index sources from it on, ``engram_layer_ids`` carry
an Engram module. The frontend reads and checks them, then refuses to compile the model: the
trace builds V4's kinds only.
"""

from __future__ import annotations

from typing import Any

from dsv4c.artifact.model_config import Candidates, LayerSpec, shared_kv_layers
from dsv4c.errors import ConfigError

SHARED_KV_FIELDS = ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                    "candidate_block_size", "candidate_topk_blocks", "engram_layer_ids")


def _layer_ids(raw: dict[str, Any], key: str, n: int) -> list[int]:
    ids = raw.get(key, [])
    if (not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                             for i in ids) or ids != sorted(set(ids))):
        raise ConfigError(f"config field {key!r} must be an increasing list of layer ids below {n}, got {ids!r}")
    return ids


def _count(raw: dict[str, Any], key: str) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {v!r}")
    return v


def _last_at_or_before(ids: list[int], i: int) -> int | None:
    return max((j for j in ids if j <= i), default=None)


def shared_kv_schedule(raw: dict[str, Any], ratios: list[int], moe: list[str]) -> tuple[LayerSpec, ...]:
    """The backbone's layers from ``compress_ratios`` and the shared-KV fields of ``raw``."""
    n = len(moe)
    kv_sources = _layer_ids(raw, "kv_source_layer_ids", n)
    index_sources = _layer_ids(raw, "index_source_layer_ids", n)
    engram = _layer_ids(raw, "engram_layer_ids", n)
    candidates = None
    if raw.get("candidate_source_layer_id") is not None:
        source = raw["candidate_source_layer_id"]
        if source not in index_sources:
            raise ConfigError(f"config field candidate_source_layer_id = {source!r} is not an index source layer")
        candidates = Candidates(source, _count(raw, "candidate_block_size"), _count(raw, "candidate_topk_blocks"))
    for i, r in enumerate(ratios):
        if r > 0 and _last_at_or_before(kv_sources, i) is None:
            raise ConfigError(f"config field compress_ratios[{i}] = {r}: the layer is compressed but no "
                              "kv_source_layer_ids entry comes at or before it")
    return shared_kv_layers(ratios, moe, kv_sources, index_sources, candidates, engram)


def validate_schedule(layers: tuple[LayerSpec, ...]) -> None:
    """Every role points at an earlier layer that plays it, and a group shares one compressor."""
    by_index = {l.index: l for l in layers}

    def earlier(l: LayerSpec, role: str, j: int | None) -> LayerSpec:
        if j is None or j > l.index or j not in by_index:
            raise ConfigError(f"layer {l.index}: {role} {j!r} is not this or an earlier layer")
        return by_index[j]

    for l in layers:
        if l.compress_ratio < 0:
            raise ConfigError(f"layer {l.index}: compress ratio {l.compress_ratio} is negative")
        if not l.is_compressed:
            if (l.kv_source, l.topk_source, l.candidates, l.overlap) != (None, None, None, False):
                raise ConfigError(f"layer {l.index}: a sliding-window layer reads no compressed rows")
            continue
        source = earlier(l, "kv_source", l.kv_source)
        if not source.is_kv_source:
            raise ConfigError(f"layer {l.index}: kv_source {source.index} owns no compressor")
        if (source.compress_ratio, source.overlap) != (l.compress_ratio, l.overlap):
            raise ConfigError(f"layer {l.index}: compress ratio {l.compress_ratio} differs from its KV source "
                              f"{source.index}'s {source.compress_ratio}")
        if l.topk_source is not None:
            selector = earlier(l, "topk_source", l.topk_source)
            if not selector.has_indexer or selector.kv_source != l.kv_source:
                raise ConfigError(f"layer {l.index}: topk_source {selector.index} runs no indexer over the "
                                  f"rows of KV source {source.index}")
            if not source.owns_index_keys:
                raise ConfigError(f"layer {l.index}: KV source {source.index} publishes no index keys to select by")
        if l.candidates is not None:
            level = earlier(l, "candidate source", l.candidates.source)
            if not l.has_indexer or level.candidates != l.candidates:
                raise ConfigError(f"layer {l.index}: selects inside the candidates of layer {level.index}, "
                                  "which is not a candidate source with the same blocks, or runs no indexer")

"""The DSpark fields of a config (docs/v4.md, "DSpark"), validated into
:class:`~dsv4c.artifact.model_config.Dspark`.

DSpark is on when ``dspark_block_size`` > 0 and ``dspark_target_layer_ids`` is not empty (as
the official reference builds its drafter); otherwise the fields are read and ignored, and
``mtp.*`` is V4's MTP layer. The drafter's stages are ``num_nextn_predict_layers`` (or the
inference config's ``n_mtp_layers``) sliding-window layers after the target's; a checkpoint's
``mtp.{i}.`` prefixes have the last word on their count (``frontend.checkpoint``).
"""

from __future__ import annotations

from typing import Any

from dsv4c.artifact.model_config import Dspark
from dsv4c.errors import ConfigError

# Dspark field <- accepted spellings (official config.json, inference/config.json, transformers' V4.1;
# dspark_confidence_head is what dsv4c writes once a checkpoint says whether the head is there).
DSPARK_ALIASES: dict[str, tuple[str, ...]] = {
    "block_size": ("dspark_block_size",),
    "target_layers": ("dspark_target_layer_ids",),
    "markov_rank": ("dspark_markov_rank",),
    "noise_token_id": ("dspark_noise_token_id",),
    "n_routed_experts": ("dspark_n_routed_experts",),
    "n_experts_per_tok": ("dspark_num_experts_per_tok", "dspark_n_activated_experts"),
    "confidence_head": ("dspark_confidence_head",),
}
DSPARK_KEYS = frozenset(s for spellings in DSPARK_ALIASES.values() for s in spellings)
DEFAULT_MARKOV_RANK = 256  # the official ModelArgs default


def _given(raw: dict[str, Any], field: str) -> tuple[str, Any] | None:
    """(spelling, value) of a Dspark field, None when absent; spellings that disagree are an error."""
    given = [(s, raw[s]) for s in DSPARK_ALIASES[field] if raw.get(s) is not None]
    if len(given) > 1 and given[0][1] != given[1][1]:
        raise ConfigError(f"config fields disagree: {given[0][0]}={given[0][1]!r} vs {given[1][0]}={given[1][1]!r}")
    return given[0] if given else None


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ConfigError(f"config field {name!r} must be an integer {bound}, got {value!r}")
    return value


def parse_dspark(raw: dict[str, Any], n_layers: int, vocab_size: int, n_routed_experts: int,
                 n_experts_per_tok: int) -> Dspark | None:
    """The drafter ``raw`` describes for a target of ``n_layers`` layers, or None."""
    block = _given(raw, "block_size")
    ids = _given(raw, "target_layers")
    if block is not None:
        _int(block[0], block[1], 0)
    if ids is not None and not isinstance(ids[1], list):
        raise ConfigError(f"config field {ids[0]!r} must be a list of layer indices, got {ids[1]!r}")
    if block is None or block[1] == 0 or not ids or not ids[1]:
        return None
    layers = tuple(_int(f"{ids[0]}[{i}]", v, 0, n_layers) for i, v in enumerate(ids[1]))
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ConfigError(f"config field {ids[0]!r} = {list(layers)} must be strictly increasing")
    noise = _given(raw, "noise_token_id")
    if noise is None:
        raise ConfigError("config field 'dspark_noise_token_id' is missing: a DSpark block fills its rows after the "
                          "anchor with that token")
    rank = _given(raw, "markov_rank") or ("dspark_markov_rank", DEFAULT_MARKOV_RANK)
    experts = _given(raw, "n_routed_experts")
    per_tok = _given(raw, "n_experts_per_tok")
    n_experts = _int(experts[0], experts[1], 0) if experts else 0  # 0: the target's
    k = _int(per_tok[0], per_tok[1], 0) if per_tok else 0
    n_experts, k = n_experts or n_routed_experts, k or n_experts_per_tok
    if k > n_experts:
        raise ConfigError(f"config: the DSpark stages route each token to {k} of {n_experts} experts")
    conf = _given(raw, "confidence_head")
    if conf is not None and not isinstance(conf[1], bool):
        raise ConfigError(f"config field {conf[0]!r} must be true or false, got {conf[1]!r}")
    return Dspark(block_size=block[1], target_layers=layers, markov_rank=_int(rank[0], rank[1], 1),
                  noise_token_id=_int(noise[0], noise[1], 0, vocab_size), n_routed_experts=n_experts,
                  n_experts_per_tok=k, confidence_head=conf[1] if conf else True)


def stage_ratios(raw: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """``raw`` with ``compress_ratios`` cut to the target's layers: the entries after them are the
    drafter's stages (as many as the checkpoint ships, whatever the config counts), all sliding."""
    ratios = raw.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) <= n_layers:
        return raw
    for i, r in enumerate(ratios[n_layers:], n_layers):
        if r != 0:
            raise ConfigError(f"config field compress_ratios[{i}] = {r!r}: DSpark's draft stages attend a sliding "
                              "window only (ratio 0)")
    return {**raw, "compress_ratios": ratios[:n_layers]}

"""Reading DeepSeek-V4.1 configs (docs/v41.md) into the fields :func:`frontend.config.config_from_dict`
reads for every family, plus V4.1's own.

Two spellings load:

* the official ``config.json``: ``model_type`` ``deepseek_v41`` with the text model under
  ``text_config``, a ``vision_config`` (its presence makes the text model take image spans:
  ``image_token_id`` at the top level, the transformers default when absent), and
  ``quantization_config`` at the top level (FP8 dense weights in 32 x 32 blocks, UE8M0 scales,
  FP4 routed experts);
* the flat one transformers' ``save_pretrained`` writes (``model_type`` ``deepseek_v41_text``),
  with the derived ``layer_types`` and ``rope_parameters`` beside the fields they come from
  (an ``image_token_id`` there: the text model takes image spans).

``compress_ratios`` may carry one trailing entry per DSpark draft layer; V4.1's drafter is not
compiled yet, so the tail and the ``dspark_*`` fields are dropped (the checkpoint reader says so
when it skips the ``mtp.*`` tensors). The schedule's ids default as the reference's config does:
KV sources are the first layer of each run of equal non-zero ratios, index sources are the KV
sources, the candidate source is the last KV source (a negative id: no candidate level).
"""

from __future__ import annotations

from typing import Any

from dsv4c.artifact.model_config import V41_NUMERICS, Engram, LayerSpec
from dsv4c.errors import ConfigError, UnsupportedModelError
from dsv4c.frontend.dspark_config import DSPARK_KEYS
from dsv4c.frontend.schedule import shared_kv_schedule, validate_schedule

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")

# The composite config's top level besides text_config: what does not change the text model.
_COMPOSITE_KEYS = {"architectures", "model_type", "text_config", "vision_config", "quantization_config",
                   "image_token_id", "tie_word_embeddings", "torch_dtype", "dtype", "transformers_version",
                   "bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path", "use_cache"}
# V4.1 text fields that are not the text model's fields of every family: the image spans'
# placeholder (read into ``extra``), the drafter, and the cache dispatch transformers derives
# from the KV sources.
_DROPPED = {"image_token_id", "layer_types", *DSPARK_KEYS}
IMAGE_TOKEN_ID = 129264  # the release's (transformers' DeepseekV41Config default)
_ENGRAM_FIELDS = ("engram_vocab_size", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads",
                  "engram_head_dim", "engram_pad_id", "engram_compressed_vocab_size")
_DEFAULTS = {"rms_norm_eps": 1e-20, "candidate_block_size": 8, "candidate_topk_blocks": 2048,
             "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_id": 2,
             "engram_vocab_size": 16000000, "engram_compressed_vocab_size": 99092}


def _int(raw: dict[str, Any], key: str, least: int = 1) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ConfigError(f"config field {key!r} must be an integer >= {least}, got {v!r}")
    return v


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields, flat, whichever spelling ``raw`` is."""
    if raw.get("model_type") == "deepseek_v41_text":
        return dict(raw)
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config field 'text_config' must be an object in a model_type 'deepseek_v41' config")
    unknown = sorted(set(raw) - _COMPOSITE_KEYS)
    if unknown:
        raise UnsupportedModelError(f"config field {unknown[0]!r} is not understood by dsv4c; refusing rather than "
                                    "compiling a different model")
    flat = dict(text)
    for key in ("quantization_config", "tie_word_embeddings", "bos_token_id", "eos_token_id", "torch_dtype"):
        if key in raw and key not in flat:
            flat[key] = raw[key]
    return flat


def _default_kv_sources(ratios: list[int]) -> list[int]:
    return [i for i, r in enumerate(ratios) if r > 0 and (i == 0 or ratios[i - 1] != r)]


def read_v41(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fields, extra)``: ``fields`` is the text config in the spelling the common reader takes
    (with the schedule's ids filled in and what dsv4c does not compile dropped), ``extra`` holds
    what :func:`v41_layers` and :func:`v41_numerics` need."""
    text = _text_config(raw)
    n = _int(text, "num_hidden_layers")
    ratios = text.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < n or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios):
        raise ConfigError(f"config field 'compress_ratios' must list a ratio >= 0 for each of the {n} layers, "
                          f"got {ratios!r}")
    ratios = ratios[:n]  # the tail, if any, is the drafter's
    fields = {k: v for k, v in text.items() if k not in _DROPPED and k not in _ENGRAM_FIELDS and k != "gate_temp"}
    fields.update(model_type="deepseek_v4", compress_ratios=ratios, num_nextn_predict_layers=0, num_hash_layers=0)
    fields.setdefault("rms_norm_eps", _DEFAULTS["rms_norm_eps"])
    if fields.get("kv_source_layer_ids") is None:
        fields["kv_source_layer_ids"] = _default_kv_sources(ratios)
    if fields.get("index_source_layer_ids") is None:
        fields["index_source_layer_ids"] = fields["kv_source_layer_ids"]
    source = fields.get("candidate_source_layer_id")
    if source is None and fields["kv_source_layer_ids"]:
        source = fields["kv_source_layer_ids"][-1]
    if source is None or (isinstance(source, int) and source < 0):
        for key in ("candidate_source_layer_id", "candidate_block_size", "candidate_topk_blocks"):
            fields.pop(key, None)
    else:
        fields["candidate_source_layer_id"] = source
        for key in ("candidate_block_size", "candidate_topk_blocks"):
            fields.setdefault(key, _DEFAULTS[key])
    fields.setdefault("engram_layer_ids", [])
    types = text.get("layer_types")
    if types is not None:
        kv = set(fields["kv_source_layer_ids"])
        want = ["shared_compressed_attention" if i in kv else "sliding_attention" for i in range(n)]
        if types != want:
            raise ConfigError(f"config field 'layer_types' disagrees with kv_source_layer_ids: {types!r}")
    extra = {k: text[k] for k in (*_ENGRAM_FIELDS, "gate_temp", "image_token_id") if k in text}
    if "vision_config" in raw and "image_token_id" not in extra:
        extra["image_token_id"] = raw.get("image_token_id", IMAGE_TOKEN_ID)
    return fields, extra


def v41_layers(fields: dict[str, Any], moe: list[str]) -> tuple[LayerSpec, ...]:
    """The backbone's roles, checked, with the schedules the reference leaves undefined refused."""
    layers = shared_kv_schedule(fields, fields["compress_ratios"], moe)
    index_sources = set(fields["index_source_layer_ids"])
    kv_sources = fields["kv_source_layer_ids"]
    for i in kv_sources:
        if i not in index_sources:
            # Its group would reuse the previous group's top-k, whose width is that group's rows.
            raise UnsupportedModelError(f"config: KV source layer {i} is not an index source; V4.1 leaves such a "
                                        "group's top-k undefined")
        if layers[i].compress_ratio == 0:
            raise ConfigError(f"config: KV source layer {i} has compress ratio 0")
    for i in index_sources:
        if layers[i].compress_ratio == 0:
            raise ConfigError(f"config: index source layer {i} has compress ratio 0")
    source = fields.get("candidate_source_layer_id")
    if source is not None and any(i > source for i in kv_sources):
        # Later index sources would mask another group's rows with the candidate mask.
        raise UnsupportedModelError(f"config: KV source layer {max(kv_sources)} comes after the candidate source "
                                    f"{source}; V4.1 leaves its candidate mask undefined")
    validate_schedule(layers)
    return layers


def v41_numerics(extra: dict[str, Any], fields: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """V4.1's :class:`ModelConfig` fields besides the schedule."""
    gate_temp = extra.get("gate_temp", 1.0)
    if isinstance(gate_temp, bool) or not isinstance(gate_temp, (int, float)) or not gate_temp > 0:
        raise ConfigError(f"config field 'gate_temp' must be a positive number, got {gate_temp!r}")
    engram = None
    layer_ids = tuple(fields["engram_layer_ids"])
    if layer_ids:
        e = {**_DEFAULTS, **extra}
        rows = e.get("engram_num_embeddings")
        if not isinstance(rows, list) or len(rows) != len(layer_ids) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in rows):
            raise ConfigError(f"config field 'engram_num_embeddings' must give the table rows of each of the "
                              f"{len(layer_ids)} Engram layers, got {rows!r}")
        engram = Engram(layer_ids=layer_ids, vocab_size=_int(e, "engram_vocab_size"), num_embeddings=tuple(rows),
                        max_ngram_size=_int(e, "engram_max_ngram_size", 2), n_heads=_int(e, "engram_n_heads"),
                        head_dim=_int(e, "engram_head_dim"), pad_id=_int(e, "engram_pad_id", 0),
                        compressed_vocab_size=_int(e, "engram_compressed_vocab_size"))
        if engram.pad_id >= vocab_size:
            raise ConfigError(f"config field 'engram_pad_id' = {engram.pad_id} is not a token id below {vocab_size}")
    image_token_id = extra.get("image_token_id")
    if image_token_id is not None and (isinstance(image_token_id, bool) or not isinstance(image_token_id, int)
                                       or not 0 <= image_token_id < vocab_size):
        raise ConfigError(f"config field 'image_token_id' must be a token id below {vocab_size}, got {image_token_id!r}")
    return dict(V41_NUMERICS, gate_temp=float(gate_temp), engram=engram, image_token_id=image_token_id)

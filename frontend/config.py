"""Reading a model's config: every spelling, validated, into one :class:`ModelConfig`
(``artifact.model_config``, which the runtime shares).

Configs arrive in three spellings and all load into :class:`ModelConfig`:

* the official Hugging Face hub ``config.json`` (``compress_ratios``, ``num_hash_layers``,
  ``qk_rope_head_dim``, ``rope_scaling``),
* the official ``inference/config.json`` (``dim``, ``n_layers``, ``window_size``, ...),
* the ``transformers`` spelling (``layer_types``, ``mlp_layer_types``, ``compress_rates``,
  ``rope_parameters`` with ``main`` / ``compress``).

The per-layer schedule is kept as a plain list of :class:`LayerSpec`, never a formula.
DSpark drafter fields are read by ``frontend.dspark_config``; DeepSeek-V4.1 configs
(``model_type`` ``deepseek_v41`` / ``deepseek_v41_text``) by ``frontend.config_v41`` first.
Anything we do not implement (in a V4 config: V4.1's ratios 1/2 and shared-KV roles, which
``frontend.schedule`` reads and checks first; unknown fields) is refused with a
:class:`~dsv4c.errors.ConfigError` that names the field: a silently ignored field would
compile a wrong model.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from dsv4c.artifact.model_config import (CSA, HASH_MOE, HCA, HF_LAYER_TYPES, HF_MLP_TYPES, ROUTED_MOE, SLIDING,
                                         ModelConfig, Rope, WeightFormats, Yarn, v4_layer)
from dsv4c.artifact.quant import FP8_BLOCK_SIZES
from dsv4c.errors import ConfigError, UnsupportedModelError
from dsv4c.frontend.config_v41 import V41_MODEL_TYPES, read_v41, v41_layers, v41_numerics
from dsv4c.frontend.dspark_config import DSPARK_KEYS, parse_dspark, stage_ratios
from dsv4c.frontend.schedule import SHARED_KV_FIELDS, shared_kv_schedule, validate_schedule

# flash-0731 / pro-0813: the DSpark releases' structure (presets/README.md says what is confirmed).
PRESETS = ("pro", "flash", "tiny", "flash-0731", "pro-0813", "v41-flash", "v41-tiny")
COST_ONLY_PRESETS = ("v3.2",)  # costed by `dsv4c inspect --cost` (frontend.v32), never compiled


# --------------------------------------------------------------------------- parsing

# Keys every transformers config may carry that do not change the model.
_INERT_KEYS = {
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "use_cache", "initializer_range",
    "attention_dropout", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "pad_token_id",
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "max_batch_size", "max_seq_len", "auto_map",
    "topk_method", "model_type", "scale_dtype", "tokenizer_class", "max_length", "dtype", "n_group", "topk_group",
}

# Canonical field <- accepted spellings.
_ALIASES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size", "dim"),
    "num_layers": ("num_hidden_layers", "n_layers"),
    "num_heads": ("num_attention_heads", "n_heads"),
    "head_dim": ("head_dim",),
    "rope_dim": ("qk_rope_head_dim", "rope_head_dim"),
    "q_lora_rank": ("q_lora_rank",),
    "o_groups": ("o_groups",),
    "o_lora_rank": ("o_lora_rank",),
    "n_routed_experts": ("n_routed_experts", "num_local_experts"),
    "n_experts_per_tok": ("num_experts_per_tok", "n_activated_experts"),
    "n_shared_experts": ("n_shared_experts",),
    "moe_intermediate_size": ("moe_intermediate_size", "moe_inter_dim", "intermediate_size"),
    "routed_scaling_factor": ("routed_scaling_factor", "route_scale"),
    "scoring_func": ("scoring_func", "score_func"),
    "swiglu_limit": ("swiglu_limit",),
    "index_n_heads": ("index_n_heads",),
    "index_head_dim": ("index_head_dim",),
    "index_topk": ("index_topk",),
    "sliding_window": ("sliding_window", "window_size"),
    "hc_mult": ("hc_mult",),
    "hc_sinkhorn_iters": ("hc_sinkhorn_iters",),
    "hc_eps": ("hc_eps",),
    "rms_norm_eps": ("rms_norm_eps", "norm_eps"),
    "rope_theta": ("rope_theta",),
    "compress_rope_theta": ("compress_rope_theta",),
    "num_mtp": ("num_nextn_predict_layers", "n_mtp_layers"),
    "num_hash_layers": ("num_hash_layers", "n_hash_layers"),
    "max_position_embeddings": ("max_position_embeddings",),
    "partial_rotary_factor": ("partial_rotary_factor",),
}
_OTHER_KNOWN = {
    "compress_ratios", "layer_types", "mlp_layer_types", "compress_rates", "compress_rate_csa", "compress_rate_hca",
    "rope_scaling", "rope_parameters", "rope_factor", "original_seq_len", "beta_fast", "beta_slow",
    "num_key_value_heads", "bos_token_id", "eos_token_id", "quantization_config", "expert_dtype", "scale_fmt",
    "tie_word_embeddings", "hidden_act", "norm_topk_prob", "attention_bias", "mlp_bias", *SHARED_KV_FIELDS,
    *DSPARK_KEYS,
}
_REQUIRED = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
    "n_routed_experts", "n_experts_per_tok", "moe_intermediate_size", "index_n_heads", "index_head_dim",
    "index_topk", "sliding_window",
)
_DEFAULTS: dict[str, Any] = {
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    # Both the official ModelArgs and transformers default to one MTP layer.
    "num_mtp": 1,
}


def _refuse_unsupported_variants(raw: dict[str, Any]) -> None:
    # Malformed containers are reported with their type by _attention_schedule.
    ratios, rates = raw.get("compress_ratios"), raw.get("compress_rates")
    given = [(f"compress_ratios[{i}]", r) for i, r in enumerate(ratios if isinstance(ratios, list) else [])]
    given += [(f"compress_rates[{k!r}]", r) for k, r in (rates.items() if isinstance(rates, dict) else [])]
    given += [(k, raw[k]) for k in ("compress_rate_csa", "compress_rate_hca") if k in raw]
    for where, r in given:
        if r in (1, 2) and not any(k in raw for k in SHARED_KV_FIELDS):  # refused with their roles
            raise UnsupportedModelError(
                f"config field {where} = {r}: V4.1-style ratios 1/2 (KV owners, delayed mHC) "
                "are not implemented by dsv4c"
            )
    unknown = [k for k in raw if k not in _INERT_KEYS and k not in _OTHER_KNOWN
               and not any(k in spellings for spellings in _ALIASES.values())]
    if unknown:
        raise UnsupportedModelError(
            f"config field {unknown[0]!r} is not understood by dsv4c; refusing rather than compiling a different model"
        )


def _gather(raw: dict[str, Any]) -> dict[str, Any]:
    """Fold every spelling of a field into its canonical name; conflicting spellings are errors."""
    out: dict[str, Any] = {}
    for canon, spellings in _ALIASES.items():
        given = [(s, raw[s]) for s in spellings if s in raw and raw[s] is not None]
        if not given:
            continue
        if any(v != given[0][1] for _, v in given[1:]):
            names = " vs ".join(f"{s}={v!r}" for s, v in given)
            raise ConfigError(f"config fields disagree: {names}")
        out[canon] = given[0][1]
    return out


def _field(raw: dict[str, Any], key: str) -> str:
    """The spelling of canonical field ``key`` that ``raw`` uses (its first spelling if none)."""
    spellings = _ALIASES.get(key, (key,))
    return next((s for s in spellings if s in raw), spellings[0])


def _positive_int(raw: dict[str, Any], f: dict[str, Any], key: str) -> int:
    v = f[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config field {_field(raw, key)!r} must be a positive integer, got {v!r}")
    return v


def _positive(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"config field {name!r} must be a positive number, got {v!r}")
    return float(v)


def _number(raw: dict[str, Any], f: dict[str, Any], key: str) -> float:
    return _positive(f[key], _field(raw, key))


def _parse_rope(raw: dict[str, Any], f: dict[str, Any]) -> tuple[Rope, Rope]:
    main_theta = _number(raw, f, "rope_theta")
    compress_theta = _number(raw, f, "compress_rope_theta")
    yarn_src: Any = None
    where = ""  # how the config spells the keys of yarn_src: prefix, or per-key names below
    names: dict[str, str] = {}
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main = params["main"]
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise UnsupportedModelError("config field rope_parameters.main.rope_type must be 'default'")
        main_theta = _positive(main.get("rope_theta", main_theta), "rope_parameters.main.rope_theta")
        compress = params["compress"]
        compress_theta = _positive(compress.get("rope_theta", compress_theta), "rope_parameters.compress.rope_theta")
        yarn_src, where = compress, "rope_parameters.compress."
    elif raw.get("rope_scaling") is not None:
        yarn_src, where = raw["rope_scaling"], "rope_scaling."
    elif params is not None:
        yarn_src, where = params, "rope_parameters."
    elif "rope_factor" in raw:  # official inference/config.json
        yarn_src = {
            "type": "yarn",
            "factor": raw["rope_factor"],
            "original_max_position_embeddings": raw.get("original_seq_len", 0),
            "beta_fast": raw.get("beta_fast", 32),
            "beta_slow": raw.get("beta_slow", 1),
        }
        names = {"factor": "rope_factor", "original_max_position_embeddings": "original_seq_len"}
    if yarn_src is not None and not isinstance(yarn_src, dict):
        raise ConfigError(f"config field {where[:-1]!r} must be an object, got {yarn_src!r}")

    def name(key: str) -> str:
        return names.get(key, where + key)

    yarn = None
    if yarn_src:
        kind = yarn_src.get("rope_type", yarn_src.get("type", "default"))
        if kind == "yarn":
            orig = yarn_src.get("original_max_position_embeddings")
            if orig != 0:  # official inference configs use original_seq_len = 0 to switch YaRN off
                attention_factor = yarn_src.get("attention_factor", 1.0)
                if attention_factor not in (None, 1, 1.0):
                    raise UnsupportedModelError(
                        f"config field {name('attention_factor')} = {attention_factor}: "
                        "V4 forces 1.0 on the compress rope"
                    )
                if isinstance(orig, float) and orig.is_integer():
                    orig = int(orig)
                if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
                    raise ConfigError(
                        f"config field {name('original_max_position_embeddings')!r} must be a positive integer, "
                        f"got {orig!r}"
                    )
                yarn = Yarn(
                    factor=_positive(yarn_src.get("factor"), name("factor")),
                    original_max_position_embeddings=orig,
                    # transformers reads a missing or null (or zero) beta as its default.
                    beta_fast=_positive(yarn_src.get("beta_fast") or 32, name("beta_fast")),
                    beta_slow=_positive(yarn_src.get("beta_slow") or 1, name("beta_slow")),
                )
        elif kind != "default":
            raise UnsupportedModelError(
                f"config field {name('rope_type' if 'rope_type' in yarn_src else 'type')} = {kind!r}: "
                "only 'default' and 'yarn' rope types are implemented"
            )
    return Rope(main_theta), Rope(compress_theta, yarn)


def _compress_rates(raw: dict[str, Any]) -> dict[str, int]:
    """The compress ratio of each attention kind; the legacy scalar and the dict entry
    are two spellings of one field."""
    rates = raw.get("compress_rates")
    if rates is None:
        rates = {}
    if not isinstance(rates, dict):
        raise ConfigError(f"config field 'compress_rates' must be an object, got {rates!r}")
    bad_rates = [k for k in rates if k not in HF_LAYER_TYPES or k == "sliding_attention"]
    if bad_rates:
        raise UnsupportedModelError(f"config field compress_rates[{bad_rates[0]!r}] names an unknown attention kind")
    ratio_of = {SLIDING: 0}
    for kind, key, legacy, default in ((CSA, "compressed_sparse_attention", "compress_rate_csa", 4),
                                       (HCA, "heavily_compressed_attention", "compress_rate_hca", 128)):
        given = [(f"compress_rates[{key!r}]", rates[key])] if key in rates else []
        given += [(legacy, raw[legacy])] if raw.get(legacy) is not None else []
        if len(given) == 2 and given[0][1] != given[1][1]:
            raise ConfigError(f"config fields disagree: {given[0][0]}={given[0][1]!r} vs {legacy}={given[1][1]!r}")
        name, rate = given[0] if given else (legacy, default)
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ConfigError(f"config field {name} must be a positive integer, got {rate!r}")
        ratio_of[kind] = rate
    return ratio_of


def _official_kinds(ratios: list[int]) -> list[tuple[str, int]]:
    """(kind, ratio) per ``compress_ratios`` entry as the official reference reads them: 4 is
    CSA (overlapping windows and an indexer), any other non-zero ratio is HCA at that ratio."""
    schedule = []
    for i, r in enumerate(ratios):
        if r < 0:
            raise ConfigError(f"config field compress_ratios[{i}] = {r} must be 0 (sliding) or a positive ratio")
        schedule.append((SLIDING if r == 0 else CSA if r == 4 else HCA, r))
    hca = [(i, r) for i, (kind, r) in enumerate(schedule) if kind == HCA]
    other = next(((i, r) for i, r in hca if r != hca[0][1]), None)
    if other is not None:
        # An artifact describes its model in the transformers spelling (the C++ host reads it),
        # which holds one ratio per attention kind.
        raise UnsupportedModelError(
            f"config field compress_ratios[{other[0]}] = {other[1]}: HCA layers at a second ratio "
            f"(compress_ratios[{hca[0][0]}] = {hca[0][1]}); dsv4c compiles one HCA ratio per model"
        )
    return schedule


def _kinds_by_rates(ratios: list[int], ratio_of: dict[str, int]) -> list[tuple[str, int]]:
    """(kind, ratio) per ``compress_ratios`` entry where the config also sets the rate of each kind."""
    if ratio_of[CSA] == ratio_of[HCA]:
        raise ConfigError(
            f"config field 'compress_ratios': CSA and HCA both compress by {ratio_of[CSA]}, so a ratio cannot say "
            "which a layer is; use layer_types + compress_rates"
        )
    kind_of = {ratio: kind for kind, ratio in ratio_of.items()}
    for i, r in enumerate(ratios):
        if r not in kind_of:
            raise UnsupportedModelError(
                f"config field compress_ratios[{i}] = {r} is neither 0, the CSA rate ({ratio_of[CSA]}) nor the HCA "
                f"rate ({ratio_of[HCA]}) that compress_rates / compress_rate_csa / compress_rate_hca set"
            )
    return [(kind_of[r], r) for r in ratios]


def _attention_schedule(raw: dict[str, Any], n: int, n_mtp: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(kind, ratio) for every backbone layer, then for every MTP layer."""
    ratio_of = _compress_rates(raw)
    types, ratios = raw.get("layer_types"), raw.get("compress_ratios")
    if types is None and ratios is None:
        raise ConfigError("config has neither 'compress_ratios' nor 'layer_types': the layer schedule is missing")

    from_types = None
    if types is not None:
        if not isinstance(types, list):
            raise ConfigError(f"config field 'layer_types' must be a list, got {types!r}")
        if len(types) != n:
            raise ConfigError(f"config field 'layer_types' has {len(types)} entries for num_hidden_layers = {n}")
        kinds = []
        for i, t in enumerate(types):
            if not isinstance(t, str) or t not in HF_LAYER_TYPES:
                raise UnsupportedModelError(
                    f"config field layer_types[{i}] = {t!r} is not one of {sorted(HF_LAYER_TYPES)}"
                )
            kinds.append(HF_LAYER_TYPES[t])
        # transformers does not instantiate MTP; the official MTP block is sliding-only.
        from_types = [(k, ratio_of[k]) for k in kinds], [(SLIDING, 0)] * n_mtp
    if ratios is None:
        return from_types

    if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
        raise ConfigError(f"config field 'compress_ratios' must be a list of integers, got {ratios!r}")
    if len(ratios) < n:
        raise ConfigError(
            f"config field 'compress_ratios' has {len(ratios)} entries; expected num_hidden_layers ({n})"
            f" or num_hidden_layers + MTP layers ({n + n_mtp})"
        )
    if len(ratios) > n + n_mtp:
        # A checkpoint whose MTP layer was dropped without trimming the list; the official
        # reference reads one entry per layer it builds and ignores the rest.
        print(f"dsv4c: warning: config field 'compress_ratios' has {len(ratios)} entries for {n} layers and {n_mtp} "
              f"MTP layers; ignoring the last {len(ratios) - n - n_mtp}", file=sys.stderr)
        ratios = ratios[:n + n_mtp]
    if all(raw.get(k) is None for k in ("compress_rates", "compress_rate_csa", "compress_rate_hca")):
        schedule = _official_kinds(ratios)
    else:
        schedule = _kinds_by_rates(ratios, ratio_of)
    mtp = schedule[n:] if len(ratios) == n + n_mtp else [(SLIDING, 0)] * n_mtp
    if from_types is not None and from_types[0] != schedule[:n]:
        i = next(i for i, (a, b) in enumerate(zip(from_types[0], schedule)) if a != b)
        raise ConfigError(
            f"config fields disagree: layer_types[{i}] = {types[i]!r} vs compress_ratios[{i}] = {ratios[i]}"
        )
    return schedule[:n], mtp


def _moe_schedule(raw: dict[str, Any], f: dict[str, Any], n: int) -> list[str]:
    n_hash = f.get("num_hash_layers")
    if n_hash is not None and (isinstance(n_hash, bool) or not isinstance(n_hash, int) or not 0 <= n_hash <= n):
        raise ConfigError(f"config field {_field(raw, 'num_hash_layers')!r} must be an integer in [0, {n}], "
                          f"got {n_hash!r}")
    types = raw.get("mlp_layer_types")
    if types is None:
        # Both the official ModelArgs and transformers default to 3 (capped at the depth).
        n_hash = min(n, 3) if n_hash is None else n_hash
        return [HASH_MOE] * n_hash + [ROUTED_MOE] * (n - n_hash)
    if not isinstance(types, list) or len(types) != n:
        got = f"{len(types)} entries" if isinstance(types, list) else f"a {type(types).__name__}"
        raise ConfigError(f"config field 'mlp_layer_types' has {got}; expected a list of num_hidden_layers = {n}")
    out = []
    for i, t in enumerate(types):
        if not isinstance(t, str) or t not in HF_MLP_TYPES:
            raise UnsupportedModelError(f"config field mlp_layer_types[{i}] = {t!r} is not 'hash_moe' or 'moe'")
        out.append(HF_MLP_TYPES[t])
    if n_hash is not None and out != [HASH_MOE] * n_hash + [ROUTED_MOE] * (n - n_hash):
        raise ConfigError(f"config fields disagree: {_field(raw, 'num_hash_layers')} = {n_hash} vs mlp_layer_types")
    return out


def _weight_formats(raw: dict[str, Any]) -> WeightFormats:
    qc = raw.get("quantization_config")
    dense, scale, fp8_block = "bf16", "e8m0", 128
    if raw.get("dtype") in ("fp8", "bf16"):  # official inference/config.json
        dense = raw["dtype"]
        scale = "e8m0" if raw.get("scale_fmt") == "ue8m0" or raw.get("scale_dtype") == "fp8" else "fp32"
    if isinstance(qc, dict):
        method, fmt = qc.get("quant_method"), qc.get("fmt", "e4m3")
        if method != "fp8" or fmt != "e4m3":
            raise UnsupportedModelError(
                f"config field quantization_config: quant_method={method!r} fmt={fmt!r}; only fp8 e4m3 is implemented"
            )
        block = qc.get("weight_block_size", [128, 128])
        if not isinstance(block, list) or block not in ([b, b] for b in FP8_BLOCK_SIZES) or type(block[0]) is not int:
            raise UnsupportedModelError(f"config field quantization_config.weight_block_size = {block!r}; dsv4c "
                                        f"implements square FP8 blocks of {' or '.join(map(str, FP8_BLOCK_SIZES))}")
        fp8_block = block[0]
        dense = "fp8"
        scale = "e8m0" if qc.get("scale_fmt") == "ue8m0" else "fp32"
    elif qc is not None:
        raise ConfigError("config field 'quantization_config' must be an object")
    if dense == "bf16" and raw.get("torch_dtype", raw.get("dtype")) == "float32":
        dense = "fp32"
    experts, qc_experts = raw.get("expert_dtype"), (qc or {}).get("expert_dtype")
    if experts and qc_experts and experts != qc_experts:
        raise ConfigError(f"config fields disagree: expert_dtype={experts!r} vs quantization_config.expert_dtype="
                          f"{qc_experts!r}")
    experts = experts or qc_experts
    if experts not in (None, "fp4", "fp8", "bf16", "fp32"):
        raise UnsupportedModelError(f"config field expert_dtype = {experts!r}; expected fp4, fp8, bf16 or fp32")
    # Released FP8 V4 checkpoints store routed experts as FP4 even where the hub config
    # (V4-Flash) does not say so; the loader follows each tensor's real dtype anyway.
    return WeightFormats(dense=dense, experts=experts or ("fp4" if dense == "fp8" else dense), scale=scale,
                         fp8_block=fp8_block)


def _refuse_shared_kv(raw: dict[str, Any], f: dict[str, Any], n: int) -> None:
    """A V4.1-style schedule is read and checked (a bad reference is a ConfigError naming it), then
    refused: the trace builds V4's sliding / CSA / HCA layers only."""
    given = [k for k in SHARED_KV_FIELDS if k in raw]
    if not given:
        return
    ratios = raw.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < n or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios):
        raise ConfigError(f"config field 'compress_ratios' must list a ratio >= 0 for each of the {n} layers "
                          f"beside {given[0]}, got {ratios!r}")
    validate_schedule(shared_kv_schedule(raw, ratios[:n], _moe_schedule(raw, f, n)))
    raise UnsupportedModelError(f"config field {given[0]!r}: V4.1 layer roles (shared compressed KV, reused "
                                "top-k, Engram) are not implemented by dsv4c")


def config_from_dict(raw: dict[str, Any], name: str = "custom") -> ModelConfig:
    """Validate and normalise a config dict in any supported spelling."""
    if not isinstance(raw, dict):
        raise ConfigError("a model config must be a JSON object")
    model_type = raw.get("model_type", "deepseek_v4")
    v41_extra = None
    if model_type in V41_MODEL_TYPES:
        raw, v41_extra = read_v41(raw)
    elif model_type != "deepseek_v4":
        raise UnsupportedModelError(f"config field model_type = {model_type!r}; dsv4c compiles 'deepseek_v4', "
                                    f"{' and '.join(map(repr, V41_MODEL_TYPES))} only")
    _refuse_unsupported_variants(raw)
    f = {**_DEFAULTS, **_gather(raw)}
    missing = [k for k in _REQUIRED if k not in f]
    if missing:
        raise ConfigError(f"config is missing the field {_ALIASES[missing[0]][0]!r}")
    ints = {k: _positive_int(raw, f, k) for k in _REQUIRED}
    for k in ("hc_mult", "hc_sinkhorn_iters"):
        ints[k] = _positive_int(raw, f, k)
    n = ints["num_layers"]
    n_mtp = f["num_mtp"]
    dspark = parse_dspark(raw, n, ints["vocab_size"], ints["n_routed_experts"], ints["n_experts_per_tok"])
    if dspark is not None:  # the stages: as many as the config says (a checkpoint may correct it)
        if isinstance(n_mtp, bool) or not isinstance(n_mtp, int) or n_mtp < 1:
            raise ConfigError(f"config field {_field(raw, 'num_mtp')} = {n_mtp!r}: a DSpark drafter has at least "
                              "one stage")
        raw = stage_ratios(raw, n)
    elif isinstance(n_mtp, bool) or not isinstance(n_mtp, int) or not 0 <= n_mtp <= 1:
        raise UnsupportedModelError(f"config field {_field(raw, 'num_mtp')} = {n_mtp!r}; dsv4c implements 0 or 1")

    head_dim = ints["head_dim"]
    # transformers sizes the rope as int(head_dim * partial_rotary_factor) of each
    # rope_parameters entry, the official code reads qk_rope_head_dim: all that are given must agree.
    rope_dim = f.get("rope_dim")
    factors = [("partial_rotary_factor", f.get("partial_rotary_factor"))]
    params = raw.get("rope_parameters")
    for label in ("main", "compress"):
        entry = params.get(label) if isinstance(params, dict) else None
        if isinstance(entry, dict):
            factors.append((f"rope_parameters.{label}.partial_rotary_factor", entry.get("partial_rotary_factor")))
    for key, factor in factors:
        if factor is None:
            continue
        dims = head_dim * _positive(factor, key)
        if abs(dims - int(dims)) > 1e-9:
            raise ConfigError(f"config field {key} = {factor}: head_dim * {factor} = {dims} is not a whole number")
        if rope_dim is None:
            rope_dim = int(dims)
        elif int(dims) != rope_dim:
            raise ConfigError(f"config fields disagree: {_field(raw, 'rope_dim')} = {rope_dim!r} vs {key} = {factor} "
                              f"({int(dims)} rope dims)")
    if rope_dim is None:
        rope_dim = 64
    if not isinstance(rope_dim, int) or rope_dim <= 0 or rope_dim % 2 or rope_dim >= head_dim:
        raise ConfigError(f"config field {_field(raw, 'rope_dim')!r} = {rope_dim!r} must be even and smaller than "
                          f"head_dim ({head_dim})")
    if rope_dim > ints["index_head_dim"]:
        raise ConfigError(f"config field 'index_head_dim' = {ints['index_head_dim']} is smaller than the rope dims")

    checks = [
        (raw.get("num_key_value_heads", 1) == 1, "num_key_value_heads must be 1 (V4 is MQA with K == V)"),
        (f["n_shared_experts"] == 1, "n_shared_experts must be 1"),
        (f["scoring_func"] == "sqrtsoftplus",
         f"{_field(raw, 'scoring_func')} = {f['scoring_func']!r}; V4 routes with 'sqrtsoftplus'"),
        (raw.get("hidden_act", "silu") == "silu", "hidden_act must be 'silu'"),
        (raw.get("norm_topk_prob", True) is True, "norm_topk_prob must be true"),
        (not raw.get("tie_word_embeddings", False), "tie_word_embeddings must be false (V4's head is not tied)"),
        (not raw.get("attention_bias", False), "attention_bias must be false (V4 has no attention biases)"),
        (not raw.get("mlp_bias", False), "mlp_bias must be false (V4 has no MLP biases)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UnsupportedModelError(f"config: {msg}")
    if (ints["num_heads"] * head_dim) % ints["o_groups"]:
        raise ConfigError(
            f"config: num_attention_heads * head_dim ({ints['num_heads'] * head_dim}) is not divisible by o_groups"
        )
    if ints["n_experts_per_tok"] > ints["n_routed_experts"]:
        raise ConfigError("config: num_experts_per_tok is larger than n_routed_experts")

    main_rope, compress_rope = _parse_rope(raw, f)
    moe = _moe_schedule(raw, f, n)
    if v41_extra is not None:
        layers, mtp_layers = v41_layers(raw, moe), ()
    else:
        _refuse_shared_kv(raw, f, n)
        attention, mtp_attention = _attention_schedule(raw, n, n_mtp)
        layers = tuple(v4_layer(i, k, r, m) for i, ((k, r), m) in enumerate(zip(attention, moe)))
        mtp_layers = tuple(v4_layer(n + i, k, r, ROUTED_MOE) for i, (k, r) in enumerate(mtp_attention))
        validate_schedule(layers + mtp_layers)
    weights = _weight_formats(raw)
    if weights.experts == "fp4" and (ints["hidden_size"] % 32 or ints["moe_intermediate_size"] % 32):
        raise ConfigError("config: FP4 experts need hidden_size and moe_intermediate_size divisible by 32")

    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    cfg = ModelConfig(
        vocab_size=ints["vocab_size"], hidden_size=ints["hidden_size"], num_heads=ints["num_heads"],
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=ints["q_lora_rank"], o_groups=ints["o_groups"],
        o_lora_rank=ints["o_lora_rank"], n_routed_experts=ints["n_routed_experts"],
        n_experts_per_tok=ints["n_experts_per_tok"], moe_intermediate_size=ints["moe_intermediate_size"],
        routed_scaling_factor=_number(raw, f, "routed_scaling_factor"), swiglu_limit=_number(raw, f, "swiglu_limit"),
        index_n_heads=ints["index_n_heads"], index_head_dim=ints["index_head_dim"], index_topk=ints["index_topk"],
        sliding_window=ints["sliding_window"], hc_mult=ints["hc_mult"], hc_sinkhorn_iters=ints["hc_sinkhorn_iters"],
        hc_eps=_number(raw, f, "hc_eps"), rms_norm_eps=_number(raw, f, "rms_norm_eps"), main_rope=main_rope,
        compress_rope=compress_rope, layers=layers, mtp_layers=mtp_layers,
        max_position_embeddings=_positive_int(raw, f, "max_position_embeddings"),
        bos_token_id=raw.get("bos_token_id", 0), eos_token_ids=eos_ids, weights=weights, name=name, dspark=dspark,
    )
    return cfg if v41_extra is None else replace(cfg, **v41_numerics(v41_extra, raw, cfg.vocab_size))


def load_config(path: str | Path) -> ModelConfig:
    """Load ``config.json`` from a file or a model directory (also ``inference/config.json``)."""
    p = Path(path)
    if p.is_dir():
        candidates = [p / "config.json", p / "inference" / "config.json"]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise ConfigError(f"{p}: no config.json (or inference/config.json) in this model directory")
        p = found
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not a readable JSON config ({e.__class__.__name__}: {str(e).splitlines()[0]})") from None
    try:
        return config_from_dict(raw, name=p.parent.name if p.name == "config.json" else p.stem)
    except ConfigError as e:
        raise type(e)(f"{p}: {e}") from None


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or give a model directory")
    raw = json.loads(resources.files("dsv4c.frontend").joinpath(f"presets/{name}.json").read_text())
    return config_from_dict(raw, name=name)


def resolve_model(spec: str | Path) -> ModelConfig:
    """A preset name or a path to a model directory / config file."""
    if str(spec) in COST_ONLY_PRESETS and not Path(spec).exists():
        raise UnsupportedModelError(f"{spec} is a cost-model preset (DeepSeek-V3.2-Exp, for comparison): "
                                    f"`dsv4c inspect {spec} --cost`; dsv4c compiles DeepSeek-V4 models only")
    if str(spec) in PRESETS and not Path(spec).exists():
        return preset(str(spec))
    if not Path(spec).exists():
        raise ConfigError(f"{spec}: neither a preset ({', '.join(PRESETS)}) nor an existing model directory or config")
    return load_config(spec)


def with_weights(cfg: ModelConfig, **formats: str) -> ModelConfig:
    return replace(cfg, weights=replace(cfg.weights, **formats))

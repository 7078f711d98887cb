"""Config loader: the official hub, official inference and transformers spellings, presets,
research configs, round trips, and one test per refusal (one-line ConfigError naming the field)."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from dsv4c.errors import ArtifactError, ConfigError, UnsupportedModelError
from dsv4c.artifact.model_config import CSA, HASH_MOE, HCA, ROUTED_MOE, SLIDING, ModelConfig, v4_layer
from dsv4c.frontend.config import PRESETS, config_from_dict, load_config, preset, with_weights

from parity_configs import PARITY_CONFIGS

REFERENCE = Path(__file__).parent / "data" / "reference_configs"  # verbatim copies of the released V4-Pro / V4-Flash configs
DROP = object()  # marks a key to delete in a mutation

# A small official-spelling config: 4 layers (sliding, CSA, HCA, CSA) + a sliding MTP layer.
BASE = {
    "model_type": "deepseek_v4", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4, "sliding_window": 8,
    "num_hash_layers": 1, "compress_ratios": [0, 4, 128, 4, 0],
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
}
# The same model in the transformers spelling.
HF_BASE = {
    **{k: v for k, v in BASE.items() if k not in ("compress_ratios", "num_hash_layers", "rope_scaling")},
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000},
        "compress": {"rope_type": "yarn", "rope_theta": 160000, "factor": 16, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0},
    },
}


def mutate(base: dict, changes: dict) -> dict:
    """A deep copy of ``base`` with ``changes`` applied; dotted keys reach into sub-dicts."""
    raw = copy.deepcopy(base)
    for key, value in changes.items():
        *path, leaf = key.split(".")
        target = raw
        for part in path:
            target = target[part]
        if value is DROP:
            del target[leaf]
        else:
            target[leaf] = value
    return raw


def unnamed(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, name="custom")


def kinds(cfg: ModelConfig) -> dict[str, int]:
    return {k: sum(layer.attention == k for layer in cfg.layers) for k in (SLIDING, CSA, HCA)}


def assert_refused(raw, field: str, error=ConfigError) -> str:
    with pytest.raises(error) as info:
        config_from_dict(raw)
    message = str(info.value)
    assert "\n" not in message, message
    assert field in message, f"{field!r} not named in: {message}"
    return message


# --------------------------------------------------------------------------- official configs


@pytest.mark.parametrize("model", ["pro", "flash"])
def test_hub_and_inference_spellings_agree(model):
    hub = load_config(REFERENCE / f"v4-{model}.config.json")
    inference = load_config(REFERENCE / f"v4-{model}.inference_config.json")
    assert hub.layers == inference.layers
    assert hub.mtp_layers == inference.mtp_layers
    assert unnamed(hub) == unnamed(inference)  # every size, rope and weight format too
    assert unnamed(hub) == unnamed(preset(model))


def test_pro_schedule_and_sizes():
    cfg = preset("pro")
    assert kinds(cfg) == {HCA: 31, CSA: 30, SLIDING: 0}
    assert [l.compress_ratio for l in cfg.layers] == [128, 128] + [4, 128] * 29 + [4]
    assert [l.moe for l in cfg.layers] == [HASH_MOE] * 3 + [ROUTED_MOE] * 58
    assert cfg.mtp_layers == (v4_layer(61, SLIDING, 0, ROUTED_MOE),)
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rope_dim) == (7168, 128, 512, 64)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank) == (1536, 16, 1024)
    assert (cfg.n_routed_experts, cfg.n_experts_per_tok, cfg.moe_intermediate_size) == (384, 6, 3072)
    assert cfg.routed_scaling_factor == 2.5
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 1024)


def test_flash_schedule_and_sizes():
    cfg = preset("flash")
    assert kinds(cfg) == {HCA: 20, CSA: 21, SLIDING: 2}
    assert [l.compress_ratio for l in cfg.layers] == [0, 0] + [4, 128] * 20 + [4]
    assert [l.moe for l in cfg.layers] == [HASH_MOE] * 3 + [ROUTED_MOE] * 40
    assert cfg.mtp_layers == (v4_layer(43, SLIDING, 0, ROUTED_MOE),)
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rope_dim) == (4096, 64, 512, 64)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank) == (1024, 8, 1024)
    assert (cfg.n_routed_experts, cfg.n_experts_per_tok, cfg.moe_intermediate_size) == (256, 6, 2048)
    assert cfg.routed_scaling_factor == 1.5
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 512)


@pytest.mark.parametrize("model", ["pro", "flash"])
def test_shared_official_values(model):
    cfg = preset(model)
    assert (cfg.sliding_window, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps) == (128, 4, 20, 1e-6)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.swiglu_limit, cfg.rms_norm_eps) == (
        129280, 1048576, 10.0, 1e-6)
    assert cfg.main_rope.theta == 10000 and cfg.main_rope.yarn is None
    yarn = cfg.compress_rope.yarn
    assert cfg.compress_rope.theta == 160000
    assert (yarn.factor, yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow) == (16, 65536, 32, 1)
    assert (cfg.weights.dense, cfg.weights.experts, cfg.weights.scale) == ("fp8", "fp4", "e8m0")


def test_presets_are_frozen_and_named():
    for name in PRESETS:
        cfg = preset(name)
        assert cfg.name == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.hidden_size = 1
    tiny = preset("tiny")
    assert kinds(tiny) == {SLIDING: 1, CSA: 2, HCA: 1} and tiny.compress_ratios(HCA) == (16,)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="'huge'"):
        preset("huge")


# --------------------------------------------------------------------------- spellings and round trips


def test_official_and_hf_spellings_of_one_model_agree():
    assert config_from_dict(BASE) == config_from_dict(HF_BASE)


def test_both_schedule_spellings_together_when_they_agree():
    cfg = config_from_dict({**HF_BASE, "compress_ratios": [0, 4, 128, 4, 128], "num_hash_layers": 1})
    # compress_ratios alone can say the MTP layer is compressed
    assert cfg.layers == config_from_dict(BASE).layers and cfg.mtp_layers[0].attention == HCA


def test_transformers_saved_config_loads(tmp_path):
    from transformers import DeepseekV4Config

    for raw in (BASE, HF_BASE, PARITY_CONFIGS["odd_ratios_hc2"]):
        cfg = with_weights(config_from_dict(raw), dense="fp32", experts="fp32")
        DeepseekV4Config(**cfg.to_json_dict("hf")).save_pretrained(tmp_path)
        assert load_config(tmp_path) == dataclasses.replace(cfg, name=tmp_path.name)


def _research_configs() -> dict[str, dict]:
    return {
        **PARITY_CONFIGS,
        "rates_8_32_hf": mutate(HF_BASE, {"compress_rates": {"compressed_sparse_attention": 8,
                                                              "heavily_compressed_attention": 32}}),
        "rates_8_32_official": mutate(BASE, {"compress_ratios": [0, 8, 32, 8, 0], "compress_rate_csa": 8,
                                             "compress_rate_hca": 32}),
        "legacy_rates_with_layer_types": mutate(HF_BASE, {"compress_rates": DROP, "compress_rate_csa": 16,
                                                          "compress_rate_hca": 64}),
        "odd_window_hc2": mutate(BASE, {"sliding_window": 7, "hc_mult": 2}),
        "compressed_mtp": mutate(BASE, {"compress_ratios": [0, 4, 128, 4, 4]}),
        # The official spelling decides by the ratio itself: 4 is CSA, any other non-zero ratio HCA.
        "official_hca_8": mutate(BASE, {"compress_ratios": [8, 4, 0, 8, 0]}),
        "hash_not_a_prefix": mutate(HF_BASE, {"mlp_layer_types": ["moe", "hash_moe", "moe", "hash_moe"]}),
        "no_yarn_no_mtp": mutate(BASE, {"rope_scaling": DROP, "num_nextn_predict_layers": 0,
                                        "compress_ratios": [0, 4, 128, 4]}),
        "odd_sizes": mutate(BASE, {"head_dim": 49, "qk_rope_head_dim": 2, "num_attention_heads": 2,
                                   "o_groups": 7, "hidden_size": 96, "vocab_size": 101}),
        "fp32_weights": mutate(HF_BASE, {"torch_dtype": "float32"}),
        "fp8_fp32_scales_bf16_experts": mutate(BASE, {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
                                                      "expert_dtype": "bf16"}),
    }


@pytest.mark.parametrize("name", sorted(_research_configs()))
def test_research_configs_round_trip(name):
    cfg = config_from_dict(_research_configs()[name])
    expressible = 0
    for spelling in ("official", "hf"):
        try:
            written = cfg.to_json_dict(spelling)
        except ConfigError as e:
            assert "\n" not in str(e)
            continue
        expressible += 1
        assert config_from_dict(json.loads(json.dumps(written))) == cfg, spelling
        if spelling == "hf":  # what an artifact holds, read back by the runtime without the validator
            assert ModelConfig.from_json_dict(json.loads(json.dumps(written)), cfg.name) == cfg
    assert expressible >= 1
    assert config_from_dict(json.loads(json.dumps(cfg.to_json_dict()))) == cfg  # the default spelling


@pytest.mark.parametrize("name", PRESETS)
def test_presets_round_trip(name):
    cfg = preset(name)
    spellings = ("official", "hf") if name != "tiny" else ("hf",)
    for spelling in spellings:
        assert config_from_dict(cfg.to_json_dict(spelling), name=name) == cfg
    assert ModelConfig.from_json_dict(json.loads(json.dumps(cfg.to_json_dict("hf"))), name) == cfg


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_artifact_model_description_round_trips(name):
    cfg = config_from_dict(PARITY_CONFIGS[name], name)
    assert ModelConfig.from_json_dict(json.loads(json.dumps(cfg.to_json_dict("hf"))), name) == cfg


def test_a_mangled_model_description_is_a_one_line_artifact_error():
    d = preset("tiny").to_json_dict("hf")
    del d["layer_types"]
    with pytest.raises(ArtifactError, match="x/manifest.json: .*'layer_types'.*recompile") as e:
        ModelConfig.from_json_dict(d, "tiny", "x/manifest.json")
    assert "\n" not in str(e.value)


def test_inexpressible_spellings_are_refused():
    research = _research_configs()
    cases = [
        (preset("tiny"), "official", "0/4/128"),
        (config_from_dict(research["hash_not_a_prefix"]), "official", "num_hash_layers"),
        (config_from_dict(research["compressed_mtp"]), "hf", "MTP"),
        (preset("pro"), "yaml", "spelling"),
    ]
    for cfg, spelling, field in cases:
        with pytest.raises(ConfigError, match=field):
            cfg.to_json_dict(spelling)


def test_research_schedules():
    research = _research_configs()
    cfg = config_from_dict(research["rates_8_32_official"])
    assert [(l.attention, l.compress_ratio) for l in cfg.layers] == [(SLIDING, 0), (CSA, 8), (HCA, 32), (CSA, 8)]
    assert config_from_dict(research["rates_8_32_hf"]).layers == cfg.layers
    legacy = config_from_dict(research["legacy_rates_with_layer_types"])
    assert (legacy.compress_ratios(CSA), legacy.compress_ratios(HCA)) == ((16,), (64,))
    assert config_from_dict(research["odd_window_hc2"]).hc_mix_size == 8
    official = config_from_dict(research["official_hca_8"])
    assert [(l.attention, l.compress_ratio) for l in official.layers] == [(HCA, 8), (CSA, 4), (SLIDING, 0), (HCA, 8)]
    assert official.mtp_layers[0].attention == SLIDING


def test_trailing_compress_ratios_past_the_mtp_layers_are_ignored_with_a_warning(capsys):
    # A checkpoint whose MTP layer was dropped without trimming compress_ratios.
    dropped = config_from_dict(mutate(BASE, {"num_nextn_predict_layers": 0}))
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "ignoring the last 1" in warning and "'compress_ratios'" in warning
    trimmed = config_from_dict(mutate(BASE, {"num_nextn_predict_layers": 0, "compress_ratios": [0, 4, 128, 4]}))
    assert dropped == trimmed and dropped.mtp_layers == ()
    assert capsys.readouterr().err == ""
    # Past an MTP layer too: its own entry still counts.
    extra = config_from_dict(mutate(BASE, {"compress_ratios": [0, 4, 128, 4, 128, 4]}))
    assert "ignoring the last 1" in capsys.readouterr().err
    assert extra.mtp_layers[0].attention == HCA


def test_transformers_reads_our_rope_dims_for_odd_sizes():
    from transformers import DeepseekV4Config

    # 49 * (2 / 49) < 2 in floating point, and transformers truncates it.
    cfg = config_from_dict(_research_configs()["odd_sizes"])
    hf = DeepseekV4Config(**cfg.to_json_dict("hf"))
    assert hf.qk_rope_head_dim == cfg.rope_dim == 2
    for label in ("main", "compress"):
        assert int(hf.head_dim * hf.rope_parameters[label]["partial_rotary_factor"]) == 2


def test_defaults():
    raw = {k: v for k, v in HF_BASE.items() if k not in ("qk_rope_head_dim", "mlp_layer_types")}
    raw = {**raw, "head_dim": 128, "index_head_dim": 64, "num_hidden_layers": 2,
           "layer_types": HF_BASE["layer_types"][:2]}
    cfg = config_from_dict(raw)
    assert cfg.rope_dim == 64 and len(cfg.mtp_layers) == 1
    assert [l.moe for l in cfg.layers] == [HASH_MOE, HASH_MOE]  # 3 hash layers, capped at the depth
    assert cfg.weights.dense == "bf16" and cfg.weights.experts == "bf16"


def test_partial_rotary_factor_alone_sets_the_rope_dims():
    raw = mutate(BASE, {"qk_rope_head_dim": DROP, "partial_rotary_factor": 0.375})
    assert config_from_dict(raw).rope_dim == 24


def test_inference_config_without_yarn():
    raw = json.loads((REFERENCE / "v4-flash.inference_config.json").read_text())
    assert config_from_dict({**raw, "original_seq_len": 0}).compress_rope.yarn is None


# --------------------------------------------------------------------------- refusals

REFUSALS = {
    # V4.1 and DSpark variants
    "v41_ratio_in_compress_ratios": (mutate(BASE, {"compress_ratios": [0, 2, 128, 4, 0]}), "compress_ratios[1]",
                                     UnsupportedModelError),
    "v41_ratio_in_compress_rates": (mutate(HF_BASE, {"compress_rates.compressed_sparse_attention": 1}),
                                    "compress_rates['compressed_sparse_attention']", UnsupportedModelError),
    "v41_ratio_in_legacy_rate": (mutate(HF_BASE, {"compress_rate_hca": 2}), "compress_rate_hca",
                                 UnsupportedModelError),
    "dspark_field": (mutate(BASE, {"num_dspark_layers": 3}), "num_dspark_layers", UnsupportedModelError),
    "dspark_field_any_case": (mutate(BASE, {"DSpark_config": {}}), "DSpark_config", UnsupportedModelError),
    "unknown_key": (mutate(BASE, {"sparse_mode": "x"}), "sparse_mode", UnsupportedModelError),
    "model_type": (mutate(BASE, {"model_type": "deepseek_v3"}), "model_type", UnsupportedModelError),
    # layer lists
    "compress_ratios_length": (mutate(BASE, {"compress_ratios": [0, 4, 128]}), "compress_ratios", ConfigError),
    "compress_ratios_not_a_list": (mutate(BASE, {"compress_ratios": 4}), "compress_ratios", ConfigError),
    "compress_ratios_not_ints": (mutate(BASE, {"compress_ratios": ["0", 4, 128, 4]}), "compress_ratios", ConfigError),
    "ratio_not_a_rate": (mutate(BASE, {"compress_ratios": [0, 8, 128, 4, 0], "compress_rate_hca": 128}),
                         "compress_ratios[1]", UnsupportedModelError),
    "two_hca_ratios": (mutate(BASE, {"compress_ratios": [0, 8, 128, 4, 0]}), "compress_ratios[2] = 128",
                       UnsupportedModelError),
    "negative_ratio": (mutate(BASE, {"compress_ratios": [0, -4, 128, 4, 0]}), "compress_ratios[1]", ConfigError),
    "csa_and_hca_rates_equal": (mutate(BASE, {"compress_rate_csa": 128}), "compress_ratios", ConfigError),
    "no_schedule": (mutate(BASE, {"compress_ratios": DROP}), "compress_ratios", ConfigError),
    "layer_types_length": (mutate(HF_BASE, {"layer_types": HF_BASE["layer_types"][:3]}), "layer_types", ConfigError),
    "layer_types_not_a_list": (mutate(HF_BASE, {"layer_types": "sliding_attention"}), "layer_types", ConfigError),
    "layer_kind_unknown": (mutate(HF_BASE, {"layer_types": ["full_attention"] + HF_BASE["layer_types"][1:]}),
                           "layer_types[0]", UnsupportedModelError),
    "layer_kind_unhashable": (mutate(HF_BASE, {"layer_types": [["x"]] + HF_BASE["layer_types"][1:]}),
                              "layer_types[0]", UnsupportedModelError),
    "mlp_layer_types_length": (mutate(HF_BASE, {"mlp_layer_types": ["moe"] * 5}), "mlp_layer_types", ConfigError),
    "mlp_layer_types_not_a_list": (mutate(HF_BASE, {"mlp_layer_types": "moe"}), "mlp_layer_types", ConfigError),
    "mlp_kind_unknown": (mutate(HF_BASE, {"mlp_layer_types": ["moe", "dense", "moe", "moe"]}), "mlp_layer_types[1]",
                         UnsupportedModelError),
    "layer_types_vs_compress_ratios": (mutate(HF_BASE, {"compress_ratios": [0, 128, 128, 4]}),
                                       "layer_types[1]", ConfigError),
    "mlp_layer_types_vs_num_hash_layers": (mutate(HF_BASE, {"num_hash_layers": 2}), "num_hash_layers", ConfigError),
    "num_hash_layers_too_many": (mutate(BASE, {"num_hash_layers": 5}), "num_hash_layers", ConfigError),
    "num_hash_layers_negative": (mutate(BASE, {"num_hash_layers": -1}), "num_hash_layers", ConfigError),
    "num_hash_layers_bool": (mutate(BASE, {"num_hash_layers": True}), "num_hash_layers", ConfigError),
    "compress_rates_not_a_dict": (mutate(HF_BASE, {"compress_rates": [4, 128]}), "compress_rates", ConfigError),
    "compress_rates_unknown_kind": (mutate(HF_BASE, {"compress_rates.sliding_attention": 4}), "compress_rates",
                                    UnsupportedModelError),
    "compress_rate_zero": (mutate(HF_BASE, {"compress_rates.heavily_compressed_attention": 0}),
                           "compress_rates['heavily_compressed_attention']", ConfigError),
    "compress_rate_string": (mutate(BASE, {"compress_rate_csa": "4"}), "compress_rate_csa", ConfigError),
    "compress_rate_spellings_disagree": (mutate(HF_BASE, {"compress_rate_csa": 8}), "compress_rate_csa",
                                         ConfigError),
    # sizes
    "sizes_disagree": (mutate(BASE, {"dim": 128}), "dim=128", ConfigError),
    "layer_count_spellings_disagree": (mutate(BASE, {"n_layers": 3}), "n_layers", ConfigError),
    "size_via_alias": (mutate(BASE, {"hidden_size": DROP, "dim": 0}), "'dim'", ConfigError),
    "rope_dim_odd": (mutate(BASE, {"qk_rope_head_dim": 15}), "qk_rope_head_dim", ConfigError),
    "rope_dim_not_below_head_dim": (mutate(BASE, {"qk_rope_head_dim": 64}), "qk_rope_head_dim", ConfigError),
    "rope_dim_not_int": (mutate(BASE, {"qk_rope_head_dim": 16.0}), "qk_rope_head_dim", ConfigError),
    "rope_dim_above_index_head_dim": (mutate(BASE, {"index_head_dim": 8}), "index_head_dim", ConfigError),
    "partial_rotary_vs_qk_rope": (mutate(BASE, {"partial_rotary_factor": 0.5}), "partial_rotary_factor",
                                  ConfigError),
    "partial_rotary_nested_vs_qk_rope": (mutate(HF_BASE, {"rope_parameters.compress.partial_rotary_factor": 0.5}),
                                         "rope_parameters.compress.partial_rotary_factor", ConfigError),
    "partial_rotary_not_whole": (mutate(BASE, {"qk_rope_head_dim": DROP, "partial_rotary_factor": 0.3}),
                                 "partial_rotary_factor", ConfigError),
    "partial_rotary_not_a_number": (mutate(BASE, {"partial_rotary_factor": "0.25"}), "partial_rotary_factor",
                                    ConfigError),
    "o_groups_divisibility": (mutate(BASE, {"num_attention_heads": 3, "o_groups": 5}), "o_groups", ConfigError),
    "topk_above_experts": (mutate(BASE, {"num_experts_per_tok": 9}), "num_experts_per_tok", ConfigError),
    "fp4_hidden_not_div_32": (mutate(BASE, {"hidden_size": 80, "expert_dtype": "fp4"}), "hidden_size",
                              ConfigError),
    "fp4_inter_not_div_32": (mutate(BASE, {"moe_intermediate_size": 48, "expert_dtype": "fp4"}),
                             "moe_intermediate_size", ConfigError),
    "expert_dtype_unknown": (mutate(BASE, {"expert_dtype": "int4"}), "expert_dtype", UnsupportedModelError),
    "expert_dtype_spellings_disagree": (
        mutate(BASE, {"expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8", "expert_dtype": "fp8"}}),
        "quantization_config.expert_dtype", ConfigError),
    "eps_zero": (mutate(BASE, {"rms_norm_eps": 0}), "rms_norm_eps", ConfigError),
    "eps_via_alias": (mutate(BASE, {"norm_eps": -1e-6}), "norm_eps", ConfigError),
    "scaling_not_a_number": (mutate(BASE, {"routed_scaling_factor": "2.5"}), "routed_scaling_factor", ConfigError),
    "hc_eps_bool": (mutate(BASE, {"hc_eps": True}), "hc_eps", ConfigError),
    "max_positions_float": (mutate(BASE, {"max_position_embeddings": 65536.0}), "max_position_embeddings",
                            ConfigError),
    "not_an_object": ([BASE], "JSON object", ConfigError),
    # quantization
    "quant_method": (mutate(BASE, {"quantization_config": {"quant_method": "gptq"}}), "quantization_config",
                     UnsupportedModelError),
    "quant_fmt": (mutate(BASE, {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}),
                  "quantization_config", UnsupportedModelError),
    "quant_block": (mutate(BASE, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}),
                    "quantization_config.weight_block_size", UnsupportedModelError),
    "quant_block_not_a_list": (mutate(BASE, {"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}}),
                               "quantization_config.weight_block_size", UnsupportedModelError),
    "quant_not_an_object": (mutate(BASE, {"quantization_config": "fp8"}), "quantization_config", ConfigError),
    # rope
    "rope_type_linear": (mutate(BASE, {"rope_scaling.type": "linear"}), "rope_scaling", UnsupportedModelError),
    "rope_main_not_default": (mutate(HF_BASE, {"rope_parameters.main.rope_type": "yarn"}), "rope_parameters.main",
                              UnsupportedModelError),
    "rope_compress_dynamic": (mutate(HF_BASE, {"rope_parameters.compress.rope_type": "dynamic"}),
                              "rope_parameters.compress", UnsupportedModelError),
    "rope_flat_parameters_llama3": (mutate(BASE, {"rope_scaling": DROP, "rope_parameters": {"rope_type": "llama3"}}),
                                    "rope_parameters", UnsupportedModelError),
    "attention_factor": (mutate(HF_BASE, {"rope_parameters.compress.attention_factor": 1.2772}), "attention_factor",
                         UnsupportedModelError),
    "rope_scaling_not_an_object": (mutate(BASE, {"rope_scaling": "yarn"}), "rope_scaling", ConfigError),
    "yarn_factor_missing": (mutate(BASE, {"rope_scaling.factor": DROP}), "rope_scaling.factor", ConfigError),
    "yarn_factor_string": (mutate(HF_BASE, {"rope_parameters.compress.factor": "16"}),
                           "rope_parameters.compress.factor", ConfigError),
    "yarn_original_missing": (mutate(BASE, {"rope_scaling.original_max_position_embeddings": DROP}),
                              "rope_scaling.original_max_position_embeddings", ConfigError),
    "yarn_original_string": (mutate(BASE, {"rope_scaling.original_max_position_embeddings": "4k"}),
                             "rope_scaling.original_max_position_embeddings", ConfigError),
    "yarn_beta_string": (mutate(BASE, {"rope_scaling.beta_fast": "32"}), "rope_scaling.beta_fast", ConfigError),
    "rope_theta_zero": (mutate(BASE, {"rope_theta": 0}), "rope_theta", ConfigError),
    "rope_theta_nested_string": (mutate(HF_BASE, {"rope_parameters.main.rope_theta": "1e4"}),
                                 "rope_parameters.main.rope_theta", ConfigError),
    "inference_rope_factor_string": (mutate(BASE, {"rope_scaling": DROP, "rope_factor": "16",
                                                   "original_seq_len": 4096}), "rope_factor", ConfigError),
    # fixed V4 architecture choices
    "kv_heads": (mutate(BASE, {"num_key_value_heads": 2}), "num_key_value_heads", UnsupportedModelError),
    "tied_embeddings": (mutate(BASE, {"tie_word_embeddings": True}), "tie_word_embeddings", UnsupportedModelError),
    "scoring_func": (mutate(BASE, {"scoring_func": "softmax"}), "scoring_func", UnsupportedModelError),
    "shared_experts": (mutate(BASE, {"n_shared_experts": 2}), "n_shared_experts", UnsupportedModelError),
    "hidden_act": (mutate(BASE, {"hidden_act": "gelu"}), "hidden_act", UnsupportedModelError),
    "norm_topk_prob": (mutate(BASE, {"norm_topk_prob": False}), "norm_topk_prob", UnsupportedModelError),
    "attention_bias": (mutate(BASE, {"attention_bias": True}), "attention_bias", UnsupportedModelError),
    "two_mtp_layers": (mutate(BASE, {"num_nextn_predict_layers": 2}), "num_nextn_predict_layers",
                       UnsupportedModelError),
    "mtp_via_alias": (mutate(BASE, {"n_mtp_layers": 3}), "n_mtp_layers", UnsupportedModelError),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals(case):
    raw, field, error = REFUSALS[case]
    assert_refused(raw, field, error)


# transformers' names of the required fields, as the message must name them.
REQUIRED_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                   "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                   "index_n_heads", "index_head_dim", "index_topk", "sliding_window"]


@pytest.mark.parametrize("field", REQUIRED_FIELDS)
def test_missing_required_field(field):
    assert_refused(mutate(BASE, {field: DROP}), repr(field))


@pytest.mark.parametrize("field", REQUIRED_FIELDS + ["hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"])
@pytest.mark.parametrize("value", [0, -4, 8.5, "64", True])
def test_non_positive_or_non_integer_size(field, value):
    assert_refused(mutate(BASE, {field: value}), repr(field))


def test_null_counts_as_missing():
    assert_refused(mutate(BASE, {"hidden_size": None}), "'hidden_size'")


# --------------------------------------------------------------------------- load_config


def test_load_config_from_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert load_config(tmp_path) == config_from_dict(BASE, name=tmp_path.name)
    official = tmp_path / "official"
    (official / "inference").mkdir(parents=True)
    (official / "inference" / "config.json").write_text((REFERENCE / "v4-flash.inference_config.json").read_text())
    assert unnamed(load_config(official)) == unnamed(preset("flash"))


def _assert_load_refused(path, *named) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message, message
    for part in named:
        assert part in message, message


def test_load_config_missing_file(tmp_path):
    _assert_load_refused(tmp_path / "nope.json", str(tmp_path / "nope.json"), "not found")


def test_load_config_directory_without_config(tmp_path):
    _assert_load_refused(tmp_path, str(tmp_path), "config.json")


def test_load_config_invalid_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"vocab_size": 12,\n "oops"\n')
    _assert_load_refused(path, str(path), "JSON")


def test_load_config_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe{}")
    _assert_load_refused(path, str(path))


def test_load_config_json_array(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    _assert_load_refused(path, str(path), "JSON object")


def test_load_config_names_file_and_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(mutate(BASE, {"tie_word_embeddings": True})))
    with pytest.raises(UnsupportedModelError) as info:  # the subclass survives the path prefix
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and "tie_word_embeddings" in str(info.value)

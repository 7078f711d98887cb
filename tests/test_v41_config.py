"""DeepSeek-V4.1 configs and checkpoints: both config spellings, the layer roles from the schedule
ids (with the reference config's defaults and the schedules it leaves undefined refused), the
checkpoint under official and transformers names (FP8 32 x 32, FP4 experts, FP8 Engram rows),
the presets, `inspect` beside V4-Flash, make-tiny with a tokenizer that the reference and llvm
targets compile, and an fp8 KV cache refused in one line (V4.1's pool keeps its own round-tripped
rows).

The small config is the one transformers' reference saved for tests/data/v41_engram."""

import json
from pathlib import Path

import numpy as np
import pytest

from dsv4c.artifact.model_config import ROUTED_MOE, Candidates, ModelConfig
from dsv4c.artifact.safetensors_io import write_safetensors
from dsv4c.cli import main as cli
from dsv4c.errors import ConfigError, UnsupportedModelError
from dsv4c.frontend.checkpoint import load_weights
from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.config import config_from_dict, load_config, preset, with_weights
from dsv4c.frontend.random_model import random_weights
from dsv4c.frontend.tensor_inventory import inventory

FLAT = json.loads((Path(__file__).parent / "data" / "v41_engram" / "config.json").read_text())


def official(flat: dict, **top) -> dict:
    """The release's nesting of a flat text config."""
    text = {**flat, "model_type": "deepseek_v41_text"}
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
            "vision_config": {"hidden_size": 32, "num_hidden_layers": 2}, "image_token_id": 7, **top}


def flat(**changes) -> dict:
    out = dict(FLAT)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def roles(cfg: ModelConfig) -> list[tuple]:
    return [(l.compress_ratio, l.kv_source, l.topk_source, l.candidates is not None, l.engram) for l in cfg.layers]


def test_the_saved_flat_config_reads_as_v41():
    cfg = config_from_dict(FLAT)
    assert cfg.family == "v4.1" and cfg.rms_norm_eps == 1e-20 and cfg.gate_temp == 1.0
    assert (cfg.q_head_norm, cfg.delayed_mhc, cfg.activation_fake_quant) == (False, True, True)
    assert cfg.mtp_layers == () and cfg.dspark is None  # its DSpark fields and ratio tail are the drafter's
    assert all(l.moe == ROUTED_MOE for l in cfg.layers)
    assert roles(cfg) == [(0, None, None, False, True), (2, 1, 1, False, False), (2, 1, 1, False, False),
                          (2, 1, 3, False, False), (1, 4, 4, True, False), (1, 4, 4, False, True),
                          (1, 4, 6, True, False), (0, None, None, False, False)]
    assert cfg.layers[4].is_candidate_source and cfg.layers[6].candidates == Candidates(4, 4, 2)
    assert [l.indexer_role for l in cfg.layers[1:7]] == ["own_keys", "reuse_topk", "rescore", "own_keys",
                                                         "reuse_topk", "rescore"]
    e = cfg.engram
    assert (e.layer_ids, e.vocab_size, e.num_embeddings, e.max_ngram_size, e.n_heads, e.head_dim, e.pad_id,
            e.compressed_vocab_size, e.columns) == ((0, 5), 40, (304, 462), 4, 2, 32, 2, 254, 6)
    compress = cfg.compress_rope
    assert (cfg.main_rope.theta, compress.theta, compress.yarn.factor) == (10000.0, 160000.0, 16.0)


def test_the_official_nesting_reads_the_same_with_its_weight_formats():
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
             "weight_block_size": [32, 32]}
    cfg = config_from_dict(official(flat(dtype=None), quantization_config=quant))
    assert cfg.weights == with_weights(cfg, dense="fp8", experts="fp4", scale="e8m0", fp8_block=32).weights
    assert cfg.layers == config_from_dict(FLAT).layers
    with pytest.raises(UnsupportedModelError, match="'processor_class'"):
        config_from_dict(official(FLAT, processor_class="x"))


@pytest.mark.parametrize("spelling", ["official", "hf"])
def test_both_written_spellings_read_back(spelling):
    cfg = config_from_dict(FLAT, name="case")
    assert config_from_dict(json.loads(json.dumps(cfg.to_json_dict(spelling))), name="case") == cfg
    assert ModelConfig.from_json_dict(cfg.to_json_dict("hf"), "case") == cfg


def test_the_schedule_ids_default_as_the_reference_config_does():
    cfg = config_from_dict(flat(kv_source_layer_ids=None, index_source_layer_ids=None, candidate_source_layer_id=None,
                                layer_types=None))
    # KV sources: the first layer of each run of equal ratios; index sources: the KV sources;
    # candidates: the last KV source.
    assert [l.index for l in cfg.layers if l.is_kv_source] == [1, 4]
    assert [l.index for l in cfg.layers if l.is_compressed and l.has_indexer] == [1, 4]
    assert [l.index for l in cfg.layers if l.is_candidate_source] == [4]
    no_level = config_from_dict(flat(candidate_source_layer_id=-1))
    assert not any(l.candidates for l in no_level.layers)


UNDEFINED = {
    "kv_source_not_index_source": (dict(index_source_layer_ids=[1, 3, 6], candidate_source_layer_id=1),
                                   UnsupportedModelError, "KV source layer 4 is not an index source"),
    "kv_source_after_candidates": (dict(candidate_source_layer_id=1), UnsupportedModelError,
                                   "KV source layer 4 comes after the candidate source 1"),
    "mixed_ratios_in_a_group": (dict(compress_ratios=[0, 2, 2, 2, 1, 2, 1, 0]), ConfigError,
                                "layer 5: compress ratio 2 differs from its KV source 4's 1"),
    "candidate_not_index_source": (dict(candidate_source_layer_id=5), ConfigError,
                                   "candidate_source_layer_id = 5 is not an index source"),
    "layer_types_disagree": (dict(layer_types=["sliding_attention"] * 8), ConfigError, "'layer_types' disagrees"),
    "compressed_before_any_source": (dict(kv_source_layer_ids=[4], layer_types=None), ConfigError,
                                     r"compress_ratios\[1\] = 2: .* no kv_source_layer_ids"),
    "hash_routing": (dict(scoring_func="softmax"), UnsupportedModelError, "scoring_func"),
}


@pytest.mark.parametrize("name", UNDEFINED)
def test_schedules_the_reference_leaves_undefined_are_refused(name):
    changes, error, message = UNDEFINED[name]
    with pytest.raises(error, match=message):
        config_from_dict(flat(**changes))


def test_the_presets():
    flash = preset("v41-flash")
    assert flash.family == "v4.1" and flash.num_layers == 40 and flash.weights.fp8_block == 32
    assert flash.weights.experts == "fp4" and flash.engram.num_embeddings == (384006168, 384016682)
    assert [l.index for l in flash.layers if l.is_kv_source] == [2, 8, 14, 20]
    assert [l.index for l in flash.layers if l.indexer_role == "rescore"] == [24, 28, 32, 36]
    names = {s.name for s in inventory(flash)}
    assert "hc_head_fn" not in names and "layers.2.attn.compressor.wgate.weight" in names
    assert "layers.20.attn.compressor.wgate.weight" not in names  # ratio 1 pools nothing
    assert "layers.24.attn.indexer.wq_b.weight" in names and "layers.24.attn.indexer.wk.weight" not in names
    assert not any(".ape" in n or "tid2eid" in n or "indexer.compressor" in n for n in names)
    assert {"layers.14.engram.embed.weight", "layers.14.engram.wkv.weight"} <= names
    assert preset("v41-tiny").engram.compressed_vocab_size == 230  # the byte-level tokenizer's


def test_inspect_prices_v41_flash_beside_v4_flash(capsys):
    assert cli(["inspect", "v41-flash", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # Four groups held once: three of ratio 2 and one of ratio 1, 2.5 rows a token, against V4-Flash's.
    assert report["rows_per_envelope"] == 640 and report["bytes_per_token"] < report["flash_bytes_per_token"]
    # The two tables apart from the weights: 768,022,850 rows of 256 FP8 values and 8 scales.
    assert report["engram_bytes"] == int((384006168 + 384016682) * 256 * (1 + 1 / 32))
    assert cli(["inspect", "v41-flash"]) == 0
    assert "V4-Flash beside it" in capsys.readouterr().out
    assert cli(["inspect", "v41-flash", "--cost", "--json"]) == 0
    engram = json.loads(capsys.readouterr().out)["cost_by_family"]["engram"]
    # Two Engram layers, 24 table rows of 256 FP8 values each per token, beside their projections.
    assert engram["flops"] > 0 and engram["bytes_read"] > 2 * 24 * 256


def _transformers_name(name: str) -> str:
    return {"embed.weight": "model.embed.weight", "head.weight": "lm_head.weight"}.get(name, "model." + name)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """v41-tiny stored as the release stores V4.1: FP8 32 x 32 dense weights and Engram rows, FP4 experts."""
    cfg = with_weights(preset("v41-tiny"), dense="fp8", experts="fp4", fp8_block=32)
    weights = random_weights(cfg, seed=1)
    out = write_checkpoint(cfg, weights, tmp_path_factory.mktemp("v41") / "fp8")
    return cfg, weights, out


def test_an_official_fp8_checkpoint_loads_and_skips_the_drafter_and_vision_saying_so(fp8_model, capsys):
    cfg, weights, out = fp8_model
    extra = {name: ("F32", np.zeros((2, 2), np.float32))
             for name in ("mtp.0.attn.wq_a.weight", "vision.blocks.0.w", "aligner.proj.weight", "image_newline")}
    write_safetensors(out / "extra.safetensors", extra)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "extra.safetensors" for name in extra})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    got = load_weights(load_config(out), out)
    assert capsys.readouterr().err.count("ignoring 4 checkpoint tensors") == 1
    table = got["layers.5.engram.embed.weight"]
    truth = weights["layers.5.engram.embed.weight"]
    assert np.abs(table - truth).max() <= np.abs(truth).max() * 2.0**-3  # e4m3 rows, a scale per 32 columns
    assert got["layers.1.ffn.experts.w1"].shape == (8, 32, 64)


def test_transformers_names_load_as_the_official_ones(fp8_model, tmp_path):
    cfg = preset("v41-tiny")
    weights = random_weights(cfg, seed=2)
    write_safetensors(tmp_path / "model.safetensors",
                      {_transformers_name(n): ("F32", w) for n, w in weights.items()})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_json_dict("hf")))
    got = load_weights(load_config(tmp_path), tmp_path)
    assert np.array_equal(got["head.weight"], weights["head.weight"])
    assert np.array_equal(got["layers.4.attn.indexer.wk.weight"], weights["layers.4.attn.indexer.wk.weight"])


def test_make_tiny_writes_a_tokenizer_that_the_targets_compile_and_an_fp8_pool_is_refused(tmp_path, capsys):
    assert cli(["make-tiny", "--config", "v41-tiny", "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert cli(["compile", "--model", str(tmp_path / "m"), "--target", "llvm", "--kv-cache-dtype", "fp8",
                "-o", str(tmp_path / "a")]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "DeepSeek-V4.1" in err and "fp8" in err
    for target in ("reference", "llvm"):
        assert cli(["compile", "--model", str(tmp_path / "m"), "--target", target, "-o", str(tmp_path / target)]) == 0
        assert (tmp_path / target / "engram_hash.safetensors").is_file()

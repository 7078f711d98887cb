"""The DSpark drafter, model side: its config fields (every spelling, every refusal), its
checkpoint (official names, stage count from the tensors, V4.1's Markov spelling,
``--draft-model``), ``make-tiny``, and the traced functions against an independent numpy
implementation written from docs/v4.md ("Forward pass", "DSpark"), in float64, that calls
nothing of dsv4c's reference ops."""

import json
from dataclasses import replace
from importlib import resources

import numpy as np
import pytest

from dsv4c.artifact.model_config import Dspark, ModelConfig
from dsv4c.errors import CheckpointError, ConfigError, UnsupportedModelError
from dsv4c.frontend.checkpoint import Checkpoint, ir_sources, load_weights, official_name
from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.config import config_from_dict, load_config, preset, with_weights
from dsv4c.frontend.draft_model import resolve_drafter
from dsv4c.frontend.random_model import random_weights
from dsv4c.frontend.tensor_inventory import inventory
from dsv4c.frontend.trace import trace
from dsv4c.ir.cost import Decode, function_cost, node_families
from dsv4c.ir.interpreter import Interpreter
from dsv4c.passes.merge_projections import materialize_weights
from dsv4c.passes.pipeline import run_pipeline

from dense_cache import DenseCache

TINY = json.loads(resources.files("dsv4c.frontend").joinpath("presets/tiny.json").read_text())


def dspark_raw(stages=3, block=5, targets=(1, 2, 3), hc_mult=4, **extra) -> dict:
    """The tiny preset (4 layers, window 8) with a DSpark drafter, transformers spelling."""
    return {**TINY, "hc_mult": hc_mult, "num_nextn_predict_layers": stages, "dspark_block_size": block,
            "dspark_target_layer_ids": list(targets), "dspark_markov_rank": 16, "dspark_noise_token_id": 500,
            **extra}


# --------------------------------------------------------------------------- config


def test_the_official_fields_make_a_drafter_of_sliding_routed_stages():
    cfg = config_from_dict(dspark_raw())
    assert cfg.dspark == Dspark(5, (1, 2, 3), 16, 500, 8, 2, True)
    assert [(l.index, l.attention, l.compress_ratio, l.moe) for l in cfg.mtp_layers] == [
        (4, "sliding", 0, "routed"), (5, "sliding", 0, "routed"), (6, "sliding", 0, "routed")]


def test_the_inference_spelling_and_the_stage_expert_overrides():
    raw = {k: v for k, v in dspark_raw(dspark_n_routed_experts=4, dspark_n_activated_experts=1).items()
           if k != "num_nextn_predict_layers"}
    cfg = config_from_dict({**raw, "n_mtp_layers": 2})
    assert (len(cfg.mtp_layers), cfg.dspark.n_routed_experts, cfg.dspark.n_experts_per_tok) == (2, 4, 1)
    assert cfg.moe_experts(cfg.mtp_layers[0]) == (4, 1) and cfg.moe_experts(cfg.layers[3]) == (8, 2)
    hf = config_from_dict(dspark_raw(dspark_n_routed_experts=4, dspark_num_experts_per_tok=1))
    assert hf.dspark == cfg.dspark


def test_official_compress_ratios_may_list_the_stages_as_zeros():
    cfg = preset("flash-0731")
    assert (cfg.num_layers, len(cfg.mtp_layers), cfg.dspark.target_layers) == (43, 3, (40, 41, 42))
    # The released hub config counts one stage while listing three zeros: no warning, the tensors decide.
    raw = json.loads(resources.files("dsv4c.frontend").joinpath("presets/flash-0731.json").read_text())
    assert len(config_from_dict({**raw, "num_nextn_predict_layers": 1}).mtp_layers) == 1


@pytest.mark.parametrize("spelling", ["hf", "official"])
@pytest.mark.parametrize("name", ["flash-0731", "pro-0813"])
def test_presets_round_trip_through_both_spellings_and_the_manifest(name, spelling):
    cfg = preset(name)
    assert config_from_dict(cfg.to_json_dict(spelling), name=name) == cfg
    assert ModelConfig.from_json_dict(cfg.to_json_dict("hf"), name=name) == cfg


def test_without_a_block_size_the_fields_are_inert_and_mtp_is_v4s():
    cfg = config_from_dict(dspark_raw(stages=1, block=0))
    assert cfg.dspark is None and len(cfg.mtp_layers) == 1
    assert "dspark_block_size" not in cfg.to_json_dict()


@pytest.mark.parametrize("change, error, words", [
    ({"dspark_target_layer_ids": [2, 1]}, ConfigError, "strictly increasing"),
    ({"dspark_target_layer_ids": [1, 4]}, ConfigError, "dspark_target_layer_ids[1]"),
    ({"dspark_target_layer_ids": 3}, ConfigError, "list of layer indices"),
    ({"dspark_noise_token_id": 512}, ConfigError, "dspark_noise_token_id"),
    ({"dspark_noise_token_id": None}, ConfigError, "dspark_noise_token_id' is missing"),
    ({"dspark_markov_rank": 0}, ConfigError, "dspark_markov_rank"),
    ({"dspark_block_size": -1}, ConfigError, "dspark_block_size"),
    ({"dspark_block_size": 2.5}, ConfigError, "dspark_block_size"),
    ({"dspark_num_experts_per_tok": 1, "dspark_n_activated_experts": 2}, ConfigError, "disagree"),
    ({"dspark_n_routed_experts": 2, "dspark_num_experts_per_tok": 3}, ConfigError, "3 of 2 experts"),
    ({"dspark_confidence_head": "yes"}, ConfigError, "dspark_confidence_head"),
    ({"num_nextn_predict_layers": 0}, ConfigError, "at least one stage"),
    ({"dspark_draft_layers": 3}, UnsupportedModelError, "dspark_draft_layers"),
])
def test_bad_dspark_fields_are_one_line_errors(change, error, words):
    raw = {k: v for k, v in {**dspark_raw(), **change}.items() if v is not None}
    with pytest.raises(error) as e:
        config_from_dict(raw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_compressed_stage_in_compress_ratios_is_refused():
    raw = json.loads(resources.files("dsv4c.frontend").joinpath("presets/flash-0731.json").read_text())
    with pytest.raises(ConfigError, match=r"compress_ratios\[44\] = 4"):
        config_from_dict({**raw, "compress_ratios": raw["compress_ratios"][:44] + [4, 0]})


# --------------------------------------------------------------------------- checkpoint


def write_model(root, raw: dict, seed: int = 0) -> ModelConfig:
    """An fp32 random checkpoint of ``raw`` under ``root``."""
    cfg = with_weights(config_from_dict(raw), dense="fp32", experts="fp32")
    write_checkpoint(cfg, random_weights(cfg, seed), root)
    return cfg


def test_make_tiny_writes_the_drafter_under_official_names(tmp_path):
    from dsv4c.cli import main as cli

    (tmp_path / "config.json").write_text(json.dumps(dspark_raw()))
    assert cli(["make-tiny", "--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "m")]) == 0
    cfg = load_config(tmp_path / "m")
    assert cfg.dspark == config_from_dict(dspark_raw()).dspark
    with Checkpoint(tmp_path / "m") as ckpt:
        names = set(ckpt.names())
    assert {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.2.hc_head_fn",
            "mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight",
            "mtp.2.confidence_head.proj.weight", "mtp.1.attn.wkv.weight", "mtp.1.ffn.experts.7.w2.weight"} <= names
    assert not [n for n in names if n.startswith("mtp.") and any(
        part in n for part in ("e_proj", "h_proj", "enorm", "hnorm", "compressor", "indexer", "tid2eid"))]
    assert "mtp.0.markov_head.markov_w1.weight" not in names and "mtp.1.main_proj.weight" not in names
    weights = load_weights(cfg, tmp_path / "m")  # every tensor accounted for, none extra
    assert weights["mtp.0.main_proj.weight"].shape == (64, 3 * 64)
    assert weights["mtp.2.confidence_head.proj.weight"].shape == (1, 64 + 16)


def test_the_stage_count_comes_from_the_tensors(tmp_path, capsys):
    cfg = write_model(tmp_path / "m", dspark_raw())
    said_one = replace(cfg, mtp_layers=cfg.mtp_layers[:1])  # 0731's config: one stage, three shipped
    assert resolve_drafter(said_one, tmp_path / "m", None) == cfg
    assert capsys.readouterr().err.count("warning") == 1
    assert resolve_drafter(cfg, tmp_path / "m", None) == cfg and capsys.readouterr().err == ""


def test_a_target_without_drafter_tensors_compiles_without_a_drafter(tmp_path, capsys):
    v4 = write_model(tmp_path / "v4", {**TINY, "num_nextn_predict_layers": 0})
    cfg = resolve_drafter(replace(v4, dspark=config_from_dict(dspark_raw()).dspark), tmp_path / "v4", None)
    assert cfg.dspark is None and cfg.mtp_layers == ()
    assert "--draft-model" in capsys.readouterr().err


def test_a_biased_confidence_head_is_refused(tmp_path):
    from dsv4c.artifact.safetensors_io import write_safetensors

    write_model(tmp_path / "m", dspark_raw(stages=1, block=2, targets=(3,)))
    write_safetensors(tmp_path / "m" / "bias.safetensors",
                      {"mtp.0.confidence_head.proj.bias": ("F32", np.zeros(1, np.float32))})
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.0.confidence_head.proj.bias"] = "bias.safetensors"
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedModelError, match="confidence_head.proj.bias"):
        resolve_drafter(load_config(tmp_path / "m"), tmp_path / "m", None)


def test_the_v41_markov_spelling_reads_as_0731s():
    assert official_name("mtp.2.markov_head.embed.weight") == "mtp.2.markov_head.markov_w1.weight"
    assert official_name("mtp.2.markov_head.head.weight") == "mtp.2.markov_head.markov_w2.weight"
    assert official_name("head.weight") == "head.weight"


def test_a_drafter_without_confidence_head_loads_and_says_so(tmp_path):
    cfg = config_from_dict(dspark_raw(dspark_confidence_head=False))
    assert not any("confidence" in s.name for s in inventory(cfg))
    cfg = write_model(tmp_path / "m", dspark_raw(dspark_confidence_head=False))
    assert resolve_drafter(replace(cfg, dspark=replace(cfg.dspark, confidence_head=True)), tmp_path / "m",
                           None) == cfg
    assert trace(cfg).functions["dspark_markov"].outputs[1].type.shape == ("T", 16)


def test_draft_model_takes_the_drafter_from_another_checkpoint(tmp_path):
    write_model(tmp_path / "target", {**TINY, "num_nextn_predict_layers": 1}, seed=1)  # V4 with its MTP layer
    draft = write_model(tmp_path / "draft", dspark_raw(stages=2, targets=(2, 3)), seed=2)
    target = with_weights(load_config(tmp_path / "target"), dense="fp32", experts="fp32")
    cfg = resolve_drafter(target, None, tmp_path / "draft")
    assert cfg.dspark == draft.dspark and len(cfg.mtp_layers) == 2 and cfg.layers == target.layers
    with Checkpoint(tmp_path / "target", drafter=tmp_path / "draft") as ckpt:
        assert "mtp.0.e_proj.weight" not in ckpt  # the target's MTP layer is not the drafter's
        got = {name: src.read_all() for name, src in ir_sources(cfg, ckpt).items()}
    mine, theirs = load_weights(target, tmp_path / "target"), load_weights(draft, tmp_path / "draft")
    np.testing.assert_array_equal(got["layers.1.attn.wkv.weight"], mine["layers.1.attn.wkv.weight"])
    np.testing.assert_array_equal(got["mtp.1.ffn.experts.w1"], theirs["mtp.1.ffn.experts.w1"])
    np.testing.assert_array_equal(got["mtp.0.main_proj.weight"], theirs["mtp.0.main_proj.weight"])


def test_draft_model_must_fit_the_target(tmp_path):
    write_model(tmp_path / "wide", dspark_raw(**{"hidden_size": 96}))
    write_model(tmp_path / "plain", {**TINY, "num_nextn_predict_layers": 0})
    target = preset("tiny")
    with pytest.raises(ConfigError, match="hidden_size is 96, the target's is 64"):
        resolve_drafter(target, None, tmp_path / "wide")
    with pytest.raises(ConfigError, match="needs a config with the DSpark fields"):
        resolve_drafter(target, None, tmp_path / "plain")
    deep = write_model(tmp_path / "deep", {**dspark_raw(targets=(3, 5)), "num_hidden_layers": 6,
                                           "layer_types": TINY["layer_types"] + ["sliding_attention"] * 2,
                                           "mlp_layer_types": TINY["mlp_layer_types"] + ["moe"] * 2})
    assert deep.num_layers == 6
    with pytest.raises(ConfigError, match="layer 5; the target has 4 layers"):
        resolve_drafter(target, None, tmp_path / "deep")


def test_compile_draft_model_records_the_drafter_in_the_manifest(tmp_path):
    from dsv4c.cli import main as cli

    write_model(tmp_path / "target", {**TINY, "num_nextn_predict_layers": 0})
    write_model(tmp_path / "draft", dspark_raw(stages=1, block=2, targets=(3,)))
    assert cli(["compile", "--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"),
                "--target", "reference", "-o", str(tmp_path / "art")]) == 0
    model = json.loads((tmp_path / "art" / "manifest.json").read_text())["model"]
    assert (model["dspark_block_size"], model["dspark_target_layer_ids"], model["num_nextn_predict_layers"]) == (
        2, [3], 1)
    assert model["dspark_confidence_head"] is True


# --------------------------------------------------------------------------- IR, passes, cost


def test_the_passes_verify_the_drafter_and_tensor_parallel_leaves_it_out(capsys):
    cfg = config_from_dict(dspark_raw())
    for numerics in ("exact", "qat"):
        program = run_pipeline(trace(cfg, numerics))
        assert list(program.functions) == ["step", "dspark_draft", "dspark_markov"]
        draft = program.functions["dspark_draft"]
        assert not any(n.op == "kv_write" for n in draft.nodes)
        assert {n.attrs["kind"] for n in draft.nodes if n.op == "sparse_attn"} == {"block"}
        writes = [n.attrs["layer"] for n in program.functions["step"].nodes if n.op == "kv_write"]
        assert writes[-3:] == [4, 5, 6]
        for fn in program.functions.values():  # the cost model and the profiler's families know every op
            assert function_cost(fn, Decode(2, 100, 580, 132))
            for node in fn.nodes:
                assert node_families(node)
        markov = program.functions["dspark_markov"].nodes
        assert [node_families(n) for n in markov if n.op in ("embed", "lm_head")] == [{"head": 1.0}] * 2
    program = trace(with_weights(cfg, dense="bf16", experts="bf16"), tensor_parallel=2)
    assert list(program.functions) == ["step"]
    assert not any(n.op == "hc_mean" for n in program.functions["step"].nodes)
    assert capsys.readouterr().err.count("warning") == 1


# --------------------------------------------------------------------------- the math, independently


def _rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _rope(x, pos, theta, dims, inverse=False):
    """GPT-J rotation of the pairs (2i, 2i+1) of the trailing ``dims`` channels at ``pos``."""
    freq = theta ** (-np.arange(0, dims, 2) / dims)
    ang = pos[:, None] * freq[None, :] * (-1 if inverse else 1)
    ang = ang.reshape((len(pos),) + (1,) * (x.ndim - 2) + (dims // 2,))
    out = x.copy()
    a, b = x[..., -dims::2], x[..., -dims + 1::2]
    out[..., -dims::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., -dims + 1::2] = b * np.cos(ang) + a * np.sin(ang)
    return out


class NumpyDspark:
    """The drafter of docs/v4.md ("DSpark") in float64, from the weights by name."""

    def __init__(self, cfg: ModelConfig, weights: dict):
        self.c, self.w = cfg, {k: np.asarray(v, np.float64) for k, v in weights.items()}
        self.theta = cfg.main_rope.theta

    def context_rows(self, streams: dict[int, np.ndarray], pos: np.ndarray) -> list[np.ndarray]:
        """Each stage's ring rows of the positions ``pos`` from the streams entering the target layers."""
        taps = np.concatenate([streams[l].mean(axis=1) for l in self.c.dspark.target_layers], axis=1)
        x = _rms(taps @ self.w["mtp.0.main_proj.weight"].T, self.w["mtp.0.main_norm.weight"])
        return [self._kv(x, f"mtp.{s}.attn.", pos) for s in range(len(self.c.mtp_layers))]

    def _kv(self, x, p, pos):
        return _rope(_rms(x @ self.w[p + "wkv.weight"].T, self.w[p + "kv_norm.weight"]), pos, self.theta,
                     self.c.rope_dim)

    def _mix(self, h, p, which):
        c = self.c
        n = c.hc_mult
        mix = _rms(h.reshape(len(h), -1)) @ self.w[f"{p}hc_{which}_fn"].T
        base, scale = self.w[f"{p}hc_{which}_base"], self.w[f"{p}hc_{which}_scale"]
        pre = _sigmoid(mix[:, :n] * scale[0] + base[:n]) + c.hc_eps
        post = 2 * _sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        logits = mix[:, 2 * n:].reshape(-1, n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = np.exp(logits - logits.max(-1, keepdims=True))
        comb = comb / comb.sum(-1, keepdims=True) + c.hc_eps
        comb = comb / (comb.sum(-2, keepdims=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + c.hc_eps)
            comb = comb / (comb.sum(-2, keepdims=True) + c.hc_eps)
        return (pre[:, :, None] * h).sum(1), post, comb

    def _seam(self, h, p, which, f):
        y, post, comb = self._mix(h, p, which)
        out = f(_rms(y, self.w[f"{p}{which}_norm.weight"]))
        return post[:, :, None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", comb, h)

    def _attention(self, x, p, pos, ring):
        c, w = self.c, self.w
        q = _rms(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"]) @ w[p + "wq_b.weight"].T
        q = _rope(_rms(q.reshape(len(x), c.num_heads, c.head_dim)), pos, self.theta, c.rope_dim)
        keys = np.concatenate([ring, self._kv(x, p, pos)])  # the window before the block, then the block
        s = np.einsum("thd,kd->thk", q, keys) / np.sqrt(c.head_dim)
        sink = w[p + "attn_sink"][None, :, None]
        m = np.maximum(s.max(-1, keepdims=True), sink)
        probs = np.exp(s - m) / (np.exp(s - m).sum(-1, keepdims=True) + np.exp(sink - m))
        o = _rope(probs @ keys, pos, self.theta, c.rope_dim, inverse=True).reshape(len(x), c.o_groups, -1)
        wo_a = w[p + "wo_a.weight"].reshape(c.o_groups, c.o_lora_rank, -1)
        return np.einsum("tgi,gri->tgr", o, wo_a).reshape(len(x), -1) @ w[p + "wo_b.weight"].T

    def _moe(self, x, p):
        c, w = self.c, self.w
        k = c.dspark.n_experts_per_tok
        scores = np.sqrt(np.log1p(np.exp(x @ w[p + "gate.weight"].T)))
        ids = np.argsort(-(scores + w[p + "gate.bias"]), axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(scores, ids, -1)
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * c.routed_scaling_factor

        def swiglu(v, w1, w2, w3):
            g, u = np.minimum(v @ w1.T, c.swiglu_limit), np.clip(v @ w3.T, -c.swiglu_limit, c.swiglu_limit)
            return (g * _sigmoid(g) * u) @ w2.T

        out = swiglu(x, *(w[f"{p}shared_experts.w{i}.weight"] for i in (1, 2, 3)))
        for t in range(len(x)):
            for e, g in zip(ids[t], weights[t]):
                out[t] += g * swiglu(x[t], *(w[f"{p}experts.w{i}"][e] for i in (1, 2, 3)))
        return out

    def draft(self, tokens, pos, ring_of):
        """(base logits, head hidden y) of one request's block; ``ring_of(s)``: stage s's keys before it."""
        c, w = self.c, self.w
        h = np.repeat(w["embed.weight"][tokens][:, None, :], c.hc_mult, axis=1)
        for s in range(len(c.mtp_layers)):
            p = f"mtp.{s}."
            h = self._seam(h, p, "attn", lambda x: self._attention(x, p + "attn.", pos, ring_of(s)))
            h = self._seam(h, p, "ffn", lambda x: self._moe(x, p + "ffn."))
        last = f"mtp.{len(c.mtp_layers) - 1}."
        mix = _rms(h.reshape(len(h), -1)) @ w[last + "hc_head_fn"].T
        pre = _sigmoid(mix * w[last + "hc_head_scale"][0] + w[last + "hc_head_base"]) + c.hc_eps
        y = (pre[:, :, None] * h).sum(1)
        return _rms(y, w[last + "norm.weight"]) @ w["head.weight"].T, y

    def markov(self, prev: int, y_row):
        last = f"mtp.{len(self.c.mtp_layers) - 1}."
        e = self.w[last + "markov_head.markov_w1.weight"][prev]
        conf = self.w[last + "confidence_head.proj.weight"] @ np.concatenate([y_row, e])
        return self.w[last + "markov_head.markov_w2.weight"] @ e, conf[0]


def assert_close(got, want, what):
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err <= 1e-5 * max(1.0, np.abs(want).max()), f"{what}: off by {err}"


CASES = {  # hc_mult, block size, stages, target layers, stage experts override
    "hc4-b5-s3": (4, 5, 3, (1, 2, 3), {}),
    "hc2-b2-s1": (2, 2, 1, (3,), {}),
    "hc2-b5-s3": (2, 5, 3, (0, 2), {"dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 1}),
    "hc4-b2-s1": (4, 2, 1, (1, 3), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_drafter_matches_an_independent_numpy_implementation(case, tmp_path):
    hc, block, stages, targets, extra = CASES[case]
    cfg = write_model(tmp_path / "m", dspark_raw(stages, block, targets, hc, **extra), seed=3)
    program = run_pipeline(trace(cfg))
    weights = materialize_weights(program, load_weights(cfg, tmp_path / "m"))
    ref = NumpyDspark(cfg, load_weights(cfg, tmp_path / "m"))
    n, window = cfg.num_layers, cfg.sliding_window
    streams: dict[int, dict[int, list]] = {0: {}, 1: {}}  # request -> target layer -> streams entering it
    entering = {("h0" if l == 0 else f"l{l - 1}.h"): l for l in targets}  # the trace's names of those streams
    step_seqs = []

    def tap(node, args, result):
        layer = entering.get(node.outputs[0].name)
        if layer is not None:
            h = result[0] if len(node.outputs) > 1 else result
            for seq in (0, 1):
                streams[seq].setdefault(layer, []).append(h[step_seqs[-1] == seq].astype(np.float64))

    cache = DenseCache(cfg)
    interp = Interpreter(program, weights, cache, hook=tap)
    rng = np.random.default_rng(5)
    prompts = {0: rng.integers(2, 500, 11), 1: rng.integers(2, 500, 5)}
    # Step 1: both requests (ragged), step 2: the rest of request 0 (11 > the window of 8).
    for feed in ({0: (0, 6), 1: (0, 5)}, {0: (6, 11)}):
        tokens = np.concatenate([prompts[s][a:b] for s, (a, b) in feed.items()])
        pos = np.concatenate([np.arange(a, b) for a, b in feed.values()])
        step_seqs.append(np.concatenate([np.full(b - a, s) for s, (a, b) in feed.items()]))
        interp.run("step", tokens=tokens, positions=pos, seq_ids=step_seqs[-1])

    rings = {}
    for seq, prompt in prompts.items():
        entering = {l: np.concatenate(parts) for l, parts in streams[seq].items()}
        rings[seq] = ref.context_rows(entering, np.arange(len(prompt)))
        for s, rows in enumerate(rings[seq]):  # the ring rows the step wrote, every position
            assert_close(cache.window_rows(n + s, seq, 0, len(prompt)), rows, f"stage {s} ring of request {seq}")

    anchors = {0: 7, 1: 9}
    tokens = np.concatenate([[anchors[s]] + [500] * (block - 1) for s in prompts])
    pos = np.concatenate([np.arange(len(p), len(p) + block) for p in prompts.values()])
    seqs = np.repeat([0, 1], block)
    before = [cache.window_rows(n + s, 0, 0, 11).copy() for s in range(stages)]
    interp.hook = None
    logits, hidden = interp.run("dspark_draft", tokens=tokens, positions=pos, seq_ids=seqs)
    for s in range(stages):  # the block is scratch: the rings keep the target's rows
        np.testing.assert_array_equal(cache.window_rows(n + s, 0, 0, 11), before[s])

    drafts = {}
    for seq, prompt in prompts.items():
        rows = np.nonzero(seqs == seq)[0]
        p0 = len(prompt)
        base, y = ref.draft(tokens[rows], pos[rows].astype(np.float64),
                            lambda s: rings[seq][s][max(0, p0 - window):p0])
        assert_close(logits[rows], base, f"base logits of request {seq}")
        assert_close(hidden[rows], y, f"head hidden of request {seq}")
        prev, drafts[seq] = anchors[seq], []
        for i, row in enumerate(rows):  # the Markov chain follows the drafts
            bias, conf = interp.run("dspark_markov", tokens=np.array([prev]), positions=pos[row:row + 1],
                                    seq_ids=seqs[row:row + 1], streams=hidden[row:row + 1])
            want_bias, want_conf = ref.markov(prev, y[i])
            assert_close(bias[0], want_bias, f"Markov bias of request {seq} row {i}")
            assert_close(conf[0, 0], want_conf, f"confidence of request {seq} row {i}")
            prev = int(np.argmax(base[i] + want_bias))
            assert prev == int(np.argmax(logits[row] + bias[0]))
            drafts[seq].append(prev)
    assert all(len(d) == block for d in drafts.values())


def test_the_reference_backend_drafts_on_the_engines_pool(tmp_path):
    """The reference backend's dspark_draft / dspark_markov on the paged pool the engine's steps
    filled give what the interpreter gives on a dense cache fed the same tokens."""
    from dsv4c.compile import compile_model
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    cfg = write_model(tmp_path / "m", dspark_raw(stages=2, block=3, targets=(2, 3)), seed=4)
    compile_model(str(tmp_path / "m"), "reference", tmp_path / "art", progress=False, log=lambda *_: None)
    engine = Engine(tmp_path / "art", max_context=64)
    assert engine.backend.has_dspark
    prompt = list(range(20, 33))
    rid = engine.submit(prompt, SamplingParams(max_new_tokens=2))
    engine.step()
    r = engine.requests[rid]
    tokens = np.array([r.sequence[r.fed], 500, 500], np.int32)
    pos = np.arange(r.fed, r.fed + 3, dtype=np.int32)
    base = engine.backend.dspark_draft(tokens, pos, np.full(3, rid, np.int32))
    bias, conf = engine.backend.dspark_markov(np.array([tokens[0], 41], np.int32), np.array([0, 1]))

    program = run_pipeline(trace(cfg))
    interp = Interpreter(program, materialize_weights(program, load_weights(cfg, tmp_path / "m")), DenseCache(cfg))
    interp.run("step", tokens=np.array(prompt), positions=np.arange(len(prompt)), seq_ids=np.zeros(len(prompt)))
    want_base, y = interp.run("dspark_draft", tokens=tokens, positions=pos, seq_ids=np.zeros(3))
    want_bias, want_conf = interp.run("dspark_markov", tokens=np.array([tokens[0], 41]), positions=pos[:2],
                                      seq_ids=np.zeros(2), streams=y[:2])
    np.testing.assert_allclose(base, want_base, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bias, want_bias, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(conf, want_conf[:, 0], rtol=1e-5, atol=1e-5)
    engine.close()


def test_without_confidence_head_the_backend_returns_none(tmp_path):
    from dsv4c.compile import compile_model
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    write_model(tmp_path / "m", dspark_raw(stages=1, block=2, targets=(3,), dspark_confidence_head=False))
    compile_model(str(tmp_path / "m"), "reference", tmp_path / "art", progress=False, log=lambda *_: None)
    engine = Engine(tmp_path / "art", max_context=32)
    rid = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=2))
    engine.step()
    engine.backend.dspark_draft(np.array([8, 500], np.int32), np.array([3, 4], np.int32), np.full(2, rid, np.int32))
    bias, conf = engine.backend.dspark_markov(np.array([8], np.int32), np.array([0]))
    assert bias.shape == (1, 512) and conf is None
    engine.close()

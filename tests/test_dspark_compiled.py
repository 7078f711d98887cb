"""DSpark's drafter compiled for the CPU against the reference backend: the target step's
context write, the draft stages' base logits and the Markov / confidence heads agree within
1e-4; GPU targets compile a DSpark model without weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dsv4c
from dsv4c.cli import main as cli
from dsv4c.codegen import gpu
from dsv4c.frontend.config import config_from_dict
from dsv4c.runtime.engine import Engine

from conftest import compile_pair
from reference_harness import fp32_checkpoint

TOL = 1e-4
BLOCK = 4  # T = 4 for one request: the decode functions; more requests: prefill


def dspark_config(block: int = BLOCK, confidence: bool | None = None) -> dict:
    """The tiny preset (window 8, CSA / HCA layers) with a two-stage drafter tapping layers 1 and 3."""
    raw = json.loads((Path(dsv4c.__file__).parent / "frontend" / "presets" / "tiny.json").read_text())
    del raw["quantization_config"], raw["expert_dtype"]
    raw.update({"num_nextn_predict_layers": 2, "dspark_block_size": block, "dspark_target_layer_ids": [1, 3],
                "dspark_markov_rank": 8, "dspark_noise_token_id": raw["vocab_size"] - 1})
    if confidence is not None:
        raw["dspark_confidence_head"] = confidence
    return raw


@pytest.fixture(scope="session")
def dspark_artifacts(tmp_path_factory):
    """(config, reference artifact, llvm artifact) of an fp32 DSpark checkpoint, compiled once."""
    tmp = tmp_path_factory.mktemp("dspark")
    cfg = fp32_checkpoint(config_from_dict(dspark_config(), "dspark"), tmp / "ckpt")
    return cfg, *compile_pair(tmp, tmp / "ckpt")


def _drafts(artifact, prompts: list[np.ndarray], prev: np.ndarray):
    """Feed each prompt but its last token in one step (the context write), draft one block per
    request (its last token the anchor), then the Markov head row by row for every request and
    once over all rows: (base logits, [(bias, confidence)] per call)."""
    engine = Engine(artifact, max_step_tokens=96)
    backend, pool = engine.backend, engine.pool
    assert backend.has_dspark
    tokens, positions, seqs = [], [], []
    for seq, p in enumerate(prompts):
        pool.admit(seq, reserve_tokens=len(p) + BLOCK)
        pool.ensure(seq, len(p) + BLOCK)
        tokens.append(p[:-1])
        positions.append(np.arange(len(p) - 1))
        seqs.append(np.full(len(p) - 1, seq))
    backend.step(*(np.concatenate(a).astype(np.int32) for a in (tokens, positions, seqs)))
    noise = engine.config.dspark.noise_token_id
    block_tokens = np.concatenate([[p[-1]] + [noise] * (BLOCK - 1) for p in prompts]).astype(np.int32)
    block_pos = np.concatenate([np.arange(len(p) - 1, len(p) - 1 + BLOCK) for p in prompts]).astype(np.int32)
    block_seq = np.repeat(np.arange(len(prompts)), BLOCK).astype(np.int32)
    base = backend.dspark_draft(block_tokens, block_pos, block_seq)
    heads = []
    for i in range(BLOCK):  # row i of every request, as the drafter asks
        rows = np.arange(len(prompts)) * BLOCK + i
        heads.append(backend.dspark_markov(prev[rows], rows))
    every = np.arange(len(block_tokens))
    heads.append(backend.dspark_markov(prev, every))
    return base, heads


@pytest.mark.parametrize("lengths", [[6], [3, 13, 30]])
def test_compiled_drafter_matches_the_reference(dspark_artifacts, lengths):
    cfg, ref, cpu = dspark_artifacts
    rng = np.random.default_rng(len(lengths))
    prompts = [rng.integers(2, cfg.vocab_size - 1, n) for n in lengths]
    prev = rng.integers(0, cfg.vocab_size, len(lengths) * BLOCK).astype(np.int32)
    base_ref, heads_ref = _drafts(ref, prompts, prev)
    base_cpu, heads_cpu = _drafts(cpu, prompts, prev)
    assert base_ref.shape == (len(lengths) * BLOCK, cfg.vocab_size)
    assert np.abs(base_ref - base_cpu).max() <= TOL
    for (bias_ref, conf_ref), (bias_cpu, conf_cpu) in zip(heads_ref, heads_cpu):
        assert bias_ref.shape == bias_cpu.shape and conf_ref.shape == conf_cpu.shape == (len(bias_ref),)
        assert np.abs(bias_ref - bias_cpu).max() <= TOL
        assert np.abs(conf_ref - conf_cpu).max() <= TOL


def test_manifest_names_the_dspark_functions(dspark_artifacts):
    _, _, cpu = dspark_artifacts
    vm = json.loads((cpu / "manifest.json").read_text())["vm"]
    assert vm["functions"] == ["decode", "prefill", "dspark_draft_decode", "dspark_draft_prefill",
                               "dspark_markov_decode", "dspark_markov_prefill"]
    assert vm["dspark"] == {"draft_inputs": vm["inputs"], "draft_outputs": ["logits", "y"],
                            "markov_inputs": vm["mtp_inputs"], "markov_outputs": ["bias", "confidence"]}


def test_without_a_confidence_head_the_backend_returns_none(tmp_path):
    raw = dspark_config(confidence=False)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert cli(["make-tiny", "--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "model")]) == 0
    assert cli(["compile", "--model", str(tmp_path / "model"), "--target", "llvm", "-o", str(tmp_path / "cpu")]) == 0
    prev = np.arange(BLOCK, dtype=np.int32)
    base, heads = _drafts(tmp_path / "cpu", [np.arange(2, 12)], prev)
    assert base.shape[0] == BLOCK and all(conf is None for _, conf in heads)


@pytest.mark.parametrize("target", ["sm90", "gfx942"])
def test_gpu_targets_compile_a_dspark_model_without_weights(tmp_path, target):
    try:
        gpu.nvcc_environment() if target == "sm90" else gpu.rocm_environment()
    except gpu.ToolchainError as e:
        pytest.skip(f"toolchain missing for {target}: {e}")
    (tmp_path / "config.json").write_text(json.dumps(dspark_config()))
    out = tmp_path / target
    assert cli(["compile", "--model", str(tmp_path / "config.json"), "--target", target, "--no-weights",
                "-o", str(out)]) == 0
    vm = json.loads((out / "manifest.json").read_text())["vm"]
    assert "dspark_markov_prefill" in vm["functions"] and vm["dspark"]["draft_outputs"] == ["logits", "y"]

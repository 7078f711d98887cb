"""The compiled CPU artifact against the reference backend and transformers, through the engine."""

import json

import numpy as np
import pytest

from dsv4c.codegen.lowering import kernel_table
from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.random_model import random_weights
from dsv4c.artifact.model_config import CSA, HCA, SLIDING
from dsv4c.frontend.config import config_from_dict, preset
from dsv4c.frontend.trace import trace
from dsv4c.passes.pipeline import run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams

from parity_configs import PARITY_CONFIGS
from conftest import compile_pair
from reference_harness import fp32_checkpoint, run_hf

TOL = 1e-4


@pytest.fixture
def artifacts(parity_artifacts):
    return parity_artifacts


def _program(cfg):
    return run_pipeline(trace(cfg))


def _run(artifact, prompts, max_new, chunk=None, record=True):
    engine = Engine(artifact, prefill_chunk=chunk, max_step_tokens=96)
    rids = [engine.submit(list(p), SamplingParams(max_new_tokens=max_new), record_logits=record) for p in prompts]
    engine.run()
    return [engine.result(r) for r in rids]


def test_single_request_matches_reference_and_transformers(artifacts):
    cfg, ckpt, ref, cpu = artifacts
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 70)
    (a,), (b,) = _run(ref, [prompt], 64), _run(cpu, [prompt], 64)
    assert a.tokens == b.tokens and len(b.tokens) == 64
    assert np.abs(a.logits - b.logits).max() <= TOL
    # transformers on the same token sequence, one prefill then one token at a time.
    sequence = np.concatenate([prompt, b.tokens])
    hf = run_hf(ckpt, sequence, [len(prompt)] + [1] * 64)
    assert np.abs(hf - b.logits).max() <= TOL


def test_ragged_batch_of_four_with_chunked_prefill(artifacts):
    cfg, ckpt, ref, cpu = artifacts
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in (45, 3, 77, 20)]
    a = _run(ref, prompts, 64, chunk=13)
    b = _run(cpu, prompts, 64, chunk=13)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        assert np.abs(x.logits - y.logits).max() <= TOL
    # Batching and chunking do not change what a request computes.
    alone = _run(cpu, prompts[2:3], 64)[0]
    assert alone.tokens == b[2].tokens
    assert np.abs(alone.logits - b[2].logits).max() <= TOL


def test_ragged_batch_of_eight_is_bit_identical_to_one_at_a_time(artifacts):
    """The compiled step computes a request's logits the same whatever else is in the step:
    decode and prefill functions, batch composition and chunking change no bit."""
    cfg, ckpt, ref, cpu = artifacts
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in (45, 3, 77, 20, 1, 9, 130, 33)]
    batch = _run(cpu, prompts, 12, chunk=11)
    for prompt, together in zip(prompts, batch):
        (alone,) = _run(cpu, [prompt], 12)
        assert alone.tokens == together.tokens
        assert np.array_equal(alone.logits, together.logits)


def test_quantized_checkpoint_runs_native_fp8_fp4_kernels(tmp_path):
    cfg = preset("tiny")
    write_checkpoint(cfg, random_weights(cfg, 3), tmp_path / "ckpt")
    ref, cpu = compile_pair(tmp_path, tmp_path / "ckpt")
    specs, _ = kernel_table(_program(cfg), plan_for(cfg, "llvm"))
    assert any("fp8_b128" in s for s in specs) and any("fp4_g32" in s for s in specs)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, 40)
    (a,), (b,) = _run(ref, [prompt], 64), _run(cpu, [prompt], 64)
    assert a.tokens == b.tokens
    assert np.abs(a.logits - b.logits).max() <= TOL


def test_kernels_are_shared_across_layers(artifacts):
    """A kernel per (shape, format), not per layer: V4-Pro's 61 layers need no more kernels than
    a handful of layers of each kind, and the artifact builds exactly the table's kernels."""
    cfg, ckpt, ref, cpu = artifacts
    specs, _ = kernel_table(_program(cfg), plan_for(cfg, "llvm"))
    assert json.loads((cpu / "manifest.json").read_text())["kernels"]["count"] == len(specs)
    pro = preset("pro")
    specs, per_node = kernel_table(_program(pro), plan_for(pro, "llvm"))
    assert len(specs) < 100 < 20 * pro.num_layers <= sum(len(roles) for roles in per_node)


def test_official_spelling_with_hca_ratio_8_and_a_dropped_mtp_layer(tmp_path, capsys):
    # The official reference reads compress_ratios by value (4 is CSA, any other non-zero ratio
    # HCA), and ignores the trailing entry of an MTP layer the checkpoint no longer has.
    raw = {**PARITY_CONFIGS["official_hc2"], "compress_ratios": [8, 4, 0, 8], "num_nextn_predict_layers": 0}
    cfg = fp32_checkpoint(config_from_dict(raw), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(raw))  # as published, in the official spelling
    ref, cpu = compile_pair(tmp_path, tmp_path / "ckpt")
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 3 and all("ignoring the last 1" in w for w in warnings)  # one per config load
    engine = Engine(cpu)
    assert [(l.attention, l.compress_ratio) for l in engine.config.layers] == [(HCA, 8), (CSA, 4), (SLIDING, 0)]
    assert engine.config.mtp_layers == ()
    # 70 + 16 positions: HCA rows every 8 tokens, and CSA entries past index_topk (16).
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 70)
    (a,), (b,) = _run(ref, [prompt], 16), _run(cpu, [prompt], 16)
    assert a.tokens == b.tokens and len(b.tokens) == 16
    assert np.abs(a.logits - b.logits).max() <= TOL

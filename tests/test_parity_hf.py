"""Reference interpreter vs transformers DeepseekV4ForCausalLM in fp32 (max |dlogit| <= 1e-4).

transformers loads the same official-name checkpoint files we load (its own name
conversion applies), so the name mapping is under test too. Each config covers a
different mix of layer kinds; contexts go past the point where CSA top-k is sparse."""

import numpy as np
import pytest

from dsv4c.frontend.config import config_from_dict

from parity_configs import PARITY_CONFIGS
from reference_harness import TieGuard, fp32_checkpoint, run_hf, run_ours

TOL = 1e-4
# Prompt length per config: long enough that (pos+1)//ratio > index_topk for CSA layers
# and that HCA layers close several windows.
CONTEXT = {"mixed_hc4": 96, "official_hc2": 300, "odd_ratios_hc2": 120, "csa_only_hc4": 90}


def _tokens(cfg, n, seed=7):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n)


@pytest.fixture(scope="module", params=sorted(PARITY_CONFIGS))
def model(request, tmp_path_factory):
    cfg = config_from_dict(PARITY_CONFIGS[request.param], request.param)
    ckpt = tmp_path_factory.mktemp(request.param) / "ckpt"
    return fp32_checkpoint(cfg, ckpt), ckpt, CONTEXT[request.param]


def _assert_sparse_and_tie_free(cfg, guard):
    if any(l.has_indexer for l in cfg.layers):
        assert guard.checked > 0, "no query had more visible CSA entries than index_topk: sparsity never bit"
        assert guard.min_gap > 1e-5, f"a top-k boundary is (nearly) tied: relative gap {guard.min_gap:.2e}"


def test_one_shot_prefill(model):
    cfg, ckpt, n = model
    tokens = _tokens(cfg, n)
    guard = TieGuard()
    ours = run_ours(cfg, ckpt, tokens, [n], hook=guard)
    ref = run_hf(ckpt, tokens, None)
    _assert_sparse_and_tie_free(cfg, guard)
    assert np.abs(ours - ref).max() <= TOL


def test_chunked_prefill_unaligned(model):
    cfg, ckpt, n = model
    tokens = _tokens(cfg, n, seed=8)
    # Chunk edges fall inside compress windows and inside the sliding window.
    chunks = [7, 1, 13, 5, 30]
    chunks.append(n - sum(chunks))
    guard = TieGuard()
    ours = run_ours(cfg, ckpt, tokens, chunks, hook=guard)
    ref = run_hf(ckpt, tokens, chunks)
    _assert_sparse_and_tie_free(cfg, guard)
    assert np.abs(ours - ref).max() <= TOL
    # And the chunked run equals our own one-shot run (entries are chunking-invariant).
    assert np.abs(ours - run_ours(cfg, ckpt, tokens, [n])).max() <= 1e-5


def test_prefill_then_decode(model):
    cfg, ckpt, n = model
    steps = 64
    prompt = n - 40
    tokens = _tokens(cfg, prompt + steps, seed=9)
    chunks = [prompt] + [1] * steps
    guard = TieGuard()
    ours = run_ours(cfg, ckpt, tokens, chunks, hook=guard)
    ref = run_hf(ckpt, tokens, chunks)
    _assert_sparse_and_tie_free(cfg, guard)
    assert np.abs(ours - ref).max() <= TOL

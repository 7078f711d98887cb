"""DeepSeek-V4.1 compiled for the CPU (llvm) against transformers' reference
(tests/data/v41_case0/README.md), as tests/test_v41_parity.py holds the reference target to it:
the logits and greedy tokens whole, with chunked prefill and in a ragged batch; a prefix-cache
hit bit-identical to a miss; and the V4.1 kernels against their numpy models: the fake-quant
round trips bit for bit, the candidate-block mask exactly."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tvm

from dsv4c.artifact import lowbit
from dsv4c.cli import main as cli
from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.ir.reference_v41 import candidate_mask
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.prefix_cache import BLOCK_TOKENS
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.targets import target_info

DATA = Path(__file__).parent / "data"
CASE = DATA / "v41_case0"
TOKEN_IDS = json.loads((DATA / "v41_engram" / "case.json").read_text())["token_ids"]
GREEDY = json.loads((CASE / "case.json").read_text())["greedy_tokens"]
TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def v41_llvm(tmp_path_factory):
    """The parity case compiled for llvm, once."""
    model = tmp_path_factory.mktemp("v41_llvm") / "case0"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DATA / "v41_engram" / name, model / name)
    shutil.copyfile(CASE / "model.safetensors", model / "model.safetensors")
    out = model.parent / "artifact"
    assert cli(["compile", "--model", str(model), "--target", "llvm", "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_logits_and_greedy_tokens_match_the_reference(v41_llvm, tmp_path, capsys, chunk):
    logits = tmp_path / "logits.npy"
    args = ["generate", str(v41_llvm), "--token-ids", ",".join(map(str, TOKEN_IDS)), "--max-new-tokens",
            str(len(GREEDY)), "--greedy", "--logits-out", str(logits)]
    capsys.readouterr()
    assert cli(args + (["--prefill-chunk", str(chunk)] if chunk else [])) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in GREEDY]
    got, n = np.load(logits), len(TOKEN_IDS)
    assert np.abs(got[:n] - np.load(CASE / "logits_full.npy")).max() < TOLERANCE
    assert np.abs(got[n:n + len(GREEDY)] - np.load(CASE / "logits_greedy.npy")).max() < TOLERANCE


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, length).tolist()


def test_a_ragged_batch_matches_the_reference(v41_llvm):
    """The case's prompt fed beside two others of other lengths, in chunks that never line up."""
    engine = Engine(v41_llvm, max_requests=3, max_context=256, max_step_tokens=48, prefill_chunk=13)
    params = SamplingParams(max_new_tokens=len(GREEDY))
    others = [engine.submit(_prompt(5, 30), params), engine.submit(_prompt(6, 71), params)]
    rid = engine.submit(TOKEN_IDS, params, record_logits=True)
    engine.run()
    result, n = engine.result(rid), len(TOKEN_IDS)
    assert result.tokens == GREEDY and all(len(engine.result(o).tokens) == len(GREEDY) for o in others)
    assert np.abs(result.logits[:n] - np.load(CASE / "logits_full.npy")).max() < TOLERANCE
    assert np.abs(result.logits[n:n + len(GREEDY)] - np.load(CASE / "logits_greedy.npy")).max() < TOLERANCE


def _run(engine: Engine, prompt: list[int], params) -> tuple[list[int], list[np.ndarray]]:
    """A request's tokens and the logits each of its sampling steps read (a prompt whose logits
    are recorded is never served from the prefix cache, so the engine's sampling is tapped)."""
    rows: list[np.ndarray] = []
    advance = engine._advance

    def recording(r, logits):
        rows.append(np.array(logits, copy=True))
        advance(r, logits)

    engine._advance = recording
    rid = engine.submit(prompt, params)
    engine.run()
    engine._advance = advance
    return engine.result(rid).tokens, rows


def test_a_prefix_cache_hit_is_bit_identical_to_a_miss(v41_llvm):
    params = SamplingParams(max_new_tokens=4)
    cold = Engine(v41_llvm, max_requests=2, max_context=1024, prefix_caching=False)
    cached = Engine(v41_llvm, max_requests=2, max_context=1024)
    base = _prompt(1, 2 * BLOCK_TOKENS + 9)
    _run(cached, base, params)
    prompt = base[:2 * BLOCK_TOKENS] + _prompt(2, 11)  # the Engram hash of the tail reads the hit's tokens
    hit, miss = _run(cached, prompt, params), _run(cold, prompt, params)
    assert cached.prefix_cache.hit_tokens == 2 * BLOCK_TOKENS
    assert hit[0] == miss[0] and all(np.array_equal(a, b) for a, b in zip(hit[1], miss[1]))


@functools.lru_cache(maxsize=None)
def _kernel(factory: str, *params):
    func = KERNELS[factory](*params)
    return tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}),
                       target=target_info("llvm").tvm_target())["k"]


def _call(kernel, inputs: list, out_shape, dtype="float32"):
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs]
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype))
    kernel(*tensors, out)
    return out.numpy()


@pytest.mark.parametrize("fmt", lowbit.V41_ROUNDTRIPS)
def test_the_round_trips_are_bit_exact(fmt):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((40, 64)) * np.exp2(rng.integers(-30, 20, (40, 1)))).astype(np.float32)
    x[0] = 0  # the amax floors
    x[1, :32] = np.float32(1e-30)
    x[2] = np.linspace(-6, 6, 64, dtype=np.float32)  # midpoints of the grids
    x[3, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 448, -448, 500, 6, -6, 0, 1]
    got = _call(_kernel("v41_roundtrip", 64, fmt), [x], x.shape)
    assert np.array_equal(got.view(np.uint32), lowbit.v41_roundtrip(x, fmt).view(np.uint32))


@pytest.mark.parametrize("ratio,block,blocks", [(2, 8, 2), (1, 4, 3), (2, 3, 1)])
def test_the_candidate_mask_matches_the_reference(ratio, block, blocks):
    rng = np.random.default_rng(ratio + block)
    entries = 22  # every query sees at most the step's entries
    positions = np.array([p for p in (0, 1, 2, 5, 9, 17, 21, 30, 31, 40) if (p + 1) // ratio <= entries], np.int32)
    scores = rng.standard_normal((len(positions), entries)).astype(np.float32)
    scores[:, 3] = scores[:, 11]  # ties between blocks
    visible = (positions[:, None] + 1) // ratio
    scores[np.arange(entries)[None, :] >= visible] = np.float32(-3.4028234663852886e38)  # index_score's mask
    got = _call(_kernel("candidate_mask", ratio, block, blocks), [scores, positions], scores.shape)
    want = candidate_mask(np.where(scores < -1e38, -np.inf, scores).astype(np.float32), positions, None,
                          ratio=ratio, block=block, blocks=blocks)
    assert np.array_equal(got == 0, want == 0)

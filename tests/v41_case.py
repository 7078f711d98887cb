"""The V4.1 parity case (tests/data/v41_case0/README.md) every target is held to: its model
directory compiled for a target, and the tests every target's artifact passes (whole / chunked
generate and a ragged batch against the reference's logits and greedy tokens, a prefix-cache hit
bit-identical to a miss, preempted requests and speculative decoding computing the plain tokens). A test file imports the tests and defines the ``artifact`` fixture
(tests/test_v41_parity.py: the reference target; tests/test_v41_compiled.py: llvm)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dsv4c.cli import main as cli
from dsv4c.runtime.drafter import Draft, Drafter
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.kv_pool import KVPool
from dsv4c.runtime.prefix_cache import BLOCK_TOKENS
from dsv4c.runtime.sampling import SamplingParams

DATA = Path(__file__).parent / "data"
CASE = DATA / "v41_case0"
TOKEN_IDS = json.loads((DATA / "v41_engram" / "case.json").read_text())["token_ids"]
GREEDY = json.loads((CASE / "case.json").read_text())["greedy_tokens"]
TOLERANCE = 1e-4


# The token tests/test_v41_images.py's prompts place image spans with (an ordinary token of the
# case's tokenizer: its embedding is never read at a span's positions).
IMAGE_TOKEN = json.loads((DATA / "v41_images" / "case.json").read_text())["image_token_id"]


def write_case_model(model: Path, images: bool = False) -> Path:
    """The case's model directory (config, tokenizer, weights); ``images``: its config names the
    image token, a model that sees images (the weights hold every layer's ``gate.bias_vl``)."""
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DATA / "v41_engram" / name, model / name)
    shutil.copyfile(DATA / "v41_engram" / "config.json", model / "config.json")
    if images:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "image_token_id": IMAGE_TOKEN}, indent=2))
    shutil.copyfile(CASE / "model.safetensors", model / "model.safetensors")
    return model


def compile_case(root: Path, target: str, *options: str, images: bool = False) -> Path:
    """The case's model directory under ``root`` (:func:`write_case_model`), compiled for ``target``
    (with the compile command's ``options``)."""
    model = write_case_model(root / "case0", images)
    out = root / "artifact"
    assert cli(["compile", "--model", str(model), "--target", target, "-o", str(out), *options]) == 0
    return out


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, length).tolist()


def _close(logits: np.ndarray) -> None:
    n = len(TOKEN_IDS)
    assert np.abs(logits[:n] - np.load(CASE / "logits_full.npy")).max() < TOLERANCE
    assert np.abs(logits[n:n + len(GREEDY)] - np.load(CASE / "logits_greedy.npy")).max() < TOLERANCE


@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_logits_and_greedy_tokens_match_the_reference(artifact: Path, tmp_path: Path, capsys, chunk: int | None):
    """``dsv4c generate --greedy`` of the case's prompt, whole or in prefill chunks of ``chunk``."""
    logits = tmp_path / "logits.npy"
    args = ["generate", str(artifact), "--token-ids", ",".join(map(str, TOKEN_IDS)), "--max-new-tokens",
            str(len(GREEDY)), "--greedy", "--logits-out", str(logits)]
    capsys.readouterr()
    assert cli(args + (["--prefill-chunk", str(chunk)] if chunk else [])) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in GREEDY]
    _close(np.load(logits))


def test_a_ragged_batch_matches_the_reference(artifact: Path):
    """The case's prompt fed beside two others of other lengths, in chunks that never line up."""
    engine = Engine(artifact, max_requests=3, max_context=256, max_step_tokens=48, prefill_chunk=13)
    params = SamplingParams(max_new_tokens=len(GREEDY))
    others = [engine.submit(prompt(5, 30), params), engine.submit(prompt(6, 71), params)]
    rid = engine.submit(TOKEN_IDS, params, record_logits=True)
    engine.run()
    result = engine.result(rid)
    assert result.tokens == GREEDY and all(len(engine.result(o).tokens) == len(GREEDY) for o in others)
    _close(result.logits)


def run_recording(engine: Engine, prompts, params) -> list[tuple[list[int], list[np.ndarray]]]:
    """Each request's tokens and the logits each of its sampling steps read (a prompt whose
    logits are recorded is never served from the prefix cache, so the engine's sampling is tapped)."""
    rows: dict[int, list[np.ndarray]] = {}
    advance = engine._advance

    def recording(r, logits):
        rows.setdefault(r.rid, []).append(np.array(logits, copy=True))
        advance(r, logits)

    engine._advance = recording
    rids = [engine.submit(p, params) for p in prompts]
    engine.run()
    return [(engine.result(rid).tokens, rows[rid]) for rid in rids]


def same_run(a, b) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def test_a_prefix_cache_hit_is_bit_identical_to_a_miss(artifact: Path):
    """A prompt whose first two blocks hit the prefix cache computes, bit for bit, what a miss does."""
    params = SamplingParams(max_new_tokens=6)
    cold = Engine(artifact, max_requests=2, max_context=1024, prefix_caching=False)
    cached = Engine(artifact, max_requests=2, max_context=1024)
    base = prompt(1, 2 * BLOCK_TOKENS + 9)
    run_recording(cached, [base], params)
    tail = base[:2 * BLOCK_TOKENS] + prompt(2, 11)  # the Engram hash of the tail reads the hit's tokens
    got = run_recording(cached, [tail], params)
    assert cached.prefix_cache.hit_tokens == 2 * BLOCK_TOKENS
    assert same_run(got[0], run_recording(cold, [tail], params)[0])


def test_preempted_requests_recompute_the_same_tokens(artifact):
    params = SamplingParams(max_new_tokens=40)
    cold = Engine(artifact, max_requests=3, max_context=1024, prefix_caching=False)
    g = cold.pool.geometry
    small = Engine(artifact, max_requests=3, max_context=1024, prefix_caching=False,
                   kv_cache_memory=KVPool.nbytes_for(g, 3 * (2 * g.rows_per_envelope + g.window_rows_per_request)))
    prompts = [prompt(10 + i, 2 * BLOCK_TOKENS - 10 - 7 * i) for i in range(3)]  # grow into a third block
    got = run_recording(small, prompts, params)
    assert small.preemptions > 0
    # The recomputed prefill batches its rows differently, and the interpreter's fp32 GEMMs sum in an
    # order that depends on the batch: a value on a fake-quant rounding midpoint may land on the
    # other side (docs/v41.md, "Fake-quant"). The tokens are the same, the logits close.
    for (tokens, rows), (want_tokens, want_rows) in zip(got, run_recording(cold, prompts, params)):
        assert tokens == want_tokens
        assert max(np.abs(a - b).max() for a, b in zip(rows, want_rows)) < 1e-2


class RepeatDrafter(Drafter):
    """Drafts the request's last token again: some drafts are kept, most rejected."""

    def propose(self, parts):
        return {p.request.rid: Draft([p.request.sequence[-1]] * p.wanted) for p in parts if p.wanted}


def test_speculative_decoding_computes_the_plain_tokens(artifact):
    params = SamplingParams(max_new_tokens=24)
    prompts = [prompt(20, 40), TOKEN_IDS]
    plain = run_recording(Engine(artifact, max_requests=2, max_context=256, prefix_caching=False), prompts, params)
    # Ratio 2's compressor ring holds two positions: a verify step may feed one draft.
    spec = Engine(artifact, max_requests=2, max_context=256, speculative=RepeatDrafter(), num_draft_tokens=1)
    got = run_recording(spec, prompts, params)
    assert [g[0] for g in got] == [p[0] for p in plain]
    assert spec.spec_stats.drafted > spec.spec_stats.accepted

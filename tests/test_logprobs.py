"""The engine's log-probabilities (generated and prompt tokens) against the logits it records, and
requests that fail alone."""

import numpy as np
import pytest

from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine, RequestFailed
from dsv4c.runtime.sampling import MAX_LOGPROBS, SamplingParams, token_logprob

PROMPT = [5, 17, 200, 3, 99, 41, 7, 300, 12]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def engine(tiny_llvm):
    return Engine(tiny_llvm, max_requests=4, max_context=256)


def test_token_logprob_ranks_the_most_likely_first_and_breaks_ties_by_id():
    logits = np.array([0.0, 3.0, 1.0, 3.0, -2.0], np.float32)
    entry = token_logprob(logits, 2, top=3)
    expected = _log_softmax(logits)
    assert entry.token == 2 and entry.logprob == pytest.approx(expected[2])
    assert [t for t, _ in entry.top] == [1, 3, 2]
    assert [lp for _, lp in entry.top] == pytest.approx(expected[[1, 3, 2]])
    assert token_logprob(logits, 4, top=0).top == ()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_log_softmax_of_the_recorded_logits(engine, temperature):
    params = dict(max_new_tokens=6, temperature=temperature, seed=3)
    recorded = engine.generate(PROMPT, SamplingParams(**params), record_logits=True)
    got = engine.generate(PROMPT, SamplingParams(**params, logprobs=4, prompt_logprobs=2))
    assert got.tokens == recorded.tokens  # asking for log-probabilities changes nothing sampled
    expected = _log_softmax(recorded.logits)  # rows: every prompt position, then every generated one
    sequence = PROMPT + got.tokens
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(PROMPT)
    for p, entry in enumerate(got.prompt_logprobs[1:], start=1):
        assert entry.token == PROMPT[p]
        assert entry.logprob == pytest.approx(expected[p - 1, PROMPT[p]], abs=1e-4)
        assert [t for t, _ in entry.top] == list(np.argsort(-expected[p - 1], kind="stable")[:2])
    assert len(got.logprobs) == len(got.tokens)
    for i, entry in enumerate(got.logprobs):
        row = len(PROMPT) - 1 + i
        assert entry.token == sequence[row + 1]
        assert entry.logprob == pytest.approx(expected[row, entry.token], abs=1e-4)
        assert len(entry.top) == 4 and entry.top[0][1] == pytest.approx(expected[row].max(), abs=1e-4)
        if temperature == 0:
            assert entry.top[0][0] == entry.token


def test_prompt_logprobs_with_no_new_tokens_score_the_prompt_alone(engine):
    scored = engine.generate(PROMPT, SamplingParams(max_new_tokens=0, prompt_logprobs=0))
    whole = engine.generate(PROMPT, SamplingParams(max_new_tokens=0), record_logits=True)
    assert scored.tokens == [] and whole.tokens == [] and len(whole.logits) == len(PROMPT)
    expected = _log_softmax(whole.logits)
    assert [e.logprob for e in scored.prompt_logprobs[1:]] == pytest.approx(
        [expected[p - 1, PROMPT[p]] for p in range(1, len(PROMPT))], abs=1e-4)
    # Chunked prefill scores the same positions.
    chunked = Engine(engine.path, max_requests=1, max_context=64, prefill_chunk=4)
    again = chunked.generate(PROMPT, SamplingParams(max_new_tokens=0, prompt_logprobs=0))
    assert [e.logprob for e in again.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in scored.prompt_logprobs[1:]], abs=1e-4)


@pytest.mark.parametrize("k", [-1, MAX_LOGPROBS + 1])
def test_logprobs_beyond_the_limit_are_refused(k):
    with pytest.raises(UsageError, match="logprobs"):
        SamplingParams(logprobs=k)
    with pytest.raises(UsageError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=k)


def test_speculative_logprobs_are_the_plain_ones(tiny_llvm, engine):
    spec = Engine(tiny_llvm, max_requests=2, max_context=256, speculative="mtp", num_draft_tokens=2)
    params = SamplingParams(max_new_tokens=12, logprobs=1)
    plain, drafted = engine.generate(PROMPT, params), spec.generate(PROMPT, params)
    assert drafted.tokens == plain.tokens
    assert [e.logprob for e in drafted.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)


def test_a_request_whose_callback_raises_fails_alone(engine):
    def explode(_rid, _token):
        raise ValueError("callback bug")

    params = SamplingParams(max_new_tokens=8)
    alone = engine.generate(PROMPT, params).tokens
    bad = engine.submit([9, 8, 7], params, on_token=explode)
    good = engine.submit(PROMPT, params)
    engine.run()
    assert engine.is_finished(bad) and engine.result(good).tokens == alone
    with pytest.raises(RequestFailed, match="callback bug"):
        engine.result(bad)
    assert not engine.pool.requests  # the failed request's rows went back to the pool

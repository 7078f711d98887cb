"""Speculative decoding through the drafter interface (``runtime.drafter``) with a stand-in
drafter on the quick start's llvm artifact: a block drafter that proposes the true greedy
continuation at a chosen rate and wrong tokens otherwise. Greedy output equals plain greedy, the
acceptance statistics count exactly what it proposed and what verification kept, and it is told
of every verification and of every request that leaves the pool."""

import numpy as np
import pytest

from dsv4c.artifact.directory import open_artifact
from dsv4c.runtime.drafter import Draft, Drafter, StepPart
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams

PROMPTS = (7, 1, 30, 12)
NEW_TOKENS = 12
DRAFTS = 3


class StandIn(Drafter):
    """Proposes ``wanted`` tokens at once per request: each the plain run's next token with
    probability ``rate``, else another. Keeps what it proposed per request until it is verified
    (a drafter's own state), and the acceptance it expects of greedy verification."""

    def __init__(self, truth: dict[tuple, list[int]], vocab: int, rate: float, seed: int):
        self.truth, self.vocab, self.rate = truth, vocab, rate
        self.rng = np.random.default_rng(seed)
        self.pending: dict[int, list[int]] = {}
        self.proposed = self.expected_accepted = self.verifications = 0
        self.released: set[int] = set()

    def propose(self, parts: list[StepPart]) -> dict[int, Draft]:
        drafts = {}
        for part in parts:
            r = part.request
            if not part.wanted:
                continue
            assert r.rid not in self.pending  # verified before the next proposal
            ahead = self.truth[tuple(r.prompt)][len(r.generated):len(r.generated) + part.wanted]
            tokens = [t if self.rng.random() < self.rate else (t + 1) % self.vocab for t in ahead]
            drafts[r.rid] = Draft(tokens)
            self.pending[r.rid] = tokens
            self.proposed += len(tokens)
            right = [a == t for a, t in zip(ahead, tokens)]
            self.expected_accepted += right.index(False) if False in right else len(right)
        return drafts

    def verified(self, request, draft: Draft, accepted: int) -> None:
        assert self.pending.pop(request.rid) == draft.tokens
        self.verifications += 1

    def release(self, rid: int) -> None:
        self.released.add(rid)


def _run(artifact, prompts, speculative=None, prefix_caching=True):
    engine = Engine(artifact, max_step_tokens=256, speculative=speculative,
                    num_draft_tokens=DRAFTS, prefix_caching=prefix_caching)
    rids = [engine.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    engine.run()
    return engine, [engine.result(r) for r in rids]


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_a_stand_in_drafter_gives_plain_greedy_and_exact_statistics(tiny_llvm, rate):
    artifact = tiny_llvm
    vocab = open_artifact(artifact).config.vocab_size
    prompts = [np.random.default_rng(n).integers(0, vocab, n).tolist() for n in PROMPTS]
    _, plain = _run(artifact, prompts)
    drafter = StandIn({tuple(p): r.tokens for p, r in zip(prompts, plain)}, vocab, rate, seed=5)
    spec_engine, spec = _run(artifact, prompts, drafter)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert all(len(r.tokens) == NEW_TOKENS for r in spec)
    stats = spec_engine.spec_stats
    assert stats.drafted == drafter.proposed > 0
    assert stats.accepted == drafter.expected_accepted
    assert stats.steps == drafter.verifications
    if rate == 1.0:  # every draft right: each verify step yields its drafts and one more token
        assert stats.accepted == stats.drafted and stats.steps < len(prompts) * (NEW_TOKENS - 1)
    if rate == 0.0:
        assert stats.accepted == 0
    per_request = [r.speculative for r in spec]
    assert sum(s["draft_tokens"] for s in per_request) == stats.drafted
    assert sum(s["accepted_tokens"] for s in per_request) == stats.accepted
    assert not drafter.pending and len(drafter.released) == len(prompts)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_every_verify_step_takes_all_its_drafts_with_or_without_the_prefix_cache(tiny_llvm, prefix_caching):
    """Right drafts only: each verify step takes num_draft_tokens drafts but where the request's
    last tokens leave fewer to propose. Without the prefix cache (every GPU pool) a decode step
    was cut as if the sequence's end were a block boundary, so it verified one draft at most."""
    vocab = open_artifact(tiny_llvm).config.vocab_size
    prompts = [np.random.default_rng(n).integers(0, vocab, n).tolist() for n in PROMPTS]
    _, plain = _run(tiny_llvm, prompts, prefix_caching=prefix_caching)
    drafter = StandIn({tuple(p): r.tokens for p, r in zip(prompts, plain)}, vocab, 1.0, seed=5)
    engine, spec = _run(tiny_llvm, prompts, drafter, prefix_caching=prefix_caching)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    stats = engine.spec_stats
    assert stats.accepted == stats.drafted
    assert stats.drafted >= (DRAFTS - 1) * stats.steps  # the last step of each request may take fewer

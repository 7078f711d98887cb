"""The DSpark drafter's runtime (``speculative="dspark"``) on a stand-in backend: a backend
whose step's logits come from a fixed toy "true model" (a function of the fed token and its
position) and whose DSpark functions return Markov-corrected logits that are right at a chosen
rate, so the runtime is tested apart from any compiled drafter. Greedy output equals plain
greedy with partial accepts at every block position, the confidence head cuts the drafts where it
should, the accepted-length counts add up (engine, ``--stats`` JSON and ``/metrics``), and
sampled output has the plain sampler's law (chi-square on a 4-token vocabulary)."""

import types
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import generate_latest

from dsv4c.artifact.model_config import Dspark
from dsv4c.cli import main as cli
from dsv4c.errors import UsageError
from dsv4c.runtime import engine as engine_module
from dsv4c.runtime.backend import Backend
from dsv4c.runtime.drafter import Drafter
from dsv4c.runtime.drafter_dspark import DsparkDrafter
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import Sampler, SamplingParams
from dsv4c.runtime.serve.engine_loop import EngineLoop, ServerMetrics

from test_speculative_sampling import BATCH, P_VALUE, PARAMS, PROMPT, VOCAB, _chi2_p_value, sampled_counts

NOISE = 3
PROMPTS = (45, 3, 120, 20, 1, 9, 77, 33)  # a ragged batch, fed in chunks of 13
NEW_TOKENS = 40
PERIOD = 16  # the toy model's logits depend on the position modulo this


def _toy_logits(token: int, position: int, vocab: int) -> np.ndarray:
    """The toy true model: the logits after ``token`` at ``position``."""
    return 3 * np.random.default_rng((token, position % PERIOD, 1)).standard_normal(vocab).astype(np.float32)


class ToyBackend(Backend):
    """A backend without a model: its step returns the toy model's logits; its DSpark functions
    make each row's logits (base + Markov bias) the toy model's next-token logits when the row's
    draft is to be right (with probability ``rate``, fixed per request, position and previous
    token), else logits whose argmax is another token; when ``sampled`` the right ones are
    perturbed too, so that the draft law differs from the target's. The confidence logit is +2 on
    right rows and -2 on wrong ones (a perfectly calibrated head), None without a head."""

    has_dspark = True

    def __init__(self, vocab: int, rate: float, block_size: int, sampled: bool = False, confidence: bool = True):
        self.vocab, self.rate, self.block_size = vocab, rate, block_size
        self.sampled, self.confidence = sampled, confidence
        self.block = None  # the last dspark_draft call's (tokens, positions, seq_ids, base logits)

    def step(self, tokens, positions, seq_ids, logit_rows=None):
        logits = np.stack([_toy_logits(int(t), int(p), self.vocab) for t, p in zip(tokens, positions)])
        return logits if logit_rows is None else logits[logit_rows]

    def dspark_draft(self, tokens, positions, seq_ids):
        b = self.block_size
        assert len(tokens) % b == 0 and (tokens.reshape(-1, b)[:, 1:] == NOISE).all()
        assert (np.diff(positions.reshape(-1, b), axis=1) == 1).all()
        assert (seq_ids.reshape(-1, b).T == seq_ids[::b]).all()
        base = np.random.default_rng((int(positions[0]), 2)).standard_normal((len(tokens), self.vocab))
        self.block = (tokens, positions, seq_ids, base.astype(np.float32))
        return self.block[3]

    def right(self, seq: int, position: int, prev: int) -> bool:
        return np.random.default_rng((seq, position, prev, 3)).random() < self.rate

    def dspark_markov(self, prev_tokens, rows):
        tokens, positions, seqs, base = self.block
        bias, conf = [], []
        for prev, row in zip(prev_tokens, rows):
            # Row i sits at the position of its previous token (the anchor's, then draft i's).
            seq, position = int(seqs[row]), int(positions[row])
            if row % self.block_size == 0:
                assert prev == tokens[row]
            target = _toy_logits(int(prev), position, self.vocab)
            right = self.right(seq, position, int(prev))
            if self.sampled:
                target = target + 2 * np.random.default_rng((seq, position, 4)).standard_normal(self.vocab)
            elif not right:
                best = int(np.argmax(target))
                target = target.copy()
                target[(best + 1) % self.vocab] = target[best] + 1
            bias.append(target - base[row])
            conf.append(2.0 if right else -2.0)
        return np.array(bias, np.float32), np.array(conf, np.float32) if self.confidence else None


def _dspark(block_size: int, confidence_head: bool = True) -> Dspark:
    return Dspark(block_size=block_size, target_layers=(1, 2), markov_rank=4, noise_token_id=NOISE,
                  n_routed_experts=4, n_experts_per_tok=2, confidence_head=confidence_head)


@pytest.fixture(scope="module")
def tiny_ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_ref")
    assert cli(["make-tiny", "--out", str(root / "model")]) == 0
    assert cli(["compile", "--model", str(root / "model"), "--target", "reference", "-o", str(root / "ref")]) == 0
    return root / "ref"


@pytest.fixture
def toy(monkeypatch):
    """Engines of the tiny reference artifact (its pool and scheduling) with a ToyBackend and, when
    ``block_size`` is given, a DSpark drafter of that block size in its config."""
    real_open = engine_module.open_artifact

    def make(artifact, backend: ToyBackend, block_size: int | None = None, confidence_head: bool = True, **kwargs):
        def opened(path, verify=False):
            o = real_open(path, verify=verify)
            config = replace(o.config, dspark=None if block_size is None else _dspark(block_size, confidence_head))
            return types.SimpleNamespace(manifest=o.manifest, config=config, geometry=o.geometry)

        monkeypatch.setattr(engine_module, "open_artifact", opened)
        monkeypatch.setattr(engine_module, "load_backend", lambda *args: backend)
        return Engine(artifact, **kwargs)

    return make


def _prompts(vocab=512):
    rng = np.random.default_rng(11)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPTS]


def _generate(engine, prompts, **params):
    rids = [engine.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS, **params)) for p in prompts]
    engine.run()
    return [engine.result(r) for r in rids]


def _plain(toy, tiny_ref):
    engine = toy(tiny_ref, ToyBackend(512, 0, 1), prefill_chunk=13, max_step_tokens=96)
    return [r.tokens for r in _generate(engine, _prompts())]


@pytest.mark.parametrize("block_size", [2, 3, 4, 5])
def test_greedy_dspark_equals_plain_greedy_with_partial_accepts_at_every_block_position(toy, tiny_ref, block_size):
    plain = _plain(toy, tiny_ref)
    backend = ToyBackend(512, 0.75, block_size)
    engine = toy(tiny_ref, backend, block_size, speculative="dspark", prefill_chunk=13, max_step_tokens=96)
    assert engine.speculation.num_draft_tokens == block_size  # the default: the whole block
    results = _generate(engine, _prompts())
    assert [r.tokens for r in results] == plain
    stats = engine.spec_stats
    lengths = stats.accepted_lengths
    # Every number of accepted drafts 0 .. B occurred: a rejection at every block row, and whole blocks.
    assert len(lengths) == block_size + 1 and all(lengths), lengths
    assert sum(lengths) == stats.steps and sum(j * n for j, n in enumerate(lengths)) == stats.accepted
    assert stats.steps < sum(NEW_TOKENS - 1 for _ in PROMPTS)  # accepted drafts saved steps
    per_request = [r.speculative for r in results]
    assert np.array_equal(np.sum([np.pad(s["accepted_lengths"], (0, block_size + 1 - len(s["accepted_lengths"])))
                                  for s in per_request], axis=0), lengths)
    assert stats.to_json()["accepted_lengths"] == lengths


def test_fewer_drafts_than_the_block_and_the_bounds(toy, tiny_ref):
    plain = _plain(toy, tiny_ref)
    engine = toy(tiny_ref, ToyBackend(512, 0.75, 5), 5, speculative="dspark", num_draft_tokens=2,
                 prefill_chunk=13, max_step_tokens=96)
    assert [r.tokens for r in _generate(engine, _prompts())] == plain
    assert len(engine.spec_stats.accepted_lengths) == 3
    with pytest.raises(UsageError, match=r"num_draft_tokens must be in \[1, 5\] .*block holds 5"):
        toy(tiny_ref, ToyBackend(512, 0.75, 5), 5, speculative="dspark", num_draft_tokens=6)
    # A block longer than the pool's smallest ring (the tiny model's: 8 rows) drafts what it holds.
    engine = toy(tiny_ref, ToyBackend(512, 0.75, 12), 12, speculative="dspark")
    assert engine.speculation.num_draft_tokens == 7
    with pytest.raises(UsageError, match=r"num_draft_tokens must be in \[1, 7\] .*ring holds 8"):
        toy(tiny_ref, ToyBackend(512, 0.75, 12), 12, speculative="dspark", num_draft_tokens=8)


def test_the_confidence_head_cuts_the_drafts_at_its_first_doubt(toy, tiny_ref):
    plain = _plain(toy, tiny_ref)
    engine = toy(tiny_ref, ToyBackend(512, 0.75, 5), 5, speculative="dspark", draft_confidence=0.5,
                 prefill_chunk=13, max_step_tokens=96)
    assert [r.tokens for r in _generate(engine, _prompts())] == plain
    stats = engine.spec_stats
    # The toy head rates exactly the right drafts above 0.5: every draft verified is accepted, and a
    # block whose first draft is wrong is not verified at all.
    assert stats.drafted == stats.accepted > 0 and stats.accepted_lengths[0] == 0
    # Without the cut the same drafter's drafts are rejected too.
    engine = toy(tiny_ref, ToyBackend(512, 0.75, 5), 5, speculative="dspark", prefill_chunk=13, max_step_tokens=96)
    _generate(engine, _prompts())
    assert engine.spec_stats.accepted < engine.spec_stats.drafted


def test_what_dspark_refuses(toy, tiny_ref):
    backend = ToyBackend(512, 0.75, 5)
    for confidence in (-0.1, 1.5, float("nan")):
        with pytest.raises(UsageError, match=r"draft_confidence must be in \[0, 1\]"):
            toy(tiny_ref, backend, 5, speculative="dspark", draft_confidence=confidence)
    with pytest.raises(UsageError, match="no confidence head"):
        toy(tiny_ref, backend, 5, confidence_head=False, speculative="dspark", draft_confidence=0.5)
    toy(tiny_ref, backend, 5, confidence_head=False, speculative="dspark")  # without the cut it runs
    for speculative in (None, "mtp"):
        with pytest.raises(UsageError, match="draft_confidence goes with speculative='dspark'"):
            toy(tiny_ref, backend, 5, speculative=speculative, draft_confidence=0.5)
    with pytest.raises(UsageError, match="has no DSpark drafter"):
        toy(tiny_ref, backend, None, speculative="dspark")
    backend.has_dspark = False
    with pytest.raises(UsageError, match="without the DSpark drafter's functions"):
        toy(tiny_ref, backend, 5, speculative="dspark")
    with pytest.raises(UsageError, match="compiled for 2 ranks"):
        DsparkDrafter(backend, types.SimpleNamespace(dspark=_dspark(5)), tiny_ref, "llvm", 2)


def test_a_drafter_of_ones_own_still_drafts_one_token_by_default(toy, tiny_ref):
    class Nothing(Drafter):
        def propose(self, parts):
            return {}

    assert toy(tiny_ref, ToyBackend(512, 0, 1), speculative=Nothing()).speculation.num_draft_tokens == 1


def test_metrics_count_drafts_and_accepted_lengths(toy, tiny_ref):
    engine = toy(tiny_ref, ToyBackend(512, 0.75, 4), 4, speculative="dspark", prefill_chunk=13, max_step_tokens=96)
    metrics = ServerMetrics(engine.speculation.num_draft_tokens)
    loop = EngineLoop(engine, metrics, max_waiting=8)
    rids = [engine.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in _prompts()[:4]]
    for _ in range(6):
        engine.step()
        loop._publish_engine()  # after every step, as the engine thread does; counted once each
    engine.run()
    loop._publish_engine()
    stats = engine.spec_stats
    text = generate_latest(metrics.registry).decode()
    value = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("dsv4c_spec")}
    assert value["dsv4c_spec_draft_tokens_total"] == stats.drafted > 0
    assert value["dsv4c_spec_accepted_tokens_total"] == stats.accepted
    assert value["dsv4c_spec_accepted_length_count"] == stats.steps
    assert value["dsv4c_spec_accepted_length_sum"] == stats.accepted
    cumulative = np.cumsum(stats.accepted_lengths)
    for j in range(5):
        assert value[f'dsv4c_spec_accepted_length_bucket{{le="{j}.0"}}'] == cumulative[j]
    assert all(engine.result(r).tokens for r in rids)


def _exact_joint(tokens: int) -> np.ndarray:
    """P(t1 .. t_tokens) of plain sampling from the toy model after PROMPT."""
    law = Sampler(SamplingParams(**PARAMS)).probs
    joint = np.ones(())
    for depth in range(tokens):
        step = np.zeros((VOCAB,) * (depth + 1))
        for before in np.ndindex(*(VOCAB,) * depth):
            last = (PROMPT + list(before))[-1]
            step[before] = joint[before] * law(_toy_logits(last, len(PROMPT) - 1 + depth, VOCAB))
        joint = step
    assert abs(joint.sum() - 1) < 1e-9
    return joint


def _sampled(toy, tiny_ref) -> tuple[np.ndarray, object]:
    """The first four tokens: the first verify step carries three drafts (a block of 3)."""
    engine = toy(tiny_ref, ToyBackend(VOCAB, 0.5, 3, sampled=True), 3, speculative="dspark", max_requests=BATCH)
    return sampled_counts(engine, 4), engine


def test_sampled_dspark_output_has_the_plain_law(toy, tiny_ref, monkeypatch):
    joint = _exact_joint(4)
    counts, engine = _sampled(toy, tiny_ref)
    stats = engine.spec_stats
    # Rejection sampling ran both ways, and rejections landed at every row of the block.
    assert 0.1 * stats.drafted < stats.accepted < 0.9 * stats.drafted
    assert len(stats.accepted_lengths) == 4 and all(stats.accepted_lengths)
    assert _chi2_p_value(counts, joint) > P_VALUE
    # The test tells a wrong rule: accepting every draft emits the drafter's own law.
    from dsv4c.runtime import speculative

    monkeypatch.setattr(speculative, "accept", lambda sampler, logits, draft: (
        draft.tokens + [sampler(logits[len(draft.tokens)])], len(draft.tokens)))
    wrong, _ = _sampled(toy, tiny_ref)
    assert _chi2_p_value(wrong, joint) < P_VALUE

"""Speculative decoding with the MTP layer (``Engine(speculative="mtp")``): greedy outputs equal
plain greedy token for token, and the KV pool after a run equals a plain run's byte for byte,
however many drafts were rejected and whatever state they wrote."""

import numpy as np
import pytest

from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams

# Prompt lengths of a ragged batch of 8; with chunked prefill and 40-odd new tokens the
# decode spans cross many CSA / HCA window ends (official_hc2's HCA windows are 128 tokens:
# the 120-token prompt crosses one while decoding).
PROMPTS = (45, 3, 120, 20, 1, 9, 77, 33)
NEW_TOKENS = 40


def _prompts(cfg):
    rng = np.random.default_rng(11)
    return [list(rng.integers(0, cfg.vocab_size, n)) for n in PROMPTS]


def _run(artifact, prompts, speculative=None, k=1, oracle=None):
    engine = Engine(artifact, prefill_chunk=13, max_step_tokens=96, speculative=speculative, num_draft_tokens=k)
    if oracle is not None:
        engine.speculation.drafter.choose = oracle
    rollbacks = _record_rollbacks(engine)
    rids = [engine.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    engine.run()
    return engine, [engine.result(r) for r in rids], rollbacks


_PLAIN = {}


def _plain(cpu, prompts):
    if cpu not in _PLAIN:
        _PLAIN[cpu] = _run(cpu, prompts)
    return _PLAIN[cpu]


def _oracle(plain, prompts, vocab, seed):
    """Drafts that are right with probability ~0.6 (the plain run's next token) and wrong
    otherwise, so acceptances, partial acceptances and rejections all occur at every depth."""
    by_prompt = {tuple(p): r.tokens for p, r in zip(prompts, plain)}
    rng = np.random.default_rng(seed)

    def propose(r, draft, _logits):
        ahead = by_prompt[tuple(r.prompt)][len(r.generated) + len(draft.tokens)]
        draft.tokens.append(ahead if rng.random() < 0.6 else (ahead + 1) % vocab)
    return propose


def _record_rollbacks(engine) -> list[int]:
    """The positions whose pool state the engine puts back (rejected drafts)."""
    pool, taken, restored = engine.pool, {}, []
    position_state, save, restore = pool.position_state, pool.save, pool.restore

    def tagged_save(state):
        saved = save(state)
        taken[id(saved)] = state.position
        return saved

    def tagged_state(seq, positions):
        state = _Tagged(position_state(seq, positions))
        state.position = int(list(positions)[0])
        return state

    def recorded_restore(saved):
        restored.append(taken[id(saved)])
        restore(saved)

    pool.position_state, pool.save, pool.restore = tagged_state, tagged_save, recorded_restore
    return restored


class _Tagged(list):
    position: int


def _pool_state(engine, cfg):
    """Every pool array, with the MTP layer's window rows blanked: a plain run never writes them."""
    pool = engine.pool
    planes = {k: v.copy() for k, v in pool.planes.items()}
    for slot in range(pool.max_slots):
        base = pool.slot_rows(slot)[0] + cfg.num_layers * cfg.sliding_window
        for plane in planes.values():
            plane[base:base + cfg.sliding_window] = 0
    rings = {f"{k}.{i}": v[i] for k, v in pool.state.items() for i in range(2)}
    return {**planes, "index": pool.index_plane, **rings}


@pytest.mark.parametrize("mode", ["mtp_k1", "oracle_k1", "oracle_k2"])
def test_greedy_speculative_equals_plain_and_leaves_the_same_pool(parity_artifacts, mode):
    cfg, _, _, cpu = parity_artifacts
    prompts = _prompts(cfg)
    plain_engine, plain, _ = _plain(cpu, prompts)
    k = int(mode[-1])
    oracle = _oracle(plain, prompts, cfg.vocab_size, k) if mode.startswith("oracle") else None
    spec_engine, spec, rolled_back = _run(cpu, prompts, "mtp", k, oracle)
    for a, b in zip(plain, spec):
        assert a.tokens == b.tokens and len(a.tokens) == NEW_TOKENS
    stats = spec_engine.spec_stats
    decode_positions = sum(NEW_TOKENS - 1 for _ in prompts)
    assert stats.steps > 0 and stats.drafted >= stats.steps
    rejected = stats.drafted - stats.accepted
    if oracle is None:
        # Random MTP weights: nearly every draft is rejected, so a rejected draft sat at
        # every decode position, the last position of every window among them.
        assert rejected >= 0.9 * decode_positions
    else:
        assert stats.accepted >= 0.3 * stats.drafted and rejected >= 0.2 * stats.drafted
        assert stats.steps < decode_positions  # accepted drafts saved steps
    # Rejected drafts closed compressor windows (writing entries, index entries and, for CSA,
    # the overlap half of the ring) and were taken back: every ratio with random MTP drafts.
    ratios = sorted({layer.compress_ratio for layer in cfg.layers if layer.is_compressed})
    closing = {r: sum((p + 1) % r == 0 for p in rolled_back) for r in ratios}
    assert all(closing.values()) if oracle is None else closing[ratios[0]] >= 2, closing
    before, after = _pool_state(plain_engine, cfg), _pool_state(spec_engine, cfg)
    for name in before:
        assert np.array_equal(before[name], after[name]), name
    per_request = [r.speculative for r in spec]
    assert sum(s["draft_tokens"] for s in per_request) == stats.drafted
    assert all(s["acceptance_rate"] is None or 0 <= s["acceptance_rate"] <= 1 for s in per_request)


def test_speculative_refuses_what_it_cannot_do(parity_artifacts, tmp_path):
    cfg, _, ref, cpu = parity_artifacts
    with pytest.raises(UsageError, match="speculative must be one of"):
        Engine(cpu, speculative="eagle")
    with pytest.raises(UsageError, match="num_draft_tokens must be in"):
        Engine(cpu, speculative="mtp", num_draft_tokens=cfg.sliding_window)
    with pytest.raises(UsageError, match="needs a compiled MTP layer"):
        Engine(ref, speculative="mtp")
    engine = Engine(cpu, speculative="mtp")
    with pytest.raises(UsageError, match="record_logits"):
        engine.submit([1, 2], SamplingParams(max_new_tokens=2), record_logits=True)


@pytest.mark.parametrize("parity_artifacts", ["official_hc2"], indirect=True)  # one config: the path is the same
def test_giving_back_cached_buffers_between_calls_changes_nothing(parity_artifacts, monkeypatch):
    """The CPU backend gives back its allocators' cached buffers every RELEASE_EVERY_S
    (runtime.tvm_runtime.release_cached_memory); done before every call, MTP's drafts, which read
    the streams the last step left on the device, and the steps still give plain greedy's tokens."""
    from dsv4c.runtime import backend_tvm

    cfg, _, _, cpu = parity_artifacts
    prompts = _prompts(cfg)
    _, plain, _ = _plain(cpu, prompts)
    releases, calls = [], []
    release, call = backend_tvm.rt.release_cached_memory, backend_tvm.TvmBackend.call
    monkeypatch.setattr(backend_tvm, "RELEASE_EVERY_S", 0.0)
    monkeypatch.setattr(backend_tvm.rt, "release_cached_memory", lambda: releases.append(release()))
    monkeypatch.setattr(backend_tvm.TvmBackend, "call", lambda self, name, *a, **k: calls.append(name) or call(
        self, name, *a, **k))
    _, spec, _ = _run(cpu, prompts, "mtp", 1)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert len(releases) == len(calls) and {"decode", "mtp0_decode"} <= set(calls)

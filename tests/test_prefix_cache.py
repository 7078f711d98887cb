"""Prefix caching and the shared, memory-sized pool: a request that hits the cache computes the
logits it computes without it, bit for bit (fp32 pool), on every parity config (CSA, HCA,
sliding-only layers, hc_mult 2 and 4); preempted requests give the same tokens; rows all come
back."""

import numpy as np
import pytest

from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.kv_pool import KVPool
from dsv4c.runtime.prefix_cache import BLOCK_TOKENS
from dsv4c.runtime.sampling import SamplingParams

NEW = 6


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, vocab, length).tolist()


class Recorder:
    """The logits every request of an engine samples from, in order (a copy of each row)."""

    def __init__(self, engine: Engine):
        self.rows: dict[int, list[np.ndarray]] = {}
        advance = engine._advance

        def recording(r, logits):
            self.rows.setdefault(r.rid, []).append(np.array(logits, copy=True))
            advance(r, logits)

        engine._advance = recording


def _run(engine: Engine, prompts: list[list[int]], params=SamplingParams(max_new_tokens=NEW)):
    """Every prompt at once; (tokens, sampled logits) of each."""
    recorder = Recorder(engine)
    rids = [engine.submit(p, params) for p in prompts]
    engine.run()
    return [(engine.result(rid).tokens, recorder.rows[rid]) for rid in rids]


def _same(a, b) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def _all_rows_free(engine: Engine) -> bool:
    pool = engine.pool
    return not pool.requests and pool._env_high == 0 and pool._slot_high == 0 and not pool._env_refs


@pytest.fixture(scope="module")
def engines(parity_artifacts):
    cfg, _ckpt, _ref, cpu = parity_artifacts
    return (cfg, Engine(cpu, max_requests=4, max_context=1536, prefix_caching=False),
            Engine(cpu, max_requests=4, max_context=1536))


@pytest.mark.parametrize("extra", [0, 3, 40])  # ends at a block boundary, inside a window, past it
def test_a_hit_computes_what_a_cold_run_computes(engines, extra):
    cfg, cold, cached = engines
    window = cfg.sliding_window
    base = _prompt(1, 3 * BLOCK_TOKENS + 17, cfg.vocab_size)
    _run(cached, [base])  # fills the cache
    for blocks in (1, 3):  # hits of one block and of several
        prompt = base[:blocks * BLOCK_TOKENS] + _prompt(2 + blocks, extra + (window if extra == 40 else 0),
                                                        cfg.vocab_size)
        before = cached.prefix_cache.hit_tokens
        got, want = _run(cached, [prompt]), _run(cold, [prompt])
        hit = cached.prefix_cache.hit_tokens - before
        # At least one prompt token is fed: a prompt of whole blocks hits all but its last.
        assert hit == (blocks - (extra == 0)) * BLOCK_TOKENS
        assert _same(got[0], want[0])


def test_requests_sharing_a_prefix_in_one_batch_and_after(engines):
    cfg, cold, cached = engines
    shared = _prompt(11, 2 * BLOCK_TOKENS + 5, cfg.vocab_size)
    prompts = [shared + _prompt(12 + i, 9 + i, cfg.vocab_size) for i in range(3)]
    together = _run(cached, prompts)  # nothing cached yet: all three compute the prefix, in one batch
    later = _run(cached, [shared + _prompt(20, 7, cfg.vocab_size)])  # hits what they cached
    assert cached.prefix_cache.hit_tokens >= 2 * BLOCK_TOKENS
    want = _run(cold, prompts + [shared + _prompt(20, 7, cfg.vocab_size)])
    assert all(_same(a, b) for a, b in zip(together + later, want))


def test_eviction_refill_and_preemption_keep_tokens_and_give_every_row_back(parity_artifacts):
    cfg, _ckpt, _ref, cpu = parity_artifacts
    cold = Engine(cpu, max_requests=4, max_context=1024, prefix_caching=False)
    g = cold.pool.geometry
    # Four prompts of two blocks each fit; as they grow into a third block, they preempt one
    # another (and cached blocks are evicted first).
    small = Engine(cpu, max_requests=4, max_context=1024,
                   kv_cache_memory=KVPool.nbytes_for(g, 4 * (2 * g.rows_per_envelope + g.window_rows_per_request)))
    prompts = [_prompt(30 + i, 400 + 13 * i, cfg.vocab_size) for i in range(4)]
    params = SamplingParams(max_new_tokens=160)
    want = _run(cold, prompts, params)
    first = _run(small, prompts, params)
    assert small.preemptions > 0
    again = _run(small, prompts, params)  # some blocks were evicted, some hit: refilled as needed
    assert all(_same(a, b) for a, b in zip(first, want)) and all(_same(a, b) for a, b in zip(again, want))
    small.clear_prefix_cache()
    assert _all_rows_free(small)


def test_speculative_decoding_with_the_cache(parity_artifacts):
    cfg, _ckpt, _ref, cpu = parity_artifacts
    plain = Engine(cpu, max_requests=2, max_context=1536, prefix_caching=False)
    spec = Engine(cpu, max_requests=2, max_context=1536, speculative="mtp", num_draft_tokens=2)
    base = _prompt(40, 2 * BLOCK_TOKENS + 60, cfg.vocab_size)
    prompts = [base, base[:2 * BLOCK_TOKENS] + _prompt(41, cfg.sliding_window + 30, cfg.vocab_size)]
    params = SamplingParams(max_new_tokens=2 * BLOCK_TOKENS)  # decoding crosses block boundaries
    first = _run(spec, prompts[:1], params)
    second = _run(spec, prompts[1:], params)
    assert spec.prefix_cache.hit_tokens > 0
    want = _run(plain, prompts, params)
    assert first[0][0] == want[0][0] and second[0][0] == want[1][0]
    spec.clear_prefix_cache()
    assert _all_rows_free(spec)


def test_a_request_waiting_for_rows_counts_its_lookup_once(tiny_llvm):
    # Room for one request of max_context: the second waits while the first runs, looking the
    # cache up at every step; the counters behind /metrics (and the hit ratio) count it once.
    g = Engine(tiny_llvm, max_requests=2, max_context=1024, prefix_caching=False).pool.geometry
    engine = Engine(tiny_llvm, max_requests=2, max_context=1024,
                    kv_cache_memory=KVPool.nbytes_for(g, 4 * g.rows_per_envelope + g.window_rows_per_request))
    refusals = []
    admit = engine.scheduler.admit

    def counting(r):
        refusals.append(not admit(r))
        return not refusals[-1]

    engine.scheduler.admit = counting
    prompts = [_prompt(50 + i, 300, engine.config.vocab_size) for i in range(2)]
    _run(engine, prompts)
    assert sum(refusals) > 1 and engine.preemptions == 0
    assert engine.prefix_cache.queried_tokens == sum(map(len, prompts))


def test_the_pool_is_sized_by_memory(tiny_llvm):
    engine = Engine(tiny_llvm, max_requests=2, max_context=512)
    g = engine.pool.geometry
    rows = KVPool.rows_for_bytes(g, 10 * 2**20)
    assert KVPool.nbytes_for(g, rows) <= 10 * 2**20 < KVPool.nbytes_for(g, rows + 1)
    sized = Engine(tiny_llvm, max_requests=2, max_context=512, kv_cache_memory=10 * 2**20)
    assert sized.pool.total_rows == rows
    with pytest.raises(UsageError, match="fewer than one request"):
        Engine(tiny_llvm, max_context=512, kv_cache_memory=1000)


def test_generate_takes_the_pool_options(tiny_llvm, capsys):
    from dsv4c.cli import main as cli

    args = ["generate", str(tiny_llvm), "--token-ids", "5,6,7", "--max-new-tokens", "4", "--greedy"]
    assert cli(args) == 0
    plain = capsys.readouterr().out
    assert cli(args + ["--kv-cache-memory", "64MiB", "--no-prefix-caching"]) == 0
    assert capsys.readouterr().out == plain
    assert cli(args + ["--kv-cache-memory", "1KiB"]) == 2
    assert "fewer than one request" in capsys.readouterr().err


def test_an_fp8_pool_hit_equals_a_cold_run_chunked_at_the_hit(tiny_llvm, tmp_path):
    from dsv4c.cli import main as cli

    fp8 = tmp_path / "fp8"
    assert cli(["compile", "--model", str(tiny_llvm.parent / "model"), "--target", "llvm", "--kv-cache-dtype", "fp8",
                "-o", str(fp8)]) == 0
    # The cache ends steps at block boundaries; the cold run's chunks end there too.
    cold = Engine(fp8, max_requests=2, max_context=1024, prefix_caching=False, prefill_chunk=BLOCK_TOKENS)
    cached = Engine(fp8, max_requests=2, max_context=1024)
    vocab = cached.config.vocab_size
    base = _prompt(50, 2 * BLOCK_TOKENS + 30, vocab)
    prompt = base[:2 * BLOCK_TOKENS] + _prompt(51, 45, vocab)
    _run(cached, [base])
    got = _run(cached, [prompt])
    assert cached.prefix_cache.hit_tokens == 2 * BLOCK_TOKENS
    assert _same(got[0], _run(cold, [prompt])[0])

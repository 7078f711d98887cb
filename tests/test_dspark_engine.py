"""Speculative decoding with a DSpark drafter end to end, on the reference interpreter: a
``make-tiny`` model with a drafter (hc_mult 2, a ratio-4 CSA layer and a 128-token HCA layer,
three stages) drafts blocks of 2 .. 5 in a ragged batch with chunked prefill and a prefix-cache
hit. Greedy output equals plain greedy token for token, and the KV pool (the stages' window
rings included, which the target step writes) equals a plain run's byte for byte after
rejections that closed compressed windows. Drafts are forced right at a chosen rate on top of
the drafter's own logits, so partial accepts land at every block position; the drafter's own
drafts (random weights) run too, sampled ones keep the plain law, and the command line and
the server."""

import json

import numpy as np
import pytest

from dsv4c.cli import main as cli
from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams

from parity_configs import PARITY_CONFIGS
from test_speculative import _record_rollbacks

STAGES = 3
CONFIG = {**PARITY_CONFIGS["official_hc2"], "num_nextn_predict_layers": STAGES,
          "compress_ratios": [128, 4, 0] + [0] * STAGES, "dspark_target_layer_ids": [1, 2],
          "dspark_markov_rank": 8, "dspark_noise_token_id": 383}
BLOCKS = (2, 3, 4, 5)
# A ragged batch fed in chunks of 13, then two prompts that share the 300-token prompt's first
# 256-token block (a prefix-cache hit: the drafter's rings come from the cache too).
PROMPTS = (45, 3, 300, 20, 1, 9, 77, 33)
NEW_TOKENS = 40
RATE = 0.6


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The reference artifact of the same random model (seed 3) with each block size, and a plain
    model without a drafter."""
    root = tmp_path_factory.mktemp("dspark")
    out = {}
    for b in BLOCKS:
        (root / f"config{b}.json").write_text(json.dumps({**CONFIG, "dspark_block_size": b}))
        assert cli(["make-tiny", "--config", str(root / f"config{b}.json"), "--seed", "3",
                    "--out", str(root / f"model{b}")]) == 0
        assert cli(["compile", "--model", str(root / f"model{b}"), "--target", "reference",
                    "-o", str(root / f"ref{b}")]) == 0
        out[b] = root / f"ref{b}"
    return out


def _prompts():
    rng = np.random.default_rng(11)
    first = [rng.integers(0, CONFIG["vocab_size"], n).tolist() for n in PROMPTS]
    shared = first[2][:270]
    second = [shared + rng.integers(0, CONFIG["vocab_size"], n).tolist() for n in (10, 30)]
    return first, second


def _run(artifact, speculative=None, num_draft_tokens=None, oracle=None):
    """Both batches, one after the other (the second hits the prefix cache the first filled)."""
    engine = Engine(artifact, prefill_chunk=13, max_step_tokens=96, speculative=speculative,
                    num_draft_tokens=num_draft_tokens)
    if oracle is not None:
        oracle(engine)
    rollbacks = _record_rollbacks(engine)
    engine.written = _record_written(engine)
    tokens = []
    for batch in _prompts():
        rids = [engine.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in batch]
        engine.run()
        tokens += [engine.result(r).tokens for r in rids]
    assert engine.prefix_cache.hit_tokens >= 256 * 2
    return engine, tokens, rollbacks


_PLAIN = {}


def _plain(artifact):
    if "run" not in _PLAIN:
        _PLAIN["run"] = _run(artifact)
    return _PLAIN["run"]


def _forced(plain_tokens, rate: float, seed: int):
    """Make the drafter's row logits pick the plain run's next token with probability ``rate``, else
    another, on top of what its own functions computed (they still run on every row)."""
    first, second = _prompts()
    sequences = [p + t for p, t in zip(first + second, plain_tokens)]
    rng = np.random.default_rng(seed)

    def install(engine):
        backend = engine.backend
        draft, markov, block = backend.dspark_draft, backend.dspark_markov, {}

        def recorded_draft(tokens, positions, seq_ids):
            block["positions"], block["seqs"] = positions, seq_ids
            return draft(tokens, positions, seq_ids)

        def forced_markov(prev_tokens, rows):
            bias, confidence = markov(prev_tokens, rows)
            bias = bias.copy()
            for i, row in enumerate(rows):
                sequence = sequences[int(block["seqs"][row])]
                at = int(block["positions"][row]) + 1  # the position row ``row`` proposes a token for
                truth = sequence[at] if at < len(sequence) else 0
                token = truth if rng.random() < rate else (truth + 1) % CONFIG["vocab_size"]
                bias[i, token] += 1e4
            return bias, confidence

        backend.dspark_draft, backend.dspark_markov = recorded_draft, forced_markov
    return install


def _record_written(engine) -> dict[int, list[bytes]]:
    """What each request wrote to the pool, as it was when the request left (finished): the rows
    its fed positions own (windows, compressor rings, closed entries; ``KVPool.position_state``).
    Which slot and envelopes hold them depends on when other requests left, which speculation
    changes; rows a request never wrote hold what an earlier one left there."""
    written, leave = {}, engine.scheduler.leave

    def recorded_leave(rid):
        r = engine.requests[rid]
        written[rid] = [array[index].tobytes() for array, index in engine.pool.position_state(rid, range(r.fed))]
        leave(rid)

    engine.scheduler.leave = recorded_leave
    return written


def _cached(engine) -> dict[bytes, list[bytes]]:
    """The prefix cache's blocks: each one's slot (windows and the rings of overlapping windows,
    the others are not kept at a block's end) and envelope, by its tokens."""
    pool, g, out = engine.pool, engine.pool.geometry, {}
    ratios = {c.layer: c.ratio for c in g.compressed}
    kept = [pool.state[(s.layer, s.stream)] for s in g.states if s.rows != ratios[s.layer]]
    for key, block in engine.prefix_cache.blocks.items():
        lo, hi = pool.slot_rows(block.slot)
        env = slice(block.envelope * g.rows_per_envelope, (block.envelope + 1) * g.rows_per_envelope)
        index = slice(block.envelope * g.index_rows_per_envelope, (block.envelope + 1) * g.index_rows_per_envelope)
        out[key] = ([plane[lo:hi].tobytes() for plane in pool.planes.values()]
                    + [plane[env].tobytes() for plane in pool.planes.values()] + [pool.index_plane[index].tobytes()]
                    + [ring[block.slot].tobytes() for rings in kept for ring in rings])
    return out


@pytest.mark.parametrize("block", BLOCKS)
def test_greedy_dspark_equals_plain_greedy_and_leaves_the_same_pool(artifacts, block):
    plain_engine, plain, _ = _plain(artifacts[5])
    engine, tokens, rolled_back = _run(artifacts[block], "dspark", oracle=_forced(plain, RATE, block))
    assert tokens == plain and all(len(t) == NEW_TOKENS for t in tokens)
    stats = engine.spec_stats
    assert engine.speculation.num_draft_tokens == block
    # Partial accepts at every block position, and whole blocks.
    assert len(stats.accepted_lengths) == block + 1 and all(stats.accepted_lengths), stats.accepted_lengths
    # Rejected drafts closed ratio-4 windows (entries, index entries, the CSA ring's overlap half)
    # and were taken back.
    assert sum((p + 1) % 4 == 0 for p in rolled_back) >= 2
    # The pool holds what a plain run leaves, byte for byte.
    assert engine.written.keys() == plain_engine.written.keys()
    for rid, rows in plain_engine.written.items():
        assert engine.written[rid] == rows, rid
    assert _cached(engine) == _cached(plain_engine) != {}


def test_the_drafters_own_drafts_give_plain_greedy(artifacts):
    _, plain, _ = _plain(artifacts[5])
    engine, tokens, _ = _run(artifacts[4], "dspark", num_draft_tokens=3)
    assert tokens == plain
    assert engine.spec_stats.drafted > 0


def test_generate_dspark_on_the_command_line(artifacts, tmp_path, capsys):
    args = ["generate", str(artifacts[5]), "--token-ids", "5,6,7,8", "--max-new-tokens", "12", "--greedy"]
    assert cli(args) == 0
    plain = capsys.readouterr().out
    for extra in ([], ["--num-draft-tokens", "2"], ["--draft-confidence", "0.3"]):
        assert cli(args + ["--speculative", "dspark", "--stats"] + extra) == 0
        out = capsys.readouterr()
        assert out.out == plain
        assert out.err.count("\n") == 1 and "speculative dspark: acceptance" in out.err
        assert json.loads(out.err.split("steps by drafts accepted ")[1]) is not None
    for bad, why in ((["--num-draft-tokens", "6"], "num_draft_tokens must be in [1, 5]"),
                     (["--draft-confidence", "1.5"], "draft_confidence must be in [0, 1]")):
        assert cli(args + ["--speculative", "dspark"] + bad) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("dsv4c: error: ") and "\n" not in err and why in err
    assert cli(args + ["--draft-confidence", "0.5"]) == 2
    assert "speculative='dspark'" in capsys.readouterr().err
    assert cli(args + ["--speculative", "mtp"]) == 2
    assert "DSpark drafter in place of an MTP layer" in capsys.readouterr().err


def test_a_model_without_a_drafter_is_refused_in_one_line(tmp_path, capsys):
    assert cli(["make-tiny", "--out", str(tmp_path / "model")]) == 0
    assert cli(["compile", "--model", str(tmp_path / "model"), "--target", "reference",
                "-o", str(tmp_path / "ref")]) == 0
    capsys.readouterr()
    with pytest.raises(UsageError, match="has no DSpark drafter"):
        Engine(tmp_path / "ref", speculative="dspark")
    assert cli(["generate", str(tmp_path / "ref"), "--token-ids", "5,6", "--max-new-tokens", "2",
                "--speculative", "dspark"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv4c: error: ") and "\n" not in err and "no DSpark drafter" in err


def test_a_dspark_server_answers_what_generate_does_and_counts_accepted_lengths(artifacts):
    import httpx

    from serving import serving

    prompt = [5, 6, 7, 8]
    plain = Engine(artifacts[5]).generate(prompt, SamplingParams(max_new_tokens=12)).tokens
    args = ("--speculative", "dspark", "--num-draft-tokens", "3", "--served-model-name", "tiny")
    with serving(artifacts[5], *args) as served:
        answer = httpx.post(f"{served.url}/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
        assert answer["choices"][0]["token_ids"] == plain
        m = served.wait_metrics(lambda m: m.get("dsv4c_spec_accepted_length_count", 0) > 0)
        assert m["dsv4c_spec_draft_tokens_total"] >= m["dsv4c_spec_accepted_tokens_total"]
        assert m["dsv4c_spec_accepted_length_sum"] == m["dsv4c_spec_accepted_tokens_total"]
        buckets = [line for line in httpx.get(f"{served.url}/metrics").text.splitlines()
                   if line.startswith("dsv4c_spec_accepted_length_bucket")]
        assert [b.split('"')[1] for b in buckets] == ["0.0", "1.0", "2.0", "3.0", "+Inf"]


def test_sampled_dspark_output_has_the_plain_law(tmp_path, monkeypatch):
    """The drafter's own Markov-corrected law on a 4-token vocabulary (the chi-square test of
    test_speculative_sampling, with a block of 3: the first verify step carries two drafts)."""
    from test_speculative_sampling import BATCH, P_VALUE, _chi2_p_value, _exact_joint, sampled_counts

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 4, "dspark_noise_token_id": 3,
                                                      "dspark_block_size": 3}))
    assert cli(["make-tiny", "--config", str(tmp_path / "config.json"), "--seed", "5",
                "--out", str(tmp_path / "m")]) == 0
    assert cli(["compile", "--model", str(tmp_path / "m"), "--target", "reference",
                "-o", str(tmp_path / "ref")]) == 0
    joint = _exact_joint(tmp_path / "ref")

    def sampled():
        engine = Engine(tmp_path / "ref", max_requests=BATCH, speculative="dspark")
        return sampled_counts(engine, 3), engine.spec_stats

    counts, stats = sampled()
    assert 0.1 * stats.drafted < stats.accepted < 0.9 * stats.drafted and len(stats.accepted_lengths) == 3
    assert _chi2_p_value(counts, joint) > P_VALUE
    from dsv4c.runtime import speculative

    monkeypatch.setattr(speculative, "accept", lambda sampler, logits, draft: (
        draft.tokens + [sampler(logits[len(draft.tokens)])], len(draft.tokens)))
    wrong, _ = sampled()
    assert _chi2_p_value(wrong, joint) < P_VALUE

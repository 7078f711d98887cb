"""DeepSeek-V4.1 against transformers' reference (tests/data/v41_case0/README.md): the reference
artifact's logits and greedy tokens whole, with chunked prefill, one token at a time and in a
ragged batch; every
layer role (sliding, KV sources of ratio 2 and 1, reuse, re-index before and after the candidate
source), both top-k levels, the group's compressed rows and index keys and the Engram layers
against the reference's internals; a prefix-cache hit, a preempted request and speculative
decoding (whose drafts the Engram hash reads too) computing what a plain run computes. The tests
every target passes live in tests/v41_case.py (tests/test_v41_compiled.py runs them on llvm)."""

import numpy as np
import pytest

from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams

from v41_case import CASE, TOKEN_IDS, TOLERANCE
from v41_case import test_a_prefix_cache_hit_is_bit_identical_to_a_miss  # noqa: F401  (run here)
from v41_case import test_a_ragged_batch_matches_the_reference  # noqa: F401
from v41_case import test_logits_and_greedy_tokens_match_the_reference  # noqa: F401
from v41_case import test_preempted_requests_recompute_the_same_tokens  # noqa: F401
from v41_case import test_speculative_decoding_computes_the_plain_tokens  # noqa: F401


@pytest.fixture(scope="module")
def artifact(v41_case_artifacts):
    """The parity case for the reference target, once for the session (a model that sees images:
    text prompts leave its image inputs unused)."""
    return v41_case_artifacts["reference"]


def test_the_artifact_chats_in_v41s_encoding(artifact):
    from dsv4c.runtime.serve.chat import ChatProtocol

    assert ChatProtocol.of(Engine(artifact, max_context=256), None).encoding.name == "V4.1"


def _record(artifact) -> dict[str, np.ndarray]:
    """The whole prompt's per-node values (one step) and the pool's compressed rows and keys."""
    engine = Engine(artifact, max_context=256)
    values = {}

    def hook(node, args, result):
        for out, value in zip(node.outputs, result if isinstance(result, tuple) else (result,)):
            values[out.name] = value

    engine.backend.interpreter.hook = hook
    seq = engine.submit(TOKEN_IDS, SamplingParams(max_new_tokens=2))
    store, pool = engine.backend.interpreter.store, engine.pool
    engine.step()  # the prompt in one step; the request still decodes, so it holds its rows
    for c in pool.geometry.compressed:
        n = len(TOKEN_IDS) // c.ratio
        values[f"rows{c.layer}"] = store.entries(c.layer, "main", seq, n)
        values[f"keys{c.layer}"] = store.entries(c.layer, "index", seq, n)
    return values


def _selected(topk: np.ndarray, rows: int) -> np.ndarray:
    chosen = np.zeros((len(topk), rows), bool)
    for t, picks in enumerate(topk):
        chosen[t, picks[picks >= 0]] = True
    return chosen


def test_every_role_and_both_top_k_levels_match_the_reference_internals(artifact):
    want = np.load(CASE / "internals.npz")
    got = _record(artifact)
    for i in range(8):  # sliding 0, 7; KV sources 1 (ratio 2), 4 (ratio 1); reuse 2, 5; re-index 3, 6
        for ours, theirs in ((f"l{i}.attn_x", "attn_in"), (f"l{i}.attn_out", "attn_out"),
                             (f"l{i}.ffn_x", "moe_in"), (f"l{i}.moe_out", "moe_out")):
            assert np.abs(got[ours] - want[f"L{i}.{theirs}"]).max() < TOLERANCE, (i, theirs)
    for i in (1, 3, 4, 6):  # own keys, re-index, candidate source, re-index inside the candidates
        theirs = want[f"L{i}.topk_selected"]
        assert np.array_equal(_selected(got[f"l{i}.index.topk"], theirs.shape[1]), theirs), i
    assert np.array_equal(got["l4.index.candidates"] == 0, want["L4.candidate_mask"])
    for source in (1, 4):
        assert np.abs(got[f"rows{source}"] - want[f"L{source}.compressed_rows"]).max() < TOLERANCE
        assert np.abs(got[f"keys{source}"] - want[f"L{source}.index_keys"]).max() < TOLERANCE
    assert np.abs(got["h0"] - want["E0.engram_in"]).max() < TOLERANCE
    assert np.abs(got["l0.engram"] - want["E0.engram_out"]).max() < TOLERANCE
    assert np.abs(got["l5.engram"] - want["E1.engram_out"]).max() < TOLERANCE

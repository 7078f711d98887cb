"""The Engram hash (compressed vocabulary, primes, offsets, multipliers, row ids) against what the
transformers DeepSeek-V4.1 reference computed (tests/data/v41_engram/README.md), its exactness
under chunking and rollback, its storage, and its errors."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dsv4c.artifact.engram import EngramTables, NgramHistory
from dsv4c.artifact.safetensors_io import write_safetensors
from dsv4c.errors import ArtifactError, ConfigError, UsageError
from dsv4c.frontend.engram import build_engram_tables, hash_multipliers, hash_primes

pytest.importorskip("tokenizers")

DATA = Path(__file__).parent / "data" / "v41_engram"
CONFIG = json.loads((DATA / "config.json").read_text())
REFERENCE = json.loads((DATA / "engram_hash.json").read_text())
TOKEN_IDS = json.loads((DATA / "case.json").read_text())["token_ids"]


def _fields(**overrides) -> dict:
    fields = dict(vocab_size=CONFIG["vocab_size"], layer_ids=CONFIG["engram_layer_ids"],
                  engram_vocab_size=CONFIG["engram_vocab_size"], max_ngram_size=CONFIG["engram_max_ngram_size"],
                  n_heads=CONFIG["engram_n_heads"], pad_id=CONFIG["engram_pad_id"],
                  compressed_vocab_size=CONFIG["engram_compressed_vocab_size"],
                  num_embeddings=CONFIG["engram_num_embeddings"])
    return fields | overrides


@pytest.fixture(scope="module")
def tables() -> EngramTables:
    return build_engram_tables(DATA, **_fields())


def test_constants_equal_the_reference(tables):
    assert tables.compressed_vocab_size == REFERENCE["compressed_vocab_size"]
    assert tables.token_map.dtype == np.int32
    np.testing.assert_array_equal(tables.token_map, REFERENCE["token_map"])
    assert tables.pad == REFERENCE["pad_id_compressed"]
    np.testing.assert_array_equal(tables.primes, REFERENCE["primes"])
    np.testing.assert_array_equal(tables.offsets, REFERENCE["offsets"])
    np.testing.assert_array_equal(tables.multipliers, np.array(REFERENCE["multipliers"], np.int64))
    assert list(tables.rows_per_layer) == CONFIG["engram_num_embeddings"]
    assert (tables.max_ngram_size, tables.n_heads) == (4, 2)


def test_row_ids_equal_the_reference(tables):
    compressed = tables.compress(TOKEN_IDS)
    rows = tables.row_ids(compressed, 0, np.arange(len(TOKEN_IDS)))
    assert rows.dtype == np.int64 and rows.shape == (len(TOKEN_IDS), 2, 6)
    np.testing.assert_array_equal(rows, REFERENCE["hash_ids"])


def test_the_sequence_start_reads_pad(tables):
    """Position p's look-backs beyond the start read the pad's compressed id: the first token's
    n-grams are those of [pad, pad, pad, t0]."""
    compressed = tables.compress(TOKEN_IDS[:1])
    padded = np.array([tables.pad] * 3 + [int(compressed[0])], np.int64)
    np.testing.assert_array_equal(tables.row_ids(compressed, 0, [0]), tables.row_ids(padded, 0, [3]))


@pytest.mark.parametrize("chunks", [[1] * 56, [5, 3, 7, 1, 2, 38], [29] + [1] * 27, [3, 53]])
def test_chunked_hashing_equals_the_whole_sequence(tables, chunks):
    history, pieces, start = NgramHistory(tables), [], 0
    for size in chunks:
        history.append(start, TOKEN_IDS[start:start + size])
        pieces.append(history.row_ids(np.arange(start, start + size)))
        start += size
    np.testing.assert_array_equal(np.concatenate(pieces), REFERENCE["hash_ids"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunking_of_a_long_sequence_equals_the_whole(tables, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG["vocab_size"], 600)
    whole = NgramHistory(tables)
    whole.append(0, tokens)
    expected = whole.row_ids(np.arange(len(tokens)))
    history, pieces, start = NgramHistory(tables), [], 0
    while start < len(tokens):
        size = int(rng.integers(1, 40))
        history.append(start, tokens[start:start + size])
        pieces.append(history.row_ids(np.arange(start, min(start + size, len(tokens)))))
        start += size
    np.testing.assert_array_equal(np.concatenate(pieces), expected)
    assert expected.min() >= 0 and (expected < np.array(tables.rows_per_layer)[None, :, None]).all()


def test_a_step_needs_only_the_last_n_max_minus_1_ids(tables):
    compressed = tables.compress(TOKEN_IDS)
    window = compressed[40 - 3:]
    np.testing.assert_array_equal(tables.row_ids(window, 37, np.arange(40, 56)), np.array(REFERENCE["hash_ids"])[40:])
    with pytest.raises(ValueError, match="not all in the context"):
        tables.row_ids(compressed[38:], 38, [40])


def test_truncation_rolls_back_exactly(tables):
    """A speculative rollback (truncate, then append the accepted tokens) or an overwrite in
    place leaves the history as if only the final sequence had ever been appended."""
    rng = np.random.default_rng(1)
    history = NgramHistory(tables)
    history.append(0, TOKEN_IDS[:30])
    history.append(30, rng.integers(0, CONFIG["vocab_size"], 5))  # rejected drafts
    history.truncate(31)
    history.append(31, TOKEN_IDS[31:40])
    history.append(30, TOKEN_IDS[30:45])  # rewrites 30.. and drops the rest
    history.append(45, TOKEN_IDS[45:])
    assert len(history) == len(TOKEN_IDS)
    np.testing.assert_array_equal(history.row_ids(np.arange(56)), REFERENCE["hash_ids"])
    history.truncate(10)
    assert len(history) == 10
    with pytest.raises(ValueError, match="gap-free"):
        history.append(11, [5])
    with pytest.raises(ValueError):
        history.truncate(11)
    with pytest.raises(ValueError, match="not all in the context"):
        history.row_ids([10])


def test_token_ids_outside_the_vocabulary_are_refused(tables):
    with pytest.raises(UsageError, match=r"token id 300 is outside the vocabulary \[0, 300\)"):
        tables.compress([5, 300])
    with pytest.raises(UsageError, match="token id -1"):
        NgramHistory(tables).append(0, [-1])


def test_model_ids_past_the_tokenizer_map_to_pad(tables):
    """The released model has more embedding rows than tokenizer tokens; the extra ids read as pad."""
    wider = build_engram_tables(DATA, **_fields(vocab_size=320))
    np.testing.assert_array_equal(wider.token_map[:300], tables.token_map)
    assert (wider.token_map[300:] == tables.pad).all()
    narrower = build_engram_tables(DATA, **_fields(vocab_size=290))  # the size check counts every token
    np.testing.assert_array_equal(narrower.token_map, tables.token_map[:290])


def test_save_and_load_round_trip(tables, tmp_path):
    path = tmp_path / "engram.safetensors"
    tables.save(path)
    loaded = EngramTables.load(path)
    for name in ("token_map", "primes", "multipliers"):
        got, want = getattr(loaded, name), getattr(tables, name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert (loaded.layer_ids, loaded.compressed_vocab_size, loaded.pad) == (tables.layer_ids, 254, tables.pad)
    np.testing.assert_array_equal(loaded.row_ids(loaded.compress(TOKEN_IDS), 0, np.arange(56)), REFERENCE["hash_ids"])


def test_load_refuses_other_files(tables, tmp_path):
    other = tmp_path / "weights.safetensors"
    write_safetensors(other, {"w": ("F32", np.zeros(3, np.float32))})
    with pytest.raises(ArtifactError, match="not an Engram hash file"):
        EngramTables.load(other)
    with pytest.raises(ArtifactError, match="cannot open"):
        EngramTables.load(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    arrays = {"token_map": ("I32", tables.token_map), "layer_ids": ("I64", np.array([0, 5], np.int64)),
              "primes": ("I64", tables.primes), "multipliers": ("I64", tables.multipliers[:, :3])}
    write_safetensors(bad, arrays, metadata={"compressed_vocab_size": "254", "pad": "2"})
    with pytest.raises(ArtifactError, match="do not fit 2 layers"):
        EngramTables.load(bad)


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_compressed_vocabulary_size_mismatch_is_a_config_error():
    expected = "yields 254 compressed Engram ids but engram_compressed_vocab_size is 99092"
    with pytest.raises(ConfigError, match=expected) as error:
        build_engram_tables(DATA, **_fields(compressed_vocab_size=99092))
    _one_line(error)


def test_a_missing_tokenizer_is_a_config_error(tmp_path):
    shutil.copy(DATA / "config.json", tmp_path)
    with pytest.raises(ConfigError, match="no tokenizer.json; a model with Engram layers needs") as error:
        build_engram_tables(tmp_path, **_fields())
    _one_line(error)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable tokenizer") as error:
        build_engram_tables(tmp_path, **_fields())
    _one_line(error)


def test_tables_too_small_for_the_hash_are_a_config_error():
    with pytest.raises(ConfigError, match="layer 5's table has 461 rows but the Engram hash addresses 462") as error:
        build_engram_tables(DATA, **_fields(num_embeddings=[304, 461]))
    _one_line(error)
    with pytest.raises(ConfigError, match=r"engram_num_embeddings is \[304\]"):
        build_engram_tables(DATA, **_fields(num_embeddings=[304]))
    assert build_engram_tables(DATA, **_fields(num_embeddings=[400, 462])).rows_per_layer == (304, 462)
    with pytest.raises(ConfigError, match="engram_pad_id 300"):
        build_engram_tables(DATA, **_fields(pad_id=300))


def test_released_table_sizes():
    """DeepSeek-V4.1-Flash: engram_vocab_size 16000000, 8 heads, n-grams 2..4, Engram at layers 1
    and 14; each layer's primes sum to its released engram_num_embeddings."""
    primes = hash_primes(2, 16_000_000, 4, 8)
    assert primes.sum(axis=(1, 2)).tolist() == [384_006_168, 384_016_682]
    assert len(set(primes.ravel().tolist())) == 48 and primes.min() > 16_000_000 - 1
    multipliers = hash_multipliers([1, 14], 4, 99_092)
    assert multipliers.shape == (2, 4) and (multipliers % 2 == 1).all()
    assert (multipliers <= np.iinfo(np.int64).max // 99_092).all()  # t * m cannot overflow for t < 99092


def test_primes_follow_the_documented_order():
    """Each n-gram size restarts the search above engram_vocab_size - 1 and skips primes taken earlier."""
    np.testing.assert_array_equal(hash_primes(2, 40, 4, 2), [[[41, 43], [47, 53], [59, 61]],
                                                             [[67, 71], [73, 79], [83, 89]]])
    assert hash_primes(1, 2, 2, 3).tolist() == [[[2, 3, 5]]]

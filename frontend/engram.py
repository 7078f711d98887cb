"""The Engram hash constants of a DeepSeek-V4.1 model, computed at compile time from its config
and tokenizer (what they mean and how the runtime uses them: :mod:`dsv4c.artifact.engram`).

* The compressed vocabulary: each token id of the tokenizer is decoded alone; its key is the
  decoded text after a fixed Unicode normalisation (NFKC, NFD, accents stripped, lower case,
  runs of blanks collapsed to one space, trimmed; a text that is one space stays one space, and
  one that normalises to nothing keys as itself), or the token's raw vocabulary string when the
  decoded text holds U+FFFD (a token that is part of a UTF-8 sequence). Compressed ids number
  the distinct keys in order of first appearance over token ids 0, 1, 2, ...; their count must
  equal the config's ``engram_compressed_vocab_size``, which the checkpoint's tables were
  trained with.
* Primes: for each Engram layer in config order and each n-gram size 2 .. n_max, the search
  restarts above ``engram_vocab_size - 1`` and takes the next ``n_heads`` primes that no earlier
  (layer, size) took.
* Multipliers: for the decoder layer ``l`` (its id, not its Engram ordinal), ``n_max`` draws of
  ``numpy.random.default_rng(10007 * l).integers(0, bound, dtype=int64)`` with ``bound = max(1,
  (2**63 - 1) // compressed_vocab_size // 2)``, each made odd as ``2 * draw + 1``.

Reading the tokenizer needs the ``tokenizers`` package (``pip install dsv4c[tokenizer]``); the
runtime never does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsv4c.artifact.engram import EngramTables
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.file_names import TOKENIZER
from dsv4c.errors import ConfigError, UsageError

_MULTIPLIER_SEED_STRIDE = 10007
_BLANK = "\ue000"  # a private-use character that stands for a lone space while Strip runs


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _BLANK),  # a text that is exactly one space keeps it
        normalizers.Strip(),
        normalizers.Replace(_BLANK, " "),
    ])


def _load_tokenizer(model_dir: Path):
    path = model_dir / TOKENIZER
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no {TOKENIZER}; a model with Engram layers needs its tokenizer "
                          "to derive the compressed vocabulary")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("compiling a model with Engram layers reads its tokenizer with the `tokenizers` package: "
                         "pip install 'dsv4c[tokenizer]'") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for malformed files
        raise ConfigError(f"{path}: not a readable tokenizer ({str(error).splitlines()[0]})") from None


def compressed_token_map(model_dir: str | Path) -> tuple[np.ndarray, int]:
    """The compressed id (int32) of every token id of the model directory's tokenizer, added
    tokens included, and the number of distinct compressed ids."""
    tokenizer = _load_tokenizer(Path(model_dir))
    normalize = _normalizer().normalize_str
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[t] for t in range(size)], skip_special_tokens=False)
    compressed: dict[str, int] = {}
    token_map = np.empty(size, np.int32)
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalize(text) or text
        token_map[token_id] = compressed.setdefault(key, len(compressed))
    return token_map, len(compressed)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin: these bases decide every n below 3.3e24."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def hash_primes(n_layers: int, engram_vocab_size: int, max_ngram_size: int, n_heads: int) -> np.ndarray:
    """``[n_layers, max_ngram_size - 1, n_heads]`` int64: each hash head's modulus, all distinct
    (see the module docstring for the order they are taken in)."""
    taken: set[int] = set()
    primes = np.empty((n_layers, max_ngram_size - 1, n_heads), np.int64)
    for layer in range(n_layers):
        for size in range(max_ngram_size - 1):
            current = engram_vocab_size - 1
            for head in range(n_heads):
                current += 1
                while current in taken or not _is_prime(current):
                    current += 1
                taken.add(current)
                primes[layer, size, head] = current
    return primes


def hash_multipliers(layer_ids, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """``[len(layer_ids), max_ngram_size]`` int64, odd: one per look-back distance per layer."""
    bound = max(1, np.iinfo(np.int64).max // compressed_vocab_size // 2)
    rows = [np.random.default_rng(_MULTIPLIER_SEED_STRIDE * layer).integers(0, bound, size=max_ngram_size,
                                                                             dtype=np.int64)
            for layer in layer_ids]
    return np.asarray(rows, np.int64).reshape(len(layer_ids), max_ngram_size) * 2 + 1


def build_engram_tables(model_dir: str | Path, *, vocab_size: int, layer_ids, engram_vocab_size: int,
                        max_ngram_size: int, n_heads: int, pad_id: int, compressed_vocab_size: int,
                        num_embeddings) -> EngramTables:
    """The Engram hash record of the model in ``model_dir`` (its config's ``engram_*`` fields as
    keywords; ``vocab_size`` is the model's, i.e. its embedding rows).

    Token ids at or above the tokenizer's size (the released model has more embedding rows than
    tokens) map to the pad's compressed id: no such token occurred in training, so no row is
    right for it; pad is what the tables were trained to read as "no token here", it keeps every
    compressed id inside the range the multipliers were bounded for, and a model whose sampler
    picks such an id keeps running instead of failing the request. Refusing at compile time
    would reject the released checkpoint.

    ``num_embeddings`` (the tables' rows per Engram layer) must cover every row the hash can
    address; more rows than that are allowed (they are never read).
    """
    layer_ids = tuple(int(i) for i in layer_ids)
    if len(set(layer_ids)) != len(layer_ids) or min(layer_ids, default=0) < 0:
        raise ConfigError(f"engram_layer_ids {list(layer_ids)} must be distinct layer ids")
    if max_ngram_size < 2 or n_heads < 1 or engram_vocab_size < 1:
        raise ConfigError(f"engram_max_ngram_size {max_ngram_size}, engram_n_heads {n_heads} and engram_vocab_size "
                          f"{engram_vocab_size} must be at least 2, 1 and 1")
    token_map, derived_size = compressed_token_map(model_dir)
    if derived_size != compressed_vocab_size:
        raise ConfigError(f"{model_dir}: the tokenizer yields {derived_size} compressed Engram ids but "
                          f"engram_compressed_vocab_size is {compressed_vocab_size}; this tokenizer is not the one "
                          "the Engram tables were trained with")
    if not 0 <= pad_id < len(token_map):
        raise ConfigError(f"engram_pad_id {pad_id} is not a token of the {len(token_map)}-token tokenizer")
    pad = int(token_map[pad_id])
    model_map = np.full(vocab_size, pad, np.int32)
    shared = min(vocab_size, len(token_map))
    model_map[:shared] = token_map[:shared]
    tables = EngramTables(token_map=model_map, layer_ids=layer_ids,
                          primes=hash_primes(len(layer_ids), engram_vocab_size, max_ngram_size, n_heads),
                          multipliers=hash_multipliers(layer_ids, max_ngram_size, compressed_vocab_size),
                          compressed_vocab_size=compressed_vocab_size, pad=pad)
    rows = list(num_embeddings)
    short = [(layer, have, need) for layer, have, need in zip(layer_ids, rows, tables.rows_per_layer) if have < need]
    if len(rows) != len(layer_ids) or short:
        layer, have, need = short[0] if short else (None, rows, list(tables.rows_per_layer))
        where = f"layer {layer}'s table has {have} rows" if short else f"engram_num_embeddings is {have}"
        raise ConfigError(f"{where} but the Engram hash addresses {need}; engram_num_embeddings must be the sum "
                          "of each layer's primes")
    return tables


def engram_tables(cfg: ModelConfig, model_dir: str | Path) -> EngramTables:
    """The Engram hash record of ``cfg`` (a model with Engram layers) and its tokenizer in ``model_dir``."""
    e = cfg.engram
    return build_engram_tables(model_dir, vocab_size=cfg.vocab_size, layer_ids=e.layer_ids,
                               engram_vocab_size=e.vocab_size, max_ngram_size=e.max_ngram_size, n_heads=e.n_heads,
                               pad_id=e.pad_id, compressed_vocab_size=e.compressed_vocab_size,
                               num_embeddings=e.num_embeddings)

"""The byte-level tokenizer ``dsv4c make-tiny`` writes beside a random model that needs one (a
V4.1 model's Engram compressed vocabulary is derived from its tokenizer at compile time): the
three special tokens BOS, EOS and pad at ids 0, 1 and 2, then one token per byte and no merges,
so every text encodes and the vocabulary is the same on every machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4c.artifact.file_names import TOKENIZER, TOKENIZER_CONFIG
from dsv4c.errors import ConfigError, UsageError

SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
BYTE_TOKENIZER_SIZE = len(SPECIAL_TOKENS) + 256


def _byte_level_chars() -> list[str]:
    """The character the byte-level pre-tokenizer writes for each byte value 0 .. 255: printable
    Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def write_byte_tokenizer(model_dir: str | Path, vocab_size: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``model_dir`` for a model of
    ``vocab_size`` embedding rows (at least :data:`BYTE_TOKENIZER_SIZE`)."""
    if vocab_size < BYTE_TOKENIZER_SIZE:
        raise ConfigError(f"a byte-level tokenizer needs {BYTE_TOKENIZER_SIZE} token ids; the model has "
                          f"vocab_size {vocab_size}")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise UsageError("writing a tokenizer needs the `tokenizers` package: pip install 'dsv4c[tokenizer]'") from None
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + byte for byte, char in enumerate(_byte_level_chars())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    out = Path(model_dir)
    (out / TOKENIZER).write_text(tok.to_str())
    (out / TOKENIZER_CONFIG).write_text(json.dumps({"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1],
                                                    "pad_token": SPECIAL_TOKENS[2]}, ensure_ascii=False))

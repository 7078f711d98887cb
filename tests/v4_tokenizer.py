"""A byte-level BPE tokenizer with DeepSeek-V4's special tokens, for models that have none (the
tiny model in the chat tests, the flash slice in ``bench/constrained.py``): V4's encoding and its
grammars need those tokens in the vocabulary."""

import json
from pathlib import Path

SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"]
THINK_TAGS = ["<think>", "</think>"]  # added tokens that decode as text, as in DeepSeek's tokenizers
THINK_END_ID = len(SPECIAL) + 1


def write_v4_tokenizer(model: Path, corpus: list[str], vocab_size: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``model``: BOS id 0, EOS id 1, the think
    tags next, then the 256 bytes and merges learnt from ``corpus`` up to ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + THINK_TAGS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in SPECIAL
    (model / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIAL[0], "eos_token": SPECIAL[1]}))

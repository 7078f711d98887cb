"""The name of every file of an artifact directory (docs/artifact.md lists what each holds).
The C++ host spells the ones it opens itself (``manifest.json``); every other name it reads
from the manifest."""

from __future__ import annotations

MANIFEST = "manifest.json"  # written last; names every other file
PROGRAM = "program.json"  # the IR program after the passes
LIBRARY = "model.so"  # the compiled step (compiled targets)
CONSTANTS = "constants.safetensors"  # the compiled step's constant tensors (compiled targets)
WEIGHTS = "weights.safetensors"  # the weights when one file holds them all
WEIGHTS_INDEX = "weights.safetensors.index.json"  # which weight file holds which tensor
TOKENIZER = "tokenizer.json"  # copied from the model directory when it has one
TOKENIZER_CONFIG = "tokenizer_config.json"  # likewise; its chat_template serves chat requests
COPIED_FROM_MODEL = (TOKENIZER, TOKENIZER_CONFIG)
ENGRAM_HASH = "engram_hash.safetensors"  # a V4.1 model's Engram hash constants (artifact.engram.EngramTables)


def engram_table_file(layer: int) -> str:
    """The file of decoder layer ``layer``'s Engram table (``artifact.engram_tables``)."""
    return f"engram-table-{layer}.safetensors"


def rank_prefix(rank: int, ranks: int) -> str:
    """What rank ``rank``'s weight files and index start with in an artifact of ``ranks`` ranks."""
    return f"rank{rank}-" if ranks > 1 else ""


def weight_files(count: int, prefix: str = "") -> list[str]:
    """:data:`WEIGHTS` when one file holds every weight, else ``weights-00001-of-0000N.safetensors``
    ... (the Hugging Face convention); a rank's of a multi-rank artifact start with ``prefix``."""
    if count == 1:
        return [prefix + WEIGHTS]
    return [f"{prefix}weights-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

"""Random models of any size: deterministic weights for a config's inventory, streamed a piece at
a time (``dsv4c make-tiny``, tests, benchmarks), for ``checkpoint_writer.write_checkpoint`` to store."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from dsv4c.artifact.model_config import ModelConfig
from dsv4c.frontend.checkpoint_writer import row_pieces
from dsv4c.frontend.tensor_inventory import INDEX, inventory


def iter_random_weights(cfg: ModelConfig, seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """Deterministic random weights with activations of sensible size, as a stream of
    ``(official name, fp32 rows)`` pieces in inventory order (what :func:`write_checkpoint`
    takes), one piece in memory at a time. numpy draws the same numbers in pieces as at once,
    so the values do not depend on the piece size.

    Projections are scaled by 1/sqrt(fan_in) so every layer keeps unit-size activations;
    the mHC, sink and compressor-gate parameters get enough spread that routing, top-k and
    pooling are not degenerate (and index scores rarely tie)."""
    rng = np.random.default_rng(seed)
    for spec in inventory(cfg):
        name, shape = spec.name, spec.shape
        for start, stop in row_pieces(shape):
            piece = (stop - start, *shape[1:])
            if spec.kind == INDEX:
                # Distinct experts per token, as the released tables have.
                yield name, np.argsort(rng.random((piece[0], cfg.n_routed_experts)), axis=1)[:, :shape[1]].astype(np.int64)
                continue
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * rng.standard_normal(piece)
            elif name.endswith(("_scale",)):
                value = 0.5 + 0.1 * rng.standard_normal(piece)
            elif name.endswith(("_base", "attn_sink", "gate.bias")):
                value = 0.5 * rng.standard_normal(piece)
            elif name.endswith(".ape"):
                value = 0.5 * rng.standard_normal(piece)
            elif name.endswith("_fn"):
                value = rng.standard_normal(piece) / np.sqrt(shape[1])
            elif name == "embed.weight":
                value = rng.standard_normal(piece)
            else:
                value = rng.standard_normal(piece) / np.sqrt(shape[-1])
            yield name, value.astype(np.float32)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """:func:`iter_random_weights` as whole tensors in memory (official names), for small models."""
    pieces: dict[str, list[np.ndarray]] = {}
    for name, rows in iter_random_weights(cfg, seed):
        pieces.setdefault(name, []).append(rows)
    return {name: np.concatenate(parts) for name, parts in pieces.items()}

"""What the engine asks of a backend: run a step on its KV pool and say what else it can do.

A backend runs an artifact's step (the IR interpreter, a compiled library, several ranks of one)
on the engine's :class:`~dsv4c.runtime.kv_pool.KVPool`. The capabilities below are declared
here, each with its default, so the engine reads them as attributes of every backend rather
than probing for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from dsv4c.errors import UsageError


class Backend(ABC):
    # Whether the pool is the KVPool's own arrays in host memory (false: a device copy, which the
    # prefix cache cannot share rows of yet).
    on_host: bool = True
    # Whether the model's MTP layer can run (:meth:`draft`): speculative decoding with mtp needs it.
    has_mtp: bool = False
    # Whether the model's DSpark block drafter can run (:meth:`dspark_draft`, :meth:`dspark_markov`):
    # speculative decoding with dspark needs it.
    has_dspark: bool = False
    # Whether speculative decoding saves and restores pool rows with :meth:`save_rows` /
    # :meth:`restore_rows` (the pool lives on a device) rather than in the KVPool's arrays.
    device_rows: bool = False
    # Whether the artifact's vision tower can run (:meth:`encode_image`): a V4.1 model compiled
    # with its vision_config (docs/vision.md).
    has_vision: bool = False

    @abstractmethod
    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
             logit_rows: np.ndarray | None = None, engram_rows: np.ndarray | None = None,
             images: StepImages | None = None) -> np.ndarray:
        """Run one step; the logits of ``logit_rows`` (token indices; default every token).
        ``engram_rows``: the Engram table rows of every token ``[T, L_e, C]``, for a model with
        Engram layers. ``images``: the image rows the step's tokens take, for a model that sees
        images (None: no token of the step is in an image span)."""

    def draft(self, next_tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, stream_rows: np.ndarray,
              logit_rows: np.ndarray | None = None, chain: bool = False) -> np.ndarray:
        """The MTP layer's draft logits (backends with ``has_mtp``)."""
        raise NotImplementedError(f"{type(self).__name__} has no MTP layer")

    def dspark_draft(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray) -> np.ndarray:
        """Base logits [T, V] of a block call (every row); keeps its head hidden rows y for
        :meth:`dspark_markov` (backends with ``has_dspark``)."""
        raise NotImplementedError(f"{type(self).__name__} has no DSpark drafter")

    def dspark_markov(self, prev_tokens: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """For rows ``rows`` of the last :meth:`dspark_draft`: the Markov bias [R, V] from each row's
        previous token, and the confidence logits [R] (None: the drafter has no confidence head)."""
        raise NotImplementedError(f"{type(self).__name__} has no DSpark drafter")

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        """One image's span rows ``[token_count, text_hidden]`` from its pixels (backends with
        ``has_vision``; ``artifact.vision`` says what the pixels are)."""
        raise UsageError("this artifact has no vision tower (its model has no vision_config, or its target runs "
                         "none); images need one")

    def check_pool_functions(self) -> None:
        """Refuse an artifact that cannot save and restore pool rows (backends with ``device_rows``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its pool rows on the host")

    def save_rows(self, state: list):
        """A copy of the rows of a ``KVPool.position_state``, for :meth:`restore_rows` (``device_rows``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its pool rows on the host")

    def restore_rows(self, saved) -> None:
        """Rows saved by :meth:`save_rows` put back (``device_rows``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its pool rows on the host")

    def close(self) -> None:
        """Release what outlives the engine's own memory (other ranks' processes); nothing by default."""


class StepImages(NamedTuple):
    """A step's image inputs (the compiled step's ``image_rows`` and ``image_index``): token t
    takes row ``index[t]`` of ``rows`` ``[I, hidden]`` in place of its embedding where that is
    >= 0 (-1: a text token)."""

    rows: np.ndarray
    index: np.ndarray

"""Image spans in requests (docs/vision_text.md): checking a request's spans, their rows (each
image encoded once by the backend's ``encode_image``, kept by digest) and a step's image inputs."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from dsv4c.artifact.model_config import ModelConfig
from dsv4c.errors import UsageError
from dsv4c.runtime.backend import StepImages
from dsv4c.runtime.request import ImageSpan, Request

# Images whose rows the engine keeps after their requests have fed them (a later turn with the
# same image finds them); the rows of spans a request still prefills are kept however many.
KEPT_IMAGES = 16


def check_spans(images: Sequence[ImageSpan] | None, prompt: list[int], cfg: ModelConfig) -> tuple[ImageSpan, ...]:
    """``images`` in prompt order, or the ``UsageError`` that refuses them: a model without image
    spans, a span outside the prompt or over another, a span position that is not the model's
    image token, rows of the wrong shape, neither pixels nor rows."""
    if not images:
        return ()
    if cfg.image_token_id is None:
        raise UsageError("this model does not take images (its config has no vision tower); send text only")
    spans = sorted(images, key=lambda s: s.start)
    end = 0
    for s in spans:
        if not isinstance(s, ImageSpan):
            raise UsageError(f"an image must be an ImageSpan, got {type(s).__name__}")
        if s.token_count < 1 or s.start < end or s.end > len(prompt):
            raise UsageError(f"image span {s.start}..{s.end - 1} is empty, overlaps another or lies outside the "
                             f"prompt's {len(prompt)} tokens")
        if any(prompt[p] != cfg.image_token_id for p in range(s.start, s.end)):
            raise UsageError(f"image span {s.start}..{s.end - 1} holds tokens other than the image token "
                             f"{cfg.image_token_id}")
        if s.rows is not None and np.shape(s.rows) != (s.token_count, cfg.hidden_size):
            raise UsageError(f"image span {s.start}..{s.end - 1}: rows of shape {np.shape(s.rows)}, want "
                             f"({s.token_count}, {cfg.hidden_size})")
        if s.rows is None and s.pixels is None:
            raise UsageError(f"image span {s.start}..{s.end - 1} has neither pixels nor rows")
        end = s.end
    return tuple(spans)


def dead_spans(r: Request) -> tuple[tuple[int, int], ...]:
    """The positions of ``r`` the Engram hash marks DEAD: its image spans."""
    return tuple((s.start, s.end) for s in r.images)


class ImageRows:
    """The rows of each image by digest: encoded once (``encode``: the backend's
    ``encode_image``), kept while a request prefills its span and for the last
    :data:`KEPT_IMAGES` images after."""

    def __init__(self, encode: Callable[[np.ndarray], np.ndarray], hidden_size: int):
        self.encode, self.hidden_size = encode, hidden_size
        self._rows: OrderedDict[str, np.ndarray] = OrderedDict()  # least recently used first
        self.encoded = 0  # images encode_image ran on

    def of(self, span: ImageSpan) -> np.ndarray:
        """The span's rows ``[token_count, hidden]`` (float32)."""
        if span.rows is not None:
            return np.asarray(span.rows, np.float32)
        rows = self._rows.get(span.digest)
        if rows is None:
            rows = np.asarray(self.encode(span.pixels), np.float32)
            self.encoded += 1
            if rows.shape != (span.token_count, self.hidden_size):
                raise UsageError(f"image {span.digest[:12]}: encode_image made rows of shape {rows.shape}, the span "
                                 f"takes ({span.token_count}, {self.hidden_size}); the processor and the artifact "
                                 "disagree on the image's token count")
            self._rows[span.digest] = rows
        self._rows.move_to_end(span.digest)
        return rows

    def keep_only(self, live: set[str]) -> None:
        """Forget the least recently used rows beyond :data:`KEPT_IMAGES` that no digest of ``live``
        (the images of requests still prefilling) names."""
        for digest in [d for d in self._rows if d not in live][:max(0, len(self._rows) - KEPT_IMAGES)]:
            del self._rows[digest]


def step_images(parts: list[tuple[Request, int, int]], rows: ImageRows, tokens: int) -> StepImages | None:
    """The image inputs of a step of ``tokens`` tokens that feeds, per ``(request, first position,
    count)`` of ``parts`` in step order, those positions; None when none is in an image span."""
    index, pieces, taken, offset = np.full(tokens, -1, np.int32), [], 0, 0
    for r, first, n in parts:
        for s in r.images:
            a, b = max(s.start, first), min(s.end, first + n)
            if a < b:
                index[offset + a - first:offset + b - first] = np.arange(taken, taken + b - a)
                pieces.append(rows.of(s)[a - s.start:b - s.start])
                taken += b - a
        offset += n
    return StepImages(np.concatenate(pieces), index) if pieces else None

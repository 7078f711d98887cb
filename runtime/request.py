"""A request as the engine runs it, and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dsv4c.runtime.drafter import Draft
from dsv4c.runtime.sampling import Sampler, SamplingParams, TokenLogprob, token_logprob
from dsv4c.runtime.speculative import SpecStats

TokenCallback = Callable[[int, int], None]  # (request id, token id)


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """An image in a prompt (a model that sees images, docs/vision_text.md): prompt positions
    ``start .. start + token_count - 1`` hold the model's image token and take the rows the
    artifact's ``encode_image`` makes of ``pixels`` (the processor's array). ``digest`` (the
    processor's hash of the pixels) names the image: the engine encodes it once and the prefix
    cache keys the span's positions on it. ``rows`` ``[token_count, hidden]``: rows made
    elsewhere, used as they are instead of encoding ``pixels`` (tests, or a host that ran the
    tower itself)."""

    start: int
    pixels: np.ndarray | None
    token_count: int
    digest: str
    rows: np.ndarray | None = None

    @property
    def end(self) -> int:
        return self.start + self.token_count


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    on_token: TokenCallback | None = None
    record_logits: bool = False
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # tokens of prompt + generated already run through the model
    logits: list[np.ndarray] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of generated tokens, when asked for
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # the first has none
    done_sampling: bool = False
    finished: bool = False
    failure: Exception | None = None  # what ended it early (the engine and other requests go on)
    draft: Draft = field(default_factory=Draft)
    spec: SpecStats = field(default_factory=SpecStats)
    images: tuple[ImageSpan, ...] = ()  # in prompt order, never overlapping
    cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache

    def __post_init__(self):
        self.sampler = Sampler(self.params)

    @property
    def decoding(self) -> bool:
        """All but the last token of the sequence are fed: the next step feeds one (and drafts)."""
        return self.fed == len(self.prompt) + len(self.generated) - 1

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def wants_every_row(self) -> bool:
        """Whether the next step returns the logits of every position it feeds this request, not
        only of the one that completes its sequence."""
        return (self.record_logits or bool(self.draft.tokens)
                or (self.params.prompt_logprobs is not None and self.fed < len(self.prompt)))

    def take(self, token: int, logits: np.ndarray) -> None:
        """``token`` generated, drawn from ``logits``."""
        self.generated.append(token)
        if self.params.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, self.params.logprobs))
        if self.on_token:
            self.on_token(self.rid, token)
        if len(self.generated) >= self.params.max_new_tokens or token in self.params.stop_token_ids:
            self.done_sampling = True


@dataclass
class Result:
    tokens: list[int]
    logits: np.ndarray | None  # [prompt_len + len(tokens), vocab] when recorded
    speculative: dict | None = None  # SpecStats.to_json() when the engine speculates
    logprobs: list[TokenLogprob] | None = None  # per generated token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, when params.prompt_logprobs is set
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not run through the model)


class RequestFailed(RuntimeError):
    """A request ended by an error of its own (its ``on_token`` callback raised, ...): the engine
    and its other requests went on."""

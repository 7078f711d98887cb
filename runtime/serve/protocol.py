"""OpenAI request bodies, checked field by field, and the response shapes of the two endpoints.

Every problem with a request is an :class:`APIError` whose one-line message names the field;
nothing a client sends gets past here as an unexpected type.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from dsv4c.runtime.sampling import MAX_LOGPROBS, TokenLogprob


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


# Options that change what is generated and that this server does not implement: accepted at the
# value that leaves the output as it is (or null), refused by name otherwise.
NEUTRAL = {
    "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": "", "tools": [],
    "tool_choice": "none", "functions": [], "function_call": "none", "response_format": {"type": "text"},
}
# Options that only describe a request; accepted and ignored.
LABELS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Chat options of the conversation protocol, checked by runtime.serve.chat (tools, tool_choice and
# response_format are no longer neutral there).
CHAT_PROTOCOL = {"tools", "tool_choice", "response_format", "chat_template_kwargs", "reasoning_effort",
                 "add_generation_prompt"}
# The most choices one request may ask for (prompts x n): each is a request in the engine.
MAX_CHOICES = 128


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int | None  # None: as many as the context leaves
    temperature: float
    top_p: float
    seed: int | None  # None: a fresh seed per request
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool  # vLLM's extension: generate past EOS, up to max_tokens (benchmarks, tests)
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k most likely alternatives
    echo: bool = False  # completions: the prompt comes first in the text (and its tokens in logprobs)
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: the usage so far in every chunk


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body nests arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if b"\\u" in raw:  # JSON escapes can spell a lone surrogate, which no text encoding can carry
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise bad_request("the request body holds a lone UTF-16 surrogate (like \\udcff): not text",
                              code="invalid_json") from None
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite number, as a float too (a 400-digit integer is not one)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _is_token_ids(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def check_token_ids(ids: list[int], vocab_size: int, name: str, param: str) -> list[int]:
    """``ids`` when every one is in the vocabulary; else a 400 naming the first that is not by its
    position (``name[i]``), before anything decodes or embeds it."""
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        at = next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise bad_request(f"{name}[{at}] = {_show(ids[at])} is outside the vocabulary: token ids must be in "
                          f"[0, {vocab_size})", param)
    return ids


def _show(v) -> str:
    try:
        text = json.dumps(v)
    except (ValueError, RecursionError):  # an integer too long to print, or nesting too deep
        text = f"a {type(v).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Spec:
    """What one request field accepts, once for its check and its documentation: ``check`` decides,
    ``expected`` says it in the 400, ``schema`` (JSON Schema) in ``/openapi.json``. Null is
    accepted too, and means the default. A field with no ``check`` has a parser of its own."""

    check: Callable[[Any], bool] | None
    expected: str
    schema: dict[str, Any]


def _int_spec(low: int, high: int | None = None) -> Spec:
    if high is None:
        return Spec(lambda v: _is_int(v) and v >= low, f"an integer >= {low}", {"type": "integer", "minimum": low})
    return Spec(lambda v: _is_int(v) and low <= v <= high, f"an integer in [{low}, {high}]",
                {"type": "integer", "minimum": low, "maximum": high})


STRING = Spec(lambda v: isinstance(v, str), "a string", {"type": "string"})
BOOL = Spec(lambda v: isinstance(v, bool), "true or false", {"type": "boolean"})
COUNT = _int_spec(0)
LOGPROBS_COUNT = _int_spec(0, MAX_LOGPROBS)
TOKEN_ID = {"type": "integer", "minimum": 0}  # below the model's vocabulary size: Server.checked_ids
TOKEN_IDS = Spec(_is_token_ids, "a list of token ids (integers)", {"type": "array", "items": TOKEN_ID})
STRINGS = {"type": "array", "items": {"type": "string", "minLength": 1}}
# How OpenAI's fields are checked (a prompt and messages have checks of their own: _prompts and
# chat_messages; NEUTRAL and LABELS below are the rest of what requests may carry).
COMMON = {
    "model": STRING,  # which one: Server.check_model
    "max_tokens": COUNT,
    "temperature": Spec(lambda v: _is_number(v) and v >= 0, "a number >= 0", {"type": "number", "minimum": 0}),
    "top_p": Spec(lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]",
                  {"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "seed": COUNT,
    "stop": Spec(lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
                 "a string or a list of strings", {"anyOf": [{"type": "string", "minLength": 1}, STRINGS]}),
    "stream": BOOL,
    "stream_options": Spec(lambda v: isinstance(v, dict) and set(v) <= {"include_usage", "continuous_usage_stats"},
                           'an object like {"include_usage": true}',
                           {"type": "object", "properties": {"include_usage": {"type": ["boolean", "null"]},
                                                             "continuous_usage_stats": {"type": ["boolean", "null"]}},
                            "additionalProperties": False}),
    "ignore_eos": BOOL,
    "n": _int_spec(1, MAX_CHOICES),
}
PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, TOKEN_IDS.schema,
                           {"type": "array", "minItems": 1, "items": {"type": "string"}},
                           {"type": "array", "minItems": 1, "items": {**TOKEN_IDS.schema, "minItems": 1}}]}
IMAGE_DETAILS = ("auto", "low", "high")  # accepted and ignored: the model's processor decides the resolution
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
IMAGE_PART = {"type": "object", "required": ["type", "image_url"], "properties": {
    "type": {"const": "image_url"},
    "image_url": {"type": "object", "required": ["url"], "properties": {
        "url": {"type": "string", "description": "data:image/...;base64,... or a file:// URL under the server's "
                                                 "--allowed-image-dir; the server fetches no http(s) URL"},
        "detail": {"enum": [*IMAGE_DETAILS, None], "description": "accepted and ignored"}},
        "additionalProperties": False}}}


def messages_schema(vision: bool) -> dict[str, Any]:
    """``messages`` as /openapi.json shows it: with image parts for a ``vision`` model."""
    part = {"anyOf": [TEXT_PART, IMAGE_PART]} if vision else TEXT_PART
    return {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": part}]}}}}


# The fields of each endpoint (beyond NEUTRAL and LABELS; chat's conversation options: runtime.serve.chat).
COMPLETION = {**COMMON, "prompt": Spec(None, "", PROMPT_SCHEMA), "logprobs": LOGPROBS_COUNT, "echo": BOOL}
CHAT = {**COMMON, "messages": Spec(None, "", messages_schema(False)), "max_completion_tokens": COUNT,
        "logprobs": BOOL, "top_logprobs": LOGPROBS_COUNT}
TOKENIZE = {**COMMON, "prompt": Spec(None, "", {"anyOf": PROMPT_SCHEMA["anyOf"][:2]}),
            "messages": CHAT["messages"], "add_special_tokens": BOOL}
DETOKENIZE = {**COMMON, "tokens": TOKEN_IDS}


def _field(body: dict, name: str, spec: Spec, default=None):
    """``body[name]`` when present and not null (null means "the default", as in OpenAI's API)."""
    value = body.get(name)
    if value is None:
        return default
    if not spec.check(value):
        raise bad_request(f"'{name}' must be {spec.expected}, got {_show(value)}", name)
    return value


def _check_options(body: dict, fields: dict[str, Spec]) -> None:
    for name, value in body.items():
        if name in NEUTRAL:
            if value is not None and value != NEUTRAL[name]:
                raise bad_request(f"'{name}' = {_show(value)} is not supported by this server (only "
                                  f"{_show(NEUTRAL[name])} or null)", name, "unsupported_option")
        elif name not in LABELS and name not in fields:
            raise bad_request(f"unknown option '{name}'", name, "unknown_option")


def _generation_options(body: dict, max_tokens: int | None, logprobs: int | None = None,
                        echo: bool = False) -> GenerationOptions:
    _field(body, "model", STRING)
    temperature = _field(body, "temperature", COMMON["temperature"], 1.0)
    top_p = _field(body, "top_p", COMMON["top_p"], 1.0)
    seed = _field(body, "seed", COUNT)
    stop = _field(body, "stop", COMMON["stop"], [])
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if "" in stop:
        raise bad_request("'stop' strings must not be empty", "stop")
    stream = _field(body, "stream", BOOL, False)
    stream_options = _field(body, "stream_options", COMMON["stream_options"], {})
    include_usage = _field(stream_options, "include_usage", BOOL, False)
    continuous_usage = include_usage and _field(stream_options, "continuous_usage_stats", BOOL, False)
    ignore_eos = _field(body, "ignore_eos", BOOL, False)
    n = _field(body, "n", COMMON["n"], 1)
    return GenerationOptions(max_tokens, float(temperature), float(top_p), seed, stop, stream, include_usage,
                             ignore_eos, n, logprobs, echo, continuous_usage)


def _prompts(prompt) -> list[str | list[int]]:
    """OpenAI's four spellings of ``prompt``: a text, token ids, or a batch (a list) of either."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(isinstance(p, list) and p and _is_token_ids(p)
                                                       for p in prompt)):
        return prompt
    raise bad_request("'prompt' must be a string, a list of token ids (integers), or a non-empty list of strings "
                      f"or of token id lists, got {_show(prompt)}", "prompt")


def completion_request(body: dict) -> tuple[list[str | list[int]], GenerationOptions]:
    """``POST /v1/completions``: the prompts (texts or token ids; a batch answers one choice per
    prompt and ``n``) and the options."""
    _check_options(body, COMPLETION)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt", "missing_field")
    prompts = _prompts(body["prompt"])
    echo = _field(body, "echo", BOOL, False)
    opts = _generation_options(body, _field(body, "max_tokens", COUNT, 16),  # OpenAI's default: 16
                               _field(body, "logprobs", LOGPROBS_COUNT), echo)
    if len(prompts) * opts.n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n = {opts.n} asks for more than {MAX_CHOICES} choices", "n")
    return prompts, opts


def _image_url(part: dict, where: str) -> str:
    """The URL of an image part, checked for OpenAI's shape."""
    image = part.get("image_url")
    if not (isinstance(image, dict) and isinstance(image.get("url"), str)
            and set(image) <= {"url", "detail"} and image.get("detail") in (*IMAGE_DETAILS, None)):
        raise bad_request(f"{where}: an image part is {{\"type\": \"image_url\", \"image_url\": {{\"url\": URL}}}} "
                          f"(and \"detail\": one of {', '.join(IMAGE_DETAILS)}), got {_show(part)}", "messages")
    return image["url"]


def _message_text(content, i: int, joiner: str, vision: bool) -> str:
    """A message's text: its text parts joined (image parts, which a vision model takes, left out)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = []
        for j, part in enumerate(content):
            if vision and part.get("type") == "image_url":
                _image_url(part, f"messages[{i}].content[{j}]")
                continue
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                kinds = ('text parts ({"type": "text", "text": ...}) and images ({"type": "image_url", ...})' if vision
                         else 'this model has no vision tower, so only text parts ({"type": "text", "text": ...})')
                raise bad_request(f"messages[{i}].content: {kinds} are supported", "messages")
            parts.append(part["text"])
        return joiner.join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts, got {_show(content)}",
                      "messages")


def chat_messages(body: dict, vision: bool = False) -> list[dict[str, Any]]:
    """The request's ``messages``, each with its content as plain text (a list of parts also kept
    as ``content_parts``: DeepSeek-V4.1's encoding joins them its own way, images included).
    ``vision``: whether the model takes image parts (else they are refused)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"'messages' must be a non-empty list of messages, got {_show(messages)}", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role', got {_show(m)}", "messages")
        # A tool result's text parts are joined by a blank line, as DeepSeek-V4's release encoding
        # joins them; other messages' parts run on as written.
        joiner = "\n\n" if m["role"] == "tool" else ""
        parts = {"content_parts": m["content"]} if isinstance(m.get("content"), list) else {}
        rendered.append({**m, "content": _message_text(m.get("content"), i, joiner, vision), **parts})
    return rendered


def image_urls(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The image parts of checked ``messages`` (:func:`chat_messages`), in prompt order: where
    each is (``messages[i].content[j]``) and its URL."""
    return [(f"messages[{i}].content[{j}]", part["image_url"]["url"])
            for i, m in enumerate(messages) for j, part in enumerate(m.get("content_parts", ()))
            if part.get("type") == "image_url"]


def chat_request(body: dict, vision: bool = False) -> tuple[list[dict[str, Any]], GenerationOptions]:
    """``POST /v1/chat/completions``: the messages (content as plain text; image parts for a
    ``vision`` model) and the options."""
    _check_options({k: v for k, v in body.items() if k not in CHAT_PROTOCOL}, CHAT)
    rendered = chat_messages(body, vision)
    max_tokens = _field(body, "max_completion_tokens", COUNT, _field(body, "max_tokens", COUNT))
    logprobs = _field(body, "logprobs", BOOL, False)
    top = _field(body, "top_logprobs", LOGPROBS_COUNT)
    if top is not None and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return rendered, _generation_options(body, max_tokens, (top or 0) if logprobs else None)


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | list[int] | None  # this, or
    messages: list[dict[str, Any]] | None  # these
    add_special_tokens: bool  # for a text prompt: BOS and the like, as completions add them


def tokenize_request(body: dict, vision: bool = False) -> TokenizeRequest:
    """``POST /tokenize`` (vLLM's): a ``prompt`` (text or token ids) or chat ``messages``, one of them."""
    # With messages, the conversation options (tools, chat_template_kwargs, ...) shape the prompt.
    _check_options({k: v for k, v in body.items() if k not in CHAT_PROTOCOL or "messages" not in body},
                   TOKENIZE)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give either 'prompt' (text or token ids) or 'messages'", "prompt", "missing_field")
    special = _field(body, "add_special_tokens", BOOL, True)
    if "messages" in body:
        return TokenizeRequest(None, chat_messages(body, vision), special)
    prompt = body["prompt"]
    if not (isinstance(prompt, str) or _is_token_ids(prompt)):
        raise bad_request(f"'prompt' must be a string or a list of token ids, got {_show(prompt)}", "prompt")
    return TokenizeRequest(prompt, None, special)


def detokenize_request(body: dict) -> list[int]:
    """``POST /detokenize`` (vLLM's): ``tokens``, a list of token ids."""
    _check_options(body, DETOKENIZE)
    return _field(body, "tokens", TOKEN_IDS, [])


# --------------------------------------------------------------------------- responses

# A token with its log-probability entry; the first prompt token has none (nothing predicts it).
ScoredToken = tuple[int, TokenLogprob | None]
TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: of the prompt tokens, those the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Completions:
    """Shapes of ``/v1/completions``. Every choice also carries ``token_ids`` (as vLLM's
    ``return_token_ids`` does): the generated ids, the only output of a model without a tokenizer."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    @staticmethod
    def choice(index: int, text: str, token_ids: list[int], finish: str | None,
               logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "token_ids": token_ids}

    chunk_choice = choice

    @staticmethod
    def opening_chunk_choice(index: int) -> dict[str, Any] | None:
        return None

    @staticmethod
    def logprobs(scored: list[ScoredToken], token_text: TokenText, text_offset: int) -> dict[str, Any]:
        """The legacy shape: parallel lists, ``top_logprobs`` as {token text: log-probability}
        (null where a token has no entry), ``text_offset`` where each token starts in the text."""
        tokens = [token_text(t) for t, _ in scored]
        offsets = []
        for text in tokens:
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob if e else None for _, e in scored],
                "top_logprobs": [{token_text(t): lp for t, lp in e.top} if e else None for _, e in scored],
                "text_offset": offsets}


class ChatCompletions:
    """Shapes of ``/v1/chat/completions`` (with ``token_ids`` as in :class:`Completions`)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    @staticmethod
    def choice(index: int, text: str, token_ids: list[int], finish: str | None,
               logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish, "token_ids": token_ids}

    @staticmethod
    def chunk_choice(index: int, text: str, token_ids: list[int], finish: str | None,
                     logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish,
                "token_ids": token_ids}

    @staticmethod
    def opening_chunk_choice(index: int) -> dict[str, Any] | None:
        # OpenAI's first chunk names the role before any content.
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "token_ids": []}

    @staticmethod
    def logprobs(scored: list[ScoredToken], token_text: TokenText, text_offset: int) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t, e.logprob), "top_logprobs": [entry(a, lp) for a, lp in e.top]}
                            for t, e in scored], "refusal": None}

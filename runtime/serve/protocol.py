"""OpenAI request bodies, checked field by field, and the response shapes of the two endpoints.

Every problem with a request is an :class:`APIError` whose one-line message names the field;
nothing a client sends gets past here as an unexpected type.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable


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
    "n": 1, "best_of": 1, "echo": False, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0,
    "frequency_penalty": 0, "logit_bias": {}, "suffix": "", "tools": [], "tool_choice": "none", "functions": [],
    "function_call": "none", "response_format": {"type": "text"},
}
# Options that only describe a request; accepted and ignored.
LABELS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Chat options of the conversation protocol, checked by runtime.serve.chat (tools, tool_choice and
# response_format are no longer neutral there).
CHAT_PROTOCOL = {"tools", "tool_choice", "response_format", "chat_template_kwargs", "reasoning_effort",
                 "add_generation_prompt"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "ignore_eos"}


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


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_token_ids(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _show(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(body: dict, name: str, check: Callable[[Any], bool], expected: str, default=None):
    """``body[name]`` when present and not null (null means "the default", as in OpenAI's API)."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad_request(f"'{name}' must be {expected}, got {_show(value)}", name)
    return value


def _check_options(body: dict, own: set[str]) -> None:
    for name, value in body.items():
        if name in NEUTRAL:
            if value is not None and value != NEUTRAL[name]:
                raise bad_request(f"'{name}' = {_show(value)} is not supported by this server (only "
                                  f"{_show(NEUTRAL[name])} or null)", name, "unsupported_option")
        elif name not in COMMON | LABELS | own:
            raise bad_request(f"unknown option '{name}'", name, "unknown_option")


def _generation_options(body: dict, max_tokens: int | None) -> GenerationOptions:
    _field(body, "model", lambda v: isinstance(v, str), "a string")  # which one: Server.check_model
    temperature = _field(body, "temperature", lambda v: _is_number(v) and v >= 0, "a number >= 0", 1.0)
    top_p = _field(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    seed = _field(body, "seed", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    stop = _field(body, "stop", lambda v: isinstance(v, str) or (isinstance(v, list) and all(
        isinstance(s, str) for s in v)), "a string or a list of strings", [])
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if "" in stop:
        raise bad_request("'stop' strings must not be empty", "stop")
    stream = _field(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    stream_options = _field(body, "stream_options", lambda v: isinstance(v, dict) and set(v) <= {"include_usage"},
                            'an object like {"include_usage": true}', {})
    include_usage = _field(stream_options, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
    ignore_eos = _field(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False)
    return GenerationOptions(max_tokens, float(temperature), float(top_p), seed, stop, stream, include_usage,
                             ignore_eos)


def _max_tokens(body: dict, name: str, default: int | None) -> int | None:
    return _field(body, name, lambda v: _is_int(v) and v >= 0, "an integer >= 0", default)


def completion_request(body: dict) -> tuple[str | list[int], GenerationOptions]:
    """``POST /v1/completions``: the prompt (text or token ids) and the options."""
    _check_options(body, {"prompt"})
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt", "missing_field")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        if len(prompt) != 1:
            raise bad_request(f"batched prompts ({len(prompt)} in one request) are not supported; send one "
                              "request per prompt", "prompt", "unsupported_option")
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, str) or _is_token_ids(prompt)):
        raise bad_request(f"'prompt' must be a string or a list of token ids (integers), got {_show(prompt)}",
                          "prompt")
    return prompt, _generation_options(body, _max_tokens(body, "max_tokens", 16))  # OpenAI's default: 16


def _message_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts, got {_show(content)}",
                      "messages")


def chat_request(body: dict) -> tuple[list[dict[str, Any]], GenerationOptions]:
    """``POST /v1/chat/completions``: the messages (content as plain text) and the options."""
    _check_options({k: v for k, v in body.items() if k not in CHAT_PROTOCOL}, {"messages", "max_completion_tokens"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"'messages' must be a non-empty list of messages, got {_show(messages)}", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role', got {_show(m)}", "messages")
        rendered.append({**m, "content": _message_text(m.get("content"), i)})
    max_tokens = _max_tokens(body, "max_completion_tokens", _max_tokens(body, "max_tokens", None))
    return rendered, _generation_options(body, max_tokens)


# --------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Completions:
    """Shapes of ``/v1/completions``. Every choice also carries ``token_ids`` (as vLLM's
    ``return_token_ids`` does): the generated ids, the only output of a model without a tokenizer."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    @staticmethod
    def choice(text: str, token_ids: list[int], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": token_ids}

    chunk_choice = choice

    @staticmethod
    def opening_chunk_choice() -> dict[str, Any] | None:
        return None


class ChatCompletions:
    """Shapes of ``/v1/chat/completions`` (with ``token_ids`` as in :class:`Completions`)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    @staticmethod
    def choice(text: str, token_ids: list[int], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish, "token_ids": token_ids}

    @staticmethod
    def chunk_choice(text: str, token_ids: list[int], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish,
                "token_ids": token_ids}

    @staticmethod
    def opening_chunk_choice() -> dict[str, Any] | None:
        # OpenAI's first chunk names the role before any content.
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
                "token_ids": []}

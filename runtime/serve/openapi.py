"""``/openapi.json`` (and ``/docs``): each endpoint's request body from the field specs the request
parsers check with (:mod:`.protocol`'s, and :data:`.chat.CHAT_OPTIONS_SCHEMA`), bounded by the
served model (its vocabulary, ``--max-context``, the places of ``--max-requests`` + ``--max-waiting``,
image parts when it has a vision tower),
and the shapes of its answers and of OpenAI's errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4c.runtime.serve.chat import CHAT_OPTIONS_SCHEMA
from dsv4c.runtime.serve.protocol import LABELS, MAX_CHOICES, NEUTRAL, TOKEN_ID, Spec, messages_schema


@dataclass(frozen=True)
class Bounds:
    """What bounds a request on this server beyond its fields' own checks."""

    vocab_size: int
    max_context: int
    places: int  # running + waiting: the most choices a request may have
    vision: bool = False  # whether chat messages may hold image parts


def _bounded(schema: Any, bounds: Bounds) -> Any:
    """``schema`` with every token id below the vocabulary size."""
    if schema == TOKEN_ID:
        return {**TOKEN_ID, "maximum": bounds.vocab_size - 1}
    if isinstance(schema, dict):
        return {k: _bounded(v, bounds) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_bounded(v, bounds) for v in schema]
    return schema


def request_body(fields: dict[str, Spec], required: list[str], bounds: Bounds, chat_options: bool = False,
                 one_of: tuple[str, ...] = ()) -> dict:
    """An operation's ``requestBody`` (for FastAPI's ``openapi_extra``): every field it accepts;
    ``one_of``: fields of which the body holds exactly one."""
    limits = {"max_tokens": {"maximum": bounds.max_context}, "max_completion_tokens": {"maximum": bounds.max_context},
              "n": {"maximum": min(MAX_CHOICES, bounds.places)}}
    properties: dict[str, Any] = {name: {"description": "accepted and ignored"} for name in sorted(LABELS)}
    properties |= {name: {"enum": [value], "description": "only this value (the output it leaves as it is)"}
                   for name, value in NEUTRAL.items()}
    if chat_options:
        properties |= CHAT_OPTIONS_SCHEMA
    properties |= {name: _bounded({**spec.schema, **limits.get(name, {})}, bounds) for name, spec in fields.items()}
    if "messages" in fields:
        properties["messages"] = messages_schema(bounds.vision)
    nullable = {name: {"anyOf": [schema, {"type": "null"}]} if name not in (*required, *one_of) else schema
                for name, schema in properties.items()}
    schema = {"type": "object", "required": required, "properties": nullable, "additionalProperties": False}
    if one_of:
        schema["oneOf"] = [{"required": [name]} for name in one_of]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_STRING, _INT, _INTS = {"type": "string"}, {"type": "integer"}, {"type": "array", "items": {"type": "integer"}}
_NULLABLE_OBJECT = {"type": ["object", "null"]}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": _STRING, "type": _STRING, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                        "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                                  "properties": {"cached_tokens": _INT}}}}
_FINISH = {"enum": ["stop", "length", "tool_calls", None]}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": _STRING, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {"name": _STRING,
                                                                                   "arguments": _STRING}}}}


def _answer(choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": _STRING, "object": _STRING, "created": _INT, "model": _STRING, "usage": USAGE,
        "choices": {"type": "array", "items": {"type": "object", "required": list(choice), "properties": choice}}}}


COMPLETION_ANSWER = _answer({"index": _INT, "text": _STRING, "logprobs": _NULLABLE_OBJECT, "finish_reason": _FINISH,
                             "token_ids": _INTS})
CHAT_ANSWER = _answer({"index": _INT, "logprobs": _NULLABLE_OBJECT, "finish_reason": _FINISH, "token_ids": _INTS,
                       "message": {"type": "object", "required": ["role", "content"], "properties": {
                           "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                           "reasoning_content": {"type": ["string", "null"]},
                           "tool_calls": {"type": "array", "items": _TOOL_CALL}}}})
TOKENIZE_ANSWER = {"type": "object", "required": ["tokens", "count", "max_model_len"],
                   "properties": {"tokens": _INTS, "count": _INT, "max_model_len": _INT}}
DETOKENIZE_ANSWER = {"type": "object", "required": ["prompt"], "properties": {"prompt": _STRING}}
ERRORS = {400: "a malformed request, or one that can never be admitted", 401: "a missing or wrong API key",
          404: "another model", 408: "a body that did not arrive in time", 413: "a body over the limit",
          503: "the server is full (Retry-After) or shutting down"}


def responses(answer: dict, streams: bool = False) -> dict:
    """An operation's ``responses`` (FastAPI's): its answer (or server-sent events), and OpenAI's errors."""
    content = {"application/json": {"schema": answer}}
    if streams:
        # Each event: a chunk as JSON (an error, once the status has gone out), then "[DONE]".
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                   "properties": {"data": _STRING}}}
    errors = {status: {"description": why, "content": {"application/json": {"schema": ERROR}}}
              for status, why in ERRORS.items()}
    return {200: {"description": "the answer" + (" (server-sent events with stream: true)" if streams else ""),
                  "content": content}, **errors}


def require_api_key(document: dict, routes: list) -> None:
    """Mark the operations of ``routes`` (FastAPI's) in ``document`` as behind the API key."""
    document.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for route in routes:
        for method in route.methods:
            document["paths"][route.path][method.lower()]["security"] = [{"bearer": []}]

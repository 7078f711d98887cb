"""DeepSeek-V4.1's conversation protocol, written by us from the format of the release's
``encoding/encoding_dsv41.py`` (as SGLang's port and its tests show it). It is V4's
(:mod:`.dsv4_encoding`) with these differences:

* DSML is spelled with spaced tag names, ``<｜DSML｜ calls>``, ``<｜DSML｜ invoke>``,
  ``<｜DSML｜ parameter>`` (:data:`~.dsml.V41_DSML`), in the tools prompt and in tool calls.
* System messages carry ``<｜System｜>``. A system message after the first is a turn the
  assistant answers (``<｜Assistant｜>`` follows it, and it counts as the last user turn when
  thinking mode drops earlier reasoning); the request's tools go to a leading system message, or
  an empty one put first.
* Reasoning effort is a number: thinking mode opens the prompt with ``<｜System｜>Reasoning
  Effort: N (range 1-100, ...)``; ``reasoning_effort`` is an integer in [1, 100] or ``low`` (25),
  ``high`` (50, the default), ``xhigh`` (75) or ``max`` (100).
* A message's content may be a list of parts, joined by a blank line; an image part
  (``image_url`` or ``image``) is the placeholder ``<｜deepseek_image｜>``, where the vision
  encoder's rows go (``dsv4c serve`` takes ``image_url`` parts for an artifact with a vision
  tower and expands each placeholder to the image's span: docs/vision_serving.md).

A placeholder typed in the request's text is text, never an image. The tokenizer turns an
added token's spelling into that token wherever it occurs in the prompt text, so text that
spells ``<｜deepseek_image｜>`` would become an image slot with no image behind it. The release
refuses such a request (a 400, and clients that keep the refused turn in their history then
have every later request refused too: sglang#39274, sglang#40758); we write it with ASCII bars,
``<|deepseek_image|>``, which reads the same to the model and can never become the token. Every
string of the request (contents, reasoning, tool results, call arguments, tool schemas) is
escaped so before the encoder puts in the placeholders of image parts.
"""

from __future__ import annotations

import json
from typing import Any

from dsv4c.runtime.serve.dsml import V41_DSML, to_json
from dsv4c.runtime.serve.dsv4_encoding import Dialect, encode_conversation
from dsv4c.runtime.serve.protocol import bad_request

SYSTEM = "<｜System｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
ESCAPED_IMAGE_PLACEHOLDER = "<|deepseek_image|>"
EFFORT_BUDGETS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
IMAGE_PARTS = ("image_url", "image")


def _effort_prompt(effort: Any) -> str:
    budget = EFFORT_BUDGETS.get(effort or "high") if isinstance(effort, str) or effort is None else effort
    if type(budget) is not int or not 1 <= budget <= 100:  # type(), not isinstance: a bool is no budget
        raise bad_request(f"'reasoning_effort' must be an integer in [1, 100] or one of {', '.join(EFFORT_BUDGETS)}, "
                          f"got {effort!r}", "reasoning_effort")
    return f"Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


V41 = Dialect(V41_DSML, _effort_prompt, SYSTEM)


def escape_placeholder(value: Any) -> Any:
    """``value`` (a request's JSON) with every spelled-out image placeholder in ASCII bars."""
    if isinstance(value, str):
        return value.replace(IMAGE_PLACEHOLDER, ESCAPED_IMAGE_PLACEHOLDER)
    if isinstance(value, list):
        return [escape_placeholder(v) for v in value]
    if isinstance(value, dict):
        return {escape_placeholder(k): escape_placeholder(v) for k, v in value.items()}
    return value


def _escaped_message(m: dict) -> dict:
    """A message with its strings escaped, the JSON text of its calls' arguments included (which
    may spell the placeholder with ``\\u`` escapes: the prompt has it decoded)."""
    m = escape_placeholder(m)
    if isinstance(m.get("tool_calls"), list):
        m["tool_calls"] = [_escaped_arguments(c) for c in m["tool_calls"]]
    return m


def _escaped_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    try:
        arguments = json.loads(function["arguments"])
    except (TypeError, KeyError, ValueError):
        return call  # not a call the encoder takes: it says so
    return {**call, "function": {**function, "arguments": to_json(escape_placeholder(arguments))}}


def _content_text(content: Any, i: int) -> str:
    """A message's content (escaped) as the prompt has it: parts joined by a blank line."""
    if not isinstance(content, list):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            parts.append(IMAGE_PLACEHOLDER)
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise bad_request(f"messages[{i}].content: a part must be {{\"type\": \"text\", \"text\": ...}} or an "
                              "image (\"image_url\", \"image\")", "messages")
    return "\n\n".join(parts)


def encode_chat(messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                response_format: dict | None = None, thinking: bool = False, reasoning_effort: str | int | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` (OpenAI chat messages; ``content`` a text or a list of
    text and image parts, or kept as ``content_parts`` by :func:`.protocol.chat_messages`), as
    :func:`.dsv4_encoding.encode_chat` takes them."""
    messages = [{**m, "content": _content_text(m.get("content_parts", m.get("content")), i)}
                for i, m in enumerate(map(_escaped_message, messages))]
    return encode_conversation(V41, messages, tools=escape_placeholder(tools),
                               response_format=escape_placeholder(response_format), thinking=thinking,
                               reasoning_effort=reasoning_effort, add_generation_prompt=add_generation_prompt)

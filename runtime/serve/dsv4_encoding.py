"""DeepSeek-V4's conversation protocol: the prompt of a conversation, written by us from the
format of the release's ``encoding/encoding_dsv4.py`` (the V4 checkpoints ship no Jinja chat
template), and the markers the model writes back (reasoning, DSML tool calls).

The prompt: BOS, then each message. System messages are their text; the request's tools (and a
``response_format`` schema) are appended to the first system message, or to an empty one put
first. User and developer turns open with ``<｜User｜>``; consecutive user and ``tool``
messages are one user turn whose parts are joined by a blank line, tool results written as
``<tool_result>...</tool_result>`` in the order the assistant called them. A turn that the
assistant answers (or the last one, for the generation prompt) ends with ``<｜Assistant｜>``
and then ``<think>`` in thinking mode or ``</think>`` in chat mode. Assistant messages are
``[reasoning</think>]content[DSML tool calls]<｜end▁of▁sentence｜>``.

Thinking mode drops the reasoning of turns before the last user turn, and developer messages
before it, as the release does; a conversation with tools keeps every turn's reasoning (and
opens ``<think>`` after every user turn), as the release does.

Reasoning effort follows the first V4 generation (the April release's encoding): ``max``
prepends the "Absolute maximum" effort prompt to the first message in thinking mode, ``high``
(the default) adds nothing. Later checkpoints (0731, 0813) moved that text to ``high`` and gave
``max`` a stronger one, which is why serving stacks that mix the two are one level off.

V4.1 keeps this protocol with a few differences (:mod:`.dsv41_encoding`): the conversation loop
here takes a :class:`Dialect`, what a member of the family writes its own way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from dsv4c.runtime.serve.dsml import THINK_END, THINK_START, V4_DSML, Dsml, to_json
from dsv4c.runtime.serve.protocol import bad_request

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"

REASONING_EFFORTS = {
    "high": "",
    "max": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
        "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
        "scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
        "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
    ),
}

RESPONSE_FORMAT_PROMPT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")


def _v4_effort(effort: Any) -> str:
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                          "reasoning_effort")
    return REASONING_EFFORTS[effort or "high"]


@dataclass(frozen=True)
class Dialect:
    """What one encoding of the V4 family writes differently from the others.

    ``system_token``: the marker of a system message ("" in V4, whose system text goes in bare).
    Where there is one (V4.1), it also opens the first message when an effort prompt leads it, a
    system message after the first is a turn the assistant answers, like a user's, and the tools
    go to the leading system message. ``effort_prompt``: the text of a ``reasoning_effort`` (checked
    in every mode, written at the start in thinking mode)."""

    dsml: Dsml
    effort_prompt: Callable[[Any], str]
    system_token: str = ""

    def asks_reply(self, i: int, role: str) -> bool:
        """Whether a turn with this role at index ``i`` is one the assistant answers."""
        return role in ("user", "developer") or (bool(self.system_token) and role == "system" and i > 0)


V4 = Dialect(V4_DSML, _v4_effort)


def _history_calls(message: dict, i: int) -> list[tuple[str, dict[str, Any]]]:
    """An assistant message's OpenAI ``tool_calls`` as (name, arguments), checked."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(name, str) or not isinstance(parsed, dict):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{\"function\": {{\"name\": NAME, "
                              "\"arguments\": A JSON OBJECT AS A STRING}}}", "messages")
        out.append((name, parsed))
    return out


def _user_turns(messages: list[dict]) -> list[dict]:
    """Consecutive user and tool messages merged into one user turn (``parts``: text, or a tool
    result with the id of the call it answers), tool results in the order the last assistant
    called them."""
    merged: list[dict] = []
    call_order: dict[str, int] = {}
    for i, m in enumerate(messages):
        role = m["role"]
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        if role == "developer" and not m["content"]:
            raise bad_request(f"messages[{i}]: a developer message needs content", "messages")
        if role == "assistant":
            if not isinstance(m.get("reasoning_content") or "", str):
                raise bad_request(f"messages[{i}].reasoning_content must be a string", "messages")
            m = {**m, "calls": _history_calls(m, i)}
            if m["calls"]:
                call_order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c.get("id")}
        if role not in ("user", "tool"):
            merged.append(m)
            continue
        part = ("text", m["content"]) if role == "user" else ("tool", m["content"], m.get("tool_call_id"))
        if merged and merged[-1]["role"] == "user":
            merged[-1]["parts"].append(part)
        else:
            merged.append({"role": "user", "parts": [part]})
        merged[-1]["call_order"] = call_order
    for turn in merged:
        if turn["role"] == "user":
            order = turn.pop("call_order")
            # Results take the slots results had, sorted by call order (unknown ids first, as the release does).
            results = iter(sorted((p for p in turn["parts"] if p[0] == "tool"), key=lambda p: order.get(p[2], 0)))
            turn["parts"] = [next(results) if p[0] == "tool" else p for p in turn["parts"]]
    return merged


def _with_system_extras(messages: list[dict], tools: list[dict] | None, response_format: dict | None,
                        dialect: Dialect) -> list[dict]:
    if not tools and response_format is None:
        return messages
    if dialect.system_token:  # a later system message is a turn: the tools go to the leading one
        host = 0 if messages and messages[0]["role"] == "system" else None
    else:
        host = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)
    if host is None:
        messages, host = [{"role": "system", "content": ""}, *messages], 0
    extras = {"tools": [t["function"] for t in tools or []], "response_format": response_format}
    return [{**m, **extras} if i == host else m for i, m in enumerate(messages)]


def _system_extras(m: dict, dsml: Dsml) -> str:
    text = ""
    if m.get("tools"):
        text += "\n\n" + dsml.tools_prompt(m["tools"])
    if m.get("response_format") is not None:
        text += "\n\n" + RESPONSE_FORMAT_PROMPT + to_json(m["response_format"])
    return text


def encode_chat(messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                response_format: dict | None = None, thinking: bool = False, reasoning_effort: str | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` (OpenAI chat messages, ``content`` already plain text).

    ``tools``: OpenAI tool definitions (``{"type": "function", "function": {...}}``), checked by
    the caller. ``add_generation_prompt=False`` leaves the last user turn without the assistant
    marker that asks for a reply."""
    return encode_conversation(V4, messages, tools=tools, response_format=response_format, thinking=thinking,
                               reasoning_effort=reasoning_effort, add_generation_prompt=add_generation_prompt)


def encode_conversation(dialect: Dialect, messages: list[dict[str, Any]], *, tools: list[dict] | None,
                        response_format: dict | None, thinking: bool, reasoning_effort: Any,
                        add_generation_prompt: bool) -> str:
    """:func:`encode_chat` in one of the family's dialects."""
    effort = dialect.effort_prompt(reasoning_effort)  # checked in every mode, written in thinking mode
    effort = effort if thinking else ""
    turns = _with_system_extras(_user_turns(messages), tools, response_format, dialect)
    # The release keeps every turn's reasoning once the conversation has tools.
    drop_reasoning = thinking and not tools

    def last_user() -> int:
        return max((i for i, m in enumerate(turns) if dialect.asks_reply(i, m["role"])), default=-1)

    last = last_user()
    if drop_reasoning:
        turns = [m for i, m in enumerate(turns) if not (i < last and m["role"] == "developer")]
        last = last_user()
    prompt = BOS
    for i, m in enumerate(turns):
        if i == 0 and (effort or m["role"] == "system"):
            prompt += dialect.system_token + effort
        prompt += _render(i, m, dialect, thinking and (not drop_reasoning or i > last))
        following = turns[i + 1]["role"] if i + 1 < len(turns) else None
        reply_follows = following in ("assistant", "latest_reminder") or (following is None and add_generation_prompt)
        if dialect.asks_reply(i, m["role"]) and reply_follows:
            prompt += ASSISTANT + (THINK_START if thinking and (not drop_reasoning or i >= last) else THINK_END)
    return prompt


def _render(i: int, m: dict, dialect: Dialect, keeps_reasoning: bool) -> str:
    role, content = m["role"], m.get("content") or ""
    if role == "system":
        return (dialect.system_token if i > 0 else "") + content + _system_extras(m, dialect.dsml)
    if role == "developer":
        return USER + content + _system_extras(m, dialect.dsml)
    if role == "user":
        return USER + "\n\n".join(p[1] if p[0] == "text" else f"<tool_result>{p[1]}</tool_result>"
                                  for p in m["parts"])
    if role == "latest_reminder":
        return LATEST_REMINDER + content
    reasoning = (m.get("reasoning_content") or "") + THINK_END if keeps_reasoning else ""
    return reasoning + content + (dialect.dsml.tool_calls(m["calls"]) if m["calls"] else "") + EOS

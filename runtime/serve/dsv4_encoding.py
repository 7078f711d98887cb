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
"""

from __future__ import annotations

import json
from typing import Any

from dsv4c.runtime.serve.protocol import bad_request

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAMETER_OPEN, PARAMETER_CLOSE = f"<{DSML}parameter", f"</{DSML}parameter>"
# What separates an assistant's content from its tool calls.
TOOL_CALLS_SEPARATOR = "\n\n"

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

TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{TOOL_CALLS_OPEN}" block like the following:

{TOOL_CALLS_OPEN}
{INVOKE_OPEN} name="$TOOL_NAME">
{PARAMETER_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN} name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{TOOL_CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside \
{THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_PROMPT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def dsml_parameter(name: str, value: Any) -> str:
    """One argument: strings as they are (``string="true"``), anything else as JSON."""
    text, is_string = (value, "true") if isinstance(value, str) else (to_json(value), "false")
    return f'{PARAMETER_OPEN} name="{name}" string="{is_string}">{text}{PARAMETER_CLOSE}'


def dsml_tool_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The block of (name, arguments) calls, as an assistant writes it after its content."""
    invokes = [f'{INVOKE_OPEN} name="{name}">\n' + "\n".join(dsml_parameter(k, v) for k, v in arguments.items())
               + f"\n{INVOKE_CLOSE}" for name, arguments in calls]
    return f"{TOOL_CALLS_SEPARATOR}{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


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


def _with_system_extras(messages: list[dict], tools: list[dict] | None, response_format: dict | None) -> list[dict]:
    if not tools and response_format is None:
        return messages
    first = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)
    if first is None:
        messages, first = [{"role": "system", "content": ""}, *messages], 0
    extras = {"tools": [t["function"] for t in tools or []], "response_format": response_format}
    return [{**m, **extras} if i == first else m for i, m in enumerate(messages)]


def _system_extras(m: dict) -> str:
    text = ""
    if m.get("tools"):
        text += "\n\n" + TOOLS_PROMPT.format(schemas="\n".join(to_json(t) for t in m["tools"]))
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
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise bad_request(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got "
                          f"{reasoning_effort!r}", "reasoning_effort")
    turns = _with_system_extras(_user_turns(messages), tools, response_format)
    # The release keeps every turn's reasoning once the conversation has tools.
    drop_reasoning = thinking and not tools
    last_user = max((i for i, m in enumerate(turns) if m["role"] in ("user", "developer")), default=-1)
    if drop_reasoning:
        turns = [m for i, m in enumerate(turns) if not (i < last_user and m["role"] == "developer")]
        last_user = max((i for i, m in enumerate(turns) if m["role"] in ("user", "developer")), default=-1)
    prompt = BOS
    for i, m in enumerate(turns):
        if i == 0 and thinking:
            prompt += REASONING_EFFORTS[reasoning_effort or "high"]
        prompt += _render(i, m, thinking, drop_reasoning, last_user)
        following = turns[i + 1]["role"] if i + 1 < len(turns) else None
        asks_reply = following in ("assistant", "latest_reminder") or (following is None and add_generation_prompt)
        if m["role"] in ("user", "developer") and asks_reply:
            prompt += ASSISTANT + (THINK_START if thinking and (not drop_reasoning or i >= last_user) else THINK_END)
    return prompt


def _render(i: int, m: dict, thinking: bool, drop_reasoning: bool, last_user: int) -> str:
    role, content = m["role"], m.get("content") or ""
    if role == "system":
        return content + _system_extras(m)
    if role == "developer":
        return USER + content + _system_extras(m)
    if role == "user":
        return USER + "\n\n".join(p[1] if p[0] == "text" else f"<tool_result>{p[1]}</tool_result>"
                                  for p in m["parts"])
    if role == "latest_reminder":
        return LATEST_REMINDER + content
    reasoning = ""
    if thinking and (not drop_reasoning or i > last_user):
        reasoning = (m.get("reasoning_content") or "") + THINK_END
    return reasoning + content + (dsml_tool_calls(m["calls"]) if m["calls"] else "") + EOS

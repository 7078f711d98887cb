"""What a V4-family model writes, split as it streams into reasoning, content and DSML tool
calls (in its dialect's spelling of DSML: :mod:`.dsml`).

Text that may be the start of a marker (``</think>``, the tool-calls block) is held back until
it is known not to be one, so no delta carries partial markup; a tool call comes out whole once
its ``</｜DSML｜invoke>`` (V4.1: ``</｜DSML｜ invoke>``) has arrived, and :meth:`ChatOutputParser.open_call`
tells what is known of the one being written (to stream it). DSML the model gets wrong (a call
that does not parse, a block it ends early) comes out as content, as it was written, and the
rest of the output with it; a block cut short by ``max_tokens`` ends in the call it was writing,
as far as it got (OpenAI's truncated call), and no markup."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache

from dsv4c.runtime.serve.dsml import THINK_END, TOOL_CALLS_SEPARATOR, V4_DSML, Dsml

_INVOKE = re.compile(r' name="([^"]*)">(.*)', re.S)


@cache
def _parameter(dsml: Dsml) -> re.Pattern:
    return re.compile(rf'\s*{re.escape(dsml.parameter_open)} name="([^"]*)" string="(true|false)">(.*?)'
                      rf'{re.escape(dsml.parameter_close)}', re.S)


@cache
def _open_parameter(dsml: Dsml) -> re.Pattern:
    """A parameter whose value is still being written."""
    return re.compile(rf'\s*{re.escape(dsml.parameter_open)} name="([^"]*)" string="(true|false)">(.*)', re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: "ChatDelta") -> "ChatDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def _arguments(rest: str, dsml: Dsml) -> tuple[dict, int, bool]:
    """The parameters at the start of ``rest``, where they end, and whether they all parsed
    (``string="false"`` values must be JSON, a name comes once; ``string="true"`` values are
    strings as written)."""
    arguments, at = {}, 0
    while (p := _parameter(dsml).match(rest, at)) is not None:
        key, is_string, value = p.groups()
        if key in arguments:
            return arguments, at, False
        if is_string == "true":
            arguments[key] = value
        else:
            try:
                arguments[key] = json.loads(value)
            except ValueError:
                return arguments, at, False
        at = p.end()
    return arguments, at, True


def _json_item(key: str, value) -> str:
    """One member of an object as ``json.dumps(..., ensure_ascii=False)`` writes it."""
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def parse_invoke(body: str, dsml: Dsml = V4_DSML) -> ToolCall | None:
    """The call in ``<｜DSML｜invoke`` BODY ``</｜DSML｜invoke>`` (or the tags of ``dsml``), or None
    when it is not one."""
    match = _INVOKE.fullmatch(body)
    if match is None:
        return None
    name, rest = match.groups()
    arguments, at, parsed = _arguments(rest, dsml)
    if not parsed or rest[at:].strip():
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def partial_invoke(body: str, dsml: Dsml = V4_DSML) -> ToolCall | None:
    """What is known of a call still being written (``<｜DSML｜invoke`` BODY, no end yet): None until
    its name is; then its arguments as the start of the JSON object :func:`parse_invoke` makes of
    the whole call: the parameters written, and a string value as far as it has come."""
    match = _INVOKE.match(body)
    if match is None:
        return None
    name, rest = match.groups()
    arguments, at, parsed = _arguments(rest, dsml)
    items = [_json_item(k, v) for k, v in arguments.items()]
    writing = _open_parameter(dsml).match(rest, at) if parsed else None
    if writing is not None and writing[2] == "true" and writing[1] not in arguments:
        value = writing[3][:len(writing[3]) - _held(writing[3], (dsml.parameter_close,))]
        items.append(_json_item(writing[1], value)[:-1])  # the string is not closed yet
    return ToolCall(name, "{" + ", ".join(items))


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may be the start of a marker."""
    return max((k for m in markers for k in range(1, min(len(m) - 1, len(text)) + 1) if text.endswith(m[:k])),
               default=0)


class ChatOutputParser:
    """Feed the model's text as it comes; each call returns what can be handed out now.

    ``thinking``: the prompt opened ``<think>``, so the text starts as reasoning, up to
    ``</think>`` (or a tool-calls block). ``tools``: DSML blocks are tool calls (with
    ``tool_choice: "none"`` they are content). ``dsml``: the model's spelling of DSML."""

    def __init__(self, thinking: bool, tools: bool, dsml: Dsml = V4_DSML):
        self.state = "reasoning" if thinking else "content"
        self.tools, self.dsml = tools, dsml
        self.pending = ""  # received, not handed out
        self.block = ""  # raw text of the tool-calls block since its last call: content if the block breaks
        self.calls = 0

    def feed(self, text: str) -> ChatDelta:
        self.pending += text
        out = ChatDelta()
        while self._step(out):
            pass
        return out

    def open_call(self) -> ToolCall | None:
        """The call being written, as far as it is known (see :func:`partial_invoke`)."""
        stripped = self.pending.lstrip()
        if self.state != "calls" or not stripped.startswith(self.dsml.invoke_open):
            return None
        return partial_invoke(stripped[len(self.dsml.invoke_open):], self.dsml)

    def finish(self, truncated: bool = False) -> ChatDelta:
        """The rest, once the model has stopped. A block it ended early is content; one cut short
        (``truncated``: by max_tokens) ends in the call it was writing, as far as it is known."""
        out = self.feed("")
        if truncated:  # what is held back now can only be the start of a marker: no markup goes out
            call = self.open_call()
            out.tool_calls += [call] if call is not None else []
        elif self.state == "calls":
            out.content += self.block + self.pending
        elif self.state == "reasoning":
            out.reasoning += self.pending
        else:
            out.content += self.pending
        self.pending = ""
        return out

    def _markers(self) -> tuple[str, ...]:
        block = (TOOL_CALLS_SEPARATOR + self.dsml.calls_open, self.dsml.calls_open) if self.tools else ()
        return ((THINK_END,) if self.state == "reasoning" else ()) + block

    def _step(self, out: ChatDelta) -> bool:
        """Hand out what is known; True when the state changed and there may be more."""
        if self.state in ("reasoning", "content"):
            return self._text(out)
        if self.state == "calls":
            return self._calls(out)
        out.content += self.pending  # after broken DSML everything is content
        self.pending = ""
        return False

    def _text(self, out: ChatDelta) -> bool:
        markers = self._markers()
        found = [(i, m) for m in markers if (i := self.pending.find(m)) >= 0]
        if not found:
            keep = _held(self.pending, markers)
            self._emit(out, self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        at, marker = min(found)  # the separator's variant starts first when both match
        before, self.pending = self.pending[:at], self.pending[at + len(marker):]
        self._emit(out, before)
        if marker == THINK_END:
            self.state = "content"
        else:
            self.state, self.block = "calls", marker
        return True

    def _emit(self, out: ChatDelta, text: str) -> None:
        if self.state == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _calls(self, out: ChatDelta) -> bool:
        dsml, stripped = self.dsml, self.pending.lstrip()
        if stripped.startswith(dsml.calls_close):
            self.pending = stripped[len(dsml.calls_close):]
            self.state, self.block = "content", ""
            return True
        if stripped.startswith(dsml.invoke_open):
            end = stripped.find(dsml.invoke_close)
            broken = stripped.find(dsml.calls_close)
            if end < 0 and broken < 0:
                return False  # the call is still coming
            whole = 0 <= end and (broken < 0 or end < broken)
            call = parse_invoke(stripped[len(dsml.invoke_open):end], dsml) if whole else None
            if call is None:
                return self._broken()
            out.tool_calls.append(call)
            self.calls += 1
            self.pending, self.block = stripped[end + len(dsml.invoke_close):], ""
            return True
        if any(m.startswith(stripped) for m in (dsml.calls_close, dsml.invoke_open)):
            return False  # nothing yet, or the start of the next element
        return self._broken()

    def _broken(self) -> bool:
        self.pending, self.block = self.block + self.pending, ""
        self.state = "plain"
        return True


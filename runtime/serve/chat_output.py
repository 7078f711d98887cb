"""What a V4 model writes, split as it streams into reasoning, content and DSML tool calls.

Text that may be the start of a marker (``</think>``, the tool-calls block) is held back until
it is known not to be one, so no delta carries partial markup; a tool call comes out whole once
its ``</｜DSML｜invoke>`` has arrived. DSML the model gets wrong (a call that does not parse, a
block cut short) comes out as content, as it was written, and the rest of the output with it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from dsv4c.runtime.serve.dsv4_encoding import (INVOKE_CLOSE, INVOKE_OPEN, PARAMETER_CLOSE, PARAMETER_OPEN,
                                               THINK_END, TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN, TOOL_CALLS_SEPARATOR)

_INVOKE = re.compile(r' name="([^"]*)">(.*)', re.S)
_PARAMETER = re.compile(rf'\s*{PARAMETER_OPEN} name="([^"]*)" string="(true|false)">(.*?){PARAMETER_CLOSE}', re.S)


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


def parse_invoke(body: str) -> ToolCall | None:
    """The call in ``<｜DSML｜invoke`` BODY ``</｜DSML｜invoke>``, or None when it is not one.
    ``string="false"`` values must be JSON; ``string="true"`` values are strings as written."""
    match = _INVOKE.fullmatch(body)
    if match is None:
        return None
    name, rest = match.groups()
    arguments, at = {}, 0
    while (p := _PARAMETER.match(rest, at)) is not None:
        key, is_string, value = p.groups()
        if key in arguments:
            return None
        if is_string == "true":
            arguments[key] = value
        else:
            try:
                arguments[key] = json.loads(value)
            except ValueError:
                return None
        at = p.end()
    if rest[at:].strip():
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may be the start of a marker."""
    return max((k for m in markers for k in range(1, min(len(m) - 1, len(text)) + 1) if text.endswith(m[:k])),
               default=0)


class ChatOutputParser:
    """Feed the model's text as it comes; each call returns what can be handed out now.

    ``thinking``: the prompt opened ``<think>``, so the text starts as reasoning, up to
    ``</think>`` (or a tool-calls block). ``tools``: DSML blocks are tool calls (with
    ``tool_choice: "none"`` they are content)."""

    def __init__(self, thinking: bool, tools: bool):
        self.state = "reasoning" if thinking else "content"
        self.tools = tools
        self.pending = ""  # received, not handed out
        self.block = ""  # raw text of the tool-calls block since its last call: content if the block breaks
        self.calls = 0

    def feed(self, text: str) -> ChatDelta:
        self.pending += text
        out = ChatDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ChatDelta:
        """The rest, once the model has stopped: a block cut short is content."""
        out = self.feed("")
        if self.state == "calls":
            out.content += self.block + self.pending
        elif self.state == "reasoning":
            out.reasoning += self.pending
        else:
            out.content += self.pending
        self.pending = ""
        return out

    def _markers(self) -> tuple[str, ...]:
        block = (TOOL_CALLS_SEPARATOR + TOOL_CALLS_OPEN, TOOL_CALLS_OPEN) if self.tools else ()
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
        stripped = self.pending.lstrip()
        if stripped.startswith(TOOL_CALLS_CLOSE):
            self.pending = stripped[len(TOOL_CALLS_CLOSE):]
            self.state, self.block = "content", ""
            return True
        if stripped.startswith(INVOKE_OPEN):
            end = stripped.find(INVOKE_CLOSE)
            broken = stripped.find(TOOL_CALLS_CLOSE)
            if end < 0 and broken < 0:
                return False  # the call is still coming
            call = parse_invoke(stripped[len(INVOKE_OPEN):end]) if 0 <= end and (broken < 0 or end < broken) else None
            if call is None:
                return self._broken()
            out.tool_calls.append(call)
            self.calls += 1
            self.pending, self.block = stripped[end + len(INVOKE_CLOSE):], ""
            return True
        if any(m.startswith(stripped) for m in (TOOL_CALLS_CLOSE, INVOKE_OPEN)):
            return False  # nothing yet, or the start of the next element
        return self._broken()

    def _broken(self) -> bool:
        self.pending, self.block = self.block + self.pending, ""
        self.state = "plain"
        return True


"""DSML, the markup in which DeepSeek's V4 family writes tool calls, in its two spellings.

V4 writes ``<｜DSML｜tool_calls>``, ``<｜DSML｜invoke>``, ``<｜DSML｜parameter>``; V4.1 renamed the
block and put a space before every tag name (``<｜DSML｜ calls>``, ``<｜DSML｜ invoke>``,
``<｜DSML｜ parameter>``). Everything else (attributes, line breaks, the blank line before the
block, the tools section of the system prompt) is the same in both, so one :class:`Dsml` per
spelling writes the calls and the tools prompt, and the output parser and the grammar of forced
calls read the tags from it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
_DSML = "｜DSML｜"
# What separates an assistant's content from its tool calls.
TOOL_CALLS_SEPARATOR = "\n\n"


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Dsml:
    """One spelling of DSML: the names that follow ``｜DSML｜`` in its three tags."""

    block: str
    invoke: str
    parameter: str

    @property
    def calls_open(self) -> str:
        return f"<{_DSML}{self.block}>"

    @property
    def calls_close(self) -> str:
        return f"</{_DSML}{self.block}>"

    @property
    def invoke_open(self) -> str:  # followed by ` name="...">`
        return f"<{_DSML}{self.invoke}"

    @property
    def invoke_close(self) -> str:
        return f"</{_DSML}{self.invoke}>"

    @property
    def parameter_open(self) -> str:  # followed by ` name="..." string="true|false">`
        return f"<{_DSML}{self.parameter}"

    @property
    def parameter_close(self) -> str:
        return f"</{_DSML}{self.parameter}>"

    def argument(self, name: str, value: Any) -> str:
        """One argument: strings as they are (``string="true"``), anything else as JSON."""
        text, is_string = (value, "true") if isinstance(value, str) else (to_json(value), "false")
        return f'{self.parameter_open} name="{name}" string="{is_string}">{text}{self.parameter_close}'

    def tool_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The block of (name, arguments) calls, as an assistant writes it after its content."""
        invokes = [f'{self.invoke_open} name="{name}">\n' + "\n".join(self.argument(k, v) for k, v in arguments.items())
                   + f"\n{self.invoke_close}" for name, arguments in calls]
        return f"{TOOL_CALLS_SEPARATOR}{self.calls_open}\n" + "\n".join(invokes) + f"\n{self.calls_close}"

    def tools_prompt(self, functions: list[dict]) -> str:
        """The system prompt's tools section: how to call, then each function's schema."""
        schemas = "\n".join(to_json(f) for f in functions)
        return f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{self.calls_open}" block like the following:

{self.calls_open}
{self.invoke_open} name="$TOOL_NAME">
{self.parameter_open} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{self.parameter_close}
...
{self.invoke_close}
{self.invoke_open} name="$TOOL_NAME2">
...
{self.invoke_close}
{self.calls_close}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside \
{THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


V4_DSML = Dsml("tool_calls", "invoke", "parameter")
V41_DSML = Dsml(" calls", " invoke", " parameter")

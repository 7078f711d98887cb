"""V4's prompt encoding, byte for byte against transcripts of the release's format written out by
hand (encoding/encoding_dsv4.py of the April release, read for the format)."""

import pytest

from dsv4c.runtime.serve.dsv4_encoding import encode_chat
from dsv4c.runtime.serve.protocol import APIError, chat_messages

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# The release's tools section, written out: what follows a system message's text and a blank line.
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": \
{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
{"name": "get_time", "parameters": {"type": "object", "properties": {}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "2+2?"}]


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_multi_turn_chat_mode():
    assert encode_chat(CHAT) == (
        f"{B}You are terse.{U}Hi{A}</think>Hello!{E}{U}2+2?{A}</think>")
    assert encode_chat(CHAT, add_generation_prompt=False) == f"{B}You are terse.{U}Hi{A}</think>Hello!{E}{U}2+2?"


def test_thinking_drops_the_reasoning_of_earlier_turns():
    assert encode_chat(CHAT, thinking=True) == (
        f"{B}You are terse.{U}Hi{A}</think>Hello!{E}{U}2+2?{A}<think>")
    # max effort: its prompt leads the first message; high (the first generation's default) adds nothing.
    assert encode_chat(CHAT, thinking=True, reasoning_effort="max") == (
        f"{B}{MAX_EFFORT}You are terse.{U}Hi{A}</think>Hello!{E}{U}2+2?{A}<think>")
    assert encode_chat(CHAT, thinking=True, reasoning_effort="high") == encode_chat(CHAT, thinking=True)
    assert encode_chat(CHAT, reasoning_effort="max") == encode_chat(CHAT)  # effort only speaks in thinking mode


def test_thinking_drops_developer_messages_before_the_last_user_turn():
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "assistant", "content": "Ok."},
                {"role": "user", "content": "Go"}]
    assert encode_chat(messages) == f"{B}{U}Be brief.{A}</think>Ok.{E}{U}Go{A}</think>"
    assert encode_chat(messages, thinking=True) == f"{B}Ok.{E}{U}Go{A}<think>"


def test_a_turn_after_the_last_user_keeps_its_reasoning():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel", "reasoning_content": "r"}]
    assert encode_chat(messages, thinking=True) == f"{B}{U}Hi{A}<think>r</think>Hel{E}"


def test_tools_calls_and_results():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [_call("c1", "get_weather", '{"city": "Paris", "days": 2}')]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert encode_chat(messages, tools=[WEATHER, TIME]) == (
        f"{B}\n\n{TOOLS_SECTION}"
        f"{U}Weather in Paris?{A}</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
        f"{U}<tool_result>sunny</tool_result>{A}</think>")


def test_a_tool_results_text_parts_are_joined_by_a_blank_line():
    parts = [{"type": "text", "text": "sunny"}, {"type": "text", "text": "22 C"}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [_call("c1", "get_weather", '{"city": "Paris"}')]},
                {"role": "tool", "tool_call_id": "c1", "content": parts}]
    prompt = encode_chat(chat_messages({"messages": messages}), tools=[WEATHER])
    assert prompt.endswith(f"</｜DSML｜tool_calls>{E}{U}<tool_result>sunny\n\n22 C</tool_result>{A}</think>")
    assert prompt == encode_chat([*messages[:2], {**messages[2], "content": "sunny\n\n22 C"}], tools=[WEATHER])
    # A user message's parts run on as written (the release takes only a string there).
    user = chat_messages({"messages": [{"role": "user", "content": parts}]})
    assert encode_chat(user) == f"{B}{U}sunny22 C{A}</think>"


def test_tools_join_the_first_system_message_and_thinking_keeps_every_turn():
    messages = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Time and weather?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "Two tools.",
                 "tool_calls": [_call("a", "get_weather", '{"city": "Oslo"}'), _call("b", "get_time", "{}")]},
                # Results arrive out of call order, with the user's next words: one user turn, in call order.
                {"role": "tool", "tool_call_id": "b", "content": "12:00"},
                {"role": "tool", "tool_call_id": "a", "content": "rain"},
                {"role": "user", "content": "Thanks"}]
    assert encode_chat(messages, tools=[WEATHER, TIME], thinking=True) == (
        f"{B}Sys.\n\n{TOOLS_SECTION}"
        f"{U}Time and weather?{A}<think>Two tools.</think>Checking.\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_time">\n'
        "\n"
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
        f"{U}<tool_result>rain</tool_result>\n\n<tool_result>12:00</tool_result>\n\nThanks{A}<think>")


def test_response_format_and_latest_reminder():
    messages = [{"role": "user", "content": "Name?"}, {"role": "latest_reminder", "content": "Today is Monday."}]
    response_format = {"type": "json_object"}
    assert encode_chat(messages, response_format=response_format) == (
        f"{B}\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object"}'
        f"{U}Name?{A}</think><｜latest_reminder｜>Today is Monday.")


@pytest.mark.parametrize("messages, kwargs, fragment", [
    ([{"role": "robot", "content": "x"}], {}, "role must be one of"),
    ([{"role": "developer", "content": ""}], {}, "developer message needs content"),
    ([{"role": "assistant", "content": "", "tool_calls": [_call("a", "f", "not json")]}], {}, "tool_calls[0]"),
    ([{"role": "assistant", "content": "", "tool_calls": "f"}], {}, "must be a list"),
    ([{"role": "assistant", "content": "", "reasoning_content": 3}], {}, "reasoning_content"),
    ([{"role": "user", "content": "x"}], {"thinking": True, "reasoning_effort": "medium"}, "'reasoning_effort'"),
])
def test_malformed_conversations_are_client_errors(messages, kwargs, fragment):
    with pytest.raises(APIError) as e:
        encode_chat(messages, **kwargs)
    assert e.value.status == 400 and fragment in e.value.message

"""V4.1's prompt encoding, byte for byte. The expected strings are written out by hand from the
format that the public port of the release's ``encoding/encoding_dsv41.py`` is tested against:
sgl-project/sglang, test/registered/unit/entrypoints/openai/test_encoding_dsv41.py (effort
budgets, the system token, a mid-conversation system turn, spaced DSML, image parts) and
python/sglang/srt/entrypoints/openai/encoding_dsv41.py (the tools section, tool results)."""

import json

import pytest

from dsv4c.runtime.serve import dsv4_encoding
from dsv4c.runtime.serve.dsv41_encoding import ESCAPED_IMAGE_PLACEHOLDER, IMAGE_PLACEHOLDER, encode_chat
from dsv4c.runtime.serve.protocol import APIError, chat_messages

from test_dsv4_encoding import TIME, WEATHER
from test_dsv4_encoding import TOOLS_SECTION as V4_TOOLS_SECTION

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, S = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
EFFORT = S + "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a value",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}

# The release's tools section is V4's in V4.1's spelling of the tags.
TOOLS_SECTION = (V4_TOOLS_SECTION.replace("｜DSML｜tool_calls", "｜DSML｜ calls")
                 .replace("｜DSML｜invoke", "｜DSML｜ invoke").replace("｜DSML｜parameter", "｜DSML｜ parameter"))


# An assistant turn with reasoning, content and one call, as the release writes it.
CALL_TURN = ("  reason  </think>summary\n\n"
             "<｜DSML｜ calls>\n"
             '<｜DSML｜ invoke name="lookup">\n'
             '<｜DSML｜ parameter name="query" string="true">value</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="limit" string="false">2</｜DSML｜ parameter>\n'
             "</｜DSML｜ invoke>\n"
             f"</｜DSML｜ calls>{E}")


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CALLED = [{"role": "user", "content": "question"},
          {"role": "assistant", "reasoning_content": "  reason  ", "content": "summary",
           "tool_calls": [_call("c1", "lookup", '{"query":"value","limit":2}')]}]


@pytest.mark.parametrize("effort, budget", [(None, 50), ("low", 25), ("high", 50), ("xhigh", 75), ("max", 100),
                                            (1, 1), (42, 42), (100, 100)])
def test_reasoning_effort_is_a_budget_behind_the_system_token(effort, budget):
    prompt = encode_chat([{"role": "user", "content": "question"}], thinking=True, reasoning_effort=effort)
    assert prompt == f"{B}{EFFORT.format(budget)}{U}question{A}<think>"


@pytest.mark.parametrize("effort", [-1, 0, 101, "medium", "none", True, False, 1.5])
def test_other_efforts_are_client_errors(effort):
    for thinking in (True, False):  # checked in chat mode too, where it is not written
        with pytest.raises(APIError) as e:
            encode_chat([{"role": "user", "content": "q"}], thinking=thinking, reasoning_effort=effort)
        assert e.value.status == 400 and "'reasoning_effort'" in e.value.message


def test_chat_mode_writes_no_effort_and_plain_turns_as_v4_does():
    assert encode_chat([{"role": "user", "content": "hello"}], reasoning_effort="max") == f"{B}{U}hello{A}</think>"
    turns = [{"role": "user", "content": "1+1=?"}, {"role": "assistant", "content": "2", "reasoning_content": "r"},
             {"role": "user", "content": "2+2=?"}]
    assert encode_chat(turns) == dsv4_encoding.encode_chat(turns) == f"{B}{U}1+1=?{A}</think>2{E}{U}2+2=?{A}</think>"
    assert encode_chat(turns, thinking=True) == f"{B}{EFFORT.format(50)}{U}1+1=?{A}</think>2{E}{U}2+2=?{A}<think>"


def test_system_messages_carry_the_system_token():
    sys_user = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hello"}]
    assert encode_chat(sys_user) == f"{B}{S}You are a helpful assistant.{U}hello{A}</think>"
    assert encode_chat(sys_user, thinking=True, reasoning_effort=7) == (
        f"{B}{EFFORT.format(7)}You are a helpful assistant.{U}hello{A}<think>")
    # An empty system message still writes its token; in thinking mode the effort prompt has written it.
    empty = [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]
    assert encode_chat(empty) == f"{B}{S}{U}hi{A}</think>"
    assert encode_chat(empty, thinking=True) == encode_chat(empty[1:], thinking=True)


def test_a_later_system_message_is_a_turn_the_assistant_answers():
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "system", "content": "mid sys"}]
    # It is the last user turn: the reasoning before it is dropped, and <think> opens after it.
    assert encode_chat(messages, thinking=True, reasoning_effort=88) == (
        f"{B}{EFFORT.format(88)}sys{U}q1{A}</think>a1{E}{S}mid sys{A}<think>")
    assert encode_chat(messages) == f"{B}{S}sys{U}q1{A}</think>a1{E}{S}mid sys{A}</think>"
    assert encode_chat(messages, add_generation_prompt=False) == f"{B}{S}sys{U}q1{A}</think>a1{E}{S}mid sys"


def test_tools_go_to_the_leading_system_message_in_spaced_dsml():
    assert ('<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
            '</｜DSML｜ parameter>\n...\n</｜DSML｜ invoke>') in TOOLS_SECTION
    messages = [{"role": "system", "content": "system"}, {"role": "user", "content": "question"},
                {"role": "system", "content": "later"}]
    assert encode_chat(messages, tools=[WEATHER, TIME]) == (
        f"{B}{S}system\n\n{TOOLS_SECTION}{U}question{S}later{A}</think>")
    # No leading system message: an empty one is put first to hold them.
    assert encode_chat(messages[1:], tools=[WEATHER, TIME]) == (
        f"{B}{S}\n\n{TOOLS_SECTION}{U}question{S}later{A}</think>")


def test_a_call_and_its_result_in_thinking_mode_with_tools():
    messages = [*CALLED, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    # With tools every turn keeps its reasoning.
    assert encode_chat(messages, tools=[WEATHER, TIME], thinking=True) == (
        f"{B}{EFFORT.format(50)}\n\n{TOOLS_SECTION}{U}question{A}<think>{CALL_TURN}"
        f"{U}<tool_result>42</tool_result>{A}<think>")
    # As history without tools, the turn before the last user turn loses its reasoning, not its call.
    assert encode_chat([*CALLED, {"role": "user", "content": "thanks"}], thinking=True) == (
        f"{B}{EFFORT.format(50)}{U}question{A}</think>{CALL_TURN[len('  reason  </think>'):]}{U}thanks{A}<think>")


def test_results_merge_into_one_user_turn_in_call_order():
    messages = [{"role": "user", "content": "Both?"},
                {"role": "assistant", "content": "", "tool_calls": [_call("a", "lookup", '{"query": "x"}'),
                                                                    _call("b", "lookup", '{"query": "y"}')]},
                {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "Y"},
                                                                  {"type": "text", "text": "y"}]},
                {"role": "tool", "tool_call_id": "a", "content": "X"},
                {"role": "user", "content": "ok"}]
    prompt = encode_chat(chat_messages({"messages": messages}), tools=[LOOKUP])
    assert prompt.endswith(f"</｜DSML｜ calls>{E}{U}<tool_result>X</tool_result>\n\n"
                           f"<tool_result>Y\n\ny</tool_result>\n\nok{A}</think>")


def test_content_parts_are_joined_by_a_blank_line_and_images_are_placeholders():
    parts = [{"type": "text", "text": "inspect"}, {"type": "image_url", "image_url": {"url": "/a.png"}},
             {"type": "text", "text": "and"}, {"type": "image_url", "image_url": "/b.png"}]
    assert encode_chat([{"role": "user", "content": parts}]) == (
        f"{B}{U}inspect\n\n{IMAGE_PLACEHOLDER}\n\nand\n\n{IMAGE_PLACEHOLDER}{A}</think>")
    # The text parts a request's messages keep (protocol.chat_messages) are joined the same way.
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert encode_chat(chat_messages({"messages": [{"role": "user", "content": text}]})) == f"{B}{U}a\n\nb{A}</think>"


def test_a_typed_placeholder_is_text_wherever_the_request_has_it():
    typed, escaped = f"Echo this back: {IMAGE_PLACEHOLDER}", f"Echo this back: {ESCAPED_IMAGE_PLACEHOLDER}"
    messages = [{"role": "system", "content": typed}, {"role": "user", "content": [{"type": "text", "text": typed}]},
                {"role": "assistant", "content": typed, "reasoning_content": typed,
                 "tool_calls": [_call("c", "lookup", json.dumps({"query": typed}))]},
                {"role": "tool", "tool_call_id": "c", "content": typed}]
    tool = {"type": "function", "function": {**LOOKUP["function"], "description": typed}}
    for thinking in (False, True):
        prompt = encode_chat(messages, tools=[tool], thinking=thinking)
        assert IMAGE_PLACEHOLDER not in prompt
        assert prompt.count(escaped) == 6 + thinking  # the reasoning is kept with tools in thinking mode
    # The encoder's own placeholder (an image part) beside a typed one.
    image = [{"type": "text", "text": typed}, {"type": "image", "url": "/c.png"}]
    assert encode_chat([{"role": "user", "content": image}]) == f"{B}{U}{escaped}\n\n{IMAGE_PLACEHOLDER}{A}</think>"


def test_a_typed_placeholder_never_becomes_the_image_token(tmp_path):
    """Tokenized with the placeholder as an added special token, as DeepSeek's tokenizer has it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.add_special_tokens([B, U, A, IMAGE_PLACEHOLDER])
    image = tokenizer.token_to_id(IMAGE_PLACEHOLDER)
    typed = encode_chat([{"role": "user", "content": f"what is {IMAGE_PLACEHOLDER}?"}])
    assert image not in tokenizer.encode(typed, add_special_tokens=False).ids
    real = encode_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/a.png"}}]}])
    assert tokenizer.encode(real, add_special_tokens=False).ids.count(image) == 1


@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "user", "content": [{"type": "audio", "data": "x"}]}], "messages[0].content"),
    ([{"role": "system", "content": "s"}, {"role": "robot", "content": "x"}], "role must be one of"),
    ([{"role": "assistant", "content": "", "tool_calls": [_call("a", "f", '"scalar"')]}], "tool_calls[0]"),
])
def test_malformed_conversations_are_client_errors(messages, fragment):
    with pytest.raises(APIError) as e:
        encode_chat(messages)
    assert e.value.status == 400 and fragment in e.value.message


def _chat(model_type):
    """The chat of a template-less artifact of this model_type (a fake engine: no model runs)."""
    from types import SimpleNamespace

    from dsv4c.runtime.serve.chat import ChatProtocol

    engine = SimpleNamespace(path="/nowhere", manifest=SimpleNamespace(model={"model_type": model_type}, vision=None),
                             config=SimpleNamespace(vocab_size=16, eos_token_ids=[1]), tokenizer=None)
    return ChatProtocol.of(engine, None)


def test_a_v41_artifact_chats_in_v41s_encoding_and_dsml():
    from dsv4c.runtime.serve.chat import chat_options

    v41, v4 = _chat("deepseek_v41"), _chat("deepseek_v4")
    assert (v41.summary, v4.summary) == (", chat (V4.1 encoding)", ", chat (V4 encoding)")
    body = {"messages": CALLED[:1], "tools": [LOOKUP], "reasoning_effort": 30,
            "chat_template_kwargs": {"thinking": True}}
    options = chat_options(body)
    assert v41.prompt_text(CALLED[:1], options) == encode_chat(CALLED[:1], tools=[LOOKUP], thinking=True,
                                                                reasoning_effort=30)
    # V4's encoding takes no budget; without one it writes V4's DSML.
    with pytest.raises(APIError, match="'reasoning_effort'"):
        v4.prompt_text(CALLED[:1], options)
    assert "<｜DSML｜tool_calls>" in v4.prompt_text(CALLED[:1], chat_options({**body, "reasoning_effort": "max"}))
    # The answer is parsed in V4.1's DSML.
    answer = v41.endpoint(options).choice(0, CALL_TURN[:-len(E)], [], "stop")
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["reasoning_content"] == "  reason  "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer["message"]["tool_calls"]] \
        == [("lookup", {"query": "value", "limit": 2})]
    for effort in (True, 2.5):
        with pytest.raises(APIError, match="'reasoning_effort'"):
            chat_options({**body, "reasoning_effort": effort})
    with pytest.raises(APIError, match="no chat_template"):
        _chat("llama").prompt_text(CALLED[:1], options)

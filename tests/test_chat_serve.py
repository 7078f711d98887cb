"""V4's conversation protocol through `dsv4c serve` and `dsv4c generate --messages`: a tiny
deepseek_v4 model with a byte-level BPE tokenizer carrying V4's special tokens and no chat
template, driven with the openai client."""

import json

import httpx
import jsonschema
import openai
import pytest

from dsv4c.cli import main as cli
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.runtime.serve.app import _choice_seed
from dsv4c.runtime.serve.dsv4_encoding import encode_chat

from test_serve import serving
from v4_tokenizer import SPECIAL, THINK_END_ID, write_v4_tokenizer

EOS = 1
CORPUS = ['{"city": "Paris", "unit": "celsius", "days": 3}', "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>",
          '<｜DSML｜invoke name="get_weather">', "</｜DSML｜invoke>", '<｜DSML｜parameter name="unit" string="true">',
          "</｜DSML｜parameter>", "## Tools You have access to a set of tools. The weather is nice today."]
WEATHER_PARAMETERS = {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"type": "string", "enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                 "properties": {"name": {"type": "string", "maxLength": 6},
                                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    assert cli(["make-tiny", "--out", str(root / "model"), "--seed", "1"]) == 0
    write_v4_tokenizer(root / "model", CORPUS * 10, 512)
    assert cli(["compile", "--model", str(root / "model"), "--target", "llvm", "-o", str(root / "cpu")]) == 0
    return root / "cpu"


@pytest.fixture(scope="module")
def engine(artifact):
    return Engine(artifact, max_requests=1, max_context=2048)


@pytest.fixture(scope="module")
def client(artifact):
    with serving(artifact, "--max-context", "2048", "--served-model-name", "tiny", no_tracebacks=True) as served:
        yield openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)


def _greedy(engine, text, n):
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    return ids, engine.generate(ids, SamplingParams(max_new_tokens=n, stop_token_ids=(EOS,))).tokens


def test_chat_prompts_are_v4s_encoding(engine, client, tmp_path, capsys):
    prompt, expected = _greedy(engine, encode_chat(USER, tools=TOOLS, thinking=True), 12)
    # BOS, the tools' system message, <｜User｜> ..., <｜Assistant｜><think>
    assert prompt[0] == 0 and prompt.count(2) == 1 and prompt[-2:] == [3, THINK_END_ID - 1]
    answer = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=12, temperature=0,
                                            extra_body={"chat_template_kwargs": {"thinking": True}})
    choice = answer.choices[0]
    assert answer.usage.prompt_tokens == len(prompt) and choice.token_ids == expected
    # Thinking: text up to </think> is reasoning, the rest content (split here by token id, not by the parser).
    body = [t for t in expected if t != EOS]
    cut = body.index(THINK_END_ID) if THINK_END_ID in body else len(body)
    # The server drops an incomplete UTF-8 sequence the output ends with (a random model makes them).
    reasoning, content = (engine.tokenizer.decode(ids, skip_special_tokens=False) for ids in (body[:cut],
                                                                                            body[cut + 1:]))
    if cut == len(body):
        reasoning = reasoning.rstrip("\ufffd")
    assert choice.message.reasoning_content == reasoning and (choice.message.content or "") == content.rstrip("\ufffd")

    path = tmp_path / "messages.json"
    path.write_text(json.dumps(USER))
    capsys.readouterr()
    assert cli(["generate", str(engine.path), "--messages", str(path), "--max-new-tokens", "12", "--greedy",
                "--stop-token-ids", str(EOS)]) == 0
    _, chat_mode = _greedy(engine, encode_chat(USER), 12)
    assert capsys.readouterr().out.rstrip("\n") == engine.decode(chat_mode)


def _chat(client, stream: bool, **request) -> tuple[str, list[list[str]], str, int]:
    """(content, the calls as [name, arguments], finish reason, chunks with tool calls before the
    last) of one choice, streamed or not; streamed calls are put together from their deltas."""
    answer = client.chat.completions.create(model="tiny", messages=USER, stream=stream, **request)
    if not stream:
        message = answer.choices[0].message
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls or [])
        return (message.content or "", [[c.function.name, c.function.arguments] for c in message.tool_calls or []],
                answer.choices[0].finish_reason, 0)
    chunks = [c for c in answer if c.choices]
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function.name is not None:
                assert call.index not in calls and call.id.startswith("call_") and call.type == "function"
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    early = sum(bool(c.choices[0].delta.tool_calls) for c in chunks[:-1])
    return ("".join(c.choices[0].delta.content or "" for c in chunks), [calls[i] for i in sorted(calls)],
            chunks[-1].choices[0].finish_reason, early)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_is_schema_valid(client, tool_choice, stream):
    named = isinstance(tool_choice, dict)
    for seed in range(4):
        content, calls, finish, _ = _chat(client, stream, tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
                                          temperature=1.0, seed=seed)
        assert finish == "tool_calls" and content == "" and calls and (len(calls) == 1 or not named)
        for name, arguments in calls:
            if name == "get_weather":
                jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
            else:
                assert name == "get_time" and not named and json.loads(arguments) == {}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_are_valid(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": ANSWER_SCHEMA}}
    for seed in range(6):
        answer = client.chat.completions.create(model="tiny", messages=USER, response_format=response_format,
                                                max_tokens=300, temperature=1.0, seed=seed, stream=stream)
        if stream:
            chunks = list(answer)
            content, finish = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            content, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(content), ANSWER_SCHEMA)
    anything = client.chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"},
                                              max_tokens=400, temperature=0.7, seed=1)
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # cut at max_tokens: a prefix of an object
        assert anything.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("constraint", [{"tools": TOOLS, "tool_choice": "required"}, {"response_format": {
    "type": "json_schema", "json_schema": {"name": "person", "schema": ANSWER_SCHEMA}}}], ids=["tool_call", "json_schema"])
def test_each_of_n_choices_keeps_its_own_constraint(client, constraint):
    request = dict(model="tiny", messages=USER, max_tokens=300, temperature=1.0, **constraint)
    answer = client.chat.completions.create(n=2, seed=3, **request)
    assert sorted(c.index for c in answer.choices) == [0, 1]
    for choice in answer.choices:
        if "tools" in constraint:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            for call in choice.message.tool_calls:
                schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
                jsonschema.validate(json.loads(call.function.arguments), schema)
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)
        # What a request with the choice's seed samples alone: a grammar state of its own.
        alone = client.chat.completions.create(n=1, seed=_choice_seed(3, choice.index), **request)
        assert alone.choices[0].token_ids == choice.token_ids
    assert answer.choices[0].token_ids != answer.choices[1].token_ids


@pytest.mark.parametrize("extra, fragment", [
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "must name one"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs {\"json_schema\""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "cannot be enforced"),
    ({"response_format": {"type": "yaml"}}, "'response_format' must be"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "send one"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "medium"}, "'reasoning_effort'"),
    ({"add_generation_prompt": "yes"}, "'add_generation_prompt'"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role must be one of"),
    ({"functions": [{"name": "f"}]}, "'functions'"),
])
def test_protocol_mistakes_are_400s(client, extra, fragment):
    body = {"model": "tiny", "messages": USER, "max_tokens": 2, **extra}
    response = httpx.post(f"{client.base_url}chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_cut_short_is_the_call_so_far(client, stream):
    """OpenAI's truncated call: finish reason "length", the call as far as it got in tool_calls, no
    DSML in content; streamed, its name and arguments go out as they are written."""
    request = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   temperature=1.0, seed=2)
    content, whole, finish, early = _chat(client, stream, max_tokens=300, **request)
    assert finish == "tool_calls" and content == "" and len(whole) == 1
    jsonschema.validate(json.loads(whole[0][1]), WEATHER_PARAMETERS)
    if stream:
        assert early >= 3  # the name, then pieces of the arguments, before the last chunk
    length = client.chat.completions.create(model="tiny", messages=USER, max_tokens=300,
                                            **request).usage.completion_tokens
    seen = set()
    for max_tokens in range(1, length, max(1, length // 12)):
        content, calls, finish, _ = _chat(client, stream, max_tokens=max_tokens, **request)
        assert finish == "length" and content == "" and len(calls) <= 1
        for name, arguments in calls:  # the same seed writes the same call: this one, as far as it got
            assert name == "get_weather" and whole[0][1].startswith(arguments)
            seen.add(arguments)
    assert len(seen) >= 3  # cut at several places inside the call


@pytest.mark.parametrize("stream", [False, True])
def test_chat_content_carries_no_special_token_text(client, stream):
    """A model that writes BOS or a role token mid-answer (this one, sampled near uniformly): their
    text is no part of the answer, which is decoded with the protocol's markers kept."""
    specials = [SPECIAL.index(t) for t in SPECIAL if t != SPECIAL[EOS]]
    written = 0
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, temperature=50.0,
                                                seed=seed, stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(answer)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            ids = [t for c in chunks for t in c.choices[0].token_ids]
        else:
            text, ids = answer.choices[0].message.content, answer.choices[0].token_ids
        written += sum(ids.count(t) for t in specials)
        assert not any(t in text for t in SPECIAL), text
    assert written > 0  # the case came up

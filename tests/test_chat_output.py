"""The V4-family output parser: reasoning, content and DSML tool calls (V4's spelling and
V4.1's spaced one), the same whether the text comes whole or split at any point, and no streamed
delta carrying partial markup."""

import json

import pytest

from dsv4c.runtime.serve.chat_output import ChatDelta, ChatOutputParser, ToolCall
from dsv4c.runtime.serve.dsml import THINK_END, V4_DSML, V41_DSML

CALLS = [ToolCall("get_weather", json.dumps({"city": "Paris", "days": 2, "tags": ["a</b>"]})),
         ToolCall("get_time", "{}")]
DIALECTS = {"V4": V4_DSML, "V4.1": V41_DSML}


def _cases(dsml):
    """(text, thinking, tools, reasoning, content, calls): what a whole output parses into, by hand."""
    block = dsml.tool_calls([("get_weather", {"city": "Paris", "days": 2, "tags": ["a</b>"]}), ("get_time", {})])
    second = block.index(f'{dsml.invoke_open} name="get_time"')
    broken_value = (f'\n\n{dsml.calls_open}\n{dsml.invoke_open} name="f">\n'
                    f'{dsml.parameter_open} name="a" string="false">not json{dsml.parameter_close}\n'
                    f'{dsml.invoke_close}\n{dsml.calls_close}')
    return [
        ("Let me think.</think>The answer is 4.", True, False, "Let me think.", "The answer is 4.", []),
        ("Still thinking when cut", True, True, "Still thinking when cut", "", []),
        ("a < b, x</thinking>", False, True, "", "a < b, x</thinking>", []),
        (f"I'll check.{block}", False, True, "", "I'll check.", CALLS),
        (f"Two.</think>{block}", True, True, "Two.", "", CALLS),
        (f"Skipped the end of thinking{block}", True, True, "Skipped the end of thinking", "", CALLS),
        (f"Calls{block}\nthen more words", False, True, "", "Calls\nthen more words", CALLS),
        # tool_choice "none": DSML is not parsed.
        (f"I'll check.{block}", False, False, "", f"I'll check.{block}", []),
        # Malformed DSML is content as written: a string="false" value that is not JSON, a block cut short.
        (f"x{broken_value}", False, True, "", f"x{broken_value}", []),
        (f"x{block[:60]}", False, True, "", f"x{block[:60]}", []),
        # Cut short after its first call: the call stands, what follows it is content.
        (f"x{block[:second + 10]}", False, True, "", f"x\n{block[second:second + 10]}", CALLS[:1]),
        # A good call, then garbage inside the same block: the call stands, the rest is content.
        (block.replace(f"{dsml.invoke_close}\n{dsml.invoke_open}", f"{dsml.invoke_close}\nbad{dsml.invoke_open}", 1),
         False, True, "", "\nbad" + block[second:], CALLS[:1]),
        # The other dialect's spelling is no call.
        (f"ok{(V4_DSML if dsml is V41_DSML else V41_DSML).tool_calls([('f', {})])}", False, True, "",
         f"ok{(V4_DSML if dsml is V41_DSML else V41_DSML).tool_calls([('f', {})])}", []),
    ]


CASES = [(name, *case) for name, dsml in DIALECTS.items() for case in _cases(dsml)]


def _parse(chunks, thinking, tools, dsml):
    parser = ChatOutputParser(thinking, tools, dsml)
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    total = ChatDelta()
    for d in deltas:
        total.add(d)
    return deltas, total


def _ends_in_a_marker_start(piece, markers):
    return any(piece.endswith(m[:k]) for m in markers for k in range(1, len(m)))


@pytest.mark.parametrize("dialect, text, thinking, tools, reasoning, content, calls", CASES)
def test_whole_text(dialect, text, thinking, tools, reasoning, content, calls):
    _, whole = _parse([text], thinking, tools, DIALECTS[dialect])
    assert (whole.reasoning, whole.content, whole.tool_calls) == (reasoning, content, calls)
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("dialect, text, thinking, tools, reasoning, content, calls", CASES)
def test_split_at_every_boundary_equals_the_whole(dialect, text, thinking, tools, reasoning, content, calls):
    dsml = DIALECTS[dialect]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    well_formed = "｜DSML｜" not in content
    block_markers = ("\n\n" + dsml.calls_open, dsml.calls_open) if tools else ()
    for chunks in splits:
        deltas, total = _parse(chunks, thinking, tools, dsml)
        assert (total.reasoning, total.content, total.tool_calls) == (reasoning, content, calls), chunks
        for d in deltas[:-1]:  # only the final flush may end in what looks like the start of a marker
            assert THINK_END not in d.reasoning
            assert not _ends_in_a_marker_start(d.reasoning, (THINK_END, *block_markers)), (d, chunks)
            if well_formed:
                assert "｜DSML｜" not in d.content and not _ends_in_a_marker_start(d.content, block_markers), (d, chunks)


@pytest.mark.parametrize("dsml", DIALECTS.values(), ids=DIALECTS)
def test_calls_stream_out_as_each_closes(dsml):
    block = dsml.tool_calls([("get_weather", {"city": "Paris", "days": 2, "tags": ["a</b>"]}), ("get_time", {})])
    parser = ChatOutputParser(thinking=False, tools=True, dsml=dsml)
    first_close = block.index(dsml.invoke_close) + len(dsml.invoke_close)
    assert parser.feed("ok" + block[:first_close - 1]).tool_calls == []
    assert parser.feed(block[first_close - 1:first_close]).tool_calls == CALLS[:1]
    rest = parser.feed(block[first_close:])
    assert rest.tool_calls == CALLS[1:] and rest.content == "" and parser.finish().content == ""


def test_a_v41_answer_as_the_release_writes_it():
    """The completion that sgl-project/sglang's test/registered/unit/entrypoints/openai/
    test_encoding_dsv41.py parses (its end of sentence left out, as the server's decoding does)."""
    text = ("  reason  </think>summary\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"lookup\">\n"
            '<｜DSML｜ parameter name="query" string="true">value</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="limit" string="false">2</｜DSML｜ parameter>\n'
            "</｜DSML｜ invoke>\n</｜DSML｜ calls>")
    _, whole = _parse([text], True, True, V41_DSML)
    assert (whole.reasoning, whole.content) == ("  reason  ", "summary")
    assert whole.tool_calls == [ToolCall("lookup", json.dumps({"query": "value", "limit": 2}))]


@pytest.mark.parametrize("dsml", DIALECTS.values(), ids=DIALECTS)
def test_a_block_cut_short_ends_in_the_call_it_was_writing(dsml):
    """Cut by max_tokens anywhere: no markup in content, the calls that closed, and the one being
    written as far as it is known (its name, then the start of its arguments); streamed, what
    :meth:`open_call` tells grows as the start of the whole call's arguments."""
    text = "ok" + dsml.tool_calls([("get_weather", {"city": "Paris", "days": 2, "tags": ["a</b>"]}),
                                   ("get_time", {})])
    first_header_end = text.index('"get_weather">') + len('"get_weather">')
    second_header_end = text.index('"get_time">') + len('"get_time">')
    city_start = text.index('string="true">') + len('string="true">')
    city_end = text.index(dsml.parameter_close) + len(dsml.parameter_close)
    streamed = ChatOutputParser(thinking=False, tools=True, dsml=dsml)
    known = {}
    for cut in range(len(text) + 1):
        streamed.feed(text[cut - 1:cut] if cut else "")
        if (writing := streamed.open_call()) is not None:
            assert writing.arguments.startswith(known.get(writing.name, "")), (cut, writing)
            known[writing.name] = writing.arguments
        parser = ChatOutputParser(thinking=False, tools=True, dsml=dsml)
        total = parser.feed(text[:cut]).add(parser.finish(truncated=True))
        assert total.content == "ok"[:cut] and total.reasoning == "", cut
        assert len(total.tool_calls) == (cut >= first_header_end) + (cut >= second_header_end), cut
        for call, whole in zip(total.tool_calls, CALLS):
            assert call.name == whole.name and whole.arguments.startswith(call.arguments), (cut, call)
        if city_start <= cut < city_end:  # the string as far as it came, not what may start its end tag
            value = "Paris"[:cut - city_start]
            assert total.tool_calls[0].arguments == '{"city": "' + value, (cut, total.tool_calls[0])
    assert known == {"get_weather": '{"city": "Paris", "days": 2, "tags": ["a</b>"]', "get_time": "{"}

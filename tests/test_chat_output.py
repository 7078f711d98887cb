"""The V4 output parser: reasoning, content and DSML tool calls, the same whether the text comes
whole or split at any point, and no streamed delta carrying partial markup."""

import json

import pytest

from dsv4c.runtime.serve.chat_output import ChatDelta, ChatOutputParser, ToolCall
from dsv4c.runtime.serve.dsml import THINK_END, V4_DSML

BLOCK = V4_DSML.tool_calls([("get_weather", {"city": "Paris", "days": 2, "tags": ["a</b>"]}), ("get_time", {})])
CALLS = [ToolCall("get_weather", json.dumps({"city": "Paris", "days": 2, "tags": ["a</b>"]})),
         ToolCall("get_time", "{}")]
SECOND = BLOCK.index('<｜DSML｜invoke name="get_time"')
BROKEN_VALUE = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
                '<｜DSML｜parameter name="a" string="false">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                '</｜DSML｜tool_calls>')

# (text, thinking, tools, reasoning, content, calls): what a whole output parses into, by hand.
CASES = [
    ("Let me think.</think>The answer is 4.", True, False, "Let me think.", "The answer is 4.", []),
    ("Still thinking when cut", True, True, "Still thinking when cut", "", []),
    ("a < b, x</thinking>", False, True, "", "a < b, x</thinking>", []),
    (f"I'll check.{BLOCK}", False, True, "", "I'll check.", CALLS),
    (f"Two.</think>{BLOCK}", True, True, "Two.", "", CALLS),
    (f"Skipped the end of thinking{BLOCK}", True, True, "Skipped the end of thinking", "", CALLS),
    (f"Calls{BLOCK}\nthen more words", False, True, "", "Calls\nthen more words", CALLS),
    # tool_choice "none": DSML is not parsed.
    (f"I'll check.{BLOCK}", False, False, "", f"I'll check.{BLOCK}", []),
    # Malformed DSML is content as written: a string="false" value that is not JSON, a block cut short.
    (f"x{BROKEN_VALUE}", False, True, "", f"x{BROKEN_VALUE}", []),
    (f"x{BLOCK[:60]}", False, True, "", f"x{BLOCK[:60]}", []),
    # Cut short after its first call: the call stands, what follows it is content.
    (f"x{BLOCK[:SECOND + 10]}", False, True, "", f"x\n{BLOCK[SECOND:SECOND + 10]}", CALLS[:1]),
    # A good call, then garbage inside the same block: the call stands, the rest is content.
    (BLOCK.replace("</｜DSML｜invoke>\n<｜DSML｜invoke", "</｜DSML｜invoke>\nbad<｜DSML｜invoke", 1), False, True, "",
     "\nbad" + BLOCK[BLOCK.index('<｜DSML｜invoke name="get_time"'):], CALLS[:1]),
]
BLOCK_MARKERS = ("\n\n" + V4_DSML.calls_open, V4_DSML.calls_open)


def _parse(chunks, thinking, tools):
    parser = ChatOutputParser(thinking, tools)
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    total = ChatDelta()
    for d in deltas:
        total.add(d)
    return deltas, total


def _ends_in_a_marker_start(piece, markers):
    return any(piece.endswith(m[:k]) for m in markers for k in range(1, len(m)))


@pytest.mark.parametrize("text, thinking, tools, reasoning, content, calls", CASES)
def test_whole_text(text, thinking, tools, reasoning, content, calls):
    _, whole = _parse([text], thinking, tools)
    assert (whole.reasoning, whole.content, whole.tool_calls) == (reasoning, content, calls)
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("text, thinking, tools, reasoning, content, calls", CASES)
def test_split_at_every_boundary_equals_the_whole(text, thinking, tools, reasoning, content, calls):
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    well_formed = "｜DSML｜" not in content
    block_markers = BLOCK_MARKERS if tools else ()
    for chunks in splits:
        deltas, total = _parse(chunks, thinking, tools)
        assert (total.reasoning, total.content, total.tool_calls) == (reasoning, content, calls), chunks
        for d in deltas[:-1]:  # only the final flush may end in what looks like the start of a marker
            assert THINK_END not in d.reasoning
            assert not _ends_in_a_marker_start(d.reasoning, (THINK_END, *block_markers)), (d, chunks)
            if well_formed:
                assert "｜DSML｜" not in d.content and not _ends_in_a_marker_start(d.content, block_markers), (d, chunks)


def test_calls_stream_out_as_each_closes():
    parser = ChatOutputParser(thinking=False, tools=True)
    first_close = BLOCK.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>")
    assert parser.feed("ok" + BLOCK[:first_close - 1]).tool_calls == []
    assert parser.feed(BLOCK[first_close - 1:first_close]).tool_calls == CALLS[:1]
    rest = parser.feed(BLOCK[first_close:])
    assert rest.tool_calls == CALLS[1:] and rest.content == "" and parser.finish().content == ""

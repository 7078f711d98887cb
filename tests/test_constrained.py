"""Constrained decoding offline: a request's grammar fed V4 output token by token through its
logits processor (the masks the engine applies), thinking mode included."""

import json

import numpy as np
import pytest

from dsv4c.runtime.serve.chat import ChatProtocol, chat_options
from dsv4c.runtime.serve.constrained import response_format_grammar, tool_call_grammar
from dsv4c.runtime.serve.dsml import THINK_END, V4_DSML, V41_DSML

from test_chat_serve import ANSWER_SCHEMA, CORPUS, EOS
from v4_tokenizer import THINK_END_ID, write_v4_tokenizer

VOCAB = 512
REASONING = 'The user wants {"city": ...}; Paris, so celsius.'
# A plain string parameter is written as is, as V4's encoder writes calls in a conversation's history.
WEATHER = {"type": "object", "required": ["city", "unit"],
           "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
# The city's text holds the start of its parameter's closing marker.
CALL = V4_DSML.tool_calls([("get_weather", {"city": "Paris </b></｜DSML｜", "unit": "c", "days": 3})])
ANSWER = json.dumps({"name": "Ann", "age": 30, "tags": ["a"]})
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": ANSWER_SCHEMA}}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """The chat protocol of a V4 model (no template) with the chat tests' tokenizer."""
    from tokenizers import Tokenizer

    model = tmp_path_factory.mktemp("tokenizer")
    write_v4_tokenizer(model, CORPUS * 10, VOCAB)
    return ChatProtocol(model, None, "deepseek_v4", VOCAB, (EOS,), Tokenizer.from_file(str(model / "tokenizer.json")))


@pytest.fixture(scope="module")
def chat41(chat):
    """The same for a V4.1 model: the same tokenizer, V4.1's encoding."""
    return ChatProtocol(chat.grammar.path.parent, None, "deepseek_v41", VOCAB, (EOS,), chat.tokenizer)


def _encode(chat, text: str) -> list[int]:
    return chat.tokenizer.encode(text, add_special_tokens=False).ids


def _feed(constraint, ids: list[int]) -> np.ndarray | None:
    """The mask after ``ids``, each taken as the engine would; None when one of them is masked."""
    for token in ids:
        if not np.isfinite(constraint.mask(np.zeros(VOCAB, np.float32))[token]):
            return None
        constraint.accept(token)
    return constraint.mask(np.zeros(VOCAB, np.float32))


def _allowed(mask) -> list[int]:
    return np.flatnonzero(np.isfinite(mask)).tolist()


GRAMMARS = {"tool_call": lambda *think: tool_call_grammar(TOOLS, ["get_weather"], False, *think),
            "json_schema": lambda *think: response_format_grammar(RESPONSE_FORMAT, *think)}
ANSWERS = {"tool_call": CALL, "json_schema": ANSWER}


@pytest.mark.parametrize("kind", GRAMMARS)
@pytest.mark.parametrize("added", [True, False], ids=["think-token", "think-text"])
def test_thinking_reasons_then_answers_under_the_constraint(chat, kind, added):
    tokens, tokenizer, encode = chat.grammar, chat.tokenizer, lambda text: _encode(chat, text)
    # </think> as the added token a V4 model writes, or (a tokenizer without it) spelled as text.
    assert tokens.think_token() == THINK_END_ID
    think_end = [THINK_END_ID] if added else encode("</") + encode("think") + encode(">")
    assert tokenizer.decode(think_end, skip_special_tokens=False) == THINK_END
    thinking = lambda: tokens.constraint(GRAMMARS[kind](True, THINK_END_ID if added else None), kind)  # noqa: E731
    answer = encode(ANSWERS[kind])
    # Reasoning, </think>, then the answer: every token allowed, and then only EOS.
    assert _allowed(_feed(thinking(), encode(REASONING) + think_end + answer)) == [EOS]
    # The answer alone reads as reasoning still open: the request may not end there.
    assert EOS not in _allowed(_feed(thinking(), answer))
    # Without thinking the answer comes first: the reasoning's first token is refused.
    assert _feed(tokens.constraint(GRAMMARS[kind](False), kind), encode(REASONING) + think_end + answer) is None
    assert _allowed(_feed(tokens.constraint(GRAMMARS[kind](False), kind), answer)) == [EOS]


@pytest.mark.parametrize("constraint", [{"tools": TOOLS, "tool_choice": "required"},
                                        {"response_format": RESPONSE_FORMAT}], ids=GRAMMARS)
def test_a_chat_requests_thinking_option_reaches_its_constraint(chat, constraint):
    kind = "tool_call" if "tools" in constraint else "json_schema"
    reasoned = _encode(chat, REASONING) + [THINK_END_ID] + _encode(chat, ANSWERS[kind])
    thinking = chat_options({**constraint, "chat_template_kwargs": {"thinking": True}})
    assert _allowed(_feed(chat.constraint(thinking), reasoned)) == [EOS]
    assert _feed(chat.constraint(chat_options(constraint)), reasoned) is None


def test_a_v41_forced_call_is_written_in_v41s_dsml(chat, chat41):
    forced = chat_options({"tools": TOOLS, "tool_choice": "required"})
    v41_call = _encode(chat41, V41_DSML.tool_calls([("get_weather", {"city": "Paris", "unit": "c"})]))
    assert _allowed(_feed(chat41.constraint(forced), v41_call)) == [EOS]
    assert _feed(chat41.constraint(forced), _encode(chat41, CALL)) is None
    assert _feed(chat.constraint(forced), v41_call) is None

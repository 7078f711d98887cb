"""Constrained decoding: grammars for ``response_format`` and forced tool calls, and the token
mask that holds a request to them, by llguidance.

The grammar tokenizer (llguidance's view of every token's bytes) is built once per server; each
request compiles its grammar into a matcher, and the engine thread calls it before sampling
each token (``SamplingParams.logits_processor``): tokens the grammar does not allow get -inf.

A forced call is written as the model's DSML (V4's or V4.1's spelling: :mod:`.dsml`) with its
arguments in the schema's property order, required ones always and optional ones at the model's
choice. Strings go as written (``string="true"``) when the schema says only "a string" or lists
its values; a string with any other constraint (pattern, length, format) goes as a JSON string
(``string="false"``), which the grammar checks against the schema like every other value."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from dsv4c.runtime.serve.dsml import THINK_END, TOOL_CALLS_SEPARATOR, V4_DSML, Dsml
from dsv4c.runtime.serve.protocol import bad_request

# Compact JSON as the release's encoder writes it (json.dumps' separators), with no free
# whitespace: a grammar that allows whitespace lets a model pad forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A string "as written" may be anything but the end of its parameter.
_PLAIN_STRING_KEYS = {"type", "description", "title"}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _escaped(marker: str) -> str:
    return "".join(f"\\{c}" if c in "\\/.^$*+?()[]{}|-" else c for c in marker)


def _through(marker: str) -> str:
    """A lark rule body for a lazy rule (``name[lazy]: ...``): any text up to the first ``marker``
    and the marker. llguidance's lexer is greedy, so a terminal of "text without the marker"
    followed by the marker as text never ends: it takes the marker's first bytes as its own."""
    return f"/(.|\\n)*{_escaped(marker)}/"


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def _start(body: str, thinking: bool, think_token: int | None) -> list[str]:
    """The start rule: in thinking mode the reasoning comes first, up to ``</think>``, the added
    token ``think_token`` (see :meth:`GrammarTokenizer.think_token`) or else text."""
    if not thinking:
        return [f"start: {body}"]
    if think_token is None:
        return [f"start: reasoning {body}", f"reasoning[lazy]: {_through(THINK_END)}"]
    # Text cannot match an added token: the reasoning is a terminal that ends where the token comes
    # (and cannot spell ``</think>`` out either, which would end it for the output parser).
    return [f"start: REASONING <[{think_token}]> {body}",
            f"REASONING: /(.|\\n)*/ & ~/(.|\\n)*{_escaped(THINK_END)}(.|\\n)*/"]


def response_format_grammar(response_format: dict, thinking: bool, think_token: int | None = None) -> str:
    schema = {"type": "object"} if response_format["type"] == "json_object" else \
        response_format["json_schema"]["schema"]
    return "\n".join(_start("answer", thinking, think_token) + [f"answer: {_json_rule(schema)}"])


def _parameter_rules(tool: str, schema: dict, dsml: Dsml) -> tuple[str, list[str]]:
    """The rule of one tool's parameters (in property order) and the rules it needs."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    close, newline = _lit(dsml.parameter_close + "\n"), _lit("\n")
    parts, rules = [], []
    for i, (key, sub) in enumerate(properties.items()):
        rule = f"{tool}_p{i}"
        as_written = _lit(f'{dsml.parameter_open} name="{key}" string="true">')
        as_json = _lit(f'{dsml.parameter_open} name="{key}" string="false">')
        plain = isinstance(sub, dict) and sub.get("type") == "string"
        if plain and set(sub) <= _PLAIN_STRING_KEYS:
            rules += [f"{rule}: {as_written} {rule}_text {newline}",
                      f"{rule}_text[lazy]: {_through(dsml.parameter_close)}"]
        elif plain and isinstance(sub.get("enum"), list) and set(sub) <= _PLAIN_STRING_KEYS | {"enum"}:
            rules.append(f"{rule}: {as_written} ({' | '.join(_lit(str(v)) for v in sub['enum'])}) {close}")
        else:
            value = {**defs, **sub} if isinstance(sub, dict) else sub
            rules += [f"{rule}: {as_json} {rule}_value {close}", f"{rule}_value: {_json_rule(value)}"]
        parts.append(rule if key in required else f"{rule}?")
    # No parameters: the release writes the empty list as an empty line.
    return (" ".join(parts) if parts else _lit("\n")), rules


def tool_call_grammar(tools: list[dict], names: list[str], many: bool, thinking: bool,
                      think_token: int | None = None, dsml: Dsml = V4_DSML) -> str:
    """Output that is one DSML tool-calls block (in ``dsml``'s spelling) calling the named tools
    (``many``: one or more calls, else exactly one), with arguments that satisfy each tool's
    parameters schema."""
    rules, invokes = [], []
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    for k, name in enumerate(names):
        schema = by_name[name].get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise bad_request(f"tool {name!r}: 'parameters' must be an object schema for tool_choice to force "
                              "its call", "tools")
        params, needed = _parameter_rules(f"t{k}", schema, dsml)
        head = _lit(f'{dsml.invoke_open} name="{name}">\n')
        rules += [f"invoke{k}: {head} {params} {_lit(dsml.invoke_close)}", *needed]
        invokes.append(f"invoke{k}")
    newline, closing = _lit("\n"), _lit(f"\n{dsml.calls_close}")
    opening = _lit(f"{TOOL_CALLS_SEPARATOR}{dsml.calls_open}\n")
    calls = f"invoke ({newline} invoke)*" if many else "invoke"
    block = f"{opening} {calls} {closing}"
    return "\n".join(_start("block", thinking, think_token)
                     + [f"block: {block}", "invoke: " + " | ".join(invokes), *rules])


class GrammarTokenizer:
    """llguidance's tokenizer for one served model, built once (on first use: a second for a
    130k vocabulary), shared by every request's matcher."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos: tuple[int, ...]):
        self.path, self.vocab_size, self.eos = tokenizer_json, vocab_size, eos
        self._built = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._built is None:
                try:
                    from llguidance import LLTokenizer
                except ModuleNotFoundError:
                    raise bad_request("constrained decoding (tool_choice 'required' or a named tool, "
                                      "response_format) needs the llguidance package: pip install 'dsv4c[serve]'",
                                      code="unsupported_option") from None
                try:
                    self._built = LLTokenizer(self.path.read_text(), n_vocab=self.vocab_size,
                                              eos_token=list(self.eos))
                except ValueError as e:  # a tokenizer it cannot read (a word-level one has no decoder)
                    raise bad_request(f"this model's tokenizer.json cannot drive constrained decoding (tool_choice "
                                      f"'required' or a named tool, response_format): llguidance: {e}",
                                      code="unsupported_option") from None
            return self._built

    def think_token(self) -> int | None:
        """``</think>``'s id where it is an added token (as in DeepSeek's tokenizers): llguidance
        matches an added token only by its id, never as the text it decodes to."""
        tok = self.get()
        ids = tok.tokenize_str(THINK_END)
        return ids[0] if len(ids) == 1 and tok.is_special_token(ids[0]) else None

    def constraint(self, grammar: str, param: str) -> "GrammarConstraint":
        from llguidance import LLMatcher

        matcher = LLMatcher(self.get(), grammar, log_level=0)
        if matcher.is_error():
            raise bad_request(f"'{param}' cannot be enforced: {matcher.get_error()}", param)
        return GrammarConstraint(matcher, self.vocab_size, self.eos)


class GrammarConstraint:
    """One request's grammar state: masks the logits of each step, follows the tokens taken."""

    def __init__(self, matcher, vocab_size: int, eos: tuple[int, ...]):
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, eos

    def mask(self, logits: np.ndarray) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if not allowed.any():  # the grammar is done (or the request went on past EOS): only EOS
            allowed[list(self.eos)] = True
        return np.where(allowed, logits, -np.inf)

    def accept(self, token: int) -> None:
        # A token the grammar refuses can only be one generated past its end (ignore_eos).
        self.matcher.consume_token(token)

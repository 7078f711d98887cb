"""The conversation protocol of chat requests: which prompt a chat request makes (the model's
Jinja template when it has one, else the DeepSeek V4 family's own encoding: V4's or V4.1's, by
the artifact's ``model_type``), its tool and structured-output options, and how the answer is
shaped (reasoning, content and tool calls parsed from the model's output).

A V4.1 model with a vision tower takes images too (docs/vision_serving.md): each image part of
a message becomes the encoding's ``<｜deepseek_image｜>``, expanded to the positions of the
image's span, whose pixels go with the prompt to the engine.

Options beyond OpenAI's: ``chat_template_kwargs`` (``{"thinking": true}`` turns thinking mode
on, as in vLLM; with a Jinja template, they are the template's variables),
``add_generation_prompt`` (default true) and ``reasoning_effort`` (V4: ``high`` or ``max``;
V4.1: ``low``, ``high``, ``xhigh``, ``max`` or an integer budget in [1, 100])."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dsv4c.artifact.file_names import TOKENIZER
from dsv4c.artifact.vision import VisionGeometry
from dsv4c.errors import UsageError
from dsv4c.runtime.request import ImageSpan
from dsv4c.runtime.serve import dsv4_encoding, dsv41_encoding
from dsv4c.runtime.serve.chat_output import ChatOutputParser, ToolCall
from dsv4c.runtime.serve.constrained import GrammarTokenizer, response_format_grammar, tool_call_grammar
from dsv4c.runtime.serve.dsml import THINK_END, THINK_START, V4_DSML, V41_DSML, Dsml
from dsv4c.runtime.serve.protocol import APIError, ChatCompletions, bad_request, chat_request, image_urls
from dsv4c.runtime.serve.text import ChatTemplate
from dsv4c.runtime.vision.intake import ImageError, ImageIntake
from dsv4c.runtime.vision.processor import expand_image_placeholders, preprocess

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; it also keeps names safe inside DSML
V4_TEMPLATE_KWARGS = {"thinking"}


@dataclass(frozen=True)
class DeepSeekEncoding:
    """The conversation protocol of a V4-family model (its checkpoints ship no Jinja template):
    the prompt of a conversation, and the DSML its answers call tools in."""

    name: str
    encode_chat: Callable[..., str]
    dsml: Dsml
    images: bool = False  # whether it writes a placeholder for each image part


ENCODINGS = {"deepseek_v4": DeepSeekEncoding("V4", dsv4_encoding.encode_chat, V4_DSML),
             "deepseek_v41": DeepSeekEncoding("V4.1", dsv41_encoding.encode_chat, V41_DSML, images=True)}
ENCODINGS["deepseek_v41_text"] = ENCODINGS["deepseek_v41"]  # how an artifact's manifest spells V4.1's text model


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat request runs: its prompt tokens (each image's span expanded) and its images."""

    token_ids: list[int]
    images: tuple[ImageSpan, ...] = ()


@dataclass(frozen=True)
class ChatOptions:
    tools: list[dict] = field(default_factory=list)
    tool_choice: str = "none"  # "none", "auto", "required", or "function" (then ``function`` names it)
    function: str | None = None
    response_format: dict | None = None  # json_object or json_schema; None: text
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True

    @property
    def thinking(self) -> bool:
        return self.template_kwargs.get("thinking") is True

    @property
    def forced(self) -> bool:
        """Whether the answer must be a tool call."""
        return self.tool_choice in ("required", "function")


def _tools(value) -> list[dict]:
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and _TOOL_NAME.fullmatch(function["name"])
                and isinstance(function.get("parameters", {}), dict)):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": NAME, "
                              "\"parameters\": JSON SCHEMA}}}} with NAME of letters, digits, _ and - (64 at most)",
                              "tools")
    names = [t["function"]["name"] for t in value]
    if len(set(names)) < len(names):
        raise bad_request("tools must have distinct names", "tools")
    return value


def _response_format(value) -> dict | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return value
    if kind == "json_schema":
        spec = value.get("json_schema")
        if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
            return value
        raise bad_request("'response_format' json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                          "response_format")
    raise bad_request("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                      "response_format")


_FUNCTION = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
# What chat_options accepts, for /openapi.json.
CHAT_OPTIONS_SCHEMA = {
    "tools": {"type": "array", "items": {**_FUNCTION, "properties": {**_FUNCTION["properties"], "function": {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string", "pattern": f"^{_TOOL_NAME.pattern}$"},
                       "description": {"type": "string"}, "parameters": {"type": "object"}}}}}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, _FUNCTION]},
    "response_format": {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"}, "json_schema": {
                "type": "object", "required": ["schema"],
                "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}}}}]},
    "chat_template_kwargs": {"type": "object"},
    "reasoning_effort": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "add_generation_prompt": {"type": "boolean"},
}


def chat_options(body: dict) -> ChatOptions:
    """The conversation-protocol options of a chat request body, checked (400 on a mistake)."""
    tools = _tools(body["tools"]) if body.get("tools") is not None else []
    choice = body.get("tool_choice")
    function = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        function = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if function not in {t["function"]["name"] for t in tools}:
            raise bad_request("'tool_choice' must name one of the request's tools: {\"type\": \"function\", "
                              "\"function\": {\"name\": NAME}}", "tool_choice")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or a named function",
                          "tool_choice")
    if choice == "required" and not tools:
        raise bad_request("tool_choice \"required\" needs 'tools'", "tool_choice")
    response_format = _response_format(body["response_format"]) if body.get("response_format") is not None else None
    if response_format is not None and choice in ("required", "function"):
        raise bad_request("'response_format' and a forced tool call both constrain the answer: send one",
                          "response_format")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str) and type(effort) is not int:
        raise bad_request("'reasoning_effort' must be a string (or V4.1's integer budget)", "reasoning_effort")
    generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise bad_request("'add_generation_prompt' must be true or false", "add_generation_prompt")
    return ChatOptions(tools, choice, function, response_format, kwargs, effort, generation_prompt)


class ChatProtocol:
    """One server's chat: its Jinja template or its V4-family encoding, and its grammar tokenizer."""

    def __init__(self, artifact: Path, template: ChatTemplate | None, model_type: str, vocab_size: int,
                 eos: tuple[int, ...], tokenizer=None, vision: VisionGeometry | None = None):
        self.template, self.tokenizer = template, tokenizer
        # A template, when the model ships one, wins; V4 and V4.1 checkpoints ship none.
        self.encoding = ENCODINGS.get(model_type) if template is None else None
        # Images need a vision tower and an encoding that places them.
        self.vision = vision if self.encoding is not None and self.encoding.images else None
        path = Path(artifact) / TOKENIZER
        self.grammar = GrammarTokenizer(path, vocab_size, eos) if tokenizer is not None else None
        self.unshown = set(eos) | (self._unmarked_specials() if self.v4 and tokenizer is not None else set())

    def _unmarked_specials(self) -> set[int]:
        """The special tokens that no marker of the output parser holds (BOS, role tokens): their
        text is no part of an answer."""
        dsml = self.encoding.dsml
        markers = (THINK_START, THINK_END, dsml.calls_open, dsml.calls_close, dsml.invoke_open, dsml.invoke_close,
                   dsml.parameter_open, dsml.parameter_close)
        return {i for i, token in self.tokenizer.get_added_tokens_decoder().items()
                if token.special and not any(token.content in m for m in markers)}

    @classmethod
    def of(cls, engine, template: ChatTemplate | None) -> "ChatProtocol":
        """The chat of an :class:`~dsv4c.runtime.engine.Engine`'s artifact."""
        return cls(engine.path, template, engine.manifest.model.get("model_type"), engine.config.vocab_size,
                   tuple(engine.config.eos_token_ids), engine.tokenizer,
                   VisionGeometry.from_manifest(engine.manifest.vision) if engine.manifest.vision else None)

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    @property
    def v4(self) -> bool:
        """Whether a V4-family encoding (V4's or V4.1's) writes the prompt and parses the answer."""
        return self.encoding is not None

    @property
    def summary(self) -> str:
        """For the server's banner."""
        if not self.v4:
            return ", chat (template)" if self.template else ""
        return f", chat ({self.encoding.name} encoding{', images' if self.takes_images else ''})"

    def decode_output(self, ids: list[int]) -> str:
        """Generated text as the V4-family output parser reads it: the special tokens of its markers
        kept (they must survive whichever of them a tokenizer calls special), the others (the stop
        tokens, BOS, role tokens) left out, so that no answer carries their text."""
        return self.tokenizer.decode([t for t in ids if t not in self.unshown], skip_special_tokens=False)

    def prompt_text(self, messages: list[dict], options: ChatOptions) -> str:
        tools = options.tools if options.tool_choice != "none" else []
        if self.template is not None:
            return self.template.render(messages, add_generation_prompt=options.add_generation_prompt,
                                        tools=tools or None, reasoning_effort=options.reasoning_effort,
                                        **options.template_kwargs)
        if not self.v4:
            raise bad_request("this model has no chat_template in tokenizer_config.json: use /v1/completions",
                              "messages", "no_chat_template")
        unknown = set(options.template_kwargs) - V4_TEMPLATE_KWARGS
        if unknown or not isinstance(options.template_kwargs.get("thinking", False), bool):
            raise bad_request(f"{self.encoding.name}'s encoding takes chat_template_kwargs {{\"thinking\": "
                              f"true|false}}, got {sorted(options.template_kwargs)}", "chat_template_kwargs")
        return self.encoding.encode_chat(messages, tools=tools, response_format=options.response_format,
                                         thinking=options.thinking, reasoning_effort=options.reasoning_effort,
                                         add_generation_prompt=options.add_generation_prompt)

    def prompt(self, messages: list[dict], options: ChatOptions, intake: ImageIntake) -> ChatPrompt:
        """The prompt of checked ``messages`` (the model must have a tokenizer) with its images,
        each read as ``intake`` allows, decoded and processed: what chat completions, /tokenize and
        ``dsv4c generate --messages`` run. A bad image is a 400 naming its part."""
        urls = image_urls(messages)
        try:
            intake.check_count(len(urls))
        except ImageError as e:
            raise bad_request(str(e), "messages", e.code) from None
        # The template (or the V4-family encoding) writes the special tokens (BOS, role markers) itself.
        text = self.prompt_text(messages, options)
        if not urls:
            return ChatPrompt(self.tokenizer.encode(text, add_special_tokens=False).ids)
        # Each image's placeholder (typed ones are escaped: these are the image parts') is the image
        # token, as the release's tokenizer splits the text at that special token; the text between
        # is tokenized as it would be there, whichever tokens a tokenizer has.
        pieces = [self.tokenizer.encode(piece, add_special_tokens=False).ids
                  for piece in text.split(dsv41_encoding.IMAGE_PLACEHOLDER)]
        ids = pieces[0] + [t for piece in pieces[1:] for t in (self.vision.image_token_id, *piece)]
        processed = []
        for where, url in urls:
            try:
                processed.append(preprocess(intake.load(url), self.vision))
            except ImageError as e:
                raise bad_request(f"{where}: {e}", "messages", e.code) from None
        ids, starts = expand_image_placeholders(ids, processed, self.vision.image_token_id)
        return ChatPrompt(ids, tuple(ImageSpan(start, p.pixels, p.token_count, p.digest)
                                     for start, p in zip(starts, processed)))

    def constraint(self, options: ChatOptions):
        """The request's logits processor, or None when nothing constrains its answer."""
        forced = options.forced
        if not forced and options.response_format is None:
            return None
        param = "tool_choice" if forced else "response_format"
        if forced and not self.v4:
            raise bad_request("a forced tool call is written as V4's DSML: it needs V4's own encoding (this "
                              "model has a Jinja chat_template)", "tool_choice", "unsupported_option")
        if self.grammar is None:
            raise bad_request("this model has no tokenizer.json: nothing to constrain", param, "no_tokenizer")
        thinking = self.v4 and options.thinking
        think_token = self.grammar.think_token() if thinking else None
        if forced:
            names = [t["function"]["name"] for t in options.tools] if options.function is None else [options.function]
            grammar = tool_call_grammar(options.tools, names, options.function is None, thinking, think_token,
                                        self.encoding.dsml)
        else:
            grammar = response_format_grammar(options.response_format, thinking, think_token)
        return self.grammar.constraint(grammar, param)

    def endpoint(self, options: ChatOptions):
        if not self.v4:
            return ChatCompletions
        return V4ChatCompletions(options.thinking, options.tool_choice != "none", self.encoding.dsml,
                                 stream_calls=options.forced)


def read_messages(path: str | Path) -> list[dict]:
    """``dsv4c generate --messages FILE``: a JSON list of OpenAI chat messages."""
    try:
        messages = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--messages {path}: {e}") from None
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                            for m in messages)):
        raise UsageError(f"--messages {path}: not a JSON list of messages with a 'role' each")
    return messages


def count_image_parts(messages: list[dict]) -> int:
    """The image parts of unchecked ``messages`` (what a prompt must make room for)."""
    return sum(isinstance(part, dict) and part.get("type") == "image_url" for m in messages
               if isinstance(m.get("content"), list) for part in m["content"])


def messages_prompt(engine, messages: list[dict], thinking: bool, intake: ImageIntake) -> ChatPrompt:
    """The prompt ``dsv4c serve`` makes of a chat request with these messages and its images,
    by the same path (``dsv4c generate --messages``)."""
    if engine.tokenizer is None:
        raise UsageError(f"{engine.path} has no tokenizer.json; --messages needs one")
    chat = ChatProtocol.of(engine, ChatTemplate.from_artifact(engine.path))
    try:
        checked, _ = chat_request({"messages": messages}, chat.takes_images)
        return chat.prompt(checked, ChatOptions(template_kwargs={"thinking": thinking}), intake)
    except APIError as e:
        raise UsageError(f"--messages: {e.message}") from None


class V4ChatCompletions(ChatCompletions):
    """``/v1/chat/completions`` shapes with a V4-family model's output parsed (``dsml``: its
    spelling of tool calls): ``reasoning_content`` (thinking mode), ``content`` and
    ``tool_calls``, whole and streamed; one per request (the stream's parser is its state).

    A call cut short by ``max_tokens`` is in ``tool_calls`` as far as it got (finish reason
    ``length``). Streamed, a forced call (``stream_calls``: its grammar keeps it well-formed) goes
    out as it is written: its name, then its arguments in pieces; other calls go out as each
    closes, since DSML the model gets wrong turns out to be content only then."""

    def __init__(self, thinking: bool, tools: bool, dsml: Dsml, stream_calls: bool = False):
        self.thinking, self.tools, self.dsml, self.stream_calls = thinking, tools, dsml, stream_calls
        self.stream = ChatOutputParser(thinking, tools, dsml)
        self.calls_sent = 0
        self.arguments_sent: str | None = None  # of the call being streamed (None: no call is)

    def _start(self, call: ToolCall) -> dict:
        self.calls_sent += 1
        return {"index": self.calls_sent - 1, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def _more(self, arguments: str) -> dict:
        """The next piece of the streamed call's arguments (those sent are the start of ``arguments``)."""
        piece, self.arguments_sent = arguments[len(self.arguments_sent):], arguments
        return {"index": self.calls_sent - 1, "function": {"arguments": piece}}

    def _calls(self, calls: list[ToolCall], writing: ToolCall | None = None) -> list[dict]:
        """The ``tool_calls`` entries for calls that closed (or were cut short), the first of them
        perhaps the rest of the call being streamed, and what is new of the one being written."""
        out = []
        for call in calls:
            if self.arguments_sent is not None:
                out.append(self._more(call.arguments))
                self.arguments_sent = None
            else:
                out.append(self._start(call))
        if writing is not None and self.arguments_sent is None:
            out.append(self._start(writing))
            self.arguments_sent = writing.arguments
        elif writing is not None and len(writing.arguments) > len(self.arguments_sent):
            out.append(self._more(writing.arguments))
        return out

    def _finish(self, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and self.calls_sent else finish

    def choice(self, index: int, text: str, token_ids: list[int], finish: str | None,
               logprobs: dict | None = None) -> dict[str, Any]:
        parser = ChatOutputParser(self.thinking, self.tools, self.dsml)
        delta = parser.feed(text).add(parser.finish(truncated=finish == "length"))
        message = {"role": "assistant", "content": delta.content if delta.content or not delta.tool_calls else None}
        if self.thinking:
            message["reasoning_content"] = delta.reasoning
        calls = self._calls(delta.tool_calls)
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": self._finish(finish),
                "token_ids": token_ids}

    def chunk_choice(self, index: int, text: str, token_ids: list[int], finish: str | None,
                     logprobs: dict | None = None) -> dict[str, Any]:
        delta = self.stream.feed(text)
        if finish is not None:
            delta.add(self.stream.finish(truncated=finish == "length"))
        writing = self.stream.open_call() if self.stream_calls and finish is None else None
        calls = self._calls(delta.tool_calls, writing)
        shaped: dict[str, Any] = {}
        if delta.reasoning:
            shaped["reasoning_content"] = delta.reasoning
        if delta.content or not (delta.reasoning or calls):
            shaped["content"] = delta.content
        if calls:
            shaped["tool_calls"] = calls
        return {"index": index, "delta": shaped, "logprobs": logprobs, "finish_reason": self._finish(finish),
                "token_ids": token_ids}

"""The conversation protocol of chat requests: which prompt a chat request makes (the model's
Jinja template when it has one, else DeepSeek-V4's own encoding), its tool and structured-output
options, and how the answer is shaped (reasoning, content and tool calls parsed from V4's
output).

Options beyond OpenAI's: ``chat_template_kwargs`` (``{"thinking": true}`` turns V4's thinking
mode on, as in vLLM; with a Jinja template, they are the template's variables),
``add_generation_prompt`` (default true) and ``reasoning_effort`` (V4: ``high`` or ``max``)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4c.artifact.file_names import TOKENIZER
from dsv4c.runtime.serve.chat_output import ChatDelta, ChatOutputParser
from dsv4c.runtime.serve.constrained import GrammarTokenizer, response_format_grammar, tool_call_grammar
from dsv4c.runtime.serve.dsv4_encoding import encode_chat
from dsv4c.runtime.serve.protocol import ChatCompletions, bad_request
from dsv4c.runtime.serve.text import ChatTemplate

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; it also keeps names safe inside DSML
V4_TEMPLATE_KWARGS = {"thinking"}


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
    if effort is not None and not isinstance(effort, str):
        raise bad_request("'reasoning_effort' must be a string", "reasoning_effort")
    generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise bad_request("'add_generation_prompt' must be true or false", "add_generation_prompt")
    return ChatOptions(tools, choice, function, response_format, kwargs, effort, generation_prompt)


class ChatProtocol:
    """One server's chat: its Jinja template or V4's encoding, and its grammar tokenizer."""

    def __init__(self, artifact: Path, template: ChatTemplate | None, model_type: str, vocab_size: int,
                 eos: tuple[int, ...], tokenizer=None):
        self.template, self.tokenizer, self.eos = template, tokenizer, eos
        # A template, when the model ships one, wins; V4 checkpoints ship none.
        self.v4 = template is None and model_type == "deepseek_v4"
        path = Path(artifact) / TOKENIZER
        self.grammar = GrammarTokenizer(path, vocab_size, eos) if tokenizer is not None else None

    @classmethod
    def of(cls, engine, template: ChatTemplate | None) -> "ChatProtocol":
        """The chat of an :class:`~dsv4c.runtime.engine.Engine`'s artifact."""
        return cls(engine.path, template, engine.manifest.model.get("model_type"), engine.config.vocab_size,
                   tuple(engine.config.eos_token_ids), engine.tokenizer)

    @property
    def summary(self) -> str:
        """For the server's banner."""
        return ", chat (template)" if self.template else ", chat (V4 encoding)" if self.v4 else ""

    def decode_output(self, ids: list[int]) -> str:
        """Generated text as V4's output parser reads it: special tokens kept (the markers must
        survive whichever of them a tokenizer calls special), the stop tokens left out."""
        return self.tokenizer.decode([t for t in ids if t not in self.eos], skip_special_tokens=False)

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
            raise bad_request(f"V4's encoding takes chat_template_kwargs {{\"thinking\": true|false}}, got "
                              f"{sorted(options.template_kwargs)}", "chat_template_kwargs")
        return encode_chat(messages, tools=tools, response_format=options.response_format, thinking=options.thinking,
                           reasoning_effort=options.reasoning_effort,
                           add_generation_prompt=options.add_generation_prompt)

    def constraint(self, options: ChatOptions):
        """The request's logits processor, or None when nothing constrains its answer."""
        forced = options.tool_choice in ("required", "function")
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
            grammar = tool_call_grammar(options.tools, names, options.function is None, thinking, think_token)
        else:
            grammar = response_format_grammar(options.response_format, thinking, think_token)
        return self.grammar.constraint(grammar, param)

    def endpoint(self, options: ChatOptions):
        if not self.v4:
            return ChatCompletions
        return V4ChatCompletions(options.thinking, options.tool_choice != "none")


class V4ChatCompletions(ChatCompletions):
    """``/v1/chat/completions`` shapes with V4's output parsed: ``reasoning_content`` (thinking
    mode), ``content`` and ``tool_calls``, whole and streamed; one per request (the stream's
    parser is its state)."""

    def __init__(self, thinking: bool, tools: bool):
        self.thinking, self.tools = thinking, tools
        self.stream = ChatOutputParser(thinking, tools)
        self.calls_sent = 0

    def _calls(self, delta: ChatDelta) -> list[dict]:
        out = []
        for call in delta.tool_calls:
            out.append({"index": self.calls_sent, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}})
            self.calls_sent += 1
        return out

    def _finish(self, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and self.calls_sent else finish

    def choice(self, index: int, text: str, token_ids: list[int], finish: str | None,
               logprobs: dict | None = None) -> dict[str, Any]:
        parser = ChatOutputParser(self.thinking, self.tools)
        delta = parser.feed(text).add(parser.finish())
        message = {"role": "assistant", "content": delta.content if delta.content or not delta.tool_calls else None}
        if self.thinking:
            message["reasoning_content"] = delta.reasoning
        calls = self._calls(delta)
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": self._finish(finish),
                "token_ids": token_ids}

    def chunk_choice(self, index: int, text: str, token_ids: list[int], finish: str | None,
                     logprobs: dict | None = None) -> dict[str, Any]:
        delta = self.stream.feed(text)
        if finish is not None:
            delta.add(self.stream.finish())
        shaped: dict[str, Any] = {}
        if delta.reasoning:
            shaped["reasoning_content"] = delta.reasoning
        if delta.content or not (delta.reasoning or delta.tool_calls):
            shaped["content"] = delta.content
        if delta.tool_calls:
            shaped["tool_calls"] = self._calls(delta)
        return {"index": index, "delta": shaped, "logprobs": logprobs, "finish_reason": self._finish(finish),
                "token_ids": token_ids}

"""Text around the engine's tokens: the model's chat template, and generated tokens turned into
text as they arrive, whole characters only, cut at the first stop string."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dsv4c.artifact.file_names import TOKENIZER_CONFIG
from dsv4c.errors import ArtifactError
from dsv4c.runtime.serve.protocol import bad_request


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, indent=None) -> str:
    # transformers' tojson: plain json.dumps (jinja's own escapes <, >, & and ' for HTML).
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """The ``chat_template`` of ``tokenizer_config.json``, rendered as transformers'
    ``apply_chat_template(..., add_generation_prompt=True)`` renders it: a sandboxed jinja
    environment with ``raise_exception``, ``tojson`` and the special tokens as variables."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self.template = env.from_string(source)
        self.special_tokens = special_tokens

    @classmethod
    def from_artifact(cls, artifact: Path) -> "ChatTemplate | None":
        """The artifact's template, or None when it has no ``tokenizer_config.json`` or no template in it."""
        path = Path(artifact) / TOKENIZER_CONFIG
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{path}: unreadable ({e.__class__.__name__})") from None
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if source is None:
            return None
        if not isinstance(source, str):
            raise ArtifactError(f"{path}: chat_template must be a string or a list of named templates")
        # Special tokens are strings or AddedToken objects ({"content": ...}).
        special = {k: v if isinstance(v, str) else v["content"] for k, v in config.items()
                   if k.endswith("_token") and (isinstance(v, str) or (isinstance(v, dict) and "content" in v))}
        try:
            return cls(source, special)
        except jinja2.TemplateSyntaxError as e:
            raise ArtifactError(f"{path}: chat_template line {e.lineno}: {e.message}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables) -> str:
        """``variables``: the request's ``tools`` and ``chat_template_kwargs``, as vLLM passes them."""
        try:
            return self.template.render({**variables, **self.special_tokens, "messages": messages,
                                         "add_generation_prompt": add_generation_prompt})
        except jinja2.TemplateError as e:
            raise bad_request(f"the model's chat template refused the messages: {e}", "messages") from None


class TextAssembler:
    """Generated tokens in, text out, as they come.

    Decodes a sliding window of ids (the last released token and the new ones) so each token
    costs O(1) decoding; holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD)
    or could still be the start of a stop string, and stops at the first stop string, whose
    text is not part of the output."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self._prefix = self._read = 0  # ids[_prefix:_read] were decoded into text already
        self.text = ""  # decoded so far (and cut at a stop string once one appears)
        self.released = 0  # characters of text handed out
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one token; return the text that can be released now."""
        self.ids.append(token)
        done = self.decode(self.ids[self._prefix:self._read])
        now = self.decode(self.ids[self._prefix:])
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return ""
        self.text += now[len(done):]
        self._prefix, self._read = self._read, len(self.ids)
        # Released text holds no stop string nor the start of one, so a stop string starts after it.
        cuts = [i for i in (self.text.find(s, self.released) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped = self.text[:min(cuts)], True
            return self.flush()
        longest = max(map(len, self.stop), default=1)
        held = max((k for k in range(1, min(len(self.text) - self.released, longest - 1) + 1)
                    if any(s.startswith(self.text[-k:]) for s in self.stop)), default=0)
        return self._release(len(self.text) - held)

    def flush(self) -> str:
        """The text held back, once no more tokens will come."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.released:upto]
        self.released = max(self.released, upto)
        return out

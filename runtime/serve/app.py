"""The FastAPI application (OpenAI's completions and chat completions, health, metrics) and the
uvicorn server that runs it."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import signal
import socket
import sys
import time
import uuid
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import LogitsProcessor, SamplingParams
from dsv4c.runtime.serve.chat import ChatOptions, ChatProtocol, chat_options
from dsv4c.runtime.serve.engine_loop import EngineLoop, EngineStopped, Generation, QueueFull, ServerMetrics
from dsv4c.runtime.serve.protocol import (APIError, ChatCompletions, Completions, GenerationOptions, bad_request,
                                          chat_request, completion_request, parse_json_object, usage)
from dsv4c.runtime.serve.text import ChatTemplate, TextAssembler

Endpoint = type[Completions] | type[ChatCompletions] | ChatCompletions


class EventStream(StreamingResponse):
    """Server-sent events that call ``on_close`` however the response ends: sent in full, client
    gone (Starlette then cancels the body), or the server cancelling it at shutdown."""

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Server:
    """What one ``dsv4c serve`` process serves: one engine, its chat template, its metrics."""

    def __init__(self, engine: Engine, chat_template: ChatTemplate | None, max_waiting: int,
                 served_model_name: str | None = None):
        self.engine = engine
        self.chat = ChatProtocol.of(engine, chat_template)
        self.model = served_model_name or engine.manifest["model_name"]
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(engine, self.metrics, max_waiting)
        self.eos = tuple(engine.config.eos_token_ids)

    def check_model(self, body: dict) -> dict:
        """``body`` if it names this server's model or none (a name that is not a string is the
        request parser's 400); another name is OpenAI's 404 ``model_not_found``."""
        name = body.get("model")
        if isinstance(name, str) and name != self.model:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves {self.model!r}",
                           "invalid_request_error", "model_not_found")
        return body

    # ------------------------------------------------------------------ prompts
    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer.json, so it takes no text: send 'prompt' as a list of "
                              "token ids", "prompt", "no_tokenizer")
        return self.engine.encode(prompt)

    def chat_prompt(self, messages: list[dict], options: ChatOptions = ChatOptions()) -> list[int]:
        if self.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer.json, so it cannot chat: use /v1/completions with "
                              "token ids", "messages", "no_tokenizer")
        # The template (or V4's encoding) writes the special tokens (BOS, role markers) itself.
        return self.engine.tokenizer.encode(self.chat.prompt_text(messages, options), add_special_tokens=False).ids

    # ------------------------------------------------------------------ generation
    async def generate(self, request: Request, endpoint: Endpoint, prompt: list[int], opts: GenerationOptions,
                       logits_processor: LogitsProcessor | None = None, decode=None) -> Response:
        """``logits_processor``: the request's constrained decoding; ``decode``: how its tokens
        become text (default: the tokenizer's, special tokens left out)."""
        text = TextAssembler(decode or self.engine.decode, opts.stop) if self.engine.tokenizer is not None else None
        if opts.stop and text is None:
            raise bad_request("this model has no tokenizer.json, so it has no text to match 'stop' strings in",
                              "stop", "no_tokenizer")
        max_tokens = opts.max_tokens if opts.max_tokens is not None else max(self.engine.max_context - len(prompt), 0)
        try:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=opts.temperature, top_p=opts.top_p,
                                    seed=opts.seed if opts.seed is not None else secrets.randbits(63),
                                    stop_token_ids=() if opts.ignore_eos else self.eos,
                                    logits_processor=logits_processor)
        except UsageError as e:
            raise bad_request(str(e)) from None
        try:
            gen = self.loop.open(prompt, params)
        except QueueFull as e:
            raise APIError(503, f"the server is full ({e}); retry later", "server_error", "queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), "server_error", "engine_stopped") from None
        try:
            await gen.submitted
        except UsageError as e:
            self.loop.close(gen)
            raise bad_request(str(e)) from None
        except BaseException:
            self.loop.close(gen)
            raise
        head = {"id": f"{endpoint.id_prefix}{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model}
        outputs = self._outputs(gen, text)
        if opts.stream:
            return EventStream(self._events(endpoint, head, outputs, len(prompt), opts.include_usage),
                               on_close=lambda: self.loop.close(gen))
        answer = asyncio.ensure_future(self._complete(endpoint, head, outputs, len(prompt)))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            # A client that left gets no answer; the finally cancels its generation.
            return answer.result() if answer.done() else Response(status_code=499)
        finally:
            answer.cancel()
            gone.cancel()
            self.loop.close(gen)

    async def _outputs(self, gen: Generation, text: TextAssembler | None):
        """(new text, new token ids, finish reason or None) as the engine produces tokens."""
        last = None
        while True:
            update = await gen.updates.get()
            if update.failure is not None:
                raise APIError(500, f"the engine stopped: {update.failure}", "server_error", "engine_failed")
            ids, delta = [], ""
            for token in update.tokens:
                ids.append(token)
                last = token
                if text is not None:
                    delta += text.add(token)
                    if text.stopped:
                        self.loop.close(gen)  # no need for more tokens
                        yield delta, ids, "stop"
                        return
            if update.done:
                finish = "stop" if last in gen.params.stop_token_ids else "length"
                yield delta + (text.flush() if text is not None else ""), ids, finish
                return
            yield delta, ids, None

    async def _complete(self, endpoint: Endpoint, head: dict, outputs, prompt_tokens: int) -> JSONResponse:
        parts, ids, finish = [], [], None
        async for delta, new, finish in outputs:
            parts.append(delta)
            ids += new
        return JSONResponse({"id": head["id"], "object": endpoint.object, **head,
                             "choices": [endpoint.choice("".join(parts), ids, finish)],
                             "usage": usage(prompt_tokens, len(ids))})

    async def _events(self, endpoint: Endpoint, head: dict, outputs, prompt_tokens: int,
                      include_usage: bool) -> AsyncIterator[str]:
        def chunk(choices: list, usage_counts=None) -> str:
            extra = {"usage": usage_counts} if include_usage else {}
            return _sse({"id": head["id"], "object": endpoint.chunk_object, **head, "choices": choices, **extra})

        opening = endpoint.opening_chunk_choice()
        if opening is not None:
            yield chunk([opening])
        generated = 0
        try:
            async for delta, ids, finish in outputs:
                generated += len(ids)
                yield chunk([endpoint.chunk_choice(delta, ids, finish)])
        except APIError as e:  # the status line has gone out: the error travels as an event
            yield _sse(e.body())
        if include_usage:
            yield chunk([], usage(prompt_tokens, generated))
        yield "data: [DONE]\n\n"


def create_app(server: Server, api_key: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        server.loop.start(asyncio.get_running_loop())
        yield
        server.loop.stop()

    app = FastAPI(title="dsv4c", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return await api_error(_request, APIError(e.status_code, str(e.detail), kind, code))

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {e!r}", "server_error").body(), status_code=500)

    async def check_api_key(request: Request) -> None:
        # The scheme is case-insensitive (RFC 9110 §11.1): "bearer KEY" is as good as "Bearer KEY".
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if api_key is not None and not (scheme.lower() == "bearer"
                                        and hmac.compare_digest(given.encode(), api_key.encode())):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           "authentication_error", "invalid_api_key")

    @app.get("/health")
    async def health():
        if not server.loop.alive:
            raise APIError(503, "the engine loop is not running", "server_error", "engine_stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": server.created,
                                            "owned_by": "dsv4c", "max_model_len": server.engine.max_context}]}

    @v1.post("/completions")
    async def completions(request: Request):
        prompt, opts = completion_request(server.check_model(parse_json_object(await request.body())))
        return await server.generate(request, Completions, server.completion_prompt(prompt), opts)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = server.check_model(parse_json_object(await request.body()))
        messages, opts = chat_request(body)
        options = chat_options(body)
        prompt = server.chat_prompt(messages, options)
        # Compiling a grammar can take a while: off the event loop.
        constraint = await asyncio.to_thread(server.chat.constraint, options)
        return await server.generate(request, server.chat.endpoint(options), prompt, opts, constraint,
                                     server.chat.decode_output if server.chat.v4 else None)

    app.include_router(v1)
    return app


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(artifact: str, host: str = "127.0.0.1", port: int = 8000, max_requests: int = 8,
          max_context: int = 4096, max_waiting: int = 64, api_key: str | None = None,
          shutdown_timeout: float = 30.0, speculative: str | None = None, num_draft_tokens: int = 1,
          weights: str = "auto", served_model_name: str | None = None) -> int:
    """Run the server until SIGINT / SIGTERM; then stop accepting, let running requests finish for up
    to ``shutdown_timeout`` seconds, cancel the rest and return 0. ``speculative="mtp"``: every
    request decodes speculatively with the model's MTP layer (``Engine``). ``served_model_name``:
    the name requests must give as ``model`` (default: the artifact's model name)."""
    if max_requests < 1 or max_context < 1 or max_waiting < 0 or shutdown_timeout < 0:
        raise UsageError("--max-requests and --max-context must be positive, --max-waiting and "
                         "--shutdown-timeout >= 0")
    engine = Engine(artifact, max_requests=max_requests, max_context=max_context, speculative=speculative,
                    num_draft_tokens=num_draft_tokens, weights=weights)
    server = Server(engine, ChatTemplate.from_artifact(engine.path), max_waiting, served_model_name)
    sock = _listen(host, port)
    # uvicorn picks uvloop and httptools (the serve extra installs both): the event loop thread
    # shares the GIL with the engine thread, and with asyncio + h11 its per-token work slowed
    # the engine's steps by ~20% on 8 streams; with them the overhead is within a few percent.
    config = uvicorn.Config(create_app(server, api_key), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout)
    http = uvicorn.Server(config)

    # uvicorn handles SIGINT / SIGTERM while it runs, then restores these handlers and raises the
    # signal again; as no-ops they let the shutdown end with exit status 0 (and they catch a signal
    # that comes before uvicorn has taken over).
    def stop(_sig, _frame):
        http.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
    print(f"dsv4c serve: {server.model} on {url} (up to {max_requests} running, "
          f"{max_waiting} waiting, context {max_context}{server.chat.summary}"
          f"{f', speculative {speculative} x{num_draft_tokens}' if speculative else ''})", flush=True)
    http.run(sockets=[sock])
    print("dsv4c serve: stopped", file=sys.stderr, flush=True)
    return 0

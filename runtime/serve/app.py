"""The FastAPI application (OpenAI's completions and chat completions, tokenizer endpoints,
health, metrics) and ``serve``, which runs it (the HTTP layer below it: :mod:`.transport`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import dsv4c
from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine, RequestFailed
from dsv4c.runtime.request import ImageSpan
from dsv4c.runtime.sampling import LogitsProcessor, SamplingParams
from dsv4c.runtime.serve.chat import ChatOptions, ChatPrompt, ChatProtocol, chat_options
from dsv4c.runtime.serve.engine_loop import EngineLoop, EngineStopped, Generation, QueueFull, ServerMetrics
from dsv4c.runtime.serve.openapi import (CHAT_ANSWER, COMPLETION_ANSWER, DETOKENIZE_ANSWER, TOKENIZE_ANSWER, Bounds,
                                         request_body, require_api_key, responses)
from dsv4c.runtime.serve.protocol import (CHAT, COMPLETION, DETOKENIZE, TOKENIZE, APIError, ChatCompletions,
                                          Completions, GenerationOptions, ScoredToken, bad_request, chat_request,
                                          check_token_ids, completion_request, detokenize_request, parse_json_object,
                                          tokenize_request, usage)
from dsv4c.runtime.serve.text import ChatTemplate, TextAssembler
from dsv4c.runtime.serve.transport import (ConnectionLimits, CountResponses, EventStream, HTTPServer, RequestLimits,
                                           client_gone, limited_protocol, listen, read_body, sse)
from dsv4c.runtime.serve.weight_check import WeightCheck
from dsv4c.runtime.vision.intake import ImageIntake

Endpoint = type[Completions] | type[ChatCompletions] | ChatCompletions
T = TypeVar("T")
# Bodies larger than this are parsed on a worker thread: parsing 1 MB of JSON (and checking its
# token ids) takes tens of milliseconds, which would stall every stream on the event loop. So are
# bodies with images, however small: a file's image is decoded and resized while it is parsed.
PARSE_ON_LOOP_BYTES = 64 * 1024


def _choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed from the request's: the first choice takes the seed itself (so ``n=1``
    samples what it always did), the others a 63-bit mix of both (splitmix64's constants)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) >> 1


@dataclass
class Choice:
    """One choice of a request: one prompt's generation in the engine, and how it becomes text."""

    index: int
    prompt: list[int]
    gen: Generation
    text: TextAssembler | None
    echo: str | None  # the prompt's text when it comes first in the output (completions' echo)
    endpoint: Endpoint  # shapes its output (V4's chat parses it, with a parser of its own)
    finished: bool = False  # its last piece, with a finish reason, has been produced
    cached_tokens: int = 0  # of its prompt, found in the prefix cache (known from its first update)


def cached_tokens(choices: list[Choice], n: int) -> int:
    """The prompt tokens of a request found in the prefix cache, each prompt counted once as in
    ``prompt_tokens``: what all of its n choices found (they are admitted together, so a choice
    rarely finds what a sibling wrote)."""
    return sum(min(c.cached_tokens for c in choices[i:i + n]) for i in range(0, len(choices), n))


@dataclass
class Piece:
    """What a choice adds to its output at one update."""

    text: str
    token_ids: list[int]
    scored: list[ScoredToken]  # the tokens with log-probabilities, when asked for (echoed prompt first)
    finish: str | None


class Server:
    """What one ``dsv4c serve`` process serves: one engine, its chat template, its metrics."""

    def __init__(self, engine: Engine, chat_template: ChatTemplate | None, max_waiting: int,
                 served_model_name: str | None = None, limits: RequestLimits = RequestLimits(),
                 on_engine_failure=lambda: None, weights_verified: bool = False,
                 images: ImageIntake = ImageIntake()):
        """``weights_verified``: the engine hashed every artifact file as it loaded (``--verify``)."""
        self.engine, self.limits, self.images = engine, limits, images
        self.chat = ChatProtocol.of(engine, chat_template)
        self.model = served_model_name or engine.manifest.model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.speculation.num_draft_tokens if engine.speculation is not None else 0)
        self.loop = EngineLoop(engine, self.metrics, max_waiting, on_engine_failure)
        self.weights = WeightCheck(self.metrics.weights_verified, weights_verified)
        self.eos = tuple(engine.config.eos_token_ids)

    def check_model(self, body: dict) -> dict:
        """``body`` if it names this server's model or none (a name that is not a string is the
        request parser's 400); another name is OpenAI's 404 ``model_not_found``."""
        name = body.get("model")
        if isinstance(name, str) and name != self.model:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves {self.model!r}",
                           "invalid_request_error", "model_not_found")
        return body

    async def parse(self, request: Request, parse: Callable[[dict], T]) -> T:
        """The request's body, read within the limits and checked by ``parse``; a large body is
        parsed off the event loop, so that it does not stall the streams of others."""
        raw = await read_body(request, self.limits)

        def check() -> T:
            return parse(self.check_model(parse_json_object(raw)))

        return await asyncio.to_thread(check) if len(raw) > PARSE_ON_LOOP_BYTES or b"image_url" in raw else check()

    # ------------------------------------------------------------------ prompts and text
    def needs_tokenizer(self, what: str, param: str) -> None:
        if self.engine.tokenizer is None:
            raise bad_request(f"this model has no tokenizer.json, so {what}", param, "no_tokenizer")

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        self.needs_tokenizer("it takes no text: send 'prompt' as a list of token ids", "prompt")
        return self.engine.encode(prompt)

    def chat_prompt(self, messages: list[dict], options: ChatOptions = ChatOptions()) -> ChatPrompt:
        self.needs_tokenizer("it cannot chat: use /v1/completions with token ids", "messages")
        return self.chat.prompt(messages, options, self.images)

    def checked_ids(self, ids: list[int], name: str) -> list[int]:
        """Token ids from a request, each in this model's vocabulary (or a 400 naming the first that is not)."""
        return check_token_ids(ids, self.engine.config.vocab_size, name, name.partition("[")[0])

    def token_text(self, token: int) -> str:
        """A token as text in log-probabilities; ``token_id:N`` (vLLM's spelling) without a tokenizer."""
        if self.engine.tokenizer is None:
            return f"token_id:{token}"
        return self.engine.tokenizer.decode([token], skip_special_tokens=False)

    # ------------------------------------------------------------------ generation
    def _params(self, opts: GenerationOptions, prompt: list[int], seed: int,
                logits_processor: LogitsProcessor | None) -> SamplingParams:
        max_tokens = opts.max_tokens if opts.max_tokens is not None else max(self.engine.max_context - len(prompt), 0)
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=opts.temperature, top_p=opts.top_p,
                                  seed=seed, stop_token_ids=() if opts.ignore_eos else self.eos,
                                  logprobs=opts.logprobs,
                                  prompt_logprobs=opts.logprobs if opts.echo else None,
                                  logits_processor=logits_processor)
        except UsageError as e:
            raise bad_request(str(e)) from None

    async def _open(self, endpoint: Endpoint, prompts: list[list[int]], opts: GenerationOptions,
                    echo_texts: list[str] | None, chat: ChatOptions | None,
                    images: tuple[ImageSpan, ...] = ()) -> list[Choice]:
        """One generation per prompt and choice, all accepted by the engine, or none and the error.
        A chat choice has its own output parser and its own constraint (both keep state). A request
        that could never be admitted is a 400 before it takes a place: a 503 would have its client
        retry forever."""
        if opts.stop and self.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer.json, so it has no text to match 'stop' strings in",
                              "stop", "no_tokenizer")
        wanted, most = len(prompts) * opts.n, self.loop.capacity
        if wanted > most:
            raise bad_request(f"{len(prompts)} prompt(s) x n = {opts.n} make {wanted} requests, more than this server "
                              f"ever holds ({self.engine.max_requests} running + {most - self.engine.max_requests} "
                              "waiting)", "n", "too_many_choices")
        seed = opts.seed if opts.seed is not None else secrets.randbits(63)
        choices: list[Choice] = []
        try:
            planned = []
            for i, prompt in enumerate(prompts):
                for j in range(opts.n):
                    index = i * opts.n + j
                    decode, constraint = self.engine.decode, None
                    if chat is not None:
                        # Compiling a grammar can take a while: off the event loop.
                        constraint = await asyncio.to_thread(self.chat.constraint, chat)
                        endpoint = self.chat.endpoint(chat)
                        decode = self.chat.decode_output if self.chat.v4 else decode
                    params = self._params(opts, prompt, _choice_seed(seed, index), constraint)
                    if j == 0:  # what the engine would refuse (a prompt's choices differ only in their seeds)
                        self.engine.check(prompt, params, images=images)
                    planned.append((i, index, prompt, params, endpoint, decode))
            for i, index, prompt, params, endpoint, decode in planned:
                gen = self.loop.open(prompt, params, images)
                text = TextAssembler(decode, opts.stop) if self.engine.tokenizer else None
                choices.append(Choice(index, prompt, gen, text, echo_texts[i] if echo_texts else None, endpoint))
            for c in choices:
                await c.gen.submitted
        except BaseException as e:  # none of the request's generations goes on
            for c in choices:
                self.loop.close(c.gen)
            if isinstance(e, QueueFull):
                raise APIError(503, f"the server is full ({e}); retry later", "server_error", "queue_full",
                               headers={"Retry-After": "1"}) from None
            if isinstance(e, EngineStopped):
                raise APIError(503, str(e), "server_error", "engine_stopped") from None
            if isinstance(e, UsageError):
                raise bad_request(str(e)) from None
            raise
        return choices

    async def generate(self, request: Request, endpoint: Endpoint, prompts: list[list[int]],
                       opts: GenerationOptions, echo_texts: list[str] | None = None,
                       chat: ChatOptions | None = None, images: tuple[ImageSpan, ...] = ()) -> Response:
        """Run every prompt ``opts.n`` times and answer with all the choices (streamed or not);
        ``echo_texts``: each prompt's text, put before its output; ``chat``: a chat request's
        conversation options (its output parsing and constrained decoding); ``images``: the
        prompts' image spans (a chat request's one prompt)."""
        choices = await self._open(endpoint, prompts, opts, echo_texts, chat, images)
        head = {"id": f"{endpoint.id_prefix}{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model}
        prompt_tokens = sum(map(len, prompts))

        def close_all():
            self.metrics.unfinished.inc(sum(not c.finished for c in choices))
            for c in choices:
                self.loop.close(c.gen)

        if opts.stream:
            return EventStream(self._events(endpoint, head, choices, prompt_tokens, opts), on_close=close_all)
        answer = asyncio.ensure_future(self._complete(endpoint, head, choices, prompt_tokens, opts))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            # A client that left gets no answer; the finally cancels its generations.
            return answer.result() if answer.done() else Response(status_code=499)
        finally:
            answer.cancel()
            gone.cancel()
            close_all()

    @staticmethod
    def _failure(error: BaseException) -> APIError:
        if isinstance(error, EngineStopped):
            return APIError(503, str(error), "server_error", "server_shutting_down")
        if isinstance(error, RequestFailed):
            return APIError(500, str(error), "server_error", "request_failed")
        return APIError(500, f"the engine stopped: {error!r}", "server_error", "engine_failed")

    async def _outputs(self, c: Choice) -> AsyncIterator[Piece]:
        """The choice's output as the engine produces its tokens."""
        last, gen = None, c.gen
        first = True
        while True:
            update = await gen.updates.get()
            if update.failure is not None:
                raise self._failure(update.failure)
            c.cached_tokens = update.cached_tokens
            text, scored = "", []
            if first and c.echo is not None:
                text = c.echo
                if update.prompt_logprobs is not None:
                    scored = list(zip(c.prompt, update.prompt_logprobs))
            first = False
            for token in update.tokens:
                last = token
                if c.text is not None:
                    text += c.text.add(token)
            if update.logprobs is not None:
                scored += list(zip(update.tokens, update.logprobs))
            finish = None
            if c.text is not None and c.text.stopped:
                self.loop.close(gen)  # no need for more tokens
                finish = "stop"
            elif update.done:
                finish = "stop" if last in gen.params.stop_token_ids else "length"
                text += c.text.flush() if c.text is not None else ""
            if finish is not None:
                self.metrics.finished.labels(finish).inc()
                c.finished = True
            yield Piece(text, update.tokens, scored, finish)
            if finish is not None:
                return

    def _logprobs(self, endpoint: Endpoint, opts: GenerationOptions, scored: list[ScoredToken],
                  text_offset: int) -> dict | None:
        return endpoint.logprobs(scored, self.token_text, text_offset) if opts.logprobs is not None else None

    async def _complete(self, endpoint: Endpoint, head: dict, choices: list[Choice], prompt_tokens: int,
                        opts: GenerationOptions) -> JSONResponse:
        async def collect(c: Choice) -> dict:
            text, ids, scored, finish = [], [], [], None
            async for piece in self._outputs(c):
                text.append(piece.text)
                ids += piece.token_ids
                scored += piece.scored
                finish = piece.finish
            return c.endpoint.choice(c.index, "".join(text), ids, finish, self._logprobs(endpoint, opts, scored, 0))

        answers = await asyncio.gather(*map(collect, choices))
        generated = sum(len(a["token_ids"]) for a in answers)
        return JSONResponse({"id": head["id"], "object": endpoint.object, **head, "choices": answers,
                             "usage": usage(prompt_tokens, generated, cached_tokens(choices, opts.n))})

    async def _events(self, endpoint: Endpoint, head: dict, choices: list[Choice], prompt_tokens: int,
                      opts: GenerationOptions) -> AsyncIterator[str]:
        def chunk(choice_list: list, usage_counts=None) -> str:
            extra = {"usage": usage_counts} if opts.include_usage else {}
            return sse({"id": head["id"], "object": endpoint.chunk_object, **head, "choices": choice_list, **extra})

        def so_far(generated: int) -> dict | None:  # vLLM's continuous_usage_stats: the usage in every chunk
            return usage(prompt_tokens, generated, cached_tokens(choices, opts.n)) if opts.continuous_usage else None

        for c in choices:
            opening = c.endpoint.opening_chunk_choice(c.index)
            if opening is not None:
                yield chunk([opening], so_far(0))
        pieces: asyncio.Queue[tuple[Choice, Piece | APIError | None]] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for piece in self._outputs(c):
                    pieces.put_nowait((c, piece))
            except APIError as e:
                pieces.put_nowait((c, e))
            pieces.put_nowait((c, None))

        pumps = [asyncio.ensure_future(pump(c)) for c in choices]
        generated, offsets, running = 0, dict.fromkeys(range(len(choices)), 0), len(choices)
        try:
            while running:
                c, piece = await pieces.get()
                if piece is None:
                    running -= 1
                elif isinstance(piece, APIError):  # the status line has gone out: the error travels as an event
                    yield sse(piece.body())
                    break
                else:
                    generated += len(piece.token_ids)
                    logprobs = self._logprobs(endpoint, opts, piece.scored, offsets[c.index])
                    offsets[c.index] += sum(len(self.token_text(t)) for t, _ in piece.scored)
                    yield chunk([c.endpoint.chunk_choice(c.index, piece.text, piece.token_ids, piece.finish,
                                                         logprobs)], so_far(generated))
        finally:
            for p in pumps:
                p.cancel()
        if opts.include_usage:
            yield chunk([], usage(prompt_tokens, generated, cached_tokens(choices, opts.n)))
        yield "data: [DONE]\n\n"


def create_app(server: Server, api_key: str | None = None,
               check_weights: Callable[[asyncio.AbstractEventLoop], None] = lambda _loop: None) -> CountResponses:
    """``check_weights``: started once the server is ready (the background weight check)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        server.loop.start(asyncio.get_running_loop())
        check_weights(asyncio.get_running_loop())
        yield
        server.loop.stop()

    # /openapi.json and /docs (Swagger UI) describe every endpoint, open to all (as vLLM's).
    app = FastAPI(title="dsv4c", version=dsv4c.__version__, lifespan=lifespan, redoc_url=None)
    bounds = Bounds(server.engine.config.vocab_size, server.engine.max_context, server.loop.capacity,
                    server.chat.takes_images)

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
        if server.weights.failure is not None:
            raise APIError(503, server.weights.failure, "server_error", "weights_corrupt")
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

    # Each handler's parse callback also tokenizes (and renders the chat), so that all of a large
    # request's CPU work happens off the event loop (Server.parse).
    @v1.post("/completions", openapi_extra=request_body(COMPLETION, ["prompt"], bounds),
             responses=responses(COMPLETION_ANSWER, streams=True))
    async def completions(request: Request):
        def prepare(body: dict):
            prompts, opts = completion_request(body)
            # A batch comes back as sent (the same list); one prompt comes back wrapped in a list.
            names = [f"prompt[{i}]" for i in range(len(prompts))] if prompts is body["prompt"] else ["prompt"]
            for name, p in zip(names, prompts):
                if isinstance(p, list):
                    server.checked_ids(p, name)
            echo = None
            if opts.echo:  # the prompt as sent, or its ids' text
                echo = [p if isinstance(p, str) else server.engine.decode(p) if server.engine.tokenizer else ""
                        for p in prompts]
            return [server.completion_prompt(p) for p in prompts], opts, echo

        ids, opts, echo = await server.parse(request, prepare)
        return await server.generate(request, Completions, ids, opts, echo)

    @v1.post("/chat/completions", openapi_extra=request_body(CHAT, ["messages"], bounds, chat_options=True),
             responses=responses(CHAT_ANSWER, streams=True))
    async def chat_completions(request: Request):
        def prepare(body: dict):
            (messages, opts), options = chat_request(body, server.chat.takes_images), chat_options(body)
            return server.chat_prompt(messages, options), opts, options

        prompt, opts, options = await server.parse(request, prepare)
        return await server.generate(request, ChatCompletions, [prompt.token_ids], opts, chat=options,
                                     images=prompt.images)

    # vLLM's tokenizer endpoints (outside /v1, as there), behind the same key.
    tokens = APIRouter(dependencies=[Depends(check_api_key)])

    @tokens.post("/tokenize", openapi_extra=request_body(TOKENIZE, [], bounds, chat_options=True,
                                                         one_of=("prompt", "messages")),
                 responses=responses(TOKENIZE_ANSWER))
    async def tokenize(request: Request):
        def prepare(body: dict) -> list[int]:
            asked = tokenize_request(body, server.chat.takes_images)
            if asked.messages is not None:  # each image counts the positions of its span
                return server.chat_prompt(asked.messages, chat_options(body)).token_ids
            if isinstance(asked.prompt, str):
                server.needs_tokenizer("it takes no text", "prompt")
                return server.engine.tokenizer.encode(asked.prompt, add_special_tokens=asked.add_special_tokens).ids
            return server.checked_ids(asked.prompt, "prompt")

        ids = await server.parse(request, prepare)
        return {"tokens": ids, "count": len(ids), "max_model_len": server.engine.max_context}

    @tokens.post("/detokenize", openapi_extra=request_body(DETOKENIZE, [], bounds),
                 responses=responses(DETOKENIZE_ANSWER))
    async def detokenize(request: Request):
        ids = await server.parse(request, detokenize_request)
        server.needs_tokenizer("it has no text for token ids", "tokens")
        server.checked_ids(ids, "tokens")
        return {"prompt": server.engine.decode(ids)}

    @tokens.get("/tokenizer_info")
    async def tokenizer_info():
        # What clients that tokenize through the server read (lm-eval's remote tokenizer).
        server.needs_tokenizer("it has no tokenizer to describe", None)
        config, tok = server.engine.config, server.engine.tokenizer
        named = {"bos_token": config.bos_token_id, "eos_token": config.eos_token_ids[0] if config.eos_token_ids
                 else None}
        return {**{name: tok.id_to_token(i) for name, i in named.items() if i is not None},
                "model_max_length": server.engine.max_context, "vocab_size": config.vocab_size}

    app.include_router(v1)
    app.include_router(tokens)
    if api_key is not None:
        require_api_key(app.openapi(), [*v1.routes, *tokens.routes])  # FastAPI keeps the document it made
    endpoints = {route.path for router in (app.router, v1, tokens) for route in router.routes
                 if isinstance(route, APIRoute)}
    return CountResponses(app, server.metrics, endpoints)


# After the engine ended the requests left at shutdown, their answers get this long to go out.
ANSWER_GRACE_SECONDS = 10.0


def serve(artifact: str, host: str = "127.0.0.1", port: int = 8000, max_requests: int = 8,
          max_context: int = 4096, max_waiting: int = 64, api_key: str | None = None,
          shutdown_timeout: float = 30.0, speculative: str | None = None, num_draft_tokens: int | None = None,
          weights: str = "auto", served_model_name: str | None = None,
          limits: RequestLimits = RequestLimits(), kv_cache_memory: int | None = None,
          prefix_caching: bool = True, tensor_parallel: int | None = None,
          distributed_timeout: float | None = None, draft_confidence: float = 0.0, engram_memory: str = "map",
          connection_limits: ConnectionLimits = ConnectionLimits(), verify: bool = False,
          background_verify: bool = True, images: ImageIntake = ImageIntake()) -> int:
    """Run the server until SIGINT / SIGTERM; then stop accepting, let running requests finish for up
    to ``shutdown_timeout`` seconds, end the rest with an error answer and return 0. If the engine
    fails (a bug), the server stops the same way and returns 1, so that a supervisor restarts it.
    ``verify`` hashes every artifact file before the engine starts; without it (and unless not
    ``background_verify``) a thread hashes the weight files once the server is ready, and a
    mismatch stops the server the same way, with status 1 (:mod:`.weight_check`).
    ``speculative="mtp"`` (``"dspark"``): every request decodes speculatively with the model's MTP
    layer (DSpark drafter; ``Engine``); ``engram_memory`` as ``Engine``'s. ``served_model_name``: the
    name requests must give as ``model`` (default: the artifact's model name). ``images``: where
    chat images may come from and their limits (a model with a vision tower)."""
    if max_requests < 1 or max_context < 1 or max_waiting < 0 or shutdown_timeout < 0:
        raise UsageError("--max-requests and --max-context must be positive, --max-waiting and "
                         "--shutdown-timeout >= 0")
    if limits.max_bytes < 1 or not limits.body_timeout > 0:
        raise UsageError("--max-request-bytes and --request-body-timeout must be positive")
    connection_limits.check()
    engine = Engine(artifact, max_requests=max_requests, max_context=max_context, verify=verify,
                    speculative=speculative, num_draft_tokens=num_draft_tokens, weights=weights,
                    kv_cache_memory=kv_cache_memory, prefix_caching=prefix_caching, tensor_parallel=tensor_parallel,
                    distributed_timeout=distributed_timeout, draft_confidence=draft_confidence,
                    engram_memory=engram_memory)

    def stop_serving():
        http.should_exit = True

    server = Server(engine, ChatTemplate.from_artifact(engine.path), max_waiting, served_model_name, limits,
                    on_engine_failure=stop_serving, weights_verified=verify, images=images)

    def check_weights(event_loop: asyncio.AbstractEventLoop) -> None:
        if not verify and background_verify:
            server.weights.start(engine.path, engine.manifest, event_loop, stop_serving)

    sock = listen(host, port)

    def refused(status: int) -> None:  # answered below the application (transport.LimitedProtocol)
        server.metrics.requests.labels("connection", str(status)).inc()

    # uvicorn picks uvloop, and runs httptools under LimitedProtocol (the serve extra installs both):
    # the event loop thread shares the GIL with the engine thread, and with asyncio + h11 its
    # per-token work slowed the engine's steps by ~20% on 8 streams; with them the overhead is
    # within a few percent.
    config = uvicorn.Config(create_app(server, api_key, check_weights), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + ANSWER_GRACE_SECONDS,
                            http=limited_protocol(connection_limits, refused),
                            timeout_keep_alive=connection_limits.keep_alive_timeout)
    http = HTTPServer(config, server.loop.abort, shutdown_timeout)

    # uvicorn handles SIGINT / SIGTERM while it runs, then restores these handlers and raises the
    # signal again; as no-ops they let the shutdown end with exit status 0 (and they catch a signal
    # that comes before uvicorn has taken over).
    def stop(_sig, _frame):
        http.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
    pool = engine.pool
    print(f"dsv4c serve: {server.model} on {url} (up to {max_requests} running, "
          f"{max_waiting} waiting, context {max_context}, KV pool "
          f"{pool.nbytes_for(pool.geometry, pool.total_rows) / 2**20:,.0f} MiB"
          f"{', prefix caching' if engine.prefix_cache else ''}{server.chat.summary}"
          f"{f', tensor parallel {ranks}' if (ranks := engine.manifest.tensor_parallel) > 1 else ''}"
          f"{f', speculative {speculative} x{engine.speculation.num_draft_tokens}' if speculative else ''}"
          f"{f', draft confidence {draft_confidence}' if draft_confidence else ''})", flush=True)
    http.run(sockets=[sock])
    engine.close()
    if server.weights.failure is not None:
        print("dsv4c serve: stopped because a weight file does not match its sha256", file=sys.stderr, flush=True)
        return 1
    if server.loop.failure is not None:
        print(f"dsv4c serve: stopped because the engine failed ({server.loop.failure!r})", file=sys.stderr,
              flush=True)
        return 1
    print("dsv4c serve: stopped", file=sys.stderr, flush=True)
    return 0

"""The HTTP side of the server below the endpoints: reading a request body within its limits,
server-sent events, counting every answer, and the uvicorn server that listens and drains."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import uvicorn
from fastapi import Request
from fastapi.responses import StreamingResponse

from dsv4c.errors import UsageError
from dsv4c.runtime.serve.engine_loop import ServerMetrics
from dsv4c.runtime.serve.protocol import APIError

@dataclass(frozen=True)
class RequestLimits:
    """What a request body may cost before it is parsed: ``max_bytes`` (8 MiB holds a 1M-token text
    prompt, about 4 MB), and ``body_timeout`` seconds to arrive in full (stalled clients let go)."""

    max_bytes: int = 8 * 1024 * 1024
    body_timeout: float = 30.0


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The whole body, or a 413 as soon as it is known to be too large, or a 408 once it has taken
    ``body_timeout`` seconds; both close the connection (its unread bytes would be the next request)."""
    close = {"Connection": "close"}
    too_large = APIError(413, f"the request body is larger than {limits.max_bytes} bytes, this server's "
                              "--max-request-bytes", "invalid_request_error", "request_too_large", headers=close)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise too_large
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout:g} s",
                       "invalid_request_error", "request_timeout", headers=close) from None
    return bytes(body)


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


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class CountResponses:
    """ASGI middleware around the whole application (error handlers included): every HTTP answer
    counted by endpoint and status in ``dsv4c_http_requests_total``."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


class HTTPServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown ends in answers: once ``drain_timeout`` seconds have
    passed, the engine ends what still runs, so that waiting clients get a JSON 503 and streams an
    error event and ``[DONE]``, rather than uvicorn cancelling their tasks (a plain-text 500, streams
    cut short, tracebacks). uvicorn's own timeout stays as a backstop."""

    def __init__(self, config: uvicorn.Config, abort: Callable[[], None], drain_timeout: float):
        super().__init__(config)
        self.abort, self.drain_timeout = abort, drain_timeout  # abort: the engine loop's

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.abort)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()



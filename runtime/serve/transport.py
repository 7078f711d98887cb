"""The HTTP side of the server below the endpoints: the limits on a connection before its request
reaches the application (:class:`LimitedProtocol`), reading a request body within its limits,
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
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from dsv4c.errors import UsageError
from dsv4c.runtime.serve.engine_loop import ServerMetrics
from dsv4c.runtime.serve.protocol import APIError


@dataclass(frozen=True)
class ConnectionLimits:
    """What a connection may cost before its request reaches the application: ``max_header_bytes``
    of request line and headers (431), ``header_timeout`` seconds from the connection's opening (or,
    kept alive, from its next request's first byte) to the end of the headers, ``keep_alive_timeout``
    seconds idle between requests, and ``max_connections`` open at once (more are answered 503)."""

    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1000  # below the usual 1024 open files a process may hold

    def check(self) -> None:
        if self.max_header_bytes < 1 or self.max_connections < 1 or not (self.header_timeout > 0
                                                                          and self.keep_alive_timeout > 0):
            raise UsageError("--max-header-bytes, --max-connections, --header-timeout and --keep-alive-timeout "
                             "must be positive")


# A connection refused with an answer is read (and its bytes dropped) this long after the answer,
# so that the client gets it: closing a socket with unread bytes sends a reset, which can
# destroy the answer before the client has read it.
LINGER_SECONDS = 2.0


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol on httptools, with :class:`ConnectionLimits` (uvicorn has a
    keep-alive timeout but neither a header-size limit nor a header timeout, and its
    ``limit_concurrency`` parses a request's headers before its 503). ``limits`` and ``refused``
    (called with the status of each answer given here, for the metrics) are set by
    :func:`limited_protocol`."""

    limits: ConnectionLimits
    refused: Callable[[int], None]

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.awaiting_headers, self.header_bytes, self.refusing = True, 0, False
        self.header_timer = None
        if len(self.connections) > self.limits.max_connections:  # before a byte is read
            self.refuse(APIError(503, f"the server holds {self.limits.max_connections} connections, its "
                                      "--max-connections; retry later", "server_error", "too_many_connections",
                                 headers={"Retry-After": "1"}))
            return
        self.start_header_timer()

    def start_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.limits.header_timeout, self.headers_too_slow)

    def stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def connection_lost(self, exc) -> None:
        self.stop_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refusing:  # the answer is out: what comes now is dropped
            return
        if self.awaiting_headers:
            self.header_bytes += len(data)
        super().data_received(data)
        # While the headers are incomplete, every byte received since the request began is theirs.
        if self.awaiting_headers and self.header_bytes > self.limits.max_header_bytes \
                and not self.transport.is_closing():
            self.refuse(self.headers_too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.start_header_timer()  # a kept-alive connection's next request

    def on_headers_complete(self) -> None:
        self.awaiting_headers = False
        self.stop_header_timer()
        # The headers completed inside the last chunk, which may also hold body bytes: count them exactly.
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self.app = self.answer(self.headers_too_large())  # this connection's last request
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.awaiting_headers, self.header_bytes = True, 0

    def headers_too_large(self) -> APIError:
        return APIError(431, f"the request line and headers are larger than {self.limits.max_header_bytes} bytes, "
                             "this server's --max-header-bytes", "invalid_request_error", "headers_too_large",
                        headers={"Connection": "close"})

    def headers_too_slow(self) -> None:
        self.header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined request trickles in behind a response: close after it
        elif self.header_bytes == 0:
            self.transport.close()  # nothing came: nothing to answer
        else:
            self.refuse(APIError(408, f"the request line and headers did not arrive within "
                                      f"{self.limits.header_timeout:g} s, this server's --header-timeout",
                                 "invalid_request_error", "request_timeout"))

    def refuse(self, error: APIError) -> None:
        """Answer ``error`` below the application and close the connection (it no longer counts as open)."""
        self.refusing = True
        self.stop_header_timer()
        self.connections.discard(self)
        self.refused(error.status)
        body = json.dumps(error.body()).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), **error.headers,
                   "Connection": "close"}
        self.transport.write(STATUS_LINE[error.status] + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
                             + b"\r\n" + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()

    def answer(self, error: APIError):
        """An ASGI application that answers ``error`` (for a request whose headers the parser has taken)."""
        async def app(_scope, _receive, send) -> None:
            self.refused(error.status)
            await send({"type": "http.response.start", "status": error.status,
                        "headers": [(b"content-type", b"application/json"),
                                    *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]})
            await send({"type": "http.response.body", "body": json.dumps(error.body()).encode()})
        return app


def limited_protocol(limits: ConnectionLimits, refused: Callable[[int], None]) -> type[LimitedProtocol]:
    """The protocol class uvicorn makes each connection's protocol from (``uvicorn.Config(http=...)``)."""
    return type("LimitedProtocol", (LimitedProtocol,), {"limits": limits, "refused": staticmethod(refused)})


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



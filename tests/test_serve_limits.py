"""`dsv4c serve`'s limits below the application, through raw sockets: request line and header bytes
(431), the header timeout (idle and trickling connections), the keep-alive timeout and the cap on
open connections (503 before a byte is read); the server answers as before afterwards. And what
load tools ask of a stream: vLLM's ``continuous_usage_stats`` (guidellm sends it)."""

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from serving import serving

HEADER_TIMEOUT = 1.0
KEEP_ALIVE = 0.5
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def api(serve_artifacts):
    with serving(serve_artifacts / "cpu", "--header-timeout", str(HEADER_TIMEOUT), "--keep-alive-timeout",
                 str(KEEP_ALIVE), "--max-connections", str(MAX_CONNECTIONS), "--max-header-bytes", "64KiB",
                 no_tracebacks=True) as served:
        yield served


def connect(api) -> socket.socket:
    url = urlsplit(api.url)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def answer(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed (monotonic)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic()


def one_response(sock: socket.socket) -> bytes:
    """One whole response on a kept-alive connection: its head, then its Content-Length bytes (a
    response may arrive in several reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def status_and_error(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def still_answers(api) -> None:
    assert httpx.get(f"{api.url}/health").status_code == 200


def test_a_megabyte_of_headers_gets_431(api):
    sock = connect(api)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    status, error = status_and_error(answer(sock)[0])
    assert status == 431 and error["code"] == "headers_too_large" and "65536" in error["message"]
    # Headers that arrive whole in one read are counted exactly, below and above the limit.
    lines = b"".join(b"X-%d: %s\r\n" % (i, b"b" * 100) for i in range(700))  # 700 x ~108 bytes
    sock = connect(api)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
    assert answer(sock)[0].startswith(b"HTTP/1.1 431 ")
    assert httpx.get(f"{api.url}/health", headers={f"X-{i}": "b" * 100 for i in range(500)}).status_code == 200
    counted = httpx.get(f"{api.url}/metrics").text
    assert 'dsv4c_http_requests_total{endpoint="connection",status="431"} 2.0' in counted


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(api):
    sock, opened = connect(api), time.monotonic()
    data, closed = answer(sock)
    assert data == b"" and HEADER_TIMEOUT * 0.8 <= closed - opened < HEADER_TIMEOUT + 1.5
    still_answers(api)


def test_headers_trickled_in_are_cut_off_at_the_header_timeout(api):
    """Slowloris: a header line every 0.3 s, which no read timeout of 0.3 s or more would catch."""
    sock, opened = connect(api), time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    data = b""
    for i in range(20):  # up to 6 s of trickling; the server answers after 1
        if select.select([sock], [], [], 0.3)[0]:
            data, closed = answer(sock)
            break
        sock.sendall(b"X-Trickle-%d: y\r\n" % i)
    assert data, "the trickling connection was never cut off"
    status, error = status_and_error(data)
    assert status == 408 and error["code"] == "request_timeout"
    assert HEADER_TIMEOUT * 0.8 <= closed - opened < HEADER_TIMEOUT + 1.5
    still_answers(api)


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(api):
    sock = connect(api)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = one_response(sock)
    answered = time.monotonic()
    assert first.startswith(b"HTTP/1.1 200 ")
    data, closed = answer(sock)
    assert data == b"" and KEEP_ALIVE * 0.8 <= closed - answered < HEADER_TIMEOUT


def test_connections_over_the_cap_get_503_before_they_send_anything(api):
    held = [connect(api) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)  # accepted by the server
        extra = connect(api)  # sends nothing: the answer comes before any parsing
        data = answer(extra)[0]
        status, error = status_and_error(data)
        assert status == 503 and error["code"] == "too_many_connections"
        assert b"\r\nRetry-After: 1\r\n" in data
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.1)
    still_answers(api)
    assert api.metrics()["dsv4c_engine_up"] == 1


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(api):
    body = {"prompt": [7, 8, 9], "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{api.url}/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    generated = 0
    for chunk in chunks[:-1]:
        generated += len(chunk["choices"][0]["token_ids"])
        assert chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": generated, "total_tokens": 3 + generated,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
    assert generated == 3 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3

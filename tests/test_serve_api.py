"""`dsv4c serve`, the rest of the OpenAI / vLLM surface (n, batched prompts, logprobs, echo,
/tokenize, lm-eval's loglikelihood requests) and what keeps it up (body limits, shutdown, an
engine that dies, random request bodies), through real HTTP against a server subprocess."""

import json
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4c.cli import main as cli
from dsv4c.runtime.serve.app import _choice_seed
from dsv4c.runtime.serve.protocol import APIError, chat_request, completion_request, tokenize_request

from serving import CONTEXT, KEY, serving

AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [7, 17, 200, 30, 99, 41]
BODY_LIMIT = 100_000


@pytest.fixture(scope="module")
def server(serve_artifacts):
    with serving(serve_artifacts / "cpu", "--api-key", KEY, "--max-requests", "4", "--max-waiting", "12",
                 "--max-context", str(CONTEXT), "--served-model-name", "tiny", "--max-request-bytes",
                 str(BODY_LIMIT), "--request-body-timeout", "1", no_tracebacks=True) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=timeout)


def _labelled(server, name: str) -> dict[tuple, float]:
    """A labelled counter's values by label values, from /metrics."""
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            values[tuple(part.split("=")[1].strip('"') for part in labels.split(","))] = float(value)
    return values


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ------------------------------------------------------------------ n, batched prompts


def test_n_choices_and_batched_prompts_sample_each_choice_with_its_own_seed(server):
    prompts = [PROMPT, [8, 9, 10]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    first = _post(server, "/v1/completions", body).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert first["usage"] == {"prompt_tokens": 9, "completion_tokens": 20, "total_tokens": 29,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert _post(server, "/v1/completions", body).json()["choices"] == first["choices"]  # reproducible
    by_index = {c["index"]: c["token_ids"] for c in first["choices"]}
    assert by_index[0] != by_index[1] and by_index[2] != by_index[3]
    # Choice i of prompt p is what one request with choice i's seed samples alone.
    for index, prompt in [(0, PROMPT), (1, PROMPT), (3, prompts[1])]:
        alone = _post(server, "/v1/completions", {**body, "prompt": prompt, "n": 1, "seed": _choice_seed(7, index)})
        assert alone.json()["choices"][0]["token_ids"] == by_index[index]
    # Streamed, the same choices arrive interleaved, each ending with its finish reason.
    streamed: dict[int, list[int]] = {}
    finishes = {}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
                    if choice["finish_reason"]:
                        finishes[choice["index"]] = choice["finish_reason"]
    assert streamed == by_index and finishes == dict.fromkeys(range(4), "length")


def test_chat_n_answers_several_choices(client):
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w6 w7"}], n=3,
                                            max_tokens=4, temperature=1.0, seed=1)
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    assert answer.usage.completion_tokens == sum(len(c.token_ids) for c in answer.choices)


# ------------------------------------------------------------------ logprobs and echo


@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_echoed_prompt_logprobs_are_the_log_softmax_of_generate_logits(serve_artifacts, server, tmp_path,
                                                                       max_tokens):
    logits_file = tmp_path / "logits.npy"
    assert cli(["generate", str(serve_artifacts / "cpu"), "--token-ids", ",".join(map(str, PROMPT)), "--greedy",
                "--max-new-tokens", str(max_tokens), "--logits-out", str(logits_file)]) == 0
    expected = _log_softmax(np.load(logits_file))
    answer = _post(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2,
                                               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    choice = answer.json()["choices"][0]
    sequence = PROMPT + choice["token_ids"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(sequence)
    assert lp["tokens"] == [f"w{t}" for t in sequence]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first
    got = np.array(lp["token_logprobs"][1:])
    assert np.abs(got - expected[np.arange(len(sequence) - 1), sequence[1:]]).max() < 1e-4
    for row, top in enumerate(lp["top_logprobs"][1:]):
        best = np.argsort(-expected[row], kind="stable")[:2]
        assert list(top) == [f"w{t}" for t in best]
    assert choice["text"].startswith("w7 w17 w200 w30 w99 w41")
    assert lp["text_offset"][:3] == [0, 2, 5]  # "w7", "w17", "w200" (the token strings, concatenated)


def test_chat_logprobs_and_top_logprobs(client):
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w6 w7 w8"}],
                                            max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                            extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == 5 == answer.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.token == entry.top_logprobs[0].token  # greedy
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.bytes == list(entry.token.encode())
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w6 w7 w8"}],
                                              max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True})
    tokens = [e.token for chunk in streamed for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert tokens == [e.token for e in content]


def test_lm_eval_loglikelihood_through_the_remote_tokenizer(server, monkeypatch):
    """lm-eval's local-completions model as a user runs it: it finds /tokenizer_info and /tokenize,
    then scores each continuation with echo + logprobs (max_tokens 1)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what its completion requests send; auth_token its tokenizer's
    lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model="tiny", auth_token=KEY,
                             num_concurrent=1, max_retries=1)
    assert lm.tokenizer_backend == "remote"
    pairs = [("w7 w17 w200", " w30"), ("w6 w7", " w8 w9"), ("w40", " w41")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        ids = [int(w[1:]) for w in (context + continuation).split()]
        ctx = len(context.split())
        echo = _post(server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0,
                                                 "temperature": 0}).json()["choices"][0]["logprobs"]
        assert logprob == pytest.approx(sum(echo["token_logprobs"][ctx:]), abs=1e-4)
        assert greedy == all(lp == max(top.values()) for lp, top in
                             zip(echo["token_logprobs"][ctx:], echo["top_logprobs"][ctx:]))


# ------------------------------------------------------------------ tokenizer endpoints


def test_tokenize_and_detokenize(server):
    text = _post(server, "/tokenize", {"prompt": "w6 w7 w300"}).json()
    assert text == {"tokens": [6, 7, 300], "count": 3, "max_model_len": CONTEXT}
    assert _post(server, "/tokenize", {"prompt": [9, 10]}).json()["tokens"] == [9, 10]
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "w6"}]}).json()
    assert chat["tokens"] == [0, 3, 6, 4]  # <bos> <user> w6 <assistant>, as the chat template writes it
    assert _post(server, "/detokenize", {"tokens": [6, 7, 300]}).json() == {"prompt": "w6 w7 w300"}
    info = httpx.get(f"{server.url}/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == "<eos>" and info["bos_token"] == "<bos>"
    for path, body, fragment in [("/tokenize", {"prompt": "w6", "messages": []}, "either"),
                                 ("/tokenize", {}, "either"), ("/tokenize", {"prompt": [1.5]}, "'prompt'"),
                                 ("/detokenize", {"tokens": [99999]}, "token ids must be in"),
                                 ("/detokenize", {"tokens": "w6"}, "'tokens'")]:
        response = _post(server, path, body)
        assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "w6"}).status_code == 401


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", {"prompt": [2**63], "echo": True, "max_tokens": 1}, f"prompt[0] = {2**63}"),
    ("/v1/completions", {"prompt": [6, -1], "echo": True, "max_tokens": 1}, "prompt[1] = -1"),
    ("/v1/completions", {"prompt": [6, 7, 4294967296], "max_tokens": 1, "stream": True}, "prompt[2] = 4294967296"),
    ("/v1/completions", {"prompt": [[6], [7, 8, 512]], "echo": True, "max_tokens": 1}, "prompt[1][2] = 512"),
    ("/tokenize", {"prompt": [10**30, -5]}, f"prompt[0] = {10**30}"),
    ("/detokenize", {"tokens": [6, 7, -1]}, "tokens[2] = -1"),
])
def test_token_ids_outside_the_vocabulary_are_400s_naming_their_place(server, path, body, where):
    """Every id is checked before anything decodes or embeds it (echo once decoded first: a 500)."""
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == f"{where} is outside the vocabulary: token ids must be in [0, 512)"
    assert error["param"] == where.split("[")[0]


def test_the_openapi_document_says_which_endpoints_need_the_key(server):
    document = httpx.get(f"{server.url}/openapi.json").json()  # open to all, as /health
    assert document["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert document["paths"][path]["post"]["security"] == [{"bearer": []}]
    assert "security" not in document["paths"]["/health"]["get"]


# ------------------------------------------------------------------ limits


def _raw_exchange(server, request: bytes, wait: float = 5.0) -> tuple[bytes, bool]:
    """Send ``request`` on a fresh connection; (what came back, whether the server closed it)."""
    address = urlparse(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=wait) as sock:
        sock.sendall(request)
        received, closed = b"", False
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                closed = True
                break
            received += chunk
        return received, closed


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    answer, closed = _raw_exchange(server, _head("/v1/completions", 50 * BODY_LIMIT) + b'{"prompt": [')
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer and closed
    # A chunked body (no Content-Length) is cut as it passes the limit.
    def chunks():
        yield b'{"prompt": ['
        for _ in range(BODY_LIMIT // 1000 + 1):
            yield b"1, " * 333 + b"1,"
    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=AUTH)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_a_stalled_body_gets_408_and_its_connection_closed(server):
    answer, closed = _raw_exchange(server, _head("/v1/completions", 100) + b'{"prompt": [1, 2', wait=10)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer and closed
    assert _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_metrics_count_answers_by_status_and_choices_by_finish_reason(server):
    before_ok = _labelled(server, "dsv4c_http_requests_total").get(("/v1/completions", "200"), 0)
    before_bad = _labelled(server, "dsv4c_http_requests_total").get(("/v1/completions", "400"), 0)
    before_length = _labelled(server, "dsv4c_choices_finished_total").get(("length",), 0)
    _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 3, "ignore_eos": True})
    _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": -2})
    counts = _labelled(server, "dsv4c_http_requests_total")
    assert counts[("/v1/completions", "200")] == before_ok + 1 and counts[("/v1/completions", "400")] == before_bad + 1
    assert _labelled(server, "dsv4c_choices_finished_total")[("length",)] == before_length + 3
    assert server.metrics()["dsv4c_engine_up"] == 1


# ------------------------------------------------------------------ random bodies

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                               max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n",
          "logprobs", "top_logprobs", "echo", "stream_options", "ignore_eos", "max_completion_tokens", "tokens",
          "add_special_tokens", "best_of", "response_format"]
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6) | JSON


@settings(max_examples=400, deadline=None)
@given(body=BODIES)
def test_request_parsers_answer_any_json_with_a_value_or_a_400(body):
    for parse in (completion_request, chat_request, tokenize_request):
        try:
            parse(body) if isinstance(body, dict) else None
        except APIError as e:
            assert e.status == 400 and e.message


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]))
def test_random_bodies_never_get_a_500(server, body, path):
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 8)  # keep accepted requests short
    raw = json.dumps(body, allow_nan=True).encode()
    response = httpx.post(f"{server.url}{path}", content=raw, headers=AUTH, timeout=120)
    assert response.status_code < 500 or response.json()["error"]["code"] == "queue_full", response.text
    assert response.status_code == 200 or "error" in response.json()


# ------------------------------------------------------------------ shutdown and engine death


def test_shutdown_past_its_timeout_answers_everyone_and_exits_0(serve_artifacts):
    with serving(serve_artifacts / "cpu", "--max-context", str(CONTEXT), "--shutdown-timeout", "0.3") as served:
        long = {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT), "ignore_eos": True}
        answers = {}

        def complete():
            answers["plain"] = httpx.post(f"{served.url}/v1/completions", json=long, timeout=60)

        def stream():
            with httpx.stream("POST", f"{served.url}/v1/completions", json={**long, "stream": True},
                              timeout=60) as response:
                answers["events"] = [line for line in response.iter_lines() if line]

        threads = [threading.Thread(target=complete), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        served.wait_metrics(lambda m: m.get("dsv4c_requests_running") == 2 and m["dsv4c_generation_tokens_total"] > 0)
        served.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert served.proc.wait(60) == 0
    plain = answers["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down"
    events = answers["events"]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in served.stderr.read_text()


ENGINE_FAULT = """
import sys
from dsv4c.runtime.engine import Engine

def failing_step(self):
    raise RuntimeError("injected engine fault")

Engine.step = failing_step
from dsv4c.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_that_dies_fails_its_requests_and_the_process_exits_1(serve_artifacts):
    with serving(serve_artifacts / "cpu", "--max-context", str(CONTEXT), launcher=("-c", ENGINE_FAULT)) as served:
        response = httpx.post(f"{served.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_failed"
        assert "injected engine fault" in response.json()["error"]["message"]
        assert served.proc.wait(30) == 1  # a supervisor restarts it
    assert "the engine failed" in served.stderr.read_text()


REQUEST_FAULT = """
import sys
from dsv4c.runtime.engine import Engine

advance = Engine._advance

def advance_failing_on_token_13(self, r, logits):
    if r.prompt[0] == 13:
        raise ValueError("injected fault of one request")
    advance(self, r, logits)

Engine._advance = advance_failing_on_token_13
from dsv4c.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_request_that_fails_fails_alone(serve_artifacts):
    with serving(serve_artifacts / "cpu", "--max-context", str(CONTEXT), launcher=("-c", REQUEST_FAULT)) as served:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        alone = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
        answers = {}

        def post(name, prompt):
            answers[name] = httpx.post(f"{served.url}/v1/completions", json={**body, "prompt": prompt}, timeout=60)

        threads = [threading.Thread(target=post, args=("bad", [13, *PROMPT])),
                   threading.Thread(target=post, args=("good", PROMPT))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answers["bad"].status_code == 500 and answers["bad"].json()["error"]["code"] == "request_failed"
        assert "injected fault of one request" in answers["bad"].json()["error"]["message"]
        assert answers["good"].json()["choices"][0]["token_ids"] == alone
        assert httpx.get(f"{served.url}/health").status_code == 200 and served.metrics()["dsv4c_engine_up"] == 1


REFUSING_SUBMIT = """
import sys
from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine

submit = Engine.submit

def submit_refusing_token_13(self, prompt, params, *args, **kwargs):
    if prompt[0] == 13:
        raise UsageError("injected refusal")
    return submit(self, prompt, params, *args, **kwargs)

Engine.submit = submit_refusing_token_13
from dsv4c.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_refused_request_leaves_no_traceback_in_the_log(serve_artifacts):
    """A request of several choices that the engine refuses is a 400; its other choices' refusals,
    which nobody awaits, are no "Future exception was never retrieved" at shutdown."""
    with serving(serve_artifacts / "cpu", "--max-context", str(CONTEXT), launcher=("-c", REFUSING_SUBMIT),
                 no_tracebacks=True) as served:
        for stream in (False, True):
            refused = httpx.post(f"{served.url}/v1/completions", json={"prompt": [13, *PROMPT], "n": 4,
                                                                      "max_tokens": 2, "stream": stream}, timeout=60)
            assert refused.status_code == 400 and "injected refusal" in refused.json()["error"]["message"]
        good = httpx.post(f"{served.url}/v1/completions", json={"prompt": PROMPT, "n": 4, "max_tokens": 2}, timeout=60)
        assert good.status_code == 200
    assert served.proc.returncode == 0 and "never retrieved" not in served.stderr.read_text()


def test_a_resent_prompt_hits_the_prefix_cache(server):
    before = server.metrics()
    prompt = [6 + (7 * i) % 500 for i in range(600)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first, second = (_post(server, "/v1/completions", body).json() for _ in range(2))
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    # OpenAI's usage says how much of the prompt came from the cache: two whole blocks the second time.
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)] == [0, 512]
    streamed = _post(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 512}
    after = server.metrics()
    assert after["dsv4c_prefix_cache_queries_total"] - before.get("dsv4c_prefix_cache_queries_total", 0) == 1800
    assert after["dsv4c_prefix_cache_hits_total"] - before.get("dsv4c_prefix_cache_hits_total", 0) == 1024
    assert 0 < after["dsv4c_kv_pool_cached_ratio"] < 1 and after["dsv4c_preemptions_total"] == 0


def test_refused_choices_give_their_places_back(server):
    # The server holds 4 running + 12 waiting: refused requests of 8 choices must not keep theirs.
    for _ in range(3):
        refused = _post(server, "/v1/completions", {"prompt": PROMPT, "n": 8, "max_tokens": CONTEXT})
        assert refused.status_code == 400 and "max_context" in refused.json()["error"]["message"]
    full = _post(server, "/v1/completions", {"prompt": PROMPT, "n": 16, "max_tokens": 1})
    assert full.status_code == 200 and len(full.json()["choices"]) == 16


def test_a_request_that_can_never_be_admitted_is_a_400_even_when_the_server_is_full(server, client):
    """4 running + 12 waiting: a request of 17 choices, or longer than the context, will never get in,
    so a 503 with Retry-After would have its client retry forever."""
    impossible = [({"prompt": PROMPT, "n": 17}, "too_many_choices", "17 requests, more than this server ever holds "
                   "(4 running + 12 waiting)"),
                  ({"prompt": [PROMPT] * 17}, "too_many_choices", "17 prompt(s) x n = 1"),
                  ({"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT) + 1}, "invalid_value", "max_context"),
                  ({"prompt": [6] * (CONTEXT + 1), "max_tokens": None}, "invalid_value", "max_context")]
    with httpx.Client(limits=httpx.Limits(max_connections=32), headers=AUTH, timeout=60) as http:
        long = {"prompt": PROMPT, "max_tokens": CONTEXT - len(PROMPT), "ignore_eos": True, "stream": True}
        opened = [http.stream("POST", f"{server.url}/v1/completions", json=long) for _ in range(16)]
        try:
            assert all(s.__enter__().status_code == 200 for s in opened)
            server.wait_metrics(lambda m: m["dsv4c_requests_running"] == 4 and m["dsv4c_requests_waiting"] == 12)
            full = http.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            assert full.status_code == 503 and full.headers["Retry-After"] == "1"
            for body, code, fragment in impossible:
                refused = http.post(f"{server.url}/v1/completions", json={"max_tokens": 1, **body})
                assert refused.status_code == 400 and "Retry-After" not in refused.headers, refused.text
                assert refused.json()["error"]["code"] == code and fragment in refused.json()["error"]["message"]
            with pytest.raises(openai.BadRequestError, match="max_context"):
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w6"}],
                                               max_tokens=CONTEXT)
        finally:
            for s in opened:
                s.__exit__(None, None, None)
    server.wait_metrics(lambda m: m["dsv4c_requests_running"] == 0 and m["dsv4c_requests_waiting"] == 0)

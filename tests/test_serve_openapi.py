"""`dsv4c serve`'s /openapi.json and /docs, and schemathesis driving the live server from that
schema: a few hundred generated requests (valid and not), none answered with a 5xx, every
answer in the documented shape."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import negative_data_rejection, not_a_server_error, response_schema_conformance

from dsv4c.runtime.serve.chat import CHAT_OPTIONS_SCHEMA
from dsv4c.runtime.serve.protocol import CHAT_PROTOCOL

from serving import serving

# A small context and few places, so that every request the schema lets through is short.
CONTEXT, RUNNING, WAITING = 24, 2, 3


@pytest.fixture(scope="module")
def api(serve_artifacts):
    with serving(serve_artifacts / "cpu", "--max-context", str(CONTEXT), "--max-requests", str(RUNNING),
                 "--max-waiting", str(WAITING), no_tracebacks=True) as served:
        yield served


@pytest.fixture(scope="module")
def api_schema(api):
    return schemathesis.openapi.from_url(f"{api.url}/openapi.json")


def test_the_schema_holds_every_field_with_its_bounds(api):
    document = httpx.get(f"{api.url}/openapi.json").json()
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = body["properties"]
    assert body["required"] == ["prompt"] and body["additionalProperties"] is False
    assert fields["n"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": RUNNING + WAITING}
    assert fields["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": CONTEXT}
    assert fields["prompt"]["anyOf"][1]["items"] == {"type": "integer", "minimum": 0, "maximum": 511}
    assert {"best_of", "logit_bias", "user", "echo", "logprobs", "stream_options"} <= set(fields)
    chat = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert CHAT_PROTOCOL == set(CHAT_OPTIONS_SCHEMA) and CHAT_PROTOCOL <= set(chat["properties"])
    assert document["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]
    docs = httpx.get(f"{api.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/tokenizer_info"), ("GET", "/health"),
              ("GET", "/metrics")]


def test_the_schema_lists_every_operation(api_schema):
    listed = {(result.ok().method.upper(), result.ok().path) for result in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_no_generated_request_gets_a_5xx(api_schema, method, path):
    """schemathesis' cases of one operation (its pytest plugin does not run on this pytest: the
    cases are drawn with hypothesis here)."""
    statuses = []

    @given(case=api_schema[path][method].as_strategy())
    @settings(max_examples=100 if method == "POST" else 5, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def answered(case):
        response = case.call_and_validate(checks=[not_a_server_error, response_schema_conformance,
                                                  negative_data_rejection], timeout=30)
        statuses.append(response.status_code)

    answered()
    assert 200 in statuses, statuses  # answers were checked against their documented shape too

"""A bounded fuzz run of the OpenAPI schema: schemathesis generates valid and invalid
requests for every operation from the server's own /openapi.json (fixed seed, 20 per operation
and mode); the server must never answer 5xx, and every answer must be documented and match its
documented schema and content type."""

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from mtp_serve.server.limits import Limits
from support.server import serve

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server(checkpoint_dir):
    # A small context and default completion: generated requests finish quickly.
    s = serve(checkpoint_dir("qwen3_5", agreeable=True), mtp_depth=2, fixed_depth=True, max_context=128,
              default_max_tokens=4, limits=Limits(max_request_bytes=64 << 10))
    yield s
    s.stop()


EXAMPLES = 20  # per operation and mode
# the generating and counting routes: fuzzed in both modes (a stored response's cancel takes only its id)
BODY_POSTS = {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "POST /v1/messages/count_tokens",
              "POST /v1/responses"}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_server_errors_and_responses_as_documented(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(fuzz_server.root + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    sent = {}
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def fuzz(case):
            sent[operation.label] = sent.get(operation.label, 0) + 1
            case.call_and_validate(checks=CHECKS, timeout=60)

        try:
            fuzz()
        except Unsatisfiable:  # an operation without a body or typed parameters has no invalid request
            assert mode is GenerationMode.NEGATIVE and (operation.method.upper() in ("GET", "HEAD")
                                                        or "{rid}" in operation.path), operation.label
    posts = [label for label in sent if label.startswith("POST")]
    assert BODY_POSTS <= set(posts) and all(sent[label] >= EXAMPLES // 2 for label in posts), sent


# ---------------------------------------------------------------- tools and constraints

from hypothesis import strategies as st  # noqa: E402

SPECIAL = ["</tool_call>", "<|im_end|>", "<think>", "<tool_call>"]
WORD = st.sampled_from(["city", "x y", "a", "é"] + SPECIAL) | st.text(min_size=1, max_size=6)
LEAF = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "object", "array", "strin"])}),
    st.fixed_dictionaries({"type": st.just("string"), "enum": st.lists(WORD, min_size=1, max_size=3) | st.integers()}),
    st.fixed_dictionaries({"type": st.just("string"), "pattern": st.sampled_from(["[a-z]{2}", "</tool_call>", "("]) | st.integers()}),
    st.fixed_dictionaries({"const": WORD}),
    st.fixed_dictionaries({"type": st.just("string"), "maxLength": st.integers(-1, 6)}),
    st.just({"$ref": "#"}),
)
PARAMS = st.one_of(
    st.fixed_dictionaries({"type": st.just("object"),
                           "properties": st.dictionaries(WORD, LEAF, max_size=3) | st.lists(st.integers(), max_size=2),
                           "required": st.lists(WORD, max_size=2) | st.integers()}),
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.fixed_dictionaries({"a": st.just({"$ref": "#"})}),
                           "required": st.just(["a"])}),
    LEAF, st.integers(), st.just({}),
)
CHOICE = st.sampled_from(["auto", "required", "none", "named"])
STREAM_FLAG = st.booleans()


@st.composite
def chat_body(draw):
    name = draw(WORD)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": draw(STREAM_FLAG),
            "tools": [{"type": "function", "function": {"name": name, "parameters": draw(PARAMS)}}]}
    choice = draw(CHOICE)
    body["tool_choice"] = {"type": "function", "function": {"name": name}} if choice == "named" else choice
    extra = draw(st.sampled_from([None, "guided_regex", "guided_choice", "guided_json"]))
    if extra is not None and choice in ("auto", "none"):
        body[extra] = draw({"guided_regex": st.sampled_from(["</tool_call>", "[a-z]{3}", "<\\|im_end\\|>x"]),
                            "guided_choice": st.lists(WORD, min_size=1, max_size=4), "guided_json": PARAMS}[extra])
    return body


@st.composite
def messages_body(draw):
    name = draw(WORD)
    body = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "stream": draw(STREAM_FLAG), "tools": [{"name": name, "input_schema": draw(PARAMS)}]}
    choice = draw(CHOICE)
    body["tool_choice"] = ({"type": "tool", "name": name} if choice == "named" else
                           {"type": {"required": "any"}.get(choice, choice)})
    return body


@st.composite
def responses_body(draw):
    name = draw(WORD)
    body = {"model": "test-model", "input": "Hi", "max_output_tokens": 6, "stream": draw(STREAM_FLAG),
            "tools": [{"type": "function", "name": name, "parameters": draw(PARAMS)}]}
    choice = draw(CHOICE)
    body["tool_choice"] = {"type": "function", "name": name} if choice == "named" else choice
    if choice in ("auto", "none") and draw(st.booleans()):
        body["text"] = {"format": {"type": "json_schema", "name": "out", "schema": draw(PARAMS)}}
    return body


TOOL_EXAMPLES = 40  # per API


@pytest.fixture(scope="module")
def tools_server(checkpoint_dir):
    s = serve(checkpoint_dir("qwen3_5", agreeable=True), mtp_depth=2, fixed_depth=True, max_context=1024,
              default_max_tokens=6, limits=Limits(max_request_bytes=64 << 10))
    yield s
    s.stop()


@pytest.mark.parametrize("path,bodies", [("/v1/chat/completions", chat_body()), ("/v1/messages", messages_body()),
                                         ("/v1/responses", responses_body())], ids=["chat", "messages", "responses"])
def test_tools_and_constraints_never_5xx(tools_server, path, bodies):
    """Bodies with tools (well-formed, malformed, special-token text in names and enums, recursive)
    and output constraints: a 4xx or a documented answer, never a 5xx, and no error in the middle of
    a stream that began as a success."""
    schema = schemathesis.openapi.from_url(tools_server.root + "/openapi.json")
    operation = next(r.ok() for r in schema.get_all_operations() if r.ok().label == f"POST {path}")
    seen = {}

    @given(body=bodies)
    @settings(max_examples=TOOL_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(body):
        case = operation.Case(body=body, media_type="application/json")
        response = case.call_and_validate(checks=[not_a_server_error, status_code_conformance], timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if body.get("stream") and response.status_code == 200:
            events = [line for line in response.text.splitlines() if line.startswith(("data:", "event:"))]
            assert not any('"server_error"' in e or '"api_error"' in e or "internal error" in e for e in events), events[-5:]

    fuzz()
    print(f"\n{path}: answers by status {dict(sorted(seen.items()))}")
    assert seen.get(400, 0) and seen.get(200, 0), seen  # both refusals and answers were exercised

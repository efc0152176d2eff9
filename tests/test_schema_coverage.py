"""The schemas people really send: oneOf, unknown formats, dependencies,
dependentRequired, uniqueItems, if/then, recursive $ref with siblings. Each is served or
refused as json_schema_mode says, relaxed keywords are reported with their paths, the
finished output's `valid` agrees with jsonschema on the full schema, and MTP output equals
plain output under the same constraint. A forced tool call whose parameters use oneOf goes
through chat, Messages and Responses."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mtp_serve.server.errors import APIError
from mtp_serve.server.schema_relax import disjoint, serve_schema, validator_class

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

INT = {"type": "integer", "minimum": 0, "maximum": 9}
SHORT = {"type": "string", "maxLength": 6}


def obj(props: dict, required=None, **more) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props), "additionalProperties": False, **more}


# name: (schema, exact in strict mode, expected relaxed paths, expected ignored paths)
CASES = {
    "oneOf_disjoint": (obj({"v": {"oneOf": [INT, SHORT]}}), True, [], []),
    "oneOf_overlapping": (obj({"v": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 6},
                                                {"type": "integer", "minimum": 4, "maximum": 9}]}}),
                          False, ["/properties/v/oneOf"], []),
    "unknown_formats": (obj({"version": {"type": "string", "format": "semverVersion", "maxLength": 8},
                             "tag": {"type": "string", "format": "", "maxLength": 4}}),
                        True, [], ["/properties/version/format", "/properties/tag/format"]),
    "dependencies": (obj({"a": SHORT, "b": INT}, required=[], dependencies={"a": ["b"]}), True, [], []),
    "dependentRequired": (obj({"a": SHORT, "b": INT, "c": INT}, required=["c"], dependentRequired={"a": ["b"]}), True, [], []),
    "uniqueItems": (obj({"xs": {"type": "array", "items": INT, "maxItems": 4, "uniqueItems": True}}),
                    False, ["/properties/xs/uniqueItems"], []),
    "if_then": (obj({"kind": {"enum": ["a", "b"]}, "n": INT}, required=["kind"],  # a finite discriminator: branches
                    **{"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]}}), True, [], []),
    "if_then_else": (obj({"kind": SHORT, "n": INT, "m": INT}, required=["kind"],  # any string: relaxed
                         **{"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]}, "else": {"required": ["m"]}}),
                     False, ["/if", "/then", "/else"], []),
    "recursive_ref_siblings": ({"$defs": {"node": obj({"v": INT, "next": {"$ref": "#/$defs/node", "maxProperties": 2}},
                                                      required=["v"])},
                                "$ref": "#/$defs/node"}, False, ["/$defs/node/properties/next/maxProperties"], []),
}
MSGS = [{"role": "user", "content": "Answer in JSON."}]


def chat(server, schema: dict, mode=None, **body) -> httpx.Response:
    payload = {"model": "test-model", "messages": MSGS, "max_tokens": 80, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **body}
    if mode is not None:
        payload["json_schema_mode"] = mode
    return httpx.post(server.base_url + "/chat/completions", json=payload, timeout=120)


def check_report(report: dict, schema: dict, text: str, finish: str, relaxed, ignored) -> None:
    """The report lists what was relaxed, and its verdict is jsonschema's on the full schema."""
    assert report["relaxed"] == relaxed and report["ignored"] == ignored and report["exact"] == (not relaxed), report
    if finish == "length":
        assert report["valid"] is False and "cut" in report["errors"][0]
        return
    errors = list(validator_class(schema)(schema).iter_errors(json.loads(text)))
    assert report["valid"] == (not errors), (report, text)
    assert bool(report["errors"]) == bool(errors)


# ---------------------------------------------------------------- served or refused as the mode says


@pytest.mark.parametrize("name", list(CASES))
def test_served_relaxed_reported_and_validated(server, name):
    schema, _, relaxed, ignored = CASES[name]
    r = chat(server, schema)
    assert r.status_code == 200, r.text
    body = r.json()
    choice, report = body["choices"][0], body["structured_output"]
    check_report(report, schema, choice["message"]["content"], choice["finish_reason"], relaxed, ignored)
    assert report["mode"] == "relaxed"
    assert r.headers["x-structured-output"] == f"{'exact' if not relaxed else 'relaxed'}; valid={str(report['valid']).lower()}"


@pytest.mark.parametrize("name", list(CASES))
def test_strict_serves_exact_and_refuses_the_rest_naming_keyword_and_path(server, name):
    schema, exact, relaxed, _ = CASES[name]
    r = chat(server, schema, mode="strict", max_tokens=40)
    if exact:
        assert r.status_code == 200, r.text
        assert r.json()["structured_output"]["mode"] == "strict"
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    keyword = relaxed[0].rsplit("/", 1)[-1]
    assert f"'{keyword}'" in err["message"] and relaxed[0] in err["message"], err
    assert err["code"] == "invalid_constraint" and err["param"] == "response_format"
    assert server.service.engine.active_count == 0


@pytest.mark.parametrize("name", list(CASES))
def test_mtp_equals_plain_under_the_same_constraint(server, name):
    schema = CASES[name][0]
    plain = chat(server, schema, mtp_depth=0).json()
    mtp = chat(server, schema).json()
    spec = mtp["usage"]["speculative"]
    assert spec["drafted"] + spec.get("forced_drafted", 0) + spec.get("copy_drafted", 0) > 0, spec  # head, grammar or copies
    assert mtp["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert mtp["structured_output"] == plain["structured_output"]


def test_enforced_dependencies_and_conditionals_hold_under_sampling(server):
    """dependentRequired / dependencies / if-then on a finite discriminator are grammar branches,
    not relaxed: every sampled output obeys them. Outputs cut by the token limit are unfinished JSON,
    so seeds are tried until three finish (each schema must see at least one)."""
    for name in ("dependencies", "dependentRequired", "if_then"):
        schema = CASES[name][0]
        finished = 0
        for seed in range(16):
            r = chat(server, schema, temperature=1.0, seed=seed).json()
            if r["choices"][0]["finish_reason"] != "stop":
                continue
            assert r["structured_output"]["valid"] is True, r
            validator_class(schema)(schema).validate(json.loads(r["choices"][0]["message"]["content"]))
            finished += 1
            if finished == 3:
                break
        assert finished, f"{name}: no sampled output finished within max_tokens, so nothing was checked"


def test_server_default_mode_and_bad_mode(server):
    config = server.service.config
    schema = CASES["uniqueItems"][0]
    config.json_schema_mode = "strict"
    try:
        assert chat(server, schema).status_code == 400
        assert chat(server, schema, mode="relaxed").status_code == 200  # the request's field wins
    finally:
        config.json_schema_mode = "relaxed"
    r = chat(server, schema, mode="loose")
    assert r.status_code == 400 and "json_schema_mode" in r.json()["error"]["message"]


def test_streams_report_on_their_last_chunk(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    schema = CASES["uniqueItems"][0]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for with_usage in (True, False):
        chunks = list(c.chat.completions.create(model="test-model", messages=MSGS, response_format=fmt, max_tokens=80,
                                                temperature=0, stream=True, stream_options={"include_usage": with_usage}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        last = chunks[-1].model_extra
        assert (chunks[-1].usage is not None) == with_usage
        finish = next(ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason)
        check_report(last["structured_output"], schema, text, finish, ["/properties/xs/uniqueItems"], [])
        assert all("structured_output" not in ch.model_extra for ch in chunks[:-1])


def test_completions_guided_json_reports_too(server):
    schema = CASES["oneOf_overlapping"][0]
    r = httpx.post(server.base_url + "/completions", json={"model": "test-model", "prompt": "JSON:", "max_tokens": 40,
                                                           "temperature": 0, "guided_json": schema}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    check_report(body["structured_output"], schema, body["choices"][0]["text"], body["choices"][0]["finish_reason"],
                 ["/properties/v/oneOf"], [])
    assert r.headers["x-structured-output"].startswith("relaxed; valid=")


def test_unconstrained_responses_carry_no_report(server):
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "test-model", "messages": MSGS, "max_tokens": 5}, timeout=60)
    assert "structured_output" not in r.json() and "x-structured-output" not in r.headers


# ---------------------------------------------------------------- forced tool calls whose parameters use oneOf

PICK = {"type": "object", "additionalProperties": False, "required": ["target", "level"], "properties": {
    "target": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 8}]},  # disjoint
    "level": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 6}, {"type": "integer", "minimum": 4, "maximum": 9}]},
}}
PICK_RELAXED = ["pick:/properties/level/oneOf"]


def check_call_report(report: dict, args_list) -> None:
    assert report["relaxed"] == PICK_RELAXED and not report["exact"]
    errors = [e for args in args_list for e in jsonschema.Draft202012Validator(PICK).iter_errors(args)]
    assert report["valid"] == (not errors), (report, args_list)


def test_forced_oneof_tool_through_chat(server):
    tool = {"type": "function", "function": {"name": "pick", "parameters": PICK}}
    payload = {"model": "test-model", "messages": [{"role": "user", "content": "Pick one."}], "tools": [tool],
               "tool_choice": {"type": "function", "function": {"name": "pick"}}, "max_tokens": 120,
               "parallel_tool_calls": False, "temperature": 0}
    r = httpx.post(server.base_url + "/chat/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    calls = body["choices"][0]["message"]["tool_calls"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and calls
    check_call_report(body["structured_output"], [json.loads(c["function"]["arguments"]) for c in calls])
    assert r.headers["x-structured-output"].startswith("relaxed; valid=")
    plain = httpx.post(server.base_url + "/chat/completions", json={**payload, "mtp_depth": 0}, timeout=120).json()
    assert plain["choices"][0]["message"]["tool_calls"][0]["function"] == calls[0]["function"]
    strict = httpx.post(server.base_url + "/chat/completions", json={**payload, "json_schema_mode": "strict"}, timeout=60)
    assert strict.status_code == 400 and "/properties/level/oneOf" in strict.json()["error"]["message"]


def test_forced_oneof_tool_through_messages(server):
    a = anthropic.Anthropic(base_url=server.root, api_key="none", max_retries=0)
    tool = {"name": "pick", "description": "Pick", "input_schema": PICK}
    m = a.messages.create(model="test-model", max_tokens=120, tools=[tool], messages=[{"role": "user", "content": "Pick one."}],
                          tool_choice={"type": "tool", "name": "pick", "disable_parallel_tool_use": True})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses, m
    check_call_report(m.model_extra["structured_output"], [u.input for u in uses])
    with a.messages.stream(model="test-model", max_tokens=120, tools=[tool], messages=[{"role": "user", "content": "Pick one."}],
                           tool_choice={"type": "tool", "name": "pick", "disable_parallel_tool_use": True}) as s:
        events = list(s)
        streamed = [b.input for b in s.get_final_message().content if b.type == "tool_use"]
    delta = next(e for e in events if e.type == "message_delta")
    check_call_report(delta.model_extra["structured_output"], streamed)


def test_forced_oneof_tool_through_responses(server):
    fn = {"type": "function", "name": "pick", "description": "Pick", "parameters": PICK}
    c = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    r = c.responses.create(model="test-model", input="Pick one.", tools=[fn], tool_choice={"type": "function", "name": "pick"},
                           max_output_tokens=120, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(call.name == "pick" for call in calls)
    check_call_report(r.model_extra["structured_output"], [json.loads(call.arguments) for call in calls])
    done = [e for e in c.responses.create(model="test-model", input="Pick one.", tools=[fn], stream=True, parallel_tool_calls=False,
                                          tool_choice={"type": "function", "name": "pick"}, max_output_tokens=120)
            if e.type == "response.completed"]
    assert done and done[0].response.model_extra["structured_output"]["relaxed"] == PICK_RELAXED


def test_responses_text_format_relaxed(server):
    schema = CASES["if_then_else"][0]
    r = httpx.post(server.base_url + "/responses", json={
        "model": "test-model", "input": "JSON please", "max_output_tokens": 80, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    text = "".join(p["text"] for o in body["output"] if o["type"] == "message" for p in o["content"])
    check_report(body["structured_output"], schema, text, "length" if body["status"] == "incomplete" else "stop",
                 ["/if", "/then", "/else"], [])


# ---------------------------------------------------------------- the rewriting alone


def test_discriminated_conditionals_become_one_branch_per_value():
    tagged = {"type": "object", "properties": {"t": {"enum": ["x", "y", "z"]}, "a": INT, "b": INT}, "allOf": [
        {"if": {"properties": {"t": {"const": "x"}}}, "then": {"required": ["a"]}},
        {"if": {"properties": {"t": {"enum": ["y", "z"]}}, "required": ["t"]}, "then": {"required": ["b"]}, "else": {"properties": {"b": False}}}]}
    served = serve_schema(tagged, "strict")
    assert served.exact and "allOf" not in served.schema
    by_value = {b["properties"]["t"].get("const", "absent") if b["properties"]["t"] else "absent": b.get("allOf", [])
                for b in served.schema["anyOf"]}
    assert by_value == {"x": [{"required": ["a"]}, {"properties": {"b": False}}], "y": [{"required": ["b"]}],
                        "z": [{"required": ["b"]}], "absent": [{"required": ["a"]}, {"properties": {"b": False}}]}


def test_disjointness_is_sound():
    root: dict = {}
    assert disjoint({"type": "string"}, {"type": "integer"}, root)
    assert not disjoint({"type": "integer"}, {"type": "number"}, root)
    assert disjoint({"const": 1}, {"const": True}, root)  # JSON: 1 is not true
    tagged = lambda t: {"type": "object", "required": ["k"], "properties": {"k": {"const": t}}}  # noqa: E731
    assert disjoint(tagged("a"), tagged("b"), root)
    assert not disjoint({"required": ["k"], "properties": {"k": {"const": "a"}}}, tagged("b"), root)  # a string matches the first
    assert not disjoint({"type": "string", "maxLength": 3}, {"type": "string"}, root)


@pytest.mark.parametrize("schema, reason, where", [
    ({"type": "nope"}, "Invalid type", "'type' at /type"),
    (obj({"a": {"type": "string", "minLength": 5, "maxLength": 2}}), "unsatisfiable", "'minLength' at /properties/a/minLength"),
    ({"$defs": {"x": {"type": "nope"}}, "properties": {"a": {"$ref": "#/$defs/x"}}}, "Invalid type", "'type' at /$defs/x/type"),
    (obj({"a": {"$ref": "#/nowhere"}}), "does not exist", "'$ref' at /properties/a/$ref"),  # broken, not relaxed
])
def test_unservable_schema_is_a_400_naming_reason_keyword_and_path(schema, reason, where):
    with pytest.raises(APIError) as e:
        serve_schema(schema, "relaxed", "response_format.schema")
    assert e.value.status == 400 and e.value.param == "response_format.schema"
    assert reason in e.value.message and where in e.value.message, e.value.message


def test_unservable_schema_through_the_api(server):
    r = chat(server, obj({"a": {"type": "string", "minLength": 5, "maxLength": 2}}))
    assert r.status_code == 400 and "'minLength' at /properties/a/minLength" in r.json()["error"]["message"]
    assert server.service.engine.active_count == 0


def test_served_schemas_are_cached_and_originals_untouched():
    schema = CASES["if_then_else"][0]
    before = json.dumps(schema)
    a, b = serve_schema(schema), serve_schema(json.loads(before))
    assert a is b and json.dumps(schema) == before and "if" not in a.schema


def test_schemas_llguidance_compiles_are_served_as_they_are():
    """Same grammar, same masks as before: only schemas llguidance refuses are rewritten."""
    from pathlib import Path

    from mtp_serve.engine.grammar import json_schema_error

    files = sorted((Path(__file__).resolve().parents[1] / "bench" / "data" / "jsonschemabench").glob("*/*.json"))
    assert len(files) == 120
    compiled = [s for s in (json.loads(f.read_text()) for f in files) if json_schema_error(json.dumps(s)) is None]
    assert len(compiled) > 80
    assert all(serve_schema(s, "strict").schema == s for s in compiled)


# ---------------------------------------------------------------- tool schemas with $defs (pydantic's nested models)

NESTED = {"type": "object", "additionalProperties": False, "required": ["item", "tag"],
          "properties": {"item": {"$ref": "#/$defs/Item"}, "tag": {"$ref": "#/$defs/Tag"}},
          "$defs": {"Item": {"type": "object", "additionalProperties": False, "required": ["n"],
                             "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "kind": {"$ref": "#/$defs/Tag"}}},
                    "Tag": {"type": "string", "enum": ["red", "blue"]}}}


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
def test_tool_schemas_with_definitions_compile_in_both_call_formats(parser):
    import llguidance

    from mtp_serve.server import constraints

    c = constraints.tool_calls(parser, [{"type": "function", "function": {"name": "put", "parameters": NESTED}}], None, False, set())
    assert llguidance.LLMatcher.validate_grammar_with_warnings(llguidance.LLMatcher.grammar_from_lark(c.source), None) == (False, [])
    assert c.served["put"].exact


def test_forced_tool_with_definitions_through_chat(server):
    """Objects come back as objects and enums as strings; the random model may pad the JSON
    with whitespace until max_tokens (reported as cut), so a few seeds are tried."""
    tool = {"type": "function", "function": {"name": "put", "parameters": NESTED}}
    finished = 0
    for seed in range(6):
        r = httpx.post(server.base_url + "/chat/completions", json={
            "model": "test-model", "messages": [{"role": "user", "content": "Put one."}], "tools": [tool], "tool_choice": "required",
            "max_tokens": 120, "parallel_tool_calls": False, "temperature": 1.0, "seed": seed}, timeout=120)
        body = r.json()
        report = body["structured_output"]
        assert report["exact"] and report["relaxed"] == []
        if body["choices"][0]["finish_reason"] != "tool_calls":
            assert report["valid"] is False and "cut" in report["errors"][0]
            continue
        finished += 1
        for call in body["choices"][0]["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), NESTED)
        assert report["valid"] is True and report["errors"] == []
    assert finished

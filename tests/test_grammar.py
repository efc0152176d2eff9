"""Constrained decoding with MTP stays exact: a constrained MTP run emits exactly the
constrained plain run's tokens (greedy) or its distribution (sampled), alone and in a
batch beside unconstrained rows; and what it emits matches the constraint."""

import json

import jsonschema
import pytest
from scipy.stats import chi2_contingency

from mtp_serve.engine.generator import generate
from mtp_serve.engine.grammar import Constraint, GrammarError
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "address"], "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "address": {"type": "object", "additionalProperties": False, "required": ["zip"],
                        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "array_bounds": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    "enum": {"enum": ["red", "green", "blue", 7, None]},
    "any_of": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "string", "maxLength": 3}]},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["x", "y"], "properties": {
        "x": {"type": "number", "minimum": 0.5, "maximum": 2.5}, "y": {"type": "integer", "exclusiveMaximum": 3}}},
    "optional": {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {
        "a": {"type": "boolean"}, "b": {"type": "string", "maxLength": 4}, "c": {"type": "null"}}},
    "defs_ref": {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                     "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
                 "type": "object", "additionalProperties": False, "required": ["from", "to"],
                 "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}}},
    "pattern": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{2}$"},
}


def run(lm, prompt, params, depth, policy=None):
    out, finish, stats = [], None, None
    for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth, policy=policy):
        out += chunk.token_ids
        finish, stats = chunk.finish_reason, chunk.stats
    return out, finish, stats


def text_of(lm, tokens):
    eos = set(lm.tokenizer.eos_token_ids)
    return lm.tokenizer.decode([t for t in tokens if t not in eos])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_constrained_greedy_mtp_equals_constrained_plain(family, loaded):
    lm = loaded(family, agreeable=True)
    prompt = [11, 22, 33, 44]
    params = SamplingParams(max_tokens=60, constraint=Constraint.json_schema(PERSON))
    plain, finish, _ = run(lm, prompt, params, 0)
    assert finish == "stop"
    for depth in (1, 2, 3):
        ours, _, stats = run(lm, prompt, params, depth)
        assert ours == plain, depth
        assert sum(stats.drafted) > 0 and 0 < sum(stats.accepted) < sum(stats.drafted), "accept and reject both ran"
    jsonschema.validate(json.loads(text_of(lm, plain)), PERSON)


def test_constrained_greedy_on_the_demo_model(demo_model):
    lm = demo_model
    prompt = lm.tokenizer.encode("def settings():\n    return ")
    params = SamplingParams(max_tokens=80, constraint=Constraint.json_schema(SCHEMAS["nested"]))
    plain, _, _ = run(lm, prompt, params, 0)
    for depth in (1, 2, 3):
        assert run(lm, prompt, params, depth)[0] == plain, depth
    regex = SamplingParams(max_tokens=40, constraint=Constraint("regex", r"def [a-z_]{1,16}\(self(, [a-z]{1,8}){0,2}\):"))
    plain, finish, _ = run(lm, prompt, regex, 0)
    assert finish == "stop" and run(lm, prompt, regex, 3)[0] == plain


def test_constrained_and_free_rows_share_a_batch(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    rows = {
        "json": ([5, 6, 7], SamplingParams(max_tokens=50, constraint=Constraint.json_schema(PERSON))),
        "free": ([8, 9], SamplingParams(max_tokens=40, ignore_eos=True)),
        "choice": ([10, 11, 12], SamplingParams(max_tokens=20, constraint=Constraint.choice(["yes", "no", "maybe"]))),
        "seeded": ([13, 14], SamplingParams(max_tokens=50, temperature=1.0, seed=9,
                                            constraint=Constraint("regex", r"[a-f]{3,8}(-[0-9]{2})+"))),
    }
    for depth in (1, 3):
        sched = Scheduler(lm.model, lm.tokenizer, policy=DepthPolicy(max_depth=depth, fixed=True))
        for key, (prompt, params) in rows.items():
            sched.add(key, prompt, params, depth)
        out = {k: [] for k in rows}
        while sched.has_work():
            for key, chunk in sched.step():
                assert not isinstance(chunk, Exception), chunk
                out[key] += chunk.token_ids
        for key, (prompt, params) in rows.items():
            assert out[key] == run(lm, prompt, params, 0)[0], (depth, key)
    assert text_of(lm, out["choice"]) in ("yes", "no", "maybe")


@pytest.mark.distribution
def test_constrained_sampling_matches_constrained_plain_distribution(loaded):
    """Unseeded sampling: drafts from the masked q, rejection against the masked p."""
    lm = loaded("qwen3_5", agreeable=True)
    constraint = Constraint("regex", ".{4}")  # masks special tokens and lone UTF-8 bytes
    prompt, n = [11, 22, 33, 44, 55], 500

    def sample(depth):
        # One scheduler serves the n requests one after the other, as the server's does (its
        # grammar compiler, built once, is most of what a scheduler per request would cost).
        sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=1, prefill_chunk=None,
                          policy=DepthPolicy(max_depth=depth, fixed=True))  # as generate() makes it
        outs, drafted, accepted = [], 0, 0
        for i in range(n):
            # (4 tokens: the round after the first may emit the other 3, so it drafts 2)
            sched.add(i, prompt, SamplingParams(max_tokens=4, temperature=1.0, constraint=constraint), depth)
            toks, stats = [], None
            while sched.has_work():
                for _, chunk in sched.step():
                    assert not isinstance(chunk, Exception), chunk
                    toks, stats = toks + chunk.token_ids, chunk.stats
            outs.append(toks)
            drafted, accepted = drafted + sum(stats.drafted), accepted + sum(stats.accepted)
        return outs, accepted, drafted

    plain, _, _ = sample(0)
    mtp, accepted, drafted = sample(2)
    assert all(len(s) == 4 for s in plain + mtp)
    special = set(range(256, lm.model.vocab_size))  # the byte tokenizer's specials: never a character
    assert not special & {t for s in plain + mtp for t in s}
    assert accepted >= 30 and drafted - accepted >= 30, (accepted, drafted)
    for pos in range(4):
        a, b = [s[pos] for s in plain], [s[pos] for s in mtp]
        keys = sorted(set(a) | set(b))
        p = chi2_contingency([[a.count(k) for k in keys], [b.count(k) for k in keys]])[1]
        assert p > 0.001, f"position {pos}: p={p:.2g}"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_outputs_that_stop_validate_against_the_schema(name, loaded):
    """A random-weight model sampled under each schema: whatever finishes is valid."""
    lm = loaded("qwen3_5")
    schema = SCHEMAS[name]
    stopped = 0
    for seed in range(6):
        params = SamplingParams(max_tokens=80, temperature=1.0, seed=seed, constraint=Constraint.json_schema(schema))
        toks, finish, _ = run(lm, [1, 2, 3], params, 2)
        if finish == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text_of(lm, toks)), schema)
    assert stopped >= 3, f"only {stopped} of 6 samples finished"


@pytest.mark.parametrize("constraint, message", [
    (Constraint("json_schema", '{"type": "foo"}'), "json schema"),
    (Constraint("regex", "(unclosed"), "regex"),
    (Constraint("lark", "start: missing_rule"), "lark"),
])
def test_invalid_constraints_are_refused_by_name(constraint, message, loaded):
    lm = loaded("qwen3_5")
    sched = Scheduler(lm.model, lm.tokenizer)
    with pytest.raises(GrammarError, match=f"invalid {message}"):
        sched.grammar_compiler().check(constraint)
    with pytest.raises(GrammarError):
        sched.add("bad", [1, 2], SamplingParams(constraint=constraint), 2)
    assert not sched.has_work()

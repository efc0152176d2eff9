"""What a request's output must match, as one engine `Constraint` (llguidance grammars).

Where a constraint comes from (at most one per request):
- OpenAI `response_format` (chat completions, completions): `{"type": "json_object"}`
  or `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`; the
  Responses API's `text.format` (the same, flattened);
- vLLM-style extras in the request body: `structured_outputs` with one of `json`,
  `regex`, `choice`, `grammar`, or the older `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`. Grammars use llguidance's Lark dialect
  (Lark syntax plus `%json {schema}`, special tokens as `<name>`, lazy rules);
- `tool_choice` "required" / "any" / a named tool, on every API: the output is a
  tool call (several with parallel tool calls) in the model's own format
  (qwen3_coder XML or Hermes JSON) whose arguments follow the tool's JSON schema,
  so the usual tool-call parser reads it.
When the prompt opens a think block, reasoning stays free: the constraint starts
after the model closes it.

JSON schemas (response formats, guided JSON, tool parameters) are served through
`schema_relax.serve_schema` in the request's `json_schema_mode` ("strict" | "relaxed"): the
result is a `SchemaConstraint`, which also carries what the schemas were served as, for the
response's `structured_output` report (`structured.py`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Dict, List, Optional

from functools import lru_cache

from jsonschema import SchemaError
from jsonschema.exceptions import best_match
from jsonschema.validators import Draft202012Validator, validator_for
from llguidance import regex_to_lark

from mtp_serve.engine.grammar import ANY_JSON_OBJECT, Constraint, choice_regex
from mtp_serve.server.errors import bad_request
from mtp_serve.server.schema_relax import ANNOTATIONS, ServedSchema, resolve_ref, serve_schema

THINK_CLOSE = "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
EXTRA_KINDS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


class SchemaConstraint(Constraint):
    """A constraint built from JSON schemas, carrying what each was served as (`served`:
    {"": schema} for an output format, {tool name: schema} for forced tool calls) and the
    mode. The engine reads only `kind` and `source` (`plain()` drops the rest)."""

    def __init__(self, kind: str, source: str, served: Dict[str, ServedSchema], mode: str, tool_calls: bool = False):
        super().__init__(kind, source)
        object.__setattr__(self, "served", served)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "tool_calls", tool_calls)

    def plain(self) -> Constraint:
        return Constraint(self.kind, self.source)


def json_schema(schema: dict, param: str, mode: str) -> SchemaConstraint:
    served = serve_schema(schema, mode, param)
    return SchemaConstraint("json_schema", json.dumps(served.schema), {"": served}, mode)


def _schema(value: Any, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param}: not valid JSON: {e}", param) from e
    if not isinstance(value, dict):
        raise bad_request(f"{param}: a JSON schema must be an object", param)
    return value


def from_response_format(fmt: Optional[dict], param: str = "response_format", mode: str = "relaxed") -> Optional[Constraint]:
    """OpenAI `response_format` (or Responses `text.format`) as a constraint; None for text."""
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_schema(ANY_JSON_OBJECT, param, mode)
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)  # chat nests it; Responses flattens it
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(f"{param}: json_schema needs a 'schema'", param)
        return json_schema(_schema(spec["schema"], f"{param}.schema"), param, mode)  # the message names the path
    raise bad_request(f"{param}: type {kind!r} is not supported (text, json_object, json_schema)", param)


def from_extras(body: Dict[str, Any], mode: str = "relaxed") -> Optional[Constraint]:
    """vLLM-style `structured_outputs` / `guided_*` fields of the request body."""
    found = {}
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        found.update({k: (v, f"structured_outputs.{k}") for k, v in so.items() if k in EXTRA_KINDS and v is not None})
    found.update({k: (body[name], name) for k, name in EXTRA_KINDS.items() if body.get(name) is not None})
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"one output constraint per request; got {', '.join(p for _, p in found.values())}")
    (kind, (value, param)), = found.items()
    if kind == "json":
        return json_schema(_schema(value, param), param, mode)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise bad_request(f"{param} must be a non-empty list of strings", param)
        return Constraint.choice(value)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return Constraint("regex" if kind == "regex" else "lark", value)


def requested(req, mode: str = "relaxed") -> Optional[Constraint]:
    """An OpenAI-style request's output constraint: `response_format` or the vLLM-style fields."""
    fmt = req.response_format.model_dump() if req.response_format is not None else None
    return one_of(from_response_format(fmt, mode=mode), from_extras(req.model_dump(), mode))


def one_of(*constraints: Optional[Constraint]) -> Optional[Constraint]:
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        raise bad_request("one output constraint per request: a forced tool call, response_format and "
                          "structured_outputs / guided_* cannot be combined")
    return given[0] if given else None


# ---------------------------------------------------------------- grammars


def _literal(text: str, added_tokens: set) -> str:
    """A Lark element matching `text`: the special-token reference (`<...>`, the token
    itself) when the tokenizer has it as one added token (llguidance matches those as
    tokens, not as text), else a string."""
    return text if text in added_tokens and text.startswith("<") and text.endswith(">") else json.dumps(text)


def _grammar_entry(c: Constraint) -> dict:
    if c.kind == "json_schema":
        return {"json_schema": json.loads(c.source)}
    if c.kind == "regex":
        return {"lark_grammar": f"start: /{regex_to_lark(c.source)}/"}
    return {"lark_grammar": c.source}


def after_reasoning(c: Constraint, added_tokens: set) -> Constraint:
    """Free reasoning up to the think block's end, then `c`."""
    close = _literal(THINK_CLOSE, added_tokens)
    top = {"grammars": [
        {"lark_grammar": f"start: REASONING {close} /[ \\n]*/ @body\nREASONING: /(?s:.*)/"},
        {"name": "body", **_grammar_entry(c)},
    ]}
    return Constraint("llguidance", json.dumps(top))


PARAM_END = json.dumps("\n</parameter>\n")
MANY_OPTIONS = 256  # string enums longer than this are written as one regular expression


def _special_texts(added_tokens: set) -> list:
    return sorted((t for t in added_tokens if t.startswith("<") and t.endswith(">") and len(t) > 2), key=len, reverse=True)


def _no_special_text(fn: dict, added_tokens: set, where: str) -> None:
    """A forced call writes the tool's name, its parameter names and its enum / const / pattern
    text verbatim; with a special token's text among them (`</tool_call>`, `<|im_end|>`) the call
    could not be read back (the parser splits at that text): a 400 naming it."""
    specials = _special_texts(added_tokens)
    if not specials:
        return

    def found(text) -> Optional[str]:
        return next((t for t in specials if isinstance(text, str) and t in text), None)

    def refuse(what: str, token: str):
        raise bad_request(f"{where}: {what} contains {token!r}, the text of a special token of this model; a forced "
                          "tool call cannot carry it (rename it, or use tool_choice auto)", "tools", "invalid_tool_schema")

    if found(fn.get("name")):
        refuse("the function name", found(fn.get("name")))

    def walk(node, path: str):
        if isinstance(node, list):
            for k, v in enumerate(node):
                walk(v, f"{path}/{k}")
            return
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            here = f"{path}/{key}"
            if key == "properties" and isinstance(value, dict):
                for prop in value:
                    if found(prop):
                        refuse(f"the parameter name at {here}", found(prop))
            if key in ("enum", "const", "pattern"):
                for v in value if isinstance(value, list) else [value]:
                    if found(v):
                        refuse(f"{key} at {here}", found(v))
            walk(value, here)

    walk(fn.get("parameters"), "parameters")


@lru_cache(maxsize=2048)
def _schema_problem(text: str) -> Optional[str]:
    """Why a tool's parameters (as JSON text) are not a JSON schema (its metaschema says), or None."""
    schema = json.loads(text)
    cls = validator_for(schema, default=Draft202012Validator) if isinstance(schema, dict) else Draft202012Validator
    try:
        error = best_match(cls(cls.META_SCHEMA).iter_errors(schema))  # no format checks: patterns are ECMA, not Python
    except (SchemaError, RecursionError, TypeError, ValueError) as e:
        return str(e)
    if error is None:
        return None
    where = "/" + "/".join(map(str, error.absolute_path))
    return f"{error.message} at {where}"


def check_tools(tools: Optional[List[dict]]) -> None:
    """Every tool's parameters validated as JSON Schema (the jsonschema package's metaschema
    check) before any use: a malformed one is a 400 naming the tool and the keyword."""
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}]: a function tool needs a name", "tools", "invalid_tool_schema")
        params = fn.get("parameters")
        if params is None:
            continue
        try:
            text = json.dumps(params, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise bad_request(f"tools[{i}] ({fn['name']!r}): parameters are not JSON: {e}", "tools", "invalid_tool_schema") from e
        problem = _schema_problem(text)
        if problem is not None:
            raise bad_request(f"tools[{i}] ({fn['name']!r}): parameters are not a valid JSON schema: {problem}", "tools",
                              "invalid_tool_schema")


def tool_calls(parser: str, tools: List[dict], name: Optional[str], parallel: bool, added_tokens: set,
               mode: str = "relaxed") -> SchemaConstraint:
    """A forced tool call in the model's format: one (or, with `parallel`, several) of
    `tools` (only `name` when given), arguments following each tool's schema (as served in `mode`)."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    for i, fn in enumerate(fns):
        _no_special_text(fn, added_tokens, f"tools[{i}]" if name is None else f"tool {fn['name']!r}")
    open_, close = _literal(TOOL_CALL_OPEN, added_tokens), _literal(TOOL_CALL_CLOSE, added_tokens)
    more = ' ("\\n" call)*' if parallel else ""
    rules = ["start: call" + more, "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
    served: Dict[str, ServedSchema] = {}
    for i, fn in enumerate(fns):
        param = f"tools[{i}].parameters" if name is None else f"tool {fn['name']!r} parameters"
        s = serve_schema(fn.get("parameters") or {"type": "object"}, mode, param)
        if parser != "hermes":
            s = _xml_served(s, mode, param)
        served[fn["name"]] = s
        schema = s.schema
        if parser == "hermes":
            call = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": fn["name"]}, "arguments": schema}, **_definitions(schema)}
            rules.append(f'call_{i}: {open_} "\\n" %json {json.dumps(call)} "\\n" {close}')
        else:
            rules += _xml_call(i, fn["name"], schema, open_, close)
    return SchemaConstraint("lark", "\n".join(rules), served, mode, tool_calls=True)


XML_ENFORCED = {"type", "properties", "required", "additionalProperties", "$defs", "definitions"}


def _xml_served(s: ServedSchema, mode: str, param: str) -> ServedSchema:
    """The XML call format writes each listed property on its own: keywords at the top of
    the parameters' schema other than these are not enforced (listed as relaxed)."""
    top = [f"/{k}" for k in s.schema if k not in XML_ENFORCED and k not in ANNOTATIONS and not k.startswith("x-")]
    if not top:
        return s
    if mode == "strict":
        raise bad_request(f"{param}: json_schema_mode strict: the tool-call format cannot enforce '{top[0][1:]}' at {top[0]} "
                          "(parameters are written one by one); json_schema_mode relaxed serves it and validates the "
                          "arguments against the full schema", param, "invalid_constraint")
    return replace(s, relaxed=s.relaxed + tuple(top))


def _xml_call(i: int, name: str, schema: dict, open_: str, close: str) -> List[str]:
    """qwen3_coder: <function=NAME>, then each parameter as <parameter=ARG>, its value and
    </parameter> (in schema order; optional ones may be left out)."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    params, rules = [], []
    for j, (arg, sub) in enumerate(props.items()):
        sub = _inline_ref(sub, schema) if isinstance(sub, dict) else {}
        value, extra = _xml_value(f"v_{i}_{j}", sub, _definitions(schema))
        rules += [f"p_{i}_{j}: {json.dumps(f'<parameter={arg}>' + chr(10))} {value}"] + extra
        params.append(f"p_{i}_{j}" + ("" if arg in required else "?"))
    header = json.dumps(f"\n<function={name}>\n")
    return [f'call_{i}: {open_} {header} {" ".join(params)} "</function>\\n" {close}'] + rules


def _definitions(schema: dict) -> dict:
    """The parameters' `$defs` / `definitions`: an embedded schema (`%json`) is its own document,
    so local references resolve only when they travel with it."""
    return {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}


def _inline_ref(sub: dict, schema: dict) -> dict:
    """A parameter that is only a local reference (pydantic writes them): its target."""
    if isinstance(sub.get("$ref"), str) and not set(sub) - {"$ref", *ANNOTATIONS}:
        target = resolve_ref(sub, schema)
        return target if isinstance(target, dict) and target is not sub else sub
    return sub


def _xml_value(rule: str, sub: dict, defs: Optional[dict] = None):
    """A parameter's value and its closing tag: strings as raw text (the parser keeps them
    as written), enums and patterns of strings exactly, everything else as JSON (with the
    parameters' definitions when it refers to them)."""
    if sub.get("type") != "string":
        if defs and '"$ref"' in json.dumps(sub):
            sub = {**defs, **sub}
        return f"%json {json.dumps(sub)} {PARAM_END}", []
    options = sub.get("enum", [sub["const"]] if "const" in sub else None)
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        if len(options) > MANY_OPTIONS:  # one lexeme: as alternatives, 2,000 would pass llguidance's row limit
            return f"/{regex_to_lark(choice_regex(options))}/ {PARAM_END}", []
        return "(" + " | ".join(json.dumps(o) for o in options) + f") {PARAM_END}", []
    if "pattern" in sub:
        pattern = sub["pattern"].removeprefix("^").removesuffix("$")
        return f"/{regex_to_lark(pattern)}/ {PARAM_END}", []
    lo, hi = sub.get("minLength", 0), sub.get("maxLength")
    length = f"{{{lo},{hi}}}" if hi is not None else (f"{{{lo},}}" if lo else "*")
    return rule, [f'{rule}[suffix={PARAM_END}]: /(?s:.{length})/']

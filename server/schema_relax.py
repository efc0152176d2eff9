"""The JSON schemas people send, as schemas llguidance can enforce: exactly where an exact
form exists, relaxed (and the output validated afterwards) where it does not.

    served = serve_schema(schema, "relaxed", param="response_format")  # a 400 (APIError) when it cannot be served
    served.schema      # what the grammar enforces
    served.relaxed     # ("/properties/tags/uniqueItems", ...): keywords the grammar does not enforce
    served.ignored     # ("/properties/v/format", ...): unknown formats, annotations by JSON Schema's rules
    served.validate(instance)  # error messages against the full original schema (jsonschema)

Rules, in order:
- a schema llguidance compiles as it is is served as it is (the same grammar, the same masks);
- exact rewrites, in both modes: an unknown string `format` is dropped (JSON Schema makes
  formats annotations); `uniqueItems: false` (the default) and `uniqueItems` on arrays of at
  most one item are dropped; `dependentRequired` / array-valued `dependencies` on an object
  with at most `MAX_DEPENDENCIES` of them become `anyOf` branches (the key absent, or it and
  its dependents present); `if`/`then`/`else` testing one property against constants, on an
  object where that property takes finitely many values (an enum, a boolean), become one
  `anyOf` branch per value (and one for the property absent) holding the parts it selects;
  a `oneOf` llguidance cannot show disjoint but this module can (distinct types, distinct
  constants, or a required property whose values cannot overlap) becomes `anyOf`; when these
  branches do not compile, the keywords are relaxed instead;
- keywords the grammar cannot enforce (`uniqueItems`, `dependentSchemas`, `if`/`then`/`else`,
  `not`, `contains`, `propertyNames`, `unevaluated*`, other `dependencies`) are dropped and
  listed in `relaxed`;
- then llguidance compiles the result; what it still refuses is relaxed where its message says
  where (a `oneOf` it cannot prove disjoint becomes `anyOf`, `min/maxProperties` it cannot
  enforce, a `pattern` with look-arounds, the constraint siblings of a circular `$ref`); what is
  left falls back to its own `lenient` option, listed as relaxed too.
Under `strict` any relaxation is a 400 naming the keyword and its JSON path; a schema that cannot
be served at all is a 400 with llguidance's reason and the keyword and path where it fails.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import jsonschema

from mtp_serve.engine.grammar import GrammarBudget, json_schema_error
from mtp_serve.server.errors import bad_request
from mtp_serve.server.lanes import within

MODES = ("strict", "relaxed")
GRAMMAR_SECONDS = GrammarBudget().max_seconds  # serving one schema, as compiling one constraint
KNOWN_FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri", "unknown"}
UNENFORCEABLE = ("uniqueItems", "dependencies", "dependentRequired", "dependentSchemas", "if", "then", "else", "not",
                 "contains", "minContains", "maxContains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "readOnly", "writeOnly", "deprecated",
               "$id", "id", "$schema", "$anchor", "contentEncoding", "contentMediaType", "markdownDescription",
               "$defs", "definitions"}  # and definitions: not constraints on the value here
MAX_DEPENDENCIES = 3  # per object: 2^n grammar branches
MAX_SUBSCHEMAS = 10_000  # per schema, before any grammar work (the compile's cost grows with them)
MAX_PROPERTIES = 1_000  # per object: optional properties cost the grammar quadratically
MAX_ROUNDS = 8  # compile, relax what llguidance names, again
MAX_ERRORS = 5  # validation errors reported

SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SUBSCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                 "propertyNames", "unevaluatedItems", "unevaluatedProperties")


@dataclass
class ServedSchema:
    """A request's schema as served: what the grammar enforces and what it does not."""

    original: dict
    schema: dict  # what llguidance compiles
    relaxed: Tuple[str, ...] = ()  # JSON pointers of keywords the grammar does not enforce
    ignored: Tuple[str, ...] = ()  # JSON pointers of unknown formats (annotations)
    _validator: Any = field(default=None, repr=False)

    @property
    def exact(self) -> bool:
        return not self.relaxed

    def validate(self, instance: Any) -> List[str]:
        """Messages of the first errors of `instance` against the full original schema."""
        if self._validator is None:
            self._validator = validator_class(self.original)(self.original)
        errors = sorted(self._validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
        return [f"{pointer(list(e.absolute_path)) or '/'}: {e.message[:300]}" for e in errors[:MAX_ERRORS]]


def pointer(parts) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def validator_class(schema: dict):
    """The schema's own draft; without `$schema`, draft 7 when it uses draft-7-only keywords, else 2020-12."""
    if isinstance(schema, dict) and "$schema" in schema:
        return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    old = any("dependencies" in node or "additionalItems" in node or isinstance(node.get("items"), list)
              for node, _ in walk(schema))
    return jsonschema.Draft7Validator if old else jsonschema.Draft202012Validator


# ---------------------------------------------------------------- walking


def walk(node: Any, path: Tuple = ()) -> Iterator[Tuple[dict, Tuple]]:
    """Every subschema (dicts) with its path, parents first; the caller may edit a node's keys
    before its children are visited."""
    if not isinstance(node, dict):
        return
    yield node, path
    for key in SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in list(node[key].items()):
                yield from walk(sub, path + (key, name))
    for key in SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from walk(sub, path + (key, i))
    for key in SUBSCHEMA_ONE:
        sub = node.get(key)
        if isinstance(sub, list) and key == "items":  # draft 4-7 tuples
            for i, s in enumerate(sub):
                yield from walk(s, path + (key, i))
        elif isinstance(sub, dict):
            yield from walk(sub, path + (key,))
    if isinstance(node.get("dependencies"), dict):
        for name, sub in node["dependencies"].items():
            yield from walk(sub, path + ("dependencies", name))


# ---------------------------------------------------------------- disjointness (oneOf -> anyOf exactly)

TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")


def resolve_ref(node: Any, root: dict, depth: int = 0) -> Any:
    """The subschema a local `$ref` (`#/...`) points to, followed through chains; `node` itself
    when it is no reference or points nowhere."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") and depth < 16:
        target: Any = root
        for part in node["$ref"][1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        node, depth = target, depth + 1
    return node


def _types(node: dict) -> Optional[set]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return set(t)
    values = _values(node)
    if values is not None:
        return {_type_of(v) for v in values}
    return None


def _type_of(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "object")


def _values(node: dict) -> Optional[List[str]]:
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return node["enum"]
    return None


def _overlap_types(a: set, b: set) -> bool:
    widen = lambda s: s | ({"number"} if "integer" in s else set()) | ({"integer"} if "number" in s else set())  # noqa: E731
    return bool(widen(a) & b) or bool(a & widen(b))


def disjoint(a: Any, b: Any, root: dict, depth: int = 0) -> bool:
    """True when no JSON value can match both schemas (a sound check: False when unsure)."""
    a, b = resolve_ref(a, root), resolve_ref(b, root)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > 4:
        return False
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not _overlap_types(ta, tb):
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None:
        key = lambda v: json.dumps(v, sort_keys=True) + _type_of(v)  # noqa: E731  (1 and True differ)
        return not ({key(v) for v in va} & {key(v) for v in vb})
    if ta == {"object"} and tb == {"object"}:
        shared = set(a.get("required") or ()) & set(b.get("required") or ())
        pa, pb = a.get("properties") or {}, b.get("properties") or {}
        return any(p in pa and p in pb and disjoint(pa[p], pb[p], root, depth + 1) for p in shared)
    return False


MAX_VALUES = 32  # values of a discriminator turned into branches
_ABSENT = object()


def _discriminator(cond: dict) -> Optional[str]:
    """K when `cond["if"]` tests one property against constants: {"properties": {K: {"const"/"enum"}}},
    optionally with "required": [K]."""
    test = cond["if"]
    if not isinstance(test, dict) or set(test) - {"properties", "required", *ANNOTATIONS}:
        return None
    props = test.get("properties")
    if not isinstance(props, dict) or len(props) != 1:
        return None
    (key, sub), = props.items()
    if not isinstance(sub, dict) or _values(sub) is None or set(sub) - {"const", "enum", *ANNOTATIONS}:
        return None
    return key if test.get("required", [key]) == [key] else None


def _domain(sub: Any) -> Optional[list]:
    """The finitely many values a property's schema allows, or None."""
    if not isinstance(sub, dict):
        return None
    if _values(sub) is not None:
        return list(_values(sub))
    return [True, False] if sub.get("type") == "boolean" else None


def _branch(cond: dict, key: str, value: Any) -> str:
    """Which part of a conditional applies when the discriminator has `value` (_ABSENT: missing)."""
    if value is _ABSENT:
        return "else" if key in (cond["if"].get("required") or ()) else "then"
    matches = any(json.dumps(value, sort_keys=True) == json.dumps(x, sort_keys=True) and _type_of(value) == _type_of(x)
                  for x in _values(cond["if"]["properties"][key]))
    return "then" if matches else "else"


def _pairwise_disjoint(branches: list, root: dict) -> bool:
    return all(disjoint(x, y, root) for i, x in enumerate(branches) for y in branches[i + 1:])


# ---------------------------------------------------------------- the rewrites


class _Rewrite:
    """One schema's rewriting: the working copy and what was relaxed or ignored."""

    def __init__(self, schema: dict, enforce: bool = True):
        self.root = copy.deepcopy(schema)
        self.relaxed: List[str] = []
        self.ignored: List[str] = []
        self.enforce = enforce
        self.branch_rewrites = 0  # dependencies and conditionals rewritten as grammar branches

    def relax(self, node: dict, path: Tuple, key: str) -> None:
        node.pop(key, None)
        self.relaxed.append(pointer(path + (key,)))

    def exact_pass(self) -> None:
        for node, path in walk(self.root):
            fmt, kind = node.get("format"), node.get("type", "string")
            if "format" in node and fmt not in KNOWN_FORMATS and "string" in (kind if isinstance(kind, list) else [kind]):
                node.pop("format")
                self.ignored.append(pointer(path + ("format",)))
            if "uniqueItems" in node and (node["uniqueItems"] is not True or node.get("maxItems", 2) <= 1):
                node.pop("uniqueItems")
            if self.enforce:
                self._dependencies_as_branches(node)
                self._conditionals_as_branches(node)

    def _dependencies_as_branches(self, node: dict) -> None:
        """`{"a": ["b"]}`: a absent, or a and b present; exact as grammar branches."""
        deps = {}
        for key in ("dependentRequired", "dependencies"):
            d = node.get(key)
            if isinstance(d, dict) and d and all(isinstance(v, list) for v in d.values()):
                deps[key] = d
        if not deps or sum(len(d) for d in deps.values()) > MAX_DEPENDENCIES:
            return
        branches = [{"anyOf": [{"properties": {k: False}}, {"required": [k, *v]}]} for d in deps.values() for k, v in d.items()]
        for key in deps:
            node.pop(key)
        self.branch_rewrites += len(branches)
        node["allOf"] = list(node.get("allOf") or []) + branches

    def _conditionals_as_branches(self, node: dict) -> None:
        """`if: {properties: {K: {const: V}}}, then: T, else: E` (the node's own, and those in its
        allOf) on an object whose K takes finitely many values: one branch per value of K, with
        the thens and elses that value selects, and one for K absent; exact as grammar branches."""
        conds = [c for c in [node] + list(node.get("allOf") or []) if isinstance(c, dict) and "if" in c]
        keys = {_discriminator(c) for c in conds}
        key = keys.pop() if len(keys) == 1 else None
        domain = _domain(resolve_ref((node.get("properties") or {}).get(key, {}), self.root)) if key else None
        if not conds or key is None or not domain or len(domain) > MAX_VALUES or any(
                set(c) - {"if", "then", "else", *ANNOTATIONS} for c in conds if c is not node):
            return
        required = key in (node.get("required") or ())
        branches = []
        for v in domain + ([] if required else [_ABSENT]):
            picked = [c[part] for c in conds for part in [_branch(c, key, v)] if part in c]
            branch: dict = {"properties": {key: {"const": v} if v is not _ABSENT else False}}
            if picked:
                branch["allOf"] = picked
            branches.append(branch)
        node["allOf"] = [c for c in node.get("allOf") or [] if c not in conds]
        if not node["allOf"]:
            node.pop("allOf")
        for part in ("if", "then", "else"):
            node.pop(part, None)
        if "anyOf" in node:
            node.setdefault("allOf", []).append({"anyOf": branches})
        else:
            node["anyOf"] = branches
        self.branch_rewrites += len(conds)

    @staticmethod
    def _one_of_as_any_of(node: dict) -> None:
        branches = node.pop("oneOf")
        if "anyOf" in node:  # both: the intersection
            node["allOf"] = list(node.get("allOf") or []) + [{"anyOf": branches}]
        else:
            node["anyOf"] = branches

    def relax_pass(self) -> None:
        for node, path in walk(self.root):
            for key in UNENFORCEABLE:
                if key in node:
                    self.relax(node, path, key)

    # -- what llguidance still refuses, by its message

    def fix(self, error: str) -> bool:
        """Relax what `error` names; False when nothing could be."""
        if "oneOf" in error:
            return self._each(lambda n: isinstance(n.get("oneOf"), list), "oneOf", self._one_of_relaxed)
        if "min/maxProperties" in error:
            return self._each(lambda n: ("minProperties" in n or "maxProperties" in n)
                              and not set(n.get("properties") or ()) <= set(n.get("required") or ()),
                              "minProperties", self._drop_counts)
        if "Unknown format" in error:
            name = error.split("Unknown format:", 1)[1].split(";")[0].strip()
            return self._each(lambda n: n.get("format") == name, "format", lambda n, p: self.relax(n, p, "format"))
        if "regex" in error or "look-around" in error:
            return self._bad_patterns()
        if "circular reference" in error:
            target = error.rsplit("#", 1)[-1].split()[0].rstrip(".;'\"") if "#" in error else None
            return self._each(lambda n: isinstance(n.get("$ref"), str) and (target is None or n["$ref"].endswith("#" + target))
                              and any(k not in ANNOTATIONS for k in n if k != "$ref"), "$ref", self._ref_siblings)
        if "does not exist" in error or "external" in error.lower() or "Retriev" in error:
            return self._each(lambda n: isinstance(n.get("$ref"), str) and not n["$ref"].startswith("#"), "$ref",
                              lambda n, p: self.relax(n, p, "$ref"))  # outside the document: not fetched
        m = re.search(r"Unimplemented keys: \[(.*?)\]", error)
        if m:
            keys = [k.strip().strip('"') for k in m.group(1).split(",")]
            return self._each(lambda n: any(k in n for k in keys), keys[0],
                              lambda n, p: [self.relax(n, p, k) for k in keys if k in n])
        return False

    def _each(self, match: Callable[[dict], bool], _key: str, change: Callable[[dict, Tuple], Any]) -> bool:
        hits = [(n, p) for n, p in walk(self.root) if match(n)]
        for n, p in hits:
            change(n, p)
        return bool(hits)

    def _one_of_relaxed(self, node: dict, path: Tuple) -> None:
        """llguidance could not show the branches disjoint: anyOf, exact when this module can."""
        if not _pairwise_disjoint(node["oneOf"], self.root):
            self.relaxed.append(pointer(path + ("oneOf",)))
        self._one_of_as_any_of(node)

    def _drop_counts(self, node: dict, path: Tuple) -> None:
        for key in ("minProperties", "maxProperties"):
            if key in node:
                self.relax(node, path, key)

    def _ref_siblings(self, node: dict, path: Tuple) -> None:
        for key in [k for k in node if k != "$ref" and k not in ANNOTATIONS]:
            self.relax(node, path, key)

    def _bad_patterns(self) -> bool:
        changed = False
        for node, path in walk(self.root):
            if isinstance(node.get("pattern"), str) and json_schema_error(json.dumps({"type": "string", "pattern": node["pattern"]})):
                self.relax(node, path, "pattern")
                changed = True
            pp = node.get("patternProperties")
            if isinstance(pp, dict):
                for key in [k for k in pp if json_schema_error(json.dumps({"type": "string", "pattern": k}))]:
                    pp.pop(key)
                    self.relaxed.append(pointer(path + ("patternProperties", key)))
                    changed = True
        return changed


# ---------------------------------------------------------------- serving


def _lenient(schema: dict) -> Optional[Tuple[dict, List[str]]]:
    """llguidance's own `lenient` option (unsupported keywords and formats ignored): the
    schema with it, and what it warned it ignored; None when even that does not compile."""
    import llguidance  # the engine's grammar library; only this last resort needs it here

    served = {**schema, "x-guidance": {**(schema.get("x-guidance") or {}), "lenient": True}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(served), defaults={"whitespace_flexible": False})
    is_error, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return None if is_error else (served, [f"(llguidance lenient) {w}" for w in warnings] or ["(llguidance lenient)"])


def _rewrite(schema: dict, enforce: bool) -> Tuple[_Rewrite, Optional[str]]:
    rw = _Rewrite(schema, enforce)
    if json_schema_error(json.dumps(schema)) is None:
        return rw, None
    rw.exact_pass()
    error = json_schema_error(json.dumps(rw.root))
    if error is None:
        return rw, None
    rw.relax_pass()
    for _ in range(MAX_ROUNDS):
        error = json_schema_error(json.dumps(rw.root))
        if error is None or not rw.fix(error):
            break
    return rw, error


@lru_cache(maxsize=512)
def _serve(text: str) -> Tuple[ServedSchema, Optional[str]]:
    """(the schema served in relaxed mode, llguidance's reason when even that fails); cached:
    agents send the same tool schemas with every request."""
    schema = json.loads(text)
    rw, error = _rewrite(schema, enforce=True)
    if error is not None and rw.branch_rewrites:
        rw, error = _rewrite(schema, enforce=False)  # the dependency branches did not compile
    if error is not None:
        lenient = _lenient(rw.root) if isinstance(rw.root, dict) else None
        if lenient is None:
            return ServedSchema(schema, rw.root, tuple(rw.relaxed), tuple(rw.ignored)), error
        rw.root, rw.relaxed = lenient[0], rw.relaxed + lenient[1]
    return ServedSchema(schema, rw.root, tuple(rw.relaxed), tuple(rw.ignored)), None


MAX_PROBES = 200  # subschemas compiled alone to find where a refused schema fails


def locate(schema: dict) -> Optional[Tuple[str, str]]:
    """(keyword, JSON path) of the deepest subschema llguidance refuses on its own (with the
    document's definitions beside it, so references resolve); None when none is found."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    nodes = list(walk(schema))[:MAX_PROBES]
    for node, path in reversed(nodes):  # children come after their parents
        probe = {**defs, **{k: v for k, v in node.items() if k not in defs}}
        if json_schema_error(json.dumps(probe)) is None:
            continue
        for key in sorted((k for k in node if k not in defs), key=lambda k: k == "type"):  # type last: it scopes the rest
            if json_schema_error(json.dumps({k: v for k, v in probe.items() if k != key})) is None:
                return key, pointer(path + (key,))
        return "", pointer(path) or "/"
    return None


def check_size(schema: dict, where: str, param: Optional[str]) -> None:
    """A 400 for a schema past MAX_SUBSCHEMAS or MAX_PROPERTIES, before any grammar work."""
    for n, (node, path) in enumerate(walk(schema), 1):
        if n > MAX_SUBSCHEMAS:
            raise bad_request(f"{where}invalid json schema: more than {MAX_SUBSCHEMAS:,} subschemas", param,
                              "invalid_constraint")
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
            raise bad_request(f"{where}invalid json schema: {len(props):,} properties in one object at "
                              f"{pointer(path) or '/'}; at most {MAX_PROPERTIES:,}", param, "invalid_constraint")


def serve_schema(schema: Any, mode: str = "relaxed", param: Optional[str] = None) -> ServedSchema:
    """The schema as served in `mode`; a 400 (APIError, in the API's shape) when it cannot be."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise bad_request(f"{param or 'schema'}: a JSON schema must be an object", param, "invalid_constraint")
    try:
        text = json.dumps(schema, sort_keys=False)
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param or 'schema'}: not a JSON schema: {e}", param, "invalid_constraint") from e
    where = f"{param}: " if param else ""
    check_size(schema, where, param)
    try:
        served, error = within(GRAMMAR_SECONDS, _serve, text)
    except TimeoutError:
        raise bad_request(f"{where}invalid json schema: serving it took longer than {GRAMMAR_SECONDS:g}s (simplify it: "
                          "fewer properties or alternatives)", param, "invalid_constraint") from None
    if error is not None:
        found = locate(served.schema)
        at = "" if found is None else (f" ('{found[0]}' at {found[1]})" if found[0] else f" (at {found[1]})")
        named = f" (relaxed where it could: {', '.join(served.relaxed)})" if served.relaxed else ""
        raise bad_request(f"{where}invalid json schema: this JSON schema cannot be served: {error}{at}{named}", param,
                          "invalid_constraint")
    if mode == "strict" and served.relaxed:
        first, more = served.relaxed[0], len(served.relaxed) - 1
        keyword = first.rsplit("/", 1)[-1]
        raise bad_request(f"{where}json_schema_mode strict: the grammar cannot enforce '{keyword}' at {first or '/'}"
                          + (f" (and {more} more: {', '.join(served.relaxed[1:4])}{'...' if more > 3 else ''})" if more else "")
                          + "; json_schema_mode relaxed serves it and validates the output against the full schema",
                          param, "invalid_constraint")
    return served


def check_mode(mode: Optional[str], default: str) -> str:
    if mode is None:
        return default
    if mode not in MODES:
        raise bad_request(f"json_schema_mode must be one of {', '.join(MODES)}", "json_schema_mode")
    return mode


def relaxed_schemas(served: Dict[str, ServedSchema]) -> List[str]:
    """Every relaxed keyword, prefixed with its tool's name when there are several schemas."""
    if list(served) == [""]:
        return list(served[""].relaxed)
    return [f"{name}:{p}" for name, s in served.items() for p in s.relaxed]

"""The "qwen3_coder" tool-call format (Qwen3.5/3.6, XML)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    value (may span lines)
    </parameter>
    </function>
    </tool_call>

Values are raw text (one leading and one trailing newline stripped), converted
by the parameter's JSON-schema type from the request's `tools`.

A `<function=NAME>...</function>` whose `<tool_call>` wrapper the model left
out (Qwen3-Coder models do write it; vLLM accepts it) is a call too when NAME
is a declared tool; otherwise it is content.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from .events import ToolCallArgsDelta, ToolCallStart, find_first, partial_suffix_len
from .tools_base import TOOL_CALL_END, TOOL_CALL_START, ToolCallParser, dumps, new_call_id, reject_constant

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"

_MAX_NAME = 256  # longest function / parameter name accepted in a tag
_NAME_CHARS = re.compile(r"[^>\n<]*")
_FUNCTION_HEADER = re.compile(r"\s*<function=([^>\n<]{0,%d})>" % _MAX_NAME)


# ---------------------------------------------------------------- value types


def _normalize_type(t: str) -> str:
    t = t.strip().lower()
    if t in ("null", "none"):
        return "null"
    if t.startswith(("int", "uint", "long", "short", "unsigned")):
        return "integer"
    if t.startswith(("num", "float", "double", "decimal")):
        return "number"
    if t.startswith("bool"):
        return "boolean"
    if t in ("object", "dict", "map"):
        return "object"
    if t in ("array", "list", "arr", "tuple"):
        return "array"
    return "string"


def schema_types(schema: Any) -> list[str]:
    """Normalized JSON types a (property) schema allows; [] when unknown."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    raw = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    types = [_normalize_type(x) for x in raw]
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        if isinstance(subs, list):
            for sub in subs:
                types += schema_types(sub)
    if not types:
        if "properties" in schema:
            types = ["object"]
        elif "items" in schema:
            types = ["array"]
    return list(dict.fromkeys(types))


def _local_ref(schema: Any, root: dict) -> Any:
    """The target of a local `$ref` (`#/$defs/Model`, as pydantic writes nested models); else `schema`."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    target: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return schema
        target = target[part]
    return target


def param_types(schemas: dict[str, dict] | None, function: str, param: str) -> list[str]:
    if not schemas:
        return []
    root = schemas.get(function) or {}
    props = root.get("properties")
    if not isinstance(props, dict):
        return []
    return schema_types(_local_ref(props.get(param), root))


_FAIL = object()


def _convert_number(s: str, integer: bool) -> Any:
    if re.fullmatch(r"[-+]?\d+", s):
        return int(s)
    try:
        f = float(s)
    except ValueError:
        return _FAIL
    if not math.isfinite(f):
        return _FAIL
    if integer:
        return int(f) if f.is_integer() else _FAIL
    return f


def _convert_one(t: str, s: str) -> Any:
    if t == "null":
        return None if s in ("null", "None") else _FAIL
    if t == "boolean":
        low = s.lower()
        return True if low == "true" else False if low == "false" else _FAIL
    if t in ("integer", "number"):
        return _convert_number(s, t == "integer")
    if t in ("object", "array"):
        want = dict if t == "object" else list
        try:
            v = json.loads(s, parse_constant=reject_constant)
        except (ValueError, RecursionError):
            try:
                v = ast.literal_eval(s)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return _FAIL
            if isinstance(v, tuple) and want is list:
                v = list(v)
        return v if isinstance(v, want) else _FAIL
    return _FAIL


def convert_param_value(raw: str, types: list[str]) -> Any:
    """Convert a raw XML parameter value by its schema types.

    No schema, or a string type: the text unchanged. Otherwise `null`/`None`
    gives None, then each non-string type is tried in order; when none fits
    the text is kept as a string.
    """
    others = [t for t in types if t != "string"]
    if not others:
        return raw
    s = raw.strip()
    if s in ("null", "None"):
        return None
    for t in others:
        v = _convert_one(t, s)
        if v is not _FAIL:
            return v
    return raw


# ---------------------------------------------------------------- parser

_HEADER, _BETWEEN, _PARAM_HEADER, _VALUE, _AFTER_FUNCTION, _BARE_END = range(6)
_BETWEEN_TAGS = (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
_VALUE_TAGS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
_AFTER_TAGS = (TOOL_CALL_END, FUNCTION_START)


class Qwen3CoderToolParser(ToolCallParser):
    """`<tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>`.

    Lenient inside a call, like vLLM: a missing `</parameter>` ends at the next
    `<parameter=` / `</function>` / `</tool_call>`, a missing `</function>` at
    `</tool_call>`; stray text between parameters is ignored; several functions
    in one block become several calls.
    """

    name = "qwen3_coder"

    def _block_starts(self) -> tuple[str, ...]:
        # A bare <function= opens a block only when tools are declared.
        return (TOOL_CALL_START, FUNCTION_START) if self._schemas else (TOOL_CALL_START,)

    def _tag_length(self, tag: str) -> int:
        return 0 if tag == FUNCTION_START else len(tag)  # the header step reads <function=NAME>

    def _begin_block(self, tag: str) -> None:
        self._state = _HEADER
        self._first_in_block = True
        self._call_open = False
        self._bare = tag == FUNCTION_START

    def _step_block(self, final: bool) -> bool:
        return (
            self._step_header,
            self._step_between,
            self._step_param_header,
            self._step_value,
            self._step_after_function,
            self._step_bare_end,
        )[self._state](final)

    def _unclosed(self) -> bool:
        """End of output inside a block (cut off): an open call closes with its arguments so far."""
        self._consume(len(self._buf))
        if self._call_open:
            self._close_call()
        self._close_block()
        return True

    def _step_header(self, final: bool) -> bool:
        buf = self._buf
        m = _FUNCTION_HEADER.match(buf)
        if m and self._valid_name(m.group(1).strip()) and (not self._bare or self._schemas):
            self._consume(m.end())
            self._open_call(m.group(1).strip())
            self._state = _BETWEEN
            return True
        if not m:
            s = buf.lstrip()
            rest = s[len(FUNCTION_START):]
            partial = FUNCTION_START.startswith(s) or (
                s.startswith(FUNCTION_START) and len(rest) <= _MAX_NAME and bool(_NAME_CHARS.fullmatch(rest)))
            if partial and not final:
                return False
            if partial and self._first_in_block and not self._bare:
                self._drop()  # cut off before the function name: no call, and no markup as content
                return True
        # Not a call header.
        if self._bare:
            # Not a declared tool: the tag is text; scanning goes on after it.
            self._consume(min(len(buf), len(FUNCTION_START)))
            self._fallback()
        elif self._first_in_block:
            # The <tool_call> is plain text; what follows is scanned again as content.
            self._fallback()
        else:
            # A bad extra function in a block: skip its tag, ignore text until </tool_call>.
            ws = len(buf) - len(buf.lstrip())
            self._consume(min(len(buf), ws + len(FUNCTION_START)))
            self._state = _AFTER_FUNCTION
        return True

    def _open_call(self, name: str) -> None:
        self._first_in_block = False
        self._function = name
        self._index = self._new_index()
        self._nparams = 0
        self._call_open = True
        self._out(ToolCallStart(self._index, new_call_id(), name))

    def _close_call(self) -> None:
        self._call_open = False
        self._out(ToolCallArgsDelta(self._index, "}" if self._nparams else "{}"))

    def _args(self, text: str) -> None:
        if text:
            self._out(ToolCallArgsDelta(self._index, text))

    def _step_between(self, final: bool) -> bool:
        buf = self._buf
        i, tag = find_first(buf, _BETWEEN_TAGS)
        if i < 0:
            if final:
                return self._unclosed()
            self._consume(len(buf) - partial_suffix_len(buf, _BETWEEN_TAGS))
            return False
        self._consume(i + len(tag))
        if tag == PARAMETER_START:
            self._state = _PARAM_HEADER
        elif tag == FUNCTION_END:
            self._close_call()
            self._state = _BARE_END if self._bare else _AFTER_FUNCTION
        else:
            self._close_call()
            self._close_block()
        return True

    def _step_param_header(self, final: bool) -> bool:
        buf = self._buf
        j = buf.find(">")
        head = buf if j < 0 else buf[:j]
        if len(head) > _MAX_NAME or not _NAME_CHARS.fullmatch(head) or (j < 0 and final):
            self._state = _BETWEEN  # not a parameter tag: ignore it
            return True
        if j < 0:
            return False
        self._consume(j + 1)
        name = head.strip()
        self._ptypes = param_types(self._schemas, self._function, name)
        self._pstream = not any(t != "string" for t in self._ptypes)
        self._pvalue: list[str] = []
        self._plead = True  # one leading newline still to strip
        self._args(("{" if self._nparams == 0 else ", ") + dumps(name) + ": " + ('"' if self._pstream else ""))
        self._nparams += 1
        self._state = _VALUE
        return True

    def _value_text(self, text: str) -> None:
        if not text:
            return
        if self._pstream:
            self._args(dumps(text)[1:-1])  # JSON string escaping is per character
        else:
            self._pvalue.append(text)

    def _end_value(self) -> None:
        if self._pstream:
            self._args('"')
            return
        raw = "".join(self._pvalue)
        try:
            out = dumps(convert_param_value(raw, self._ptypes))
        except (TypeError, ValueError, RecursionError):
            out = dumps(raw)
        self._args(out)

    def _step_value(self, final: bool) -> bool:
        if self._plead and self._buf:
            if self._buf[0] == "\n":
                self._consume(1)
            self._plead = False
        buf = self._buf
        if not buf and not final:
            return False
        i, tag = find_first(buf, _VALUE_TAGS)
        if i >= 0 or final:
            end = i if i >= 0 else len(buf)
            text = self._consume(end)
            self._value_text(text[:-1] if text.endswith("\n") else text)
            self._end_value()
            if tag == PARAMETER_END:
                self._consume(len(tag))
            self._state = _BETWEEN  # other end tags are handled there
            return True
        # Hold back a possible partial end tag and one newline before it.
        keep = len(buf) - partial_suffix_len(buf, _VALUE_TAGS)
        if keep and buf[keep - 1] == "\n":
            keep -= 1
        self._value_text(self._consume(keep))
        return False

    def _step_after_function(self, final: bool) -> bool:
        buf = self._buf
        i, tag = find_first(buf, _AFTER_TAGS)
        if i < 0:
            if final:
                return self._unclosed()
            self._consume(len(buf) - partial_suffix_len(buf, _AFTER_TAGS))
            return False
        self._consume(i)
        if tag == TOOL_CALL_END:
            self._consume(len(tag))
            self._close_block()
        else:
            self._state = _HEADER
        return True

    def _step_bare_end(self, final: bool) -> bool:
        """After a bare call's `</function>`: a stray `</tool_call>` belongs to it."""
        s = self._buf.lstrip()
        if s.startswith(TOOL_CALL_END):
            self._consume(len(self._buf) - len(s) + len(TOOL_CALL_END))
        elif TOOL_CALL_END.startswith(s) and not final:
            return False
        self._close_block()
        return True

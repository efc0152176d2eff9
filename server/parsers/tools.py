"""Streaming tool-call parsers.

Formats:
- "qwen3_coder" (Qwen3.5/3.6, XML)::

      <tool_call>
      <function=NAME>
      <parameter=ARG>
      value (may span lines)
      </parameter>
      </function>
      </tool_call>

  Values are raw text (one leading and one trailing newline stripped),
  converted by the parameter's JSON-schema type from the request's `tools`.
- "hermes" (Qwen3-Next): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- "none": every character is content.

Common interface: `feed(delta) -> list[Event]`, `finish() -> list[Event]`,
`has_tool_calls`, `tool_calls`, `parse_all(text)`. Events are ContentDelta,
ToolCallStart and ToolCallArgsDelta (see events.py).

Content rules: whitespace just before a tool call, between calls and after
the last call is dropped. Text that is not a well-formed tool call (unclosed
block at the end, bad JSON, a function not in `tools`, no `<function=`) comes
back as content, verbatim.

Streaming of qwen3_coder arguments: with `incremental=True` (the default) a
call is committed, and its ToolCallStart sent, as soon as `<function=NAME>`
names a known tool; its arguments then stream per parameter, string values
as they arrive. A committed call cut off by the end of output is closed with
the arguments parsed so far (the server reports finish_reason "length" then).
With `incremental=False` nothing of a block is sent before `</tool_call>`, so
an unclosed block becomes content; `parse_all` always works this way.
Hermes calls are always sent whole when `</tool_call>` arrives.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from typing import Any

from .events import (
    ContentDelta,
    Event,
    ToolCallArgsDelta,
    ToolCallStart,
    find_first,
    merge_events,
    partial_suffix_len,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"

_MAX_NAME = 256  # longest function / parameter name accepted in a tag
_NAME_CHARS = re.compile(r"[^>\n<]*")
_FUNCTION_HEADER = re.compile(r"\s*<function=([^>\n<]{0,%d})>" % _MAX_NAME)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---------------------------------------------------------------- schemas


def tool_schemas(tools: Any) -> dict[str, dict] | None:
    """{function name: parameters JSON schema} from an OpenAI `tools` list.

    None when no tools are given: then any function name is accepted.
    """
    if not tools:
        return None
    out: dict[str, dict] = {}
    for tool in tools:
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


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


def param_types(schemas: dict[str, dict] | None, function: str, param: str) -> list[str]:
    if not schemas:
        return []
    props = (schemas.get(function) or {}).get("properties")
    if not isinstance(props, dict):
        return []
    return schema_types(props.get(param))


_FAIL = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN / Infinity are not valid JSON output


def _convert_one(t: str, s: str) -> Any:
    if t == "null":
        return None if s in ("null", "None") else _FAIL
    if t == "boolean":
        low = s.lower()
        return True if low == "true" else False if low == "false" else _FAIL
    if t == "integer":
        if re.fullmatch(r"[-+]?\d+", s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            return _FAIL
        return int(f) if math.isfinite(f) and f.is_integer() else _FAIL
    if t == "number":
        if re.fullmatch(r"[-+]?\d+", s):
            return int(s)
        try:
            f = float(s)
        except ValueError:
            return _FAIL
        return f if math.isfinite(f) else _FAIL
    if t in ("object", "array"):
        want = dict if t == "object" else list
        try:
            v = json.loads(s, parse_constant=_reject_constant)
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


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


# ---------------------------------------------------------------- base parser


class ToolCallParser:
    """Base class: content scanning, block bookkeeping, event output.

    Subclasses implement `_begin_block()` and `_step_block(final) -> bool`
    (True when the step made progress and the loop should run again).
    """

    name = "base"

    def __init__(self, tools: Any = None, *, incremental: bool = True):
        self.tools = tools
        self.incremental = incremental
        self._schemas = tool_schemas(tools)
        self._buf = ""
        self._events: list[Event] = []
        self._pending: list[Event] = []  # events of the open block (incremental=False)
        self._in_block = False
        self._raw: list[str] = []  # the open block as written, for the content fallback
        self._skip_ws = False  # drop whitespace that follows a tool call
        self._next_index = 0
        self._calls: dict[int, list] = {}  # index -> [id, name, [argument parts]]

    # -- public

    @property
    def has_tool_calls(self) -> bool:
        """True once any valid tool call has been emitted (finish_reason "tool_calls")."""
        return bool(self._calls)

    @property
    def tool_calls(self) -> list[dict]:
        """Calls emitted so far, OpenAI format (arguments as a JSON string)."""
        return [
            {"id": c[0], "type": "function", "function": {"name": c[1], "arguments": "".join(c[2])}}
            for _, c in sorted(self._calls.items())
        ]

    def feed(self, text: str) -> list[Event]:
        if text:
            self._buf += text
            self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """End of output: flush held-back text, settle an unclosed block."""
        self._run(final=True)
        return self._take()

    def parse_all(self, text: str) -> tuple[str, list[dict]]:
        """Non-streaming: (content, tool calls). Unclosed blocks become content."""
        p = type(self)(self.tools, incremental=False)
        events = p.feed(text) + p.finish()
        return "".join(e.text for e in events if isinstance(e, ContentDelta)), p.tool_calls

    # -- machinery

    def _take(self) -> list[Event]:
        events, self._events = merge_events(self._events), []
        return events

    def _emit(self, ev: Event) -> None:
        if isinstance(ev, ToolCallStart):
            self._calls[ev.index] = [ev.id, ev.name, []]
        elif isinstance(ev, ToolCallArgsDelta):
            self._calls[ev.index][2].append(ev.text)
        elif not ev.text:
            return
        self._events.append(ev)

    def _out(self, ev: Event) -> None:
        """A tool-call event of the open block: sent now, or at `</tool_call>`."""
        if self.incremental:
            self._emit(ev)
        else:
            self._pending.append(ev)

    def _valid_name(self, name: str) -> bool:
        return bool(name) and (self._schemas is None or name in self._schemas)

    def _new_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1

    def _consume(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        self._raw.append(text)
        return text

    def _run(self, final: bool) -> None:
        while self._step_block(final) if self._in_block else self._step_content(final):
            pass

    def _step_content(self, final: bool) -> bool:
        buf = self._buf
        if self._skip_ws:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
            self._skip_ws = False
        i = buf.find(TOOL_CALL_START)
        if i >= 0:
            before = buf[:i]
            text = before.rstrip()
            self._emit(ContentDelta(text))
            self._buf = buf[i + len(TOOL_CALL_START):]
            self._in_block = True
            self._raw = [before[len(text):], TOOL_CALL_START]
            self._begin_block()
            return True
        if final:
            self._emit(ContentDelta(buf.rstrip() if self._calls else buf))
            self._buf = ""
            return False
        # Hold back a possible partial <tool_call> and the whitespace before it.
        keep = len(buf) - partial_suffix_len(buf, (TOOL_CALL_START,))
        keep = len(buf[:keep].rstrip())
        self._emit(ContentDelta(buf[:keep]))
        self._buf = buf[keep:]
        return False

    def _close_block(self) -> None:
        """`</tool_call>` seen (or an incremental block cut off): release its calls."""
        for ev in self._pending:
            self._emit(ev)
        self._pending = []
        self._in_block = False
        self._raw = []
        self._skip_ws = True

    def _fallback(self) -> None:
        """The open block is not a valid tool call: what was consumed of it is content."""
        self._pending = []
        self._in_block = False
        self._emit(ContentDelta("".join(self._raw)))
        self._raw = []

    def _begin_block(self) -> None:
        raise NotImplementedError

    def _step_block(self, final: bool) -> bool:
        raise NotImplementedError


class NoToolParser(ToolCallParser):
    """Passes all text through as content."""

    name = "none"

    def feed(self, text: str) -> list[Event]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []

    def parse_all(self, text: str) -> tuple[str, list[dict]]:
        return text, []


# ---------------------------------------------------------------- qwen3_coder (XML)

_HEADER, _BETWEEN, _PARAM_HEADER, _VALUE, _AFTER_FUNCTION = range(5)
_BETWEEN_TAGS = (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
_VALUE_TAGS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
_AFTER_TAGS = (TOOL_CALL_END, FUNCTION_START)


class Qwen3CoderToolParser(ToolCallParser):
    """`<tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>`.

    Lenient inside a committed call, like vLLM: a missing `</parameter>` ends at
    the next `<parameter=` / `</function>` / `</tool_call>`, a missing
    `</function>` at `</tool_call>`; stray text between parameters is ignored;
    several functions in one block become several calls.
    """

    name = "qwen3_coder"

    def _begin_block(self) -> None:
        self._state = _HEADER
        self._first_in_block = True
        self._call_open = False

    def _step_block(self, final: bool) -> bool:
        return (
            self._step_header,
            self._step_between,
            self._step_param_header,
            self._step_value,
            self._step_after_function,
        )[self._state](final)

    def _unclosed(self) -> bool:
        """End of output inside a committed block."""
        self._consume(len(self._buf))
        if self.incremental:
            if self._call_open:
                self._close_call()
            self._close_block()
        else:
            self._fallback()
        return True

    def _step_header(self, final: bool) -> bool:
        buf = self._buf
        m = _FUNCTION_HEADER.match(buf)
        if m and self._valid_name(m.group(1).strip()):
            self._consume(m.end())
            self._open_call(m.group(1).strip())
            self._state = _BETWEEN
            return True
        if not m and not final:
            s = buf.lstrip()
            if FUNCTION_START.startswith(s):
                return False
            rest = s[len(FUNCTION_START):]
            if s.startswith(FUNCTION_START) and len(rest) <= _MAX_NAME and _NAME_CHARS.fullmatch(rest):
                return False
        # Not a call header.
        if self._first_in_block:
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
        self._call_open = True
        self._function = name
        self._index = self._new_index()
        self._nparams = 0
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
            self._state = _AFTER_FUNCTION
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
        self._args(
            ("{" if self._nparams == 0 else ", ")
            + _dumps(name)
            + ": "
            + ('"' if self._pstream else "")
        )
        self._nparams += 1
        self._state = _VALUE
        return True

    def _value_text(self, text: str) -> None:
        if not text:
            return
        if self._pstream:
            self._args(_dumps(text)[1:-1])  # JSON string escaping is per character
        else:
            self._pvalue.append(text)

    def _end_value(self) -> None:
        if self._pstream:
            self._args('"')
            return
        raw = "".join(self._pvalue)
        try:
            out = _dumps(convert_param_value(raw, self._ptypes))
        except (TypeError, ValueError, RecursionError):
            out = _dumps(raw)
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


# ---------------------------------------------------------------- hermes (JSON)


class HermesToolParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, sent whole at `</tool_call>`."""

    name = "hermes"

    def _begin_block(self) -> None:
        self._search_from = 0

    def _step_block(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(TOOL_CALL_END, self._search_from)
        if i < 0:
            if final:
                self._consume(len(buf))
                self._fallback()
                return True
            self._search_from = max(0, len(buf) - len(TOOL_CALL_END) + 1)
            return False
        body = self._consume(i)
        self._consume(len(TOOL_CALL_END))
        call = self._parse_body(body)
        if call is None:
            self._fallback()
            return True
        name, args = call
        index = self._new_index()
        self._out(ToolCallStart(index, new_call_id(), name))
        self._out(ToolCallArgsDelta(index, args))
        self._close_block()
        return True

    def _parse_body(self, body: str) -> tuple[str, str] | None:
        try:
            obj = json.loads(body.strip(), parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name = obj["name"].strip()
        if not self._valid_name(name):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if args is None:
            args = {}
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args, parse_constant=_reject_constant) if args.strip() else {}
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        return name, _dumps(args)


# ---------------------------------------------------------------- factory

_PARSERS = {
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "hermes": HermesToolParser,
    "none": NoToolParser,
}


def make_tool_parser(name: str | None, tools: Any = None, *, incremental: bool = True) -> ToolCallParser:
    """"qwen3_coder" (alias "qwen3_xml"), "hermes", or "none"/None."""
    cls = _PARSERS.get(name or "none")
    if cls is None:
        raise ValueError(f"unknown tool parser {name!r}; expected one of {sorted(_PARSERS)}")
    return cls(tools, incremental=incremental)


def detect_tool_parser(chat_template: str | None) -> str:
    """Tool-call format a chat template teaches: "qwen3_coder", "hermes" or "none"."""
    t = chat_template or ""
    if "<function=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t and ('"name"' in t or "\\\"name\\\"" in t):
        return "hermes"
    return "none"


def parse_tool_calls(text: str, parser: str, tools: Any = None) -> tuple[str, list[dict]]:
    """Non-streaming helper: (content, tool calls)."""
    return make_tool_parser(parser, tools).parse_all(text)

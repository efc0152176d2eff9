"""The "hermes" tool-call format (Qwen3-Next, JSON)::

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

A call that opens `{"name": "NAME", "arguments": {` (NAME a declared tool)
streams: the name at once, then the arguments object as the model writes it;
cut off, the object is closed after the arguments so far. Any other body (keys
in another order, arguments as a JSON string) is read whole at `</tool_call>`.
"""

from __future__ import annotations

import json
import re

from .events import ToolCallArgsDelta, ToolCallStart, partial_suffix_len
from .tools_base import TOOL_CALL_END, ToolCallParser, dumps, new_call_id, reject_constant

_MAX_HEAD = 1024  # past this many characters without a streamable header, the body is read whole
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_NAMED = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.){1,256})"')
_HEAD_PARTIAL = re.compile(r'\s*(\{\s*("(n(a(m(e("\s*(:\s*("[^"\n]*)?)?)?)?)?)?)?)?)?\s*$')
_IN_HEAD, _IN_ARGS, _IN_TAIL, _WHOLE = range(4)
_CLOSERS = {"{": "}", "[": "]"}


def _name(quoted: str) -> str:
    """A JSON string's inside, decoded ("" when it does not decode)."""
    try:
        return json.loads('"' + quoted + '"').strip()
    except ValueError:
        return ""


def json_closing(prefix: str) -> str:
    """A suffix that makes the cut-off JSON object text `prefix` valid JSON (best effort)."""
    stack, in_str, esc = [], False, False
    for ch in prefix:
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
        elif ch in "}]" and stack:
            stack.pop()
    quote = ('\\"' if esc else '"') if in_str else ""
    closers = "".join(reversed(stack))
    tail = prefix.rstrip()
    middles = ["", "null", ": null", "0"]
    for word in ("true", "false", "null"):
        middles += [word[k:] for k in range(1, len(word)) if tail.endswith(word[:k])]
    for middle in middles:
        for q in (quote, quote + ": null") if in_str else (quote,):
            if _valid(prefix + q + middle + closers):
                return q + middle + closers
    return quote + closers


def _valid(text: str) -> bool:
    try:
        json.loads(text, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return False
    return True


class HermesToolParser(ToolCallParser):
    name = "hermes"

    def _begin_block(self, tag: str) -> None:
        self._state = _IN_HEAD
        self._search_from = 0

    def _step_block(self, final: bool) -> bool:
        return (self._step_head, self._step_args, self._step_tail, self._step_whole)[self._state](final)

    def _step_head(self, final: bool) -> bool:
        buf = self._buf
        m = _HEAD.match(buf)
        if m:
            if self._valid_name(_name(m.group(1))):
                name = _name(m.group(1))
                self._consume(m.end())
                self._index = self._new_index()
                self._out(ToolCallStart(self._index, new_call_id(), name))
                self._args, self._stack, self._in_str, self._esc = "", [], False, False
                self._state = _IN_ARGS
                return True
        elif final:  # cut off before the arguments
            named = _NAMED.match(buf)
            name = _name(named.group(1)) if named else ""
            if self._valid_name(name):
                self._consume(len(buf))
                index = self._new_index()
                self._out(ToolCallStart(index, new_call_id(), name))
                self._out(ToolCallArgsDelta(index, "{}"))
                self._close_block()
                return True
            if _HEAD_PARTIAL.match(buf):
                self._drop()  # before the name was complete
                return True
        elif not final and TOOL_CALL_END not in buf and len(buf) < _MAX_HEAD:
            return False
        self._state = _WHOLE
        return True

    def _step_args(self, final: bool) -> bool:
        """Pass the arguments object through, tracking strings and nesting to find its end."""
        buf, i, end = self._buf, 0, -1
        while i < len(buf):
            ch = buf[i]
            if self._in_str:
                self._esc, self._in_str = (False, True) if self._esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self._in_str = True
            elif ch in _CLOSERS:
                self._stack.append(ch)
            elif ch in "}]":
                self._stack.pop()
                if not self._stack:
                    end = i + 1
                    break
            elif ch == "<" and TOOL_CALL_END.startswith(buf[i:i + len(TOOL_CALL_END)]):
                if buf.startswith(TOOL_CALL_END, i) or (not final):
                    end = i  # the block ends inside the arguments (or may: hold it back)
                    break
            i += 1
        if end < 0:
            self._emit_args(self._consume(len(buf)))
            if final:
                self._emit_args(json_closing(self._args))
                self._close_block()
                return True
            return False
        self._emit_args(self._consume(end))
        if self._stack:  # stopped at a (possible) </tool_call>
            if not buf.startswith(TOOL_CALL_END, end) and not final:
                return False
            self._emit_args(json_closing(self._args))
            self._stack = []
        self._state = _IN_TAIL
        return True

    def _emit_args(self, text: str) -> None:
        if text:
            self._args += text
            self._out(ToolCallArgsDelta(self._index, text))

    def _step_tail(self, final: bool) -> bool:
        """After the arguments: the rest of the body (its closing brace) up to `</tool_call>`."""
        buf = self._buf
        i = buf.find(TOOL_CALL_END)
        if i < 0 and not final:
            self._consume(len(buf) - partial_suffix_len(buf, (TOOL_CALL_END,)))
            return False
        self._consume(len(buf) if i < 0 else i + len(TOOL_CALL_END))
        self._close_block()
        return True

    def _step_whole(self, final: bool) -> bool:
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
            obj = json.loads(body.strip(), parse_constant=reject_constant)
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
                args = json.loads(args, parse_constant=reject_constant) if args.strip() else {}
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        return name, dumps(args)

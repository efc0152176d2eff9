"""The "hermes" tool-call format (Qwen3-Next, JSON)::

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

A call is sent whole when its `</tool_call>` arrives.
"""

from __future__ import annotations

import json

from .events import ToolCallArgsDelta, ToolCallStart
from .tools_base import TOOL_CALL_END, ToolCallParser, dumps, new_call_id, reject_constant


class HermesToolParser(ToolCallParser):
    name = "hermes"

    def _begin_block(self, tag: str) -> None:
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

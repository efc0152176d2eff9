"""The shared machinery of the tool-call parsers: content scanning, block bookkeeping, events.

A format module (`tools_qwen3_coder.py`, `tools_hermes.py`) subclasses
`ToolCallParser` and implements `_begin_block(tag)` and `_step_block(final)`.

Interface: `feed(delta) -> list[Event]`, `finish() -> list[Event]`, `has_tool_calls`.
Events are ContentDelta, ToolCallStart and ToolCallArgsDelta (see events.py).

Content rules: whitespace just before a tool call, between calls and after the
last call is dropped. A call streams as it is written: id and name as soon as
the name is read (and is a declared tool), then its argument text in pieces.
From then on it is a call: cut off (max_tokens) it is closed with the
arguments so far, still valid JSON. A block cut off before its function name
is dropped (tool-call markup is never content). Text that never becomes a call
(a function not in `tools`, a block with no function header) comes back as
content, verbatim.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from .events import ContentDelta, Event, ToolCallArgsDelta, ToolCallStart, find_first, merge_events, partial_suffix_len

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_schemas(tools: list[dict] | None) -> dict[str, dict] | None:
    """{function name: parameters JSON schema} from OpenAI `tools` dicts.

    None when no tools are given: then any function name is accepted.
    """
    if not tools:
        return None
    out: dict[str, dict] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN / Infinity are not valid JSON output


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


class ToolCallParser:
    """Base class: a block opens at `<tool_call>` (a format may add tags: `_block_starts`)."""

    name = "base"

    def __init__(self, tools: list[dict] | None = None):
        self._schemas = tool_schemas(tools)
        self._buf = ""
        self._events: list[Event] = []
        self._in_block = False
        self._raw: list[str] = []  # the open block as written, for the content fallback
        self._skip_ws = False  # drop whitespace that follows a tool call
        self._next_index = 0
        self._block_index = 0  # the first call index of the open block
        self._emitted_calls = 0

    # -- public

    @property
    def has_tool_calls(self) -> bool:
        """True once any valid tool call has been emitted (finish_reason "tool_calls")."""
        return self._emitted_calls > 0

    def feed(self, text: str) -> list[Event]:
        if text:
            self._buf += text
            self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """End of output: flush held-back text, settle an unclosed block."""
        self._run(final=True)
        return self._take()

    # -- machinery for the format modules

    def _take(self) -> list[Event]:
        events, self._events = merge_events(self._events), []
        return events

    def _emit(self, ev: Event) -> None:
        if isinstance(ev, ToolCallStart):
            self._emitted_calls += 1
        elif not isinstance(ev, ToolCallArgsDelta) and not ev.text:
            return
        self._events.append(ev)

    def _out(self, ev: Event) -> None:
        """A tool-call event of the open block: sent at once (the block can no longer be content)."""
        self._emit(ev)

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
        i, tag = self._find_block_start(buf)
        if i >= 0:
            before = buf[:i]
            text = before.rstrip()
            self._emit(ContentDelta(text))
            n = self._tag_length(tag)
            self._buf = buf[i + n:]
            self._in_block = True
            self._raw = [before[len(text):], tag[:n]]
            self._block_index = self._next_index
            self._begin_block(tag)
            return True
        if final:
            self._emit(ContentDelta(buf.rstrip() if self._emitted_calls else buf))
            self._buf = ""
            return False
        # Hold back a possible partial start tag and the whitespace before it.
        keep = len(buf) - partial_suffix_len(buf, self._block_starts())
        keep = len(buf[:keep].rstrip())
        self._emit(ContentDelta(buf[:keep]))
        self._buf = buf[keep:]
        return False

    def _block_starts(self) -> tuple[str, ...]:
        return (TOOL_CALL_START,)

    def _find_block_start(self, buf: str) -> tuple[int, str | None]:
        return find_first(buf, self._block_starts())

    def _tag_length(self, tag: str) -> int:
        """How much of a block's start tag the content scanner consumes."""
        return len(tag)

    def _close_block(self) -> None:
        """The block closed (its calls are out already)."""
        self._in_block = False
        self._raw = []
        self._skip_ws = True

    def _fallback(self) -> None:
        """The open block is not a tool call (none of it went out): what was consumed of it is content."""
        self._next_index = self._block_index  # its calls never happened
        self._in_block = False
        self._emit(ContentDelta("".join(self._raw)))
        self._raw = []

    def _drop(self) -> None:
        """The output ended in a block cut off before its function name: nothing of it goes out."""
        self._consume(len(self._buf))
        self._next_index = self._block_index
        self._in_block = False
        self._raw = []

    def _begin_block(self, tag: str) -> None:
        raise NotImplementedError

    def _step_block(self, final: bool) -> bool:
        raise NotImplementedError

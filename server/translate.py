"""Translations every API adapter shares: content parts to text, tools to the
template's function tools, parser events to content blocks (the streaming
block state machine of Messages and Responses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from mtp_serve.server.errors import APIError, bad_request
from mtp_serve.server.parsers import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallStart

TEXT_PARTS = ("text", "input_text", "output_text")  # chat, Responses input, Responses output replayed
NOT_TEXT = ("image", "image_url", "input_image", "document", "file", "input_file", "input_audio")


def unsupported(kind: Any, where: str, param: str) -> APIError:
    if kind in NOT_TEXT:
        return bad_request(f"{where}: {kind} content is not supported: this model reads text only", param)
    return bad_request(f"{where}: content part of type {kind!r} is not supported here", param)


def flatten_text(content: Any, where: str, param: str, *, kinds=TEXT_PARTS, sep: str = "") -> str:
    """Content as one string: a string as it is, a list of text parts joined with `sep`.
    Any other part, or content that is neither, is a 400 naming where it is."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of content parts, not {type(content).__name__}", param)
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise unsupported(kind, f"{where}[{k}]", param)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{k}]: a {kind} part needs a string 'text'", param)
        parts.append(part["text"])
    return sep.join(parts)


def function_tool(name: str, parameters: Optional[dict], description: Optional[str] = None) -> dict:
    """An OpenAI function tool, as chat templates and the tool-call constraint read tools."""
    fn = {"name": name, "parameters": parameters if parameters is not None else {"type": "object", "properties": {}}}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


# ---------------------------------------------------------------- content blocks


@dataclass
class Block:
    """One block of a streamed reply: reasoning, text, or a tool call."""

    index: int
    kind: str  # "thinking", "text" or "tool_use"
    call: Optional[ToolCallStart] = None  # for a tool_use block: its id and name
    text: str = ""  # what the block holds so far (reasoning, text, or the call's arguments)


@dataclass
class BlockEvent:
    type: str  # "start", "delta" or "stop"
    block: Block
    delta: str = ""


class Blocks:
    """Parser events -> content blocks. A block starts when the kind of output changes
    (reasoning, text, each tool call) and stops when the next one starts or the output ends."""

    def __init__(self):
        self.open: Optional[Block] = None
        self.count = 0

    def _start(self, kind: str, call: Optional[ToolCallStart] = None) -> List[BlockEvent]:
        out = self.close()
        self.open = Block(self.count, kind, call)
        self.count += 1
        return out + [BlockEvent("start", self.open)]

    def feed(self, events: List[Event]) -> List[BlockEvent]:
        out: List[BlockEvent] = []
        for ev in events:
            if isinstance(ev, (ReasoningDelta, ContentDelta)):
                kind = "thinking" if isinstance(ev, ReasoningDelta) else "text"
                if self.open is None or self.open.kind != kind:
                    out += self._start(kind)
            elif isinstance(ev, ToolCallStart):
                out += self._start("tool_use", ev)
                continue
            elif not isinstance(ev, ToolCallArgsDelta) or self.open is None:
                continue
            self.open.text += ev.text
            out.append(BlockEvent("delta", self.open, ev.text))
        return out

    def close(self) -> List[BlockEvent]:
        """Stop the open block (at the output's end)."""
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [BlockEvent("stop", block)]

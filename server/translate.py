"""Translations every API adapter shares: content parts to text (and images), tools to the
template's function tools, parser events to content blocks (the streaming
block state machine of Messages and Responses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Union

from mtp_serve.server.errors import APIError, bad_request
from mtp_serve.server.images import IMAGE_PARTS, image_ref
from mtp_serve.server.parsers import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallStart

Content = Union[str, List[dict]]  # a message's content for the template: text, or parts with images

TEXT_PARTS = ("text", "input_text", "output_text")  # chat, Responses input, Responses output replayed
NOT_TEXT = ("document", "file", "input_file", "input_audio")


def unsupported(kind: Any, where: str, param: str) -> APIError:
    if kind in IMAGE_PARTS:
        return bad_request(f"{where}: image content is not supported here (images go in user messages and tool results)", param)
    if kind in NOT_TEXT:
        return bad_request(f"{where}: {kind} content is not supported: this model reads text and images", param)
    return bad_request(f"{where}: content part of type {kind!r} is not supported here", param)


def flatten_text(content: Any, where: str, param: str, *, kinds=TEXT_PARTS, sep: str = "", images: bool = False) -> Content:
    """Content as the chat template reads it: a string as it is, a list of text parts joined
    with `sep`. With `images`, image parts of any API are taken too: content with an image is
    a list of parts in order, texts ({"type": "text"}, neighbours joined with `sep`) and images
    ({"type": "image", "image": ImageRef}; chat.render resolves them and hands the template
    HF's {"type": "image"}). Any other part, or content that is neither, is a 400 naming where it is."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of content parts, not {type(content).__name__}", param)
    parts: List[dict] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind in IMAGE_PARTS:
            parts.append({"type": "image", "image": image_ref(part, f"{where}[{k}]", param)})
            continue
        if kind not in kinds:
            raise unsupported(kind, f"{where}[{k}]", param)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{k}]: a {kind} part needs a string 'text'", param)
        if parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += sep + part["text"]
        else:
            parts.append({"type": "text", "text": part["text"]})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def joined(contents: List[Content], sep: str) -> Content:
    """Several contents as one (a message of several blocks), joined with `sep`: a string
    when all are strings, else a list of parts."""
    if all(isinstance(c, str) for c in contents):
        return sep.join(contents)
    parts: List[dict] = []
    for c in contents:
        for p in ([{"type": "text", "text": c}] if isinstance(c, str) else c):
            if parts and parts[-1]["type"] == "text" and p["type"] == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + sep + p["text"]}
            else:
                parts.append(dict(p))
    return parts


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

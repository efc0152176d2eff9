"""Events produced by the streaming output parsers, and two small text helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Union


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of reasoning text (OpenAI-style `reasoning_content`)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """A piece of ordinary assistant content."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: `index` counts calls in this output from 0."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    """A fragment of the JSON arguments of call `index`.

    Concatenating every fragment of one call gives its complete JSON object text.
    """

    index: int
    text: str


Event = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgsDelta]


def find_first(text: str, tags: Iterable[str], start: int = 0) -> tuple[int, str | None]:
    """Earliest full occurrence of any tag in `text[start:]`: (index, tag) or (-1, None)."""
    best, best_tag = -1, None
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, best_tag = i, tag
    return best, best_tag


def partial_suffix_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of some tag.

    That many characters must be held back: the next delta may complete the tag.
    """
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def merge_events(events: list[Event]) -> list[Event]:
    """Join neighbouring text deltas of the same kind (and same call index)."""
    out: list[Event] = []
    for ev in events:
        prev = out[-1] if out else None
        if isinstance(ev, (ContentDelta, ReasoningDelta)) and type(prev) is type(ev):
            out[-1] = type(ev)(prev.text + ev.text)
        elif (
            isinstance(ev, ToolCallArgsDelta)
            and isinstance(prev, ToolCallArgsDelta)
            and prev.index == ev.index
        ):
            out[-1] = ToolCallArgsDelta(ev.index, prev.text + ev.text)
        else:
            out.append(ev)
    return out

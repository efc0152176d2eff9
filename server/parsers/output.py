"""Reasoning parser, then tool parser: one stream of output events."""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallStart, merge_events
from .reasoning import ReasoningParser
from .tools import ToolCallParser


class OutputParser:
    """Feed raw text deltas; get ReasoningDelta / ContentDelta / ToolCallStart / ToolCallArgsDelta.

    Text goes through the reasoning parser first (when given); its content part
    goes through the tool parser (when given). A `<tool_call>` inside
    unterminated reasoning ends the reasoning (see ReasoningParser) and reaches
    the tool parser.
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def has_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.has_tool_calls

    def feed(self, text: str) -> list[Event]:
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._route(r, c, final=False)

    def finish(self) -> list[Event]:
        r, c = self.reasoning.finish() if self.reasoning else ("", "")
        return self._route(r, c, final=True)

    def _route(self, r: str, c: str, final: bool) -> list[Event]:
        events: list[Event] = [ReasoningDelta(r)] if r else []
        if self.tools is None:
            if c:
                events.append(ContentDelta(c))
        else:
            events += self.tools.feed(c)
            if final:
                events += self.tools.finish()
        return merge_events(events)


@dataclass
class ParsedOutput:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)


def collect(events: list[Event]) -> ParsedOutput:
    """Aggregate events into a whole message (None for empty reasoning/content)."""
    reasoning, content, calls = [], [], {}
    for ev in events:
        if isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls[ev.index] = {"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
        elif isinstance(ev, ToolCallArgsDelta):
            calls[ev.index]["function"]["arguments"] += ev.text
    return ParsedOutput(
        "".join(reasoning) or None,
        "".join(content) or None,
        [calls[i] for i in sorted(calls)],
    )


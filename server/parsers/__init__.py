"""Streaming output parsers: reasoning (`<think>`) and tool calls (Qwen XML, Hermes JSON)."""

from .events import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from .output import OutputParser, ParsedOutput, collect, parse_output
from .reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning
from .tools import (
    HermesToolParser,
    NoToolParser,
    Qwen3CoderToolParser,
    ToolCallParser,
    convert_param_value,
    detect_tool_parser,
    make_tool_parser,
    parse_tool_calls,
)

__all__ = [
    "ContentDelta",
    "Event",
    "ReasoningDelta",
    "ToolCallArgsDelta",
    "ToolCallStart",
    "OutputParser",
    "ParsedOutput",
    "collect",
    "parse_output",
    "ReasoningParser",
    "prompt_opens_reasoning",
    "split_reasoning",
    "HermesToolParser",
    "NoToolParser",
    "Qwen3CoderToolParser",
    "ToolCallParser",
    "convert_param_value",
    "detect_tool_parser",
    "make_tool_parser",
    "parse_tool_calls",
]

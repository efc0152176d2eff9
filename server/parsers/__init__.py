"""Streaming output parsers: reasoning (`<think>`) and tool calls (Qwen XML, Hermes JSON)."""

from .events import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from .output import OutputParser, ParsedOutput, collect
from .reasoning import ReasoningParser, prompt_opens_reasoning
from .tools import detect_tool_parser, make_tool_parser
from .tools_base import ToolCallParser
from .tools_qwen3_coder import convert_param_value

__all__ = [
    "ContentDelta",
    "Event",
    "ReasoningDelta",
    "ToolCallArgsDelta",
    "ToolCallStart",
    "OutputParser",
    "ParsedOutput",
    "collect",
    "ReasoningParser",
    "prompt_opens_reasoning",
    "ToolCallParser",
    "convert_param_value",
    "detect_tool_parser",
    "make_tool_parser",
]

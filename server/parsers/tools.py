"""Tool-call formats by name, and the format a chat template teaches.

One module per format over `tools_base.ToolCallParser`:
- "qwen3_coder" (Qwen3.5/3.6, XML): `tools_qwen3_coder.py`
- "hermes" (Qwen3-Next, JSON): `tools_hermes.py`
"""

from __future__ import annotations

from .tools_base import ToolCallParser
from .tools_hermes import HermesToolParser
from .tools_qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen3_coder": Qwen3CoderToolParser,
    "hermes": HermesToolParser,
}


def make_tool_parser(name: str, tools: list[dict] | None = None) -> ToolCallParser:
    """A fresh parser for one output: "qwen3_coder" or "hermes"."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool parser {name!r}; expected one of {sorted(TOOL_PARSERS)}")
    return cls(tools)


def detect_tool_parser(chat_template: str | None) -> str:
    """Tool-call format a chat template teaches: "qwen3_coder", "hermes" or "none"."""
    t = chat_template or ""
    if "<function=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t and ('"name"' in t or "\\\"name\\\"" in t):
        return "hermes"
    return "none"

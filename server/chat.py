"""Chat prompts: messages -> the checkpoint's chat template -> token ids; and the output parsers.

`tool_choice`:
- "none": the tools still reach the template (the prompt stays a prefix of the
  agent's next turn), but the output is not parsed for tool calls.
- "auto" (the default with tools): the output is parsed for tool calls.
- "required" / named: the output is constrained (grammar, `constraints.py`) to
  a tool call in the model's format (one of the tools, or the named one; several
  with parallel tool calls) whose arguments follow the tool's schema.
(Anthropic's "any" is "required" and its "tool" a named function; the Responses
API's choices are the same as chat's.) An output constraint (`response_format`
and the like) goes through the same place; with thinking on, the reasoning
before either stays free.

Streaming tool calls: a call goes out when its `</tool_call>` arrives, as one
delta with id and name, then its argument chunks; text that never becomes a
well-formed call (malformed, or cut off by max_tokens) is sent as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

from jinja2 import TemplateError

from mtp_serve.engine.grammar import Constraint
from mtp_serve.server import constraints
from mtp_serve.server.errors import bad_request
from mtp_serve.server.parsers import (
    OutputParser,
    ReasoningParser,
    detect_tool_parser,
    make_tool_parser,
    prompt_opens_reasoning,
)
from mtp_serve.server.schemas import ChatMessage

TURN_START = "<|im_start|>"  # ChatML, as every Qwen template uses


@dataclass
class ChatPrompt:
    text: str  # the rendered prompt
    ids: List[int]
    constraint: Optional[Constraint]  # what the output (after any reasoning) must match: a forced tool call, a schema...
    opens_reasoning: bool  # the prompt ends inside an open think block
    tool_parser: str  # parser for this request's output ("none" when not parsing tools)
    tools: Optional[list]  # OpenAI tools as dicts
    checkpoints: tuple = ()  # prompt lengths worth a prompt-cache snapshot

    @classmethod
    def raw(cls, ids: List[int], constraint: Optional[Constraint] = None) -> "ChatPrompt":
        """A prompt given as text or ids (/v1/completions): the output is not parsed."""
        return cls("", ids, constraint, False, "none", None)


def hf_tokenizer(tokenizer):
    return getattr(tokenizer, "_tokenizer", tokenizer)


class ChatFormat:
    """The model's chat template and parser choice, resolved once at start-up."""

    def __init__(self, tokenizer, card, *, chat_template: Optional[str] = None, tool_parser: str = "auto",
                 reasoning_parser: str = "auto", check_constraint: Callable[[Constraint], None] = lambda c: None):
        self.tokenizer = hf_tokenizer(tokenizer)
        self.added_tokens = set(self.tokenizer.get_added_vocab())
        self.check_constraint = check_constraint  # compiles it: a 400 naming the problem
        if chat_template is not None and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text()
        self.template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if tool_parser == "auto":
            tool_parser = detect_tool_parser(self.template)
            if tool_parser == "none":
                tool_parser = card.tool_call_parser
        if reasoning_parser == "auto":
            reasoning_parser = card.reasoning_parser
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        turn = self.tokenizer.convert_tokens_to_ids(TURN_START)
        self.turn_start_id = turn if isinstance(turn, int) and self.tokenizer.convert_ids_to_tokens(turn) == TURN_START else None

    def checkpoints(self, ids: List[int]) -> tuple:
        """Where the last turn (the generation prompt) starts. An agent's next request
        repeats everything before it, while the reply after it comes back re-rendered
        (reasoning dropped, arguments reformatted), so a snapshot there is what the
        next turn can reuse."""
        if self.turn_start_id is None or self.turn_start_id not in ids:
            return ()
        last = len(ids) - 1 - ids[::-1].index(self.turn_start_id)
        return (last,) if last > 0 else ()

    # -- prompt

    def render(self, messages: List[dict], tools: Optional[List[dict]] = None, tool_choice: Optional[str] = None,
               tool_name: Optional[str] = None, template_kwargs: Optional[dict] = None, messages_param: str = "messages",
               output: Optional[Constraint] = None, parallel_tool_calls: bool = True) -> ChatPrompt:
        """`messages` as chat templates expect them; `tools` as OpenAI function tools;
        `tool_choice` "none" / "auto" / "required" (None: "auto" with tools), or
        `tool_name` for one named function; `output`: a constraint on the output."""
        if not self.template:
            raise bad_request("this model has no chat template; use /v1/completions or start the server with --chat-template")
        tools = tools or None
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        if tool_name is not None:
            choice = "function"
        if choice not in ("none", "auto") and not tools:
            raise bad_request("tool_choice requires tools", "tool_choice")
        parser = self.tool_parser if (tools and choice != "none") else "none"
        if parser == "none" and choice not in ("none", "auto"):
            raise bad_request("tool_choice 'required' or a named function needs a tool-call format; this server runs with --tool-call-parser none", "tool_choice")
        try:
            text = self.tokenizer.apply_chat_template(
                one_system_message(messages),
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                chat_template=self.template,
                **(template_kwargs or {}),
            )
        except (TemplateError, TypeError, ValueError, KeyError) as e:
            raise bad_request(f"the chat template rejected the messages: {e}", messages_param) from e
        opens = self.reasoning_parser != "none" and prompt_opens_reasoning(text)
        forced = None
        if choice in ("required", "function"):
            if tool_name is not None and tool_name not in {t["function"]["name"] for t in tools}:
                raise bad_request(f"tool_choice names function {tool_name!r}, which is not in tools", "tool_choice")
            forced = constraints.tool_calls(parser, tools, tool_name, parallel_tool_calls, self.added_tokens)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        prompt = ChatPrompt(text, ids, constraints.one_of(forced, output), opens, parser, tools, self.checkpoints(ids))
        if prompt.constraint is not None:
            self.check_constraint(self.engine_constraint(prompt))
        return prompt

    def engine_constraint(self, prompt: ChatPrompt) -> Optional[Constraint]:
        """What the engine enforces from the first output token: reasoning stays free."""
        if prompt.constraint is None or not prompt.opens_reasoning:
            return prompt.constraint
        return constraints.after_reasoning(prompt.constraint, self.added_tokens)

    # -- output

    def output_parser(self, prompt: ChatPrompt) -> OutputParser:
        reasoning = ReasoningParser(starts_in_reasoning=True) if prompt.opens_reasoning else None
        tools = make_tool_parser(prompt.tool_parser, prompt.tools) if prompt.tool_parser != "none" else None
        return OutputParser(reasoning, tools)


def one_system_message(messages: List[dict]) -> List[dict]:
    """Qwen templates take one system message, first: system messages elsewhere (Codex sends
    two developer messages, Claude Code system turns) join it, in order, so the prompt
    stays a prefix of the next turn's."""
    system = [m for m in messages if m.get("role") == "system"]
    if len(system) < 2 and (not system or messages[0] is system[0]):
        return messages
    text = "\n\n".join(m["content"] for m in system if m.get("content"))
    return [{"role": "system", "content": text}] + [m for m in messages if m.get("role") != "system"]


def template_messages(messages: List[ChatMessage]) -> List[dict]:
    """OpenAI messages -> what chat templates expect (text content, dict arguments)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        content = d.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise bad_request(f"messages[{i}]: content part of type {kind!r} is not supported (text only)", f"messages.{i}.content")
            d["content"] = "".join(parts)
        elif content is None:
            d["content"] = ""
        for call in d.get("tool_calls", []) or []:
            fn = call["function"]
            if isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"] or "{}")
                except json.JSONDecodeError as e:
                    raise bad_request(f"messages[{i}]: tool call arguments are not valid JSON: {e}", f"messages.{i}.tool_calls") from e
                fn["arguments"] = args
        out.append(d)
    return out


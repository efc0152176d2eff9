"""Chat prompts: messages -> the checkpoint's chat template -> token ids; and the output parsers.

`tool_choice` is enforced through the prompt, since the engine has no
constrained decoding:
- "none": the tools still reach the template (the prompt stays a prefix of the
  agent's next turn), but the output is not parsed for tool calls.
- "auto" (the default with tools): the output is parsed for tool calls.
- "required": the generation prompt ends with the opening of a tool call
  (`<tool_call>\\n<function=` for qwen3_coder, `<tool_call>\\n{"name": "` for
  hermes), so the model's first tokens name a function.
- named: the prompt ends with the whole call header for that function; the
  model writes the arguments.
With thinking on, the forced text first closes the think block. The forced
text is fed to the output parser as if the model had written it. A model that
still writes a malformed call gets its text back as content.

Streaming tool calls: a call goes out when its `</tool_call>` arrives, as one
delta with id and name, then its argument chunks; text that never becomes a
well-formed call (malformed, or cut off by max_tokens) is sent as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from jinja2 import TemplateError

from mtp_serve.server.errors import bad_request
from mtp_serve.server.parsers import (
    OutputParser,
    ReasoningParser,
    detect_tool_parser,
    make_tool_parser,
    prompt_opens_reasoning,
)
from mtp_serve.server.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice

TOOL_PARSERS = ("auto", "qwen3_coder", "hermes", "none")
TURN_START = "<|im_start|>"  # ChatML, as every Qwen template uses
REASONING_PARSERS = ("auto", "qwen3", "none")


@dataclass
class ChatPrompt:
    text: str  # the rendered prompt, forced text included
    ids: List[int]
    forced: str  # text appended after the generation prompt (tool_choice required/named)
    opens_reasoning: bool  # the prompt ends inside an open think block
    tool_parser: str  # parser for this request's output ("none" when not parsing tools)
    tools: Optional[list]  # OpenAI tools as dicts
    checkpoints: tuple = ()  # prompt lengths worth a prompt-cache snapshot


def hf_tokenizer(tokenizer):
    return getattr(tokenizer, "_tokenizer", tokenizer)


class ChatFormat:
    """The model's chat template and parser choice, resolved once at start-up."""

    def __init__(self, tokenizer, card, *, chat_template: Optional[str] = None, tool_parser: str = "auto", reasoning_parser: str = "auto"):
        self.tokenizer = hf_tokenizer(tokenizer)
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
        """Every message boundary: where each `<|im_start|>` is. The first ones end the
        system prompt and tool schemas, which other conversations share; the last one
        starts the generation prompt, before the reply that an agent's next request
        sends back re-rendered (reasoning dropped, arguments reformatted)."""
        if self.turn_start_id is None:
            return ()
        return tuple(i for i, t in enumerate(ids) if t == self.turn_start_id and i > 0)

    # -- prompt

    def render(self, req: ChatCompletionRequest) -> ChatPrompt:
        if not self.template:
            raise bad_request("this model has no chat template; use /v1/completions or start the server with --chat-template")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and choice != "auto" and not tools:
            raise bad_request("tool_choice requires tools", "tool_choice")
        parser = self.tool_parser if (tools and choice != "none") else "none"
        if parser == "none" and choice not in ("none", "auto"):
            raise bad_request("tool_choice 'required' or a named function needs a tool-call format; this server runs with --tool-call-parser none", "tool_choice")
        kwargs = dict(req.chat_template_kwargs or {})
        try:
            text = self.tokenizer.apply_chat_template(
                template_messages(req.messages),
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                chat_template=self.template,
                **kwargs,
            )
        except (TemplateError, TypeError, ValueError, KeyError) as e:
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from e
        opens = self.reasoning_parser != "none" and prompt_opens_reasoning(text)
        forced = ""
        if choice == "required" or isinstance(choice, NamedToolChoice):
            name = choice.function.name if isinstance(choice, NamedToolChoice) else None
            if name is not None and name not in {t["function"]["name"] for t in tools}:
                raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
            forced = ("</think>\n\n" if opens else "") + forced_tool_prefix(parser, name)
        text += forced
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ChatPrompt(text, ids, forced, opens, parser, tools, self.checkpoints(ids))

    # -- output

    def output_parser(self, prompt: ChatPrompt, *, streaming: bool, parallel_tool_calls: bool = True) -> OutputParser:
        reasoning = ReasoningParser(starts_in_reasoning=True) if prompt.opens_reasoning else None
        # incremental=False also when streaming: a call is sent (id and name, then its
        # argument chunks) once `</tool_call>` closes it, so malformed or cut-off
        # tool text can still come back as content instead of a half-sent call.
        tools = make_tool_parser(prompt.tool_parser, prompt.tools, incremental=False) if prompt.tool_parser != "none" else None
        return OutputParser(reasoning, tools)


def forced_tool_prefix(parser: str, name: Optional[str]) -> str:
    if parser == "hermes":
        return '<tool_call>\n{"name": "' + (f'{name}", "arguments": ' if name else "")
    return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")


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


def tools_as_dicts(tools: Any) -> Optional[list]:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None

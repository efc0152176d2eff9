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

Streaming tool calls (as vLLM streams them): a call goes out as soon as its
function name is read, as one delta with id and name, then its arguments in
pieces as the model writes them. A call cut off by max_tokens is still a call,
its arguments closed after what was written (finish_reason "length"); a block
cut off before its name is dropped. Tool-call markup never reaches content;
text that never becomes a call (an undeclared function) is content.

Special tokens in client text (`PromptEncoder`): a message containing
`<|im_end|>` must not close its turn. Before rendering, every special token in
the messages' and tools' strings becomes a marker; the template's own special
tokens stay as they are. The rendered text is then split at the template's
special tokens (as the tokenizer itself does) and each piece between them is
tokenized with the markers turned back into their text and special tokens read
as text, so client text gets exactly the ids ordinary text would.

Images: each API's image parts arrive as {"type": "image", "image": ImageRef}
(translate.flatten_text); `render` resolves them (images.py: fetched, decoded,
resized), hands the template HF's {"type": "image"} items, and after tokenizing
expands the template's one `<|image_pad|>` per image to the image's n_tokens
pads, in order (`ChatPrompt.images`).
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple

from jinja2 import TemplateError

from mtp_serve.engine.grammar import Constraint
from mtp_serve.engine.memory import trim_heap
from mtp_serve.models.mlx_lm_compat import hf_tokenizer
from mtp_serve.server import constraints
from mtp_serve.server.errors import bad_request
from mtp_serve.server.images import ImageRef, ImageSettings, resolve
from mtp_serve.server.parsers import (
    OutputParser,
    ReasoningParser,
    detect_tool_parser,
    make_tool_parser,
    prompt_opens_reasoning,
)
from mtp_serve.server.schemas import ChatMessage
from mtp_serve.server.translate import flatten_text

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
    images: tuple = ()  # PreparedImage per image, in prompt order; each fills n_tokens image-pad tokens of `ids`
    # What the engine enforces from the first output token (reasoning stays free): built with the
    # prompt (`ChatFormat.engine_constraint`), compiled off the engine thread by `Service.render`.
    engine_constraint: Optional[Constraint] = None

    @classmethod
    def raw(cls, ids: List[int], constraint: Optional[Constraint] = None, checkpoints: tuple = (),
            opens_reasoning: bool = False, engine_constraint: Optional[Constraint] = None) -> "ChatPrompt":
        """A prompt given as text or ids (/v1/completions): the output is not parsed."""
        return cls("", ids, constraint, opens_reasoning, "none", None, checkpoints, engine_constraint=engine_constraint)

    @property
    def image_tokens(self) -> int:
        return sum(image.n_tokens for image in self.images)


# Tokenizing a few MB leaves hundreds of MB freed but held by the C heap (tokenizers'
# per-token buffers); past this many characters the encoder hands them back to the OS.
TRIM_ABOVE_CHARS = 1 << 18


class PromptEncoder:
    """Prompt text -> token ids; special tokens in client text stay text unless allowed."""

    def __init__(self, tokenizer, allow_special_in_content: bool = False):
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {t.content for t in decoder.values() if getattr(t, "special", False)}
        special |= set(getattr(tokenizer, "all_special_tokens", ()) or ())
        self.special = sorted((t for t in special if t), key=len, reverse=True)
        self.escaping = bool(self.special) and not allow_special_in_content
        self.special_re = re.compile("|".join(map(re.escape, self.special))) if self.special else None
        backend = getattr(tokenizer, "_tokenizer", None)
        self.as_text = None
        if self.escaping and hasattr(backend, "encode_special_tokens"):
            self.as_text = copy.deepcopy(backend)  # its own copy: the flag is per tokenizer, shared by threads
            self.as_text.encode_special_tokens = True

    def escape(self, value: Any) -> Tuple[Any, dict]:
        """`value` (messages, tools) with each special token in its strings replaced by a
        marker; returns it and {marker: token}."""
        if not self.escaping:
            return value, {}
        nonce = secrets.token_hex(6)
        markers = {tok: f"\ue000{nonce}.{i}\ue001" for i, tok in enumerate(self.special)}
        used = {}

        def sub(m: re.Match) -> str:
            used[markers[m.group(0)]] = m.group(0)
            return markers[m.group(0)]

        def walk(v):
            if isinstance(v, str):
                return self.special_re.sub(sub, v) if self.special_re.search(v) else v
            if isinstance(v, dict):
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x) for x in v]
            return v

        return walk(value), used

    def encode(self, text: str, markers: Optional[dict] = None) -> List[int]:
        if markers:
            ids = self._encode_marked(text, markers)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(text) > TRIM_ABOVE_CHARS:
            trim_heap()
        return ids

    def _encode_marked(self, text: str, markers: dict) -> List[int]:
        ids: List[int] = []
        pos = 0
        for m in self.special_re.finditer(text):  # the template's own special tokens
            ids += self._as_text(text[pos : m.start()], markers)
            ids.append(self.tokenizer.convert_tokens_to_ids(m.group(0)))
            pos = m.end()
        return ids + self._as_text(text[pos:], markers)

    def _as_text(self, piece: str, markers: dict) -> List[int]:
        if not piece:
            return []
        for marker, token in markers.items():
            piece = piece.replace(marker, token)
        if self.as_text is not None:
            return self.as_text.encode(piece, add_special_tokens=False).ids
        return self.tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)


class ChatFormat:
    """The model's chat template and parser choice, resolved once at start-up."""

    def __init__(self, tokenizer, card, *, chat_template: Optional[str] = None, tool_parser: str = "auto",
                 reasoning_parser: str = "auto", special_tokens_in_content: bool = False,
                 vision=None,
                 image_settings: ImageSettings = ImageSettings()):
        self.tokenizer = hf_tokenizer(tokenizer)
        self.vision = vision  # the model's vision tower (models/vision.Vision), None for a text-only model
        self.image_settings = image_settings
        self.encoder = PromptEncoder(self.tokenizer, allow_special_in_content=special_tokens_in_content)
        self.added_tokens = set(self.tokenizer.get_added_vocab())
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

    def render(self, messages: List[dict], tools: Optional[List[dict]] = None, tool_choice: Optional[str] = None,
               tool_name: Optional[str] = None, template_kwargs: Optional[dict] = None, messages_param: str = "messages",
               output: Optional[Constraint] = None, parallel_tool_calls: bool = True,
               schema_mode: str = "relaxed", continue_final: bool = False, add_generation_prompt: bool = True) -> ChatPrompt:
        """`messages` as chat templates expect them; `tools` as OpenAI function tools;
        `tool_choice` "none" / "auto" / "required" (None: "auto" with tools), or
        `tool_name` for one named function; `output`: a constraint on the output;
        `schema_mode`: how a forced call's tool schemas are served (schema_relax.py);
        `continue_final`: the last message is the start of the assistant's reply (a
        prefill), which the output continues instead of opening a new turn; `add_generation_prompt`
        off: no assistant turn is opened either (the output goes on from the last message's end)."""
        if not self.template:
            raise bad_request("this model has no chat template; use /v1/completions or start the server with --chat-template")
        tools = tools or None
        constraints.check_tools(tools)  # JSON Schema's metaschema, before any use: a 400 on every API
        names = [t["function"]["name"] for t in tools or ()]
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise bad_request(f"tools: tool names must be unique; {dup!r} appears {names.count(dup)} times", "tools")
        if continue_final and (not messages or messages[-1].get("role") != "assistant"):
            raise bad_request("continuing the final message needs an assistant message last", messages_param)
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        if tool_name is not None:
            choice = "function"
        if choice not in ("none", "auto") and not tools:
            raise bad_request("tool_choice requires tools", "tool_choice")
        parser = self.tool_parser if (tools and choice != "none") else "none"
        if parser == "none" and choice not in ("none", "auto"):
            raise bad_request("tool_choice 'required' or a named function needs a tool-call format; this server runs with --tool-call-parser none", "tool_choice")
        messages, refs = image_parts(messages)
        images = resolve(refs, self.vision, self.image_settings)  # fetched, decoded, resized: a 400 for a bad one
        (escaped, escaped_tools), markers = self.encoder.escape([one_system_message(messages), tools])
        try:
            text = self.tokenizer.apply_chat_template(
                escaped,
                tools=escaped_tools,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                tokenize=False,
                chat_template=self.template,
                **(template_kwargs or {}),
            )
        except (TemplateError, TypeError, ValueError, KeyError) as e:
            raise bad_request(f"the chat template rejected the messages: {e}", messages_param) from e
        except RecursionError as e:  # nesting is bounded before (limits.py); a template that recurses anyway
            raise bad_request("the chat template could not render the request: nested too deeply", messages_param) from e
        opens = self.reasoning_parser != "none" and prompt_opens_reasoning(text)
        forced = None
        if choice in ("required", "function"):
            if tool_name is not None and tool_name not in {t["function"]["name"] for t in tools}:
                raise bad_request(f"tool_choice names function {tool_name!r}, which is not in tools", "tool_choice")
            forced = constraints.tool_calls(parser, tools, tool_name, parallel_tool_calls, self.added_tokens, schema_mode)
        ids = self.encoder.encode(text, markers)
        if images or self.vision is not None:
            ids = self.expand_images(ids, images, messages_param)
        for marker, token in markers.items():
            text = text.replace(marker, token)
        constraint = constraints.one_of(forced, output)
        return ChatPrompt(text, ids, constraint, opens, parser, tools, self.checkpoints(ids), images,
                          self.engine_constraint(constraint, opens))

    def expand_images(self, ids: List[int], images: tuple, param: str) -> List[int]:
        """The template writes one image-pad token per image; each becomes the image's
        n_tokens pads, in order. A count that does not match (a template that does not render
        image parts, pad tokens in client text read as special) is a 400."""
        pad = self.vision.spec.image_token_id
        found = ids.count(pad)
        if found != len(images):
            raise bad_request(f"the chat template rendered {found} image placeholders for {len(images)} images "
                              "(does it render image content parts?)", param)
        if not images:
            return ids
        out: List[int] = []
        it = iter(images)
        for t in ids:
            if t == pad:
                out += [pad] * next(it).n_tokens
            else:
                out.append(t)
        return out

    def refuse_image_pads(self, ids: List[int], param: str) -> None:
        """A raw prompt (/v1/completions) cannot carry images: its image-pad tokens would have none."""
        if self.vision is not None and self.vision.spec.image_token_id in ids:
            raise bad_request("the prompt has image placeholder tokens but a raw prompt cannot carry images; send "
                              "images as content parts to /v1/chat/completions, /v1/messages or /v1/responses", param)

    def engine_constraint(self, c: Optional[Constraint], opens_reasoning: bool) -> Optional[Constraint]:
        """What the engine enforces from the first output token for the output constraint `c`:
        reasoning stays free when the prompt opens a think block."""
        if c is None:
            return None
        if not opens_reasoning:
            return Constraint(c.kind, c.source).carry(c)  # what the engine reads, nothing more (and c's compiled matcher)
        return constraints.after_reasoning(c, self.added_tokens)

    # -- output

    def output_parser(self, prompt: ChatPrompt) -> OutputParser:
        reasoning = ReasoningParser(starts_in_reasoning=True) if prompt.opens_reasoning else None
        tools = make_tool_parser(prompt.tool_parser, prompt.tools) if prompt.tool_parser != "none" else None
        return OutputParser(reasoning, tools)


def thinking_switch(effort: Optional[str]) -> Optional[dict]:
    """A reasoning effort as Qwen templates' thinking switch: none / minimal turn it off."""
    return None if effort is None else {"enable_thinking": effort not in ("none", "minimal")}


def one_system_message(messages: List[dict]) -> List[dict]:
    """Qwen templates take one system message, first: system messages elsewhere (Codex sends
    two developer messages, Claude Code system turns) join it, in order, so the prompt
    stays a prefix of the next turn's."""
    system = [m for m in messages if m.get("role") == "system"]
    if len(system) < 2 and (not system or messages[0] is system[0]):
        return messages
    text = "\n\n".join(m["content"] for m in system if m.get("content"))
    return [{"role": "system", "content": text}] + [m for m in messages if m.get("role") != "system"]


def image_parts(messages: List[dict]) -> Tuple[List[dict], List[ImageRef]]:
    """Messages whose content parts hold images ({"type": "image", "image": ImageRef}, from
    translate.flatten_text) as the template reads them (HF's {"type": "image"}), and the refs
    in message order: the order the template writes their placeholders."""
    refs: List[ImageRef] = []
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image":
                    refs.append(p["image"])
                    p = {"type": "image"}
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, refs


def template_messages(messages: List[ChatMessage]) -> List[dict]:
    """OpenAI messages -> what chat templates expect (text content, image parts, dict arguments)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        if "reasoning" in d and "reasoning_content" not in d:  # the name newer clients send back
            d["reasoning_content"] = d.pop("reasoning")
        content = d.get("content")
        if isinstance(content, list):
            d["content"] = flatten_text(content, f"messages[{i}].content", f"messages.{i}.content", kinds=("text", "input_text"),
                                        images=d["role"] in ("user", "tool"))
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


"""Request schemas (pydantic): the validation of every OpenAI request field we read.

Unknown fields are ignored (`extra="ignore"`), as OpenAI clients expect;
messages keep theirs (`extra="allow"`) so chat templates can read fields such
as `reasoning_content`. Responses are plain dicts built in each API's adapter.

Types are strict, as the schema says (`"max_tokens": "8"` and `"stream": "yes"`
are refused, not converted; an integer is a number), and no number may be NaN or
infinite (JSON has neither).
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from mtp_serve.engine.sampling import REPETITION_PENALTY_RANGE

STRICT = dict(strict=True, allow_inf_nan=False)

# Any integer in [-2^63, 2^64) (signed or unsigned 64-bit), used modulo 2^64.
Seed = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64), AfterValidator(lambda v: v % (1 << 64))]
RepetitionPenalty = Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class StreamOptions(_Request):
    include_usage: bool = False


class NamedFunction(BaseModel):
    model_config = ConfigDict(**STRICT)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(**STRICT)
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    type: str


class SpeculativeOptions(BaseModel):
    """`speculative`: how a request's speculation may draft (an mtp-serve extension)."""

    model_config = ConfigDict(extra="forbid", **STRICT)
    copy_: Optional[bool] = Field(default=None, alias="copy")  # drafts copied from the context; None: on


class SamplingFields(_Request):
    """The sampling fields every API accepts (Messages and Responses take the ones their
    own API lacks as mtp-serve extras, in `extra_body`). One declaration: `Service.start`
    turns them into the engine's SamplingParams."""

    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[RepetitionPenalty] = None
    seed: Optional[Seed] = None
    ignore_eos: bool = False
    mtp_depth: Optional[int] = Field(default=None, ge=0, le=8)  # MTP drafts per round; 0: off
    speculative: Optional[SpeculativeOptions] = None  # {"copy": false}: no drafts copied from the context
    # reasoning tokens before the server closes the think block (vLLM's name; Messages: thinking.budget_tokens)
    thinking_token_budget: Optional[int] = Field(default=None, ge=1)
    json_schema_mode: Optional[Literal["strict", "relaxed"]] = None  # None: the server's --json-schema-mode


class _OpenAIFields(SamplingFields):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM-style output constraints (server/constraints.py)
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Optional[Union[Dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    @property
    def stop_list(self) -> tuple:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_OpenAIFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    continue_final_message: bool = False  # vLLM's extra: the final assistant message is continued (a prefill)


class CompletionRequest(_OpenAIFields):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0 with echo and logprobs: score the prompt only
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None

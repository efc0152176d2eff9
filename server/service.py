"""What every route shares: the settings, the model, the engine, the chat format, metrics;
and the one way a request starts (`start`, which returns its `Run`).

    svc = Service(loaded, ServerConfig(served_model_name="demo"))
    run = svc.start(request, prompt, req, max_tokens=req.max_tokens, options=Options(prompt_param="messages"))
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import List, Optional

from mtp_serve.engine.engine_loop import EngineLoop, RequestHandle
from mtp_serve.engine.grammar import Constraint, GrammarError
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.context_drafts import MAX_COPY
from mtp_serve.engine.prompt_cache import PromptCacheUnavailable, open_prompt_cache
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.caches import KVSetting
from mtp_serve.models.mlx_lm_compat import hf_tokenizer
from mtp_serve.server.chat import ChatFormat, ChatPrompt
from mtp_serve.server.errors import bad_request, engine_refusals
from mtp_serve.server.images import ImageSettings, capped_spec
from mtp_serve.server.lanes import Lanes, within
from mtp_serve.server.schema_relax import GRAMMAR_SECONDS
from mtp_serve.server.limits import Limits
from mtp_serve.server.metrics import Metrics
from mtp_serve.server.run import Options, Run
from mtp_serve.server.schemas import SamplingFields

log = logging.getLogger("mtp_serve.server")

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: Optional[str] = None
    max_context: Optional[int] = None  # None: the model's max_position_embeddings
    max_queue: int = 64
    max_active: int = 8  # --max-batch-size
    prefill_chunk: int = 512
    mtp_depth: int = 0  # most drafts per round (the policy picks up to it per row); 0 = MTP off
    fixed_depth: bool = False  # draft exactly mtp_depth every round instead
    copy_max: int = MAX_COPY  # --copy-drafts: most tokens a row copies from its context per round; 0: none
    pipeline: bool = True  # plain rounds start the next step's pass before their tokens reach the host (--no-pipelined-decode)
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    chat_template: Optional[str] = None  # a file or template text overriding the checkpoint's
    ping_seconds: float = 15.0  # SSE keep-alive interval
    prompt_cache_bytes: Optional[int] = None  # None: a quarter of the available memory; 0: no prompt cache
    prompt_cache_interval: Optional[int] = None  # tokens between snapshots inside long messages; None: per model; 0: none
    prompt_cache_dir: Optional[str] = None  # the disk tier's folder (None: memory only)
    prompt_cache_disk_bytes: Optional[int] = None  # None: half the free space, at most 16 GiB
    prompt_cache_off: Optional[str] = None  # why the prompt cache is off where the server turned it off itself
    kv_bits: Optional[int] = None  # attention KV quantized to 8 or 4 bits (--kv-bits); None: the compute dtype
    kv_group_size: int = 64  # --kv-group-size: values per scale and bias along the head dimension
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json
    limits: Limits = field(default_factory=Limits)  # request size, counts, nesting (limits.py)
    default_max_tokens: Optional[int] = None  # a request without max_tokens: None = the rest of the context
    max_tokens_over_context: str = "clamp"  # a max_tokens past the context: "clamp" lowers it to fit, "refuse" is a 400
    special_tokens_in_content: bool = False  # parse special tokens in client text (a prompt-injection risk)
    metrics_without_key: bool = False  # with api_key: /metrics stays open to a scraper
    cors_origins: tuple = ()  # --cors-origins: browser origins allowed to call the API ("*": any); none by default
    tokenizer_threads: int = 2  # threads per preparation lane (lanes.py): rendering, tokenizing, images, grammars
    warm_up: bool = False  # before serving: requests through the engine (server/warmup.py); mtp-serve turns it on
    json_schema_mode: str = "relaxed"  # --json-schema-mode: "strict" refuses what the grammar cannot enforce (schema_relax.py)
    images: ImageSettings = field(default_factory=ImageSettings)  # --max-images, --max-image-bytes, ... (images.py)


def model_max_context(config: dict) -> int:
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 32768)


def generation_defaults(path) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json (as vLLM uses them)."""
    try:
        gen = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: gen[k] for k in SAMPLING_DEFAULT_KEYS if isinstance(gen.get(k), (int, float))}


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token's text can have (a bound from its vocabulary strings)."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 1 << 10
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1


class Service:
    def __init__(self, loaded, config: ServerConfig, engine_factory=EngineLoop):
        self.loaded = loaded
        self.config = config
        self.max_context = config.max_context or model_max_context(loaded.config)
        self.tokenizer = hf_tokenizer(loaded.tokenizer)
        self.eos_ids = set(getattr(loaded.tokenizer, "eos_token_ids", None) or ())
        self.max_token_bytes = longest_token_bytes(self.tokenizer)
        self.too_many_prompt_bytes = self.max_context * self.max_token_bytes  # text that cannot fit the context
        loaded.model.use_kv(KVSetting(config.kv_bits, config.kv_group_size))  # before any cache is made
        prompt_cache = self._open_prompt_cache()
        self.engine = engine_factory(loaded.model, loaded.tokenizer, max_queue=config.max_queue, max_active=config.max_active,
                                     prefill_chunk=config.prefill_chunk, prompt_cache=prompt_cache,
                                     policy=DepthPolicy.serving(config.mtp_depth, config.fixed_depth, loaded.card.window_costs),
                                     copy_max=config.copy_max, pipeline=config.pipeline)
        self.chat = ChatFormat(loaded.tokenizer, loaded.card, chat_template=config.chat_template,
                               tool_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser,
                               special_tokens_in_content=config.special_tokens_in_content,
                               vision=getattr(loaded.model, "vision", None),
                               image_settings=config.images)
        self.metrics = Metrics(self.engine)
        # Prompts are checked, rendered and tokenized off the event loop, on a few threads
        # (tokenizers releases the GIL), in two lanes: heavy requests wait behind their own kind.
        self.lanes = Lanes(config.tokenizer_threads)
        vision = getattr(loaded.model, "vision", None)
        spec = capped_spec(vision.spec, config.images.max_image_tokens) if vision is not None else None
        self.min_image_tokens = max(1, spec.min_pixels // spec.factor ** 2) if spec is not None else 1
        self.created = int(time.time())

    def _open_prompt_cache(self):
        """The prompt cache, or None with `prompt_cache_off` saying why (start-up line and /v1/stats)."""
        config = self.config
        self.prompt_cache_off = config.prompt_cache_off
        if self.prompt_cache_off is None and config.prompt_cache_bytes == 0:
            self.prompt_cache_off = "turned off (--prompt-cache-bytes 0)"
        if self.prompt_cache_off is None:
            try:
                cache = open_prompt_cache(self.loaded, config.served_model_name, max_bytes=config.prompt_cache_bytes,
                                          interval=config.prompt_cache_interval, disk_dir=config.prompt_cache_dir,
                                          disk_bytes=config.prompt_cache_disk_bytes)
                if cache is not None:
                    return cache
                self.prompt_cache_off = "no memory was available for it at start-up"
            except PromptCacheUnavailable as e:
                self.prompt_cache_off = f"this model's caches cannot be reused: {e}"
        (log.warning if config.prompt_cache_bytes != 0 else log.info)("prompt cache: off: %s", self.prompt_cache_off)
        return None

    # -- checks

    def check_context(self, n_prompt: int, param: str) -> int:
        """Returns the room left for the completion."""
        if n_prompt >= self.max_context:
            raise bad_request(f"This model's maximum context length is {self.max_context} tokens; the prompt has {n_prompt} tokens",
                              param, "context_length_exceeded")
        if n_prompt == 0:
            raise bad_request("the prompt is empty", param)
        return self.max_context - n_prompt

    def check_constraint(self, c: Constraint) -> None:
        """Compile an output constraint now (a 400 naming the problem), not in the engine; a
        compile past the grammar budget's seconds is refused then, not when it ends (it goes
        on, on a grammar thread, and its result is dropped)."""
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is not None:
            scheduler.grammar_compiler()  # built once per model, before the clock starts
        try:
            within(GRAMMAR_SECONDS, self.engine.check_constraint, c)
        except TimeoutError:
            raise bad_request(f"the {c.kind.replace('_', ' ')} took longer than {GRAMMAR_SECONDS:g}s to compile "
                              "(simplify it: fewer properties or alternatives, bounded repetition)",
                              "response_format", "invalid_constraint") from None
        except GrammarError as e:
            raise bad_request(str(e), "response_format", "invalid_constraint") from e

    def render(self, *args, **kwargs) -> ChatPrompt:
        """`ChatFormat.render`, then the engine's constraint compiled (a 400 naming the problem). Called
        on the tokenizer threads (`run_cpu`), so the engine thread only copies the compiled matcher."""
        prompt = self.chat.render(*args, **kwargs)
        if prompt.engine_constraint is not None:
            self.check_constraint(prompt.engine_constraint)
        return prompt

    def check_prompt_bytes(self, n_bytes: int, n_images: int = 0) -> None:
        """Before any rendering or tokenizing: no token holds more than `max_token_bytes`
        bytes and no image takes fewer than `min_image_tokens`, so a prompt whose text and
        images need more tokens than the context cannot fit."""
        at_least = n_bytes // self.max_token_bytes + n_images * self.min_image_tokens
        if at_least >= self.max_context:
            images = f" and {n_images} images" if n_images else ""
            raise bad_request(f"This model's maximum context length is {self.max_context} tokens; the prompt's "
                              f"{n_bytes} bytes of text{images} are at least {at_least} tokens", None,
                              "context_length_exceeded")

    def max_tokens(self, requested: Optional[int], n_prompt: int, room: int, param: str) -> int:
        """The completion's budget. Without max_tokens: the rest of the context (or
        --default-max-tokens, when smaller). A max_tokens past the context is lowered to fit
        (as LM Studio, Ollama and llama.cpp's server do: agents send 32,000 for any model they
        do not know), or refused with --max-tokens-over-context refuse (vLLM's rule)."""
        if requested is None:
            return min(room, self.config.default_max_tokens or room)
        if requested > room:
            if self.config.max_tokens_over_context == "refuse":
                raise bad_request(f"This model's maximum context length is {self.max_context} tokens; you requested "
                                  f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} for the completion). "
                                  f"Reduce the prompt or the completion length.", param, "context_length_exceeded")
            log.info("%s %d lowered to %d: the prompt's %d tokens leave that much of the %d-token context",
                     param, requested, room, n_prompt, self.max_context)
            self.metrics.max_tokens_lowered.inc()
            return room
        return requested

    # -- runs

    def start(self, request, prompt: ChatPrompt, fields: SamplingFields, *, max_tokens: Optional[int], stop: tuple = (),
              stop_token_ids: tuple = (), logprobs: Optional[int] = None, options: Options = Options(),
              seed_offset: int = 0) -> Run:
        """Check the prompt's length, build the engine's sampling (defaults from the
        checkpoint's generation_config.json) and submit: the request's one `Run`.
        `seed_offset`: choice k of n draws with seed + k (each choice its own, reproducible)."""
        room = self.check_context(len(prompt.ids), options.prompt_param)
        granted = self.max_tokens(max_tokens, len(prompt.ids), room, options.max_tokens_param)
        d = self.config.sampling_defaults
        pick = lambda k, fallback: getattr(fields, k) if getattr(fields, k) is not None else d.get(k, fallback)  # noqa: E731
        top_k = pick("top_k", 0)
        bias = fields.logit_bias_pairs
        vocab = self.loaded.model.vocab_size
        if any(t >= vocab for t, _ in bias):
            raise bad_request(f"logit_bias: token ids must be in [0, {vocab})", "logit_bias")
        try:
            params = SamplingParams(
                temperature=float(pick("temperature", 1.0)),
                top_p=float(pick("top_p", 1.0)),
                top_k=0 if top_k in (None, -1) else int(top_k),
                min_p=float(pick("min_p", 0.0)),
                presence_penalty=float(pick("presence_penalty", 0.0)),
                frequency_penalty=float(pick("frequency_penalty", 0.0)),
                repetition_penalty=float(pick("repetition_penalty", 1.0)),
                seed=None if fields.seed is None else (fields.seed + seed_offset) % (1 << 64),
                max_tokens=granted,
                stop=tuple(stop),
                stop_token_ids=tuple(stop_token_ids),
                ignore_eos=fields.ignore_eos,
                logprobs=logprobs,
                constraint=prompt.engine_constraint,
                copy_drafts=fields.speculative is None or fields.speculative.copy_ is not False,
                logit_bias=bias,
            )
        except ValueError as e:
            raise bad_request(str(e)) from e
        if options.reasoning_budget is None and fields.thinking_token_budget is not None:
            options = replace(options, reasoning_budget=fields.thinking_token_budget)
        run = Run(self, prompt, params, fields.mtp_depth if fields.mtp_depth is not None else self.config.mtp_depth,
                  options, request, started=getattr(request.state, "started", None) or time.perf_counter(),
                  lowered_from=max_tokens if max_tokens is not None and max_tokens > granted else None)
        return run.submit()

    def submit_ids(self, ids, params: SamplingParams, depth: int, checkpoints: tuple = (), images: tuple = ()) -> RequestHandle:
        """`images`: the prompt's PreparedImages, in order (their pad tokens are in `ids`)."""
        with engine_refusals():
            return self.engine.submit(ids, params, depth, checkpoints, images=images)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def engine_job(self, make_steps):
        """Work on the engine thread beside the requests (engine_loop.Job), e.g. scoring a prompt."""
        with engine_refusals():
            return await self.engine.run_job(make_steps)

    async def run_cpu(self, fn, *args):
        """`fn(*args)` on the request's preparation lane (lanes.py)."""
        return await self.lanes.run(fn, *args)

    @lru_cache(maxsize=65536)
    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

"""mtp-serve: the OpenAI-compatible server.

    mtp-serve --model PATH_OR_REPO --enable-mtp
    mtp-serve --model A --model B                  # several models; requests pick one by `model`
    mtp-serve --config examples/claude_code_two_models.toml

Then point an OpenAI client at http://127.0.0.1:8000/v1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from mtp_serve import BACKEND
from mtp_serve.backend import GPU_WINDOWS_NOTE
from mtp_serve.cli import ranks
from mtp_serve.cli.common import OneLineParser, byte_size, fail, origins
from mtp_serve.server.images import ImageSettings
from mtp_serve.server.limits import Limits

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mtp-serve", description="OpenAI-compatible server with lossless MTP speculative decoding.")
    p.add_argument("--model", action="append", help="local directory or Hugging Face repo id (default: the embedded "
                   "demo model); repeat it to serve several models, the first being the default for requests "
                   "without a model (the others load on first use)")
    p.add_argument("--config", metavar="FILE", help="serve the models a TOML file lists, each with its own name, "
                   "aliases, MTP, context, batch size and prompt cache share (examples/claude_code_two_models.toml)")
    p.add_argument("--max-loaded-bytes", type=byte_size, metavar="SIZE",
                   help="with several models: most weight bytes loaded at once; a load past it first unloads the "
                   "least recently used idle unpinned model (default: the machine's memory)")
    p.add_argument("--enable-mtp", action="store_true", help="decode with the checkpoint's MTP head (speculative, lossless)")
    p.add_argument("--mtp-depth", type=int, help="most drafts per round with --enable-mtp (default: the model card's); "
                   "each request's depth is chosen up to it from measured costs and its own acceptance")
    p.add_argument("--fixed-depth", action="store_true", help="draft exactly --mtp-depth tokens every round, and copy drafts "
                   "wherever a copy is expected to emit more than the head, not by measured times (a run repeats exactly)")
    p.add_argument("--copy-drafts", type=int, default=32, metavar="N",
                   help="with MTP on, also draft up to N tokens a round copied from the request's own prompt and output "
                        "where its latest tokens occurred before (exact like every draft; 0: off; a request's "
                        "\"speculative\": {\"copy\": false} turns it off for that request)")
    p.add_argument("--no-pipelined-decode", action="store_true",
                   help="decode plain rounds one after the other (by default a plain round builds and starts the "
                        "next step's pass before its own tokens reach the host; the output is the same)")
    p.add_argument("--draft-vocab", type=int, metavar="N", help="draft from the checkpoint's N most frequent tokens "
                   "(its draft_vocab.json; default: the model card's draft_vocab_size, 0: the whole vocabulary)")
    p.add_argument("--draft-head-bits", type=int, choices=(0, 4, 8), help="draft from the head quantized to 4 or 8 bits "
                   "(default: the model card's draft_head_bits, as mtp-tune chose it; 0: the head as stored)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="model id clients send (default: the model directory's name)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health")
    p.add_argument("--metrics-without-key", action="store_true", help="with --api-key: leave /metrics open to a scraper")
    p.add_argument("--cors-origins", type=origins, action="extend", default=[], metavar="ORIGINS",
                   help="browser origins (scheme://host[:port], comma-separated, or * for any) allowed to call the API "
                   "from their pages: CORS preflights are answered, before the API key check (default: none)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait beyond the free batch slots (then 429)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (continuous batching)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens prefilled per engine step between decode rounds")
    p.add_argument("--max-context", type=int, help="longest prompt plus completion, in tokens (default: the model's)")
    p.add_argument("--prompt-cache-bytes", type=byte_size, metavar="SIZE",
                   help="memory for reusable model state across requests, e.g. 8G (default: a quarter of the memory "
                        "available at start-up; 0 turns the prompt cache off)")
    p.add_argument("--prompt-cache-interval", type=int, metavar="TOKENS",
                   help="also snapshot every TOKENS tokens inside long messages (default: measured per model; 0: only "
                        "at message boundaries)")
    p.add_argument("--prompt-cache-dir", metavar="DIR", help="keep snapshots on disk too, in DIR: they survive restarts")
    p.add_argument("--prompt-cache-disk-bytes", type=byte_size, metavar="SIZE",
                   help="most disk space for --prompt-cache-dir (default: half the free space, at most 16G)")
    p.add_argument("--kv-bits", type=int, choices=(8, 4),
                   help="quantize every attention cache (the backbone's and the MTP head's) to 8 or 4 bits: about "
                        "half / a quarter of the KV bytes of bf16 (a quarter / an eighth of fp32), so the prompt cache "
                        "holds more conversations; MTP stays exact against plain decoding at the same setting "
                        "(default: the compute dtype)")
    p.add_argument("--kv-group-size", type=int, default=64, choices=(32, 64, 128),
                   help="with --kv-bits: values per scale and bias along the head dimension")
    p.add_argument("--quantized-matmul", choices=("exact", "int8"),
                   help="numerics of quantized models' decode matmuls: int8 (each row of x as int8 per 32 values, "
                   "integer sums: faster; the default where every other decode product is row-invariant, i.e. with "
                   "mtp-serve's sgemm shim or without OpenBLAS, so greedy MTP stays token-identical to plain) or exact "
                   "(fp32, MLX's product up to rounding; the default otherwise)")
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", "qwen3_coder", "hermes", "none"))
    p.add_argument("--reasoning-parser", default="auto", choices=("auto", "qwen3", "none"))
    p.add_argument("--chat-template", help="a Jinja chat template file overriding the checkpoint's")
    p.add_argument("--default-max-tokens", type=int, help="completion length of a request without max_tokens "
                   "(default: the rest of the context)")
    p.add_argument("--max-tokens-over-context", default="clamp", choices=("clamp", "refuse"),
                   help="a max_tokens larger than the context leaves after the prompt: lower it to fit (clamp, as LM "
                        "Studio, Ollama and llama.cpp do; agents send 32000) or answer 400 context_length_exceeded "
                        "(refuse, as vLLM does)")
    p.add_argument("--json-schema-mode", default="relaxed", choices=("strict", "relaxed"),
                   help="JSON schemas the grammar cannot fully enforce (uniqueItems, if/then, overlapping oneOf...): "
                        "serve them relaxed and validate the output against the full schema, reported in the "
                        "response's structured_output (relaxed), or refuse them with a 400 (strict); per request: "
                        "json_schema_mode")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="read special tokens (<|im_end|>, ...) in message text as control tokens, not as text")
    limits = Limits()
    p.add_argument("--max-request-bytes", type=int, default=limits.max_request_bytes, help="largest request body (then 413)")
    p.add_argument("--max-messages", type=int, default=limits.max_messages, help="messages (or input items) per request")
    p.add_argument("--max-tools", type=int, default=limits.max_tools, help="tools per request")
    p.add_argument("--max-json-depth", type=int, default=limits.max_json_depth, help="deepest JSON nesting in a request")
    p.add_argument("--max-stop", type=int, default=limits.max_stop, help="stop sequences per request")
    images = ImageSettings()
    p.add_argument("--max-images", type=int, default=images.max_images, help="images per request, all turns together (then 400)")
    p.add_argument("--max-image-bytes", type=byte_size, default=images.max_image_bytes, metavar="SIZE",
                   help="encoded bytes per image, base64 decoded or fetched (default 20M; then 400)")
    p.add_argument("--max-image-pixels", type=int, default=images.max_image_pixels, metavar="N",
                   help="decoded width x height per image, before resizing to the model's bounds (then 400)")
    p.add_argument("--image-fetch-timeout", type=float, default=images.fetch_timeout, metavar="SECONDS",
                   help="time to fetch one http(s) image URL, all of it (then 400)")
    p.add_argument("--image-fetch-allow-hosts", type=allow_hosts, default=(), metavar="HOSTS",
                   help="comma-separated host names, addresses or networks (10.0.0.0/8) image URLs may reach "
                        "though not public; by default loopback, private, link-local, multicast and reserved addresses "
                        "are never fetched (checked on every resolved address and every redirect)")
    p.add_argument("--max-image-tokens", type=int, default=images.max_image_tokens, metavar="N",
                   help="resize larger images down to about N image tokens (default 0: the checkpoint's own bounds; "
                        "on CPU the vision tower's time grows faster than the tokens)")
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: time running requests may take to finish before they end with a final "
                        "error event (and [DONE]); a second signal ends them at once")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    ranks.add_arguments(p)
    return p


def allow_hosts(text: str) -> tuple:
    from mtp_serve.server.image_fetch import parse_allow_hosts

    try:
        return parse_allow_hosts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")

    def error(msg: str) -> int:
        return fail("mtp-serve", msg)

    try:
        more = several_models(args)  # the other models' settings; the first's go into args
    except ValueError as e:
        return error(str(e))
    if args.mtp_depth is not None and not 1 <= args.mtp_depth <= 8:
        return error("--mtp-depth must be between 1 and 8")
    if args.max_loaded_bytes is not None and args.max_loaded_bytes <= 0:
        return error("--max-loaded-bytes must be more than 0")
    if args.shutdown_grace < 0:
        return error("--shutdown-grace must be 0 or more")
    if args.image_fetch_timeout <= 0:
        return error("--image-fetch-timeout must be more than 0")
    if args.max_queue < 1:
        return error("--max-queue must be at least 1")
    if args.max_batch_size < 1 or args.prefill_chunk < 1:
        return error("--max-batch-size and --prefill-chunk must be at least 1")
    if args.max_context is not None and args.max_context < 2:
        return error("--max-context must be at least 2")
    small = [f for f in ("max_request_bytes", "max_messages", "max_tools", "max_json_depth", "max_stop", "default_max_tokens")
             if getattr(args, f) is not None and getattr(args, f) < 1]
    if small:
        return error(f"--{small[0].replace('_', '-')} must be at least 1")
    if args.prompt_cache_interval is not None and args.prompt_cache_interval < 0:
        return error("--prompt-cache-interval must be 0 or more")
    if args.copy_drafts < 0:
        return error("--copy-drafts must be 0 or more")
    if args.prompt_cache_disk_bytes is not None and not args.prompt_cache_dir:
        return error("--prompt-cache-disk-bytes needs --prompt-cache-dir")
    if args.prompt_cache_dir:
        try:
            Path(args.prompt_cache_dir).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return error(f"--prompt-cache-dir: {e}")
    if args.chat_template is not None:
        import os

        if not os.path.isfile(args.chat_template):
            return error(f"--chat-template: no such file: {args.chat_template}")

    if args.quantized_matmul:
        from mtp_serve import quantized_matmul

        quantized_matmul.set_numerics(args.quantized_matmul)

    import uvicorn

    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import CheckpointError, load_model
    from mtp_serve.models.sharding import ShardingError
    from mtp_serve.server.app import create_app
    from mtp_serve.server.service import ServerConfig, generation_defaults

    group = ranks.distributed_ranks(args)  # launched by mlx.launch with several ranks, else None
    if group is not None and more:
        return error("several models (--model given twice, or --config) cannot be served across mlx.launch ranks: "
                     "start one group per model")
    if group is not None:
        refused = ranks.prompt_cache_refusal(args)
        if refused:
            return error(refused)
        args.prompt_cache_bytes = 0
    from mtp_serve.cli.progress import hub_progress, stage

    hub_progress()  # download bars on a terminal only
    try:
        model_path = args.model or default_model_path()
        load_started = time.perf_counter()
        with stage(f"loading {model_path}"):
            loaded = load_model(model_path, enable_mtp=args.enable_mtp, draft_vocab=args.draft_vocab,
                                draft_head_bits=args.draft_head_bits,
                                split=group.split if group else None)
    except FileNotFoundError as e:
        return error(str(e))
    except (CheckpointError, ShardingError) as e:
        return error(str(e))
    load_seconds = time.perf_counter() - load_started
    if group is not None:
        group.announce(loaded)
        if group.rank != 0:
            return group.follow(loaded)

    depth = 0
    if loaded.model.has_mtp:
        depth = args.mtp_depth or loaded.card.default_mtp_depth
        mtp = (f"MTP on, depth {depth}, {loaded.model.drafts_note()}" if depth else
               "MTP off by default: mtp-tune found it slower on this machine (mtp_serve.json default_mtp_depth 0; "
               "--mtp-depth K or a request's mtp_depth turns it on)")
    elif args.enable_mtp:
        mtp = loaded.mtp_status.replace("MTP off:", "MTP off (requested with --enable-mtp, but") + ")"
    else:
        mtp = "MTP off (start with --enable-mtp to use the model's MTP head)" if "no mtp" not in loaded.mtp_status.lower() else loaded.mtp_status
    from mtp_serve.models.caches import KVSetting

    try:
        KVSetting(args.kv_bits, args.kv_group_size).check([loaded.model.text.args.head_dim])
    except ValueError as e:
        return error(str(e))
    is_repo_id = bool(args.model) and not Path(args.model).expanduser().exists()
    name = args.served_model_name or (args.model if is_repo_id else loaded.path.name)
    config = ServerConfig(
        served_model_name=name,
        api_key=args.api_key,
        max_context=args.max_context,
        max_queue=args.max_queue,
        max_active=args.max_batch_size,
        prefill_chunk=args.prefill_chunk,
        mtp_depth=depth,
        fixed_depth=args.fixed_depth,
        copy_max=args.copy_drafts,
        pipeline=not args.no_pipelined_decode,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=args.chat_template,
        prompt_cache_bytes=args.prompt_cache_bytes,
        prompt_cache_interval=args.prompt_cache_interval,
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
        prompt_cache_off=ranks.PROMPT_CACHE_OFF if group is not None else None,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        sampling_defaults=generation_defaults(loaded.path),
        limits=Limits(max_request_bytes=args.max_request_bytes, max_messages=args.max_messages, max_tools=args.max_tools,
                      max_json_depth=args.max_json_depth, max_stop=args.max_stop),
        images=ImageSettings(max_images=args.max_images, max_image_bytes=args.max_image_bytes,
                             max_image_pixels=args.max_image_pixels, fetch_timeout=args.image_fetch_timeout,
                             max_image_tokens=args.max_image_tokens, fetch_allow_hosts=args.image_fetch_allow_hosts),
        default_max_tokens=args.default_max_tokens,
        max_tokens_over_context=args.max_tokens_over_context,
        special_tokens_in_content=args.allow_special_tokens_in_content,
        json_schema_mode=args.json_schema_mode,
        metrics_without_key=args.metrics_without_key,
        cors_origins=tuple(dict.fromkeys(args.cors_origins)),
        warm_up=group is None,  # across ranks every rank takes part in the warm-up rounds below instead
    )
    try:
        if more or args.aliases or args.max_loaded_bytes is not None:
            from mtp_serve.server.models_registry import Models

            models = Models.serving(loaded, config, more=[spec(m, config) for m in more], aliases=args.aliases,
                                    max_loaded_bytes=args.max_loaded_bytes, load_seconds=load_seconds)
            problem = models.budget_problem()
            if problem:
                budget = (f"--config {args.config}: [server].max_loaded_bytes" if args.config and args.budget_from_config
                          else "--max-loaded-bytes")
                return error(f"{budget}: {problem}")
            app = create_app(loaded, config, models=models)
        else:
            app = create_app(loaded, config, **({"engine_factory": group.engine_factory()} if group else {}))
    except OSError as e:  # the prompt cache's folder
        return error(f"--prompt-cache-dir: {e}")
    except ValueError as e:  # a name given twice
        return error(str(e))
    app.state.config_file = args.config
    fail_start_in_one_line(app)
    svc = app.state.service
    print(f"mtp-serve: serving {name} ({loaded.path}) at http://{args.host}:{args.port}/v1; {mtp}; "
          f"tools {svc.chat.tool_parser}, reasoning {svc.chat.reasoning_parser}, context {svc.max_context}; "
          f"KV {loaded.model.kv} ({loaded.model.kv_bytes_per_token():,} bytes a token"
          f"{'; ' + loaded.model.kv_attention() if loaded.model.kv.quantized else ''}); "
          f"{loaded.model.memory_note()}{BACKEND.note}", flush=True)
    for card in app.state.models.cards()[1:]:
        print(f"mtp-serve: also serving {card['id']}{' (aliases ' + ', '.join(card['aliases']) + ')' if card['aliases'] else ''} "
              f"({card['root'] or 'the demo model'}): {'loaded now' if card['loaded'] else 'loads on first use'}", flush=True)
    print(f"mtp-serve: web page (playground, live charts, MTP off/on side by side) at http://{args.host}:{args.port}/",
          flush=True)
    if depth and not BACKEND.exact_windows:
        print(f"mtp-serve: warning: {GPU_WINDOWS_NOTE}", flush=True)
    if loaded.mtp_fix:
        print(f"mtp-serve: this model has no MTP head; add it (lossless speculative decoding) with:\n  {loaded.mtp_fix}",
              flush=True)
    from mtp_serve.engine.warmup import calibrate_blas_threads, decode_matmuls_note, warm_up

    log = logging.getLogger("mtp_serve")
    log.info("warming up the decode paths (the first run on a machine also compiles kernels)")
    if group is not None:  # every rank takes part; a failure here ends the group
        log.info("warm-up on %d ranks took %.1fs", group.link.size, svc.engine.warm_up(depth))
    else:
        try:
            with stage("warming up the decode paths (compiling kernels on a first start)"):
                log.info("warm-up took %.1fs", warm_up(loaded.model, loaded.tokenizer, depth))
            with stage("timing decode matmuls on one thread and on all"):
                threads = calibrate_blas_threads(loaded.model, loaded.tokenizer, depth)
            log.info("%s (measured)", decode_matmuls_note(threads))
        except Exception as e:  # noqa: BLE001 - a failed warm-up is not fatal: the first request pays instead
            log.warning("warm-up failed (%s: %s); serving anyway", type(e).__name__, e)
    if group is not None:
        return group.serve(app, svc.engine, args.host, args.port, args.log_level)
    return serve_until_stopped(app, args.host, args.port, args.log_level, args.shutdown_grace)


def several_models(args) -> list:
    """--model given more than once, or --config: the first model's settings go into `args`
    (the single-model path serves it as before); returns the others' (dicts of
    models_config.MODEL_KEYS), empty with one model."""
    from mtp_serve.cli import models_config

    paths = args.model or []
    args.aliases = ()
    args.budget_from_config = False
    if args.config:
        if paths:
            raise ValueError("--config and --model: list the models in one place")
        try:
            f = models_config.read_config(args.config)
        except models_config.ConfigError as e:
            raise ValueError(f"--config {args.config}: {e}") from None
        models = f.models
        args.budget_from_config = args.max_loaded_bytes is None and f.max_loaded_bytes is not None
        if args.max_loaded_bytes is None:
            args.max_loaded_bytes = f.max_loaded_bytes
        if args.prompt_cache_bytes is None:
            args.prompt_cache_bytes = f.prompt_cache_bytes
    else:
        models = [{"path": p} for p in paths]
        for p in paths[1:]:  # the first is loaded at once, which names a missing one
            try:
                models_config.check_path(p, "--model")
            except models_config.ConfigError as e:
                raise ValueError(str(e)) from None
    args.model = models[0].get("path") if models else None
    for m in models[1:]:  # the command line's flags are every model's defaults
        m.setdefault("mtp", args.enable_mtp)
        m.setdefault("mtp_depth", args.mtp_depth)
        m.setdefault("draft_vocab", args.draft_vocab)
        m.setdefault("draft_head_bits", args.draft_head_bits)
        if "name" not in m:
            p = m.get("path")
            m["name"] = (p if p and not Path(p).expanduser().exists() else Path(p).expanduser().resolve().name) if p else "demo"
    if len(models) > 1 and args.prompt_cache_bytes != 0:  # the budget is shared out (default: one model's)
        from mtp_serve.engine.prompt_cache.setup import MEMORY_SHARE, available_memory

        total = args.prompt_cache_bytes if args.prompt_cache_bytes is not None else int(available_memory() * MEMORY_SHARE)
        for m, part in zip(models, models_config.prompt_cache_parts(models, total)):
            m["prompt_cache_bytes"] = part
    if models:  # the first model's keys override the flags
        for key, flag in (("name", "served_model_name"), ("mtp", "enable_mtp"), ("mtp_depth", "mtp_depth"),
                          ("draft_vocab", "draft_vocab"), ("draft_head_bits", "draft_head_bits"), ("max_context", "max_context"),
                          ("max_batch_size", "max_batch_size"), ("max_queue", "max_queue"),
                          ("prompt_cache_bytes", "prompt_cache_bytes")):
            if key in models[0]:
                setattr(args, flag, models[0][key])
        args.aliases = tuple(models[0].get("aliases", ()))
    return models[1:]


def spec(m, config):
    """A ModelSpec for one of the other models, on the default model's settings."""
    from dataclasses import replace

    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.server.models_registry import ModelSpec

    c = replace(config, served_model_name=m["name"], max_context=m.get("max_context", config.max_context),
                max_active=m.get("max_batch_size", config.max_active), max_queue=m.get("max_queue", config.max_queue),
                prompt_cache_bytes=m.get("prompt_cache_bytes", config.prompt_cache_bytes), sampling_defaults={},
                mtp_depth=0, warm_up=False)
    return ModelSpec(m["name"], m.get("path") or default_model_path(), c, aliases=tuple(m.get("aliases", ())), enable_mtp=bool(m["mtp"]),
                     mtp_depth=m["mtp_depth"], draft_vocab=m["draft_vocab"],
                     draft_head_bits=m["draft_head_bits"], pinned=bool(m.get("pinned")))


def fail_start_in_one_line(app) -> None:
    """A pinned model that fails to load at start ends the process with one line and status 1
    (as every other start-up error), not the lifespan's traceback and uvicorn's status 3."""
    import os
    from contextlib import asynccontextmanager

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        try:
            context = inner(a)
            await context.__aenter__()
        except RuntimeError as e:
            where = f"--config {a.state.config_file}: " if getattr(a.state, "config_file", None) else ""
            fail("mtp-serve", where + " ".join(str(e).split()))
            logging.shutdown()
            sys.stderr.flush()
            os._exit(1)
        try:
            yield
        finally:
            await context.__aexit__(None, None, None)

    app.router.lifespan_context = lifespan


class _Stopped(Exception):
    """Ctrl-C or SIGTERM, raised where uvicorn hands the signal back after its graceful shutdown."""


def _stopped(signum, frame):
    raise _Stopped(signum)


def serve_until_stopped(app, host: str, port: int, log_level: str, grace: float = 10.0) -> int:
    """Serve until Ctrl-C or SIGTERM; after the drain (server/shutdown.py: running requests
    finish within `grace` seconds, then end with their API's final events; then the app's
    lifespan: the engine stops, the disk cache flushes within its bound) exit with status 0.

    uvicorn re-raises the signal it caught once it has shut down (so the process would die of
    SIGTERM, or raise KeyboardInterrupt into the interpreter's teardown); our handlers, which
    it restores before re-raising, turn that into a normal return. The process then ends with
    `os._exit`: at interpreter teardown a native thread still joinable below Python (not pinned
    to a library; the engine thread is joined by then) aborted the process ("terminate called
    without an active exception", status 134), and nothing is left to clean up once the
    lifespan has run."""
    import os
    import signal

    import uvicorn

    from mtp_serve.server.shutdown import DrainingServer

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level),
                            end_requests=app.state.models.stop_engines, grace=grace)
    try:
        server.run()
    except (_Stopped, KeyboardInterrupt):
        pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if server.started else 1)  # not started: the port was taken (uvicorn said so)


if __name__ == "__main__":
    sys.exit(main())

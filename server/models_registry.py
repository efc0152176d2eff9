"""Several models behind one server: a `Service` per served model, loaded on first use (or at
start when pinned), unloaded least-recently-used when a load would pass the weights budget.

    models = Models([ModelSpec("main", path_a, config_a, pinned=True), ModelSpec("fast", path_b, config_b,
                     aliases=("claude-haiku-4-5",))], max_loaded_bytes=32 << 30)
    svc = await service_for(request, req.model)   # in a route: the model's ready Service (404 if unknown)

Each loaded model has its own `EngineLoop` thread (its batch, depth policy, prompt cache):
requests to two models run concurrently, and one engine's failure fails only its own
requests. The loops share the machine's cores (on the CPU back end two busy loops compete
for them; an idle loop waits on its queue and costs nothing).

A request holds a lease on its model from routing until its response has been sent (the
`LeaseMiddleware`): a model with leases, waiters or engine work is never unloaded. Loads
run one at a time, off the event loop; requests for a model that is loading wait (at most
its --max-queue of them, then 429).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mtp_serve.engine.engine_loop import EngineLoop
from mtp_serve.server.errors import APIError
from mtp_serve.server.limits import check_prompt_bytes
from mtp_serve.server.service import ServerConfig, Service, generation_defaults, model_max_context

log = logging.getLogger("mtp_serve.models")


def machine_memory() -> int:
    """Physical memory: the default weights budget (--max-loaded-bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(loaded) -> int:
    """Bytes the loaded model's parameters take."""
    from mlx.utils import tree_flatten

    m = loaded.model
    arrays = {id(v): v for mod in (m.model, m.head) if mod is not None for _, v in tree_flatten(mod.parameters())}
    return sum(v.nbytes for v in arrays.values())


def estimated_bytes(path: Optional[str]) -> Optional[int]:
    """Before a first load: the checkpoint's safetensors files (None when not a local folder)."""
    if not path:
        return None
    folder = Path(path).expanduser()
    files = list(folder.glob("*.safetensors")) if folder.is_dir() else []
    return sum(f.stat().st_size for f in files) or None


def gib(n: int) -> str:
    """A byte count as messages show it, in the largest unit that keeps it at 1 or more (GiB at most)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"


@dataclass
class ModelSpec:
    """One served model. `config` holds its Service settings (its served_model_name is the
    name); `mtp_depth` None: the model card's default when the head loads."""

    name: str
    path: Optional[str]  # None: the embedded demo model
    config: ServerConfig
    aliases: Sequence[str] = ()
    enable_mtp: bool = False
    mtp_depth: Optional[int] = None
    draft_vocab: Optional[int] = None
    draft_head_bits: Optional[int] = None
    pinned: bool = False

    def __post_init__(self):
        self.config = replace(self.config, served_model_name=self.name)


@dataclass
class Entry:
    spec: ModelSpec
    service: Optional[Service] = None
    bytes: Optional[int] = None  # measured at the last load, else estimated from the files
    last_used: float = 0.0
    leases: int = 0  # requests routed here whose responses are not finished
    waiting: int = 0  # requests waiting for this model's load
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0
    unload_seconds: float = 0.0
    requests: int = 0
    retired_tokens: Dict[str, float] = field(default_factory=lambda: {"prompt": 0.0, "completion": 0.0})

    @property
    def name(self) -> str:
        return self.spec.name

    def idle(self) -> bool:
        svc = self.service
        return (self.leases == 0 and self.waiting == 0 and svc is not None
                and svc.engine.queue_depth == 0 and svc.engine.active_count == 0)


class Models:
    def __init__(self, specs: List[ModelSpec], *, max_loaded_bytes: Optional[int] = None,
                 engine_factory: Callable = EngineLoop, loader: Optional[Callable] = None):
        if not specs:
            raise ValueError("no model to serve")
        self.entries = [Entry(s, bytes=estimated_bytes(s.path)) for s in specs]
        self.by_name: Dict[str, Entry] = {}
        for e in self.entries:
            for n in (e.name, *e.spec.aliases):
                if n in self.by_name:
                    raise ValueError(f"the model name '{n}' is given twice")
                self.by_name[n] = e
        self.max_loaded_bytes = max_loaded_bytes or machine_memory()
        self.engine_factory = engine_factory
        self.loader = loader
        self.lock: Optional[asyncio.Lock] = None  # made on the serving event loop
        self.started = False

    @classmethod
    def serving(cls, loaded, config: ServerConfig, engine_factory: Callable = EngineLoop,
                more: Sequence[ModelSpec] = (), aliases: Sequence[str] = (), load_seconds: float = 0.0,
                **kw) -> "Models":
        """The default model, already loaded (and pinned; `load_seconds` it took), then `more` to load on use."""
        first = ModelSpec(config.served_model_name, str(loaded.path), config, aliases=tuple(aliases), pinned=True)
        models = cls([first, *more], engine_factory=engine_factory, **kw)
        e = models.entries[0]
        e.service = Service(loaded, config, engine_factory)
        e.bytes, e.loads, e.load_seconds = weights_bytes(loaded), 1, load_seconds
        return models

    @property
    def default(self) -> Entry:
        return self.entries[0]

    @property
    def names(self) -> List[str]:
        return [e.name for e in self.entries]

    def budget_problem(self) -> Optional[str]:
        """Why the weights budget cannot work: a model that alone needs more than it, or pinned
        models that together do (None when it can; sizes estimated from the files until loaded)."""
        for e in self.entries:
            if e.bytes and e.bytes > self.max_loaded_bytes:
                return (f"the model '{e.name}' needs {gib(e.bytes)} of weights, more than the budget of "
                        f"{gib(self.max_loaded_bytes)}")
        pinned = [e for e in self.entries if e.spec.pinned]
        need = sum(e.bytes or 0 for e in pinned)
        if need > self.max_loaded_bytes:
            return (f"the pinned models ({', '.join(repr(e.name) for e in pinned)}) need {gib(need)} of weights "
                    f"together, more than the budget of {gib(self.max_loaded_bytes)}")
        return None

    def used_bytes(self) -> int:
        return sum(e.bytes or 0 for e in self.entries if e.service is not None)

    # -- routing

    def lookup(self, name: Optional[str]) -> Entry:
        if not name:
            return self.default
        e = self.by_name.get(name)
        if e is None:
            e = next((x for x in self.entries if x.service is not None and name == str(x.service.loaded.path)), None)
        if e is None:
            served = ", ".join(f"'{n}'" for n in self.by_name)
            raise APIError(404, f"The model '{name}' does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return e

    async def acquire(self, name: Optional[str], leases: Optional[list] = None) -> Service:
        """The model's ready Service, loading it first when needed; a lease is taken (and
        appended to `leases`, for `release`) before this returns, so it cannot unload under
        the request."""
        e = self.lookup(name)
        e.last_used = time.monotonic()
        if e.service is None:
            if e.waiting >= e.spec.config.max_queue:
                raise APIError(429, f"too many requests are waiting for the model '{e.name}' to load", code="queue_full",
                               headers={"Retry-After": "1"})
            e.waiting += 1
            try:
                while e.service is None:
                    async with self._lock():
                        if e.service is None:
                            await self._load(e)
            finally:
                e.waiting -= 1
        e.leases += 1
        e.requests += 1
        e.last_used = time.monotonic()
        if leases is not None:
            leases.append(e)
        return e.service

    @staticmethod
    def release(e: Entry) -> None:
        e.leases -= 1
        e.last_used = time.monotonic()

    def _lock(self) -> asyncio.Lock:
        if self.lock is None:
            self.lock = asyncio.Lock()
        return self.lock

    # -- loading and unloading

    async def _load(self, e: Entry) -> None:
        """Make room (least recently used idle unpinned models first), then load `e` on a thread."""
        need = e.bytes or 0
        if need > self.max_loaded_bytes:
            raise APIError(400, f"The model '{e.name}' needs {gib(need)} of weights; the server's budget "
                           f"(--max-loaded-bytes) is {gib(self.max_loaded_bytes)}: it cannot be loaded",
                           param="model", code="model_too_large")
        while self.used_bytes() + need > self.max_loaded_bytes:
            idle = [x for x in self.entries if x is not e and not x.spec.pinned and x.idle()]
            if not idle:
                busy = ", ".join(f"'{x.name}'" for x in self.entries if x.service is not None)
                raise APIError(503, f"The model '{e.name}' ({gib(need)}) does not fit beside the loaded models ({busy}: "
                               f"{gib(self.used_bytes())} of {gib(self.max_loaded_bytes)}), which are pinned or busy; "
                               "retry later", code="model_budget_busy", headers={"Retry-After": "5"})
            await self._unload(min(idle, key=lambda x: x.last_used), f"to make room for '{e.name}'")
        t0 = time.perf_counter()
        log.info("loading model '%s' (%s)", e.name, e.spec.path or "the demo model")
        try:
            svc = await asyncio.to_thread(self._build, e)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - this model's requests fail, the others go on
            log.error("model '%s' failed to load: %s: %s", e.name, type(exc).__name__, exc)
            raise APIError(503, f"The model '{e.name}' failed to load: {exc}", code="model_load_failed") from exc
        # HTTP requests by route and status stay one server-wide count (/metrics renders the
        # default model's registry; each model's own figures are the mtp_model_* families)
        if self.default.service is not None:
            svc.metrics.requests = self.default.service.metrics.requests
        svc.engine.start()
        e.service, e.bytes = svc, weights_bytes(svc.loaded)
        e.loads += 1
        e.load_seconds += time.perf_counter() - t0
        log.info("model '%s' loaded in %.2fs (%s of weights; %s of %s loaded)", e.name, time.perf_counter() - t0,
                 gib(e.bytes), gib(self.used_bytes()), gib(self.max_loaded_bytes))

    def _build(self, e: Entry) -> Service:
        from mtp_serve.models.demo_model import default_model_path
        from mtp_serve.models.loader import load_model

        s = e.spec
        loaded = (self.loader or load_model)(s.path or default_model_path(), enable_mtp=s.enable_mtp,
                                             draft_vocab=s.draft_vocab,
                                             draft_head_bits=s.draft_head_bits)
        depth = (s.mtp_depth or loaded.card.default_mtp_depth) if loaded.model.has_mtp else 0
        config = replace(s.config, mtp_depth=depth, sampling_defaults=s.config.sampling_defaults or generation_defaults(loaded.path))
        return Service(loaded, config, self.engine_factory)

    async def _unload(self, e: Entry, why: str) -> None:
        t0 = time.perf_counter()
        svc, e.service = e.service, None
        m = svc.metrics
        e.retired_tokens["prompt"] += m.prompt_tokens._value.get()
        e.retired_tokens["completion"] += m.completion_tokens._value.get()
        await asyncio.to_thread(self._close, svc)  # the engine thread's join; the disk tier flushes
        del svc, m
        gc.collect()
        try:
            import mlx.core as mx

            mx.clear_cache()
        except (ImportError, AttributeError):
            pass
        e.unloads += 1
        e.unload_seconds += time.perf_counter() - t0
        log.info("model '%s' unloaded %s (%.2fs; %s of %s loaded now)", e.name, why, time.perf_counter() - t0,
                 gib(self.used_bytes()), gib(self.max_loaded_bytes))

    @staticmethod
    def _close(svc: Service) -> None:
        svc.engine.stop()
        svc.lanes.shutdown()

    async def start(self) -> None:
        """Start the loaded models' engines, then load the pinned ones."""
        self.started = True
        for e in self.entries:
            if e.service is not None and not e.service.engine.running:
                e.service.engine.start()
        for e in self.entries:
            if e.spec.pinned and e.service is None:
                async with self._lock():
                    try:
                        await self._load(e)
                    except APIError as exc:  # a pinned model that cannot load stops the start-up, saying why
                        raise RuntimeError(f"pinned model '{e.name}': {exc.message}") from None

    def stop(self) -> None:
        for e in self.entries:
            if e.service is not None:
                self._close(e.service)

    def stop_engines(self) -> None:
        """End every loaded model's requests now (a draining shutdown's last step): each fails
        with EngineStopped, which its response turns into the API's final events."""
        for e in self.entries:
            if e.service is not None:
                e.service.engine.stop()

    # -- what is served

    def card(self, e: Entry) -> dict:
        s, svc = e.spec, e.service
        if svc is not None:
            context, path = svc.max_context, str(svc.loaded.path)
            mtp = {"enabled": svc.loaded.model.has_mtp and svc.config.mtp_depth > 0, "depth_cap": svc.config.mtp_depth,
                   "status": svc.loaded.mtp_status}
        else:
            context, path = s.config.max_context, s.path
            if context is None and s.path:
                try:
                    context = model_max_context(json.loads((Path(s.path).expanduser() / "config.json").read_text()))
                except (OSError, ValueError):
                    pass
            mtp = {"enabled": s.enable_mtp, "depth_cap": s.mtp_depth, "status": "not loaded"}
        return {"id": e.name, "object": "model", "created": svc.created if svc else 0, "owned_by": "mtp-serve",
                "root": path, "max_model_len": context, "aliases": list(s.aliases), "loaded": svc is not None,
                "pinned": s.pinned, "weights_bytes": e.bytes, "mtp": mtp}

    def cards(self) -> List[dict]:
        return [self.card(e) for e in self.entries]


class ModelsCollector:
    """Per-model figures for /metrics (labelled `model`): loaded or not, weight bytes, loads,
    unloads, load and unload seconds, requests routed, tokens (across reloads)."""

    def __init__(self, models: Models):
        self.models = models

    def collect(self):
        fam = {
            "loaded": GaugeMetricFamily("mtp_model_loaded", "1 when the model is loaded", labels=["model"]),
            "bytes": GaugeMetricFamily("mtp_model_weights_bytes", "The model's weight bytes (measured at its last load, "
                                       "else estimated from its files)", labels=["model"]),
            "loads": CounterMetricFamily("mtp_model_loads", "Model loads", labels=["model"]),
            "unloads": CounterMetricFamily("mtp_model_unloads", "Model unloads (to make room under --max-loaded-bytes)",
                                           labels=["model"]),
            "load_s": CounterMetricFamily("mtp_model_load_seconds", "Time spent loading the model", labels=["model"]),
            "unload_s": CounterMetricFamily("mtp_model_unload_seconds", "Time spent unloading the model", labels=["model"]),
            "requests": CounterMetricFamily("mtp_model_requests", "Requests routed to the model", labels=["model"]),
            "prompt": CounterMetricFamily("mtp_model_prompt_tokens", "Prompt tokens the model processed", labels=["model"]),
            "completion": CounterMetricFamily("mtp_model_completion_tokens", "Completion tokens the model generated",
                                              labels=["model"]),
        }
        budget = GaugeMetricFamily("mtp_max_loaded_bytes", "The weights budget (--max-loaded-bytes)",
                                   value=self.models.max_loaded_bytes)
        for e in self.models.entries:
            svc, lab = e.service, [e.name]
            fam["loaded"].add_metric(lab, 1 if svc is not None else 0)
            fam["bytes"].add_metric(lab, e.bytes or 0)
            fam["loads"].add_metric(lab, e.loads)
            fam["unloads"].add_metric(lab, e.unloads)
            fam["load_s"].add_metric(lab, e.load_seconds)
            fam["unload_s"].add_metric(lab, e.unload_seconds)
            fam["requests"].add_metric(lab, e.requests)
            live = svc.metrics if svc is not None else None
            fam["prompt"].add_metric(lab, e.retired_tokens["prompt"] + (live.prompt_tokens._value.get() if live else 0))
            fam["completion"].add_metric(lab, e.retired_tokens["completion"]
                                         + (live.completion_tokens._value.get() if live else 0))
        yield budget
        yield from fam.values()


class LeaseMiddleware:
    """Releases the leases a request took on its models once its response (a stream's last
    byte included) has been sent, or the request has failed."""

    def __init__(self, app, models: Models):
        self.app = app
        self.models = models

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        leases = scope["mtp_leases"] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for e in leases:
                self.models.release(e)


async def service_for(request, name: Optional[str]) -> Service:
    """The route's one call: the Service serving `name` (the default model when empty), ready, with
    the request's prompt size checked against that model's context."""
    models: Models = request.app.state.models
    svc = await models.acquire(name, request.scope.get("mtp_leases"))
    check_prompt_bytes(request, svc)
    return svc

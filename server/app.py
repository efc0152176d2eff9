"""The HTTP front end: the app, its service, and the routers of each API.

    app = create_app(loaded_model, ServerConfig(served_model_name="demo"))

Routes live with their API (`openai_api.py`, `anthropic_api.py`, `responses_api.py`); they share the `Service`
(`service.py`), which starts each request's `Run` (`run.py`). Errors leave
through `errors.py`. Before a route runs: the API key (`auth.py`, before the body
is read), the body's size (`limits.py`), then the request limits
(`limits.py`, on the parsed JSON, before validation). With `--cors-origins`, CORS
(preflights, Access-Control-Allow-Origin) comes before all of them.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from mtp_serve.engine.engine_loop import EngineLoop
from mtp_serve.server import anthropic_api, openai_api, responses_api, responses_store, stats_api, web_page
from mtp_serve.server.auth import APIKeyMiddleware
from mtp_serve.server.errors import error_body, install_error_handlers
from mtp_serve.server.limits import BodyLimitMiddleware, check_request
from mtp_serve.server.models_registry import LeaseMiddleware, Models, ModelsCollector
from mtp_serve.server.openapi import install_openapi
from mtp_serve.server.service import ServerConfig
from mtp_serve.server.warmup import warm_up

log = logging.getLogger("mtp_serve")


def create_app(loaded, config: ServerConfig, engine_factory=EngineLoop, models: Optional[Models] = None) -> FastAPI:
    """`engine_factory` builds the engine (with EngineLoop's arguments); serving across
    ranks passes rank 0's `DistributedEngine`. `models`: several served models
    (`Models.serving(loaded, config, more=...)`, `models_registry.py`); without it, `loaded` alone."""
    models = models or Models.serving(loaded, config, engine_factory)
    svc = models.default.service  # the default model's: warm-up, /health, /v1/stats, the web page
    svc.metrics.registry.register(ModelsCollector(models))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await models.start()
        if config.warm_up:  # /health answers only after it: the first request then runs warm
            try:
                report = await warm_up(svc)
                log.info(report.line())
            except Exception as e:  # noqa: BLE001 - not fatal: the first requests pay instead
                log.warning("warm-up through the engine failed (%s: %s); serving anyway", type(e).__name__, e)
        try:
            yield
        finally:
            models.stop()

    app = FastAPI(title="mtp-serve", lifespan=lifespan)
    app.state.service = svc
    app.state.models = models
    install_error_handlers(app, on_error=lambda request, status: svc.metrics.request(request.scope, status))
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.limits.max_request_bytes, on_reject=svc.metrics.request)
    if config.api_key:  # added last: runs first
        # The page's static files are open (a browser cannot send a bearer header when it navigates);
        # every call the page makes for data sends the key it was given (web_page.py).
        open_paths = {"/health", "/"} | web_page.OPEN_PATHS | ({"/metrics"} if config.metrics_without_key else set())
        app.add_middleware(APIKeyMiddleware, key=config.api_key, open_paths=open_paths, on_reject=svc.metrics.request)
    app.add_middleware(LeaseMiddleware, models=models)
    if config.cors_origins:  # added last: outermost, so a preflight is answered before the API key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], max_age=600)
    app.state.response_store = responses_store.ResponseStore()
    for api in (openai_api, anthropic_api, responses_api, responses_store):
        app.include_router(api.router, dependencies=[Depends(check_request)])
    app.include_router(stats_api.router)
    app.include_router(web_page.router)

    @app.get("/health")
    async def health():
        if not svc.engine.running:
            return JSONResponse(error_body("engine is not running", "service_unavailable"), status_code=503)
        return {"status": "ok", "model": config.served_model_name, "mtp": loaded.mtp_status,
                "queue_depth": svc.engine.queue_depth, "active": svc.engine.active_count}

    def describe():
        return {"object": "server", "name": "mtp-serve", "model": config.served_model_name,
                "models": models.names, "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/models",
                              "/v1/stats", "/health", "/metrics", "/ui"]}

    @app.get("/", responses=web_page.ROOT_RESPONSES)
    async def root(request: Request):
        """What answers `GET /`: the web page for a browser (an Accept header naming text/html), else the
        server and its model as JSON (clients such as Claude Code probe it)."""
        return web_page.index() if web_page.wants_html(request) else describe()

    @app.head("/", include_in_schema=False)
    async def root_head():
        return describe()

    @app.get("/metrics", response_class=Response)
    async def metrics():
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        """Every served model, loaded or not, with its context and MTP state."""
        return {"object": "list", "data": models.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        return models.card(models.lookup(model_id))

    install_openapi(app)
    return app

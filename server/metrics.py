"""Prometheus metrics (prometheus-client), one registry per app.

Requests are labelled with their route's template (`/v1/models/{model_id:path}`),
never the raw path, and every path no route serves with `unmatched`: the number
of series stays bounded whatever clients request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import Match
from starlette.types import Scope

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
UNMATCHED = "unmatched"


def route_label(scope: Scope) -> str:
    """The template of the route serving this request (found again when it was answered
    before routing, e.g. a 401 from the API-key check), or `unmatched`."""
    route = scope.get("route")
    if route is None:
        for candidate in getattr(getattr(scope.get("app"), "router", None), "routes", ()):
            if candidate.matches(scope)[0] is not Match.NONE:
                route = candidate
                break
    return getattr(route, "path", None) or UNMATCHED


class Metrics:
    def __init__(self, engine=None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mtp_requests", "HTTP requests by route and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mtp_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter("mtp_cached_prompt_tokens", "Prompt tokens reused from the prompt cache", registry=r)
        self.completion_tokens = Counter("mtp_completion_tokens", "Completion tokens generated", registry=r)
        self.ttft = Histogram("mtp_time_to_first_token_seconds", "Time from request to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mtp_inter_token_latency_seconds", "Time between streamed tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("mtp_queue_depth", "Requests waiting for an engine slot", registry=r)
        self.active = Gauge("mtp_active_sequences", "Sequences the engine is decoding", registry=r)
        self.drafted = Counter("mtp_draft_tokens", "MTP draft tokens proposed, per draft position", ["position"], registry=r)
        self.accepted = Counter("mtp_accepted_tokens", "MTP draft tokens accepted, per draft position", ["position"], registry=r)
        if engine is not None:
            self.queue_depth.set_function(lambda: engine.queue_depth)
            self.active.set_function(lambda: engine.active_count)

    def request(self, scope: Scope, status: int) -> None:
        self.requests.labels(route_label(scope), str(status)).inc()

    def finished(self, stats) -> None:
        """Per-request totals from the engine's DecodeStats."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.completion_tokens.inc(stats.generated_tokens)
        for j, (d, a) in enumerate(zip(stats.drafted, stats.accepted)):
            self.drafted.labels(str(j + 1)).inc(d)
            self.accepted.labels(str(j + 1)).inc(a)

    def render(self) -> bytes:
        return generate_latest(self.registry)

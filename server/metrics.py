"""Prometheus metrics (prometheus-client), one registry per app.

Requests are labelled with their route's template (`/v1/models/{model_id:path}`),
never the raw path, and every path no route serves with `unmatched`: the number
of series stays bounded whatever clients request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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
        self.backbone_passes = Counter("mtp_backbone_passes", "Decode-time backbone forwards of finished requests", registry=r)
        self.ttft = Histogram("mtp_time_to_first_token_seconds", "Time from request to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mtp_inter_token_latency_seconds", "Time between streamed tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.max_tokens_lowered = Counter("mtp_max_tokens_lowered", "Requests whose max_tokens was lowered to fit the context",
                                          registry=r)
        self.queue_depth = Gauge("mtp_queue_depth", "Requests waiting for an engine slot", registry=r)
        self.active = Gauge("mtp_active_sequences", "Sequences the engine is decoding", registry=r)
        self.drafted = Counter("mtp_draft_tokens", "MTP draft tokens proposed, per draft position", ["position"], registry=r)
        self.accepted = Counter("mtp_accepted_tokens", "MTP draft tokens accepted, per draft position", ["position"], registry=r)
        self.certain_drafted = Counter("mtp_certain_draft_tokens", "Draft tokens that came with certainty, by source: "
                                       "copied from the request's own context, or forced by its grammar", ["source"],
                                       registry=r)
        self.certain_accepted = Counter("mtp_certain_accepted_tokens", "Those accepted, by source", ["source"], registry=r)
        if engine is not None:
            self.queue_depth.set_function(lambda: engine.queue_depth)
            self.active.set_function(lambda: engine.active_count)
            model = getattr(engine, "model", None)
            if getattr(model, "kv", None) is not None:  # the attention KV setting (--kv-bits)
                Gauge("mtp_kv_bits", "Bits per attention KV value (0: the compute dtype), labelled with the setting",
                      ["setting"], registry=r).labels(model.kv.tag).set(model.kv.bits or 0)
                Gauge("mtp_kv_bytes_per_token", "Attention KV bytes each cached token takes (every attention layer, "
                      "the MTP head's included)", registry=r).set(model.kv_bytes_per_token())
            r.register(EngineCollector(engine))
            if engine.prompt_cache is not None:
                r.register(PromptCacheCollector(engine.prompt_cache))

    def request(self, scope: Scope, status: int) -> None:
        self.requests.labels(route_label(scope), str(status)).inc()

    def finished(self, stats) -> None:
        """Per-request totals from the engine's DecodeStats."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.completion_tokens.inc(stats.generated_tokens)
        self.backbone_passes.inc(stats.backbone_passes)
        for j, (d, a) in enumerate(zip(stats.drafted, stats.accepted)):
            self.drafted.labels(str(j + 1)).inc(d)
            self.accepted.labels(str(j + 1)).inc(a)
        for source in ("copy", "forced"):
            self.certain_drafted.labels(source).inc(getattr(stats, source + "_drafted"))
            self.certain_accepted.labels(source).inc(getattr(stats, source + "_accepted"))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def engine_scheduler(engine):
    """The engine's `Scheduler` (rank 0's is wrapped by a distributed `Leader`)."""
    sched = getattr(engine, "scheduler", None)
    return getattr(sched, "sched", sched)


class EngineCollector:
    """What the engine is doing now, read at scrape time: the running rows' speed, tokens per
    pass and acceptance (each row's figures since its decode began, pooled over the rows), the
    depth the policy gave each row in the last round, the batch's occupancy, and the policy's
    model-wide acceptance per draft position (a moving average over rounds). Read from the
    engine thread's objects without a lock: a scrape may see a round half-recorded, never a
    broken one (ints and lists replaced whole)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        sched = engine_scheduler(self.engine)
        rows = list(sched.batch.rows) if sched is not None else []
        last = sched.last_round if sched is not None else {}
        policy = sched.policy if sched is not None else None
        yield GaugeMetricFamily("mtp_batch_capacity", "Rows the engine decodes at once (--max-batch-size)",
                                value=getattr(self.engine, "max_active", 0))
        yield GaugeMetricFamily("mtp_running_sequences", "Rows in the decode batch (prefilling ones excluded)", value=len(rows))
        yield GaugeMetricFamily("mtp_depth_cap", "Most drafts per round any row may take (--mtp-depth)",
                                value=policy.max_depth if policy is not None else 0)
        yield CounterMetricFamily("mtp_decode_rounds", "Decode rounds run (one backbone pass over the running rows each)",
                                  value=sum(policy.rounds.values()) if policy is not None else 0)
        stats = [s.stats for s in rows]
        tok_s = sum(st.generated_tokens / st.decode_s for st in stats if st.decode_s > 0)
        passes = sum(st.backbone_passes for st in stats)
        per_pass = sum(max(st.generated_tokens - 1, 0) for st in stats) / passes if passes else 0.0
        yield GaugeMetricFamily("mtp_running_decode_tokens_per_second", "Decode tokens per second of the running rows, summed "
                                "(each row's since its decode began)", value=tok_s)
        yield GaugeMetricFamily("mtp_running_tokens_per_pass", "Tokens per backbone pass of the running rows, pooled",
                                value=per_pass)
        drafted, accepted = [], []
        for st in stats:
            for j, (d, a) in enumerate(zip(list(st.drafted), list(st.accepted))):
                if j == len(drafted):
                    drafted.append(0)
                    accepted.append(0)
                drafted[j] += d
                accepted[j] += a
        running = GaugeMetricFamily("mtp_running_acceptance", "Draft acceptance of the running rows per draft position, pooled",
                                    labels=["position"])
        for j, (d, a) in enumerate(zip(drafted, accepted)):
            running.add_metric([str(j + 1)], a / d if d else 0.0)
        yield running
        prior = GaugeMetricFamily("mtp_policy_acceptance", "Model-wide draft acceptance per position as the depth policy "
                                  "sees it (a moving average over rounds)", labels=["position"])
        for j, a in enumerate(list(policy.prior) if policy is not None else []):
            prior.add_metric([str(j + 1)], a)
        yield prior
        depth = GaugeMetricFamily("mtp_row_depth", "Drafts the depth policy gave each running row in the last round, by "
                                  "the row's place in the batch", labels=["row"])
        for i, s in enumerate(rows):
            chosen = last.get(s.key)
            if chosen is not None:
                depth.add_metric([str(i)], chosen[0])
        yield depth


class PromptCacheCollector:
    """The prompt cache's counters and sizes per tier (ram, disk), read at scrape time."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        s = self.cache.stats()
        tiers = ("ram", "disk") if "snapshots_disk" in s else ("ram",)

        def per_tier(family, fmt):
            for t in tiers:
                family.add_metric([t], s[fmt.format(t)])
            return family

        yield per_tier(CounterMetricFamily("mtp_prompt_cache_hits", "Prompts that started from a snapshot, by the tier it came from",
                                           labels=["tier"]), "hits_{}")
        yield CounterMetricFamily("mtp_prompt_cache_misses", "Prompts no snapshot served", value=s["misses"])
        yield per_tier(CounterMetricFamily("mtp_prompt_cache_reused_tokens", "Prompt tokens restored from snapshots, by tier",
                                           labels=["tier"]), "reused_{}")
        yield CounterMetricFamily("mtp_prompt_cache_stored", "Snapshots taken", value=s["stored"])
        yield CounterMetricFamily("mtp_prompt_cache_failures", "Lookups and snapshots that raised (the request went on "
                                  "without reuse; /v1/stats gives the last reason)", value=s["failures"])
        yield CounterMetricFamily("mtp_prompt_cache_snapshot_seconds", "Engine time spent taking snapshots (copies, "
                                  "bookkeeping, queueing disk writes)", value=s["snapshot_s"])
        yield per_tier(GaugeMetricFamily("mtp_prompt_cache_snapshots", "Snapshots held, by tier", labels=["tier"]), "snapshots_{}")
        yield per_tier(GaugeMetricFamily("mtp_prompt_cache_bytes", "Bytes held, by tier", labels=["tier"]), "bytes_{}")
        yield per_tier(GaugeMetricFamily("mtp_prompt_cache_budget_bytes", "Byte budget, by tier", labels=["tier"]), "budget_{}")
        yield per_tier(CounterMetricFamily("mtp_prompt_cache_evictions", "Snapshots evicted over the budget, by tier",
                                           labels=["tier"]), "evictions_{}")
        if "disk" not in tiers:
            return
        yield CounterMetricFamily("mtp_prompt_cache_disk_reads", "Snapshots read from disk", value=s["disk_reads"])
        yield CounterMetricFamily("mtp_prompt_cache_disk_read_seconds", "Time reading snapshots from disk", value=s["disk_read_s"])
        yield CounterMetricFamily("mtp_prompt_cache_disk_writes", "Snapshots written to disk", value=s["disk_writes"])
        yield CounterMetricFamily("mtp_prompt_cache_disk_write_seconds", "Time writing snapshots to disk", value=s["disk_write_s"])
        yield CounterMetricFamily("mtp_prompt_cache_disk_written_bytes", "Bytes written to disk", value=s["disk_write_bytes"])
        yield CounterMetricFamily("mtp_prompt_cache_disk_skipped_files", "Corrupt, partial or foreign files skipped",
                                  value=s["disk_skipped_files"])
        yield CounterMetricFamily("mtp_prompt_cache_disk_dropped_writes", "Snapshots not written: the disk fell behind "
                                  "(over 1 GiB queued) or one is larger than the disk budget", value=s["disk_dropped_writes"])

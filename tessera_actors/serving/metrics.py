"""Prometheus metrics of ``tessera serve`` (``GET /metrics``), through ``prometheus_client``.

Two kinds: what the HTTP layer observes per request (counters of requests by
endpoint and status, prompt and generated tokens, TTFT / TPOT / end-to-end
latency histograms) is recorded as it happens; what the engine knows (queue
depth, KV slots, plan in use and switches, per-device busy fraction, bytes
moved between devices and streamed over PCIe, node health, memory) is read from ``engine.stats()`` and
``engine.health()`` at scrape time by a collector, so it is never stale.

Each server gets its own ``CollectorRegistry``: several servers (tests) in
one process do not clash, and nothing registers on import.
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# latency buckets: TTFT and e2e span ms..minutes on a CPU; TPOT is ms..a second
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def device_rows(stats: dict) -> list[dict]:
    """One ``{name, kernels, busy_fraction}`` per device of the plan in use:
    ``stats["devices"]`` where the engine gives it, else the placement's
    devices and kernel counts (busy fraction unknown: None)."""
    if stats.get("devices"):
        return [dict(d) for d in stats["devices"]]
    place = stats.get("placement") or {}
    kernels = list(place.get("kernels_per_device") or [])
    return [{"name": n, "kernels": kernels[i] if i < len(kernels) else None, "busy_fraction": None}
            for i, n in enumerate(place.get("devices") or [])]


class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    def __init__(self, stats: Callable[[], dict], health: Callable[[], dict]) -> None:
        self._stats, self._health = stats, health

    def collect(self):
        s: dict[str, Any] = self._stats() or {}
        h: dict[str, Any] = self._health() or {}

        def gauge(name: str, doc: str, value: Any):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value or 0))
            return g
        yield gauge("tessera_queue_depth", "requests waiting for a KV slot", s.get("queue_depth"))
        yield gauge("tessera_kv_slots_in_use", "KV-cache slots (rows) held by running requests", s.get("slots_in_use"))
        yield gauge("tessera_kv_slots_total", "KV-cache slots (rows) of the engine", s.get("slots_total"))
        plan = GaugeMetricFamily("tessera_plan_in_use", "1 for the placement plan the engine runs now", labels=["plan"])
        plan.add_metric([str(s.get("plan", "unknown"))], 1.0)
        yield plan
        c = CounterMetricFamily("tessera_plan_switches", "plan switches by the online monitor")
        c.add_metric([], float(s.get("plan_switches") or 0))
        yield c
        c = CounterMetricFamily("tessera_engine_steps", "engine steps run")
        c.add_metric([], float(s.get("steps") or 0))
        yield c
        for name, key, doc in (("tessera_prefix_cache_hits", "prefix_hits",
                                "prompts that found their first tokens in a kept KV row (prefix cache)"),
                               ("tessera_prefix_cache_tokens", "prefix_tokens", "prompt tokens not prefilled: "
                                "found in a kept KV row"),
                               ("tessera_engine_requests", "requests", "generation requests the engine took "
                                "(prefix cache hit rate: hits / this)")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(s.get(key) or 0))
            yield c
        yield gauge("tessera_prefix_cache_hit_rate", "prefix-cache hits per request the engine took", (
            (s.get("prefix_hits") or 0) / s["requests"] if s.get("requests") else 0))
        place = s.get("placement") or {}
        busy = GaugeMetricFamily("tessera_device_busy_fraction", "fraction of the last 10 s a device computed",
                                 labels=["index", "device"])
        busy_s = CounterMetricFamily("tessera_device_busy_seconds", "seconds a device spent on steps",
                                     labels=["index", "device"])
        kern = GaugeMetricFamily("tessera_device_kernels", "kernels placed on a device", labels=["index", "device"])
        for i, d in enumerate(device_rows(s)):
            labels = [str(i), str(d["name"])]
            frac = d.get("busy_recent", d.get("busy_fraction"))
            if frac is not None:
                busy.add_metric(labels, float(frac))
            if d.get("busy_s") is not None:
                busy_s.add_metric(labels, float(d["busy_s"]))
            kern.add_metric(labels, float(d.get("kernels") or 0))
        yield busy
        yield busy_s
        yield kern
        yield gauge("tessera_bytes_moved_per_step", "bytes moved between devices per engine step",
                    s.get("bytes_moved_per_step", place.get("bytes_per_step")))
        c = CounterMetricFamily("tessera_pcie_bytes", "weight bytes streamed host -> device (PCIe) by offload plans")
        c.add_metric([], float(s.get("pcie_bytes") or 0))
        yield c
        yield gauge("tessera_pcie_bytes_per_step", "weight bytes streamed host -> device per engine step (mean)",
                    s.get("pcie_bytes_per_step"))
        yield gauge("tessera_healthy", "1 while every node is up (or re-placed)", 1 if h.get("ok", True) else 0)
        yield gauge("tessera_nodes_lost", "nodes lost and not yet re-placed", len(h.get("lost") or []))
        mem = s.get("memory") or {}
        yield gauge("tessera_process_resident_bytes", "resident memory of the server process", mem.get("rss_bytes"))
        yield gauge("tessera_kv_cache_bytes", "KV cache over all devices (kv rows x max_model_len)",
                    mem.get("kv_cache_bytes"))
        yield gauge("tessera_kv_cache_rows", "sequences the KV cache holds at once", mem.get("kv_rows"))
        yield gauge("tessera_kv_cache_budget_bytes", "the KV cache's memory budget (0: none)",
                    mem.get("kv_cache_budget_bytes"))
        yield gauge("tessera_weight_bytes", "bytes of the model's weights (one copy)", mem.get("weight_bytes"))
        yield gauge("tessera_device_bytes", "bytes the devices allocated: weights, KV cache, activation buffers",
                    mem.get("device_bytes"))
        yield gauge("tessera_activation_bytes", "the devices' activation buffers: a scratch per device that every "
                    "bucket's temporaries share, and each bucket's inputs and outputs", mem.get("activation_bytes"))
        yield gauge("tessera_buckets_placed", "bucket graphs placed (the rest are placed in the background)",
                    s.get("buckets_placed"))


class ServerMetrics:
    """The metrics of one server; ``render()`` is the ``/metrics`` body."""

    def __init__(self, stats: Callable[[], dict], health: Callable[[], dict]) -> None:
        r = self.registry = CollectorRegistry()
        self.http = Counter("tessera_http_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=r)
        self.finished = Counter("tessera_requests_finished", "generation requests by finish reason",
                                ["finish_reason"], registry=r)
        self.ignored_fields = Counter("tessera_ignored_request_fields", "unrecognized request fields accepted "
                                      "and ignored, by name", ["field"], registry=r)
        self.prompt_tokens = Counter("tessera_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.generated_tokens = Counter("tessera_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("tessera_time_to_first_token_seconds", "arrival to first token", buckets=_TTFT,
                              registry=r)
        self.tpot = Histogram("tessera_time_per_output_token_seconds", "mean time per token after the first",
                              buckets=_TPOT, registry=r)
        self.e2e = Histogram("tessera_e2e_request_latency_seconds", "arrival to last token", buckets=_E2E,
                             registry=r)
        r.register(_EngineCollector(stats, health))

    def observe_request(self, prompt_tokens: int, completion_tokens: int, finish: str,
                        ttft: float | None, e2e: float) -> None:
        """One finished generation request (aborted ones too)."""
        self.finished.labels(finish).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)

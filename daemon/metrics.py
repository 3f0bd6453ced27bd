"""Prometheus metrics with vLLM's names, so gateways and KEDA setups written for vLLM work unchanged.

Engine gauges and counters are read from the engine's latest stats snapshot at scrape time (a custom
collector); latency histograms are observed by the AsyncEngine as outputs arrive. Each server has
its own CollectorRegistry so several can live in one process (tests).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)

PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit: vLLM's token-count buckets."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


TOKEN_BUCKETS = one_two_five_buckets(2_000_000)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineStatsCollector(Collector):
    def __init__(self, owner: DaemonMetrics) -> None:
        self.owner = owner

    def collect(self):
        stats = self.owner.stats_fn()
        if stats is None:  # still loading: no engine numbers yet
            return
        name = [self.owner.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, float(value))
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, float(value))
            return c

        yield from self._config_infos(stats)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage: fraction of blocks in use (1 = full).",
                    stats.kv_cache_usage)
        yield gauge("kvpilot:kv_cache_token_usage_perc",
                    "KV cache usage counted in tokens held, not whole blocks (1 = full).",
                    stats.kv_cache_token_usage)
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("kvpilot:num_requests_queued",
                    "Requests admitted by the daemon that have no output yet (the backpressure measure).",
                    self.owner.queued_fn())
        weights = GaugeMetricFamily("kvpilot:model_weight_bytes",
                                    "Bytes of the model's weights as held on the device, by quantization method.",
                                    labels=["model_name", "quantization"])
        weights.add_metric([*name, stats.quantization], float(stats.model_weight_bytes))
        yield weights
        yield counter("vllm:num_preemptions_total", "Preemptions since start.", stats.num_preempted_total)
        yield counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries_total)
        yield counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits_total)
        yield counter("vllm:prompt_tokens_total", "Prefill tokens processed.", stats.prompt_tokens_total)
        yield counter("vllm:generation_tokens_total", "Tokens generated.", stats.generation_tokens_total)
        yield from self._spec_decode(stats, name)

    @staticmethod
    def _spec_decode(stats: Any, name: list[str]):
        """vLLM's speculative-decoding counters, shown (as vLLM does) only when speculation is configured:
        the per-position counts then have one entry per draft position."""
        per_pos = getattr(stats, "spec_decode_num_accepted_tokens_per_pos", ())
        if not per_pos:
            return
        for metric, doc, value in (
                ("vllm:spec_decode_num_drafts", "Verifications: one per speculating sequence and step.",
                 stats.spec_decode_num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_decode_num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 stats.spec_decode_num_accepted_tokens)):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, float(value))
            yield c
        pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted draft tokens by position in the draft (0 = the first).",
                                  labels=["model_name", "position"])
        for j, value in enumerate(per_pos):
            pos.add_metric([*name, str(j)], float(value))
        yield pos

    def _config_infos(self, stats: Any):
        """The info gauges gateways read (the Inference Extension's endpoint picker): labels carry the
        facts, as in vLLM (no model_name label there either)."""
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        cache.add_metric([str(self.owner.block_size), str(int(stats.num_total_blocks)),
                          str(self.owner.enable_prefix_caching)], 1.0)
        yield cache
        # The adapters in the batch and waiting for a slot, by name, comma-joined (what the Inference
        # Extension's endpoint picker reads for adapter affinity); the value is a timestamp, as vLLM's, so
        # a reader keeping several samples takes the newest.
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        lora.add_metric([str(int(getattr(stats, "max_loras", 0))), ",".join(getattr(stats, "lora_waiting", ())),
                         ",".join(getattr(stats, "lora_running", ()))], time.time())
        yield lora


class DaemonMetrics:
    """Everything /metrics shows. `model_name` is set once the engine has loaded."""

    def __init__(self, model_name: str = "", *, stats_fn: Callable[[], Any] = lambda: None,
                 queued_fn: Callable[[], int] = lambda: 0) -> None:
        self.model_name = model_name
        self.block_size = 0  # set by the server from the engine config
        self.enable_prefix_caching = False
        self.stats_fn = stats_fn
        self.queued_fn = queued_fn
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, from arrival.",
                               labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                              labels, buckets=ITL_BUCKETS, registry=self.registry)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                              labels, buckets=E2E_BUCKETS, registry=self.registry)
        self._prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                        labels, buckets=TOKEN_BUCKETS, registry=self.registry)
        self._generation_tokens = Histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", labels,
                                            buckets=TOKEN_BUCKETS, registry=self.registry)
        self._params_n = Histogram("vllm:request_params_n", "The n request parameter.", labels,
                                   buckets=PARAMS_N_BUCKETS, registry=self.registry)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._rejected = Counter("kvpilot:requests_rejected", "Requests refused before reaching the engine.",
                                 ["model_name", "reason"], registry=self.registry)
        self.registry.register(_EngineStatsCollector(self))
        self._recent_e2e: deque[tuple[float, float]] = deque(maxlen=64)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.labels(self.model_name).observe(seconds)

    def request_finished(self, e2e_seconds: float, finish_reasons: list[str], *, prompt_tokens: int = 0,
                         generation_tokens: int = 0) -> None:
        """One engine request (one prompt) finished; finish_reasons has one entry per output (n)."""
        self._e2e.labels(self.model_name).observe(e2e_seconds)
        self._prompt_tokens.labels(self.model_name).observe(prompt_tokens)
        self._generation_tokens.labels(self.model_name).observe(generation_tokens)
        self._params_n.labels(self.model_name).observe(len(finish_reasons))
        self._recent_e2e.append((time.monotonic(), e2e_seconds))
        for reason in finish_reasons:
            self._success.labels(self.model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    @property
    def recent_e2e(self) -> float | None:
        """Mean latency of requests finished in the last minute (for Retry-After)."""
        cutoff = time.monotonic() - 60.0
        vals = [v for t, v in self._recent_e2e if t >= cutoff]
        return sum(vals) / len(vals) if vals else None

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics at /metrics, with vLLM's names, label and histogram buckets, so the
dashboards, alerts and routers written for `vllm serve` work unchanged.

Fed by the engine thread once per loop iteration (`record`): the gauges from
`LLMEngine.stats()`, the counters and histograms from the step's `RequestOutput`s and their
`RequestMetrics` (times from time.monotonic()). prometheus_client is thread-safe, so the event
loop renders the registry while the engine thread writes to it. Each server gets its own
CollectorRegistry: two apps in one process (tests) never share or clash on series.
"""
from __future__ import annotations

import gc
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISHED_REASONS = ("stop", "length", "abort")
# vLLM's label names for vllm:cache_config_info (its CacheConfig fields, values as str()),
# those with a meaning here.
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching",
                       "prefix_caching_hash_algo", "num_gpu_blocks", "num_cpu_blocks", "engine")


def cache_config_labels(stats: dict) -> tuple[str, ...]:
    """The label values from an engine's stats(). The hash algorithm named is the one whose
    hashes reach a router (the KV events' sha256 over CBOR); num_gpu_blocks counts the pool's
    blocks, the null block included, whatever the device (vLLM's count)."""
    return (str(stats["block_size"]),
            "int8" if stats.get("kv_cache_dtype") == "int8" else "auto",
            str(bool(stats.get("enable_prefix_caching", False))),
            "sha256_cbor", str(stats["num_gpu_blocks"]), "None", "0")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        reg, lab = self.registry, ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=reg).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # Ours, not vLLM's: a compilation after warm-up stalls every stream; it should stay 0.
        self.late_compilations = gauge("jaxbatch:compilations_after_warmup",
                                       "Executables compiled after warm-up (a shape warm-up missed).")
        # Ours: the start-up heap `jaxbatch serve` moves out of the cyclic collector's walks.
        gauge("jaxbatch:gc_frozen_objects",
              "Objects frozen out of Python's cyclic garbage collector (gc.freeze).").set_function(
                  gc.get_freeze_count)
        # Ours: structured outputs' host time (grammar compiles; matcher advance + mask fill).
        self.structured_compile = gauge("jaxbatch:structured_compile_seconds",
                                        "Cumulative seconds compiling grammars (and building the grammar tokenizer).")
        self.structured_mask = gauge("jaxbatch:structured_mask_seconds",
                                     "Cumulative seconds advancing grammar matchers and filling token bitmasks.")
        self.structured_fills = gauge("jaxbatch:structured_mask_fills",
                                      "Model calls that carried a grammar bitmask (mask seconds / fills = per call).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Number of draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Number of accepted tokens.")
        self.spec_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", ["model_name", "position"], registry=reg)
        # vLLM's LoRA series (only an --enable-lora engine's stats carry lora_*): one sample
        # whose labels name the adapters running and waiting, its value the time of the step.
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                               registry=reg)
        self._lora_labels: tuple | None = None
        # vLLM's info series of its CacheConfig (labels a router reads: block_size,
        # num_gpu_blocks), set once the engine's stats say what the pool is.
        self.cache_config_info = Gauge("vllm:cache_config_info",
                                       "Information of the LLMEngine CacheConfig",
                                       CACHE_CONFIG_LABELS, registry=reg)
        self._cache_config_labels: tuple | None = None
        self._model_name = model_name
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=reg)
        # Every reason is exported from the start (at 0), as vLLM does, so rate() sees the first one.
        self.success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        # Engine-thread-only state: per live request, per completion index, (tokens so far,
        # time of its last token).
        self._seen: dict[str, dict[int, tuple[int, float]]] = {}
        # The engine's cumulative counters as last exported, so each step adds its delta.
        self._exported = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                          "spec_num_drafts": 0, "spec_num_draft_tokens": 0,
                          "spec_num_accepted_tokens": 0}
        self._exported_per_position: list[int] = []

    def record(self, outputs, stats: dict, now: float) -> None:
        """One engine iteration: `outputs` from `LLMEngine.step()`, `stats` from `stats()`."""
        for out in outputs:
            self._record_output(out, now)
        # vLLM counts requests: an n=8 request is 1 running, not 8 (sequences as a fallback
        # for an engine whose stats() has no request counts).
        self.running.set(stats.get("num_running_requests", stats["num_running"]))
        self.waiting.set(stats.get("num_waiting_requests", stats["num_waiting"]))
        total = stats["num_total_blocks"]
        self.kv_usage.set((total - stats["num_free_blocks"]) / total if total else 0.0)
        self.late_compilations.set(stats.get("num_compilations_after_warmup", 0))
        self.structured_compile.set(stats.get("structured_compile_seconds", 0.0))
        self.structured_mask.set(stats.get("structured_mask_seconds", 0.0))
        self.structured_fills.set(stats.get("structured_num_mask_fills", 0))
        for key, counter in (("num_preemptions", self.preemptions),
                             ("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits),
                             ("spec_num_drafts", self.spec_drafts),
                             ("spec_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_num_accepted_tokens", self.spec_accepted)):
            value = stats.get(key, 0)
            if value > self._exported[key]:
                counter.inc(value - self._exported[key])
                self._exported[key] = value
        if "lora_running" in stats:
            self._record_lora(stats, now)
        if "num_gpu_blocks" in stats:
            self._record_cache_config(stats)
        exported = self._exported_per_position
        for pos, value in enumerate(stats.get("spec_accepted_per_position", [])):
            if pos == len(exported):
                exported.append(0)
            if value > exported[pos]:
                self.spec_per_position.labels(self._model_name, str(pos)).inc(value - exported[pos])
                exported[pos] = value

    def _record_lora(self, stats: dict, now: float) -> None:
        labels = (str(stats.get("lora_max_loras", "")),
                  ",".join(sorted(stats.get("lora_waiting", {}))),
                  ",".join(sorted(stats["lora_running"])))
        if labels != self._lora_labels:     # one series at a time, not one per combination seen
            self.lora_info.clear()
            self._lora_labels = labels
        self.lora_info.labels(*labels).set(time.time())

    def _record_cache_config(self, stats: dict) -> None:
        labels = cache_config_labels(stats)
        if labels != self._cache_config_labels:
            self.cache_config_info.clear()
            self._cache_config_labels = labels
            self.cache_config_info.labels(*labels).set(1)

    def _record_output(self, out, now: float) -> None:
        """Per request: prompt tokens, TTFT and queue time once. Per completion (vLLM counts
        each of a request's n as its own request): inter-token gaps, finish reason."""
        m = out.metrics
        first = out.request_id not in self._seen and any(c.token_ids for c in out.outputs)
        if first:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.ttft.observe(max(0.0, (m.first_token_time or now) - m.arrival_time))
            if m.first_scheduled_time is not None:
                self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        seen = self._seen.setdefault(out.request_id, {})
        last = m.last_token_time or now
        for c in out.outputs:
            before, before_time = seen.get(c.index, (0, None))
            new = len(c.token_ids) - before
            if new > 0:
                self.generation_tokens.inc(new)
                if before_time is not None:
                    for _ in range(new):   # one observation per token (a step may yield several)
                        self.itl.observe(max(0.0, last - before_time) / new)
                seen[c.index] = (len(c.token_ids), last)
        if out.finished:
            self._seen.pop(out.request_id, None)
            for c in out.outputs:
                reason = c.finish_reason or "abort"
                if reason in self.success:
                    self.success[reason].inc()
            self.e2e.observe(max(0.0, (m.finished_time or now) - m.arrival_time))
        elif not seen:
            self._seen.pop(out.request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)

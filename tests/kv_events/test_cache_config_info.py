"""vllm:cache_config_info as vLLM exports it (an info gauge at 1, its CacheConfig fields as
labels, values as str()), from an engine's stats: the labels llm-d's endpoint picker reads
(block_size, num_gpu_blocks) and the others with a meaning here; one series at a time."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from jaxbatch.entrypoints.openai.metrics import ServerMetrics

STATS = dict(num_running=0, num_waiting=0, num_free_blocks=99, num_total_blocks=99,
             num_preemptions=0, block_size=16, num_gpu_blocks=100, kv_cache_dtype="bfloat16",
             enable_prefix_caching=True)


def info_samples(metrics: ServerMetrics) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for family in text_string_to_metric_families(
        metrics.render().decode()) for s in family.samples
            if s.name == "vllm:cache_config_info"]


def test_labels_are_vllms_and_the_series_follows_the_pool():
    m = ServerMetrics("tiny")
    m.record([], STATS, 0.0)
    ((labels, value),) = info_samples(m)
    assert value == 1.0
    assert labels == {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
                      "prefix_caching_hash_algo": "sha256_cbor", "num_gpu_blocks": "100",
                      "num_cpu_blocks": "None", "engine": "0"}
    m.record([], {**STATS, "kv_cache_dtype": "int8", "num_gpu_blocks": 50}, 1.0)
    ((labels, _),) = info_samples(m)          # the old series is gone, not left beside
    assert (labels["cache_dtype"], labels["num_gpu_blocks"]) == ("int8", "50")


def test_an_engine_without_pool_stats_exports_no_info():
    m = ServerMetrics("tiny")
    m.record([], {k: v for k, v in STATS.items() if k != "num_gpu_blocks"}, 0.0)
    assert info_samples(m) == []

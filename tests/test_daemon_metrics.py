"""DaemonMetrics on its own: the gateway info gauges and the per-request histograms, with vLLM's names."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.daemon.metrics import DaemonMetrics, one_two_five_buckets

STATS = SimpleNamespace(kv_cache_usage=0.5, kv_cache_token_usage=0.4, num_running=1, num_waiting=0,
                        num_preempted_total=0, prefix_cache_queries_total=3, prefix_cache_hits_total=1,
                        prompt_tokens_total=10, generation_tokens_total=5, num_total_blocks=91,
                        model_weight_bytes=88_000_000, quantization="gguf")


def families(m: DaemonMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def test_info_gauges_appear_once_the_engine_reports():
    m = DaemonMetrics("smol")
    m.block_size, m.enable_prefix_caching = 32, True
    assert "vllm:cache_config_info" not in families(m)  # still loading: no engine numbers
    m.stats_fn = lambda: STATS
    fams = families(m)
    assert fams["vllm:cache_config_info"].samples[0].labels == {
        "block_size": "32", "num_gpu_blocks": "91", "enable_prefix_caching": "True"}
    lora = fams["vllm:lora_requests_info"].samples[0]  # no adapters: max_lora 0, nothing running or waiting
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert lora.value > 1e9  # a timestamp, as vLLM's
    m.stats_fn = lambda: SimpleNamespace(**vars(STATS), max_loras=4, lora_running=("sql", "chat"),
                                         lora_waiting=("docs",))
    lora = families(m)["vllm:lora_requests_info"].samples[0]
    assert lora.labels == {"max_lora": "4", "running_lora_adapters": "sql,chat", "waiting_lora_adapters": "docs"}


def test_model_weight_bytes_by_quantization():
    m = DaemonMetrics("smol")
    m.stats_fn = lambda: STATS
    (sample,) = families(m)["kvpilot:model_weight_bytes"].samples
    assert sample.labels == {"model_name": "smol", "quantization": "gguf"} and sample.value == 88_000_000


def test_request_histograms():
    m = DaemonMetrics("smol")
    m.request_finished(0.5, ["stop", "length"], prompt_tokens=7, generation_tokens=12)
    m.request_finished(0.2, ["stop"], prompt_tokens=3, generation_tokens=1)
    got = {s.name: s.value for f in families(m).values() for s in f.samples if "le" not in s.labels}
    assert got["vllm:request_prompt_tokens_sum"] == 10 and got["vllm:request_prompt_tokens_count"] == 2
    assert got["vllm:request_generation_tokens_sum"] == 13
    assert got["vllm:request_params_n_sum"] == 3 and got["vllm:request_params_n_count"] == 2


def test_one_two_five_buckets():
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(1) == (1,)

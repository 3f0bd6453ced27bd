"""`kvpilot serve` settings (args.py): flags, KVPILOT_* variables, precedence, and flags generated from EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvpilot.daemon.args import DEFAULT_MODEL, add_serve_arguments, parse_serve_args, parse_size
from kvpilot.daemon.engine.config import EngineConfig


def test_serve_defaults():
    a = parse_serve_args([], environ={})
    assert (a.model, a.host, a.port, a.api_key) == (DEFAULT_MODEL, "127.0.0.1", 8000, None)
    cfg = a.engine_config()
    assert cfg.model == DEFAULT_MODEL and cfg.enable_prefix_caching and cfg.max_num_seqs == 256


def test_serve_flags_reach_the_engine_config():
    a = parse_serve_args(["builtin://x", "--port", "9001", "--max-num-seqs", "4", "--block-size", "32",
                          "--max-num-batched-tokens", "512", "--max-model-len", "1024", "--dtype", "float32",
                          "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching",
                          "--scheduling-policy", "priority", "--served-model-name", "a", "b",
                          "--max-queued-requests", "7", "--shutdown-timeout", "2.5", "--api-key", "k"], environ={})
    cfg = a.engine_config()
    assert (cfg.model, cfg.max_num_seqs, cfg.block_size, cfg.max_num_batched_tokens, cfg.max_model_len) == \
        ("builtin://x", 4, 32, 512, 1024)
    assert cfg.dtype == "float32" and cfg.kv_cache_memory == 64 << 20 and not cfg.enable_prefix_caching
    assert cfg.scheduling_policy == "priority" and cfg.served_model_name == "a"
    assert a.served_model_name == ["a", "b"] and a.port == 9001
    assert (a.max_queued_requests, a.shutdown_timeout, a.api_key) == (7, 2.5, "k")


def test_env_vars_map_to_settings_and_flags_win():
    env = {"KVPILOT_MODEL": "builtin://y", "KVPILOT_PORT": "9100", "KVPILOT_API_KEY": "secret",
           "KVPILOT_ENABLE_PREFIX_CACHING": "false", "KVPILOT_MAX_NUM_SEQS": "3",
           "KVPILOT_SERVED_MODEL_NAME": "one,two", "KVPILOT_KV_CACHE_MEMORY": "1Gi", "KVPILOT_HOST": "0.0.0.0"}
    a = parse_serve_args([], environ=env)
    assert (a.model, a.port, a.api_key, a.engine.max_num_seqs, a.host) == ("builtin://y", 9100, "secret", 3, "0.0.0.0")
    assert not a.engine.enable_prefix_caching and a.served_model_name == ["one", "two"] and a.engine.kv_cache_memory == 1 << 30
    b = parse_serve_args(["builtin://z", "--port", "1", "--enable-prefix-caching"], environ=env)
    assert (b.model, b.port, b.engine.enable_prefix_caching) == ("builtin://z", 1, True)


@pytest.mark.parametrize("env", [{"KVPILOT_PORT": "eighty"}, {"KVPILOT_ENABLE_PREFIX_CACHING": "maybe"},
                                 {"KVPILOT_SCHEDULING_POLICY": "lottery"}, {"KVPILOT_MAX_NUM_SEQS": "0"}])
def test_bad_env_values_exit_like_bad_flags(env, capsys):
    with pytest.raises(SystemExit) as ei:
        parse_serve_args([], environ=env)
    assert ei.value.code == 2
    assert next(iter(env)) in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--max-num-seqs", "0"], ["--port", "70000"], ["--block-size", "5"],
                                  ["--kv-cache-memory", "lots"], ["--dtype", "int3"]])
def test_bad_flags_exit_2(argv):
    with pytest.raises(SystemExit) as ei:
        parse_serve_args(argv, environ={})
    assert ei.value.code == 2


@pytest.mark.parametrize("text,value", [("1024", 1024), ("256MiB", 256 << 20), ("1G", 10**9), ("512Mi", 512 << 20),
                                        ("1.5GiB", int(1.5 * (1 << 30))), (4096, 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_every_engine_field_is_a_flag_with_help():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    helps = {a.dest: a.help for a in p._actions}
    for f in dataclasses.fields(EngineConfig):
        assert f.name in helps, f.name
        assert helps[f.name], f"--{f.name.replace('_', '-')} has no help text"


def test_generated_engine_flags_and_env_vars_reach_the_config():
    a = parse_serve_args(["--seed", "7", "--swap-space", "0.5", "--preemption-mode", "swap", "--device", "cpu",
                          "--gpu-memory-utilization", "0.5", "--num-kv-blocks", "64"],
                         environ={"KVPILOT_MAX_MODEL_LEN": "512", "KVPILOT_SEED": "99"})
    cfg = a.engine_config()
    assert (cfg.seed, cfg.swap_space, cfg.preemption_mode, cfg.device) == (7, 0.5, "swap", "cpu")
    assert (cfg.gpu_memory_utilization, cfg.num_kv_blocks, cfg.max_model_len) == (0.5, 64, 512)
    assert parse_serve_args([], environ={}).engine_config() == EngineConfig()


@pytest.mark.parametrize("argv", [["--gpu-memory-utilization", "1.5"], ["--swap-space", "-1"],
                                  ["--device", "tpu"], ["--seed", "x"]])
def test_bad_generated_flags_exit_2(argv):
    with pytest.raises(SystemExit) as ei:
        parse_serve_args(argv, environ={})
    assert ei.value.code == 2


def test_kernel_and_host_settings_are_flags_and_env_vars():
    a = parse_serve_args(["--attention-backend", "torch", "--enforce-eager", "--no-cpu-kernel", "--num-threads", "2"],
                         environ={"KVPILOT_SMALL_BATCH_GEMM": "0", "KVPILOT_POPULATE_KV": "0",
                                  "KVPILOT_PREPACK_WEIGHTS": "false", "KVPILOT_MALLOC_TUNING": "off",
                                  "KVPILOT_ATTENTION_BACKEND": "cpu"})
    cfg = a.engine_config()
    assert (cfg.attention_backend, cfg.enforce_eager, cfg.cpu_kernel, cfg.num_threads) == ("torch", True, False, 2)
    assert (cfg.small_batch_gemm, cfg.populate_kv, cfg.prepack_weights, cfg.malloc_tuning) == (False, False, False, False)
    auto = parse_serve_args([], environ={}).engine_config()
    assert (auto.attention_backend, auto.enforce_eager, auto.small_batch_gemm, auto.num_threads) == \
        ("auto", False, None, None)
    assert parse_serve_args(["--small-batch-gemm"], environ={}).engine_config().small_batch_gemm is True


@pytest.mark.parametrize("env", [{"KVPILOT_ATTENTION_BACKEND": "cuda"}, {"KVPILOT_NUM_THREADS": "0"},
                                 {"KVPILOT_ENFORCE_EAGER": "sometimes"}])
def test_bad_kernel_settings_exit_naming_the_variable(env, capsys):
    with pytest.raises(SystemExit) as ei:
        parse_serve_args([], environ=env)
    assert ei.value.code == 2
    assert next(iter(env)) in capsys.readouterr().err


def test_reserved_variables_set_no_flag(monkeypatch):
    # KVPILOT_TEST_*, KVPILOT_CACHE_DIR and the like are not flags: a flag that would read one is refused
    from kvpilot.daemon import args as args_module

    env = {"KVPILOT_CACHE_DIR": "/tmp/x", "KVPILOT_TEST_CPU_KERNEL_CFLAGS": "-mno-avx2"}
    assert parse_serve_args([], environ=env).engine_config() == EngineConfig()
    clash = args_module._Flag("test_switch", "server", {"help": "?"})
    monkeypatch.setattr(args_module, "_SERVER_FLAGS", (*args_module._SERVER_FLAGS, clash))
    with pytest.raises(RuntimeError, match="KVPILOT_TEST_SWITCH"):
        parse_serve_args([], environ={})


def test_speculative_config_is_a_json_flag_and_variable(capsys):
    """vLLM's --speculative-config: a JSON object, checked by the engine's own rules (a bad value exits 2
    naming the key)."""
    raw = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    cfg = parse_serve_args(["--speculative-config", raw], environ={}).engine
    assert cfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    assert cfg.speculative.num_speculative_tokens == 5
    assert parse_serve_args([], environ={"KVPILOT_SPECULATIVE_CONFIG": raw}).engine.speculative_config["method"] == "ngram"
    assert parse_serve_args([], environ={}).engine.speculative_config is None
    for bad, says in [('{"method": "ngram"', "not JSON"), ("[1, 2]", "JSON object"),
                      ('{"method": "eagle", "num_speculative_tokens": 2}', "EAGLE"),
                      ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens")]:
        with pytest.raises(SystemExit) as exc:
            parse_serve_args(["--speculative-config", bad], environ={})
        assert exc.value.code == 2 and says in capsys.readouterr().err

"""Model sources: builtin GGUF conversion + cache, local folders, hf://, and bad uris."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.loader import load_model, resolve_dtype
from kvpilot.daemon.engine.runner import ModelRunner, SeqBatchEntry
from kvpilot.kernels import ops

BUILTIN = "builtin://smollm2-135m"


def _resolve_in_subprocess(cache: Path) -> subprocess.Popen:
    code = textwrap.dedent(
        """
        import logging, sys, time
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from kvpilot.common.model_source import resolve_model_path
        t = time.perf_counter()
        p = resolve_model_path("builtin://smollm2-135m")
        print(p, time.perf_counter() - t)
        """
    )
    env = {**os.environ, "KVPILOT_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Two processes resolve the builtin model into an empty cache at the same time."""
    cache = tmp_path_factory.mktemp("kvcache")
    procs = [_resolve_in_subprocess(cache) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    results = [out.split() for out, _ in outs]
    conversions = sum(err.count("converting ") for _, err in outs)
    return cache, results, conversions


def test_builtin_converts_once_into_cache(converted):
    cache, results, conversions = converted
    paths = {Path(r[0]) for r in results}
    assert len(paths) == 1, "both processes must end up with the same folder"
    folder = paths.pop()
    assert folder.parent.parent == cache
    assert conversions == 1, "the second process must wait for the first conversion, not redo it"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (folder / name).is_file(), name
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp-")], "temp dir left behind"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (30, 576, 3)
    assert "quantization_config" not in cfg
    assert (folder / "model.safetensors").stat().st_size > 400e6  # float32, not the 90 MB GGUF


def test_second_load_is_fast_and_works(converted, monkeypatch):
    cache, results, _ = converted
    convert_s = max(float(r[1]) for r in results)
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(cache))
    t = time.perf_counter()
    path = resolve_model_path(BUILTIN)
    assert time.perf_counter() - t < 0.5 and path == Path(results[0][0])

    ops.native_available()  # the native kernels build once per cache dir: not part of the load timed here
    t = time.perf_counter()
    loaded = load_model(EngineConfig(model=BUILTIN, dtype="float32", max_model_len=512))
    load_s = time.perf_counter() - t
    assert load_s < convert_s / 2, f"cached load {load_s:.1f}s vs conversion {convert_s:.1f}s"
    assert loaded.path == path
    assert loaded.model_name == BUILTIN
    assert loaded.max_model_len == 512
    assert loaded.eos_token_ids == frozenset({2})  # <|im_end|>
    assert loaded.tokenizer.chat_template and "<|im_start|>" in loaded.tokenizer.chat_template
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    assert not loaded.model.training

    # the converted weights are right: greedy decoding knows the capital of France
    cfg = EngineConfig(model=BUILTIN, dtype="float32", num_kv_blocks=4)
    runner = ModelRunner(cfg, loaded)
    runner.init_kv_cache(runner.num_blocks_for_budget())
    ids = loaded.tokenizer("The capital of France is")["input_ids"]
    logits = runner.execute([SeqBatchEntry(ids, 0, [2, 0], True)])
    out = []
    for i in range(3):
        out.append(int(logits[0].argmax()))
        logits = runner.execute([SeqBatchEntry(out[-1:], len(ids) + i, [2, 0], True)])
    assert "Paris" in loaded.tokenizer.decode(out)


def test_local_folder_source(converted, monkeypatch):
    cache, results, _ = converted
    folder = results[0][0]
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(cache / "unused"))  # a folder source needs no cache
    loaded = load_model(EngineConfig(model=folder, served_model_name="smol", dtype="float32"))
    assert loaded.path == Path(folder)
    assert loaded.model_name == "smol"
    assert loaded.max_model_len == 8192  # min(max_position_embeddings, 8192)
    assert not (cache / "unused").exists()
    with pytest.raises(ValueError, match="max_model_len=9000"):
        load_model(EngineConfig(model=folder, max_model_len=9000))


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("s3://bucket/model", r"unknown scheme 's3://'"),
        ("builtin://nope-7b", r"unknown builtin model 'nope-7b'"),
        ("/nonexistent/kvpilot/model", r"'/nonexistent/kvpilot/model' does not exist"),
        ("hf://just-a-name", r"expected hf://org/name"),
        ("", r"non-empty"),
    ],
)
def test_bad_uri(uri, match):
    with pytest.raises(ValueError, match=match):
        load_model(EngineConfig(model=uri))


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        resolve_model_path(str(tmp_path))
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"must be \.gguf"):
        resolve_model_path(str(txt))


def test_corrupt_gguf_leaves_no_cache_entry(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(cache))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(EngineConfig(model=str(bad)))
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2})
    )
    save_file({"wte.weight": torch.zeros(4, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]") as e:
        load_model(EngineConfig(model=str(tmp_path)))
    assert str(tmp_path) in str(e.value)


def test_hf_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"hf://kvpilot-tests/not-a-cached-model.*offline"):
        load_model(EngineConfig(model="hf://kvpilot-tests/not-a-cached-model"))
    assert time.perf_counter() - t < 30


def test_dtype_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    native_bf16 = "amx_bf16" in flags or "avx512_bf16" in flags  # bfloat16 dot products in hardware
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native_bf16 else torch.float32)

"""`kvpilot serve --tensor-parallel-size 2` on loopback: it serves like one process, and when a rank is killed
mid-stream the stream ends with an error, /health answers 503 (so the pod restarts) and new requests get a
503 with an OpenAI error body; the daemon's other rank does not outlive it. A two-node group (node 0 and a
worker node, each a `kvpilot serve`) gives node 0's greedy output alone."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.daemon_process import DaemonProcess
from tests.support.hf_parity import save_tiny
from tests.support.rank_procs import spawned_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama8d")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    save_tiny(cfg, LlamaForCausalLM, folder, lambda n: "norm" in n)
    return folder


def _serve_args(folder: Path, *extra: str) -> list[str]:
    return [str(folder), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--max-model-len", "512",
            "--num-threads", "1", *extra]


def _complete(d: DaemonProcess, max_tokens: int = 8) -> list[str]:
    body = json.dumps({"model": d.serve_args[0], "prompt": "The quick brown fox", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "logprobs": 1}).encode()
    req = urllib.request.Request(d.url("/v1/completions"), body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["logprobs"]["tokens"]


def test_a_killed_rank_fails_streams_and_health(llama8: Path) -> None:
    with DaemonProcess(*_serve_args(llama8, "--tensor-parallel-size", "2")) as d:
        assert len(_complete(d)) == 8
        (rank,) = spawned_ranks(d.proc.pid)
        body = json.dumps({"model": str(llama8), "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(d.url("/v1/completions"), body, {"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=60) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(rank, signal.SIGKILL)  # mid-stream
        assert events[-1] == "[DONE]" or "error" in events[-1]
        assert any("error" in e for e in events), events[-3:]
        deadline = time.monotonic() + 30
        while d.get("/health")[0] != 503:
            assert time.monotonic() < deadline, "health stayed 200 after a rank died"
            time.sleep(0.2)
        status, err = d.get("/v1/models")  # the routes answer; generation is refused
        code, body = _post(d, {"model": str(llama8), "prompt": "hi", "max_tokens": 2})
        assert code == 503 and "error" in json.loads(body)
        assert status in (200, 503)
    assert not spawned_ranks(d.proc.pid)


def _post(d: DaemonProcess, payload: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(d.url("/v1/completions"), json.dumps(payload).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_two_nodes_on_loopback_match_one_process(llama8: Path) -> None:
    """Node 0 on 127.0.0.1 and a worker node on 127.0.0.2, pipeline 2: they meet over TCP as two nodes of a
    LeaderWorkerSet would (the worker finds node 0 through LWS_LEADER_ADDRESS)."""
    with DaemonProcess(*_serve_args(llama8)) as one:
        want = _complete(one)
    port = str(_free_port())
    env = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    leader = DaemonProcess(*_serve_args(llama8, "--pipeline-parallel-size", "2", "--dist-init-addr",
                                        f"127.0.0.1:{port}"), env={**env, "LWS_WORKER_INDEX": "0"})
    worker = DaemonProcess(*_serve_args(llama8, "--pipeline-parallel-size", "2", "--dist-init-addr",
                                        f"127.0.0.1:{port}"), env={**env, "LWS_WORKER_INDEX": "1"},
                           host="127.0.0.2")
    leader.start(wait_ready=False)
    try:
        worker.start(wait_ready=False)
        deadline = time.monotonic() + 120
        while leader.get("/ready")[0] != 200 or worker.get("/ready")[0] != 200:
            assert time.monotonic() < deadline, leader.logs()[-2000:] + worker.logs()[-2000:]
            time.sleep(0.2)
        assert _complete(leader) == want
        worker.signal(signal.SIGKILL)  # the worker node is gone: node 0 notices while idle, its health says so
        deadline = time.monotonic() + 30
        while leader.get("/health")[0] != 503:
            assert time.monotonic() < deadline, leader.logs()[-2000:]
            time.sleep(0.2)
    finally:
        worker.stop()
        leader.stop()


def _free_port() -> int:
    from kvpilot.daemon.engine.executor.distributed import free_port

    return free_port()

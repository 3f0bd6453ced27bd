"""The daemon that test_server.py and test_serving.py each start: one API key, two served names."""

from __future__ import annotations

from support.daemon_process import DaemonProcess

KEY = "test-key-123"
NAME = "smollm2"
ALIAS = "smol-alias"
KV = "128MiB"
# One intra-op thread: with two OpenMP threads on a 2-core box, any other busy process (this test client,
# the reference LLM) stalls every GEMM at its barrier; one thread is steady.
ONE_THREAD = {"KVPILOT_NUM_THREADS": "1"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def api_daemon() -> DaemonProcess:
    return DaemonProcess("--api-key", KEY, "--served-model-name", NAME, ALIAS, "--max-num-seqs", "16",
                         "--kv-cache-memory", KV, "--max-queued-requests", "64", env=ONE_THREAD)

"""The daemons' LoRA routes, as the operator calls them: /v1/models (what a pod holds), and
/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies; plain text on success, an OpenAI error
body otherwise)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp


class DaemonError(Exception):
    """A call that did not succeed. reason is the LoadFailed condition's: DaemonRefused for a 4xx (the
    daemon's own message, e.g. a bad adapter), DaemonError for a 5xx, DaemonUnreachable when no answer came."""

    def __init__(self, message: str, reason: str, status: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


def error_message(status: int, text: str) -> str:
    """The message of an OpenAI error body ({"error": {"message": ...}}), else the text as it came."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("message"):
        return str(body["error"]["message"])
    return f"HTTP {status}: {text.strip()[:300]}" if text.strip() else f"HTTP {status}"


@dataclass(frozen=True)
class Answer:
    status: int
    text: str


async def _call(session: aiohttp.ClientSession, method: str, url: str, timeout: float,
                body: dict[str, str] | None = None) -> Answer:
    try:
        async with session.request(method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return Answer(resp.status, await resp.text())
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise DaemonError(f"{type(e).__name__}: {e}".rstrip(": "), "DaemonUnreachable") from e


def _raise_for(answer: Answer) -> None:
    if answer.status >= 400:
        reason = "DaemonRefused" if answer.status < 500 else "DaemonError"
        raise DaemonError(error_message(answer.status, answer.text), reason, answer.status)


async def served_adapters(session: aiohttp.ClientSession, base_url: str, timeout: float) -> frozenset[str]:
    """The adapters a daemon lists in /v1/models: the entries with a parent (the base model has none)."""
    answer = await _call(session, "GET", f"{base_url}/v1/models", timeout)
    _raise_for(answer)
    try:
        data = json.loads(answer.text).get("data") or []
        return frozenset(str(m["id"]) for m in data if isinstance(m, dict) and m.get("parent") and "id" in m)
    except (ValueError, AttributeError, TypeError) as e:
        raise DaemonError(f"/v1/models is not a model list: {e}", "DaemonError") from e


async def load(session: aiohttp.ClientSession, base_url: str, name: str, path: str, timeout: float) -> None:
    answer = await _call(session, "POST", f"{base_url}/v1/load_lora_adapter", timeout,
                         {"lora_name": name, "lora_path": path})
    _raise_for(answer)


async def unload(session: aiohttp.ClientSession, base_url: str, name: str, timeout: float) -> None:
    """Unloaded, or not loaded in the first place (404): either way the pod no longer holds it."""
    answer = await _call(session, "POST", f"{base_url}/v1/unload_lora_adapter", timeout, {"lora_name": name})
    if answer.status != 404:
        _raise_for(answer)

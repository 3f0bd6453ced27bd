"""Where the router encodes prompts: inline for short texts, on worker threads for long ones, and the fast
path of a Hugging Face tokenizer, which must give the tokenizer's own ids."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvpilot.common.errors import APIError
from kvpilot.common.protocol import parse_chat_body
from kvpilot.daemon.protocol import parse_chat_request
from kvpilot.daemon.serving import OpenAIServing
from kvpilot.router.prompt import ByteTokenizer, PromptHasher, fast_encoder, load_tokenizer
from kvpilot.router.tokenize_pool import PENDING_PER_THREAD, TokenizePool
from support.router_fakes import SlowTokenizer

CHAT = "/v1/chat/completions"


def body(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


async def test_short_prompts_inline_long_ones_on_a_worker_thread():
    tok = SlowTokenizer(delay=0.0, slow_chars=2000)
    pool = TokenizePool(PromptHasher(tok), threads=2, inline_chars=2000)
    try:
        short, long = await pool.token_ids(CHAT, body("hi")), await pool.token_ids(CHAT, body("x" * 3000))
        assert short.where == "inline" and tok.inline_threads == [threading.current_thread().name]
        assert long.where == "pool" and tok.slow_threads[0].startswith("kvpilot-tokenize")
        # the same ids either way
        assert long.ids == PromptHasher(ByteTokenizer()).token_ids(CHAT, body("x" * 3000))
        ids = await pool.token_ids("/v1/completions", {"prompt": [5, 6, 7]})
        assert (ids.ids, ids.where) == ([5, 6, 7], "none")
        assert (await pool.token_ids(CHAT, {"messages": "nope"})).ids is None
    finally:
        pool.close()


async def test_a_tokenizer_that_holds_the_gil_is_never_offloaded():
    # ByteTokenizer is Python: a thread would not free the event loop, only add the hand-off
    pool = TokenizePool(PromptHasher(ByteTokenizer()), threads=2, inline_chars=10)
    assert not pool.offloads
    assert (await pool.token_ids(CHAT, body("x" * 5000))).where == "inline"
    assert not TokenizePool(PromptHasher(SlowTokenizer(0.0, 1)), threads=0).offloads


def test_bad_pool_settings_are_refused():
    with pytest.raises(ValueError):
        TokenizePool(PromptHasher(ByteTokenizer()), threads=-1)
    with pytest.raises(ValueError):
        TokenizePool(PromptHasher(ByteTokenizer()), threads=2, max_pending=-1)
    assert TokenizePool(PromptHasher(ByteTokenizer()), threads=3).max_pending == 3 * PENDING_PER_THREAD


class _GatedTokenizer(ByteTokenizer):
    """UTF-8 bytes; a long text's encode waits for `gate` (releasing the GIL as a fast tokenizer does)."""

    releases_gil = True

    def __init__(self, long_chars: int = 100) -> None:
        self.long_chars = long_chars
        self.gate = threading.Event()
        self.started: list[str] = []  # the long texts whose encode began, in order

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= self.long_chars:
            self.started.append(text)
            self.gate.wait(30)
        return super().encode(text, add_special_tokens)


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_full_pool_sheds_long_texts_at_once_until_it_drains():
    tok = _GatedTokenizer()
    pool = TokenizePool(PromptHasher(tok), threads=1, inline_chars=100, max_pending=2)
    try:
        # one encoding (blocked), one queued behind it: the pool is full
        waits = [asyncio.create_task(pool.token_ids(CHAT, body(c * 200))) for c in "ab"]
        await _until(lambda: pool.pending == 2 and len(tok.started) == 1)
        t0 = time.perf_counter()
        shed = await asyncio.wait_for(pool.token_ids(CHAT, body("c" * 200)), 2)  # unbounded: hangs here
        assert (shed.ids, shed.where) == (None, "shed") and time.perf_counter() - t0 < 0.5
        assert (await pool.token_ids(CHAT, body("short"))).where == "inline"  # short texts never queue
        assert pool.pending == 2 and len(tok.started) == 1
        tok.gate.set()
        done = await asyncio.gather(*waits)
        assert [t.where for t in done] == ["pool", "pool"]
        assert done[1].ids == PromptHasher(ByteTokenizer()).token_ids(CHAT, body("b" * 200))
        assert pool.pending == 0
        again = await pool.token_ids(CHAT, body("d" * 200))  # drained: long texts go to the pool again
        assert again.where == "pool" and again.ids == PromptHasher(ByteTokenizer()).token_ids(CHAT, body("d" * 200))
        assert pool.pending == 0
    finally:
        tok.gate.set()
        pool.close()


async def test_a_cancelled_wait_gives_its_slot_back():
    tok = _GatedTokenizer()
    pool = TokenizePool(PromptHasher(tok), threads=1, inline_chars=100, max_pending=2)
    try:
        running = asyncio.create_task(pool.token_ids(CHAT, body("a" * 200)))
        queued = asyncio.create_task(pool.token_ids(CHAT, body("b" * 200)))
        await _until(lambda: pool.pending == 2 and len(tok.started) == 1)
        queued.cancel()  # the client went away while its text waited: the encode is dropped, the slot freed
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert pool.pending == 1
        taker = asyncio.create_task(pool.token_ids(CHAT, body("c" * 200)))  # takes the slot, not shed
        await _until(lambda: pool.pending == 2)
        running.cancel()  # a running encode cannot be stopped: its slot stays taken until it ends
        with pytest.raises(asyncio.CancelledError):
            await running
        assert pool.pending == 2 and (await pool.token_ids(CHAT, body("d" * 200))).where == "shed"
        tok.gate.set()
        assert (await asyncio.wait_for(taker, 5)).where == "pool"
        assert pool.pending == 0  # the cancelled running encode gave its slot back when it ended
        # the cancelled queued text was never encoded
        assert len(tok.started) == 2 and "a" * 200 in tok.started[0] and "c" * 200 in tok.started[1]
    finally:
        tok.gate.set()
        pool.close()


async def test_an_encode_that_raises_gives_its_slot_back(monkeypatch):
    hasher = PromptHasher(_GatedTokenizer())
    pool = TokenizePool(hasher, threads=1, inline_chars=100, max_pending=1)

    def boom(text: str, add_special_tokens: bool) -> list[int]:
        raise RuntimeError(f"cannot encode {len(text)} chars, special={add_special_tokens}")

    monkeypatch.setattr(hasher, "encode", boom)
    try:
        for _ in range(2):  # a slot leaked by the first would shed the second
            with pytest.raises(RuntimeError):
                await pool.token_ids(CHAT, body("x" * 200))
            assert pool.pending == 0
    finally:
        pool.close()


class _Encoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class _OffByOneBackend:
    """A backend whose batch encode disagrees with its tokenizer: the fast path must not be used."""

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> list[_Encoding]:
        return [_Encoding([b + 1 for b in ByteTokenizer().encode(t, add_special_tokens)]) for t in texts]


class _DisagreeingTokenizer(ByteTokenizer):
    backend_tokenizer = _OffByOneBackend()


def test_a_fast_path_that_disagrees_is_not_used():
    assert fast_encoder(_DisagreeingTokenizer()) is None
    assert fast_encoder(ByteTokenizer()) is None
    hasher = PromptHasher(_DisagreeingTokenizer())
    assert not hasher.fast and hasher.encode("ab", False) == [97, 98]


@pytest.mark.slow  # loads transformers and the builtin model's tokenizer
def test_the_fast_path_gives_the_tokenizers_own_ids():
    tok = load_tokenizer("builtin://smollm2-135m")
    hasher = PromptHasher(tok)
    assert hasher.fast and hasher.releases_gil
    rng = random.Random(3)
    texts = [tok.decode([rng.randrange(len(tok)) for _ in range(rng.randint(1, 700))]) for _ in range(100)]
    for text in texts:
        for special in (False, True):
            assert hasher.encode(text, special) == list(tok.encode(text, add_special_tokens=special))
    msgs = [{"role": "system", "content": texts[0]}, {"role": "user", "content": "hi <|im_end|> there"}]
    want = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)
    assert hasher.token_ids(CHAT, {"messages": msgs}) == list(want)


# ---- tools: the router renders the chat template with them as the daemon does ------------------------

TOOLS = [{"type": "function", "function": {
    "name": "stock", "description": "Units of a product in stock.",
    "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}}}]
TOOL_TURNS = [  # a call made and its result: templates render these differently from plain turns too
    {"role": "user", "content": "Do you have hammers?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "stock", "arguments": '{"sku": "H-1"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12"}]


def daemon_ids(tok: Any, chat_body: dict[str, Any]) -> list[int]:
    """What the daemon encodes for this body: its own OpenAIServing.chat_prompt (auto tool choice on, so
    that "auto" is accepted), encoded without special tokens as /v1/chat/completions does."""
    req = parse_chat_request(chat_body, auto_tool_choice=True)
    serving = OpenAIServing(SimpleNamespace(tokenizer=tok), None, "fcfs", 1)  # type: ignore[arg-type]
    text = serving.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools)
    return list(tok.encode(text, add_special_tokens=False))


class _NativeToolsTokenizer(ByteTokenizer):
    """A template that knows tools (its source mentions them): it gets `tools=` and dict arguments."""

    chat_template = "{% for tool in tools %}...{% endfor %}"

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        head = f"<|tools|>{json.dumps(kwargs['tools'])}\n" if kwargs.get("tools") else ""
        calls = [json.dumps(m.get("tool_calls")) for m in messages if m.get("tool_calls")]
        return head + super().apply_chat_template(messages, **kwargs) + "".join(calls)


@pytest.mark.parametrize("chat_body", [
    {"messages": [{"role": "user", "content": "Do you have hammers?"}], "tools": TOOLS},
    {"messages": [{"role": "user", "content": "Hammers?"}], "tools": TOOLS, "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "Hammers?"}], "tools": TOOLS, "tool_choice": "required"},
    {"messages": TOOL_TURNS, "tools": TOOLS},
    {"messages": TOOL_TURNS},  # tool turns without tools
], ids=["tools", "auto", "required", "tool-turns", "tool-turns-no-tools"])
def test_tools_go_into_the_template_as_the_daemon_puts_them(chat_body):
    tok = _NativeToolsTokenizer()
    ids = PromptHasher(tok).token_ids(CHAT, chat_body)
    assert ids is not None and ids == daemon_ids(tok, chat_body)
    without = PromptHasher(tok).token_ids(CHAT, {"messages": [{"role": "user", "content": "x"}]})
    assert without is not None and without == daemon_ids(tok, {"messages": [{"role": "user", "content": "x"}]})
    if "tools" in chat_body:  # the tools are in the ids: without them the ids differ
        bare = {k: v for k, v in chat_body.items() if k not in ("tools", "tool_choice")}
        assert PromptHasher(tok).token_ids(CHAT, bare) != ids


def _heavy_modules_loaded_by(code: str, timeout: float) -> list[str]:
    """Run `code` in a fresh interpreter; which of xgrammar and torch it left loaded."""
    code += '\nimport json, sys\nprint(json.dumps(sorted(m for m in ("xgrammar", "torch") if m in sys.modules)))\n'
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tool_and_constrained_requests_load_no_grammar_engine_on_the_router():
    # the router renders prompts only: a forced tool call or a response_format is the daemon's to parse,
    # and parsing one here loaded xgrammar and torch on the event loop (0.24-0.26 s on the first request)
    code = f"""
from kvpilot.router.prompt import ByteTokenizer, PromptHasher
hasher = PromptHasher(ByteTokenizer())
hasher.warm()
tools = {TOOLS!r}
for body in ({{"messages": [{{"role": "user", "content": "Hammers?"}}], "tools": tools, "tool_choice": "required"}},
             {{"messages": [{{"role": "user", "content": "Hammers?"}}], "tools": tools,
               "tool_choice": {{"type": "function", "function": {{"name": "stock"}}}}}},
             {{"messages": [{{"role": "user", "content": "JSON"}}],
               "response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": {{"type": "object"}}}}}}}}):
    assert hasher.token_ids("/v1/chat/completions", body), body
"""
    assert _heavy_modules_loaded_by(code, timeout=120) == []


@pytest.mark.slow  # loads the builtin model's tokenizer in a fresh interpreter
def test_a_router_with_the_models_tokenizer_never_loads_torch():
    # resolving the model's folder and loading its tokenizer is all the router asks of the engine's loader;
    # torch would add 180 MB to every router replica (318 vs 134 MB measured) and a second to its start
    load_tokenizer("builtin://smollm2-135m")  # converts the GGUF once (that does need torch), here
    code = """
from kvpilot.router.server import RouterSettings, build_app
build_app(RouterSettings(endpoints="http://127.0.0.1:9", tokenizer="builtin://smollm2-135m"))
"""
    assert _heavy_modules_loaded_by(code, timeout=300) == []


def test_constraints_can_be_left_to_the_daemon():
    chat = {"messages": [{"role": "user", "content": "Hammers?"}], "tools": TOOLS, "tool_choice": "required"}
    assert parse_chat_request(chat).params.structured_outputs is not None  # the daemon's parse: a forced call's grammar
    light = parse_chat_body(chat)  # the router's: no grammar, no SamplingParams
    assert "structured_outputs" not in light.sampling and light.tools == parse_chat_request(chat).tools
    # the checks that do not parse grammars still run
    with pytest.raises(APIError):
        parse_chat_body({**chat, "tool_choice": {"type": "function", "function": {"name": "nope"}}})


@pytest.mark.slow  # loads transformers and the builtin model's tokenizer
def test_tool_requests_give_the_daemons_ids_with_the_builtin_model():
    # SmolLM2's template does not know tools: the daemon writes them into a Hermes system prompt
    tok = load_tokenizer("builtin://smollm2-135m")
    hasher = PromptHasher(tok)
    system = {"role": "system", "content": "You are a shop assistant."}
    for chat_body in ({"messages": [system, {"role": "user", "content": "Hammers?"}], "tools": TOOLS},
                      {"messages": [system, *TOOL_TURNS], "tools": TOOLS, "tool_choice": "auto"},
                      {"messages": [system, *TOOL_TURNS]}):
        ids = hasher.token_ids(CHAT, chat_body)
        assert ids is not None and ids == daemon_ids(tok, chat_body), chat_body
        if "tools" in chat_body:
            bare = {k: v for k, v in chat_body.items() if k not in ("tools", "tool_choice")}
            assert hasher.token_ids(CHAT, bare) != ids
            # the same blocks as the daemon's: the template header and tool listing fill several
            assert hasher.hashes(ids) == hasher.hashes(daemon_ids(tok, chat_body)) and len(ids) >= 64

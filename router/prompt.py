"""Request body -> prompt token ids -> the engine's block-hash chain, the key of prefix affinity.

The token ids must be the daemon's: the same tokenizer, the same chat template rendered with the same
tools (kvpilot.common.chat_template, as daemon/serving.py), the same special-token rules. A body the
daemon would reject yields no hashes; the router then routes on load alone and lets the daemon answer the error.

Two stages, because they cost differently: `prompt_input` (parse the body, render the chat template) is
Python that holds the GIL; `encode` is, for a Hugging Face fast tokenizer, Rust that releases it, so
only it is worth moving off the event loop (router/tokenize_pool.py does that for long texts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.block_hash import hash_prompt_blocks
from kvpilot.common.chat_template import render_chat
from kvpilot.common.errors import APIError
from kvpilot.common.protocol import parse_chat_body


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no model needed (dev, tests). Affinity still agrees across routers, but the
    hit-token estimates are in bytes, not the engine's tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:  # noqa: ARG002 - same signature
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        parts = [f"<|{m.get('role')}|>{m.get('content')}" for m in messages]
        if kwargs.get("add_generation_prompt"):
            parts.append("<|assistant|>")
        return "\n".join(parts)


def load_tokenizer(model: str) -> Tokenizer:
    """The model's tokenizer (a model URI as `kvpilot serve` takes it); '' or 'bytes' gives ByteTokenizer."""
    if model in ("", "bytes"):
        return ByteTokenizer()
    from kvpilot.common.model_source import resolve_model_path  # converts builtin:// once, cached
    from kvpilot.common.tokenizer import load_tokenizer as load_model_tokenizer

    return load_model_tokenizer(resolve_model_path(model))


@dataclass(frozen=True)
class PromptInput:
    """What is left to do for one prompt: a text to encode, or token ids the client sent."""

    text: str | None = None
    add_special_tokens: bool = False
    ids: list[int] | None = None


Encoder = Callable[[str, bool], list[int]]

# Texts the fast path must tokenize exactly as the tokenizer does before it is trusted: plain words,
# leading spaces, non-ASCII, and (added per tokenizer) its special tokens inside text.
_PROBES = ("Hello, world!", "  two leading spaces\nand a newline", "émoji 🤖 und 中文 text", "x" * 300)


def fast_encoder(tokenizer: Any) -> Encoder | None:
    """The backend's `encode_batch_fast` (no offsets: about twice as fast, and it releases the GIL for all
    of its work), if this is a Hugging Face fast tokenizer and it agrees with `tokenizer.encode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    batch = getattr(backend, "encode_batch_fast", None)
    if batch is None:
        return None

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    specials = " ".join(str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ())
    try:
        for text in (*_PROBES, f"a {specials} b"):
            for special in (False, True):
                if encode(text, special) != list(tokenizer.encode(text, add_special_tokens=special)):
                    return None
    except Exception:  # any doubt: the tokenizer's own encode is always right
        return None
    return encode


class PromptHasher:
    def __init__(self, tokenizer: Tokenizer, block_size: int = 16) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._fast = fast_encoder(tokenizer)

    @property
    def fast(self) -> bool:
        return self._fast is not None

    @property
    def releases_gil(self) -> bool:
        """Whether `encode` lets other threads run meanwhile (only then is a worker thread worth it).
        True for the fast path; another tokenizer may say so with a `releases_gil` attribute."""
        return self._fast is not None or bool(getattr(self.tokenizer, "releases_gil", False))

    def warm(self) -> None:
        """Render and encode one chat with a tool call and a tool, as requests will: the tool modules'
        import and the template's compile then happen at start, not on the event loop under the first
        such request (about 50 ms with the builtin model)."""
        self.token_ids("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "warm-up"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "ok"}],
            "tools": [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]})

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt tokens the daemon would compute; None when there is nothing to go by."""
        inp = self.prompt_input(path, body)
        if inp is None or inp.ids is not None:
            return None if inp is None else inp.ids
        assert inp.text is not None
        return self.encode(inp.text, inp.add_special_tokens)

    def prompt_input(self, path: str, body: dict[str, Any]) -> PromptInput | None:
        """The text to encode (chat template applied) or the client's token ids; None: nothing to go by."""
        try:
            if path.endswith("/chat/completions"):
                return PromptInput(self._chat_text(body), add_special_tokens=False)
            if path.endswith("/completions"):
                return _completion_input(body.get("prompt"))
        except APIError:
            return None
        except Exception:  # a template error is the daemon's to report, not a routing failure
            return None
        return None

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """Token ids of a text; None if the tokenizer fails (the daemon will say why). Thread-safe."""
        try:
            if self._fast is not None:
                return self._fast(text, add_special_tokens)
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception:  # a tokenizer error is the daemon's to report
            return None

    def _chat_text(self, body: dict[str, Any]) -> str:
        # auto_tool_choice: the template does not depend on tool_choice, and whether the daemons take "auto"
        # is theirs to say; parsed strictly, every "auto" request would lose its affinity. Constraints
        # (response_format, forced tool calls) do not change the prompt either, and parsing them would load
        # xgrammar and torch on the event loop: the daemon checks them (common's parse leaves them out).
        req = parse_chat_body(body, auto_tool_choice=True)
        text = render_chat(self.tokenizer, req.messages, req.tools, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message)
        if not isinstance(text, str):
            raise TypeError(f"the chat template gave {type(text).__name__}, not text")
        return text

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
               adapter: str | None = None) -> list[bytes]:
        """The engine's keys for these tokens: a salted prompt's blocks are its tenant's alone there too.

        A LoRA adapter's prompt is keyed by the adapter as well (as the engine keeps adapters' KV apart),
        in bytes, which no salt (a str) can equal: these keys are the router's own, not the engine's."""
        extra: tuple = (cache_salt,) if cache_salt else ()
        if adapter:
            extra += (b"lora:" + adapter.encode(),)
        return hash_prompt_blocks(token_ids, self.block_size, extra)


def _completion_input(prompt: Any) -> PromptInput | None:
    # A batch routes as a whole: its first prompt decides.
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return PromptInput(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return PromptInput(ids=list(prompt))
    return None

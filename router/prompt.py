"""Request body -> prompt token ids -> the engine's block-hash chain, the key of prefix affinity.

The token ids must be the daemon's: the same tokenizer, the same chat template, the same special-token
rules (daemon/serving.py). A body the daemon would reject yields no hashes; the router then routes on
load alone and lets the daemon answer the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvpilot.block_hash import hash_prompt_blocks
from kvpilot.daemon.protocol import APIError, parse_chat_request


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
    from transformers import AutoTokenizer

    from kvpilot.daemon.engine.loader import resolve_model_path  # converts builtin:// once, cached

    return AutoTokenizer.from_pretrained(str(resolve_model_path(model)))


class PromptHasher:
    def __init__(self, tokenizer: Tokenizer, block_size: int = 16) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt tokens the daemon would compute; None when there is nothing to go by."""
        try:
            if path.endswith("/chat/completions"):
                return self._chat_ids(body)
            if path.endswith("/completions"):
                return self._completion_ids(body.get("prompt"))
        except APIError:
            return None
        except Exception:  # a template or tokenizer error is the daemon's to report, not a routing failure
            return None
        return None

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        req = parse_chat_request(body)
        text = self.tokenizer.apply_chat_template(req.messages, tokenize=False,
                                                  add_generation_prompt=req.add_generation_prompt,
                                                  continue_final_message=req.continue_final_message)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _completion_ids(self, prompt: Any) -> list[int] | None:
        # A batch routes as a whole: its first prompt decides.
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return None

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The engine's keys for these tokens: a salted prompt's blocks are its tenant's alone there too."""
        return hash_prompt_blocks(token_ids, self.block_size, (cache_salt,) if cache_salt else ())

"""A model folder's config, read without transformers' auto classes where that is exact.

``AutoConfig`` imports the model type's config module, and in transformers 5 every one of those
pulls in the model-loading stack down to ``torch.distributed.tensor``: 1.7 s of a 2-core start, for
a handful of numbers in config.json. So ``load_config`` reads config.json itself when it is a Llama
config that states every field the native model reads (nothing left to transformers' class defaults)
and uses a RoPE type computed here. Anything else goes through ``AutoConfig``, unchanged. It returns
what AutoConfig would for such folders (tests/test_model_files.py compares them). The tokenizer, which
the router loads too, is kvpilot.common.tokenizer's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["load_config", "read_plain_config"]

# Fields the native Llama model, the loader and the engine read that LlamaConfig would otherwise
# fill with its own defaults. A config.json missing one is left to AutoConfig.
_REQUIRED_LLAMA_FIELDS = (
    "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
    "eos_token_id",
)
# RoPE types the native model computes itself (rope_inv_freq); others need transformers' config object
_NATIVE_ROPE_TYPES = {"default", "linear", "dynamic", "llama3"}


def _rope_type(d: dict[str, Any]) -> str | None:
    """The RoPE type a config.json asks for, or None when it gives no base frequency."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        return None
    if "rope_theta" not in params and "rope_theta" not in d:
        return None
    return params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"


def read_plain_config(path: Path) -> SimpleNamespace | None:
    """config.json as attributes, when it is a Llama config that needs no class defaults; else None."""
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # AutoConfig reports it
    if not isinstance(d, dict) or d.get("model_type") != "llama":
        return None
    missing = [k for k in _REQUIRED_LLAMA_FIELDS if k not in d]
    if missing or _rope_type(d) not in _NATIVE_ROPE_TYPES:
        logger.debug("config.json in %s is read by AutoConfig (missing %s)", path, missing)
        return None
    # what LlamaConfig derives when these are absent, so that both paths agree
    d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    d.setdefault("attention_bias", False)
    d.setdefault("mlp_bias", False)
    return SimpleNamespace(**d)


def load_config(path: Path) -> Any:
    """The folder's model config: plain attributes where exact (see the module doc), else AutoConfig's."""
    plain = read_plain_config(path)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


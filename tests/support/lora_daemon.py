"""Adapters for the daemon's LoRA tests, made for a served model without loading it, and a stand-in engine.

`support.lora_adapters.write_adapter` reads an HF model's Linear modules for their names and shapes only; a
`Skeleton` gives it those from the model's config.json with weightless (meta) modules, so a test need not
import transformers or hold the weights (5 s and 0.5 GB for SmolLM2 otherwise).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvpilot.daemon.engine.lora import LoRAAdapterError, LoRARequest


class Skeleton:
    """A Llama-layout decoder's projections (names and shapes as in HF), with no weights."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    @classmethod
    def of(cls, model_folder: Path) -> Skeleton:
        return cls(json.loads((model_folder / "config.json").read_text()))

    def named_modules(self) -> Iterator[tuple[str, torch.nn.Module]]:
        c = self.config
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        head_dim = c.get("head_dim") or hidden // heads
        kv = c.get("num_key_value_heads", heads) * head_dim
        shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv, hidden),
                  "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
                  "mlp.gate_proj": (c["intermediate_size"], hidden), "mlp.up_proj": (c["intermediate_size"], hidden),
                  "mlp.down_proj": (hidden, c["intermediate_size"])}
        for i in range(c["num_hidden_layers"]):
            for name, (out_f, in_f) in shapes.items():
                yield f"model.layers.{i}.{name}", torch.nn.Linear(in_f, out_f, bias=False, device="meta")


def write_raw_adapter(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """An adapter folder with exactly these contents: for adapters write_adapter will not make (an LM-head
    target, say)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "bias": "none", **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


class FakeLoRAEngine:
    """Stands in for LLMEngine where only adapter calls matter: no model, no requests. add_lora takes
    `load_seconds` (a real load reads and checks files) and refuses folders named 'bad'."""

    def __init__(self, config: Any, load_seconds: float = 0.0) -> None:
        self.config = config
        self.tokenizer = None
        self.model_name = "fake"
        self.max_model_len = 64
        self.vocab_size = 16
        self.load_seconds = load_seconds
        self.loras: dict[int, LoRARequest] = {}
        self.call_threads: list[str] = []

    def warmup(self) -> None:
        pass

    def pause_kv_cache_mapping_while(self, busy: Any) -> None:
        pass

    def wait_for_kv_cache_mapped(self, num_blocks: int | None = None) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False

    def step(self) -> list:
        return []

    def get_stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_total_blocks=4, max_loras=1, lora_running=(), lora_waiting=())

    def add_lora(self, lora_request: LoRARequest) -> bool:
        self.call_threads.append(threading.current_thread().name)
        time.sleep(self.load_seconds)
        if Path(lora_request.lora_path).name == "bad":
            raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r}: bad weights", "lora_path")
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        self.call_threads.append(threading.current_thread().name)
        return self.loras.pop(lora_int_id, None) is not None

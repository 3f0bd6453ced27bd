"""PEFT-format LoRA adapters with random weights for a base HF model, written as PEFT saves them, and the
reference: the base model with an adapter merged in (W + scale * B @ A), which HF transformers then runs."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(?P<name>[a-z_]+)$")


def write_adapter(folder: Path, hf_model: Any, *, rank: int, alpha: float | None = None,
                  targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0, std: float = 0.05,
                  fmt: str = "safetensors", use_rslora: bool = False, extra_config: dict | None = None) -> Path:
    """An adapter of ``rank`` on ``targets`` of every layer of ``hf_model`` (random A and B: PEFT starts B at
    zero, which would change nothing), saved in ``folder`` as ``adapter_model.safetensors`` or ``.bin``."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in hf_model.named_modules():
        m = _MODULE.search(name)
        if m is None or m.group("name") not in targets or not isinstance(module, torch.nn.Linear):
            continue
        out_f, in_f = module.weight.shape
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * std
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * std
    assert tensors, f"no module of {targets} in the model"
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
              "target_modules": list(targets), "bias": "none", "use_rslora": use_rslora,
              "base_model_name_or_path": "tiny", "task_type": "CAUSAL_LM", "modules_to_save": None,
              **(extra_config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(folder / "adapter_model.safetensors"))
    else:
        torch.save(tensors, folder / "adapter_model.bin")
    return folder


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = json.loads((folder / "adapter_config.json").read_text())
    path = folder / "adapter_model.safetensors"
    if path.exists():
        from safetensors.torch import load_file

        return config, load_file(str(path))
    return config, torch.load(folder / "adapter_model.bin", weights_only=True)


def merged(hf_model: Any, folder: Path) -> Any:
    """A copy of ``hf_model`` with the adapter in ``folder`` merged into its weights, in float32."""
    config, tensors = read_adapter(folder)
    r = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    model = copy.deepcopy(hf_model).to(torch.float32)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            modules[name].weight.add_(scale * (b.float() @ a.float()))
    return model.eval()


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """HF's own greedy continuation of ``prompt``, EOS included (the engine runs with ignore_eos): a plain
    argmax loop over full forwards, since ``generate``'s min_new_tokens would mask EOS out."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]

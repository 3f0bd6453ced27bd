"""Sharded HF checkpoints (model.safetensors.index.json + model-0000N-of-0000M.safetensors) load as the
unsharded save does: same prompt logprobs and tokens. Only the shards the index names are read, and a
missing one is a ValueError naming the model and the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(unsharded folder, sharded folder) of one tiny random Qwen3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      num_hidden_layers=3, vocab_size=256, max_position_embeddings=128, initializer_range=0.08,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    tokenizer = resolve_model_path("builtin://smollm2-135m")  # any tokenizer does: the tests feed ids
    folders = []
    for name, shard in (("single", "100MB"), ("sharded", "50KB")):
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder, max_shard_size=shard)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / f, folder / f)
        folders.append(folder)
    return folders[0], folders[1]


def _run(folder: Path) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1, logprobs=1, ignore_eos=True)
    prompts = [[5, 17, 200, 33, 41, 90, 7, 8, 250, 3], [9, 9, 100, 64]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for prompt, out in zip(prompts, outs, strict=True):
        toks = list(out.outputs[0].token_ids)
        lps = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        lps += [out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(toks)]
        rows.append((toks, lps))
    return rows


def test_sharded_loads_as_unsharded(saved: tuple[Path, Path]) -> None:
    single, sharded = saved
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert (sharded / "model.safetensors.index.json").is_file() and len(shards) > 2, shards
    assert not (single / "model.safetensors.index.json").exists()
    assert _run(sharded) == _run(single)


def test_only_indexed_shards_are_read(saved: tuple[Path, Path], tmp_path: Path) -> None:
    """A stray *.safetensors beside the index (Mistral repos ship consolidated.safetensors) is not loaded."""
    from safetensors.torch import save_file

    folder = tmp_path / "m"
    shutil.copytree(saved[1], folder)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(folder / "consolidated.safetensors"))
    assert _run(folder) == _run(saved[0])


def test_missing_shard_names_model_and_file(saved: tuple[Path, Path], tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(saved[1], folder)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(weight_map.values()))[1]
    (folder / victim).unlink()
    with pytest.raises(ValueError, match=rf"model '{folder}'.*{victim}.*missing"):
        LLM(model=str(folder), dtype="float32", num_kv_blocks=16)

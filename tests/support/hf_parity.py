"""What the architecture parity tests share: tiny random-weight HF models saved for kvpilot's loader, token
prompts, and the comparison of kvpilot's logprobs and greedy tokens with HF's own forward pass."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.sampling_params import SamplingParams

ATOL = 1e-3  # prompt and sampled logprobs against HF's log-softmax, float32
TIE = 1e-4  # a greedy token may differ from HF's argmax only where both are this close
WINDOW = 8  # the tiny models' sliding window: the prompts span several windows and 16-token blocks


def copy_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer files into ``folder``: any tokenizer does, the tests feed token ids."""
    builtin = resolve_model_path("builtin://smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, folder / name)


def save_tiny(config: Any, model_class: type, folder: Path, perturb: Callable[[str], bool]) -> Any:
    """A seeded float32 HF model of ``config`` saved into ``folder`` with a tokenizer; the parameters that
    ``perturb`` names get random offsets, since HF initializes biases to 0 and norms to 1 (or 0), where they
    would count for nothing."""
    torch.manual_seed(0)
    hf = model_class(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if perturb(name):
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(folder)
    copy_tokenizer(folder)
    return hf


def tiny_models(root: Callable[[str], Path], configs: Callable[[], dict[str, Callable[[], tuple[Any, type]]]],
                perturb: Callable[[str], bool]) -> Callable[[str], tuple[Path, Any]]:
    """name -> (saved folder, HF model) of ``configs()[name]`` (an HF config and model class), each built once
    into ``root(name)`` (a module fixture's ``tmp_path_factory.mktemp``) with ``save_tiny``."""
    cache: dict[str, tuple[Path, Any]] = {}

    def build(name: str) -> tuple[Path, Any]:
        if name not in cache:
            cfg, cls = configs()[name]()
            folder = root(name)
            cache[name] = (folder, save_tiny(cfg, cls, folder, perturb))
        return cache[name]

    return build


def token_prompts(seed: int = 1, vocab: int = 256) -> list[list[int]]:
    """Three prompts of 50, 37 and 41 tokens; the third shares two 16-token blocks with the first, so a
    second pass hits the prefix cache."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(3, vocab, (50,), generator=gen).tolist()
    return [first, torch.randint(3, vocab, (37,), generator=gen).tolist(),
            first[:32] + torch.randint(3, vocab, (9,), generator=gen).tolist()]


def max_logprob_error(llm: LLM, hf: Any, prompts: list[list[int]], steps: int = 4) -> float:
    """Max |logprob - HF's| over every prompt and generated token; asserts the greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, prompt_logprobs=1, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        gen = list(out.outputs[0].token_ids)
        assert len(gen) == steps
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt + gen])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            worst = max(worst, abs(out.prompt_logprobs[i][prompt[i]].logprob - float(ref[i - 1, prompt[i]])))
        for j, tok in enumerate(gen):
            p = len(prompt) + j - 1
            best = int(ref[p].argmax())
            assert tok == best or float(ref[p, best] - ref[p, tok]) < TIE, f"greedy token {j}: {tok} != HF's {best}"
            worst = max(worst, abs(out.outputs[0].logprobs[j][tok].logprob - float(ref[p, tok])))
    return worst

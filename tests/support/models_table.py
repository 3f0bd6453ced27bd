"""The README's models table, made from the engine's MODEL_REGISTRY (what the loader accepts) and the GGUF
architectures kvpilot.common.model_source converts.

    .venv/bin/python tests/support/models_table.py     # rewrite the row in README.md (`make readme`)
    tests/test_model_archs.py checks that the row is current.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TARGET = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- models:start -->", "<!-- models:end -->"

# per family: its name, HF classes, notes, the GGUF architecture llama.cpp writes it as (or None), and
# whether it is a mixture of experts (their experts load float weights or GGUF blocks, not the checkpoint
# formats). A registered class no family lists still shows, under its own name.
FAMILIES: tuple[tuple[str, tuple[str, ...], str, str | None, bool], ...] = (
    ("Llama", ("LlamaForCausalLM",), "e.g. SmolLM2, Llama 3", "llama", False),
    ("Mistral", ("MistralForCausalLM",), "", "mistral", False),
    ("Qwen2", ("Qwen2ForCausalLM",), "e.g. Qwen2.5", "qwen2", False),
    ("Qwen3", ("Qwen3ForCausalLM",), "dense", "qwen3", False),
    ("Gemma 2", ("Gemma2ForCausalLM",), "attention and final logit soft-capping", "gemma2", False),
    ("Gemma 3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), "text only", "gemma3", False),
    ("Phi-3", ("Phi3ForCausalLM",), "LongRoPE, partial rotary (e.g. Phi-4-mini)", "phi3", False),
    ("OLMo 2", ("Olmo2ForCausalLM",), "", None, False),
    ("Mixtral", ("MixtralForCausalLM",), "mixture of experts", "mixtral", True),
    ("Qwen2-MoE", ("Qwen2MoeForCausalLM",), "shared expert", "qwen2moe", True),
    ("Qwen3-MoE", ("Qwen3MoeForCausalLM",), "e.g. Qwen3-30B-A3B", "qwen3moe", True),
    ("gpt-oss", ("GptOssForCausalLM",), "bfloat16 weights, not MXFP4", None, True),
)
CHECKPOINT_QUANT = "FP8, AWQ, GPTQ"  # the HF checkpoint formats the dense linear layers load


def _quantization(gguf_arch: str | None, moe: bool) -> str:
    from kvpilot.common.model_source import _GGUF_ARCHS

    parts = ["GGUF"] if gguf_arch is not None and gguf_arch in _GGUF_ARCHS else []
    if not moe:
        parts.append(CHECKPOINT_QUANT)
    return ", ".join(parts) or "float only"


def table(registry: dict[str, object]) -> str:
    lines = ["| family | HF architectures | notes | quantized weights |", "|---|---|---|---|"]
    listed: set[str] = set()
    for family, classes, note, gguf_arch, moe in FAMILIES:
        names = [c for c in classes if c in registry]
        listed |= set(names)
        if names:
            lines.append(f"| {family} | {', '.join(f'`{c}`' for c in names)} | {note} | "
                         f"{_quantization(gguf_arch, moe)} |")
    lines += [f"| `{c}` | `{c}` | | |" for c in sorted(registry) if c not in listed]
    return "\n".join(lines)


def section(registry: dict[str, object]) -> str:
    return f"{START}\n{table(registry)}\n{END}"


def rewrite(doc: str, registry: dict[str, object]) -> str:
    return re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: section(registry), doc, flags=re.S)


def main() -> int:
    from kvpilot.daemon.engine.models import MODEL_REGISTRY

    doc = TARGET.read_text(encoding="utf-8")
    if START not in doc or END not in doc:
        print(f"{TARGET} lacks {START} ... {END}", file=sys.stderr)
        return 1
    TARGET.write_text(rewrite(doc, dict(MODEL_REGISTRY)), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

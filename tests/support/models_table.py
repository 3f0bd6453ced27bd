"""The README's "architectures" row, made from the engine's MODEL_REGISTRY (what the loader accepts).

    .venv/bin/python tests/support/models_table.py     # rewrite the row in README.md (`make readme`)
    tests/test_model_archs.py checks that the row is current.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TARGET = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- models:start -->", "<!-- models:end -->"

# per family: its name and examples; the HF class names come from the registry. A registered class no
# family lists still shows, under its own name.
FAMILIES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("Llama", ("LlamaForCausalLM",), "e.g. SmolLM2, Llama 3"),
    ("Mistral", ("MistralForCausalLM",), ""),
    ("Qwen2", ("Qwen2ForCausalLM",), "e.g. Qwen2.5"),
    ("Qwen3", ("Qwen3ForCausalLM",), "dense"),
    ("Gemma 2", ("Gemma2ForCausalLM",), "attention and final logit soft-capping"),
    ("Gemma 3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), "text only"),
    ("Phi-3", ("Phi3ForCausalLM",), "LongRoPE"),
    ("OLMo 2", ("Olmo2ForCausalLM",), ""),
    ("Mixtral", ("MixtralForCausalLM",), "mixture of experts"),
    ("Qwen2-MoE", ("Qwen2MoeForCausalLM",), "shared expert"),
    ("Qwen3-MoE", ("Qwen3MoeForCausalLM",), "e.g. Qwen3-30B-A3B"),
    ("gpt-oss", ("GptOssForCausalLM",), "bfloat16 weights, not MXFP4"),
)


def row(registry: dict[str, object]) -> str:
    parts: list[str] = []
    listed: set[str] = set()
    for family, classes, note in FAMILIES:
        names = [c for c in classes if c in registry]
        listed |= set(names)
        if names:
            inner = ", ".join(f"`{c}`" for c in names) + (f", {note}" if note else "")
            parts.append(f"{family} ({inner})")
    parts += [f"`{c}`" for c in sorted(registry) if c not in listed]
    return ", ".join(parts)


def section(registry: dict[str, object]) -> str:
    return f"{START}{row(registry)}{END}"


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

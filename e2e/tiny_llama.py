"""The multi-node scenario's model and its reference answers: a tiny random Llama (8 query heads, 4 KV heads,
2 layers, float32) written as an HF folder with the tests' writer (tests/support/hf_parity.py), then the
greedy answers of the offline `LLM` (one process, one rank) to the scenario's prompts, as JSON.

Run as a child (`python e2e/tiny_llama.py FOLDER OUT.json`): torch stays out of the e2e's own process, whose
event loop serves the API emulator.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # workload.py, run by path like reference.py

# Settings the daemons get too (multinode_scenario.py): every one that could change the numbers.
DTYPE = "float32"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 64
MAX_TOKENS = 12


def write_model(folder: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.hf_parity import save_tiny

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    save_tiny(cfg, LlamaForCausalLM, folder, lambda n: "norm" in n)


def reference(folder: Path, prompts: list[str]) -> list[dict]:
    from kvpilot.daemon.engine import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype=DTYPE, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=NUM_KV_BLOCKS, num_threads=1, device="cpu")
    # As the e2e client asks: greedy, max_tokens, stopping at EOS like the daemons do.
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    return [{"text": o.outputs[0].text, "tokens": list(o.outputs[0].token_ids),
             "finish_reason": o.outputs[0].finish_reason} for o in outs]


def main(folder: str, out: str) -> int:
    import workload

    path = Path(folder)
    if not (path / "config.json").exists():
        write_model(path)
    result = {f"mn-{i}": answer for i, answer in enumerate(reference(path, list(workload.PROMPTS)))}
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)  # whole or absent, never half written
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

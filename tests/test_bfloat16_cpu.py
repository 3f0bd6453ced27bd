"""The native model in bfloat16 on the CPU: native attention over a bfloat16 cache, prepacked bfloat16
GEMMs where oneDNN has them, native RMSNorm and SiLU-and-multiply that round as HF's bfloat16 modules do.

A bfloat16 model cannot match float32 to float32's tolerance, and HF's own bfloat16 run is not a reference to
equal bit for bit either (another order of operations rounds differently). What it must do is stay as close
to the float32 logits as HF's bfloat16 run does, and pick the same greedy tokens where HF's bfloat16 and
float32 runs agree with each other by a clear margin."""

from __future__ import annotations

import pytest
import torch

from kvpilot.common.model_source import resolve_model_path
from kvpilot.daemon.engine import LLM, SamplingParams
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.loader import load_model
from kvpilot.daemon.engine.runner import ModelRunner, SeqBatchEntry
from kvpilot.kernels import cpu_native
from kvpilot.kernels import ops as kernels

MODEL = "builtin://smollm2-135m"
BLOCK = 16
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea, the wind and the long grey waves that roll onto the shore at night.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg = EngineConfig(model=MODEL, dtype="bfloat16", num_kv_blocks=48, block_size=BLOCK)
    loaded = load_model(cfg)
    assert loaded.dtype == torch.bfloat16
    r = ModelRunner(cfg, loaded)
    r.init_kv_cache(r.num_blocks_for_budget())
    return r


@pytest.fixture(scope="module")
def hf_logits(runner: ModelRunner) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Per prompt: its ids and HF's logits at every position, in float32 and in bfloat16."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(MODEL)), dtype=torch.float32).eval()
    tok = runner.loaded.tokenizer
    out = []
    with torch.inference_mode():
        ids_list = [list(tok(text)["input_ids"]) for text in PROMPTS]
        f32 = [hf(torch.tensor([ids])).logits[0].float() for ids in ids_list]
        hf = hf.to(torch.bfloat16)
        bf16 = [hf(torch.tensor([ids])).logits[0].float() for ids in ids_list]
    for ids, a, b in zip(ids_list, f32, bf16, strict=True):
        out.append((ids, a, b))
    return out


def test_the_bfloat16_model_runs_the_native_paths(runner: ModelRunner) -> None:
    if not cpu_native.available():
        pytest.skip("no C compiler for the native CPU kernels")
    k_cache = runner.k_caches[0]
    assert k_cache.dtype == torch.bfloat16  # "auto" KV cache: the model's dtype
    query = torch.zeros(1, 9, 64, dtype=torch.bfloat16)
    assert kernels.attention_backend_for(query, k_cache) == "cpu"
    x = torch.randn(3, 576).bfloat16()
    assert cpu_native.rms_norm(x, torch.ones(576, dtype=torch.bfloat16), 1e-5) is not None
    assert cpu_native.silu_mul(torch.randn(3, 3072).bfloat16()) is not None


def test_bfloat16_logits_stay_as_close_to_float32_as_hf_bfloat16(runner: ModelRunner, hf_logits) -> None:
    # the last prompt's first half goes in as one chunk (the prefill kernel), every other position one token
    # a step (the decode kernel), all prompts in the same batches; every position's logits are compared
    ours_err, hf_err, agree, compared = [], [], 0, 0
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(PROMPTS))]
    chunk = [1] * (len(PROMPTS) - 1) + [len(hf_logits[-1][0]) // 2]
    done = [0] * len(PROMPTS)
    while any(n < len(ids) for n, (ids, _, _) in zip(done, hf_logits, strict=True)):
        live = [j for j, (ids, _, _) in enumerate(hf_logits) if done[j] < len(ids)]
        out = runner.execute([SeqBatchEntry(hf_logits[j][0][done[j]: done[j] + chunk[j]], done[j], tables[j], True)
                              for j in live])
        for j, logits in zip(live, out, strict=True):
            done[j] += chunk[j]
            chunk[j] = 1
            _, f32, bf16 = hf_logits[j]
            pos = done[j] - 1
            ours = logits.float()
            ours_err.append((ours - f32[pos]).abs().max().item())
            hf_err.append((bf16[pos] - f32[pos]).abs().max().item())
            top2 = f32[pos].topk(2).values
            if bf16[pos].argmax() == f32[pos].argmax() and top2[0] - top2[1] > 0.5:  # a clear choice
                compared += 1
                agree += int(ours.argmax() == f32[pos].argmax())
    # bfloat16 keeps 8 bits of mantissa: logits of O(10) move by O(0.1-1) against float32, for HF as for us,
    # and single positions swing either way (measured: 0.3-1.7 here against HF's 0.3-1.6)
    assert max(hf_err) > 0.01, "HF's bfloat16 run did not differ from float32: the comparison is void"
    assert max(ours_err) <= 2 * max(hf_err), (ours_err, hf_err)
    assert sum(ours_err) / len(ours_err) <= 1.5 * sum(hf_err) / len(hf_err), (ours_err, hf_err)
    assert compared >= 20 and agree == compared


def test_bfloat16_engine_generates_the_same_alone_and_in_a_batch() -> None:
    # greedy in bfloat16 through the whole engine: a request's tokens do not depend on its batch neighbours
    # beyond what rounding allows, and every block is back in the pool after the batch
    llm = LLM(model=MODEL, dtype="bfloat16", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    batch = llm.generate(PROMPTS, params)
    assert [len(o.outputs[0].token_ids) for o in batch] == [12] * len(PROMPTS)
    assert batch[0].outputs[0].token_ids[:6] == alone[:6]
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0

"""Multi-LoRA in the engine, against HF transformers running the base with each adapter merged in
(W + alpha/r * B @ A, float32): a batch mixing the base and three adapters (ranks 4, 8, 16) gives every
request the merged model's greedy tokens, on tiny random models of the architectures whose layers differ
(Llama; Phi-3's fused q|k|v and gate|up; Gemma 3's sandwich norms and GeGLU; Qwen3's q/k norms). Then the
scheduler's slot limit, the prefix cache, preemption, n > 1, the host LRU and every bad adapter."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.lora import LoRAAdapterError, LoRANotEnabled, LoRARequest
from kvpilot.daemon.engine.sampling_params import SamplingParams
from support.engine import all_free
from support.hf_parity import save_tiny
from support.lora_adapters import ALL_TARGETS, hf_greedy, merged, write_adapter

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "initializer_range": 0.08, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
STEPS = 8
PROMPTS = [[5, 17, 33, 90, 4, 61, 7, 200, 13], [9, 8, 7, 6, 5, 4, 3, 3, 99, 100, 101], [50] * 20 + [7, 9],
           [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94]]
# (rank, targets) of the three adapters: all seven projections; attention q and v only; the MLP only
ADAPTERS = [(4, ALL_TARGETS), (8, ("q_proj", "v_proj")), (16, ("gate_proj", "up_proj", "down_proj"))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


def _configs() -> dict[str, Callable[[], tuple[Any, type, tuple[str, ...] | None]]]:
    """name -> (HF config, model class, the fused target names when the architecture fuses projections)."""
    import transformers as tf

    return {
        "llama": lambda: (tf.LlamaConfig(**TINY, num_hidden_layers=2), tf.LlamaForCausalLM, None),
        "phi3": lambda: (tf.Phi3Config(**{k: v for k, v in TINY.items() if k != "head_dim"}, num_hidden_layers=2),
                         tf.Phi3ForCausalLM, ("qkv_proj", "gate_up_proj", "o_proj", "down_proj")),
        "gemma3": lambda: (tf.Gemma3TextConfig(**TINY, num_hidden_layers=2, sliding_window=8, query_pre_attn_scalar=16,
                                               layer_types=["sliding_attention", "full_attention"]),
                           tf.Gemma3ForCausalLM, None),
        "qwen3": lambda: (tf.Qwen3Config(**TINY, num_hidden_layers=2), tf.Qwen3ForCausalLM, None),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any, list[Path]]]:
    """name -> (model folder, HF model, three adapter folders), built once per module."""
    cache: dict[str, tuple[Path, Any, list[Path]]] = {}

    def build(name: str) -> tuple[Path, Any, list[Path]]:
        if name not in cache:
            cfg, cls, fused = _configs()[name]()
            folder = tmp_path_factory.mktemp(name)
            hf = save_tiny(cfg, cls, folder, lambda n: "norm" in n or n.endswith(".bias"))
            adapters = []
            for i, (rank, targets) in enumerate(ADAPTERS):
                if fused is not None:  # Phi-3's adapters target its fused modules
                    targets = fused if i == 0 else fused[:1] if i == 1 else fused[1::3][:1] + ("down_proj",)
                adapters.append(write_adapter(tmp_path_factory.mktemp(f"{name}-lora{rank}"), hf, rank=rank,
                                              targets=targets, seed=rank, std=0.1))
            cache[name] = (folder, hf, adapters)
        return cache[name]

    return build


def _requests(adapters: list[Path]) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(adapters)]


def _llm(folder: Path, **kw: Any) -> LLM:
    kw = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16, "dtype": "float32", "num_kv_blocks": 64, **kw}
    return LLM(str(folder), **kw)


def _tokens(outs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _generate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None],
              params: SamplingParams = GREEDY) -> list[list[int]]:
    return _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                lora_request=loras))


@pytest.fixture(scope="module")
def references(tiny: Callable[[str], tuple[Path, Any, list[Path]]]) -> Callable[[str], list[list[int]]]:
    """name -> HF's greedy tokens: prompt 0 on the base, prompt i on the base merged with adapter i."""
    cache: dict[str, list[list[int]]] = {}

    def build(name: str) -> list[list[int]]:
        if name not in cache:
            _, hf, adapters = tiny(name)
            cache[name] = [hf_greedy(hf, PROMPTS[0], STEPS)] + [
                hf_greedy(merged(hf, adapters[i]), PROMPTS[i + 1], STEPS) for i in range(3)]
        return cache[name]

    return build


@pytest.mark.parametrize("name", list(_configs()))
def test_mixed_batch_matches_hf_merged(name: str, tiny, references) -> None:
    folder, hf, adapters = tiny(name)
    refs = references(name)
    # the adapters must matter: each merged model's tokens differ from the base's on the same prompt
    assert all(hf_greedy(hf, PROMPTS[i + 1], STEPS) != refs[i + 1] for i in range(3))
    llm = _llm(folder)
    reqs = _requests(adapters)
    assert _generate(llm, PROMPTS, [None, *reqs]) == refs
    # each adapter alone gives what it gave inside the mixed batch
    for i, req in enumerate(reqs):
        assert _generate(llm, [PROMPTS[i + 1]], [req]) == [refs[i + 1]]
    assert all_free(llm)


def test_more_adapters_than_slots_wait_their_turn(tiny, references) -> None:
    """max_loras=1: three adapters and the base in one call; each step holds one adapter, all finish right."""
    folder, _, adapters = tiny("llama")
    llm = _llm(folder, max_loras=1)
    seen: list[tuple[str, ...]] = []
    step = llm.engine.step

    def watching_step():  # the scheduler may never run two adapters in one step
        outs = step()
        seen.append(llm.engine.get_stats().lora_running)
        return outs

    llm.engine.step = watching_step  # type: ignore[method-assign]
    reqs = _requests(adapters)
    prompts = [PROMPTS[0], *PROMPTS[1:], PROMPTS[1]]
    assert _generate(llm, prompts, [None, *reqs, reqs[0]]) == [*references("llama"), references("llama")[1]]
    assert max(len(s) for s in seen) == 1 and {n for s in seen for n in s} == {"adapter0", "adapter1", "adapter2"}
    assert all_free(llm)


def test_prefix_cache_never_shared_across_adapters(tiny) -> None:
    folder, _, adapters = tiny("llama")
    llm = _llm(folder)
    a, b = _requests(adapters)[:2]
    prompt = {"prompt_token_ids": list(range(3, 51))}  # three full 16-token blocks
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False, lora_request=a)[0]
    again = llm.generate(prompt, params, use_tqdm=False, lora_request=a)[0]
    other = llm.generate(prompt, params, use_tqdm=False, lora_request=b)[0]
    base = llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_adapters(tiny, references, mode: str) -> None:
    """A cache too small for the batch: sequences are preempted and resumed with their adapters."""
    folder, _, adapters = tiny("llama")
    llm = _llm(folder, num_kv_blocks=6, block_size=8, preemption_mode=mode, swap_space=0.01,
               enable_prefix_caching=False)
    reqs = _requests(adapters)
    assert _generate(llm, PROMPTS, [None, *reqs]) == references("llama")
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert all_free(llm)


def test_n_sequences_share_the_adapter(tiny, references) -> None:
    folder, _, adapters = tiny("llama")
    llm = _llm(folder)
    out = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(temperature=0.0, max_tokens=STEPS, n=2,
                       ignore_eos=True), use_tqdm=False, lora_request=_requests(adapters)[1])[0]
    assert [list(o.token_ids) for o in out.outputs] == [references("llama")[2]] * 2


def test_bfloat16_close_to_the_float32_reference(tiny) -> None:
    """bfloat16 (prepacked weights, interleaved RoPE rows on the CPU): prompt logprobs with an adapter stay
    near the float32 merged model's."""
    folder, hf, adapters = tiny("llama")
    ref = merged(hf, adapters[0])
    prompt = PROMPTS[3]
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    expected = [logits[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    llm = _llm(folder, dtype="bfloat16")
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False, lora_request=_requests(adapters)[0])[0]
    got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < 0.1


def test_host_lru_reads_evicted_adapters_again(tiny, references) -> None:
    folder, _, adapters = tiny("llama")
    llm = _llm(folder, max_loras=1, max_cpu_loras=2)
    reqs = _requests(adapters)
    for req in reqs:
        assert llm.engine.add_lora(req)
    assert llm.engine.list_loras() == {2, 3}  # the first left the host cache, and its slot never held it
    assert _generate(llm, [PROMPTS[1]], [reqs[0]]) == [references("llama")[1]]
    assert 1 in llm.engine.list_loras()
    assert llm.engine.remove_lora(1) and not llm.engine.remove_lora(1)
    assert _generate(llm, [PROMPTS[1]], [reqs[0]]) == [references("llama")[1]]  # read again from its folder


def _broken(tmp_path: Path, source: Path, edit: Callable[[dict, dict], None]) -> Path:
    """A copy of adapter ``source`` with ``edit(config, tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "broken"
    shutil.copytree(source, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    edit(config, tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def _rename(tensors: dict, old: str, new: str) -> None:
    for key in [k for k in tensors if old in k]:
        tensors[key.replace(old, new)] = tensors.pop(key)


BAD = {
    "rank above the maximum": (lambda c, _t: c.update(r=32), "rank 32 is above max_lora_rank (16)"),
    "LM head": (lambda _c, t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                                      "base_model.model.lm_head.lora_B.weight": torch.zeros(256, 4)}),
                "LoRA on the LM head"),
    "embedding target": (lambda c, _t: c.update(target_modules=["embed_tokens", "q_proj"]), "LoRA on the embedding"),
    "modules_to_save": (lambda c, _t: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    "module the base lacks": (lambda _c, t: _rename(t, "self_attn.q_proj", "self_attn.w_proj"),
                              "self_attn.w_proj is not one of the base model's projections"),
    "layer the base lacks": (lambda _c, t: _rename(t, "layers.1.", "layers.7."), "the base model has 2 layers"),
    "output rows": (lambda _c, t: t.update({k: torch.zeros(100, 4) for k in t if "q_proj.lora_B" in k}),
                    "lora_B has 100 output rows, the base layer 64"),
    "input features": (lambda _c, t: t.update({k: torch.zeros(4, 70) for k in t if "q_proj.lora_A" in k}),
                       "lora_A has 70 input features, the base layer 64"),
    "missing B": (lambda _c, t: [t.pop(k) for k in list(t) if "o_proj.lora_B" in k], "lora_B is missing"),
    "DoRA": (lambda c, _t: c.update(use_dora=True), "DoRA is not supported"),
}


def test_bad_adapters_are_clear_errors_and_leak_nothing(tiny, tmp_path: Path) -> None:
    folder, _, adapters = tiny("llama")
    llm = _llm(folder)
    for i, (what, (edit, message)) in enumerate(BAD.items()):
        path = _broken(tmp_path / what.replace(" ", "_"), adapters[0], edit)
        with pytest.raises(LoRAAdapterError, match=message.replace("(", r"\(").replace(")", r"\)")):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(f"bad{i}", 10 + i, str(path)))
    for missing, message in ((tmp_path / "nowhere", "is not a directory"), (tmp_path, "adapter_config.json is missing")):
        with pytest.raises(LoRAAdapterError, match=message):
            llm.engine.add_lora(LoRARequest("missing", 99, str(missing)))
    empty = tmp_path / "empty"
    shutil.copytree(adapters[0], empty)
    (empty / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="no adapter weights"):
        llm.engine.add_lora(LoRARequest("empty", 98, str(empty)))
    # an id already in use by another adapter
    llm.engine.add_lora(LoRARequest("first", 50, str(adapters[0])))
    with pytest.raises(LoRAAdapterError, match="lora_int_id 50 is in use"):
        llm.engine.add_lora(LoRARequest("second", 50, str(adapters[1])))
    assert llm.engine.list_loras() == {50}
    assert not llm.engine.has_unfinished_requests() and all_free(llm)


def test_adapter_without_enable_lora_is_refused(tiny) -> None:
    folder, _, adapters = tiny("llama")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=16)
    with pytest.raises(LoRANotEnabled, match="enable_lora"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=_requests(adapters)[0])
    with pytest.raises(ValueError, match="lora_request: got 2 for 1 prompts"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False, lora_request=[None, None])


def test_adapter_read_from_a_bin_file_with_rslora(tiny, tmp_path: Path) -> None:
    folder, hf, _ = tiny("llama")
    path = write_adapter(tmp_path / "bin", hf, rank=8, targets=("q_proj", "o_proj", "down_proj"), seed=3, fmt="bin",
                         use_rslora=True)
    llm = _llm(folder)
    assert _generate(llm, [PROMPTS[3]], [LoRARequest("bin", 1, str(path))]) == \
        [hf_greedy(merged(hf, path), PROMPTS[3], STEPS)]


def test_speculative_decoding_with_adapters(tiny, references) -> None:
    """Drafts are verified by the model with each row's adapter: greedy tokens stay exactly the merged model's."""
    folder, _, adapters = tiny("llama")
    llm = _llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert _generate(llm, PROMPTS, [None, *_requests(adapters)]) == references("llama")
    assert llm.engine.get_stats().spec_decode_num_drafts > 0
    assert all_free(llm)


def test_structured_output_with_an_adapter(tiny) -> None:
    from kvpilot.daemon.engine.structured.spec import StructuredOutputSpec

    folder, _, adapters = tiny("llama")
    llm = _llm(folder)
    choices = ["abcabc", "cbacba", "bbbaaa"]  # single-letter tokens, which SmolLM2's tokenizer has
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputSpec.choice(choices))
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3, params, use_tqdm=False,
                        lora_request=[None, *_requests(adapters)[:2]])
    assert all(o.outputs[0].text in choices for o in outs)
    assert all_free(llm)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """HF's SmolLM2-135M on the builtin's weights (the dequantized copy the loader caches) and an adapter."""
    from transformers import AutoModelForCausalLM

    from kvpilot.common.model_source import resolve_model_path

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path("builtin://smollm2-135m")),
                                              dtype=torch.float32).eval()
    adapter = write_adapter(tmp_path_factory.mktemp("smollm2-lora"), hf, rank=8, seed=5, std=0.05,
                            targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    return hf, adapter


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_real_weights_smollm2(smollm2, quantization: str) -> None:
    """Real weights, float32: on the dequantized weights and on the GGUF file's own Q4_1 blocks, the adapter's
    greedy tokens are HF's with the adapter merged (which differ from the base's)."""
    hf, adapter = smollm2
    prompt = list(range(600, 640))
    ref = hf_greedy(merged(hf, adapter), prompt, STEPS)
    assert ref != hf_greedy(hf, prompt, STEPS)
    llm = LLM("builtin://smollm2-135m", dtype="float32", quantization=quantization, enable_lora=True,
              max_lora_rank=8, num_kv_blocks=32)
    assert _generate(llm, [prompt], [LoRARequest("real", 1, str(adapter))]) == [ref]

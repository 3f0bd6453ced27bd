"""The FP8, AWQ and GPTQ linear methods: tiny random Llama and Qwen3 models whose float checkpoints are rewritten in
each published layout (tests/support/quant_formats.py), loaded with kvpilot's LLM and compared with the same
model with the weights dequantized to float32 by the format's own definition (saved as a float checkpoint).

Tolerances, on prompt and greedy-token logprobs of float32 models on the CPU:
- FP8 (``FP8_ATOL`` 1e-5): the CPU dequantizes ``weight * scale`` in float32, the very product the float
  checkpoint holds, so both models run the same weights through the same kernels (0 difference seen).
- AWQ/GPTQ against the values their Q4_1 blocks hold (``REPACK_ATOL`` 5e-5): the same weights, summed by the
  GGUF kernel in another float32 order (2-4e-6 seen).
- AWQ/GPTQ against the checkpoint's meaning ``s*(q - z)`` (``INT4_ATOL`` 2e-2): the blocks hold ``m = -s*z``
  rounded to fp16, off by at most ``2^-11 |s*z|`` a weight (``test_q4_1_repack_stays_within_the_fp16_bound``),
  which with ``z <= 16`` is at most 1/64 (for typical z ~ 8, 1/128) of the 4-bit rounding itself; that
  rounding moves these models' logprobs by 0.8-1.7 from the original float weights, so the repack's share is
  ~0.01 at most (4-6e-3 seen). A wrong nibble order, zero point or group moves them by 0.1 and more.
Greedy tokens must agree on at least 7 of 8 prompts (a near-tie may flip one).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.models.linear import Linear
from kvpilot.daemon.engine.models.parallel import ParallelContext
from kvpilot.daemon.engine.models.quantization import get_quant_method
from kvpilot.daemon.engine.sampling_params import SamplingParams
from kvpilot.kernels import fp8 as fp8_kernels
from kvpilot.kernels import fp8_reference, gguf_reference
from support import quant_formats as qf
from support.hf_parity import save_tiny
from support.triton_child import run_triton_tests_in_interpreter

FP8_ATOL = 1e-5
INT4_ATOL = 2e-2
REPACK_ATOL = 5e-5
BLOCK = (64, 64)  # block FP8's block in the tiny models: ragged at the 160-wide MLP

TINY = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 160, "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "initializer_range": 0.08, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "num_hidden_layers": 2,
        "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """arch -> the folder of a seeded float32 tiny model (built once per module)."""
    import transformers as tf

    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            cfg, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
            folder = tmp_path_factory.mktemp(arch)
            save_tiny(cfg(**TINY), cls, folder, lambda n: "norm" in n)
            built[arch] = folder
        return built[arch]

    return build


# ------------------------------------------------------------------------------------ the formats


@dataclass(frozen=True)
class Format:
    quantize: qf.Quantizer
    dequantize: qf.Dequantizer  # what the checkpoint means
    config: dict[str, Any]
    as_q4_1: qf.Dequantizer | None = None  # 4-bit: the values kvpilot's Q4_1 blocks hold (m rounded to fp16)

    @property
    def method(self) -> str:
        kind = self.config["quant_method"]
        return "fp8" if kind == "compressed-tensors" else kind


def _fp8_ct(quantize: Callable[[torch.Tensor], qf.Tensors], config: dict[str, Any]) -> Format:
    return Format(lambda _, w: quantize(w), lambda p: qf.dequant_fp8(p["weight"], p["weight_scale"]), config)


def _gptq(group: int, *, desc_act: bool, sym: bool, v1: bool) -> Format:
    def dequantize(p: qf.Tensors, q4_1: bool = False) -> torch.Tensor:
        return qf.dequant_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], v1=v1, q4_1=q4_1)

    return Format(lambda name, w: qf.gptq(w, group, desc_act=desc_act, sym=sym, v1=v1, seed=_seed(name)),
                  dequantize, qf.gptq_config(group, desc_act=desc_act, sym=sym, v1=v1),
                  lambda p: dequantize(p, q4_1=True))


def _seed(name: str) -> int:
    """One g_idx for the projections that read the same input (q|k|v, gate|up), as GPTQ's Hessian order is."""
    layer, proj = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
    reads = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
    return 10 * layer + reads[proj]


FORMATS: dict[str, Format] = {
    "fp8_channel": _fp8_ct(qf.fp8_channel, qf.fp8_ct_config("channel")),
    "fp8_tensor": _fp8_ct(qf.fp8_tensor, qf.fp8_ct_config("tensor")),
    # static per-tensor activation scales: on the CPU the activations stay float, so they change nothing there
    "fp8_static": _fp8_ct(lambda w: {**qf.fp8_tensor(w), "input_scale": torch.tensor([0.02])},
                          qf.fp8_ct_config("tensor", dynamic=False)),
    # vLLM's own FP8 serialization: quant_method "fp8" without blocks, per-tensor scales, static activations
    "fp8_vllm_static": _fp8_ct(lambda w: {**qf.fp8_tensor(w), "input_scale": torch.tensor(0.02)},
                               {"quant_method": "fp8", "activation_scheme": "static"}),
    "fp8_block": Format(lambda _, w: qf.fp8_block(w, BLOCK),
                        lambda p: qf.dequant_fp8_block(p["weight"], p["weight_scale_inv"], BLOCK),
                        qf.fp8_block_config(BLOCK)),
    "awq": Format(lambda _, w: qf.awq_gemm(w, 32),
                  lambda p: qf.dequant_awq(p["qweight"], p["qzeros"], p["scales"], 32), qf.awq_config(32),
                  lambda p: qf.dequant_awq(p["qweight"], p["qzeros"], p["scales"], 32, q4_1=True)),
    # desc_act: a random column order per input (q|k|v share one), asymmetric zero points, the classic format
    "gptq_desc_act": _gptq(32, desc_act=True, sym=False, v1=True),
    # one group per row, symmetric (z = 8: m = -8s is exact in fp16), GPTQModel's v2 zero points
    "gptq_v2_row": _gptq(-1, desc_act=False, sym=True, v1=False),
}


def _write(float_model: Callable[[str], Path], tmp_path: Path, arch: str, fmt: str,
           config: dict[str, Any] | None = None, **kw: Any) -> tuple[Path, Path, Path | None]:
    """(quantized checkpoint, its meaning in float32, and for 4-bit formats its Q4_1 values in float32)."""
    f = FORMATS[fmt]
    quant, dense, q4_1 = (tmp_path / f"{arch}-{fmt}{suffix}" for suffix in ("", "-float", "-q4_1"))
    floats = {dense: f.dequantize} | ({q4_1: f.as_q4_1} if f.as_q4_1 else {})
    qf.rewrite_checkpoint(float_model(arch), quant, f.quantize, config or f.config, floats, **kw)
    return quant, dense, q4_1 if f.as_q4_1 else None


PROMPTS = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 9, 17, 24, 31, 40, 47, 60)]


def _run(llm: LLM) -> tuple[list[list[float]], list[list[int]]]:
    """Each prompt's logprobs (its prompt tokens' and then its greedy tokens') and greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    logprobs, tokens = [], []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        gen = out.outputs[0]
        lp = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0]
        lp += [gen.logprobs[j][t].logprob for j, t in enumerate(gen.token_ids)]
        logprobs.append(lp)
        tokens.append(list(gen.token_ids))
    return logprobs, tokens


def _compare(quant: LLM, dense: LLM) -> tuple[float, int]:
    """(max |logprob difference| over the positions both saw, prompts whose greedy tokens agree)."""
    (lq, tq), (ld, td) = _run(quant), _run(dense)
    worst = 0.0
    for a, b, ta, tb in zip(lq, ld, tq, td, strict=True):
        shared = len(a) - len(ta) + next((j for j, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        worst = max([worst] + [abs(x - y) for x, y in zip(a[:shared], b[:shared], strict=True)])
    return worst, sum(a == b for a, b in zip(tq, td, strict=True))


def _llm(folder: Path, **kw: Any) -> LLM:
    return LLM(model=str(folder), dtype="float32", num_kv_blocks=64, **kw)


# ----------------------------------------------------------------------------------- whole models


CASES = [("llama", fmt) for fmt in FORMATS] + [("qwen3", "fp8_block"), ("qwen3", "gptq_desc_act")]


@pytest.mark.parametrize(("arch", "fmt"), CASES)
def test_checkpoint_matches_its_dequantized_float_model(float_model, tmp_path: Path, arch: str, fmt: str) -> None:
    quant_dir, dense_dir, q4_1_dir = _write(float_model, tmp_path, arch, fmt)
    quant, dense = _llm(quant_dir), _llm(dense_dir)
    assert quant.engine.loaded.quantization == FORMATS[fmt].method
    worst, agree = _compare(quant, dense)
    print(f"{arch} {fmt}: max |logprob difference| {worst:.2e}, greedy agreement {agree}/8")
    assert worst < (INT4_ATOL if q4_1_dir else FP8_ATOL), f"{arch} {fmt}: max |logprob difference| {worst:.2e}"
    assert agree >= 7
    if q4_1_dir is not None:  # all of that difference is the fp16 rounding of m
        worst, agree = _compare(quant, _llm(q4_1_dir))
        print(f"{arch} {fmt}: against the Q4_1 values {worst:.2e}, greedy agreement {agree}/8")
        assert worst < REPACK_ATOL and agree >= 7, f"{arch} {fmt}: against the Q4_1 values {worst:.2e}"
    # the quantized weights take less memory than the float ones (as loaded: fp8 or Q4_1 blocks)
    assert quant.engine.loaded.weight_bytes < dense.engine.loaded.weight_bytes


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_channel"])
def test_bfloat16_models_dequantize_into_bfloat16(float_model, tmp_path: Path, fmt: str) -> None:
    """A bfloat16 model on the CPU rounds ``weight * scale`` (float32) to bfloat16 once, as loading the
    float32 dequantized checkpoint into bfloat16 does: the same weights."""
    quant_dir, dense_dir, _ = _write(float_model, tmp_path, "llama", fmt)
    quant = LLM(model=str(quant_dir), dtype="bfloat16", num_kv_blocks=64)
    assert quant.engine.loaded.model.layers[0].qkv_proj.weight.dtype == torch.bfloat16
    worst, agree = _compare(quant, LLM(model=str(dense_dir), dtype="bfloat16", num_kv_blocks=64))
    assert worst < FP8_ATOL and agree == 8, worst


def test_online_fp8_is_the_per_channel_checkpoint(float_model, tmp_path: Path) -> None:
    """``quantization="fp8"`` on a float checkpoint quantizes each row as the compressed-tensors "channel"
    scheme does: the same weights as that checkpoint dequantized."""
    _, dense_dir, _ = _write(float_model, tmp_path, "llama", "fp8_channel")
    online = _llm(float_model("llama"), quantization="fp8")
    assert online.engine.loaded.quantization == "fp8"
    worst, agree = _compare(online, _llm(dense_dir))
    assert worst < FP8_ATOL and agree == 8, worst


def test_ignored_layers_stay_float(float_model, tmp_path: Path) -> None:
    """``ignore`` entries (a regex and a module name, as compressed-tensors writes them) leave those
    projections in float."""
    config = {**qf.fp8_ct_config("channel"), "ignore": ["lm_head", "re:.*self_attn.o_proj$",
                                                        "model.layers.1.mlp.down_proj"]}
    float_layers = ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj")
    quant_dir, dense_dir, _ = _write(float_model, tmp_path, "llama", "fp8_channel", config,
                                     keep_float=lambda name: name in float_layers)
    quant = _llm(quant_dir)
    first, second = quant.engine.loaded.model.layers
    assert [p.quant_method.name for p in first.projections()] == ["fp8", "none", "fp8", "fp8"]
    assert [p.quant_method.name for p in second.projections()] == ["fp8", "none", "fp8", "none"]
    worst, _ = _compare(quant, _llm(dense_dir))
    assert worst < FP8_ATOL


@pytest.mark.parametrize(("entry", "matched"), [
    ("lm_head", ""), ("o_proj", "ab"), ("model.layers.1.self_attn.o_proj", "a"), ("layers.1", "ac"),
    (r"re:.*layers\.1\..*", "ac"), ("re:model.layers.1", "abc"),  # re.match: a prefix of the name
])
def test_ignore_entries_name_whole_modules(entry: str, matched: list[str]) -> None:
    method = get_quant_method("fp8", {**qf.fp8_ct_config("channel"), "ignore": [entry]})
    names = {"a": "layers.1.self_attn.o_proj", "b": "layers.11.self_attn.o_proj", "c": "layers.1.self_attn.q_proj"}
    assert "".join(k for k, n in names.items() if method.skips(n)) == matched


def _edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    from safetensors.torch import load_file, save_file

    (st,) = folder.glob("*.safetensors")
    tensors = load_file(str(st))
    edit(tensors)
    save_file(tensors, str(st), metadata={"format": "pt"})


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


K = "model.layers.1.self_attn.k_proj"
BAD = {
    "awq_qweight_shape": ("awq", lambda t: t.update({f"{K}.qweight": t[f"{K}.qweight"][:, :-1].contiguous()}), {},
                          r"k_proj.qweight: qweight \(128, 7\) torch.int32 != expected \(128, 8\) int32"),
    "awq_no_scales": ("awq", lambda t: t.pop(f"{K}.scales"), {}, r"missing weights \['layers.1.self_attn.k_proj.scales'\]"),
    "gptq_no_qzeros": ("gptq_desc_act", lambda t: t.pop(f"{K}.qzeros"), {}, r"missing weights.*k_proj.qzeros"),
    "gptq_qweight_dtype": ("gptq_desc_act", lambda t: t.update({f"{K}.qweight": t[f"{K}.qweight"].float()}), {},
                           r"k_proj.qweight: qweight \(16, 64\) torch.float32 != expected \(16, 64\) int32"),
    "gptq_8bit": ("gptq_desc_act", lambda _: None, {"bits": 8}, r"quantization_config.bits 8 is not supported"),
    "awq_gemv": ("awq", lambda _: None, {"version": "gemv"}, r"version 'gemv' is not supported"),
    "fp8_scale_shape": ("fp8_channel", lambda t: t.update({f"{K}.weight_scale": torch.ones(3, 1)}), {},
                        r"k_proj.weight_scale: weight_scale \(3, 1\) is neither one scale nor one per row \(64\)"),
    "fp8_not_fp8": ("fp8_channel", lambda t: t.update({f"{K}.weight": t[f"{K}.weight"].float()}), {},
                    r"k_proj.weight: weight is torch.float32, expected float8_e4m3fn"),
    "fp8_block_scales": ("fp8_block", lambda t: t.update({f"{K}.weight_scale_inv": torch.ones(2, 1)}), {},
                         r"weight_scale_inv \(2, 1\) != expected \(1, 2\) \(one per 64x64 block\)"),
    "int4_compressed_tensors": ("fp8_channel", lambda _: None, {"format": "pack-quantized"},
                                r"format 'pack-quantized' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_a_clear_error(float_model, tmp_path: Path, case: str) -> None:
    fmt, edit, config, message = BAD[case]
    quant_dir, _, _ = _write(float_model, tmp_path, "llama", fmt)
    _edit_tensors(quant_dir, edit)
    if config:
        _edit_config(quant_dir, **config)
    with pytest.raises(ValueError, match=message):
        _llm(quant_dir)


def test_quantization_setting_must_match_the_checkpoint(float_model, tmp_path: Path) -> None:
    quant_dir, _, _ = _write(float_model, tmp_path, "llama", "awq")
    with pytest.raises(ValueError, match="quantization 'gptq' does not match the checkpoint's 'awq' weights"):
        _llm(quant_dir, quantization="gptq")
    with pytest.raises(ValueError, match="quantization 'awq' runs AWQ checkpoints"):
        _llm(float_model("llama"), quantization="awq")


# ----------------------------------------------------------------------------------- single layers

_NO_GROUP = object()  # shard arithmetic needs no collectives: a placeholder group


def _ranks(tp: int) -> list[ParallelContext]:
    return [ParallelContext(tp_rank=r, tp_size=tp, tp_group=_NO_GROUP if tp > 1 else None) for r in range(tp)]


def _layer_formats() -> dict[str, tuple[Callable[[torch.Tensor], qf.Tensors], qf.Dequantizer, dict[str, Any]]]:
    """name -> (quantize a weight, its dequantization, quantization_config), for single-layer tests: every
    weight quantized as one gate_proj (so with desc_act they share one g_idx, as gate and up do)."""
    return {name: ((lambda w, q=f.quantize: q("model.layers.0.mlp.gate_proj", w)), f.dequantize, f.config)
            for name, f in FORMATS.items()}


def _load(layer: Linear, parts: list[qf.Tensors]) -> Linear:
    for i, tensors in enumerate(parts):
        for name, t in tensors.items():
            layer.load(name, t, i)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tensor_parallel_ranks_hold_their_slices(fmt: str) -> None:
    """A column-split gate|up and a row-split down over 2 ranks give the dequantized weights' products: each
    method takes its rows (output-major) and columns (whole blocks and groups) of every tensor."""
    quantize, dequantize, qc = _layer_formats()[fmt]
    torch.manual_seed(5)
    gate, up, down = (torch.randn(256, 128) * 0.05, torch.randn(256, 128) * 0.05, torch.randn(128, 256) * 0.05)
    qg, qu, qd = quantize(gate), quantize(up), quantize(down)
    x, h = torch.randn(3, 128), torch.randn(3, 256)
    atol = 1e-4 if fmt.startswith("fp8") else 2e-2
    total = torch.zeros(3, 128)
    for ctx in _ranks(2):
        method = get_quant_method(qc["quant_method"] if qc["quant_method"] != "compressed-tensors" else "fp8", qc)
        gate_up = _load(Linear.column(128, [256, 256], parallel=ctx, quant_method=method), [qg, qu])
        r = slice(128 * ctx.tp_rank, 128 * (ctx.tp_rank + 1))
        got = gate_up.quant_method.apply(gate_up, x, None, None)
        want = torch.cat([x @ dequantize(qg)[r].T, x @ dequantize(qu)[r].T], -1)
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        down_proj = Linear.row(256, 128, parallel=ctx, what="intermediate_size", quant_method=method)
        if fmt == "gptq_desc_act":  # a rank's columns hold an uneven share of each scattered group
            with pytest.raises(RuntimeError, match="a tensor-parallel rank's share of desc_act groups"):
                _load(down_proj, [qd])
            continue
        down_proj = _load(down_proj, [qd])
        total += down_proj.quant_method.apply(down_proj, h[:, r], None, None)
    if fmt != "gptq_desc_act":
        torch.testing.assert_close(total, h @ dequantize(qd).T, atol=atol, rtol=0)


def test_desc_act_permutes_the_activations() -> None:
    """A random g_idx: the columns are sorted by group at load and the activations alike at apply."""
    torch.manual_seed(6)
    w = torch.randn(64, 256) * 0.05
    parts = qf.gptq(w, 64, desc_act=True, sym=False, seed=11)
    assert not torch.equal(parts["g_idx"], torch.arange(256) // 64)
    layer = _load(Linear.replicated(256, 64, quant_method=get_quant_method(
        "gptq", qf.gptq_config(64, desc_act=True, sym=False))), [parts])
    assert layer.act_perm is not None
    x, bias, res = torch.randn(4, 256), torch.randn(64), torch.randn(4, 64)
    want = res + x @ qf.dequant_gptq(**parts).T + bias
    torch.testing.assert_close(layer.quant_method.apply(layer, x, bias, res), want, atol=2e-3, rtol=0)


@pytest.mark.parametrize("fmt", ["awq", "gptq_desc_act"])
def test_int4_layers_take_bfloat16_activations(fmt: str) -> None:
    quantize, _, qc = _layer_formats()[fmt]
    torch.manual_seed(12)
    parts = quantize(torch.randn(64, 128) * 0.05)
    layer = _load(Linear.replicated(128, 64, quant_method=get_quant_method(qc["quant_method"], qc),
                                    dtype=torch.bfloat16), [parts])
    x = torch.randn(5, 128).to(torch.bfloat16)
    got = layer.quant_method.apply(layer, x, None, None)
    assert got.dtype == torch.bfloat16
    want = x.float() @ FORMATS[fmt].as_q4_1(parts).T  # type: ignore[misc]
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)  # the output's bfloat16 rounding


@pytest.mark.parametrize("fmt", ["awq", "gptq_desc_act", "gptq_v2_row"])
def test_q4_1_repack_stays_within_the_fp16_bound(fmt: str) -> None:
    """Each weight of the Q4_1 blocks is ``s*(q - z)`` but for ``m = -s*z`` rounded to fp16: within
    ``2^-11 |s*z| + 2^-25`` (half an fp16 ulp, or of its smallest subnormal)."""
    quantize, dequantize, qc = _layer_formats()[fmt]
    torch.manual_seed(7)
    parts = quantize(torch.randn(96, 128) * 0.05)
    layer = _load(Linear.replicated(128, 96, quant_method=get_quant_method(qc["quant_method"], qc)), [parts])
    got = gguf_reference.dequantize(layer.qweight.cpu(), 3, 128)
    if layer.act_perm is not None:  # back to the checkpoint's column order
        got = got[:, torch.argsort(layer.act_perm.cpu())]
    want = dequantize(parts)
    # |s*z| per weight: the weight that q = 0 would give is -s*z
    sz = dequantize({**parts, "qweight": torch.zeros_like(parts["qweight"])})
    bound = sz.abs() * 2.0**-11 + 2.0**-25
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())
    if fmt == "gptq_v2_row":  # symmetric: z = 8, and 8*s is exact in fp16
        assert torch.equal(got, want)


def test_block_fp8_refuses_a_split_through_its_blocks() -> None:
    method = get_quant_method("fp8", qf.fp8_block_config((128, 128)))
    with pytest.raises(ValueError, match=r"rows 96:192 of 384 cut through a block"):
        Linear.column(256, [384], parallel=_ranks(4)[1], quant_method=method)
    with pytest.raises(ValueError, match=r"columns 192:384 of 384 cut through a block"):
        Linear.row(384, 256, parallel=_ranks(2)[1], quant_method=method, what="intermediate_size")
    Linear.column(256, [384], parallel=_ranks(3)[1], quant_method=method)  # 128 rows a rank: whole blocks


def test_int4_refuses_columns_that_cut_q4_1_blocks() -> None:
    method = get_quant_method("awq", qf.awq_config(32))
    with pytest.raises(ValueError, match=r"columns 48:96 of 96 are not whole blocks"):
        Linear.row(96, 64, parallel=_ranks(2)[1], quant_method=method, what="intermediate_size")
    with pytest.raises(ValueError, match=r"group_size 48 is not supported"):
        get_quant_method("gptq", qf.gptq_config(48, desc_act=False, sym=True))


def test_weight_bytes_are_the_quantized_storage() -> None:
    torch.manual_seed(8)
    w = torch.randn(64, 128)
    fp8 = _load(Linear.replicated(128, 64, quant_method=get_quant_method("fp8", None)), [{"weight": w}])
    assert fp8.weight_bytes() == 64 * 128 + 64 * 4  # 1 byte a weight and a float32 scale a row
    assert fp8.weight.dtype == torch.float32  # the CPU runs it dequantized
    awq = _load(Linear.replicated(128, 64, quant_method=get_quant_method("awq", qf.awq_config(32))),
                [qf.awq_gemm(w, 32)])
    assert awq.weight_bytes() == 64 * 128 // 32 * 20  # Q4_1: 20 bytes per 32 weights


# ------------------------------------------------------------------------------------------- kernels


def _fp8_case(m: int = 7, k: int = 96, n: int = 48, dtype: torch.dtype = torch.float32):
    torch.manual_seed(9)
    x = torch.randn(m, k, dtype=dtype)
    wq, ws = fp8_reference.quantize_weight(torch.randn(n, k) * 0.1)
    return x, wq, ws


def test_fp8_reference_quantizes_activations_per_token() -> None:
    x, wq, ws = _fp8_case()
    x[2] = 0  # an all-zero row: the scale's floor keeps it finite
    bias, res = torch.randn(48), torch.randn(7, 48)
    xq, xs = fp8_reference.quantize(x)
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (7, 1)
    assert bool((xq.float().abs().amax(dim=1)[[0, 1, 3]] == 448).all())  # each row's largest value hits 448
    want = res + ((xq.float() * xs) @ (wq.float() * ws[:, None]).T + bias)
    torch.testing.assert_close(fp8_reference.linear(x, wq, ws, None, bias, res), want, rtol=1e-5, atol=1e-5)
    # a static input scale: every row divided by it, saturating
    xq, xs = fp8_reference.quantize(x, torch.tensor(0.001))
    assert bool((xs == 0.001).all()) and float(xq.float().abs().max()) == 448
    # within fp8's rounding of the float product
    exact = x @ (wq.float() * ws[:, None]).T
    assert float((fp8_reference.linear(x, wq, ws) - exact).abs().max()) < 0.1 * float(exact.abs().max())


def test_scaled_mm_path_matches_the_reference() -> None:
    """The CUDA path's call (row-wise scales, the weight column-major) run by torch's CPU _scaled_mm: the
    same numbers but for its bfloat16 output."""
    x, wq, ws = _fp8_case(k=96, n=48)
    try:
        got = fp8_kernels.scaled_mm_linear(x, wq, ws)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    want = fp8_reference.linear(x, wq, ws)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)


def test_block_dequantize_reads_each_rows_block() -> None:
    w = torch.ones(5, 6, dtype=torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    row = torch.tensor([0, 0, 1, 1, 0], dtype=torch.int32)
    got = fp8_reference.dequantize(w, scale, row, 4)
    assert got.tolist() == [[1, 1, 1, 1, 2, 2]] * 2 + [[3, 3, 3, 3, 4, 4]] * 2 + [[1, 1, 1, 1, 2, 2]]


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:

    def test_fp8_triton_kernel_under_the_interpreter() -> None:
        run_triton_tests_in_interpreter(__file__)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize(("m", "dtype", "block_k", "rows"), [
    (3, torch.float32, 64, True), (37, torch.bfloat16, 32, True), (5, torch.float32, 96, False)])
def test_triton_fp8_block_kernel_matches_the_reference(m: int, dtype: torch.dtype, block_k: int, rows: bool) -> None:
    from kvpilot.kernels import fp8_triton

    torch.manual_seed(10)
    n, k = 80, 192  # ragged against the 64-row tile
    w = (torch.randn(n, k) * 4).to(torch.float8_e4m3fn)
    scale_rows = -(-n // 16) if rows else n
    scale = torch.rand(scale_rows, -(-k // block_k)) / 100
    scale_row = (torch.arange(n) // 16).to(torch.int32) if rows else None
    x, bias, res = torch.randn(m, k, dtype=dtype), torch.randn(n, dtype=dtype), torch.randn(m, n, dtype=dtype)
    got = fp8_triton.block_linear(x, w, scale, scale_row, block_k, bias, res)
    want = fp8_reference.block_linear(x, w, scale, scale_row, block_k, bias, res)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_copy_layout_helpers_are_consistent(tmp_path: Path) -> None:
    """rewrite_checkpoint keeps everything but the projections as they were."""
    src = tmp_path / "src"
    src.mkdir()
    from safetensors.torch import load_file, save_file

    save_file({"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 32),
               "model.norm.weight": torch.ones(32)}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    qf.rewrite_checkpoint(src, tmp_path / "q", lambda _, w: qf.awq_gemm(w, 32), qf.awq_config(32),
                          {tmp_path / "f": lambda p: qf.dequant_awq(p["qweight"], p["qzeros"], p["scales"], 32)})
    q = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert set(q) == {"model.norm.weight"} | {f"model.layers.0.self_attn.q_proj.{k}" for k in ("qweight", "qzeros", "scales")}
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    assert "quantization_config" not in json.loads((tmp_path / "f" / "config.json").read_text())
    shutil.rmtree(tmp_path / "q")

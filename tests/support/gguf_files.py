"""Tiny GGUF files as llama.cpp's converter writes them: tensor names, Gemma's 1 + w norms, llama's permuted
q/k rows, mixture-of-experts metadata and stacked experts, tokenizer metadata (a small byte-level BPE or
sentencepiece vocabulary), and optionally quantized tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

# a byte-level BPE vocabulary (Qwen's kind): the 256 byte symbols, one merge, three control tokens
_BYTE_SYMBOLS = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + \
    [chr(c) for c in range(174, 256)] + [chr(256 + i) for i in range(68)]  # GPT-2's bytes_to_unicode alphabet
BPE_TOKENS = [*_BYTE_SYMBOLS, "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a sentencepiece vocabulary (Gemma's and Phi-3's kind): control tokens per model, byte fallbacks, pieces
_SPM_PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz", *(f"▁{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
SPM_SPECIALS = {
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>"],
}


def spm_tokens(kind: str) -> list[str]:
    return [*SPM_SPECIALS[kind], *(f"<0x{b:02X}>" for b in range(256)), *_SPM_PIECES]


def write_tokenizer(w: Any, arch: str) -> None:
    """Tokenizer metadata as llama.cpp writes it: BPE for Qwen, sentencepiece ("llama") for Gemma, Phi-3 and
    llama (Phi-3's vocabulary)."""
    if arch.startswith("qwen"):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(BPE_TOKENS)
        w.add_token_types([3 if t.startswith("<|") else 1 for t in BPE_TOKENS])
        w.add_token_merges(["Ġ t"])
        w.add_bos_token_id(257)
        w.add_eos_token_id(259)
        w.add_pad_token_id(257)
        w.add_add_bos_token(False)
        return
    kind = "gemma" if arch.startswith("gemma") else "phi3"
    tokens, specials = spm_tokens(kind), SPM_SPECIALS[kind]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(_SPM_PIECES))])
    unk = tokens.index("<unk>")
    w.add_token_types([2 if i == unk else 3 if t in specials else 6 if t.startswith("<0x") else 1
                       for i, t in enumerate(tokens)])
    if kind == "gemma":
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_pad_token_id(0)
    else:
        w.add_bos_token_id(1)
        w.add_eos_token_id(3)
        w.add_pad_token_id(3)
    w.add_unk_token_id(unk)
    w.add_add_bos_token(True)


# (HF tensor name, float32 weight) -> (its blocks as uint8 [rows, row_bytes], GGML type id), or None: float32
Quantizer = Callable[[str, np.ndarray], tuple[np.ndarray, int] | None]


def write_gguf(path: Path, arch: str, hf: Any, quantize: Quantizer | None = None) -> None:
    """The model as llama.cpp's convert_hf_to_gguf.py writes it: float32 tensors, or the blocks
    ``quantize`` makes of the ones it takes."""
    cfg = hf.config
    n = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(int(cfg.max_position_embeddings))
    w.add_embedding_length(int(cfg.hidden_size))
    w.add_block_count(n)
    w.add_feed_forward_length(int(cfg.intermediate_size))
    w.add_head_count(heads)
    w.add_head_count_kv(int(cfg.num_key_value_heads))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float((rope.get("full_attention") or rope)["rope_theta"]))
    if arch != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3", "phi3"):
        w.add_sliding_window(int(cfg.sliding_window))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:  # as convert_hf_to_gguf.py's Mixtral (llama) and Qwen-MoE models write them
        w.add_expert_count(int(experts))
        w.add_expert_used_count(int(cfg.num_experts_per_tok))
        if arch.startswith("qwen"):
            w.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(int(cfg.shared_expert_intermediate_size))
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    write_tokenizer(w, arch)

    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        data = t.detach().to(torch.float32).numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's rotary row order
            data = _permute(data, heads if "q_proj" in name else int(cfg.num_key_value_heads))
        for gguf_name, part in _moe_tensors(name, data) or [(None, data)]:
            if gguf_name is None:
                base, suffix = name.rsplit(".", 1)
                gguf_name = name_map.get_name(base)
                assert gguf_name is not None, name
                gguf_name = f"{gguf_name}.{suffix}"
            if arch.startswith("gemma") and name.endswith("norm.weight"):
                part = part + 1  # llama.cpp stores Gemma's (1 + w) RMSNorm weights as 1 + w
            blocks = quantize(name, part) if quantize is not None else None
            if blocks is None:
                w.add_tensor(gguf_name, part)
            else:
                w.add_tensor(gguf_name, blocks[0], raw_dtype=gguf.GGMLQuantizationType(blocks[1]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _moe_tensors(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """A transformers 5 MoE tensor as llama.cpp stores it (its stacked ``*_exps``: numpy [E, I, H] for gate and
    up, [E, H, I] for down; the shared expert's gate as [H]); None for the others."""
    parts = name.split(".")
    if parts[:2] != ["model", "layers"] or parts[3] != "mlp":
        return None
    blk, rest = f"blk.{parts[2]}", ".".join(parts[4:])
    if rest == "experts.gate_up_proj":
        gate, up = np.split(data, 2, axis=1)
        return [(f"{blk}.ffn_gate_exps.weight", gate.copy()), (f"{blk}.ffn_up_exps.weight", up.copy())]
    simple = {"experts.down_proj": "ffn_down_exps", "gate.weight": "ffn_gate_inp",
              "shared_expert.gate_proj.weight": "ffn_gate_shexp", "shared_expert.up_proj.weight": "ffn_up_shexp",
              "shared_expert.down_proj.weight": "ffn_down_shexp", "shared_expert_gate.weight": "ffn_gate_inp_shexp"}
    if rest not in simple:
        return None
    return [(f"{blk}.{simple[rest]}.weight", data.reshape(-1) if rest == "shared_expert_gate.weight" else data)]

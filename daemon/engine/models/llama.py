"""Native Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over the paged KV cache.

One forward pass runs one flattened varlen batch: ``input_ids``/``positions`` are ``[T]`` with the
tokens of all scheduled sequences back to back. Each layer writes its new K/V with
``kvpilot.kernels.ops.store_kv`` and attends with ``kvpilot.kernels.ops.paged_attention``. q/k/v and
gate/up are fused into one matmul each. Numerics follow HF transformers (RMSNorm in float32,
cos/sin cast to the model dtype) so float32 runs match it closely.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import ops

from ..host_malloc import row_slices
from .base import AttentionMetadata, OutputRows
from .linear import Linear, keep_panels, linear, prepack, prepack_supported
from .parallel import SINGLE, ParallelContext
from .quantization import QuantMethod, get_quant_method
from .quantization.unquantized import panels_in_place

logger = logging.getLogger(__name__)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    native = ops.rms_norm(x, weight, eps)  # float32/bfloat16 CPU rows: one native pass (2x torch's op)
    if native is not None:
        return native
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # HF normalizes in float32 and scales by the weight in the model dtype
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def _rotate(qk: torch.Tensor, t: int, heads: int, hd: int, cos: torch.Tensor, sin: torch.Tensor | None) -> torch.Tensor:
    """RoPE on q/k rows ``[t, heads * hd]``, returned as ``[t, heads, hd]``: on the CPU, where the native
    kernel takes them, the rows themselves rotated in place (they are a fresh projection's).

    With ``sin`` None, ``cos`` holds complex ``cos + i*sin`` and each head's dims are stored as
    interleaved (x_j, x_{j+hd/2}) pairs (``interleave_rope_rows``): the rotation is then one complex
    multiply instead of HF's seven-op rotate_half (26x less time at 2048 tokens on the CPU).
    """
    if sin is None:
        if ops.rope_(qk, cos, heads):  # float32/bfloat16 CPU rows: rotated in place, one pass
            return qk.view(t, heads, hd)
        wide = qk if qk.dtype == torch.float32 else qk.float()  # bfloat16 rows rotate in float32
        pairs = torch.view_as_complex(wide.reshape(t, heads, hd // 2, 2))
        rotated = torch.view_as_real(pairs * cos).view(t, heads, hd)
        return rotated if rotated.dtype == qk.dtype else rotated.to(qk.dtype)
    x1, x2 = qk.view(t, heads, hd).chunk(2, dim=-1)  # HF's rotate_half layout: two halves
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def interleave_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k projection rows (or bias) from HF's two-halves order to interleaved pairs, per head.

    Attention only ever takes q.k dot products, and both get the same permutation, so scores are
    unchanged; the K cache simply holds each head's dims in this order.
    """
    heads = w.shape[0] // head_dim
    return w.reshape(heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rope_params(config: Any) -> dict[str, Any]:
    """transformers 5 keeps RoPE settings in ``rope_parameters``; older configs in rope_theta/rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            params.setdefault(k, v)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(config: Any, head_dim: int, max_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scale for the config's RoPE type."""
    p = _rope_params(config)
    rope_type = p["rope_type"]
    base = float(p["rope_theta"])
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    if rope_type == "dynamic":
        # NTK-aware: exact (plain RoPE) while max_len fits the original window; beyond it a base
        # fixed for max_len, since paged keys cannot be re-rotated per step as HF does
        factor = float(p.get("factor", 1.0))
        orig = int(p.get("original_max_position_embeddings") or config.max_position_embeddings)
        if max_len > orig:
            base = base * ((factor * max_len / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base**exps)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        orig = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept; the band between is blended
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = ~(wavelen < orig / high) * ~(wavelen > orig / low)
        return torch.where(mid, blended, scaled), 1.0
    # other static schemes (yarn, ...): transformers' own definition
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "longrope":
        raise ValueError(f"RoPE type {rope_type!r} is not supported")
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scale)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, *, dtype: torch.dtype, device: torch.device,
                 quant_method: QuantMethod | None = None, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        inter = config.intermediate_size
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim

        model_type = getattr(config, "model_type", "llama")
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = model_type == "qwen2" or attn_bias
        o_bias = attn_bias and model_type != "qwen2"
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.sliding_window = _layer_sliding_window(config, layer_idx)

        kw = {"dtype": dtype, "device": device, "quant_method": quant_method, "parallel": parallel}
        self.qkv_proj = Linear.qkv(hidden, self.head_dim, self.num_heads, self.num_kv_heads, bias=qkv_bias, **kw)
        self.o_proj = Linear.row(self.q_size, hidden, bias=o_bias, what="num_attention_heads * head_dim", **kw)
        self.gate_up_proj = Linear.column(hidden, [inter, inter], bias=mlp_bias, what="intermediate_size", **kw)
        self.down_proj = Linear.row(inter, hidden, bias=mlp_bias, what="intermediate_size", **kw)
        # this rank's heads and MLP width (all of them with one rank)
        self.local_heads = self.qkv_proj.partitions[0][2] // self.head_dim
        self.local_kv_heads = self.qkv_proj.partitions[1][2] // self.head_dim
        self.local_inter = self.gate_up_proj.partitions[0][2]
        self.input_norm = _param(hidden, dtype=dtype, device=device)
        self.post_norm = _param(hidden, dtype=dtype, device=device)

    def projections(self) -> tuple[Linear, ...]:
        return (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)

    def gemm_weight_bytes(self) -> int:
        return sum(proj.weight_bytes() for proj in self.projections())

    def prepack_weights(self, keep_panels: bool = False) -> None:
        """Each projection's weights repacked for the CPU's kernels (see ``linear``), with panel copies
        beside them for steps of a few rows when ``keep_panels``."""
        for proj in self.projections():
            proj.process_weights_after_loading(prepack=True, keep_panels=keep_panels)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor | None,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``, or ``[R, hidden]`` for ``output_rows`` (K/V of all T rows are stored)."""
        t = x.shape[0]
        nh, nkv, hd = self.local_heads, self.local_kv_heads, self.head_dim

        # attention
        qkv = self.qkv_proj(_rms_norm(x, self.input_norm, self.eps))
        # q and k heads rotated together: one RoPE pass
        qk = _rotate(qkv[:, : (nh + nkv) * hd], t, nh + nkv, hd, cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if output_rows is not None:  # the rest only for the rows that are used
            x, q, meta = x.index_select(0, output_rows.rows), q.index_select(0, output_rows.rows), output_rows.meta
            t = x.shape[0]
            if t == 0:
                return x
        o = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            self.scale,
            max_query_len=meta.max_query_len,
            max_context_len=meta.max_context_len,
            sliding_window=self.sliding_window,
        )
        h = self.o_proj(o.reshape(t, nh * hd), residual=x)

        # SwiGLU MLP, on the CPU in slices of rows whose gate|up output stays within malloc's reach: a larger
        # one is a fresh mapping that faults in on every step (a 1B-class model faulted on every 2048-token
        # step without the slices; CHANGELOG.md). SmolLM2's 24 MiB at 2048 rows stays whole.
        slices = row_slices(t, 2 * self.local_inter * h.element_size()) if h.device.type == "cpu" else None
        if slices is None:
            return self._mlp(h)
        return torch.cat([self._mlp(h[rows]) for rows in slices])

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        """``h + down(SiLU(gate) * up)`` of the post-attention norm of ``h``."""
        gu = self.gate_up_proj(_rms_norm(h, self.post_norm, self.eps))
        act = ops.silu_mul(gu)  # float32/bfloat16 on the CPU: one pass, 2x SiLU-then-multiply
        if act is None:
            gate, up = gu.split(self.local_inter, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act, residual=h)


def _layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "model_type", "") == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    return int(window)


class LlamaForCausalLM(nn.Module):
    """Llama/Mistral/Qwen2 causal LM; weights named as in HF checkpoints (``model.layers.N...``)."""

    def __init__(
        self,
        config: Any,
        *,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant_method: QuantMethod | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.eps = float(config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        kw = {"dtype": dtype, "device": device}

        self.embed_tokens = _param(self.vocab_size, self.hidden_size, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype=dtype, device=device,
                              quant_method=quant_method or get_quant_method(None), parallel=parallel)
            for i in range(self.num_layers)
        )
        self.norm = _param(self.hidden_size, **kw)
        self.lm_head = self.embed_tokens if self.tie_word_embeddings else _param(self.vocab_size, self.hidden_size, **kw)

        # cos/sin for every position up to max_model_len, computed in float32 and cast once (as HF does per step)
        inv_freq, attn_scale = rope_inv_freq(config, self.head_dim, max_model_len)
        freqs = torch.arange(max_model_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # float32 uses the complex-multiply RoPE on interleaved q/k rows (see _rotate), and so does bfloat16 on
        # the CPU, rotating in float32 and rounding once where HF's ops round each product and sum (less glue
        # per step: bench/results/profile_bf16_quick.md); other dtypes and devices keep HF's
        # layout, since complex32 arithmetic is not there on every device
        self.interleaved_rope = dtype == torch.float32 or (dtype == torch.bfloat16 and device.type == "cpu")
        if self.interleaved_rope:
            cis = torch.polar(torch.full_like(freqs, attn_scale), freqs).to(device)
            self.register_buffer("rope_cos", cis, persistent=False)
            self.rope_sin: torch.Tensor | None = None
        else:
            self.register_buffer("rope_cos", (freqs.cos() * attn_scale).to(device=device, dtype=dtype),
                                 persistent=False)
            self.register_buffer("rope_sin", (freqs.sin() * attn_scale).to(device=device, dtype=dtype),
                                 persistent=False)

        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.prepacked = False  # see prepack_weights
        self.register_buffer("lm_head_panels", None, persistent=False)  # the LM head's panels beside a packed copy
        self._logits_out: torch.Tensor | None = None  # see compute_logits

    def bind_kv_caches(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        if len(k_caches) != self.num_layers or len(v_caches) != self.num_layers:
            raise ValueError(f"need {self.num_layers} K and V caches, got {len(k_caches)} and {len(v_caches)}")
        self.k_caches, self.v_caches = list(k_caches), list(v_caches)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: AttentionMetadata,
                output_rows: OutputRows | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` → final-normed hidden states ``[T, hidden]``, or only those of
        ``output_rows`` (``[R, hidden]``), which the last layer then computes alone."""
        if not self.k_caches:
            raise RuntimeError("KV caches are not bound; call bind_kv_caches first")
        x = F.embedding(input_ids, self.embed_tokens)
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)  # [T, 1, head_dim/2]
        sin = None if self.rope_sin is None else self.rope_sin.index_select(0, positions).unsqueeze(1)
        last = self.num_layers - 1
        for i, (layer, kc, vc) in enumerate(zip(self.layers, self.k_caches, self.v_caches, strict=True)):
            x = layer(x, cos, sin, attn_meta, kc, vc, output_rows if i == last else None)
        return _rms_norm(x, self.norm, self.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of final-normed ``hidden``. On the CPU a matrix above 32 MiB
        (more than 170 rows of a 49k vocabulary) is a view of a buffer the model keeps, valid until the next
        call: as a fresh tensor it page-faulted in on every step, a third of a 256-row decode step
        (bench/results/profile_host3.md against profile_host3_after.md). Its rows are computed in slices below that size,
        whose outputs malloc keeps and hands out again."""
        rows = hidden.shape[0]
        slices = row_slices(rows, 4 * self.vocab_size) if self.device.type == "cpu" else None
        if slices is None:
            return linear(hidden, self.lm_head, None, self.lm_head_panels).float()
        if self._logits_out is None or self._logits_out.shape[0] < rows:
            self._logits_out = torch.empty((rows, self.vocab_size), dtype=torch.float32, device=self.device)
        out = self._logits_out[:rows]
        for part in slices:
            out[part].copy_(linear(hidden[part], self.lm_head, None, self.lm_head_panels))
        return out

    # ------------------------------------------------------------------ prepacked weights

    def prepack_weights(self) -> bool:
        """Swap the GEMM weights for oneDNN-prepacked copies (see ``linear``); False where unsupported.

        Call after ``load_weights``. The dense weights are released, except the embedding table, which
        the token lookup still reads: a tied LM head gets a packed copy of its own. Where ``keep_panels``
        allows the extra memory, panel copies of the GEMM weights and the LM head go beside them, for
        steps of up to ``small_batch_rows()`` rows.
        """
        if self.prepacked or not prepack_supported(self.device, self.dtype):
            return False
        head = self.lm_head
        extra = sum(layer.gemm_weight_bytes() for layer in self.layers) + head.numel() * head.element_size()
        keep = self.dtype == torch.float32 and keep_panels(extra)  # the panel kernel is float32 only
        for layer in self.layers:
            layer.prepack_weights(keep_panels=keep)
        packed_head = prepack(head)
        if keep:  # a tied head is the embedding table, which the token lookup still reads densely
            self.lm_head_panels = ops.pack_panels(head.detach()) if self.tie_word_embeddings \
                else panels_in_place(head)
        del self._parameters["lm_head"]  # tied: the embedding stays registered as embed_tokens
        self.register_buffer("lm_head", packed_head, persistent=False)
        self.prepacked = True
        return True

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (fusing q/k/v and gate/up); ``KeyError`` listing any missing ones."""
        if self.prepacked:
            raise RuntimeError("weights are prepacked; load them into a fresh model")
        expected = self._expected_names()
        loaded: set[str] = set()
        skipped: list[str] = []
        for name, w in weights:
            key = name.removeprefix("model.")
            if key == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if "rotary_emb." in key:
                continue
            dst = self._dst(key)
            if dst is None:
                skipped.append(name)
                continue
            if self.interleaved_rope and (".q_proj." in key or ".k_proj." in key):
                w = interleave_rope_rows(w, self.head_dim)
            if isinstance(dst, tuple):  # a linear layer takes its own part of the tensor
                proj, partition, kind = dst
                try:
                    proj.load(kind, w, partition)
                except RuntimeError as e:
                    raise RuntimeError(f"{name}: {e}") from None
            elif dst.shape != w.shape:
                raise RuntimeError(f"{name}: checkpoint shape {tuple(w.shape)} != expected {tuple(dst.shape)}")
            else:
                dst.copy_(w)
            loaded.add(key)
        if skipped:
            logger.warning("ignored %d unknown checkpoint tensors, e.g. %s", len(skipped), skipped[:3])
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _expected_names(self) -> set[str]:
        names = {"embed_tokens.weight", "norm.weight"}
        if not self.tie_word_embeddings:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            for proj, checkpoint_names in (
                (layer.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                (layer.o_proj, ("self_attn.o_proj",)),
                (layer.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                (layer.down_proj, ("mlp.down_proj",)),
            ):
                kinds = (*proj.quant_method.checkpoint_names(), *(("bias",) if proj.bias is not None else ()))
                names |= {f"{p}{module}.{kind}" for module in checkpoint_names for kind in kinds}
        return names

    def _dst(self, key: str) -> torch.Tensor | tuple[Linear, int, str] | None:
        """The parameter a checkpoint tensor goes to, or the linear layer, partition and tensor kind."""
        if key == "embed_tokens.weight":
            return self.embed_tokens.data
        if key == "norm.weight":
            return self.norm.data
        if key == "lm_head.weight":
            return self.lm_head.data
        parts = key.split(".")
        if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) >= self.num_layers:
            return None
        layer: LlamaDecoderLayer = self.layers[int(parts[1])]  # type: ignore[assignment]
        sub, kind = ".".join(parts[2:-1]), parts[-1]
        projections = {
            "self_attn.q_proj": (layer.qkv_proj, 0),
            "self_attn.k_proj": (layer.qkv_proj, 1),
            "self_attn.v_proj": (layer.qkv_proj, 2),
            "self_attn.o_proj": (layer.o_proj, 0),
            "mlp.gate_proj": (layer.gate_up_proj, 0),
            "mlp.up_proj": (layer.gate_up_proj, 1),
            "mlp.down_proj": (layer.down_proj, 0),
        }
        if sub in projections:
            proj, partition = projections[sub]
            known = proj.quant_method.checkpoint_names() + (("bias",) if proj.bias is not None else ())
            return (proj, partition, kind) if kind in known else None
        if sub == "input_layernorm" and kind == "weight":
            return layer.input_norm.data
        if sub == "post_attention_layernorm" and kind == "weight":
            return layer.post_norm.data
        return None

"""The one native dense decoder over the paged KV cache, shaped by a ``DecoderSpec`` (spec.py; built per
architecture in archs.py): Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, OLMo 2, and with a mixture-of-experts MLP
(moe.py) on the layers the spec marks: Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss.

One forward pass runs one flattened varlen batch: ``input_ids``/``positions`` are ``[T]`` with the
tokens of all scheduled sequences back to back. Each layer writes its new K/V with
``kvpilot.kernels.ops.store_kv`` and attends with ``kvpilot.kernels.ops.paged_attention``. q/k/v and
gate/up are fused into one matmul each. Numerics follow HF transformers (RMSNorm in float32,
cos/sin cast to the model dtype) so float32 runs match it closely. The CPU fast paths (native row
kernels, prepacked GEMMs with panels, the residual add fused into o/down, interleaved RoPE rows, the
last layer computing only the sampled rows) serve every architecture.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import ops

from ..host_malloc import row_slices
from .base import AttentionMetadata, LoRABatch, OutputRows
from .linear import Linear, keep_panels, linear, prepack, prepack_supported, small_batch_rows
from .moe import MoEBlock
from .native_decode import NativeDecodeLayers
from .parallel import SINGLE, ParallelContext
from .quantization import QuantMethod, get_quant_method
from .quantization.unquantized import panels_in_place
from .rope import permute_rope_rows, rope_dim_order, rope_inv_freq, rotary_dim, rotate
from .spec import DecoderSpec

logger = logging.getLogger(__name__)

_HEAD_CHUNK_ROWS = 65536  # vocabulary rows per chunk of a head packed in chunks (prepack_weights)

__all__ = ["DecoderLayer", "DecoderForCausalLM", "text_config"]

# checkpoint tensors of multimodal checkpoints that the text decoder does not use: skipped quietly
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# where the text decoder's tensors sit in plain and multimodal checkpoints (transformers 4 and 5 names)
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def text_config(config: Any) -> Any:
    """The text decoder's config: ``text_config`` of a multimodal config (Gemma 3), else the config."""
    return getattr(config, "text_config", None) or config


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    native = ops.rms_norm(x, weight, eps)  # float32/bfloat16 CPU rows: one native pass (2x torch's op)
    if native is not None:
        return native
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if weight.dtype == torch.float32:  # Gemma/OLMo 2 weights scale in float32, then the cast
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    # HF's Llama normalizes in float32 and scales by the weight in the model dtype
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, *, dtype: torch.dtype, device: torch.device,
                 quant_method: QuantMethod | None = None, parallel: ParallelContext = SINGLE,
                 rope_index: int = 0) -> None:
        super().__init__()
        self.spec = spec
        hidden, inter = spec.hidden_size, spec.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.eps = spec.eps
        self.scale = spec.scale
        self.q_size = self.num_heads * self.head_dim
        self.sliding_window = spec.layers[layer_idx].sliding_window
        self.rope_index = rope_index  # which of the model's cos/sin tables this layer rotates with

        quant_method = quant_method or get_quant_method(None)
        kw = {"dtype": dtype, "device": device, "quant_method": quant_method, "parallel": parallel}

        def method(attr: str) -> dict[str, Any]:  # a projection the checkpoint left in float takes none
            names = [hf for hf, a, _ in spec.weights.projections if a == attr]
            skipped = any(quant_method.skips(f"layers.{layer_idx}.{hf}") for hf in names)
            return {**kw, "quant_method": get_quant_method(None)} if skipped else kw

        self.qkv_proj = Linear.qkv(hidden, self.head_dim, self.num_heads, self.num_kv_heads, bias=spec.qkv_bias,
                                   **method("qkv_proj"))
        self.o_proj = Linear.row(self.q_size, hidden, bias=spec.o_bias, what="num_attention_heads * head_dim",
                                 **method("o_proj"))
        # the MLP: dense gate|up and down, or the spec's MoE block on the layers it marks
        self.moe: MoEBlock | None = None
        self.gate_up_proj: Linear | None = None
        self.down_proj: Linear | None = None
        if spec.layers[layer_idx].moe:
            self.moe = MoEBlock(spec, **kw)
            self.local_inter = self.moe.local_inter
        else:
            self.gate_up_proj = Linear.column(hidden, [inter, inter], bias=spec.mlp_bias, what="intermediate_size",
                                              **method("gate_up_proj"))
            self.down_proj = Linear.row(inter, hidden, bias=spec.mlp_bias, what="intermediate_size",
                                        **method("down_proj"))
            self.local_inter = self.gate_up_proj.partitions[0][2]
        # this rank's heads (all of them with one rank)
        self.local_heads = self.qkv_proj.partitions[0][2] // self.head_dim
        self.local_kv_heads = self.qkv_proj.partitions[1][2] // self.head_dim
        self.q_head_start = self.qkv_proj.partitions[0][1] // self.head_dim
        # gpt-oss's sink logits, float32 as ops.paged_attention takes them: this rank's heads
        self.sinks = _param(self.local_heads, dtype=torch.float32, device=device) if spec.attn_sinks else None

        # Gemma/OLMo 2 norm weights are kept in float32: they scale before the cast to the model dtype
        norm_dtype = dtype if spec.norm_weight == "model_dtype" else torch.float32
        sizes = {"q_norm": self.head_dim, "k_norm": self.head_dim}
        self.parallel = parallel
        # OLMo 2 norms q and k over the whole projection: each rank holds its heads' part of the weights and
        # sums its squares with the other ranks' (a KV head held by several ranks counts once)
        self.kv_replicas = max(1, parallel.tp_size // self.num_kv_heads)
        if spec.qk_norm == "projection":
            sizes = {"q_norm": self.local_heads * self.head_dim, "k_norm": self.local_kv_heads * self.head_dim}
        # the norms the spec's placement uses are parameters, the others None (forward skips those)
        self.input_norm = self.post_attn_norm = self.pre_mlp_norm = self.post_mlp_norm = None
        self.q_norm = self.k_norm = None
        for role in spec.norm_roles():
            setattr(self, role, _param(sizes.get(role, hidden), dtype=norm_dtype, device=device))

        self.attn_kwargs: dict[str, Any] = {}
        if spec.attn_soft_cap is not None:
            self.attn_kwargs["soft_cap"] = spec.attn_soft_cap

    def projections(self) -> tuple[Linear, ...]:
        if self.moe is not None:
            return (self.qkv_proj, self.o_proj, *self.moe.projections())
        assert self.gate_up_proj is not None and self.down_proj is not None
        return (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)

    def gemm_weight_bytes(self) -> int:
        return sum(proj.weight_bytes() for proj in self.projections())

    def prepack_weights(self, keep_panels: bool = False) -> None:
        """Each projection's weights repacked for the CPU's kernels (see ``linear``), with panel copies
        beside them for steps of a few rows when ``keep_panels``."""
        for proj in self.projections():
            proj.prepack(keep_panels=keep_panels)
        if self.moe is not None:  # the routed experts (the router and shared expert are projections)
            self.moe.prepack_experts(keep_panels=keep_panels)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor | None,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        output_rows: OutputRows | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``, or ``[R, hidden]`` for ``output_rows`` (K/V of all T rows are stored);
        ``lora``: the rows' adapters."""
        t = x.shape[0]
        nh, nkv, hd = self.local_heads, self.local_kv_heads, self.head_dim
        segs = None if lora is None else lora.rows

        # attention
        qkv = self.qkv_proj(x if self.input_norm is None else _rms_norm(x, self.input_norm, self.eps), lora=segs)
        # q and k heads rotated together: one RoPE pass
        qk = rotate(self._qk_rows(qkv, t), t, nh + nkv, hd, cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if output_rows is not None:  # the rest only for the rows that are used
            x, q, meta = x.index_select(0, output_rows.rows), q.index_select(0, output_rows.rows), output_rows.meta
            t = x.shape[0]
            segs = None if lora is None else lora.output_rows
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
            sinks=self.sinks,
            **self.attn_kwargs,
        )
        if self.post_attn_norm is None:  # pre-norm: the residual add fused into the GEMM
            h = self.o_proj(o.reshape(t, nh * hd), residual=x, lora=segs)
        else:
            h = x + _rms_norm(self.o_proj(o.reshape(t, nh * hd), lora=segs), self.post_attn_norm, self.eps)

        # the MLP, on the CPU in slices of rows whose gate|up output stays within malloc's reach: a larger
        # one is a fresh mapping that faults in on every step (a 1B-class model faulted on every 2048-token
        # step without the slices; CHANGELOG.md). SmolLM2's 24 MiB at 2048 rows stays whole.
        row_bytes = 2 * self.local_inter * h.element_size() if self.moe is None else self.moe.row_bytes(h.element_size())
        slices = row_slices(t, row_bytes) if h.device.type == "cpu" else None
        if slices is None:
            return self._mlp(h, segs)
        return torch.cat([self._mlp(h[rows], None if segs is None else segs.narrow(rows.start, rows.stop))
                          for rows in slices])

    def _qk_rows(self, qkv: torch.Tensor, t: int) -> torch.Tensor:
        """The q|k rows ``[t, (nh + nkv) * hd]`` of ``qkv``, RMS-normed first where the spec says so."""
        nh, nkv, hd = self.local_heads, self.local_kv_heads, self.head_dim
        if self.q_norm is None:
            return qkv[:, : (nh + nkv) * hd]
        q, k = qkv[:, : nh * hd], qkv[:, nh * hd : (nh + nkv) * hd]
        if self.spec.qk_norm == "per_head":  # each head's hd dims normed as one row
            q = _rms_norm(q.reshape(t * nh, hd), self.q_norm, self.eps).view(t, nh * hd)
            k = _rms_norm(k.reshape(t * nkv, hd), self.k_norm, self.eps).view(t, nkv * hd)
        elif self.parallel.tp_size > 1:
            q = self._split_rms_norm(q, self.q_norm, self.num_heads * hd, 1)
            k = self._split_rms_norm(k, self.k_norm, self.num_kv_heads * hd, self.kv_replicas)
        else:
            q, k = _rms_norm(q, self.q_norm, self.eps), _rms_norm(k, self.k_norm, self.eps)
        return torch.cat((q, k), dim=1)  # a fresh tensor: RoPE rotates it in place

    def _split_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, width: int, replicas: int) -> torch.Tensor:
        """RMSNorm over a projection of ``width`` columns of which this rank holds ``x``'s: the sum of squares
        over the ranks (each column held by ``replicas`` ranks), in float32 as HF computes it."""
        xf = x.float()
        squares = self.parallel.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        if replicas > 1:
            squares = squares / replicas
        normed = xf * torch.rsqrt(squares / width + self.eps)
        if weight.dtype == torch.float32:  # scaled in float32, then cast (as _rms_norm does for these norms)
            return (normed * weight).to(x.dtype)
        return normed.to(x.dtype) * weight

    def projection_norm_slice(self, w: torch.Tensor, role: str) -> torch.Tensor:
        """This rank's part of a whole-projection q or k norm weight (its heads' columns)."""
        part = self.qkv_proj.partitions[0 if role == "q_norm" else 1]
        return w.narrow(0, part[1], part[2])

    def _mlp(self, h: torch.Tensor, lora: ops.LoRASegments | None = None) -> torch.Tensor:
        """``h`` plus the MLP of ``h``, with the norms the spec places around it."""
        x = h if self.pre_mlp_norm is None else _rms_norm(h, self.pre_mlp_norm, self.eps)
        if self.moe is not None:
            y = self.moe(x)
            return h + (y if self.post_mlp_norm is None else _rms_norm(y, self.post_mlp_norm, self.eps))
        assert self.gate_up_proj is not None and self.down_proj is not None
        gu = self.gate_up_proj(x, lora=lora)
        act = self._activation(gu)
        if self.post_mlp_norm is None:
            return self.down_proj(act, residual=h, lora=lora)
        return h + _rms_norm(self.down_proj(act, lora=lora), self.post_mlp_norm, self.eps)

    def _activation(self, gu: torch.Tensor) -> torch.Tensor:
        if self.spec.activation == "silu":
            act = ops.silu_mul(gu)  # float32/bfloat16 on the CPU: one pass, 2x SiLU-then-multiply
            if act is not None:
                return act
            gate, up = gu.split(self.local_inter, dim=-1)
            return F.silu(gate) * up
        act = ops.gelu_tanh_mul(gu)  # GeGLU (Gemma): the native one-pass kernel on float32/bfloat16 CPU rows
        if act is not None:
            return act
        gate, up = gu.split(self.local_inter, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class DecoderForCausalLM(nn.Module):
    """A dense causal LM built from ``build_spec(config)``; weights named as in HF checkpoints
    (``model.layers.N...``, or under ``language_model.`` in multimodal ones). Subclasses (archs.py)
    set ``build_spec``."""

    build_spec: ClassVar[Any]  # (text config) -> DecoderSpec

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
        config = text_config(config)
        spec: DecoderSpec = type(self).build_spec(config)
        self.spec = spec
        self.config = config
        self.dtype = dtype
        self.device = device
        self.parallel = parallel
        self.num_layers = spec.num_layers  # the whole model's; this stage holds ``layers`` (num_local_layers)
        # this pipeline stage's decoder layers: self.layers[i] is checkpoint layer first_layer + i
        stage = parallel.stage_layers(spec.num_layers)
        self.first_layer = stage.start
        self.hidden_size = spec.hidden_size
        self.vocab_size = spec.vocab_size  # the real vocabulary: logits have this many columns
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.eps = spec.eps
        self.tie_word_embeddings = spec.tie_word_embeddings
        kw = {"dtype": dtype, "device": device}

        # one cos/sin table per distinct RoPE setting (Gemma 3: local and global layers)
        rope_keys = list(dict.fromkeys(layer.rope_key for layer in spec.layers))
        quant_method = quant_method or get_quant_method(None)
        self.quant_method = quant_method
        # GGUF keeps the embedding and the LM head in its blocks too: both are then Linear layers (the
        # embedding looks rows up through its method), and a tied head is the embedding's layer itself
        self.embed_layer: Linear | None = None
        self.lm_head_layer: Linear | None = None
        if quant_method.quantizes_embeddings:  # replicated on every rank and stage
            self.embed_layer = Linear.replicated(self.hidden_size, self.vocab_size, quant_method=quant_method, **kw)
            self.lm_head_layer = self.embed_layer if self.tie_word_embeddings else \
                Linear.replicated(self.hidden_size, self.vocab_size, quant_method=quant_method, **kw)
        # float embedding and LM head: split by vocabulary rows over the tensor ranks (vLLM's padding to a
        # multiple of 64 per rank); this rank holds rows [vocab_start, vocab_start + head_rows)
        self.head_rows, self.vocab_start = self.vocab_size, 0
        if parallel.tp_size > 1 and self.embed_layer is None:
            padded = -(-self.vocab_size // (64 * parallel.tp_size)) * 64 * parallel.tp_size
            self.head_rows = padded // parallel.tp_size
            self.vocab_start = parallel.tp_rank * self.head_rows
        # the first stage looks tokens up, the last one computes the logits (a tied head there is the
        # embedding shard, a copy of its own when the stages differ)
        self.embed_tokens = _param(self.head_rows, self.hidden_size, **kw) \
            if self.embed_layer is None and parallel.is_first_stage else None
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, dtype=dtype, device=device, quant_method=quant_method,
                         parallel=parallel, rope_index=rope_keys.index(spec.layers[i].rope_key))
            for i in stage
        )
        norm_dtype = dtype if spec.norm_weight == "model_dtype" else torch.float32
        self.norm = _param(self.hidden_size, dtype=norm_dtype, device=device) if parallel.is_last_stage else None
        self.lm_head = None
        if self.lm_head_layer is None and parallel.is_last_stage:
            self.lm_head = self.embed_tokens if self.tie_word_embeddings and self.embed_tokens is not None \
                else _param(self.head_rows, self.hidden_size, **kw)
        for table in (self.embed_tokens, self.lm_head):
            if table is not None and self.head_rows * parallel.tp_size != self.vocab_size:
                table.data[max(0, self.vocab_size - self.vocab_start):].zero_()  # padded rows: logits of 0
        # Gemma multiplies the embeddings by sqrt(hidden) cast to the model dtype
        self.embed_scale = None if spec.embed_scale is None else torch.tensor(spec.embed_scale, dtype=dtype, device=device)

        # float32 uses the complex-multiply RoPE on interleaved q/k rows (see rope.rotate), and so does bfloat16 on
        # the CPU, rotating in float32 and rounding once where HF's ops round each product and sum (less glue
        # per step: bench/results/profile_bf16_quick.md); other dtypes and devices keep HF's
        # layout, since complex32 arithmetic is not there on every device
        self.interleaved_rope = dtype == torch.float32 or (dtype == torch.bfloat16 and device.type == "cpu")
        # the rotary dims, one count for the whole model (its q/k rows are kept in one order: rope_dim_order)
        rot_dims = {rotary_dim(config, self.head_dim, key) for key in rope_keys}
        if len(rot_dims) > 1:
            raise ValueError(f"{spec.arch}: partial_rotary_factor differs between layer types ({sorted(rot_dims)} dims)")
        self.rotary_dim = rot_dims.pop()
        self.rope_order = rope_dim_order(self.head_dim, self.rotary_dim, self.interleaved_rope)
        self.rope_cos: list[torch.Tensor] = []
        self.rope_sin: list[torch.Tensor | None] = []
        for key in rope_keys:
            cos, sin = self._rope_table(config, key, max_model_len)
            self.rope_cos.append(cos)
            self.rope_sin.append(sin)

        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.prepacked = False  # see prepack_weights
        self.register_buffer("lm_head_panels", None, persistent=False)  # the LM head's panels beside a packed copy
        self._logits_out: torch.Tensor | None = None  # see compute_logits
        self.lm_head_chunks: list[torch.Tensor] = []  # the packed head in vocabulary chunks (prepack_weights)
        # decode steps' layers in one native call where the model allows it (native_decode.py); False once
        # found not to, None until the first decode step after the caches are bound
        self.use_native_decode = True
        self._native_decode: NativeDecodeLayers | bool | None = None

    def _rope_table(self, config: Any, key: str | None, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """cos/sin for every position up to max_model_len, computed in float32 and cast once (as HF does
        per step): complex ``cos + i*sin`` for interleaved rows, else cos and sin in the model dtype. Dims a
        partial rotation passes get cos 1 and sin 0 (see ``rope_dim_order``)."""
        inv_freq, attn_scale = rope_inv_freq(config, self.head_dim, max_model_len, key)
        freqs = torch.arange(max_model_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        passed = (max_model_len, (self.head_dim - self.rotary_dim) // 2)
        if self.interleaved_rope:
            cis = torch.polar(torch.full_like(freqs, attn_scale), freqs)
            cis = torch.cat([cis, torch.ones(passed, dtype=cis.dtype)], dim=1)
            return cis.to(self.device), None
        cast = {"device": self.device, "dtype": self.dtype}
        cos = torch.cat([freqs.cos() * attn_scale, torch.ones(passed)], dim=1)
        sin = torch.cat([freqs.sin() * attn_scale, torch.zeros(passed)], dim=1)
        return cos.to(**cast), sin.to(**cast)

    @property
    def num_local_layers(self) -> int:
        """The decoder layers this stage holds and runs: one K and one V cache each."""
        return len(self.layers)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads of this tensor rank (all of them with one rank): the KV cache's head dimension."""
        return self.layers[0].local_kv_heads if len(self.layers) else self.num_kv_heads

    def bind_kv_caches(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        n = self.num_local_layers
        if len(k_caches) != n or len(v_caches) != n:
            raise ValueError(f"need {n} K and V caches, got {len(k_caches)} and {len(v_caches)}")
        self.k_caches, self.v_caches = list(k_caches), list(v_caches)
        self._native_decode = None  # its records point at the caches: built again on the next decode step

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: AttentionMetadata,
                output_rows: OutputRows | None = None, lora: LoRABatch | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` → final-normed hidden states ``[T, hidden]``, or only those of
        ``output_rows`` (``[R, hidden]``), which the last layer then computes alone; ``lora``: the rows'
        adapters, when the step has any. A later pipeline stage takes the previous stage's ``hidden``
        ``[T, hidden]`` instead of embedding; a stage before the last returns its layers' output, not normed,
        for all T rows."""
        if not self.k_caches:
            raise RuntimeError("KV caches are not bound; call bind_kv_caches first")
        if hidden is not None:
            x = hidden
        elif self.embed_layer is not None:
            x = self.quant_method.embed(self.embed_layer, input_ids)
        elif self.embed_tokens is None:
            raise RuntimeError("a pipeline stage after the first needs the previous stage's hidden states")
        elif self.head_rows == self.vocab_size:
            x = F.embedding(input_ids, self.embed_tokens)
        else:
            x = self._embed_shard(input_ids)
        if self.embed_scale is not None and hidden is None:
            x = x * self.embed_scale
        if output_rows is None and lora is None and hidden is None and attn_meta.max_query_len == 1:
            native = self._native_decode_layers()
            y = None if native is None else native.run(x, positions, attn_meta)
            if y is not None:
                assert self.norm is not None  # one pipeline stage: the last
                return _rms_norm(y, self.norm, self.eps)
        tables = [
            (cos.index_select(0, positions).unsqueeze(1),  # [T, 1, head_dim/2]
             None if sin is None else sin.index_select(0, positions).unsqueeze(1))
            for cos, sin in zip(self.rope_cos, self.rope_sin, strict=True)
        ]
        if self.norm is None:  # a stage before the last: every row goes on to the next stage
            output_rows = None
        last = len(self.layers) - 1
        for i, (layer, kc, vc) in enumerate(zip(self.layers, self.k_caches, self.v_caches, strict=True)):
            cos, sin = tables[layer.rope_index]
            x = layer(x, cos, sin, attn_meta, kc, vc, output_rows if i == last else None, lora)
        return x if self.norm is None else _rms_norm(x, self.norm, self.eps)

    def _native_decode_layers(self) -> NativeDecodeLayers | None:
        if not self.use_native_decode:
            return None
        if self._native_decode is None:
            reason = NativeDecodeLayers.why_not(self)
            if reason is not None:
                logger.debug("decode steps run the layers in Python: %s", reason)
            self._native_decode = False if reason is not None else NativeDecodeLayers(self)
        return self._native_decode or None

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows, zeros for the ids other ranks hold, summed over them."""
        assert self.embed_tokens is not None
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.head_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        x.masked_fill_(outside.unsqueeze(1), 0)
        return self.parallel.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits ``[rows, vocab]`` on tensor rank 0 (None on the others, which only take part in
        the gather of the vocabulary slices); see ``_head_logits``."""
        if self.parallel.tp_size == 1:
            return self._head_logits(hidden)
        logits = self._head_logits(hidden)
        if self.lm_head_layer is not None:  # a replicated head: every rank has all of them
            return logits if self.parallel.tp_rank == 0 else None
        full = self.parallel.gather_to_first(logits, dim=-1)
        if full is None:
            return None
        return full[:, : self.vocab_size].contiguous() if full.shape[1] != self.vocab_size else full

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of final-normed ``hidden``. On the CPU a matrix above 32 MiB
        (more than 170 rows of a 49k vocabulary) is a view of a buffer the model keeps, valid until the next
        call: as a fresh tensor it page-faulted in on every step, a third of a 256-row decode step
        (bench/results/profile_host3.md against profile_host3_after.md). Its rows are computed in slices below that size,
        whose outputs malloc keeps and hands out again."""
        if self.lm_head_layer is not None:
            return self._soft_cap(self.lm_head_layer(hidden).float())
        if self.lm_head_chunks:
            return self._soft_cap(self._chunked_logits(hidden))
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        rows, cols = hidden.shape[0], self.head_rows  # this rank's vocabulary slice (all of it with one rank)
        slices = row_slices(rows, 4 * cols) if self.device.type == "cpu" else None
        if slices is None:
            return self._soft_cap(linear(hidden, self.lm_head, None, self.lm_head_panels).float())
        if self._logits_out is None or self._logits_out.shape[0] < rows:
            self._logits_out = torch.empty((rows, cols), dtype=torch.float32, device=self.device)
        out = self._logits_out[:rows]
        # the panel GEMM writes into the kept buffer itself: one pass over the head's weights, where each slice
        # below reads all of them again (a 262k vocabulary slices every 32 rows)
        if self.lm_head_panels is not None and rows <= small_batch_rows() and ops.panel_gemm(
                hidden, self.lm_head_panels, cols, None, None, out=out) is not None:
            return self._soft_cap(out)
        for part in slices:
            out[part].copy_(linear(hidden[part], self.lm_head, None, self.lm_head_panels))
        return self._soft_cap(out)

    def _chunked_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a head packed in vocabulary chunks (``prepack_weights`` without panels) into the kept
        float32 buffer: a chunk's output for up to a hundred-odd rows stays within malloc's reach, so each
        chunk's weights are read once a step where the whole head's would be read once per slice of rows."""
        rows = hidden.shape[0]
        if self._logits_out is None or self._logits_out.shape[0] < rows:
            self._logits_out = torch.empty((rows, self.head_rows), dtype=torch.float32, device=self.device)
        out = self._logits_out[:rows]
        for start, chunk in zip(range(0, self.head_rows, _HEAD_CHUNK_ROWS), self.lm_head_chunks, strict=True):
            cols = chunk.shape[0]
            for part in row_slices(rows, 4 * cols) or [slice(0, rows)]:
                out[part, start:start + cols].copy_(linear(hidden[part], chunk))
        return out

    def _soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-capping ``cap * tanh(logits / cap)``, in place on float32 logits."""
        cap = self.spec.final_soft_cap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

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
        if self.lm_head is None:  # a quantized head, or none on this stage: only the float layers pack
            # with panels too where allowed: a GGUF MoE's float routers are its native decode loop's GEMMs
            keep = self.dtype == torch.float32 and keep_panels(sum(layer.gemm_weight_bytes() for layer in self.layers))
            for layer in self.layers:
                layer.prepack_weights(keep_panels=keep)
            self.prepacked = True
            return True
        head = self.lm_head
        extra = sum(layer.gemm_weight_bytes() for layer in self.layers) + head.numel() * head.element_size()
        keep = self.dtype == torch.float32 and keep_panels(extra)  # the panel kernel is float32 only
        for layer in self.layers:
            layer.prepack_weights(keep_panels=keep)
        if not keep and head.shape[0] > _HEAD_CHUNK_ROWS:
            # without panels a packed head was computed in slices of rows, each reading all of it (a 262k
            # vocabulary every 32 rows); packed in vocabulary chunks it is read about once a step: 1.7x at
            # 96 rows, 2.4x at 256 for Gemma 3's bfloat16 head (bench/results/lm_head_chunks.json)
            self.lm_head_chunks = [prepack(head[v:v + _HEAD_CHUNK_ROWS])
                                   for v in range(0, head.shape[0], _HEAD_CHUNK_ROWS)]
            for i, chunk in enumerate(self.lm_head_chunks):  # buffers, so that the weight counts see them
                self.register_buffer(f"lm_head_chunk_{i}", chunk, persistent=False)
            del self._parameters["lm_head"]  # tied: the embedding stays registered as embed_tokens
            self.register_buffer("lm_head", None, persistent=False)
            self.prepacked = True
            return True
        packed_head = prepack(head)
        if keep:  # a tied head is the embedding table, which the token lookup still reads densely
            self.lm_head_panels = ops.pack_panels(head.detach()) if head is self.embed_tokens \
                else panels_in_place(head)
        del self._parameters["lm_head"]  # tied: the embedding stays registered as embed_tokens
        self.register_buffer("lm_head", packed_head, persistent=False)
        self.prepacked = True
        return True

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (fusing q/k/v and gate/up, splitting fused checkpoint tensors);
        ``KeyError`` listing any missing ones."""
        if self.prepacked:
            raise RuntimeError("weights are prepacked; load them into a fresh model")
        expected = self._expected_names()
        loaded: set[str] = set()
        skipped: list[str] = []
        for name, w in weights:
            key = _canonical(name)
            if key is None or "rotary_emb." in key or not self.wants_weight(name):
                del w  # never two whole checkpoint tensors at once: the next one is read as this goes
                continue
            try:
                covered = self._load_moe(key, w)  # a fused expert tensor covers many expected names
                if not covered:
                    covered = (key,) if self._load_one(key, w) else ()
            except RuntimeError as e:
                raise RuntimeError(f"{name}: {e}") from None
            del w
            if not covered:
                skipped.append(name)
                continue
            loaded.update(covered)
        if skipped:
            logger.warning("ignored %d unknown checkpoint tensors, e.g. %s", len(skipped), skipped[:3])
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for proj in self._linear_layers():
            proj.process_weights_after_loading()
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.process_weights_after_loading()

    def wants_weight(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is any of this rank's: False for the layers, embedding, head and
        final norm that other pipeline stages hold and the tied head's own name, so that a loader need not
        even read those (``load_weights`` skips them quietly too). Unknown names are wanted: they are warned of."""
        key = _canonical(name)
        if key is None:
            return False
        top, _, rest = key.partition(".")
        if top == "lm_head":
            return not self.tie_word_embeddings and (self.lm_head is not None or self.lm_head_layer is not None)
        if top == "embed_tokens" and self.embed_layer is None:
            return self.embed_tokens is not None or (self.tie_word_embeddings and self.lm_head is not None)
        if key == "norm.weight":
            return self.norm is not None
        if top == "layers":
            index = rest.partition(".")[0]
            return not index.isdigit() or self._local_layer(int(index)) is not None
        return True

    def _local_layer(self, index: int) -> DecoderLayer | None:
        """Checkpoint layer ``index`` if this stage holds it."""
        local = index - self.first_layer
        return self.layers[local] if 0 <= local < len(self.layers) else None  # type: ignore[return-value]

    def _linear_layers(self) -> list[Linear]:
        heads = [h for h in dict.fromkeys((self.embed_layer, self.lm_head_layer)) if h is not None]
        return heads + [proj for layer in self.layers for proj in layer.projections()]

    def weight_bytes(self) -> int:
        """The model's weights as held on the device: every linear layer as its method stores it (before
        any CPU repacking), and the float parameters beside them."""
        linears = self._linear_layers()
        inside = {id(t) for proj in linears for t in (*proj.parameters(), *proj.buffers())}
        floats = {id(t): t for t in (*self.parameters(), *self.buffers()) if id(t) not in inside}
        floats.pop(id(self.lm_head_panels), None)
        return sum(proj.weight_bytes() for proj in linears) + sum(
            t.numel() * t.element_size() for t in floats.values() if t is not None)

    def _load_moe(self, key: str, w: torch.Tensor) -> tuple[str, ...]:
        """Tensor ``key`` into its layer's MoE block; the expected names it covers, () where it is none of it."""
        parts = key.split(".", 2)
        if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
            return ()
        layer = self._local_layer(int(parts[1]))
        block = None if layer is None else layer.moe
        if block is None:
            return ()
        return tuple(f"layers.{parts[1]}.{rel}" for rel in block.load(parts[2], w))

    def _load_one(self, key: str, w: torch.Tensor) -> bool:
        """Tensor ``key`` (prefix-free HF name) into its place; False where it has none."""
        top, _, kind = key.partition(".")
        head = {"embed_tokens": self.embed_layer, "lm_head": self.lm_head_layer}.get(top)
        if head is not None and kind in head.quant_method.checkpoint_names():
            head.load(kind, w)
            return True
        if key == "embed_tokens.weight" and self.embed_layer is None:
            tables = [] if self.embed_tokens is None else [self.embed_tokens]
            if self.tie_word_embeddings and self.lm_head is not None and self.lm_head is not self.embed_tokens:
                tables.append(self.lm_head)  # the tied head of a last stage that does not embed: a copy
            return all(self._copy_vocab(table, w) for table in tables) and bool(tables)
        if key == "lm_head.weight" and self.lm_head is not None:
            return self._copy_vocab(self.lm_head, w)
        if key == "norm.weight" and self.norm is not None:
            return _copy(self.norm.data, self._norm_weight(w))
        parts = key.split(".")
        if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit():
            return False
        layer = self._local_layer(int(parts[1]))
        if layer is None:
            return False
        sub, kind = ".".join(parts[2:-1]), parts[-1]
        if sub == "self_attn" and kind == "sinks" and layer.sinks is not None:  # this rank's heads
            return _copy(layer.sinks.data, w.narrow(0, layer.q_head_start, layer.local_heads)
                         if w.shape == (self.num_heads,) else w)
        role = dict(self.spec.weights.norms).get(sub)
        if role is not None and kind == "weight":
            w = self._norm_weight(w)
            if role in ("q_norm", "k_norm"):  # in the order the q/k rows are kept
                w = permute_rope_rows(w, self.head_dim, self.rope_order)
            if self.spec.qk_norm == "projection" and role in ("q_norm", "k_norm"):
                w = layer.projection_norm_slice(w, role)
            return _copy(getattr(layer, role).data, w)
        target = {hf: (attr, part) for hf, attr, part in self.spec.weights.projections}.get(sub)
        if target is None:
            return False
        proj: Linear | None = getattr(layer, target[0])
        if proj is None:  # a dense MLP's name on a MoE layer
            return False
        known = proj.quant_method.checkpoint_names() + (("bias",) if proj.bias is not None else ())
        if kind not in known:
            return False
        if target[1] is not None:
            self._load_partition(proj, target[0], target[1], kind, w)
            return True
        # a fused checkpoint tensor: its partitions stacked along the output rows (the method checks the total)
        sizes = [rows for rows, _, _ in proj.partitions]
        for partition in range(len(sizes)):
            self._load_partition(proj, target[0], partition, kind, w, row_offset=sum(sizes[:partition]),
                                 fused_rows=sum(sizes))
        return True

    def _copy_vocab(self, table: torch.Tensor, w: torch.Tensor) -> bool:
        """A whole ``[vocab, hidden]`` embedding or LM head into this rank's rows of it (the padded ones stay 0)."""
        if self.head_rows == self.vocab_size:
            return _copy(table.data, w)
        if tuple(w.shape) != (self.vocab_size, self.hidden_size):
            raise RuntimeError(f"checkpoint shape {tuple(w.shape)} != expected {(self.vocab_size, self.hidden_size)}")
        rows = max(0, min(self.head_rows, self.vocab_size - self.vocab_start))
        return _copy(table.data[:rows], w[self.vocab_start : self.vocab_start + rows])

    def _load_partition(self, proj: Linear, attr: str, partition: int, kind: str, w: torch.Tensor,
                        **fused: int) -> None:
        order = None
        if self.rope_order is not None and attr == "qkv_proj" and partition < 2:  # q and k rows, as RoPE keeps them
            order = permute_rope_rows(torch.arange(proj.partitions[partition][0]), self.head_dim, self.rope_order)
        proj.load(kind, w, partition, row_order=order, **fused)

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        return 1.0 + w.float() if self.spec.norm_weight == "one_plus" else w

    def _expected_names(self) -> set[str]:
        names = {"norm.weight"} if self.norm is not None else set()
        if self.embed_layer is not None:  # quantized heads: on every stage
            heads = ["embed_tokens"] if self.tie_word_embeddings else ["embed_tokens", "lm_head"]
            kinds = self.quant_method.checkpoint_names()
        else:  # this stage's: the embedding where it embeds or holds the tied head, the untied head
            heads = ["embed_tokens"] if self.wants_weight("embed_tokens.weight") else []
            heads += ["lm_head"] if self.lm_head is not None and not self.tie_word_embeddings else []
            kinds = ("weight",)
        names |= {f"{head}.{kind}" for head in heads for kind in kinds}
        for i, layer in enumerate(self.layers, start=self.first_layer):
            p = f"layers.{i}."
            names |= {f"{p}{hf}.weight" for hf, _ in self.spec.weights.norms}
            if layer.sinks is not None:
                names.add(f"{p}self_attn.sinks")
            if layer.moe is not None:
                names |= {p + rel for rel in layer.moe.expected_names()}
            for hf, attr, _ in self.spec.weights.projections:
                proj: Linear | None = getattr(layer, attr)
                if proj is None:
                    continue
                kinds = (*proj.quant_method.checkpoint_names(), *(("bias",) if proj.bias is not None else ()))
                names |= {f"{p}{hf}.{kind}" for kind in kinds}
        return names


def _canonical(name: str) -> str | None:
    """A checkpoint name without its text-model prefix; None for a multimodal tower's tensors."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith("language_model.lm_head."):  # transformers 4 multimodal checkpoints
        return name.removeprefix("language_model.")
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


def _copy(dst: torch.Tensor, w: torch.Tensor) -> bool:
    if not w.is_floating_point() or w.element_size() == 1:  # an fp8 or packed tensor would lose its scales
        raise RuntimeError(f"a {w.dtype} tensor where float weights belong (quantized embeddings, LM heads and "
                           "norms are not supported for this checkpoint format)")
    if dst.shape != w.shape:
        raise RuntimeError(f"checkpoint shape {tuple(w.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(w)
    return True

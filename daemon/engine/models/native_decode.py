"""A decode step's decoder layers in one native call on the CPU (``kernels/csrc/decode_layers_cpu.c``).

At a few rows a step, a layer's kernels take microseconds each and Python's dispatch around them (module calls,
argument checks, ctypes conversions) about as long again: a third of a single-stream Q4_1 decode step
(bench/results/single_stream.json). The C loop runs the very kernels ``DecoderLayer.forward`` calls, in its
order, with its thread count, so the hidden states come out bit-identical; Python writes each layer's record
once and only the step's record (rows, positions' RoPE factors, block tables) per step.

It takes layers whose weights the native GGUF GEMM multiplies as they are (GGUF, AWQ and GPTQ without
desc_act: ``QuantMethod.native_blocks``) or float32 weights with panel copies (``native_panels``); pre-norm
or sandwich RMSNorms (float32 weights under bfloat16 rows too), per-head q/k norms or none, SwiGLU or GeGLU,
soft-capped attention, MoE layers whose SiLU experts a native MoE kernel runs (float32 panels, or GGUF blocks
under float32 or bfloat16 rows; no shared expert); no sinks; one rank; caches of the activations' dtype.
``why_not`` names what keeps a model out. Such a model, and any step with prefill rows, LoRA rows, or more rows
than the GEMMs' small-step paths take, runs through Python as before.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvpilot.kernels import ops

from .base import AttentionMetadata
from .linear import small_batch_rows

if TYPE_CHECKING:
    from .decoder import DecoderForCausalLM, DecoderLayer
    from .linear import Linear
    from .moe import MoEBlock

__all__ = ["NativeDecodeLayers"]

_DTYPES = (torch.float32, torch.bfloat16)
# the C records' slots (decode_layers_cpu.c's enums)
(L_IN_NORM, L_MLP_NORM, L_EPS, L_K_CACHE, L_V_CACHE, L_HEADS, L_KV_HEADS, L_HEAD_DIM, L_BLOCK_SIZE, L_SCALE,
 L_WINDOW, L_ROPE, L_INTER, L_HIDDEN, L_NUM_SLOTS, L_Q_NORM, L_K_NORM, L_POST_ATTN_NORM, L_POST_MLP_NORM, L_NORM_F32,
 L_GELU, L_SOFT_CAP, L_MOE) = range(23)
L_GEMMS = 24
(M_EXPERTS, M_TOPK, M_TOPK_FIRST, M_RENORMALIZE, M_INTER, M_W13, M_W13_BIAS, M_W2, M_W2_BIAS, M_GGUF,
 M_SLOTS) = range(11)
_PANELS = -1  # a GEMM record's segment count for float32 panels
(S_ROWS, S_X, S_H, S_NORMED, S_QKV, S_ATTN, S_GATE_UP, S_ACT, S_CIS, S_SLOTS, S_BLOCK_TABLES, S_BT_STRIDE,
 S_CONTEXT_LENS, S_QSL, S_SEQS, S_BF16, S_THREADS, S_QK, S_MOE_LOGITS, S_MOE_IDS, S_MOE_WEIGHTS, S_MOE_OUT) = range(22)


def _double_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


def _entry() -> tuple[Callable[..., int], int, int, int] | None:
    """The C entry point and its record sizes (layer slots, step slots, segments per GEMM)."""
    return ops.decode_layers_entry()


def _norms(layer: DecoderLayer) -> list[torch.Tensor]:
    return [w for w in (layer.input_norm, layer.pre_mlp_norm, layer.post_attn_norm, layer.post_mlp_norm,
                        layer.q_norm, layer.k_norm) if w is not None]


def _moe_why_not(layer: DecoderLayer, dtype: torch.dtype) -> str | None:
    moe = layer.moe
    assert moe is not None
    if not moe.native_experts:
        return ("mixture-of-experts layers whose experts the native kernels do not run (SiLU experts, float32 in "
                "panels or on GGUF blocks)")
    if dtype is not torch.float32 and moe.router_panels is None:
        return "a mixture-of-experts router under bfloat16 activations (float32 panels with GGUF experts only)"
    if moe.shared_gate_up is not None:
        return "a shared expert beside the routed ones"
    return None


def _layer_why_not(layer: DecoderLayer, dtype: torch.dtype, max_segments: int) -> str | None:
    if layer.moe is not None and (reason := _moe_why_not(layer, dtype)) is not None:
        return reason
    if layer.sinks is not None or set(layer.attn_kwargs) - {"soft_cap"}:
        return "attention sinks"
    if layer.q_norm is not None and layer.spec.qk_norm != "per_head":
        return "q/k norms over the whole projection"
    if layer.input_norm is None or layer.pre_mlp_norm is None or (layer.post_attn_norm is None) != (
            layer.post_mlp_norm is None):
        return "norms placed after attention or the MLP only"
    # the norm kernels take weights of the rows' dtype, or float32 ones under bfloat16 rows (Gemma's)
    norm_dtypes = {w.dtype for w in _norms(layer)}
    if not all(w.is_contiguous() for w in _norms(layer)) or len(norm_dtypes) != 1 or not (
            norm_dtypes <= {dtype} or (dtype is torch.bfloat16 and norm_dtypes == {torch.float32})):
        return "norm weights in another dtype than the activations"
    for proj in layer.projections():
        if layer.moe is not None and proj is layer.moe.router and layer.moe.router_panels is not None:
            continue  # the loop reads the router's float32 panels (_moe_why_not)
        blocks = proj.quant_method.native_blocks(proj)
        if blocks is None and proj.quant_method.native_panels(proj) is None:
            return f"{proj.quant_method.describe()} weights neither as GGUF blocks nor as float32 panels"
        if blocks is not None and len(blocks) > max_segments:
            return f"more than {max_segments} runs of block types in one layer"
        if proj.bias is not None and not (proj.bias.dtype is dtype and proj.bias.is_contiguous()):
            return "a bias in another dtype than the activations"
    return None


class NativeDecodeLayers:
    """The records of one model's layers over its bound caches, and the step call. Build it only for a model
    ``why_not`` finds nothing against (the decoder does, after every ``bind_kv_caches``)."""

    @staticmethod
    def why_not(model: DecoderForCausalLM) -> str | None:
        """Why ``model`` cannot run its decode steps natively, or None where it can."""
        entry = _entry()
        if entry is None:
            return "the native CPU kernels are not built"
        dtype = model.dtype
        if model.device.type != "cpu" or dtype not in _DTYPES:
            return "not float32 or bfloat16 on the CPU"
        if model.parallel.tp_size > 1 or model.parallel.pp_size > 1:
            return "tensor or pipeline parallelism"
        if not model.interleaved_rope or any(sin is not None for sin in model.rope_sin):
            return "RoPE in HF's two-halves layout"
        if not model.k_caches or len(model.layers) == 0:
            return "no bound KV caches"
        for kc, vc in zip(model.k_caches, model.v_caches, strict=True):
            if kc.dtype is not dtype or vc.dtype is not dtype or not (kc.is_contiguous() and vc.is_contiguous()):
                return "a KV cache in another dtype than the activations"
        for layer in model.layers:
            reason = _layer_why_not(layer, dtype, entry[3])
            if reason is not None:
                return reason
        return None

    def __init__(self, model: DecoderForCausalLM) -> None:
        entry = _entry()
        assert entry is not None
        self._fn, layer_slots, step_slots, self._max_segments = entry
        self.dtype = model.dtype
        # the rows up to which the Python layers take the same kernels: the GGUF GEMM's register-tiled path,
        # the panel GEMM (float32 weights)
        self.max_rows = min(ops.GGUF_NATIVE_MAX_ROWS[model.dtype], small_batch_rows())
        self._keep: list[torch.Tensor] = []  # every tensor a record points at, alive as long as the records
        self._moe_records: list[np.ndarray] = []  # the MoE layers' records, which the layer records point at
        layers = model.layers
        records = np.zeros((len(layers), layer_slots), dtype=np.int64)
        widths = {"qkv": 0, "qk": 0, "attn": 0, "inter": 0, "experts": 1, "top_k": 1}
        for i, (layer, kc, vc) in enumerate(zip(layers, model.k_caches, model.v_caches, strict=True)):
            records[i] = self._layer_record(layer, kc, vc, layer_slots)
            widths["qkv"] = max(widths["qkv"], (layer.local_heads + 2 * layer.local_kv_heads) * layer.head_dim)
            widths["qk"] = max(widths["qk"], (layer.local_heads + layer.local_kv_heads) * layer.head_dim)
            widths["attn"] = max(widths["attn"], layer.local_heads * layer.head_dim)
            widths["inter"] = max(widths["inter"], layer.local_inter)
            if layer.moe is not None:
                widths["experts"] = max(widths["experts"], layer.moe.moe.num_experts)
                widths["top_k"] = max(widths["top_k"], layer.moe.moe.top_k)
        self._records = records
        m, hidden, dtype = self.max_rows, model.hidden_size, model.dtype
        widths.update(x=hidden, h=hidden, normed=hidden, gate_up=2 * widths["inter"], act=widths["inter"],
                      moe_logits=widths["experts"], moe_weights=widths["top_k"], moe_out=hidden)
        self._buffers = {name: torch.empty((m, widths[name]), dtype=dtype) for name in
                         ("x", "h", "normed", "qkv", "qk", "attn", "gate_up", "act")}
        self._buffers.update({name: torch.empty((m, widths[name]), dtype=torch.float32)
                              for name in ("moe_logits", "moe_weights", "moe_out")})
        self._buffers["moe_ids"] = torch.empty((m, widths["top_k"]), dtype=torch.int64)
        self._rope_cos = model.rope_cos
        # numpy, not torch: a step writes a dozen slots, and a torch element write costs a microsecond or two
        self._cis_ptrs = np.zeros(len(model.rope_cos), dtype=np.int64)
        self._step = np.zeros(step_slots, dtype=np.int64)
        b = self._buffers
        for slot, name in ((S_X, "x"), (S_H, "h"), (S_NORMED, "normed"), (S_QKV, "qkv"), (S_QK, "qk"),
                           (S_ATTN, "attn"), (S_GATE_UP, "gate_up"), (S_ACT, "act"), (S_MOE_LOGITS, "moe_logits"),
                           (S_MOE_IDS, "moe_ids"), (S_MOE_WEIGHTS, "moe_weights"), (S_MOE_OUT, "moe_out")):
            self._step[slot] = b[name].data_ptr()
        self._step[S_CIS] = self._cis_ptrs.ctypes.data
        self._step[S_BF16] = int(dtype is torch.bfloat16)

    def _gemm_slots(self, proj: Linear, panels: torch.Tensor | None = None) -> list[int]:
        """The GEMM record of ``proj``: its GGUF blocks or float32 panels, or ``panels`` given for it (a MoE
        router's float32 panels under bfloat16 rows, which has no bias)."""
        bias = 0 if proj.bias is None or panels is not None else proj.bias.data_ptr()
        blocks = None if panels is not None else proj.quant_method.native_blocks(proj)
        if blocks is None:
            panels = panels if panels is not None else proj.quant_method.native_panels(proj)
            assert panels is not None
            self._keep.append(panels)
            return [bias, _PANELS, panels.data_ptr(), proj.out_per_rank] + [0] * (5 * self._max_segments - 2)
        slots = [bias, len(blocks)]
        for row, rows, qtype, data in blocks:
            if data.stride(1) != 1:
                data = data.contiguous()
            self._keep.append(data)
            slots += [qtype, data.data_ptr(), data.stride(0), row, rows]
        return slots + [0] * (5 * (self._max_segments - len(blocks)))

    def _layer_record(self, layer: DecoderLayer, kc: torch.Tensor, vc: torch.Tensor, slots: int) -> list[int]:
        rec = [0] * slots
        assert layer.input_norm is not None and layer.pre_mlp_norm is not None
        self._keep += [layer.input_norm, layer.pre_mlp_norm, kc, vc]
        rec[L_IN_NORM], rec[L_MLP_NORM] = layer.input_norm.data_ptr(), layer.pre_mlp_norm.data_ptr()
        rec[L_EPS], rec[L_SCALE] = _double_bits(layer.eps), _double_bits(layer.scale)
        rec[L_SOFT_CAP] = _double_bits(layer.attn_kwargs.get("soft_cap") or 0.0)
        rec[L_GELU] = int(layer.spec.activation == "gelu_tanh")
        rec[L_NORM_F32] = int(layer.input_norm.dtype is not self.dtype)
        if layer.post_attn_norm is not None and layer.post_mlp_norm is not None:  # Gemma's sandwich
            self._keep += [layer.post_attn_norm, layer.post_mlp_norm]
            rec[L_POST_ATTN_NORM] = layer.post_attn_norm.data_ptr()
            rec[L_POST_MLP_NORM] = layer.post_mlp_norm.data_ptr()
        if layer.q_norm is not None and layer.k_norm is not None:  # per head (why_not refuses the others)
            self._keep += [layer.q_norm, layer.k_norm]
            rec[L_Q_NORM], rec[L_K_NORM] = layer.q_norm.data_ptr(), layer.k_norm.data_ptr()
        rec[L_K_CACHE], rec[L_V_CACHE] = kc.data_ptr(), vc.data_ptr()
        rec[L_HEADS], rec[L_KV_HEADS], rec[L_HEAD_DIM] = layer.local_heads, layer.local_kv_heads, layer.head_dim
        rec[L_BLOCK_SIZE], rec[L_NUM_SLOTS] = kc.shape[1], kc.shape[0] * kc.shape[1]
        rec[L_WINDOW], rec[L_ROPE] = layer.sliding_window or 0, layer.rope_index
        rec[L_INTER], rec[L_HIDDEN] = layer.local_inter, layer.spec.hidden_size
        gemm_slots = (slots - L_GEMMS) // 4
        mlp = (layer.gate_up_proj, layer.down_proj) if layer.moe is None else (layer.moe.router, None)
        for g, proj in enumerate((layer.qkv_proj, layer.o_proj, *mlp)):
            if proj is not None:  # a MoE layer's router is its gate|up GEMM, and it has no down GEMM
                at = L_GEMMS + g * gemm_slots
                panels = layer.moe.router_panels if layer.moe is not None and proj is layer.moe.router else None
                rec[at:at + gemm_slots] = self._gemm_slots(proj, panels)
        if layer.moe is not None:
            rec[L_MOE] = self._moe_record(layer.moe)
        return rec

    def _moe_record(self, block: MoEBlock) -> int:
        """The address of a MoE layer's record (kept alive here), whose experts ``_moe_why_not`` accepted."""
        moe, w13, w2 = block.moe, block.w13, block.w2
        rec = np.zeros(M_SLOTS, dtype=np.int64)
        rec[M_EXPERTS], rec[M_TOPK], rec[M_INTER] = moe.num_experts, moe.top_k, block.local_inter
        rec[M_TOPK_FIRST], rec[M_RENORMALIZE] = int(moe.routing == "topk_softmax"), int(moe.renormalize)
        self._moe_records.append(rec)
        if block.gguf_experts is not None:  # the blocks: the native GGUF MoE kernel's own argument record
            ex = block.gguf_experts
            self._keep += [ex.gate, ex.up, ex.down]
            args = np.array(ops.gguf_moe_native_args(ex, self.dtype), dtype=np.int64)
            self._moe_records.append(args)
            rec[M_GGUF] = args.ctypes.data
            return int(rec.ctypes.data)
        assert isinstance(w13, ops.PackedExperts) and isinstance(w2, ops.PackedExperts)
        assert w13.panels is not None and w2.panels is not None
        rec[M_W13], rec[M_W2] = w13.panels.data_ptr(), w2.panels.data_ptr()
        # the down bias is added by rank 0 only in the Python layer: the native loop runs one rank
        for slot, bias in ((M_W13_BIAS, block.w13_bias), (M_W2_BIAS, block.w2_bias)):
            if bias is not None:
                bias = bias.detach().float().contiguous()
                self._keep.append(bias)
                rec[slot] = bias.data_ptr()
        self._keep += [w13.panels, w2.panels]
        return int(rec.ctypes.data)

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The layers' output for the step's rows ``x [T, hidden]`` (a view of a buffer kept here, valid
        until the next call), or None where this step is not one the native loop takes (the caller runs the
        layers in Python)."""
        t = x.shape[0]
        if not 0 < t <= self.max_rows or meta.max_query_len != 1 or x.dtype is not self.dtype:
            return None
        bt, ctx, qsl = meta.block_tables, meta.context_lens, meta.query_start_loc
        slots = meta.slot_mapping
        if not (bt.dtype is ctx.dtype is qsl.dtype is torch.int32 and slots.dtype is torch.int64
                and bt.stride(-1) == 1 and ctx.is_contiguous() and qsl.is_contiguous() and slots.is_contiguous()
                and slots.shape[0] == t):
            return None
        cis = [cos.index_select(0, positions) for cos in self._rope_cos]  # [T, head_dim / 2] complex each
        for i, c in enumerate(cis):
            self._cis_ptrs[i] = c.data_ptr()
        buf = self._buffers["x"][:t]
        buf.copy_(x)
        step = self._step
        step[S_ROWS], step[S_SLOTS], step[S_BLOCK_TABLES], step[S_BT_STRIDE] = t, slots.data_ptr(), bt.data_ptr(), \
            bt.stride(0)
        step[S_CONTEXT_LENS], step[S_QSL], step[S_SEQS] = ctx.data_ptr(), qsl.data_ptr(), ctx.shape[0]
        step[S_THREADS] = torch.get_num_threads()
        rc = self._fn(self._records.ctypes.data, self._records.shape[0], step.ctypes.data)
        del cis  # alive until the call returned
        if rc != 0:
            layer, code = divmod(rc, 1000)
            raise RuntimeError(f"the native decode layers failed at layer {layer - 1} (code {code})")
        return buf

"""Mixture-of-experts execution: routing, the block-aligned expert sort the Triton path reads, and the CPU path.

``kernels.ops`` re-exports ``moe_route`` and dispatches ``fused_moe`` (see there); the definition of the layer
and the torch reference are in ``moe_reference``, the Triton kernels in ``moe_triton``.

Routing (``moe_route``) covers the HF models' orders of operations:

- Mixtral, Qwen2-MoE, Qwen3-MoE: softmax over all experts in float32, top-k, then (Mixtral always,
  Qwen ``norm_topk_prob``) divide by the sum of the k: ``moe_route(logits, k, renormalize=...)``.
- gpt-oss: top-k on the logits, softmax over the k: ``moe_route(logits, k, topk_before_softmax=True)``. Its
  router's bias is the router linear's own bias (``F.linear(x, W, b)``, as in HF): add it there.
- DeepSeek-V3-style routers: sigmoid scores, a score-correction bias that takes part in the selection only
  (the weights are the uncorrected scores), renormalized: ``scoring="sigmoid", correction_bias=b``.

The weights come back float32 whatever the logits' dtype (HF's Qwen modules round them to the model dtype;
the MoE kernels multiply in float32 anyway), the ids int64 as torch.topk gives them (the kernels take int32 too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_native
from .moe_reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, activation, check_expert_ids, check_moe_args

__all__ = ["SCORINGS", "ExpertRuns", "PackedExperts", "moe_route", "moe_align", "fused_moe_cpu"]

SCORINGS = ("softmax", "sigmoid")


def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    topk_before_softmax: bool = False,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [T, k], topk_ids int64 [T, k])`` from ``router_logits [T, E]``.

    ``scoring`` turns logits into scores (softmax over the experts, or an independent sigmoid each);
    ``topk_before_softmax`` instead selects on the logits and takes the softmax over the k selected (softmax
    scoring only). ``correction_bias [E]`` is added to what the selection ranks, never to the weights.
    ``renormalize`` divides the k weights by their sum (a no-op after ``topk_before_softmax``)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if router_logits.dim() != 2 or not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"router_logits must be [T, E] with 1 <= top_k <= E; got {tuple(router_logits.shape)}, "
                         f"top_k={top_k}")
    if topk_before_softmax and scoring != "softmax":
        raise ValueError("topk_before_softmax takes softmax scoring")
    if correction_bias is not None and correction_bias.shape != router_logits.shape[1:]:
        raise ValueError(f"correction_bias must be [{router_logits.shape[1]}], got {tuple(correction_bias.shape)}")
    logits = router_logits.float()
    if topk_before_softmax:
        scores = logits
    elif scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    if correction_bias is None:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if topk_before_softmax:
        weights = torch.softmax(weights, dim=-1)
    elif renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """The (token, slot) pairs sorted by expert, each expert's run padded to a multiple of ``block_m``, so
    that a block of ``block_m`` rows belongs to one expert. Pure torch and free of device syncs (sizes are
    upper bounds, the real extent is a device tensor), so a CUDA caller never waits here.

    Returns ``sorted_ids`` int32 ``[max_blocks * block_m]``: pair indices ``t * k + j`` by expert (stable,
    so in token order within an expert), padding slots hold ``T * k``; ``expert_ids`` int32 ``[max_blocks]``:
    each block's expert, -1 past the end; ``num_post_padded`` int32 ``[1]``: the used length of sorted_ids.
    Experts without tokens get no block."""
    flat = topk_ids.reshape(-1).long()
    pairs, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    cnt_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    dest = pad_start[sorted_e] + torch.arange(pairs, device=dev) - cnt_start[sorted_e]
    # at most min(E, pairs) experts have tokens, each wasting under block_m slots
    max_blocks = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)
    sorted_ids = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(max_blocks, device=dev) * block_m
    expert_ids = torch.searchsorted(pad_end, starts, right=True)
    total = pad_end[-1:] if num_experts else torch.zeros(1, dtype=torch.int64, device=dev)
    expert_ids = torch.where(starts < total, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


class PackedExperts:
    """A stack of expert weights ``[E, N, K]`` (``w13`` or ``w2``) repacked once for the CPU GEMMs the dense
    layers use (``daemon/engine/models/linear.py``), in place of the dense stack: one copy, never two.

    - ``panels`` (float32, where the native panel kernel is built): each expert's ``ops.pack_panels`` layout,
      ``[E, N / width, K, width]``, written over the dense stack's own memory when N is a multiple of the
      panel width. ``panel_gemm`` reads it for any row count, in runs of up to ``panel_gemm_max_rows`` rows
      (each run streams the expert once; on AVX-512 the kernel leads oneDNN up to 512 rows and is level
      beyond, see kernels/csrc/small_gemm_cpu.c).
    - ``packed`` (bfloat16, or float32 without panels): one oneDNN-prepacked weight per expert (what
      ``linear.prepack`` makes), for any row count.

    Only ``fused_moe_cpu`` reads these; ``shape``/``dtype``/``dim()`` mirror the dense stack's so that the
    argument checks and callers that read ``w13.shape[0]`` work unchanged."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, *, panels: torch.Tensor | None = None,
                 packed: list[torch.Tensor] | None = None) -> None:
        if (panels is None) == (packed is None):
            raise ValueError("PackedExperts holds either panels or oneDNN-packed weights")
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.panels = panels
        self.packed = packed
        self._max_rows = cpu_native.panel_gemm_max_rows() if panels is not None else 0

    @classmethod
    def pack(cls, weight: torch.Tensor, *, panels: bool) -> PackedExperts:
        """``weight [E, N, K]`` (CPU, float32 or bfloat16) repacked: panels where ``panels`` is asked for and
        the kernel takes the weight (float32 with the native build), oneDNN-packed otherwise. With panels the
        dense memory is overwritten when the sizes allow (the caller must not read ``weight`` afterwards)."""
        if weight.dim() != 3 or not weight.is_cpu:
            raise ValueError(f"expected a CPU expert stack [E, N, K], got {tuple(weight.shape)} on {weight.device}")
        w = weight.detach()
        e, n, k = w.shape
        if panels and e and cpu_native.panel_gemm_max_rows() > 0:
            first = cpu_native.pack_panels(w[0].contiguous())
            if first is not None:
                if w.is_contiguous() and first.numel() == n * k:  # no padding: the panels go over the dense rows
                    out = w.view(e, *first.shape)
                else:
                    out = torch.empty((e, *first.shape), dtype=torch.float32)
                out[0].copy_(first)
                del first
                for i in range(1, e):
                    out[i].copy_(cpu_native.pack_panels(w[i].contiguous()))  # one expert's worth of scratch
                return cls((e, n, k), w.dtype, panels=out)
        return cls((e, n, k), w.dtype, packed=[_onednn_pack(w[i]) for i in range(e)])

    def dim(self) -> int:
        return 3

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the weights (for the module's buffers, so that weight counts see them)."""
        return [self.panels] if self.panels is not None else list(self.packed or ())

    def mm(self, e: int, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """``out = x @ W[e].T (+ bias)`` for rows ``x [M, K]`` in the weights' dtype; ``out [M, N]`` rows."""
        n = self.shape[1]
        if self.panels is not None:
            p = self.panels[e]
            if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
                bias = bias.float().contiguous()
            step = self._max_rows
            for lo in range(0, x.shape[0], step):
                hi = min(lo + step, x.shape[0])
                if cpu_native.panel_gemm(x[lo:hi], p, n, bias, out=out[lo:hi]) is None:
                    raise RuntimeError("panel_gemm refused packed expert weights (native kernels unloaded?)")
            return
        assert self.packed is not None
        if not x.is_contiguous():
            x = x.contiguous()
        if bias is not None:
            bias = bias.to(x.dtype)
        out.copy_(torch.ops.mkldnn._linear_pointwise(x, self.packed[e], bias, "none", [], ""))  # noqa: SLF001


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    """One expert's ``[N, K]`` weight in oneDNN's layout for any row count (as ``linear.prepack``)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)  # noqa: SLF001


def onednn_pack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack CPU weights of ``dtype`` here (float32; bfloat16 with AVX512-BF16/AMX)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # noqa: SLF001
    return dtype == torch.float32


def _expert_mm(w: torch.Tensor | PackedExperts, e: int, x: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor) -> None:
    if isinstance(w, PackedExperts):
        w.mm(e, x, None if bias is None else bias[e], out)
    elif bias is None:
        torch.mm(x, w[e].T, out=out)
    else:
        torch.addmm(bias[e].to(x.dtype), x, w[e].T, out=out)


def fused_moe_cpu(
    hidden: torch.Tensor,
    w13: torch.Tensor | PackedExperts,
    w2: torch.Tensor | PackedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = GPT_OSS_ALPHA,
    swiglu_limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """``moe_reference.fused_moe`` on the CPU: one sort of the pairs by expert and one gather of their rows,
    then per expert with tokens one GEMM per projection over its contiguous run of rows, written in place;
    the activation (the native ``silu_mul`` where it applies), the routing weights and the scatter-add are
    one pass each over all pairs. The weights are dense stacks (oneDNN GEMMs through ``torch.mm``) or
    ``PackedExperts`` (``MoEBlock.prepack_experts``: panel kernels or prepacked oneDNN weights, as the dense
    layers' GEMMs)."""
    act = activation
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias)  # type: ignore[arg-type]
    if (act == "silu" and isinstance(w13, PackedExperts) and isinstance(w2, PackedExperts)
            and w13.panels is not None and w2.panels is not None):
        out = cpu_native.moe_panels(hidden, w13.panels, w2.panels, w2.shape[2], topk_ids.long().contiguous(),
                                    topk_weights.float().contiguous(), w13_bias, w2_bias)
        if out is not None:
            return out
    runs = ExpertRuns.of(topk_ids, w13.shape[0])
    x = hidden.index_select(0, runs.rows)  # every pair's input row, grouped by expert
    gate_up = hidden.new_empty((runs.pairs, 2 * w2.shape[2]))
    for e, lo, hi in runs.spans:
        _expert_mm(w13, e, x[lo:hi], w13_bias, gate_up[lo:hi])
    a = cpu_native.silu_mul(gate_up) if act == "silu" else None
    if a is None:
        a = _activation(gate_up, act, swiglu_alpha, swiglu_limit).to(hidden.dtype)
    y = hidden.new_empty((runs.pairs, hidden.shape[1]))
    for e, lo, hi in runs.spans:
        _expert_mm(w2, e, a[lo:hi], w2_bias, y[lo:hi])
    return runs.weighted_sum(y, topk_weights, hidden)


@dataclass(frozen=True)
class ExpertRuns:
    """A step's (token, slot) pairs grouped by expert, as the CPU paths run them: ``order`` the pair indices
    ``t * k + j`` sorted by expert (stable: token order within an expert), ``rows`` each sorted pair's token,
    ``spans`` (expert, first, end) of each expert with tokens over the sorted pairs."""

    order: torch.Tensor
    rows: torch.Tensor
    spans: list[tuple[int, int, int]]

    @classmethod
    def of(cls, topk_ids: torch.Tensor, num_experts: int) -> ExpertRuns:
        check_expert_ids(topk_ids, num_experts)
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        spans, start = [], 0
        for e, n in enumerate(counts):
            if n:
                spans.append((e, start, start + n))
                start += n
        return cls(order, torch.div(order, topk_ids.shape[1], rounding_mode="floor"), spans)

    @property
    def pairs(self) -> int:
        return self.order.numel()

    def weighted_sum(self, y: torch.Tensor, topk_weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Each token's sum of its experts' outputs ``y`` (``[pairs, H]`` in sorted order, overwritten) times
        their routing weights, in float32, rounded once to ``hidden``'s dtype."""
        weights = topk_weights.reshape(-1).float().index_select(0, self.order)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        out.index_add_(0, self.rows, y.float().mul_(weights[:, None]))
        return out if hidden.dtype == torch.float32 else out.to(hidden.dtype)


_activation = activation  # fused_moe_cpu's keyword shadows the function's name inside it

"""The mixture-of-experts MLP of a decoder layer (``MoESpec``): a router, the routed experts stacked
``[num_experts, ...]`` for ``ops.fused_moe``, and an optional gated shared expert (Qwen2-MoE).

Checkpoints hold the experts one tensor per expert (``experts.N.gate_proj.weight``, Mixtral's ``w1/w3/w2``:
what save_pretrained writes and published Mixtral/Qwen checkpoints hold), or all of a layer's in one
tensor (transformers 5's modules, gpt-oss); both are stacked here at load. With tensor parallelism each rank
holds a slice of every expert's intermediate rows and the outputs are summed over the ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.kernels import ops
from kvpilot.kernels.ops import (
    GGUFExperts,
    PackedExperts,
    fused_moe_cpu,
    fused_moe_gguf,
    onednn_pack_supported,
)

from .linear import Linear
from .moe_gguf import GGUFExpertsLoader
from .parallel import SINGLE, ParallelContext
from .quantization import QuantMethod, get_quant_method
from .spec import DecoderSpec, MoESpec

__all__ = ["MoEBlock", "silu_mul"]

_SHARED = ("gate_proj", "up_proj", "down_proj")


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up over the two halves of ``gu``."""
    act = ops.silu_mul(gu)  # the native one-pass kernel where it applies
    if act is not None:
        return act
    gate, up = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _fits(w: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(w.shape) != shape:
        raise RuntimeError(f"checkpoint shape {tuple(w.shape)} != expected {shape}")
    return w


class MoEBlock(nn.Module):
    def __init__(self, spec: DecoderSpec, *, dtype: torch.dtype, device: torch.device,
                 quant_method: QuantMethod | None = None, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        assert spec.moe is not None
        moe: MoESpec = spec.moe
        if quant_method is not None and quant_method.name not in ("none", "gguf"):
            raise ValueError(f"{spec.arch}: quantization {quant_method.name!r} is not supported for the experts of "
                             "MoE layers (GGUF blocks and float weights are)")
        self.moe, self.arch, self.parallel = moe, spec.arch, parallel
        hidden, experts = spec.hidden_size, moe.num_experts
        kw = {"dtype": dtype, "device": device}
        # routers are never quantized in published checkpoints, and every rank routes all tokens alike
        self.router = Linear.replicated(hidden, experts, bias=moe.router_bias, quant_method=get_quant_method(None),
                                        **kw)
        self.inter_start, self.local_inter = parallel.shard(moe.intermediate_size, "moe_intermediate_size")
        n = self.local_inter
        # a GGUF's experts stay in their blocks (or come as float stacks): built once all are in
        self.gguf_loader = GGUFExpertsLoader(moe.block, experts, hidden, moe.intermediate_size, parallel) \
            if quant_method is not None and quant_method.name == "gguf" else None
        self.gguf_experts: GGUFExperts | None = None
        self.w13: torch.Tensor | PackedExperts | None = None
        self.w2: torch.Tensor | PackedExperts | None = None
        if self.gguf_loader is None:
            self.w13 = _param(experts, 2 * n, hidden, **kw)
            self.w2 = _param(experts, hidden, n, **kw)
        self.w13_bias = _param(experts, 2 * n, **kw) if moe.expert_bias else None
        self.w2_bias = _param(experts, hidden, **kw) if moe.expert_bias else None
        self.experts_packed = False  # see prepack_experts
        # SiLU experts a native kernel runs: float32 ones in panels (prepack_experts), or GGUF blocks on the CPU
        self.native_experts = False
        # the router as float32 panels under bfloat16 rows with native GGUF experts (process_weights_after_loading)
        self.register_buffer("router_panels", None, persistent=False)
        self.shared_gate_up = self.shared_down = self.shared_expert_gate = None
        if moe.shared_expert_size:
            size = moe.shared_expert_size
            tp = {"quant_method": quant_method, "parallel": parallel, **kw}
            self.shared_gate_up = Linear.column(hidden, [size, size], what="shared_expert_intermediate_size", **tp)
            self.shared_down = Linear.row(size, hidden, what="shared_expert_intermediate_size", **tp)
            self.shared_expert_gate = Linear.replicated(hidden, 1, quant_method=get_quant_method(None), **kw)

    def projections(self) -> tuple[Linear, ...]:
        return tuple(p for p in (self.router, self.shared_gate_up, self.shared_down, self.shared_expert_gate)
                     if p is not None)

    def prepack_experts(self, keep_panels: bool = False, *, force_float32: bool = False) -> bool:
        """The routed experts repacked for the CPU GEMMs the dense layers use (``kernels.moe.PackedExperts``),
        in place of the dense stacks: float32 ones as panels for every row count (where the native kernel is
        built and not turned off, and SiLU experts or ``keep_panels``), otherwise one oneDNN-packed weight per
        expert. The router and the shared expert are ``projections()``, which the decoder layer packs itself.
        Call once, after loading (tensor-parallel slices included); False where the experts stay dense (not on
        the CPU, a dtype oneDNN cannot pack here, float32 experts the native kernel does not take unless
        ``force_float32``, the torch MoE backend forced, or packed already)."""
        if self.experts_packed or not isinstance(self.w13, torch.Tensor) or not isinstance(self.w2, torch.Tensor):
            return False  # packed already, or experts that are not dense float stacks (GGUF blocks)
        if self.w13.device.type != "cpu" or not ops.current().prepack_weights:
            return False
        probe = torch.empty(0, self.w13.shape[2], dtype=self.w13.dtype)
        if ops.moe_backend_for(probe) != "cpu":  # the reference path reads dense stacks
            return False
        if not onednn_pack_supported(self.w13.dtype):
            return False
        # the native kernel reads SiLU experts as panels (small_batch_gemm=False turns the panel kernels off)
        native = (self.moe.activation == "silu" and ops.panel_gemm_max_rows() > 0
                  and ops.current().small_batch_gemm is not False)
        if self.w13.dtype == torch.float32 and not (native or force_float32):
            # float32 experts that the native MoE kernel cannot take stay dense: packed for the torch path, a
            # Qwen3-MoE-shaped model's batch-1 step took 1.10x as long (bench/results/moe_model.json)
            return False
        # float32 SiLU experts go to panels (over the dense memory: no second copy), which the native kernel
        # reads in one call per layer (kernels/csrc/moe_cpu.c): a Qwen3-MoE-shaped model's 16-row decode step
        # 1.35x faster than over dense stacks (bench/results/moe_model.json)
        want_panels = self.w13.dtype == torch.float32 and (keep_panels or native)
        for name in ("w13", "w2"):
            packed = PackedExperts.pack(getattr(self, name), panels=want_panels)
            del self._parameters[name]  # the packed stack replaces the dense one (panels: over its memory)
            for i, t in enumerate(packed.tensors()):  # buffers, so that the weight counts see them
                self.register_buffer(f"{name}_packed_{i}", t, persistent=False)
            setattr(self, name, packed)
        self.experts_packed = True
        self.native_experts = want_panels and self.moe.activation == "silu" and self.w13.panels is not None
        return True

    def row_bytes(self, element_size: int) -> int:
        """Bytes of gate|up output per token row (for the caller's row slices)."""
        return self.moe.top_k * 2 * self.local_inter * element_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for normed rows ``x [T, hidden]`` (without the residual)."""
        moe = self.moe
        logits = None
        if self.router_panels is not None:  # bfloat16 rows widened, exactly
            logits = ops.panel_gemm(x.float(), self.router_panels, moe.num_experts)
        if logits is None:
            logits = self.router(x)
        route = {"renormalize": moe.renormalize, "topk_before_softmax": moe.routing == "topk_softmax"}
        # experts the native kernel runs are routed natively too: the native decode loop repeats both bit for bit
        routed = ops.native_moe_route(logits, moe.top_k, **route) if self.native_experts else None
        weights, ids = routed if routed is not None else ops.moe_route(logits, moe.top_k, **route)
        # the per-expert down bias is weighted like its expert's output: one rank adds it, the sum has it once
        w2_bias = self.w2_bias if self.parallel.tp_rank == 0 else None
        if self.gguf_experts is not None:
            out = fused_moe_gguf(x, self.gguf_experts, weights, ids, act=moe.activation,
                                 swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit)
        else:
            # packed experts only the CPU path reads (prepack_experts packs only where ops dispatches to it)
            fused = fused_moe_cpu if self.experts_packed and ops.moe_backend_for(x) != "cpu" else ops.fused_moe
            out = fused(x, self.w13, self.w2, weights, ids, activation=moe.activation, w13_bias=self.w13_bias,
                        w2_bias=w2_bias, swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit)
        out = self.parallel.all_reduce(out)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None and self.shared_expert_gate is not None
            shared = self.shared_down(silu_mul(self.shared_gate_up(x)))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    # ------------------------------------------------------------------ weights

    def expected_names(self) -> set[str]:
        """Checkpoint names relative to the layer (``mlp.experts.0.gate_proj.weight``)."""
        moe, b = self.moe, self.moe.block
        names = {f"{b}.{moe.router}.weight"} | ({f"{b}.{moe.router}.bias"} if moe.router_bias else set())
        if self.gguf_loader is not None:
            names |= self.gguf_loader.names()
        elif moe.fused == "gpt_oss":
            names |= {f"{b}.experts.{t}" for t in ("gate_up_proj", "down_proj")}
            if moe.expert_bias:
                names |= {f"{b}.experts.{t}_bias" for t in ("gate_up_proj", "down_proj")}
        else:
            names |= self._per_expert_names()
        if moe.shared_expert_size and self.shared_down is not None:
            kinds = self.shared_down.quant_method.checkpoint_names()
            names |= {f"{b}.shared_expert.{p}.{k}" for p in _SHARED for k in kinds} | {f"{b}.shared_expert_gate.weight"}
        return names

    def process_weights_after_loading(self) -> None:
        """Once every tensor is in: a GGUF's experts built from their blocks (``GGUFExperts``), or as the float
        stacks a file that keeps them in float holds."""
        if self.gguf_loader is None:
            return
        built = self.gguf_loader.build(self.router.weight.dtype)
        self.gguf_loader = None
        if isinstance(built, GGUFExperts):
            self.gguf_experts = built
            # SiLU experts on the CPU: a decode step's rows go to the native MoE kernel (kernels/gguf_moe.py)
            self.native_experts = (self.moe.activation == "silu" and built.gate.is_cpu
                                   and ops.gguf_moe_native_available())
            router = self.router.weight
            if self.native_experts and router.dtype is torch.bfloat16 and self.router.bias is None:
                # under bfloat16 rows the router runs in float32 on panels (as llama.cpp routes in float32): the
                # native decode loop takes float32 panels and GGUF blocks, and this keeps its bfloat16 steps too
                self.router_panels = ops.pack_panels(router.detach().float())
            for name in ("gate", "up", "down"):  # buffers, so that the weight counts see them
                self.register_buffer(f"gguf_{name}_experts", getattr(built, name), persistent=False)
        else:
            self.w13, self.w2 = (nn.Parameter(w.to(self.router.weight.device), requires_grad=False) for w in built)

    def _per_expert_names(self) -> set[str]:
        b = self.moe.block
        return {f"{b}.experts.{e}.{p}.weight" for e in range(self.moe.num_experts) for p in self.moe.expert_names}

    def load(self, rel: str, w: torch.Tensor) -> tuple[str, ...]:
        """Tensor ``rel`` (its name relative to the layer) into place; the expected names it covers, () where
        it is not the block's."""
        moe = self.moe
        rest = next((rel[len(a) + 1:] for a in (moe.block, *moe.aliases) if rel.startswith(a + ".")), None)
        if rest is None:
            return ()
        name = f"{moe.block}.{rest}"
        module, _, kind = rest.rpartition(".")
        linears = {moe.router: (self.router, 0), "shared_expert_gate": (self.shared_expert_gate, 0),
                   "shared_expert.gate_proj": (self.shared_gate_up, 0), "shared_expert.up_proj": (self.shared_gate_up, 1),
                   "shared_expert.down_proj": (self.shared_down, 0)}
        if module in linears:
            proj, partition = linears[module]
            if proj is None or kind not in (*proj.quant_method.checkpoint_names(), *(("bias",) if proj.bias is not None
                                                                                     else ())):
                return ()
            proj.load(kind, w, partition)
            return (name,)
        if self.gguf_loader is not None and module.startswith("experts."):  # a GGUF's stacked blocks
            return (name,) if self.gguf_loader.load(module.removeprefix("experts."), kind, w) else ()
        if module == "experts":  # all experts in one tensor
            return self._load_fused(kind, w)
        parts = rest.split(".")
        if (len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit() and parts[3] == "weight"
                and parts[2] in moe.expert_names and int(parts[1]) < moe.num_experts and moe.fused == "stacked"):
            self._load_expert(int(parts[1]), moe.expert_names.index(parts[2]), w)
            return (name,)
        return ()

    def _check_dense(self) -> None:
        if self.experts_packed:
            raise RuntimeError("expert weights cannot be loaded after prepack_experts")

    def _load_expert(self, e: int, which: int, w: torch.Tensor) -> None:
        """One expert's gate (0), up (1) or down (2) ``weight`` into the stacks: this rank's rows of it."""
        self._check_dense()
        hidden, inter = self.w2.shape[1], self.moe.intermediate_size
        s, n = self.inter_start, self.local_inter
        if which == 2:
            self.w2.data[e].copy_(_fits(w, (hidden, inter))[:, s:s + n])
        else:
            self.w13.data[e, which * n:(which + 1) * n].copy_(_fits(w, (inter, hidden))[s:s + n])

    def _load_fused(self, kind: str, w: torch.Tensor) -> tuple[str, ...]:
        moe = self.moe
        self._check_dense()
        experts, hidden, inter = moe.num_experts, self.w2.shape[1], moe.intermediate_size
        s, n = self.inter_start, self.local_inter
        if moe.fused == "gpt_oss":  # [E, in, out], gate/up interleaved: rank rows 2s.. hold pairs s..s+n
            if kind == "gate_up_proj":
                self.w13.data.copy_(_fits(w, (experts, hidden, 2 * inter)).transpose(1, 2)[:, 2 * s:2 * (s + n)])
            elif kind == "down_proj":
                self.w2.data.copy_(_fits(w, (experts, inter, hidden)).transpose(1, 2)[:, :, s:s + n])
            elif kind == "gate_up_proj_bias" and self.w13_bias is not None:
                self.w13_bias.data.copy_(_fits(w, (experts, 2 * inter))[:, 2 * s:2 * (s + n)])
            elif kind == "down_proj_bias" and self.w2_bias is not None:
                self.w2_bias.data.copy_(_fits(w, (experts, hidden)))
            else:
                return ()
            return (f"{moe.block}.experts.{kind}",)
        if kind == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            _fits(w, (experts, 2 * inter, hidden))
            self.w13.data.copy_(torch.cat((w[:, s:s + n], w[:, inter + s:inter + s + n]), dim=1))
            covers = moe.expert_names[:2]
        elif kind == "down_proj":
            self.w2.data.copy_(_fits(w, (experts, hidden, inter))[:, :, s:s + n])
            covers = moe.expert_names[2:]
        else:
            return ()
        return tuple(f"{moe.block}.experts.{e}.{p}.weight" for e in range(experts) for p in covers)

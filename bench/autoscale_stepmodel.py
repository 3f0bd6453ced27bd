"""Step-time models for the autoscaling simulator: seconds of one engine step from its shape.

    step_s = overhead + prefill_token * P + prefill_attn * P * ctx_pos + decode_seq * D + context_token * C

P prefill tokens in the step, D decoding sequences, C the context tokens those sequences read. Two calibrations:
- `cpu`: least squares (on relative error) over the whole engine steps `bench/autoscale_stepprofile.py` timed
  on this CPU with the demo's daemon settings (SmolLM2-135M, float32, one thread), each shape the fastest of
  several interleaved rounds; `calibration_report()` states how far the fit is from each shape.
- `h200_llama8b`: the H200 figures of `bench/results/gpu_h200.md` scaled to Llama-3-8B's shape (see `h200()`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
CPU_PROFILE = RESULTS / "autoscale_step_cpu.json"  # bench/autoscale_stepprofile.py


@dataclass(frozen=True)
class StepModel:
    name: str
    overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    prefill_attn_s: float = 0.0  # per prefill token per earlier position (causal attention), quadratic in L

    def step_s(self, prefill_tokens: float, decode_seqs: float, context_tokens: float) -> float:
        return (self.overhead_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs
                + self.context_token_s * context_tokens)

    def prefill_work_s(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """Compute time of a whole prompt, apart from the per-step overhead the decode side pays anyway."""
        return self.prefill_token_s * tokens + self.prefill_attn_s * tokens * tokens / 2.0


@dataclass(frozen=True)
class Point:
    shape: str
    prefill_tokens: float
    decode_seqs: float
    context_tokens: float
    step_s: float


def profile_points(path: Path = CPU_PROFILE) -> list[Point]:
    """The shapes autoscale_stepprofile.py timed: "[prefill tokens, decoding sequences, context]" -> seconds."""
    d = json.loads(path.read_text())
    pts = []
    for key, v in d["shapes"].items():
        p, dec, ctx = json.loads(key)
        pts.append(Point(f"P{p} D{dec} C{ctx}", float(p), float(dec), float(ctx), float(v["step_s"])))
    return pts


def fit(name: str, pts: list[Point]) -> tuple[StepModel, list[dict[str, float | str]]]:
    """Least squares on relative error (each row divided by its time), coefficients kept >= 0 by dropping a
    negative one and refitting: a negative cost per token would make long steps cheaper."""
    cols = ["overhead_s", "prefill_token_s", "decode_seq_s", "context_token_s"]
    x = np.array([[1.0, p.prefill_tokens, p.decode_seqs, p.context_tokens] for p in pts])
    y = np.array([p.step_s for p in pts])
    active = list(range(len(cols)))
    coef = np.zeros(len(cols))
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] / y[:, None], np.ones(len(y)), rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    model = StepModel(name, **{c: float(v) for c, v in zip(cols, coef, strict=True)})
    rows = [{"shape": p.shape, "measured_s": p.step_s,
             "model_s": model.step_s(p.prefill_tokens, p.decode_seqs, p.context_tokens),
             "rel_err": model.step_s(p.prefill_tokens, p.decode_seqs, p.context_tokens) / p.step_s - 1.0}
            for p in pts]
    return model, rows


CPU_NAME = "cpu_smollm2_135m_fp32_1thread"


def cpu() -> StepModel:
    return fit(CPU_NAME, profile_points())[0]


# Llama-3-8B: 8.03e9 parameters in bf16; 32 layers, 8 KV heads of 128: 2*8*128*2 bytes*32 = 128 KiB a token.
LLAMA8B_PARAMS = 8.03e9
LLAMA8B_LAYERS = 32
LLAMA8B_KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2 * LLAMA8B_LAYERS
H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA's H200 SXM datasheet; prefill assumed at half of it
H200_KV_BLOCKS_LLAMA8B = 55_000  # (0.9 * 141 GB - 16 GB weights - ~4 GB activations) / 128 KiB / 16 tokens


def h200() -> StepModel:
    """gpu_h200.md measured, on one H200, decode attention in Llama-8B's layout (32/8 heads, d 128, bf16):
    128 sequences x 4096 context in 531 us for one layer (4047 GB/s). Scaled to the whole model:
    - context: 531 us / (128 * 4096) per token per layer, x 32 layers;
    - overhead: the bf16 weights (16.1 GB) read once a step at that same 4047 GB/s, plus 2 ms of host time
      (run 3: 96 requests, ~130 steps of graphs in 0.46 s, so at most 3.5 ms a step with prefill inside);
    - prefill and per-sequence GEMMs: 2 * params FLOPs a token at half the datasheet's bf16 dense peak, and
      causal attention 4 * 4096 * position FLOPs a token per layer at the same rate."""
    per_ctx = 531e-6 / (128 * 4096) * LLAMA8B_LAYERS
    weights_s = LLAMA8B_PARAMS * 2 / 4047e9
    flops = H200_BF16_DENSE_FLOPS * 0.5
    per_token = 2 * LLAMA8B_PARAMS / flops
    return StepModel("h200_llama8b_bf16", overhead_s=weights_s + 2e-3, prefill_token_s=per_token,
                     decode_seq_s=per_token, context_token_s=per_ctx,
                     prefill_attn_s=4 * 4096 * LLAMA8B_LAYERS / flops)


def calibration_report() -> dict[str, object]:
    model, rows = fit(CPU_NAME, profile_points())
    errs = [abs(float(r["rel_err"])) for r in rows]
    return {"cpu": asdict(model), "cpu_points": rows, "cpu_max_rel_err": max(errs),
            "cpu_median_rel_err": float(np.median(errs)), "cpu_mean_rel_err": sum(errs) / len(errs),
            "h200_llama8b": asdict(h200()), "h200_kv_blocks": H200_KV_BLOCKS_LLAMA8B}

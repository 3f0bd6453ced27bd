"""Seeded request traces for the autoscaling simulator: arrival times and request shapes.

Rates are in "replicas' worth": the rate one replica serves at 70% of its saturated throughput on the trace's
own request mix (see `replica_rate`). Arrivals are Poisson over 1 s bins of the rate curve. To keep 200
replicas x 2 hours inside a couple of minutes, a row may stand for `weight` identical requests arriving
together (a cohort); every count and percentile is weighted by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from autoscale_stepmodel import StepModel


@dataclass(frozen=True)
class Trace:
    name: str
    t: np.ndarray  # arrival, s, sorted
    prompt: np.ndarray  # tokens
    output: np.ndarray  # tokens
    weight: int
    duration: float
    min_replicas: int = 1
    seed: int = 0
    description: str = ""

    @property
    def requests(self) -> int:
        return int(len(self.t) * self.weight)


def chat_shapes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    prompt = np.clip(rng.lognormal(math.log(600), 0.8, n), 32, 4096).astype(np.int64)
    output = np.clip(rng.lognormal(math.log(200), 0.7, n), 16, 1024).astype(np.int64)
    return prompt, output


def rag_shapes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed prompts: log-uniform over 4k-16k tokens, short answers."""
    prompt = np.exp(rng.uniform(math.log(4096), math.log(16384), n)).astype(np.int64)
    output = np.clip(rng.lognormal(math.log(150), 0.6, n), 16, 1024).astype(np.int64)
    return prompt, output


def mixed_shapes(rag_share: float) -> Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]:
    def shapes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        p, o = chat_shapes(rng, n)
        rag = rng.random(n) < rag_share
        rp, ro = rag_shapes(rng, int(rag.sum()))
        p[rag], o[rag] = rp, ro
        return p, o
    return shapes


def replica_rate(step: StepModel, prompt: float, output: float, max_batch: int, kv_tokens: float,
                 load: float = 0.7) -> float:
    """Requests/s one replica serves at `load` of saturation: a full batch (or as many as the KV holds)
    decoding, plus each request's prefill."""
    batch = min(max_batch, kv_tokens / (prompt + output / 2.0))
    step_s = step.step_s(0.0, batch, batch * (prompt + output / 2.0))
    per_request = output * step_s / batch + float(step.prefill_work_s(prompt))
    return load / per_request


def generate(name: str, rate: Callable[[np.ndarray], np.ndarray], duration: float, seed: int,
             shapes: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]], max_rows: float = 2e6,
             min_replicas: int = 1, description: str = "") -> Trace:
    rng = np.random.default_rng(seed)
    bins = np.arange(0.0, duration, 1.0)
    lam = np.maximum(rate(bins), 0.0)
    weight = max(1, math.ceil(lam.sum() / max_rows))
    counts = rng.poisson(lam / weight)
    t = np.repeat(bins, counts) + rng.random(int(counts.sum()))
    t.sort()
    prompt, output = shapes(rng, len(t))
    return Trace(name, t, prompt, output, weight, duration, min_replicas, seed, description)


def standard(step: StepModel, max_batch: int, kv_tokens: float, seed: int = 1, scale: float = 1.0,
             short: bool = False) -> list[Trace]:
    """The issue's five shapes (the diurnal one at 50 and at 200 replicas). `scale` multiplies every rate,
    `short` cuts durations by 4 (tests, quick looks)."""
    mean_chat = (math.exp(math.log(600) + 0.32), math.exp(math.log(200) + 0.245))
    one = replica_rate(step, mean_chat[0], mean_chat[1], max_batch, kv_tokens) * scale
    rag_share = 0.2
    mp = (1 - rag_share) * mean_chat[0] + rag_share * 8860.0
    mo = (1 - rag_share) * mean_chat[1] + rag_share * 180.0
    one_rag = replica_rate(step, mp, mo, max_batch, kv_tokens) * scale
    k = 0.25 if short else 1.0
    two_h, hour = 7200.0 * k, 3600.0 * k

    def diurnal(peak: float) -> Callable[[np.ndarray], np.ndarray]:
        return lambda t: one * peak * (0.15 + 0.85 * (1 - np.cos(2 * np.pi * t / two_h)) / 2)

    def flash(t: np.ndarray) -> np.ndarray:
        start = 600.0 * k
        up = np.clip((t - start) / 30.0, 0.0, 1.0) * (t < start + 330.0)
        down = np.clip(1 - (t - start - 330.0) / 30.0, 0.0, 1.0) * (t >= start + 330.0)
        return one * 5 * (1 + 9 * np.maximum(up, down))

    def onoff(t: np.ndarray) -> np.ndarray:
        period = 360.0
        return one * np.where((t % period) < 120.0, 20.0, 2.0)

    def ramp(t: np.ndarray) -> np.ndarray:
        q = 1200.0 * k
        level = np.interp(t, [0, q, 2 * q, 3 * q, 3.5 * q], [8, 0, 0, 8, 8])
        return one * level

    chat = chat_shapes
    return [
        generate("diurnal_50", diurnal(50), two_h, seed, chat, description="diurnal curve, peak 50 replicas"),
        generate("diurnal_200", diurnal(200), two_h, seed + 1, chat, description="diurnal curve, peak 200 replicas"),
        generate("flash_crowd", flash, 1800.0 * k if short else 2400.0, seed + 2, chat,
                 description="5 replicas' worth, 10x in 30 s for 5 min"),
        generate("on_off", onoff, hour, seed + 3, chat, description="20 replicas' worth 2 min on, 2 for 4 min off"),
        generate("heavy_tail", lambda t: one_rag * 20 + 0 * t, hour, seed + 4, mixed_shapes(rag_share),
                 description="20% RAG prompts of 4-16k tokens in chat, 20 replicas' worth"),
        generate("ramp_to_zero", ramp, 3.5 * 1200.0 * k, seed + 5, chat, min_replicas=0,
                 description="8 replicas' worth down to zero over 20 min, 20 min idle, back"),
    ]

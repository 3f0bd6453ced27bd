"""Verification: which drafts the target accepts, in a way that keeps its output distribution exact.

Both proposers give a point-mass draft distribution (ngram looks tokens up, draft models take their
argmax). Standard speculative sampling for a point mass q = delta(d) accepts d with probability
min(1, p(d) / q(d)) = p(d), and on rejection draws from the residual max(0, p - q), renormalized: p with d
removed. We realize exactly that rule with one uniform u per position: draw x from the target's processed
distribution p at u (the sampler's inverse CDF), accept the draft iff x == d, and on a mismatch emit x.
P(accept) = p(d), and a rejected step's x is distributed as p restricted to tokens != d, renormalized.
Greedy rows are the special case x = argmax p.

Row j of a sequence verifying drafts d_1..d_k is the target's distribution after the sequence's output
plus d_1..d_j: penalties, min_tokens, logit bias and the grammar's mask all see that prefix, so every
row is sampled exactly as a non-speculative step after the same tokens would be.

Because each emitted token uses one uniform, as a non-speculative step does, a seeded request can emit
the same tokens with speculation on and off: the rows the walk did not use give their uniforms back
(the generator is rewound and advanced by the rows used). Rows whose sampler may draw extra uniforms
(top_p without top_k: the nucleus rejection rounds) keep whatever they drew; they stay reproducible for a
given seed, but are not token-for-token equal to a run without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..sampler import GREEDY_TEMPERATURE
from ..sampling_params import SamplingParams


def accepted_prefix(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts the target accepts: sampled[j] is the target's token at row j (after drafts[:j]);
    the walk stops at the first row whose token differs from the draft there."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


def emit(sampled: Sequence[int], drafts: Sequence[int], append: Callable[[int], bool]) -> tuple[int, int]:
    """Append the accepted drafts and the token after them, row by row: ``append(j)`` appends row j's
    token and returns True when that finished the sequence (a stop string, EOS, max_tokens), which ends
    the walk. Returns (rows used, drafts accepted and appended)."""
    accepted = accepted_prefix(sampled, drafts)
    for j in range(accepted + 1):
        if append(j):
            return j + 1, min(j + 1, accepted)
    return accepted + 1, accepted


def draws_one_uniform(params: SamplingParams, vocab_size: int) -> bool:
    """True when the sampler draws exactly one uniform for a row with these params (see sampler.py): not
    greedy, and no nucleus rejection rounds (top_p < 1 on the whole vocabulary)."""
    if params.temperature < GREEDY_TEMPERATURE:
        return False
    return params.top_p >= 1.0 or 0 < params.top_k < vocab_size


@dataclass
class GeneratorRewind:
    """A seeded generator's state before a verification that may draw more uniforms than it uses."""

    generator: torch.Generator
    state: torch.Tensor

    @classmethod
    def take(cls, generator: torch.Generator | None, params: SamplingParams, vocab_size: int) -> GeneratorRewind | None:
        if generator is None or not draws_one_uniform(params, vocab_size):
            return None
        return cls(generator, generator.get_state())

    def keep(self, num_rows_used: int) -> None:
        """Leave the generator as if only the first ``num_rows_used`` rows had drawn (one uniform each, drawn
        as the sampler draws them)."""
        self.generator.set_state(self.state)
        for _ in range(num_rows_used):
            torch.rand((), generator=self.generator, dtype=torch.float64, device=self.generator.device)

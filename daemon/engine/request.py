"""Requests: what a user sent. Its n (or best_of) sequences share the prompt's blocks via fork."""

from __future__ import annotations

from dataclasses import dataclass, field

from .outputs import RequestMetrics
from .sampling_params import SamplingParams
from .sequence import Sequence


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n-1 children exist (they are forked at the first sampled token)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.num_sequences and all(s.is_finished() for s in self.seqs)

"""Sequences: the unit the scheduler runs. A request with n > 1 runs as n sequences (a parent plus forks)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .detokenizer import TextStream
    from .lora.request import LoRARequest
    from .outputs import Logprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    SWAPPED = "swapped"  # back in the waiting queue, its blocks in the CPU pool
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Sequence:
    """One token sequence: what the scheduler and KV manager see, plus its output state.

    `seq_id` keys the scheduler and the KV cache; `request_id` and `index` say which request and
    which of its n outputs this sequence is.
    """

    seq_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None  # mixed into the first block's hash: no cache sharing across salts
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    request_id: str = ""
    index: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    # Output state, set by the engine (the scheduler never reads it).
    text: TextStream | None = None
    generator: Any = None  # torch.Generator | None; typed loosely so this module needs no torch
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # by prompt position, when asked for
    cumulative_logprob: float = 0.0
    # Structured outputs: the compiled grammar once ready, and this sequence's matcher (made lazily).
    grammar: Any = None
    matcher: Any = None
    # Speculative decoding: drafts the engine plans to verify in the coming step (the scheduler reserves
    # budget and slots for them), and this sequence's acceptance rule (spec_decode.policy.AcceptanceGate).
    num_draft_tokens: int = 0
    spec_gate: Any = None

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = self.seq_id
        # Prompt + output, kept in step with output_token_ids so hot paths never concatenate.
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return self.status.finished

"""Iteration-level scheduler: continuous batching under a token budget, chunked prefill, preemption.

Each step spends `max_num_batched_tokens`. Running sequences (decodes and unfinished prefill chunks)
are served first in policy order; then waiting sequences are admitted while budget, sequence slots
and KV blocks last. With `long_prefill_token_threshold` set, a step that decodes gives each prompt
chunk at most that many tokens: the step's length, which every running stream waits for, stays
short. When a running sequence cannot get a block, the least important running sequence is
preempted (recompute: drop its blocks; swap: move them to the CPU pool). With LoRA, a step mixes at
most `max_loras` adapters: a waiting sequence of another adapter is passed over until one's sequences end.

The scheduler owns the KV cache manager and only asks it yes/no questions: how much of a sequence
is cached (`get_computed_blocks`) and whether it can have room for n more tokens (`allocate_slots`).

Speculative decoding: a decoding sequence may carry `num_draft_tokens` (set by the engine before the
step). Its entry then computes its last token plus that many drafts: the drafts count against the
token budget (cut to what is left of it) and get KV slots. After verification `finish_drafts` counts
the accepted drafts as computed and rolls the slots of the rejected ones back (`rollback_slots`); the
prefix cache only ever sees computed, verified tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .config import EngineConfig
from .kv_cache import KVCacheManager, KVStats
from .sequence import Sequence, SequenceStatus


class KVManager(Protocol):
    """What the scheduler needs from a KV cache manager (KVCacheManager; a fake in the tests)."""

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[Any], int]: ...
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[Any] | tuple = ()
    ) -> list[Any] | None: ...
    def block_ids(self, seq: Sequence) -> list[int]: ...
    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None: ...
    def fork(self, parent: Sequence, child: Sequence) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def is_swapped(self, seq: Sequence) -> bool: ...
    def can_swap_out(self, seq: Sequence) -> bool: ...
    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]: ...
    def can_swap_in(self, seq: Sequence) -> bool: ...
    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]: ...
    def rollback_slots(self, seq: Sequence, num_tokens: int) -> None: ...
    def take_pending_copies(self) -> list[tuple[int, int]]: ...
    def reset_prefix_cache(self) -> None: ...
    def stats(self) -> KVStats: ...


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # slots this step writes: the sequence's own tokens plus its drafts
    start_pos: int  # == num_computed_tokens when scheduled
    block_table: list[int]
    # Drafts verified after the sequence's last token: the scheduler reserves `num_draft_tokens` of them;
    # the engine's proposer fills `draft_token_ids` (at most that many) before the forward pass.
    num_draft_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_verified_new(self) -> int:
        """The sequence's own (verified) tokens among this step's new ones."""
        return self.num_new_tokens - self.num_draft_tokens

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so the step must sample."""
        return self.start_pos + self.num_verified_new == self.seq.num_tokens

    def set_drafts(self, token_ids: list[int]) -> None:
        """The proposed drafts (at most the reserved number; the unused slots are rolled back after the step)."""
        if len(token_ids) > self.num_draft_tokens:
            raise ValueError(f"{len(token_ids)} drafts for {self.num_draft_tokens} reserved slots")
        self.num_new_tokens -= self.num_draft_tokens - len(token_ids)
        self.num_draft_tokens = len(token_ids)
        self.draft_token_ids = list(token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        num_cpu_blocks: int = 0,
        kv_manager: KVManager | None = None,
    ) -> None:
        self.config = config
        # kv_manager: a stand-in for tests; the engine lets the scheduler build the real one.
        self.kv_manager: KVManager = kv_manager or KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks
        )
        self.policy = config.scheduling_policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self.num_preemptions_total = 0

    # ----------------------------------------------------------------- queue management
    def _sort_key(self, seq: Sequence) -> tuple:
        # Lower `priority` value = more important (vLLM's convention); ties go to the earlier arrival.
        if self.policy == "priority":
            return (seq.priority, seq.arrival_time)
        return (seq.arrival_time,)

    def add_sequence(self, seq: Sequence) -> None:
        if seq.seq_id in self.sequences:
            raise ValueError(f"sequence id {seq.seq_id!r} is already in use")
        self.sequences[seq.seq_id] = seq
        seq.status = SequenceStatus.WAITING
        self._enqueue_waiting(seq)

    def _enqueue_waiting(self, seq: Sequence, front: bool = False) -> None:
        if self.policy == "priority":
            # Keep the queue ordered by importance; preempted sequences keep their original arrival.
            key = self._sort_key(seq)
            idx = 0
            for idx, other in enumerate(self.waiting):  # noqa: B007 - idx is used after the loop
                if key < self._sort_key(other):
                    break
            else:
                idx = len(self.waiting)
            self.waiting.insert(idx, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def add_forked(self, parent: Sequence, child: Sequence) -> None:
        """Register a child that shares the parent's blocks and runs from the parent's position."""
        self.kv_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.sequences[child.seq_id] = child
        self.running.append(child)

    def finish_sequence(self, seq: Sequence, status: SequenceStatus) -> None:
        assert status.finished
        if seq.seq_id not in self.sequences:
            return
        seq.status = status
        self.kv_manager.free(seq)
        del self.sequences[seq.seq_id]
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def abort_sequences(self, seq_ids: Iterable[str]) -> list[Sequence]:
        aborted = []
        for seq_id in seq_ids:
            seq = self.sequences.get(seq_id)
            if seq is not None:
                self.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED)
                aborted.append(seq)
        return aborted

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_stats(self) -> KVStats:
        return self.kv_manager.stats()

    def reset_prefix_cache(self) -> None:
        self.kv_manager.reset_prefix_cache()

    # ----------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Policy order decides who runs first and who is preempted first (from the tail).
        self.running.sort(key=self._sort_key)
        chunk_cap = self._prefill_chunk_cap()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, chunk_cap)
        # Admission, unless something was just preempted (memory is tight: let running work drain).
        if not out.preempted:
            budget = self._admit(out, budget, chunk_cap)
        out.blocks_to_copy = self.kv_manager.take_pending_copies()
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _prefill_chunk_cap(self) -> int:
        """Most tokens one prompt chunk may take this step: the threshold when some running sequence is
        decoding (a cap with nothing decoding would only delay the first token), else no cap."""
        cap = self.config.long_prefill_token_threshold
        if cap and any(len(seq.all_token_ids) - seq.num_computed_tokens == 1 for seq in self.running):
            return cap
        return self.config.max_num_batched_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int, chunk_cap: int) -> int:
        """Running sequences, most important first. Victims come from the unscheduled tail."""
        idx = 0
        running = self.running
        allocate = self.kv_manager.allocate_slots
        tables = self.kv_manager.block_ids
        scheduled = out.scheduled
        while idx < len(running) and budget > 0:
            seq = running[idx]
            start = seq.num_computed_tokens
            num_new = min(len(seq.all_token_ids) - start, budget, chunk_cap)
            if num_new <= 0:
                idx += 1
                continue
            num_draft = 0
            if seq.num_draft_tokens and num_new == len(seq.all_token_ids) - start == 1:
                num_draft = min(seq.num_draft_tokens, budget - 1)  # drafts spend the budget too
            if not (num_draft and allocate(seq, num_new + num_draft) is not None):
                num_draft = 0  # no room for drafts: nobody is preempted for them
                while allocate(seq, num_new) is None:
                    victim = running[-1]
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    break  # it preempted itself: nothing behind it can run either
            num_new += num_draft
            scheduled.append(ScheduledSequence(seq, num_new, start, tables(seq), num_draft))
            budget -= num_new
            idx += 1
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, chunk_cap: int) -> int:
        kv = self.kv_manager
        # a step mixes at most max_loras adapters: a sequence of another one waits, and those behind it may go
        adapters = {s.lora_request.lora_int_id for s in self.running if s.lora_request is not None} \
            if self.config.enable_lora else set()
        passed_over: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            lora = seq.lora_request
            if lora is not None and lora.lora_int_id not in adapters and len(adapters) >= self.config.max_loras:
                passed_over.append(self.waiting.popleft())
                continue
            computed_blocks: list = []
            num_cached = 0
            swapped = kv.is_swapped(seq)
            fresh = not swapped and seq.num_computed_tokens == 0  # new, or preempted in recompute mode
            if swapped:
                if not kv.can_swap_in(seq):
                    break
                out.blocks_to_swap_in.extend(kv.swap_in(seq))
            elif fresh:
                computed_blocks, num_cached = kv.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget, chunk_cap)
            if kv.allocate_slots(seq, num_new, computed_blocks) is None:
                break  # no room (after a swap-in only if it left none)
            if fresh:
                seq.num_computed_tokens = num_cached
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = num_cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            out.scheduled.append(ScheduledSequence(seq, num_new, seq.num_computed_tokens, kv.block_ids(seq)))
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))  # back in front, in their order
        return budget

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        victim.num_draft_tokens = 0  # its drafts were for the step it no longer takes part in
        # A victim scheduled earlier in this step loses its slot in the batch.
        for i, entry in enumerate(out.scheduled):
            if entry.seq is victim:
                del out.scheduled[i]
                break
        if self.config.preemption_mode == "swap" and self.kv_manager.can_swap_out(victim):
            out.blocks_to_swap_out.extend(self.kv_manager.swap_out(victim))
            victim.status = SequenceStatus.SWAPPED
        else:
            self.kv_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        out.preempted.append(victim)
        self._enqueue_waiting(victim, front=True)

    # ----------------------------------------------------------------- after the forward pass
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly filled blocks to the prefix cache."""
        cache_blocks = self.kv_manager.cache_blocks
        for entry in out.scheduled:
            seq = entry.seq
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += entry.num_verified_new  # drafts count once verified (finish_drafts)
            cache_blocks(seq, seq.num_computed_tokens)

    def finish_drafts(self, entry: ScheduledSequence, num_accepted: int) -> None:
        """After sampling: the first `num_accepted` drafts were verified (and appended to the sequence);
        their slots hold good K/V. The slots past them go back to the pool."""
        seq = entry.seq
        if seq.status != SequenceStatus.RUNNING or seq.seq_id not in self.sequences:
            return  # finished (its blocks are already free) or preempted meanwhile
        if not 0 <= num_accepted <= entry.num_draft_tokens:
            raise ValueError(f"{num_accepted} accepted of {entry.num_draft_tokens} drafts")
        seq.num_computed_tokens += num_accepted
        self.kv_manager.rollback_slots(seq, seq.num_computed_tokens)
        self.kv_manager.cache_blocks(seq, seq.num_computed_tokens)

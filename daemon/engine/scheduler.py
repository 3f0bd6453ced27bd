"""Iteration-level scheduler: continuous batching under a token budget, chunked prefill, preemption.

Each step spends `max_num_batched_tokens`. Running requests (decodes and unfinished prefill chunks)
are served first in policy order; then waiting requests are admitted while budget, sequence slots
and KV blocks last. When a running request cannot get a block, the least important running request
is preempted (recompute: drop its blocks; swap: move them to the CPU pool).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_cache import KVCacheManager
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start_pos: int  # == num_computed_tokens when scheduled
    block_table: list[int]

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so the step must sample."""
        return self.start_pos + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = config.scheduling_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0

    # ----------------------------------------------------------------- queue management
    def _sort_key(self, req: Request) -> tuple:
        # Lower `priority` value = more important (vLLM's convention); ties go to the earlier arrival.
        if self.policy == "priority":
            return (req.priority, req.arrival_time)
        return (req.arrival_time,)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            # Keep the queue ordered by importance; preempted requests keep their original arrival.
            key = self._sort_key(request)
            idx = 0
            for idx, other in enumerate(self.waiting):  # noqa: B007 - idx is used after the loop
                if key < self._sort_key(other):
                    break
            else:
                idx = len(self.waiting)
            self.waiting.insert(idx, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def add_forked(self, parent: Request, child: Request) -> None:
        """Register a child that shares the parent's blocks and runs from the parent's position."""
        self.kv.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        assert status.finished
        if request.request_id not in self.requests:
            return
        request.status = status
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish_request(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Policy order decides who runs first and who is preempted first (from the tail).
        self.running.sort(key=self._sort_key)

        # 1) Running requests, most important first. Victims come from the unscheduled tail.
        idx = 0
        running = self.running
        allocate = self.kv.allocate_slots
        tables = self.kv.block_ids
        scheduled = out.scheduled
        while idx < len(running) and budget > 0:
            req = running[idx]
            start = req.num_computed_tokens
            num_new = min(len(req.all_token_ids) - start, budget)
            if num_new <= 0:
                idx += 1
                continue
            while not allocate(req.request_id, start, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # it preempted itself: nothing behind it can run either
            scheduled.append(ScheduledRequest(req, num_new, start, tables(req.request_id)))
            budget -= num_new
            idx += 1

        # 2) Admission, unless something was just preempted (memory is tight: let running work drain).
        if not out.preempted:
            budget = self._admit(out, budget)

        out.blocks_to_copy = self.kv.take_pending_copies()
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            rid = req.request_id
            if self.kv.is_swapped(rid):
                if not self.kv.can_swap_in(rid):
                    break
                out.blocks_to_swap_in.extend(self.kv.swap_in(rid, req.num_computed_tokens))
            else:
                if not self.kv.block_ids(rid):  # new, or preempted in recompute mode
                    cached = self.kv.find_cached_prefix(rid, req.all_token_ids)
                    num_new = min(req.num_tokens - cached, budget)
                    from_free_queue = self.kv.blocks_to_take_from_free_queue(rid, cached)
                    need = self.kv.num_blocks_needed(cached + num_new) - cached // self.kv.block_size
                    if need + from_free_queue > self.kv.num_free_blocks:
                        break
                    self.kv.take_cached_prefix(rid, cached, num_query_tokens=req.num_tokens)
                    req.num_computed_tokens = cached
                    if req.num_preemptions == 0:
                        req.num_cached_tokens = cached
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(rid, req.num_computed_tokens, num_new):
                break  # cannot happen after the checks above, unless swap-in left no room
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._entry(req, num_new))
            budget -= num_new
        return budget

    def _entry(self, req: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(
            request=req,
            num_new_tokens=num_new,
            start_pos=req.num_computed_tokens,
            block_table=self.kv.block_ids(req.request_id),
        )

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        # A victim scheduled earlier in this step loses its slot in the batch.
        for i, entry in enumerate(out.scheduled):
            if entry.request is victim:
                del out.scheduled[i]
                break
        rid = victim.request_id
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(rid):
            out.blocks_to_swap_out.extend(self.kv.swap_out(rid))
            victim.status = RequestStatus.SWAPPED
        else:
            self.kv.free(rid)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        out.preempted.append(victim)
        self._enqueue_waiting(victim, front=True)

    # ----------------------------------------------------------------- after the forward pass
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly filled blocks to the prefix cache."""
        bs = self.kv.block_size
        caching = self.kv.enable_prefix_caching
        for entry in out.scheduled:
            req = entry.request
            if req.status != RequestStatus.RUNNING:
                continue
            before = req.num_computed_tokens
            req.num_computed_tokens = after = before + entry.num_new_tokens
            if caching and after // bs != before // bs:  # a block filled up
                self.kv.cache_full_blocks(req.request_id, req.all_token_ids, after)

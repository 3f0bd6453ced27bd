"""Scheduler policy on a fake KV manager: budget, chunking, preemption victims, swap, abort, max_num_seqs.

The fake implements the manager's contract (get_computed_blocks / allocate_slots and the rest) with a
fixed number of blocks and plain counters, so each test can state exactly when memory runs out. The
real KVCacheManager has its own tests (test_kv_cache.py).
"""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.kv_cache import KVCacheManager, KVStats
from kvpilot.daemon.engine.sampling_params import SamplingParams
from kvpilot.daemon.engine.scheduler import Scheduler
from kvpilot.daemon.engine.sequence import Sequence, SequenceStatus

BS = 4  # the fake's block size (it need not match EngineConfig.block_size)


class FakeKV:
    """`num_blocks` blocks; a sequence holding k tokens holds ceil(k / BS) of them."""

    def __init__(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.num_free = num_blocks
        self.held: dict[str, int] = {}  # blocks in the sequence's table
        self.paid: dict[str, int] = {}  # of those, blocks it took from the pool (a fork child pays none)
        self.cpu_free = num_cpu_blocks
        self.swapped: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}  # what get_computed_blocks reports, per sequence
        self.cached_calls: list[tuple[str, int]] = []

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[str], int]:
        n = self.cached_tokens.get(seq.seq_id, 0)
        return ["cached"] * (n // BS), n

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks=()) -> list[int] | None:
        have = self.held.get(seq.seq_id, 0) + len(computed_blocks)
        total = seq.num_computed_tokens + len(computed_blocks) * BS + num_new_tokens
        need = max(0, -(-total // BS) - have)
        cost = need + len(computed_blocks)  # cached blocks leave the free pool too
        if cost > self.num_free:
            return None
        self.num_free -= cost
        self.held[seq.seq_id] = have + need
        self.paid[seq.seq_id] = self.paid.get(seq.seq_id, 0) + cost
        return list(range(need))

    def block_ids(self, seq: Sequence) -> list[int]:
        return list(range(self.held.get(seq.seq_id, 0)))

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        self.cached_calls.append((seq.seq_id, num_computed_tokens))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.held[child.seq_id] = self.held[parent.seq_id]
        self.paid[child.seq_id] = 0

    def free(self, seq: Sequence) -> None:
        self.held.pop(seq.seq_id, None)
        self.num_free += self.paid.pop(seq.seq_id, 0)
        self.cpu_free += self.swapped.pop(seq.seq_id, 0)

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.seq_id in self.swapped

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.held.get(seq.seq_id, 0) <= self.cpu_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        n = self.held.pop(seq.seq_id)
        self.num_free += self.paid.pop(seq.seq_id)
        self.cpu_free -= n
        self.swapped[seq.seq_id] = n
        return [(i, i) for i in range(n)]

    def can_swap_in(self, seq: Sequence) -> bool:
        return self.swapped.get(seq.seq_id, 0) + 1 <= self.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        n = self.swapped.pop(seq.seq_id)
        self.cpu_free += n
        self.num_free -= n
        self.held[seq.seq_id] = self.paid[seq.seq_id] = n
        return [(i, i) for i in range(n)]

    def rollback_slots(self, seq: Sequence, num_tokens: int) -> None:
        keep = -(-num_tokens // BS)
        extra = self.held.get(seq.seq_id, 0) - keep
        if extra > 0:
            self.held[seq.seq_id] = keep
            self.paid[seq.seq_id] -= extra
            self.num_free += extra

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return []

    def reset_prefix_cache(self) -> None:
        self.cached_tokens.clear()

    def stats(self) -> KVStats:
        used = self.num_blocks - self.num_free
        return KVStats(self.num_blocks, self.num_free, used, 0, 0, 0, BS)


def _scheduler(num_blocks: int = 64, num_cpu_blocks: int = 0, **config) -> tuple[Scheduler, FakeKV]:
    kv = FakeKV(num_blocks, num_cpu_blocks)
    return Scheduler(EngineConfig(**config), num_blocks, num_cpu_blocks, kv_manager=kv), kv


def _seq(seq_id: str, num_tokens: int, arrival: float, priority: int = 0) -> Sequence:
    return Sequence(seq_id, list(range(num_tokens)), SamplingParams(), arrival_time=arrival, priority=priority)


def _decode_all(sched: Scheduler, out) -> None:
    """Finish the step as the engine would: advance counts, give every completed sequence a token."""
    sched.update_after_step(out)
    for entry in out.scheduled:
        if entry.completes_sequence:
            entry.seq.append_output_token(7)


def test_admission_stops_at_the_token_budget():
    sched, _ = _scheduler(max_num_batched_tokens=10)
    seqs = [_seq(s, 4, arrival=i) for i, s in enumerate("abc")]
    for seq in seqs:
        sched.add_sequence(seq)
    out = sched.schedule()
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [("a", 4), ("b", 4), ("c", 2)]
    assert out.num_batched_tokens == 10
    assert [e.completes_sequence for e in out.scheduled] == [True, True, False]
    assert sched.num_running == 3 and sched.num_waiting == 0


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    sched, kv = _scheduler(max_num_batched_tokens=10)
    seq = _seq("long", 25, arrival=0)
    sched.add_sequence(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        (entry,) = out.scheduled
        chunks.append((entry.start_pos, entry.num_new_tokens, entry.completes_sequence))
        sched.update_after_step(out)
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True)]
    assert seq.num_computed_tokens == 25
    assert kv.held["long"] == 7  # ceil(25 / 4)
    assert kv.cached_calls == [("long", 10), ("long", 20), ("long", 25)]


def test_prefix_hit_starts_after_the_cached_tokens():
    sched, kv = _scheduler()
    kv.cached_tokens["a"] = 8
    seq = _seq("a", 10, arrival=0)
    sched.add_sequence(seq)
    (entry,) = sched.schedule().scheduled
    assert (entry.start_pos, entry.num_new_tokens) == (8, 2)
    assert seq.num_computed_tokens == 8 and seq.num_cached_tokens == 8


def test_admission_waits_for_blocks_in_fcfs_order():
    sched, _ = _scheduler(num_blocks=3)
    sched.add_sequence(_seq("big", 12, arrival=0))  # 3 blocks
    sched.add_sequence(_seq("next", 4, arrival=1))
    out = sched.schedule()
    assert [e.seq.seq_id for e in out.scheduled] == ["big"]
    assert [s.seq_id for s in sched.waiting] == ["next"]


def _fill_then_decode(sched: Scheduler, seqs: list[Sequence]):
    """Admit sequences of exactly one full block each, then one decode step that needs new blocks."""
    for seq in seqs:
        sched.add_sequence(seq)
    first = sched.schedule()
    assert len(first.scheduled) == len(seqs)
    _decode_all(sched, first)
    return sched.schedule()


def test_fcfs_preempts_the_latest_arrival():
    sched, _ = _scheduler(num_blocks=2)
    a, b = _seq("a", 4, arrival=0), _seq("b", 4, arrival=1)
    out = _fill_then_decode(sched, [a, b])
    assert out.preempted == [b]
    assert [e.seq for e in out.scheduled] == [a]
    assert b.status == SequenceStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b]
    assert sched.num_preemptions_total == 1


def test_priority_preempts_the_least_important_even_if_earlier():
    sched, _ = _scheduler(num_blocks=2, scheduling_policy="priority")
    low, high = _seq("low", 4, arrival=0, priority=5), _seq("high", 4, arrival=1, priority=-1)
    out = _fill_then_decode(sched, [low, high])
    assert out.preempted == [low]
    assert [e.seq for e in out.scheduled] == [high]


def test_priority_orders_the_waiting_queue():
    sched, _ = _scheduler(scheduling_policy="priority", max_num_seqs=1)
    for seq in (_seq("p5", 4, 0, priority=5), _seq("p0", 4, 1, priority=0), _seq("p-1", 4, 2, priority=-1)):
        sched.add_sequence(seq)
    assert [s.seq_id for s in sched.waiting] == ["p-1", "p0", "p5"]
    assert [e.seq.seq_id for e in sched.schedule().scheduled] == ["p-1"]


def test_swap_preemption_moves_blocks_out_and_back():
    sched, kv = _scheduler(num_blocks=2, num_cpu_blocks=4, preemption_mode="swap")
    a, b = _seq("a", 4, arrival=0), _seq("b", 4, arrival=1)
    out = _fill_then_decode(sched, [a, b])
    assert out.preempted == [b] and b.status == SequenceStatus.SWAPPED
    assert out.blocks_to_swap_out == [(0, 0)]
    assert b.num_computed_tokens == 4, "a swapped sequence keeps its computed tokens"
    assert kv.is_swapped(b)
    _decode_all(sched, out)
    sched.finish_sequence(a, SequenceStatus.FINISHED_STOPPED)
    back = sched.schedule()
    assert back.blocks_to_swap_in == [(0, 0)]
    (entry,) = back.scheduled
    assert entry.seq is b and (entry.start_pos, entry.num_new_tokens) == (4, 1)
    assert b.status == SequenceStatus.RUNNING and not kv.is_swapped(b)


def test_swap_falls_back_to_recompute_without_cpu_room():
    sched, _ = _scheduler(num_blocks=2, num_cpu_blocks=0, preemption_mode="swap")
    b = _seq("b", 4, arrival=1)
    out = _fill_then_decode(sched, [_seq("a", 4, arrival=0), b])
    assert out.preempted == [b] and b.status == SequenceStatus.PREEMPTED and not out.blocks_to_swap_out


def test_no_admission_in_a_step_that_preempted():
    sched, kv = _scheduler(num_blocks=3, scheduling_policy="priority")
    a, b = _seq("a", 4, arrival=0, priority=0), _seq("b", 8, arrival=1, priority=1)
    for seq in (a, b):
        sched.add_sequence(seq)
    _decode_all(sched, sched.schedule())
    late = _seq("late", 1, arrival=2, priority=-5)  # head of the queue, and a block would be free for it
    sched.add_sequence(late)
    out = sched.schedule()
    assert out.preempted == [b] and kv.num_free == 1
    assert [e.seq for e in out.scheduled] == [a], "memory is tight: running work drains first"
    _decode_all(sched, out)
    assert late in [e.seq for e in sched.schedule().scheduled]


def test_abort_running_and_waiting_frees_their_blocks():
    sched, kv = _scheduler(max_num_seqs=1)
    run, wait = _seq("run", 6, arrival=0), _seq("wait", 6, arrival=1)
    sched.add_sequence(run)
    sched.add_sequence(wait)
    sched.schedule()
    assert kv.held == {"run": 2}
    aborted = sched.abort_sequences(["run", "wait", "unknown"])
    assert aborted == [run, wait]
    assert run.status == wait.status == SequenceStatus.FINISHED_ABORTED
    assert sched.num_running == sched.num_waiting == 0 and not sched.sequences
    assert kv.num_free == kv.num_blocks
    assert sched.schedule().is_empty


def test_max_num_seqs_caps_the_running_set():
    sched, _ = _scheduler(max_num_seqs=2)
    seqs = [_seq(f"s{i}", 3, arrival=i) for i in range(5)]
    for seq in seqs:
        sched.add_sequence(seq)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == seqs[:2]
    _decode_all(sched, out)
    sched.finish_sequence(seqs[0], SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()
    assert [e.seq for e in out.scheduled] == [seqs[1], seqs[2]]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_fork_runs_the_child_from_the_parents_position():
    sched, kv = _scheduler()
    parent = _seq("p", 5, arrival=0)
    sched.add_sequence(parent)
    _decode_all(sched, sched.schedule())
    child = _seq("p#1", 5, arrival=0)
    child.append_output_token(9)
    sched.add_forked(parent, child)
    assert child.num_computed_tokens == 5 and child.status == SequenceStatus.RUNNING
    assert kv.held["p#1"] == kv.held["p"]
    assert {e.seq.seq_id for e in sched.schedule().scheduled} == {"p", "p#1"}


def test_duplicate_sequence_id_is_refused():
    sched, _ = _scheduler()
    sched.add_sequence(_seq("x", 2, arrival=0))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_sequence(_seq("x", 2, arrival=1))


def test_stats_and_reset_go_through_the_scheduler():
    sched, kv = _scheduler(num_blocks=8)
    kv.cached_tokens["a"] = 4
    sched.add_sequence(_seq("a", 6, arrival=0))
    sched.schedule()
    assert sched.kv_stats().num_used_blocks == 2
    sched.reset_prefix_cache()
    assert kv.cached_tokens == {}


def test_scheduler_builds_the_real_manager_by_default():
    sched = Scheduler(EngineConfig(block_size=8), num_blocks=8)
    assert isinstance(sched.kv_manager, KVCacheManager)
    first = _seq("first", 20, arrival=0)
    sched.add_sequence(first)
    sched.update_after_step(sched.schedule())
    again = _seq("again", 20, arrival=1)
    sched.add_sequence(again)
    (entry,) = [e for e in sched.schedule().scheduled if e.seq is again]
    assert (entry.start_pos, again.num_cached_tokens) == (16, 16)  # two full blocks of 8 from the cache
    assert sched.kv_stats().prefix_cache_hits == 16


def test_long_prefill_threshold_caps_prompt_chunks_only_beside_decodes():
    sched, _ = _scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    first = _seq("first", 30, arrival=0)
    sched.add_sequence(first)
    out = sched.schedule()  # nothing decodes yet: the whole prompt in one step, no cap
    assert [(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled] == [("first", 30)]
    _decode_all(sched, out)
    sched.add_sequence(_seq("long", 20, arrival=1))
    chunks = []
    for _ in range(3):  # "first" decodes every step: "long" comes in chunks of 8 beside it
        out = sched.schedule()
        chunks.append([(e.seq.seq_id, e.num_new_tokens) for e in out.scheduled])
        _decode_all(sched, out)
    assert chunks == [[("first", 1), ("long", 8)], [("first", 1), ("long", 8)], [("first", 1), ("long", 4)]]


def test_long_prefill_threshold_must_not_be_negative():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)


# --- speculative decoding: drafts spend budget and slots; only verified tokens count as computed -------------

def _decoding(sched: Scheduler, *prompt_lens: int) -> list[Sequence]:
    """Running sequences "a", "b", ... admitted in one step: prompts computed, one sampled token each to decode."""
    seqs = [_seq("abcdef"[i], n, arrival=i) for i, n in enumerate(prompt_lens)]
    for seq in seqs:
        sched.add_sequence(seq)
    _decode_all(sched, sched.schedule())
    assert all(seq.num_tokens == seq.num_computed_tokens + 1 for seq in seqs)
    return seqs


def test_drafts_count_against_the_token_budget():
    sched, kv = _scheduler(max_num_batched_tokens=64)
    a, b = _decoding(sched, 4, 4)
    sched.config.max_num_batched_tokens = 7
    a.num_draft_tokens = b.num_draft_tokens = 4
    out = sched.schedule()
    assert [(e.seq.seq_id, e.num_new_tokens, e.num_draft_tokens) for e in out.scheduled] == [("a", 5, 4), ("b", 2, 1)]
    assert out.num_batched_tokens == 7
    assert kv.held == {"a": 3, "b": 2}  # slots for 4 + 1 + 4 and 4 + 1 + 1 tokens
    assert all(e.completes_sequence and e.num_verified_new == 1 for e in out.scheduled)


def test_drafts_never_preempt_anyone():
    sched, kv = _scheduler(num_blocks=4)
    a, b = _decoding(sched, 6, 3)  # 2 + 1 blocks; 1 left
    a.num_draft_tokens = 6  # would need 2 more blocks
    out = sched.schedule()
    assert [(e.seq.seq_id, e.num_new_tokens, e.num_draft_tokens) for e in out.scheduled] == [("a", 1, 0), ("b", 1, 0)]
    assert not out.preempted and b.status == SequenceStatus.RUNNING


def test_a_preempted_sequence_drops_its_drafts():
    sched, _ = _scheduler(num_blocks=3)
    a, b = _decoding(sched, 8, 3)  # 2 + 1 blocks: full
    b.num_draft_tokens = 3
    out = sched.schedule()  # a's next token needs a block: b, the latest, is preempted
    assert out.preempted == [b] and b.num_draft_tokens == 0
    assert [e.seq.seq_id for e in out.scheduled] == ["a"]


def test_verification_keeps_accepted_slots_and_rolls_back_the_rest():
    sched = Scheduler(EngineConfig(block_size=8, max_num_batched_tokens=64), num_blocks=8)
    kv = sched.kv_manager
    (seq,) = _decoding(sched, 14)  # 14 prompt tokens computed, one sampled token to decode
    seq.num_draft_tokens = 5
    out = sched.schedule()
    (entry,) = out.scheduled
    entry.set_drafts([101, 102, 103])  # the proposer found three
    assert (entry.num_new_tokens, entry.num_draft_tokens) == (4, 3)
    assert len(kv.block_ids(seq)) == 3  # slots for 15 + 5 tokens were reserved
    sched.update_after_step(out)
    assert seq.num_computed_tokens == 15  # the drafts do not count yet
    for token in (101, 102, 7):  # two drafts accepted, then the target's own token
        seq.append_output_token(token)
    sched.finish_drafts(entry, 2)
    assert seq.num_computed_tokens == 17 and seq.num_tokens == 18
    assert len(kv.block_ids(seq)) == 3 and kv.tables["a"].num_tokens == 17  # 17 slots: the rejected one is back
    assert kv.tables["a"].num_registered == 2  # two full blocks of verified tokens, published
    kv.check_invariants()


def test_the_prefix_cache_never_sees_rejected_drafts():
    sched = Scheduler(EngineConfig(block_size=8, max_num_batched_tokens=64), num_blocks=16)
    (seq,) = _decoding(sched, 7)  # 7 prompt tokens + 1 sampled: the next step fills block 0's last slot
    seq.num_draft_tokens = 8
    out = sched.schedule()
    (entry,) = out.scheduled
    entry.set_drafts([50 + i for i in range(8)])  # a whole second block of drafts
    sched.update_after_step(out)
    seq.append_output_token(99)  # the first draft is rejected: 99 follows instead
    sched.finish_drafts(entry, 0)
    assert sched.kv_manager.tables["a"].num_registered == 1
    other = Sequence("b", list(seq.all_token_ids[:8]) + [50 + i for i in range(8)] + [1], SamplingParams())
    _, cached = sched.kv_manager.get_computed_blocks(other)
    assert cached == 8  # the drafts' block was never published


def test_finish_drafts_after_the_sequence_finished_is_a_no_op():
    sched, kv = _scheduler()
    (seq,) = _decoding(sched, 4)
    seq.num_draft_tokens = 2
    out = sched.schedule()
    sched.update_after_step(out)
    sched.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED)  # a stop string inside the accepted run
    sched.finish_drafts(out.scheduled[0], 1)
    assert kv.held == {} and seq.num_computed_tokens == 5

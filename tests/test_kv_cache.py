"""KV-cache manager: unit checks and property-based op sequences that must keep the books balanced."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpilot.daemon.engine.kv_cache import BlockPool, FreeBlockQueue, KVCacheManager, hash_block

BS = 4


def test_free_queue_remove_from_middle_and_order():
    pool = BlockPool(5)
    q = pool.free_queue
    blocks = pool.blocks
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [2, 1, 3, 4, 0]
    assert len(q) == 5
    with pytest.raises(RuntimeError):
        FreeBlockQueue([]).popleft()


def test_hash_chain_depends_on_parent():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(1, [1, 2]) != hash_block(2, [1, 2])


def test_prefix_hit_reuses_blocks_and_lru_evicts_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    assert kv.find_cached_prefix("a", tokens) == 0
    kv.take_cached_prefix("a", 0, num_query_tokens=len(tokens))
    assert kv.allocate_slots("a", 0, len(tokens))
    kv.cache_full_blocks("a", tokens, len(tokens))
    a_blocks = kv.block_ids("a")
    kv.free("a")
    # Freed blocks keep their hash: a repeated prompt hits floor((len-1)/bs) blocks.
    assert kv.find_cached_prefix("b", tokens) == 2 * BS
    kv.take_cached_prefix("b", 2 * BS, num_query_tokens=len(tokens))
    assert kv.block_ids("b") == a_blocks[:2]
    assert kv.prefix_hits_tokens == 2 * BS
    kv.free("b")
    kv.check_invariants()
    # The tail block (second full block) sits ahead of the first in the LRU order, so it is evicted first.
    order = [b.block_id for b in kv.pool.free_queue if b.block_hash is not None]
    assert order.index(a_blocks[1]) < order.index(a_blocks[0])


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    kv.find_cached_prefix("p", list(range(10)))
    assert kv.allocate_slots("p", 0, 10)  # 3 blocks, last one partial
    for i in range(3):
        kv.fork("p", f"c{i}")
    assert kv.num_free_blocks == 7  # 4 sequences, still 3 blocks
    assert kv.allocate_slots("c0", 10, 1)
    copies = kv.take_pending_copies()
    assert len(copies) == 1 and copies[0][0] == kv.block_ids("p")[2]
    assert kv.block_ids("c0")[:2] == kv.block_ids("p")[:2]
    assert kv.block_ids("c0")[2] != kv.block_ids("p")[2]
    kv.check_invariants()
    for rid in ["p", "c0", "c1", "c2"]:
        kv.free(rid)
    assert kv.num_free_blocks == 10
    kv.check_invariants()


def test_allocate_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    kv.find_cached_prefix("a", list(range(9)))
    assert not kv.allocate_slots("a", 0, 9)  # needs 3 blocks
    assert kv.num_free_blocks == 2
    kv.free("a")
    kv.check_invariants()


def test_swap_roundtrip_books():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)
    kv.find_cached_prefix("a", list(range(6)))
    assert kv.allocate_slots("a", 0, 6)
    out_pairs = kv.swap_out("a")
    assert len(out_pairs) == 2 and kv.num_free_blocks == 4 and kv.is_swapped("a")
    kv.check_invariants()
    in_pairs = kv.swap_in("a", 6)
    assert [c for c, _ in in_pairs] == [c for _, c in out_pairs]
    kv.check_invariants()
    kv.free("a")
    assert kv.num_free_blocks == 4 and len(kv.free_cpu_blocks) == 4


class KVMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / preempt / abort / swap sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BS, enable_prefix_caching=True, num_cpu_blocks=6)
        self.seqs: dict[str, list[int]] = {}  # live on device: token ids whose K/V are in the cache
        self.swapped: dict[str, list[int]] = {}
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def admit(self, prompt):
        # Small alphabet: prompts often share prefixes, so the prefix cache gets real hits.
        rid = self._new_id()
        cached = self.kv.find_cached_prefix(rid, prompt)
        assert cached % BS == 0 and cached < len(prompt)
        need = self.kv.num_blocks_needed(len(prompt)) - cached // BS
        if need + self.kv.blocks_to_take_from_free_queue(rid, cached) > self.kv.num_free_blocks:
            self.kv.free(rid)
            return
        self.kv.take_cached_prefix(rid, cached, num_query_tokens=len(prompt))
        assert self.kv.allocate_slots(rid, cached, len(prompt) - cached)
        self.kv.cache_full_blocks(rid, prompt, len(prompt))
        self.seqs[rid] = list(prompt)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[rid]
        if self.kv.allocate_slots(rid, len(tokens), n):
            tokens.extend(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
            self.kv.cache_full_blocks(rid, tokens, len(tokens))
            self.kv.take_pending_copies()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child = self._new_id()
        self.kv.fork(parent, child)
        self.seqs[child] = list(self.seqs[parent])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_or_abort_or_preempt(self, data):
        # For the books, finish, abort and recompute-preemption all drop every block of the request.
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(rid)
        del self.seqs[rid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        if self.kv.can_swap_out(rid):
            self.kv.swap_out(rid)
            self.swapped[rid] = self.seqs.pop(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.kv.can_swap_in(rid):
            tokens = self.swapped.pop(rid)
            self.kv.swap_in(rid, len(tokens))
            self.seqs[rid] = tokens

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def abort_swapped(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        self.kv.free(rid)
        del self.swapped[rid]

    @invariant()
    def books_balance(self):
        self.kv.check_invariants()
        for rid, tokens in self.seqs.items():
            assert len(self.kv.block_ids(rid)) == self.kv.num_blocks_needed(len(tokens))

    def teardown(self):
        for rid in list(self.seqs) + list(self.swapped):
            self.kv.free(rid)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert len(self.kv.free_cpu_blocks) == self.kv.num_cpu_blocks


KVMachine.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
TestKVCacheProperties = KVMachine.TestCase

"""KV-cache manager: unit checks and property-based op sequences that must keep the books balanced."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpilot.block_hash import hash_block_tokens, hash_prompt_blocks
from kvpilot.daemon.engine.kv_cache import BlockPool, FreeBlockQueue, KVCacheManager
from kvpilot.daemon.engine.sampling_params import SamplingParams
from kvpilot.daemon.engine.sequence import Sequence
from kvpilot.router.prompt import ByteTokenizer, PromptHasher

BS = 4


def _seq(seq_id: str, tokens, salt: str | None = None, num_computed: int = 0) -> Sequence:
    seq = Sequence(seq_id, list(tokens), SamplingParams(), cache_salt=salt)
    seq.num_computed_tokens = num_computed
    return seq


def _admit(kv: KVCacheManager, seq: Sequence) -> int:
    """The scheduler's two calls for a whole prompt; returns the tokens served by the cache."""
    blocks, cached = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - cached, blocks) is not None
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_blocks(seq, seq.num_tokens)
    return cached


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


def test_prefix_hit_reuses_blocks_and_lru_evicts_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    a = _seq("a", tokens)
    blocks, cached = kv.get_computed_blocks(a)
    assert cached == 0 and blocks == []
    assert kv.allocate_slots(a, len(tokens), blocks) is not None
    kv.cache_blocks(a, len(tokens))
    a_blocks = kv.block_ids(a)
    kv.free(a)
    # Freed blocks keep their hash: a repeated prompt hits floor((len-1)/bs) blocks.
    b = _seq("b", tokens)
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 2 * BS
    assert kv.allocate_slots(b, 0, blocks) == []  # takes the cached blocks, allocates nothing new
    assert kv.block_ids(b) == a_blocks[:2]
    assert kv.prefix_hits_tokens == 2 * BS
    kv.free(b)
    kv.check_invariants()
    # The tail block (second full block) sits ahead of the first in the LRU order, so it is evicted first.
    order = [b.block_id for b in kv.pool.free_queue if b.block_hash is not None]
    assert order.index(a_blocks[1]) < order.index(a_blocks[0])


def test_get_computed_blocks_takes_nothing_until_allocate_slots():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    _admit(kv, _seq("a", tokens))
    kv.free(_seq("a", tokens))
    free_before = kv.num_free_blocks
    b = _seq("b", tokens)
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 2 * BS and len(blocks) == 2
    assert kv.num_free_blocks == free_before and all(blk.ref_cnt == 0 for blk in blocks)
    new = kv.allocate_slots(b, len(tokens) - cached, blocks)
    assert new is not None and len(new) == 1  # the partial third block
    assert all(blk.ref_cnt == 1 for blk in blocks)
    assert kv.stats().prefix_cache_queries == 2 * len(tokens)
    assert kv.stats().prefix_cache_hits == 2 * BS
    kv.free(b)
    kv.check_invariants()


def test_allocate_slots_returns_only_new_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = _seq("a", range(6))
    assert len(kv.allocate_slots(a, 6)) == 2
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 1) == []  # room left in the last block
    a.num_computed_tokens = 7
    assert len(kv.allocate_slots(a, 2)) == 1
    kv.free(a)
    kv.check_invariants()


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(13))  # 3 full blocks + 1
    assert _admit(kv, _seq("t1", tokens, salt="tenant-1")) == 0
    assert _admit(kv, _seq("t2", tokens, salt="tenant-2")) == 0, "another salt must never hit"
    assert _admit(kv, _seq("plain", tokens)) == 0, "no salt must not hit a salted entry"
    assert _admit(kv, _seq("t1-again", tokens, salt="tenant-1")) == 3 * BS
    assert _admit(kv, _seq("plain-again", tokens)) == 3 * BS
    kv.check_invariants()


def test_manager_hashes_equal_hash_prompt_blocks():
    # The router computes block hashes with hash_prompt_blocks: the engine must agree bit for bit.
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(100, 114))
    for salt in (None, "tenant-1"):
        seq = _seq(f"s-{salt}", tokens, salt=salt)
        _admit(kv, seq)
        extra = () if salt is None else (salt,)
        assert kv.tables[seq.seq_id].hashes == hash_prompt_blocks(tokens, BS, extra)
        # ... and so does the router's own hasher, salt included (it reads the request's cache_salt).
        assert kv.tables[seq.seq_id].hashes == PromptHasher(ByteTokenizer(), BS).hashes(tokens, salt)


def test_cached_free_counter_follows_the_free_queue():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = _seq("a", range(9))
    _admit(kv, a)
    assert kv.stats().num_cached_free_blocks == 0
    kv.free(a)
    assert kv.stats().num_cached_free_blocks == 2
    kv.check_invariants()
    _admit(kv, _seq("b", range(9)))  # takes both cached blocks back out of the free queue
    assert kv.stats().num_cached_free_blocks == 0
    kv.check_invariants()
    kv.free(_seq("b", range(9)))
    kv.reset_prefix_cache()
    assert kv.stats().num_cached_free_blocks == 0
    kv.check_invariants()


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    p = _seq("p", range(10))
    kv.get_computed_blocks(p)
    assert kv.allocate_slots(p, 10) is not None  # 3 blocks, last one partial
    p.num_computed_tokens = 10
    children = [_seq(f"c{i}", range(10), num_computed=10) for i in range(3)]
    for child in children:
        kv.fork(p, child)
    assert kv.num_free_blocks == 7  # 4 sequences, still 3 blocks
    c0 = children[0]
    assert kv.allocate_slots(c0, 1) is not None
    copies = kv.take_pending_copies()
    assert len(copies) == 1 and copies[0][0] == kv.block_ids(p)[2]
    assert kv.block_ids(c0)[:2] == kv.block_ids(p)[:2]
    assert kv.block_ids(c0)[2] != kv.block_ids(p)[2]
    kv.check_invariants()
    for seq in [p, *children]:
        kv.free(seq)
    assert kv.num_free_blocks == 10
    kv.check_invariants()


def test_allocate_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = _seq("a", range(9))
    kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 9) is None  # needs 3 blocks
    assert kv.num_free_blocks == 2
    kv.free(a)
    kv.check_invariants()


def test_swap_roundtrip_books():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)
    a = _seq("a", range(6))
    kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6
    out_pairs = kv.swap_out(a)
    assert len(out_pairs) == 2 and kv.num_free_blocks == 4 and kv.is_swapped(a)
    kv.check_invariants()
    assert kv.can_swap_in(a)
    in_pairs = kv.swap_in(a)
    assert [c for c, _ in in_pairs] == [c for _, c in out_pairs]
    kv.check_invariants()
    kv.free(a)
    assert kv.num_free_blocks == 4 and len(kv.free_cpu_blocks) == 4


def test_rollback_slots_frees_the_blocks_past_the_count():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    seq = _seq("a", range(6))
    _admit(kv, seq)  # 6 tokens: 2 blocks, the first published
    assert kv.allocate_slots(seq, 1 + 5) is not None  # a step's token and 5 drafts: 12 slots, 3 blocks
    assert len(kv.block_ids(seq)) == 3 and kv.num_free_blocks == 5
    kv.rollback_slots(seq, 8)  # one draft accepted: 8 tokens, 2 blocks
    assert len(kv.block_ids(seq)) == 2 and kv.num_free_blocks == 6
    assert kv.stats().num_used_slots == 8
    kv.check_invariants()
    with pytest.raises(ValueError, match="back to 9"):
        kv.rollback_slots(seq, 9)  # more than it holds
    with pytest.raises(RuntimeError, match="published"):
        kv.rollback_slots(seq, 3)  # into the first block, which the prefix cache holds
    kv.rollback_slots(_seq("unknown", [1]), 0)  # no table (swapped, freed): nothing to do


def test_swap_out_drops_draft_slots():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_cpu_blocks=8)
    seq = _seq("a", range(6))
    _admit(kv, seq)
    kv.allocate_slots(seq, 1 + 6)  # drafts reach a third and a fourth block
    assert len(kv.block_ids(seq)) == 4
    assert len(kv.swap_out(seq)) == 2  # only the blocks of its 6 computed tokens travel
    kv.swap_in(seq)
    assert len(kv.block_ids(seq)) == 2
    kv.check_invariants()


class KVMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / preempt / abort / swap sequences, and speculation: slots for
    a step's token plus k drafts, then a verification that keeps some and rolls the rest back, or a
    preemption (recompute or swap) while the draft slots are held."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BS, enable_prefix_caching=True, num_cpu_blocks=6)
        self.seqs: dict[str, Sequence] = {}  # live on device: all their tokens' K/V are in the cache
        self.swapped: dict[str, Sequence] = {}
        self.drafts: dict[str, int] = {}  # of self.seqs: those holding slots for 1 + this many drafts
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20), salt=st.sampled_from([None, None, "t"]))
    def admit(self, prompt, salt):
        # Small alphabet: prompts often share prefixes, so the prefix cache gets real hits.
        seq = _seq(self._new_id(), prompt, salt=salt)
        blocks, cached = self.kv.get_computed_blocks(seq)
        assert cached % BS == 0 and cached < len(prompt) and len(blocks) * BS == cached
        # The oracle: new blocks, plus hit blocks that must leave the free queue, against the free count.
        need = self.kv.num_blocks_needed(len(prompt)) - cached // BS
        fits = need + sum(1 for b in blocks if b.ref_cnt == 0) <= self.kv.num_free_blocks
        new = self.kv.allocate_slots(seq, len(prompt) - cached, blocks)
        assert (new is not None) == fits
        if new is None:
            self.kv.free(seq)
            return
        assert len(new) == need
        seq.num_computed_tokens = len(prompt)
        self.kv.cache_blocks(seq, len(prompt))
        self.seqs[seq.seq_id] = seq

    def _settled(self) -> list[str]:
        return sorted(set(self.seqs) - set(self.drafts))

    @precondition(lambda self: set(self.seqs) - set(self.drafts))
    @rule(data=st.data(), k=st.integers(1, 6))
    def speculate(self, data, k):
        # the scheduler's call for a decode with k drafts: its token plus the drafts, none computed yet
        seq = self.seqs[data.draw(st.sampled_from(self._settled()))]
        if self.kv.allocate_slots(seq, 1 + k) is not None:
            self.drafts[seq.seq_id] = k
            self.kv.take_pending_copies()

    @precondition(lambda self: self.drafts)
    @rule(data=st.data())
    def verify(self, data):
        # accepted drafts and the step's own token become tokens of the sequence; the rest roll back
        rid = data.draw(st.sampled_from(sorted(self.drafts)))
        seq, k = self.seqs[rid], self.drafts.pop(rid)
        accepted = data.draw(st.integers(0, k))
        for token in data.draw(st.lists(st.integers(0, 3), min_size=1 + accepted, max_size=1 + accepted)):
            seq.append_output_token(token)
        seq.num_computed_tokens = seq.num_tokens
        self.kv.rollback_slots(seq, seq.num_computed_tokens)
        self.kv.cache_blocks(seq, seq.num_computed_tokens)

    @precondition(lambda self: self.drafts)
    @rule(data=st.data(), swap=st.booleans())
    def preempt_mid_speculation(self, data, swap):
        # preempted while holding draft slots: recompute frees everything; swap keeps the computed blocks only
        rid = data.draw(st.sampled_from(sorted(self.drafts)))
        seq = self.seqs[rid]
        del self.drafts[rid]
        if swap and self.kv.can_swap_out(seq):
            self.kv.swap_out(seq)
            self.swapped[rid] = self.seqs.pop(rid)
        else:
            self.kv.free(self.seqs.pop(rid))

    @precondition(lambda self: set(self.seqs) - set(self.drafts))
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        seq = self.seqs[data.draw(st.sampled_from(self._settled()))]
        if self.kv.allocate_slots(seq, n) is not None:
            for token in data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)):
                seq.append_output_token(token)
            seq.num_computed_tokens = seq.num_tokens
            self.kv.cache_blocks(seq, seq.num_tokens)
            self.kv.take_pending_copies()

    @precondition(lambda self: set(self.seqs) - set(self.drafts))
    @rule(data=st.data())
    def fork(self, data):
        parent = self.seqs[data.draw(st.sampled_from(self._settled()))]
        child = _seq(self._new_id(), parent.all_token_ids, salt=parent.cache_salt, num_computed=parent.num_tokens)
        self.kv.fork(parent, child)
        self.seqs[child.seq_id] = child

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_or_abort_or_preempt(self, data):
        # For the books, finish, abort and recompute-preemption all drop every block of the sequence.
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.drafts.pop(rid, None)
        self.kv.free(self.seqs.pop(rid))

    @precondition(lambda self: set(self.seqs) - set(self.drafts))
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(self._settled()))
        if self.kv.can_swap_out(self.seqs[rid]):
            self.kv.swap_out(self.seqs[rid])
            self.swapped[rid] = self.seqs.pop(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.kv.can_swap_in(self.swapped[rid]):
            seq = self.swapped.pop(rid)
            self.kv.swap_in(seq)
            self.seqs[rid] = seq

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def abort_swapped(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        self.kv.free(self.swapped.pop(rid))

    @invariant()
    def books_balance(self):
        self.kv.check_invariants()
        for seq in self.seqs.values():
            slots = seq.num_tokens + 1 + self.drafts[seq.seq_id] if seq.seq_id in self.drafts else seq.num_tokens
            assert len(self.kv.block_ids(seq)) == self.kv.num_blocks_needed(slots)

    @invariant()
    def prefix_cache_holds_verified_tokens_only(self):
        # every block a sequence has published is full of its verified tokens, hashed as they are
        for seq in self.seqs.values():
            table = self.kv.tables[seq.seq_id]
            assert table.num_registered * BS <= seq.num_computed_tokens
            assert len(table.hashes) * BS <= seq.num_tokens, f"{seq.seq_id}: a hash of a block it has not filled"
            parent = None
            for i, block_hash in enumerate(table.hashes):
                parent = hash_block_tokens(parent, seq.all_token_ids[i * BS : (i + 1) * BS],
                                           (seq.cache_salt,) if i == 0 and seq.cache_salt is not None else ())
                assert block_hash == parent, f"{seq.seq_id}: block {i} hashed tokens it does not hold"
            for i in range(table.num_registered):
                block = table.blocks[i]
                assert block.block_hash is None or block.block_hash == table.hashes[i]

    def teardown(self):
        for seq in list(self.seqs.values()) + list(self.swapped.values()):
            self.kv.free(seq)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert len(self.kv.free_cpu_blocks) == self.kv.num_cpu_blocks


KVMachine.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
TestKVCacheProperties = KVMachine.TestCase

"""Paged KV-cache bookkeeping: a block pool with prefix caching, and a block table per sequence.

Nothing here touches tensors. The model runner owns the cache tensors; this module decides which
block ids each sequence owns, which blocks must be copied (copy-on-write) or swapped, and which
blocks can be reused from the prefix cache.

The scheduler admits a sequence with two calls: `get_computed_blocks(seq)` finds the cached
prefix (taking nothing), and `allocate_slots(seq, num_new_tokens, computed_blocks)` takes those
blocks plus room for the new tokens, or returns None and changes nothing. Speculative decoding
adds a third: `rollback_slots(seq, num_tokens)` gives back the slots of rejected draft tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpilot.block_hash import BlockHash, hash_block_tokens

from .sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) append, appendleft, popleft and remove-from-middle.

    The head is the next block to hand out (and so the first to lose its cached content).
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def _insert_after(self, anchor: Block, block: Block) -> None:
        nxt = anchor.next
        assert nxt is not None
        block.prev, block.next = anchor, nxt
        anchor.next = block
        nxt.prev = block
        self.num_free += 1

    def append(self, block: Block) -> None:
        assert self._tail.prev is not None
        self._insert_after(self._tail.prev, block)

    def appendleft(self, block: Block) -> None:
        self._insert_after(self._head, block)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> Block:
        first = self._head.next
        if first is None or first is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """Preallocated blocks with ref counts and an LRU prefix cache of unreferenced full blocks."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        # Free blocks that still hold cached content, counted as they move (stats read it every step).
        self.num_cached_free = 0

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[Block]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.num_cached_free -= 1
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash)

    def take(self, block: Block) -> None:
        """Add a reference to a block found in the prefix cache (it may be sitting in the free queue)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            if block.block_hash is not None:
                self.num_cached_free -= 1
        block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in eviction order (the first released is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)  # keep its content as long as possible (LRU)
                    self.num_cached_free += 1
                else:
                    self.free_queue.appendleft(block)  # nothing worth keeping: reuse it first

    def register(self, block: Block, block_hash: BlockHash) -> None:
        """Publish a newly filled block in the prefix cache."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # the same content already lives in another block; keep that one
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.num_cached_free = 0


@dataclass
class KVStats:
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_used_slots: int  # token slots holding a token of a live sequence
    num_allocated_slots: int  # token slots in blocks held by live sequences
    block_size: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, all time
    prefix_cache_hits: int = 0  # of those, tokens served from it

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    @property
    def token_usage(self) -> float:
        return self.num_used_slots / (self.num_total_blocks * self.block_size)

    @property
    def waste(self) -> float:
        if self.num_allocated_slots == 0:
            return 0.0
        return 1.0 - self.num_used_slots / self.num_allocated_slots


@dataclass
class _Table:
    blocks: list[Block] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # block ids, parallel to `blocks` (handed to the runner)
    hashes: list[BlockHash] = field(default_factory=list)  # hashes of this sequence's full blocks so far
    num_registered: int = 0  # leading blocks already published in the prefix cache
    num_tokens: int = 0  # tokens whose K/V the blocks hold (after the current step)


class KVCacheManager:
    """Block tables per sequence on top of a BlockPool, plus a CPU pool for swap preemption."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, _Table] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_tables: dict[str, list[int]] = {}
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        # Work for the runner before the next forward pass; the scheduler drains these each step.
        self.pending_copies: list[tuple[int, int]] = []

    # ----------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, seq: Sequence) -> list[int]:
        """The sequence's block table. A live view: read it, never change it."""
        table = self.tables.get(seq.seq_id)
        return [] if table is None else table.ids

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ----------------------------------------------------------------- prefix cache
    def _extend_hashes(self, table: _Table, seq: Sequence, upto_tokens: int) -> None:
        bs = self.block_size
        token_ids = seq.all_token_ids
        while len(table.hashes) < upto_tokens // bs:
            i = len(table.hashes)
            parent = table.hashes[-1] if table.hashes else None
            # The salt and the adapter go into the first block only; the chain carries them into every later block.
            extra = ((seq.cache_salt,) if seq.cache_salt is not None else ()) + (
                seq.lora_request.cache_key if seq.lora_request is not None else ()) if i == 0 else ()
            table.hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[Block], int]:
        """The longest cached prefix of full blocks for a sequence that holds no blocks yet.

        Takes no reference (pass the blocks to allocate_slots for that). At least one token is always
        left to compute, so the model produces logits for sampling. Returns (blocks, tokens they hold).
        """
        table = self.tables.setdefault(seq.seq_id, _Table())
        if table.blocks:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if not self.enable_prefix_caching:
            return [], 0
        max_cached_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(table, seq, max_cached_blocks * self.block_size)
        hits: list[Block] = []
        for block_hash in table.hashes[:max_cached_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish the blocks that are now completely filled (after a step computed up to here)."""
        table = self.tables.get(seq.seq_id)
        # Fast path first: called for every scheduled sequence after every step.
        if table is None or num_computed_tokens // self.block_size <= table.num_registered:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table.blocks))
        if num_full <= table.num_registered or not self.enable_prefix_caching:
            return
        self._extend_hashes(table, seq, num_full * self.block_size)
        for i in range(table.num_registered, num_full):
            self.pool.register(table.blocks[i], table.hashes[i])
        table.num_registered = num_full

    # ----------------------------------------------------------------- allocation
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[Block] | tuple = ()
    ) -> list[Block] | None:
        """Make room for `num_new_tokens` after the sequence's computed tokens and `computed_blocks`.

        `computed_blocks` (from get_computed_blocks, for a sequence holding no blocks) are referenced
        here, once admission is certain. A shared partially filled block is copied before it is
        written (copy-on-write). Returns the newly allocated blocks, or None, changing nothing, when
        the pool cannot supply them.
        """
        table = self.tables.get(seq.seq_id)
        if table is None:
            table = self.tables[seq.seq_id] = _Table()
        bs = self.block_size
        blocks = table.blocks
        num_computed = seq.num_computed_tokens + len(computed_blocks) * bs
        total = num_computed + num_new_tokens
        need_new = max(0, -(-total // bs) - len(blocks) - len(computed_blocks))  # cdiv, inlined: hot path
        write_idx = num_computed // bs
        needs_cow = num_new_tokens > 0 and write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1
        if not need_new and not needs_cow and not computed_blocks:  # the common decode step
            table.num_tokens = total
            return []
        if computed_blocks and table.blocks:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks; computed blocks are for admission")
        # Computed blocks sitting in the free queue leave it when taken, so they count against it too.
        from_free_queue = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need_new + int(needs_cow) + from_free_queue > self.pool.num_free:
            return None
        if not table.blocks:
            self._take_computed(table, seq, computed_blocks)
        if needs_cow:
            self._copy_on_write(table, write_idx)
        fresh_blocks = self.pool.allocate(need_new) if need_new else []
        table.blocks.extend(fresh_blocks)
        table.ids.extend(b.block_id for b in fresh_blocks)
        table.num_tokens = total
        return fresh_blocks

    def rollback_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink the sequence's slots to its first ``num_tokens`` (after a verification rejected the drafts
        past them): the blocks beyond are released, tail first. Published blocks hold verified tokens
        only, so a rollback never reaches one. A sequence without a table (swapped, freed) is left alone."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"cannot roll sequence {seq.seq_id} back to {num_tokens} tokens: it has {table.num_tokens}")
        if num_tokens < table.num_registered * self.block_size:
            raise RuntimeError(f"sequence {seq.seq_id}: rollback to {num_tokens} tokens reaches a published block")
        keep = -(-num_tokens // self.block_size)
        if keep < len(table.blocks):
            self.pool.release(reversed(table.blocks[keep:]))
            del table.blocks[keep:]
            del table.ids[keep:]
        table.num_tokens = num_tokens

    def _take_computed(self, table: _Table, seq: Sequence, computed_blocks: list[Block] | tuple) -> None:
        self._count_prefix_query(seq, len(computed_blocks) * self.block_size)
        for block in computed_blocks:
            self.pool.take(block)
            table.blocks.append(block)
            table.ids.append(block.block_id)
        table.num_registered = len(computed_blocks)

    def _count_prefix_query(self, seq: Sequence, num_hit_tokens: int) -> None:
        # A sequence taking its first blocks is one prefix-cache lookup of its whole token list.
        if self.enable_prefix_caching:
            self.prefix_queries_tokens += seq.num_tokens
            self.prefix_hits_tokens += num_hit_tokens

    def _copy_on_write(self, table: _Table, idx: int) -> None:
        shared = table.blocks[idx]
        (fresh,) = self.pool.allocate(1)
        self.pending_copies.append((shared.block_id, fresh.block_id))
        table.blocks[idx] = fresh
        table.ids[idx] = fresh.block_id
        self.pool.release([shared])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes into a shared block copy it first."""
        table = self.tables[parent.seq_id]
        if child.seq_id in self.tables:
            raise RuntimeError(f"sequence {child.seq_id} already has a block table")
        for block in table.blocks:
            block.ref_cnt += 1
        self.tables[child.seq_id] = _Table(
            blocks=list(table.blocks),
            ids=list(table.ids),
            hashes=list(table.hashes),
            num_registered=table.num_registered,
            num_tokens=table.num_tokens,
        )

    def free(self, seq: Sequence) -> None:
        """Release everything a sequence holds, on the device and in the CPU pool."""
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            # Tail blocks first: they are the least likely to be shared by another prompt.
            self.pool.release(reversed(table.blocks))
        cpu = self.cpu_tables.pop(seq.seq_id, None)
        if cpu:
            self.free_cpu_blocks.extend(cpu)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ----------------------------------------------------------------- swap
    def _computed_blocks(self, table: _Table, seq: Sequence) -> int:
        """Blocks holding the sequence's computed tokens: what a swap keeps (draft slots past them go)."""
        return self.num_blocks_needed(min(table.num_tokens, seq.num_computed_tokens))

    def can_swap_out(self, seq: Sequence) -> bool:
        table = self.tables.get(seq.seq_id)
        return table is not None and self._computed_blocks(table, seq) <= len(self.free_cpu_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move a sequence's blocks to the CPU pool. Returns (device block, cpu block) pairs to copy."""
        self.rollback_slots(seq, min(self.tables[seq.seq_id].num_tokens, seq.num_computed_tokens))
        table = self.tables.pop(seq.seq_id)
        cpu_ids = [self.free_cpu_blocks.pop() for _ in table.blocks]
        pairs = [(b.block_id, c) for b, c in zip(table.blocks, cpu_ids, strict=True)]
        self.cpu_tables[seq.seq_id] = cpu_ids
        self.pool.release(reversed(table.blocks))
        return pairs

    def can_swap_in(self, seq: Sequence) -> bool:
        # One block more than it had: room for the token it computes next.
        return len(self.cpu_tables.get(seq.seq_id, [])) + 1 <= self.pool.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back. Returns (cpu block, device block) pairs to copy."""
        cpu_ids = self.cpu_tables.pop(seq.seq_id)
        blocks = self.pool.allocate(len(cpu_ids))
        self.tables[seq.seq_id] = _Table(
            blocks=blocks, ids=[b.block_id for b in blocks], num_tokens=seq.num_computed_tokens
        )
        self.free_cpu_blocks.extend(cpu_ids)
        return [(c, b.block_id) for c, b in zip(cpu_ids, blocks, strict=True)]

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.seq_id in self.cpu_tables

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ----------------------------------------------------------------- stats
    def stats(self) -> KVStats:
        seen: set[int] = set()
        used_slots = 0
        allocated = 0
        for table in self.tables.values():
            for i, block in enumerate(table.blocks):
                if block.block_id in seen:
                    continue
                seen.add(block.block_id)
                allocated += self.block_size
                used_slots += max(0, min(self.block_size, table.num_tokens - i * self.block_size))
        num_free = self.pool.num_free
        return KVStats(
            num_total_blocks=self.pool.num_blocks,
            num_free_blocks=num_free,
            num_used_blocks=self.pool.num_blocks - num_free,
            num_cached_free_blocks=self.pool.num_cached_free,
            num_used_slots=used_slots,
            num_allocated_slots=allocated,
            block_size=self.block_size,
            prefix_cache_queries=self.prefix_queries_tokens,
            prefix_cache_hits=self.prefix_hits_tokens,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the books do not balance (used by tests and debug runs)."""
        refs: dict[int, int] = {}
        for table in self.tables.values():
            for block in table.blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        free_ids = {b.block_id for b in self.pool.free_queue}
        assert len(free_ids) == self.pool.num_free, "free queue length is off"
        for block in self.pool.blocks:
            expected = refs.get(block.block_id, 0)
            assert block.ref_cnt == expected, f"{block}: ref {block.ref_cnt} != table refs {expected}"
            assert (block.block_id in free_ids) == (expected == 0), f"{block}: free-queue membership wrong"
        assert len(free_ids) + len(refs) == self.pool.num_blocks, "free + used != total"
        cached_free = sum(1 for b in self.pool.free_queue if b.block_hash is not None)
        assert cached_free == self.pool.num_cached_free, "cached-free counter is off"
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, f"{block}: cache map points at a block with another hash"
        for block in self.pool.blocks:
            if block.block_hash is not None:
                assert self.pool.cached.get(block.block_hash) is block, f"{block}: hashed but not in the map"
        cpu_used = sum(len(v) for v in self.cpu_tables.values())
        assert cpu_used + len(self.free_cpu_blocks) == self.num_cpu_blocks, "cpu pool books are off"

"""Paged KV-cache bookkeeping: a block pool with prefix caching, and per-request block tables.

Nothing here touches tensors. The model runner owns the cache tensors; this module decides which
block ids each request owns, which blocks must be copied (copy-on-write) or swapped, and which
blocks can be reused from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BlockHash = int


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of a full block: chained through the parent's hash, so equal hashes mean equal prefixes."""
    return hash((parent_hash, tuple(token_ids)))


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
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[Block]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash)

    def take(self, block: Block) -> None:
        """Add a reference to a block found in the prefix cache (it may be sitting in the free queue)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
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


@dataclass
class KVStats:
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_used_slots: int  # token slots holding a token of a live request
    num_allocated_slots: int  # token slots in blocks held by live requests
    block_size: int

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
    hashes: list[BlockHash] = field(default_factory=list)  # hashes of this request's full blocks so far
    num_registered: int = 0  # leading blocks already published in the prefix cache
    num_tokens: int = 0  # tokens whose K/V the blocks hold (after the current step)


class KVCacheManager:
    """Block tables per request on top of a BlockPool, plus a CPU pool for swap preemption."""

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

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. A live view: read it, never change it."""
        table = self.tables.get(request_id)
        return [] if table is None else table.ids

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ----------------------------------------------------------------- prefix cache
    def _extend_hashes(self, table: _Table, token_ids: Sequence[int], upto_tokens: int) -> None:
        bs = self.block_size
        while len(table.hashes) < upto_tokens // bs:
            i = len(table.hashes)
            parent = table.hashes[-1] if table.hashes else None
            table.hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Take the longest cached prefix of full blocks for a request with no blocks yet.

        At least one token is always left to compute, so the model produces logits for sampling.
        Returns the number of tokens served from the cache.
        """
        if request_id in self.tables and self.tables[request_id].blocks:
            raise RuntimeError(f"request {request_id} already holds blocks")
        table = self.tables.setdefault(request_id, _Table())
        if not self.enable_prefix_caching:
            return 0
        max_cached_blocks = (len(token_ids) - 1) // self.block_size
        self._extend_hashes(table, token_ids, max_cached_blocks * self.block_size)
        hits: list[Block] = []
        for block_hash in table.hashes[:max_cached_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return len(hits) * self.block_size

    def take_cached_prefix(self, request_id: str, num_cached_tokens: int, num_query_tokens: int) -> None:
        """Reference the blocks found by find_cached_prefix (done only once admission is certain)."""
        if self.enable_prefix_caching:
            self.prefix_queries_tokens += num_query_tokens
            self.prefix_hits_tokens += num_cached_tokens
        table = self.tables[request_id]
        num = num_cached_tokens // self.block_size
        for block_hash in table.hashes[:num]:
            block = self.pool.lookup(block_hash)
            assert block is not None, "cached block vanished between lookup and take"
            self.pool.take(block)
            table.blocks.append(block)
            table.ids.append(block.block_id)
        table.num_registered = num
        table.num_tokens = num * self.block_size

    def blocks_to_take_from_free_queue(self, request_id: str, num_cached_tokens: int) -> int:
        """How many of the hit blocks are currently unreferenced (taking them shrinks the free queue)."""
        table = self.tables[request_id]
        num = num_cached_tokens // self.block_size
        count = 0
        for block_hash in table.hashes[:num]:
            block = self.pool.lookup(block_hash)
            if block is not None and block.ref_cnt == 0:
                count += 1
        return count

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish blocks that the last step filled completely."""
        table = self.tables.get(request_id)
        if table is None or not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table.blocks))
        if num_full <= table.num_registered:
            return
        self._extend_hashes(table, token_ids, num_full * self.block_size)
        for i in range(table.num_registered, num_full):
            self.pool.register(table.blocks[i], table.hashes[i])
        table.num_registered = num_full

    # ----------------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` tokens after `num_computed_tokens`.

        Copies a shared partially filled block before it is written (copy-on-write). Returns False,
        changing nothing, when the pool cannot supply the blocks.
        """
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = _Table()
        total = num_computed_tokens + num_new_tokens
        have = len(table.blocks)
        need_new = max(0, -(-total // self.block_size) - have)
        write_idx = num_computed_tokens // self.block_size
        needs_cow = num_new_tokens > 0 and write_idx < have and table.blocks[write_idx].ref_cnt > 1
        if not need_new and not needs_cow:  # the common decode step: room in the last block
            table.num_tokens = total
            return True
        if need_new + int(needs_cow) > self.pool.num_free:
            return False
        if needs_cow:
            shared = table.blocks[write_idx]
            (fresh,) = self.pool.allocate(1)
            self.pending_copies.append((shared.block_id, fresh.block_id))
            table.blocks[write_idx] = fresh
            table.ids[write_idx] = fresh.block_id
            self.pool.release([shared])
        if need_new:
            fresh_blocks = self.pool.allocate(need_new)
            table.blocks.extend(fresh_blocks)
            table.ids.extend(b.block_id for b in fresh_blocks)
        table.num_tokens = total
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; writes into a shared block copy it first."""
        parent = self.tables[parent_id]
        if child_id in self.tables:
            raise RuntimeError(f"request {child_id} already has a block table")
        for block in parent.blocks:
            block.ref_cnt += 1
        self.tables[child_id] = _Table(
            blocks=list(parent.blocks),
            ids=list(parent.ids),
            hashes=list(parent.hashes),
            num_registered=parent.num_registered,
            num_tokens=parent.num_tokens,
        )

    def free(self, request_id: str) -> None:
        """Release everything a request holds, on the device and in the CPU pool."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            # Tail blocks first: they are the least likely to be shared by another prompt.
            self.pool.release(reversed(table.blocks))
        cpu = self.cpu_tables.pop(request_id, None)
        if cpu:
            self.free_cpu_blocks.extend(cpu)

    # ----------------------------------------------------------------- swap
    def can_swap_out(self, request_id: str) -> bool:
        table = self.tables.get(request_id)
        return table is not None and len(table.blocks) <= len(self.free_cpu_blocks)

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move a request's blocks to the CPU pool. Returns (device block, cpu block) pairs to copy."""
        table = self.tables.pop(request_id)
        cpu_ids = [self.free_cpu_blocks.pop() for _ in table.blocks]
        pairs = [(b.block_id, c) for b, c in zip(table.blocks, cpu_ids, strict=True)]
        self.cpu_tables[request_id] = cpu_ids
        self.pool.release(reversed(table.blocks))
        return pairs

    def can_swap_in(self, request_id: str, extra_tokens: int = 1) -> bool:
        cpu = self.cpu_tables.get(request_id, [])
        return len(cpu) + 1 <= self.pool.num_free

    def swap_in(self, request_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back. Returns (cpu block, device block) pairs to copy."""
        cpu_ids = self.cpu_tables.pop(request_id)
        blocks = self.pool.allocate(len(cpu_ids))
        self.tables[request_id] = _Table(blocks=blocks, ids=[b.block_id for b in blocks], num_tokens=num_tokens)
        self.free_cpu_blocks.extend(cpu_ids)
        return [(c, b.block_id) for c, b in zip(cpu_ids, blocks, strict=True)]

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.cpu_tables

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
        cached_free = sum(1 for b in self.pool.free_queue if b.block_hash is not None)
        return KVStats(
            num_total_blocks=self.pool.num_blocks,
            num_free_blocks=num_free,
            num_used_blocks=self.pool.num_blocks - num_free,
            num_cached_free_blocks=cached_free,
            num_used_slots=used_slots,
            num_allocated_slots=allocated,
            block_size=self.block_size,
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
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, f"{block}: cache map points at a block with another hash"
        for block in self.pool.blocks:
            if block.block_hash is not None:
                assert self.pool.cached.get(block.block_hash) is block, f"{block}: hashed but not in the map"
        cpu_used = sum(len(v) for v in self.cpu_tables.values())
        assert cpu_used + len(self.free_cpu_blocks) == self.num_cpu_blocks, "cpu pool books are off"

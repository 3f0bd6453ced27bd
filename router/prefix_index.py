"""A bounded LRU of which replicas were sent which prompt blocks: the router's guess at their prefix caches.

It is a guess: a replica evicts blocks on its own. The bound (in block hashes) keeps the memory fixed
and forgets the least recently used prefixes first, as the replicas' caches do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, capacity: int = 200_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # block hash -> endpoints believed to hold it (a dict as an ordered set)
        self._blocks: OrderedDict[bytes, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_hashes: Sequence[bytes], endpoints: Iterable[str] | None = None) -> dict[str, int]:
        """endpoint -> how many leading blocks of the prompt it holds (only endpoints with at least one).

        The hashes are chained, so block i matching implies blocks 0..i-1 match: a replica's hit
        length is where it first misses.
        """
        alive = set(endpoints) if endpoints is not None else None
        result: dict[str, int] = {}
        holders: set[str] | None = None
        depth = 0
        for h in block_hashes:
            here = self._blocks.get(h)
            if not here:
                break
            if holders is None:
                cur = here.keys() & alive if alive is not None else set(here)
            elif here.keys() >= holders:
                depth += 1  # the usual case, a prefix recorded together: the same holders, no new set
                continue
            else:
                cur = holders.intersection(here)
            if not cur:
                break
            # only a replica that drops out here gets its length written: writing every holder's length at
            # every block was O(blocks x replicas) per request (a system prompt cached on all 200 replicas)
            if holders is not None:
                for name in holders - cur:
                    result[name] = depth
            holders = cur
            depth += 1
        for name in holders or ():
            result[name] = depth
        return result

    def record(self, block_hashes: Sequence[bytes], endpoint: str) -> None:
        """The prompt was sent to `endpoint`: it now holds these blocks (most recently used)."""
        blocks = self._blocks
        for h in block_hashes:
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = {endpoint: None}
            else:
                holders[endpoint] = None
                blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def forget(self, endpoint: str) -> int:
        """The endpoint is gone (its cache with it). Returns how many blocks lost their last holder."""
        emptied = []
        for h, holders in self._blocks.items():
            if endpoint in holders:
                del holders[endpoint]
                if not holders:
                    emptied.append(h)
        for h in emptied:
            del self._blocks[h]
        return len(emptied)

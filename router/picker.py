"""The routing decision, as a pure object: endpoint loads + a prompt's block hashes in, one endpoint out.

First the *home* of the request is found, ignoring load:
1. session: the replica that served this `user`/session key last;
2. prefix: the replica holding the longest cached prefix of the prompt (per the router's prefix index);
   replicas holding equally long prefixes are all homes, and the one with the lowest cost is taken, so a
   tenant whose prefix is cached on two replicas spreads over both;
3. hash: consistent (rendezvous) hashing on the prompt's first blocks, so routers that share no state
   still send a new prefix to the same replica.
Then load may move the request off its home (reason `spill`):
- the home is over the load cap or its KV cache is nearly full, or
- the request would queue at the home (it reports waiting requests, or it already runs as many as a
  replica runs at once: `slots`) while another eligible replica would run it at once.
A spill goes to the eligible replica with the next-longest cached prefix (the prefix index knows), else to
the next one in the prompt's rendezvous ranking: not simply the least loaded, so the tenant's prefix
becomes cached on one more replica (the same one in every router) and later requests spread over both.
4. load: with nothing to route by (no prompt, prefix off), the replica with the lowest cost.
5. fallback: every replica is over the cap or full; the lowest cost still answers.
The load cap is bounded-load consistent hashing: no choice may put a replica more than `load_cap` (a share)
above the mean load while another replica is under it. Cost weighs a waiting request (it delays a first
token by a whole request) more than a full KV cache (it only risks a preemption later).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

REASONS = ("session", "prefix", "hash", "spill", "load", "fallback")


@dataclass(frozen=True)
class EndpointLoad:
    """What the router knows about one ready replica right now."""

    name: str
    inflight: int = 0  # the router's own requests in flight there (fresh)
    running: float | None = None  # scraped vllm:num_requests_running (None: no fresh scrape)
    waiting: float | None = None  # scraped vllm:num_requests_waiting
    kv_usage: float | None = None  # scraped vllm:kv_cache_usage_perc, 0..1

    @cached_property  # a pick reads it several times per replica (works on a frozen dataclass: no slots)
    def load(self) -> float:
        # The scrape includes other routers' requests but is up to one interval old; our own count is
        # fresh. Taking the larger of the two avoids counting our requests twice.
        scraped = (self.running or 0.0) + (self.waiting or 0.0)
        return max(float(self.inflight), scraped)


@dataclass(frozen=True)
class PickerConfig:
    prefix: bool = True  # prefix index + consistent hashing
    load: bool = True  # scraped load, the load cap, spills and the KV-full rule (off: our in-flight count only)
    session: bool = False
    # Affinity may put a replica at most this share above the mean load. 1.0 (twice the mean) did best in
    # bench/router_chat.py: lower caps spilled tenants off their cached replica (bench/results/router_chat.json).
    load_cap: float = 1.0
    kv_full: float = 0.95  # replicas at or above this KV usage are no affinity target
    hash_blocks: int = 1  # how many leading blocks seed the consistent hash
    queue_weight: float = 1.0  # cost of a waiting request on top of its count in the load (so 2 in all)
    kv_weight: float = 1.0  # cost of a full KV cache, in requests (scaled by the usage)
    slots: float | None = None  # requests a replica runs at once (--max-num-seqs); None: learned from scrapes

    def __post_init__(self) -> None:
        if self.load_cap < 0:
            raise ValueError(f"load_cap must be >= 0, got {self.load_cap}")
        if not 0 < self.kv_full <= 1:
            raise ValueError(f"kv_full must be in (0, 1], got {self.kv_full}")
        if self.hash_blocks < 1:
            raise ValueError(f"hash_blocks must be >= 1, got {self.hash_blocks}")
        if self.queue_weight < 0 or self.kv_weight < 0:
            raise ValueError("queue_weight and kv_weight must be >= 0")
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")


@dataclass(frozen=True)
class Decision:
    endpoint: str
    reason: str
    hit_blocks: int = 0  # blocks of the prompt the chosen replica is believed to hold


@dataclass  # not frozen: a frozen dataclass's __init__ is slower, and this one lives for one pick
class _View:
    """One pick's look at the live replicas: who is eligible, what each costs, who would queue."""

    live: dict[str, EndpointLoad]
    eligible: set[str]
    cost: dict[str, float]
    queues: set[str]  # replicas where one more request would wait for a free slot
    ranking: list[str]  # the prompt's rendezvous order ([] with no prefix key)
    cached: Mapping[str, int]
    order: dict[str, int] = field(default_factory=dict)  # name -> its place in `ranking`

    def rank(self, name: str) -> int:
        return self.order.get(name, len(self.ranking))


@dataclass
class Picker:
    config: PickerConfig = field(default_factory=PickerConfig)

    def cap(self, loads: Sequence[float]) -> float:
        """Bounded-load cap: the most load a replica may reach after taking one more request."""
        return math.ceil((1.0 + self.config.load_cap) * (sum(loads) + 1.0) / len(loads))

    def cost(self, e: EndpointLoad) -> float:
        """How bad a replica is as a target: requests there, a waiting one weighing more, plus KV pressure."""
        if not self.config.load:
            return float(e.inflight)
        return e.load + self.config.queue_weight * (e.waiting or 0.0) + self.config.kv_weight * (e.kv_usage or 0.0)

    def would_queue(self, e: EndpointLoad, slots: float | None) -> bool:
        """One more request there would wait for a free slot instead of starting at once."""
        if not self.config.load:
            return False
        return (e.waiting or 0.0) > 0 or (slots is not None and e.load + 1.0 > slots)

    def _eligible(self, live: Sequence[EndpointLoad]) -> set[str]:
        if not self.config.load:
            return {e.name for e in live}
        loads = [e.load for e in live]
        cap, full = self.cap(loads), self.config.kv_full
        return {e.name for e, load in zip(live, loads, strict=True)
                if load + 1.0 <= cap and (e.kv_usage is None or e.kv_usage < full)}

    def pick(self, loads: Sequence[EndpointLoad], block_hashes: Sequence[bytes] = (),
             cached: Mapping[str, int] | None = None, session_endpoint: str | None = None,
             exclude: Iterable[str] = (), slots: float | None = None) -> Decision | None:
        """The endpoint for one request; None when no endpoint is left.

        `cached` maps endpoint -> number of leading blocks the prefix index says it holds; `slots` is
        the learned number of requests a replica runs at once (the config's value wins).
        """
        skip = set(exclude)
        live = [e for e in loads if e.name not in skip]
        if not live:
            return None
        view = self._view(live, block_hashes, cached or {}, self.config.slots or slots)
        if not view.eligible:  # everyone is over the cap or full: still answer, the cheapest wins
            return self._cheapest(view, set(view.live), "fallback")
        home = self._home(view, session_endpoint)
        if home is None:
            return self._cheapest(view, view.eligible, "load")
        if not self._should_spill(view, home.endpoint):
            return home
        return self._spill(view, home.endpoint)

    def _view(self, live: Sequence[EndpointLoad], block_hashes: Sequence[bytes], cached: Mapping[str, int],
              slots: float | None) -> _View:
        names = [e.name for e in live]
        ranking = rendezvous_rank(names, block_hashes, self.config.hash_blocks) \
            if self.config.prefix and block_hashes else []
        return _View({e.name: e for e in live}, self._eligible(live), {e.name: self.cost(e) for e in live},
                     {e.name for e in live if self.would_queue(e, slots)}, ranking,
                     cached if self.config.prefix else {}, {n: i for i, n in enumerate(ranking)})

    def _home(self, v: _View, session_endpoint: str | None) -> Decision | None:
        """Where affinity sends the request, load aside; None when there is nothing to route by."""
        if self.config.session and session_endpoint in v.live:
            assert session_endpoint is not None
            return Decision(session_endpoint, "session", v.cached.get(session_endpoint, 0))
        if not v.ranking:
            return None
        best = max((v.cached.get(n, 0) for n in v.ranking), default=0)
        if best > 0:
            # equal prefixes: any holder saves the same prefill; the eligible, cheapest one takes it (ties
            # go to the rendezvous order, the same in every router)
            holders = [n for n in v.ranking if v.cached.get(n, 0) == best]
            name = min(holders, key=lambda n: (n not in v.eligible, v.cost[n], v.rank(n)))
            return Decision(name, "prefix", best)
        return Decision(v.ranking[0], "hash", 0)

    @staticmethod
    def _should_spill(v: _View, home: str) -> bool:
        if home not in v.eligible:
            return True
        return home in v.queues and any(n not in v.queues for n in v.eligible if n != home)

    def _spill(self, v: _View, home: str) -> Decision:
        """The next-best target: no queue first, then the longest cached prefix, then the hash ranking."""
        pool = [n for n in v.eligible if n != home]  # not empty: _should_spill said so

        def key(n: str) -> tuple:
            hit = v.cached.get(n, 0)
            # among equal positive prefixes the cheaper holder; with no prefix anywhere the ranking
            # alone, so that a tenant's second home is one replica, not whichever is idlest now
            tie = v.cost[n] if hit > 0 or not v.ranking else 0.0
            return (n in v.queues, -hit, tie, v.rank(n), n)

        name = min(pool, key=key)
        return Decision(name, "spill", v.cached.get(name, 0))

    def _cheapest(self, v: _View, names: set[str], reason: str) -> Decision:
        name = min(names, key=lambda n: (v.cost[n], n))
        return Decision(name, reason, v.cached.get(name, 0))


def rendezvous_rank(names: Iterable[str], block_hashes: Sequence[bytes], hash_blocks: int) -> list[str]:
    """Endpoints by highest-random-weight for the prompt's seed block: the same order in every router.

    The seed is the chained hash of block `hash_blocks` (or the last full one), so it covers every
    block before it too. Adding or removing one endpoint only moves the keys that endpoint owned.
    """
    seed = block_hashes[min(hash_blocks, len(block_hashes)) - 1]

    def weight(name: str) -> bytes:
        return hashlib.blake2b(seed + b"\x00" + name.encode(), digest_size=8).digest()

    return sorted(names, key=weight, reverse=True)

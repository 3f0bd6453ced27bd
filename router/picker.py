"""The routing decision, as a pure object: endpoint loads + a prompt's block hashes in, one endpoint out.

Order of preference (each step switchable):
1. session: the replica that served this `user`/session key last, if it is under the load cap;
2. prefix: the replica holding the longest cached prefix of the prompt (per the router's prefix index);
3. hash: consistent (rendezvous) hashing on the prompt's first blocks, walking the ranking past replicas
   over the cap, so routers that share no state still send a prefix to the same replica;
4. load: the least-loaded replica.
The load cap is bounded-load consistent hashing: affinity may not put a replica more than `load_cap`
(a share) above the mean load. Replicas whose KV cache is nearly full are not affinity targets either.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

REASONS = ("session", "prefix", "hash", "load", "fallback")


@dataclass(frozen=True)
class EndpointLoad:
    """What the router knows about one ready replica right now."""

    name: str
    inflight: int = 0  # the router's own requests in flight there (fresh)
    running: float | None = None  # scraped vllm:num_requests_running (None: no fresh scrape)
    waiting: float | None = None  # scraped vllm:num_requests_waiting
    kv_usage: float | None = None  # scraped vllm:kv_cache_usage_perc, 0..1

    @property
    def load(self) -> float:
        # The scrape includes other routers' requests but is up to one interval old; our own count is
        # fresh. Taking the larger of the two avoids counting our requests twice.
        scraped = (self.running or 0.0) + (self.waiting or 0.0)
        return max(float(self.inflight), scraped)


@dataclass(frozen=True)
class PickerConfig:
    prefix: bool = True  # prefix index + consistent hashing
    load: bool = True  # scraped load, the load cap and the KV-full rule (off: our in-flight count only)
    session: bool = False
    # Affinity may put a replica at most this share above the mean load. 1.0 (twice the mean) measured best
    # in bench/router_chat.py: at 0.25 small loads spilled tenants off their cached replica (TTFT p50 1.08x
    # round-robin's vs 1.54x at 1.0, with the busiest replica at 1.2x the mean either way).
    load_cap: float = 1.0
    kv_full: float = 0.95  # replicas at or above this KV usage are no affinity target
    hash_blocks: int = 1  # how many leading blocks seed the consistent hash

    def __post_init__(self) -> None:
        if self.load_cap < 0:
            raise ValueError(f"load_cap must be >= 0, got {self.load_cap}")
        if not 0 < self.kv_full <= 1:
            raise ValueError(f"kv_full must be in (0, 1], got {self.kv_full}")
        if self.hash_blocks < 1:
            raise ValueError(f"hash_blocks must be >= 1, got {self.hash_blocks}")


@dataclass(frozen=True)
class Decision:
    endpoint: str
    reason: str
    hit_blocks: int = 0  # blocks of the prompt the chosen replica is believed to hold


@dataclass
class Picker:
    config: PickerConfig = field(default_factory=PickerConfig)

    def cap(self, loads: Sequence[float]) -> float:
        """Bounded-load cap: the most load a replica may reach after taking one more request."""
        return math.ceil((1.0 + self.config.load_cap) * (sum(loads) + 1.0) / len(loads))

    def _eligible(self, live: Sequence[EndpointLoad]) -> set[str]:
        if not self.config.load:
            return {e.name for e in live}
        loads = [e.load for e in live]
        cap, full = self.cap(loads), self.config.kv_full
        return {e.name for e, load in zip(live, loads, strict=True)
                if load + 1.0 <= cap and (e.kv_usage is None or e.kv_usage < full)}

    def pick(self, loads: Sequence[EndpointLoad], block_hashes: Sequence[bytes] = (),
             cached: Mapping[str, int] | None = None, session_endpoint: str | None = None,
             exclude: Iterable[str] = ()) -> Decision | None:
        """The endpoint for one request; None when no endpoint is left.

        `cached` maps endpoint -> number of leading blocks the prefix index says it holds.
        """
        skip = set(exclude)
        live = [e for e in loads if e.name not in skip]
        if not live:
            return None
        ok = self._eligible(live)
        cached = cached or {}
        if self.config.session and session_endpoint in ok:
            return Decision(session_endpoint, "session", cached.get(session_endpoint, 0))  # type: ignore[arg-type]
        if self.config.prefix and block_hashes:
            ranking = rendezvous_rank([e.name for e in live], block_hashes, self.config.hash_blocks)
            best = max((cached.get(n, 0) for n in ranking if n in ok), default=0)
            if best > 0:  # longest cached prefix; ties go to the rendezvous order, the same in every router
                name = next(n for n in ranking if n in ok and cached.get(n, 0) == best)
                return Decision(name, "prefix", best)
            for i, name in enumerate(ranking):
                if name in ok:
                    return Decision(name, "hash" if i == 0 else "load", 0)
        return self._least_loaded(live, ok, cached)

    def _least_loaded(self, live: Sequence[EndpointLoad], ok: set[str], cached: Mapping[str, int]) -> Decision:
        pool = [e for e in live if e.name in ok]
        reason = "load"
        if not pool:  # everyone is over the cap or full: still answer, least loaded wins
            pool, reason = list(live), "fallback"
        if self.config.load:
            best = min(pool, key=lambda e: (e.load, e.kv_usage or 0.0, e.name))
        else:
            best = min(pool, key=lambda e: (e.inflight, e.name))
        return Decision(best.name, reason, cached.get(best.name, 0))


def rendezvous_rank(names: Iterable[str], block_hashes: Sequence[bytes], hash_blocks: int) -> list[str]:
    """Endpoints by highest-random-weight for the prompt's seed block: the same order in every router.

    The seed is the chained hash of block `hash_blocks` (or the last full one), so it covers every
    block before it too. Adding or removing one endpoint only moves the keys that endpoint owned.
    """
    seed = block_hashes[min(hash_blocks, len(block_hashes)) - 1]

    def weight(name: str) -> bytes:
        return hashlib.blake2b(seed + b"\x00" + name.encode(), digest_size=8).digest()

    return sorted(names, key=weight, reverse=True)

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
  replica runs at once: `slots`) while another eligible replica would run it at once, or
- every replica may queue, but the home's queue passes the eligible replicas' mean by `spill_margin`
  requests (or its KV usage theirs by `spill_kv_margin`): the tail is the longest queue, so no replica
  may build it while others have shorter ones. Such a spill goes only to another replica holding part of
  the prompt (its tenant's system prompt, say), which prefills just the rest: a replica without it would
  prefill all of it and take one tenant more into its cache, evicting other tenants' prefixes there.
A spill goes to an eligible replica not over those means, with the next-longest cached prefix (the prefix
index knows), else to the next one in the prompt's rendezvous ranking: not simply the least loaded, so the
tenant's prefix becomes cached on one more replica (the same one in every router) and later requests
spread over both.
4. load: with nothing to route by (no prompt, prefix off), the replica with the lowest cost.
5. fallback: every replica is over the cap or full; the lowest cost still answers.
A request for a LoRA adapter (`AdapterTargets`) may go only to the replicas that list it. Its home is
found as above among those where the adapter is hot (requests for it run or wait there: it holds an
adapter slot), and a spill prefers another hot replica; an adapter hot nowhere goes to the cheapest
replica that lists it, one with a free adapter slot first, which loads it on demand.
The load cap is bounded-load consistent hashing: no choice may put a replica more than `load_cap` (a share)
above the mean load while another replica is under it. Cost weighs a waiting request (it delays a first
token by a whole request) more than a full KV cache (it only risks a preemption later).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

REASONS = ("session", "prefix", "hash", "spill", "load", "fallback")
# where an adapter request went: where the adapter was hot, off every hot replica (by load), where it was
# hot nowhere (the replica loads it), or anywhere: a model name that no replica lists
ADAPTER_OUTCOMES = ("hit", "spill", "cold", "unlisted")


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
        return _load(self.inflight, self.scraped)

    @property
    def scraped(self) -> float:
        return (self.running or 0.0) + (self.waiting or 0.0)


def _load(inflight: int, scraped: float) -> float:
    # The scrape includes other routers' requests but is up to one interval old; our own count is fresh.
    # Taking the larger of the two avoids counting our requests twice.
    return max(float(inflight), scraped)


@dataclass(frozen=True)
class AdapterTargets:
    """Where one LoRA adapter can run (router/adapters.py builds it from what the replicas report)."""

    name: str
    listed: frozenset[str] = frozenset()  # replicas whose /v1/models lists it
    hot: frozenset[str] = frozenset()  # replicas with requests for it running or waiting
    full: frozenset[str] = frozenset()  # replicas whose adapter slots all hold other adapters

    @property
    def serving(self) -> frozenset[str]:
        return self.listed | self.hot  # a hot adapter is served there, whatever an older list said


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
    # the home spills when its queue passes the replicas' mean by this many requests, or its KV usage
    # passes theirs by this share (inf: off)
    spill_margin: float = 2.0
    spill_kv_margin: float = 0.5
    adapter: bool = True  # adapter affinity (off: an adapter's requests route as any model's)

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
        if not self.spill_margin >= 0 or not self.spill_kv_margin >= 0:  # NaN fails too
            raise ValueError("spill_margin and spill_kv_margin must be >= 0")


@dataclass(frozen=True)
class Decision:
    endpoint: str
    reason: str
    hit_blocks: int = 0  # blocks of the prompt the chosen replica is believed to hold
    adapter: str = ""  # for an adapter request, one of ADAPTER_OUTCOMES ("" for any other)


@dataclass  # not frozen: a frozen dataclass's __init__ is slower, and this one lives for one pick
class _View:
    """One pick's look at the live replicas: who is eligible, what each costs, who would queue."""

    live: dict[str, EndpointLoad]
    eligible: set[str]
    cost: dict[str, float]
    queues: set[str]  # replicas where one more request would wait for a free slot
    cached: Mapping[str, int]
    # the prompt's rendezvous order as a sort key per name, lowest first ({} with no prefix key): the
    # ranking itself is never sorted, a pick only needs its first name or the order among a few
    order: dict[str, tuple[int, int]] = field(default_factory=dict)
    slots: float | None = None
    queue_sum: float = 0.0  # the eligible replicas' queues (`queue`) and KV usage, summed, for their means
    kv_sum: float = 0.0
    adapter: bool = False  # the request names an adapter these replicas list
    hot: frozenset[str] = frozenset()  # where that adapter is hot

    def rank(self, name: str) -> tuple[int, int]:
        return self.order.get(name, (0, 0))

    def queue(self, name: str) -> float:
        """Requests waiting for a slot there now: scraped, or what our fresh count puts beyond its slots."""
        e = self.live[name]
        waiting = e.waiting or 0.0
        return waiting if self.slots is None else max(waiting, e.load - self.slots)


@dataclass
class Picker:
    config: PickerConfig = field(default_factory=PickerConfig)
    # rendezvous weights of the last seeds (the seed is a prompt's first block, which a tenant's requests share):
    # at 200 replicas, hashing every replica name again for each request was half of a pick's time
    _weights: OrderedDict[bytes, dict[str, int]] = field(default_factory=OrderedDict, repr=False, compare=False)

    def cap(self, loads: Sequence[float]) -> float:
        """Bounded-load cap: the most load a replica may reach after taking one more request."""
        return math.ceil((1.0 + self.config.load_cap) * (sum(loads) + 1.0) / len(loads))

    def cost(self, e: EndpointLoad) -> float:
        """How bad a replica is as a target: requests there, a waiting one weighing more, plus KV pressure."""
        if not self.config.load:
            return float(e.inflight)
        queue, kv = self._pressure(e)
        return e.load + queue + kv

    def _pressure(self, e: EndpointLoad) -> tuple[float, float]:
        """A replica's cost on top of its load: its waiting requests' weight, then its KV pressure."""
        return self.config.queue_weight * (e.waiting or 0.0), self.config.kv_weight * (e.kv_usage or 0.0)

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
             exclude: Iterable[str] = (), slots: float | None = None,
             adapter: AdapterTargets | None = None) -> Decision | None:
        """The endpoint for one request; None when no endpoint is left.

        `cached` maps endpoint -> number of leading blocks the prefix index says it holds; `slots` is
        the learned number of requests a replica runs at once (the config's value wins); `adapter`, for a
        request that names a LoRA adapter, where it can run (none listing it: routed as any request).
        """
        skip = set(exclude)
        live = [e for e in loads if e.name not in skip] if skip else list(loads)
        serving = adapter.serving if adapter is not None and self.config.adapter else frozenset()
        if serving:  # the others would answer 404
            live = [e for e in live if e.name in serving]
        if not live:
            return None
        view = self._view(live, block_hashes, cached or {}, self.config.slots or slots)
        if serving:
            assert adapter is not None
            view.adapter, view.hot = True, adapter.hot & view.live.keys()
            # a slot freeing on a replica whose slots hold other adapters is a wait like a queue's
            view.queues.update(n for n in adapter.full & view.live.keys() if n not in adapter.hot)
        d = self._decide(view, session_endpoint)
        if not serving:
            return d if adapter is None or not self.config.adapter else Decision(
                d.endpoint, d.reason, d.hit_blocks, "unlisted")
        outcome = "hit" if d.endpoint in view.hot else "spill" if view.hot else "cold"
        return Decision(d.endpoint, d.reason, d.hit_blocks, outcome)

    def _decide(self, view: _View, session_endpoint: str | None) -> Decision:
        if not view.eligible:  # everyone is over the cap or full: still answer, the cheapest wins
            return self._cheapest(view, set(view.live), "fallback")
        home = self._home(view, session_endpoint)
        if home is None:
            return self._cheapest(view, view.eligible, "load")
        to = self._should_spill(view, home.endpoint)
        if not to:
            return home
        return self._spill(view, home.endpoint, to == "holders") or home

    def pick_many(self, loads: Sequence[EndpointLoad], n: int, weight: int = 1,
                  exclude: Iterable[str] = ()) -> list[Decision]:
        """n requests with nothing to route by (no prompt key, no session), picked one after another: the
        same decisions as n calls of `pick`, each after the chosen replica's `inflight` grew by `weight`.

        For a caller that routes many requests on one look at the loads (the fleet simulator routes
        thousands a second over 200 replicas): a pick is O(replicas), these are O(replicas + n log replicas)
        plus a C-speed sum per request (the cap is summed as `pick` sums it, so the floats agree).
        """
        skip = set(exclude)
        live = [e for e in loads if e.name not in skip]
        if not live or n <= 0:
            return []
        use_load, full, share = self.config.load, self.config.kv_full, 1.0 + self.config.load_cap
        names = [e.name for e in live]
        inflight = [e.inflight for e in live]
        # per replica what its load and cost are made of, read once (only the in-flight count changes here)
        scraped = [e.scraped for e in live]
        lds = [_load(f, x) for f, x in zip(inflight, scraped, strict=True)]
        queue, kv = zip(*map(self._pressure, live), strict=True)
        cost = [load + q + k for load, q, k in zip(lds, queue, kv, strict=True)] if use_load \
            else [float(f) for f in inflight]  # as `cost` computes it
        room = [e.kv_usage is None or e.kv_usage < full for e in live]  # not too full to be a target
        # the cap's sum, kept as a running total where that is exact (whole numbers: requests counted),
        # else summed again per request as `cap` sums it, so that the floats always agree with `pick`
        whole = all(x.is_integer() for x in lds)
        total, count = sum(lds), len(lds)
        version = [0] * count
        # Heaps of (cost, name, index, version): (cost, name) orders as _cheapest does, the version tells an
        # entry is current. `open_` holds the replicas under the cap; `over` the ones not too full but over
        # it, by load: the cap only rises (loads only grow), so they may join `open_` later.
        push, pop, replace_top = heapq.heappush, heapq.heappop, heapq.heapreplace
        open_: list[tuple[float, str, int, int]] = []
        over: list[tuple[float, int, int]] = []
        every: list[tuple[float, str, int, int]] | None = None  # any replica, built on the first fallback
        if use_load:
            over = [(lds[i], i, 0) for i in range(count) if room[i]]
            heapq.heapify(over)
        else:
            open_ = [(c, names[i], i, 0) for i, c in enumerate(cost)]
            heapq.heapify(open_)
        cap = 0.0
        chosen = []
        for _ in range(n):
            if use_load:
                cap = math.ceil(share * ((total if whole else sum(lds)) + 1.0) / count)
                while over and over[0][0] + 1.0 <= cap:
                    _, i, ver = pop(over)
                    if ver == version[i]:
                        push(open_, (cost[i], names[i], i, ver))
            while open_ and open_[0][3] != version[open_[0][2]]:
                pop(open_)
            top = bool(open_)  # the pick is open_'s top entry, which its new one replaces below
            if top:
                i = open_[0][2]
                chosen.append(i)
            else:
                if every is None:
                    every = [(c, names[j], j, version[j]) for j, c in enumerate(cost)]
                    heapq.heapify(every)
                while every[0][3] != version[every[0][2]]:
                    pop(every)
                i = every[0][2]
                chosen.append(~i)  # a fallback, told apart below
            inflight[i] += weight
            ver = version[i] = version[i] + 1
            if use_load:
                load = _load(inflight[i], scraped[i])
                total += load - lds[i]
                lds[i] = load
                c = cost[i] = load + queue[i] + kv[i]
                if room[i] and load + 1.0 <= cap:  # still under this cap, so under the next (it only rises)
                    (replace_top if top else push)(open_, (c, names[i], i, ver))
                else:
                    if top:
                        pop(open_)
                    if room[i]:
                        push(over, (load, i, ver))
            else:
                c = cost[i] = float(inflight[i])
                (replace_top if top else push)(open_, (c, names[i], i, ver))
            if every is not None:
                push(every, (c, names[i], i, ver))
        made: dict[int, Decision] = {}  # Decisions are immutable: one per replica and reason is enough
        return [made.get(i) or made.setdefault(i, Decision(names[i], "load") if i >= 0 else
                                               Decision(names[~i], "fallback")) for i in chosen]

    def _view(self, live: Sequence[EndpointLoad], block_hashes: Sequence[bytes], cached: Mapping[str, int],
              slots: float | None) -> _View:
        cfg = self.config
        cost: dict[str, float] = {}
        eligible: set[str] = set()
        queues: set[str] = set()
        queue_sum = kv_sum = 0.0
        if cfg.load:  # one pass, each replica's load read once (the cost, the cap and the queue rule share it)
            loads = [e.load for e in live]
            cap, full = self.cap(loads), cfg.kv_full
            qw, kw = cfg.queue_weight, cfg.kv_weight
            room = math.inf if slots is None else slots
            for e, load in zip(live, loads, strict=True):
                name, waiting, kv = e.name, e.waiting or 0.0, e.kv_usage
                kv_f = kv or 0.0
                cost[name] = load + qw * waiting + kw * kv_f  # `cost`, inline: this loop is a pick's O(replicas)
                beyond = load - room  # requests past its slots (negative: free slots)
                if load + 1.0 <= cap and (kv is None or kv < full):
                    eligible.add(name)
                    queue_sum += waiting if waiting >= beyond else beyond  # `_View.queue`, inline
                    kv_sum += kv_f
                if waiting > 0 or beyond > -1.0:  # one more would wait
                    queues.add(name)
        else:
            for e in live:
                cost[e.name] = float(e.inflight)
                eligible.add(e.name)
        order = self._rendezvous([e.name for e in live], block_hashes) if cfg.prefix and block_hashes else {}
        return _View({e.name: e for e in live}, eligible, cost, queues, cached if cfg.prefix else {}, order,
                     slots, queue_sum, kv_sum)

    def _rendezvous(self, names: list[str], block_hashes: Sequence[bytes]) -> dict[str, tuple[int, int]]:
        """name -> (-weight, place in `names`): ascending is rendezvous_rank's order (ties in list order)."""
        seed = _seed(block_hashes, self.config.hash_blocks)
        weights = self._weights.get(seed)
        if weights is None:
            weights = self._weights[seed] = {}
            if len(self._weights) > _WEIGHT_SEEDS:
                self._weights.popitem(last=False)
        else:
            self._weights.move_to_end(seed)
        missing = [n for n in names if n not in weights]
        if missing:
            if len(weights) > 4 * _WEIGHT_NAMES:  # replicas come and go: drop the names of a past fleet
                weights.clear()
                missing = names
            weights.update(zip(missing, _weights(seed, missing), strict=True))
        return {n: (-weights[n], i) for i, n in enumerate(names)}

    def _home(self, v: _View, session_endpoint: str | None) -> Decision | None:
        """Where affinity sends the request, load aside; None when there is nothing to route by.

        An adapter's home is one of the replicas where it is hot; hot nowhere, it has none (the cheapest
        replica that lists it then takes it)."""
        if self.config.session and session_endpoint in v.live:
            assert session_endpoint is not None
            return Decision(session_endpoint, "session", v.cached.get(session_endpoint, 0))
        pool: Collection[str] = v.hot if v.adapter else v.order
        if not pool:
            return None
        if not v.order:  # an adapter, no prompt: its cheapest hot replica, as long as load allows
            name = min(pool, key=lambda n: (n not in v.eligible, v.cost[n], n))
            return Decision(name, "load", 0)
        best = max((hit for n, hit in v.cached.items() if n in pool), default=0)
        if best > 0:
            # equal prefixes: any holder saves the same prefill; the eligible, cheapest one takes it (ties
            # go to the rendezvous order, the same in every router)
            holders = [n for n, hit in v.cached.items() if hit == best and n in pool]
            name = min(holders, key=lambda n: (n not in v.eligible, v.cost[n], v.rank(n)))
            return Decision(name, "prefix", best)
        return Decision(min(pool, key=v.rank), "hash", 0)

    def _should_spill(self, v: _View, home: str) -> str:
        """Whether the request leaves its home: '' (no), 'any' (to any replica with room), or 'holders' (only
        to one holding part of its prompt)."""
        if home not in v.eligible:
            return "any"
        if home in v.queues and any(n not in v.queues for n in v.eligible if n != home):
            return "any"
        # Past the mean queue by spill_margin (or KV usage by spill_kv_margin) the home spills, but only to
        # a replica holding part of the prompt: it prefills the rest, and takes on no tenant it lacks.
        return "holders" if self._over_mean(v, (home,)) else ""

    def _over_mean(self, v: _View, names: Iterable[str]) -> set[str]:
        """Those of `names` whose queue or KV usage pass the eligible replicas' mean by the margins."""
        if not self.config.load:
            return set()
        n, live, queue = len(v.eligible), v.live, v.queue
        q_cap, kv_cap = v.queue_sum / n + self.config.spill_margin, v.kv_sum / n + self.config.spill_kv_margin
        return {name for name in names if (live[name].kv_usage or 0.0) > kv_cap or queue(name) > q_cap}

    def _spill(self, v: _View, home: str, holders: bool = False) -> Decision | None:
        """The next-best target: no queue, an adapter's hot replica, then the longest cached prefix, then the
        hash ranking, among the replicas not over the mean (`holders`: and holding part of the prompt); None
        when none is a better place than the home."""

        def key(n: str) -> tuple:
            hit = v.cached.get(n, 0)
            # among equal positive prefixes the cheaper holder; with no prefix anywhere the ranking
            # alone, so that a tenant's second home is one replica, not whichever is idlest now
            tie = v.cost[n] if hit > 0 or not v.order else 0.0
            return (n in v.queues, v.adapter and n not in v.hot, -hit, tie, v.rank(n), n)

        others = [n for n in v.eligible if n != home and (not holders or v.cached.get(n, 0) > 0)]
        if not others:
            return None
        name = min(others, key=key)
        # over the mean too: moving from one long queue to another would pay the prefill for nothing (the
        # best is rarely over it, so the others are looked at only then)
        if self._over_mean(v, (name,)):
            pool = [n for n in others if n not in self._over_mean(v, others)]
            if pool:
                name = min(pool, key=key)
            elif home in v.eligible:
                return None
        return Decision(name, "spill", v.cached.get(name, 0))

    def _cheapest(self, v: _View, names: set[str], reason: str) -> Decision:
        # an adapter goes where it would not wait for an adapter slot first (queues holds those too)
        name = min(names, key=lambda n: (v.adapter and n in v.queues, v.cost[n], n))
        return Decision(name, reason, v.cached.get(name, 0))


_WEIGHT_SEEDS = 256  # seeds whose weights a picker keeps (each holds one weight per replica)
_WEIGHT_NAMES = 1024


def _seed(block_hashes: Sequence[bytes], hash_blocks: int) -> bytes:
    return block_hashes[min(hash_blocks, len(block_hashes)) - 1]


def _weights(seed: bytes, names: Iterable[str]) -> list[int]:
    """Each name's highest-random-weight for the seed, as an integer (big-endian: orders as the digest)."""
    h = hashlib.blake2b(seed + b"\x00", digest_size=8)  # the seed's state once, copied per name
    out = []
    for name in names:
        c = h.copy()
        c.update(name.encode())
        out.append(int.from_bytes(c.digest(), "big"))
    return out


def rendezvous_rank(names: Iterable[str], block_hashes: Sequence[bytes], hash_blocks: int) -> list[str]:
    """Endpoints by highest-random-weight for the prompt's seed block: the same order in every router.

    The seed is the chained hash of block `hash_blocks` (or the last full one), so it covers every
    block before it too. Adding or removing one endpoint only moves the keys that endpoint owned.
    """
    names = list(names)
    weights = _weights(_seed(block_hashes, hash_blocks), names)
    return [n for _, n in sorted(zip(weights, names, strict=True), key=lambda wn: wn[0], reverse=True)]

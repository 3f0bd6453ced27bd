"""The spill rule and the load cap, on the pure Picker (and the slots RouterState learns from scrapes).

A request's home is where affinity sends it; a spill moves it off when the home is over the cap or it
would queue there while another replica would run it at once, and the spill goes to the next-best cached
prefix (else the next replica in the prompt's rendezvous ranking), not simply to the idlest replica.
"""

from __future__ import annotations

import math
import random
import time

from kvpilot.block_hash import hash_prompt_blocks
from kvpilot.router.endpoints import Endpoint, EndpointSet
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.picker import EndpointLoad, Picker, PickerConfig, rendezvous_rank
from kvpilot.router.prefix_index import PrefixIndex
from kvpilot.router.prompt import ByteTokenizer, PromptHasher
from kvpilot.router.state import RouteKey, RouterState
from kvpilot.router.upstream_metrics import LoadScraper, Sample

NAMES = ["a", "b", "c", "d"]
H = hash_prompt_blocks([7] * 3 + list(range(4 * 16 - 3)), 16)  # one tenant's prompt, 4 blocks
RANK = rendezvous_rank(NAMES, H, 1)  # its hash ranking: RANK[0] is its home without a cache


def load(name: str, running: float = 0, waiting: float = 0, kv: float = 0.0, inflight: int = 0) -> EndpointLoad:
    return EndpointLoad(name, inflight=inflight, running=running, waiting=waiting, kv_usage=kv)


def test_a_queue_at_home_spills_to_the_next_best_cached_prefix_not_the_idlest():
    home, holder, idle1, idle2 = RANK[0], RANK[2], RANK[1], RANK[3]
    cached = {home: 4, holder: 2}
    # home is under the cap (sum 8, cap ceil(2 * 9 / 4) = 5, home at 4) but one request already waits there
    loads = [load(home, running=3, waiting=1), load(holder, running=2), load(idle1, running=1), load(idle2, running=1)]
    d = Picker().pick(loads, H, cached)
    assert d is not None and (d.endpoint, d.reason, d.hit_blocks) == (holder, "spill", 2)
    # no queue at home: affinity holds
    loads[0] = load(home, running=4)
    d = Picker().pick(loads, H, cached)
    assert d is not None and (d.endpoint, d.reason) == (home, "prefix")
    # ... unless home already runs as many as a replica runs at once (learned or configured slots)
    for p, slots in ((Picker(), 4.0), (Picker(PickerConfig(slots=4)), None)):
        d = p.pick(loads, H, cached, slots=slots)
        assert d is not None and (d.endpoint, d.reason) == (holder, "spill")


def test_with_no_other_holder_the_spill_follows_the_rendezvous_ranking_and_routers_agree():
    loads = [load(RANK[0], running=4, waiting=2), load(RANK[1], running=2), load(RANK[2]), load(RANK[3])]
    for order in (loads, loads[::-1]):  # another router may list the replicas in another order
        d = Picker(PickerConfig(load_cap=10)).pick(order, H, {RANK[0]: 4})
        # RANK[1] is busier than RANK[2] and RANK[3], but it is the tenant's second home in every router
        assert d is not None and (d.endpoint, d.reason, d.hit_blocks) == (RANK[1], "spill", 0)


def test_no_spill_when_every_replica_would_queue():
    loads = [load(n, running=4, waiting=1 if n == RANK[0] else 0) for n in NAMES]
    d = Picker().pick(loads, H, {RANK[0]: 4}, slots=4)
    assert d is not None and (d.endpoint, d.reason) == (RANK[0], "prefix")  # moving would only lose the cache


def test_a_spill_prefers_a_replica_with_room_over_a_longer_prefix_that_queues():
    loads = [load(RANK[0], running=4, waiting=3), load(RANK[1], running=4, waiting=1), load(RANK[2], running=1),
             load(RANK[3], running=1)]
    d = Picker(PickerConfig(load_cap=10)).pick(loads, H, {RANK[0]: 4, RANK[1]: 3})
    assert d is not None and (d.endpoint, d.reason) == (RANK[2], "spill")


def test_equal_prefixes_go_to_the_cheaper_holder():
    loads = [load(RANK[0], running=3), load(RANK[1], running=1), load(RANK[2]), load(RANK[3])]
    d = Picker(PickerConfig(load_cap=10)).pick(loads, H, {RANK[0]: 4, RANK[1]: 4})  # both under the cap
    assert d is not None and (d.endpoint, d.reason, d.hit_blocks) == (RANK[1], "prefix", 4)


def test_a_waiting_request_weighs_more_than_kv_usage():
    # equal load (3 requests each); a has the emptier cache but one of its requests waits
    loads = [load("a", running=2, waiting=1, kv=0.1), load("b", running=3, kv=0.9)]
    d = Picker(PickerConfig(prefix=False)).pick(loads)
    assert d is not None and (d.endpoint, d.reason) == ("b", "load")
    assert Picker().cost(loads[0]) > Picker().cost(loads[1])
    # the weights are settings: with queue_weight 0 the KV usage decides
    d = Picker(PickerConfig(prefix=False, queue_weight=0)).pick(loads)
    assert d is not None and d.endpoint == "a"


def test_a_hot_tenant_spreads_over_two_replicas_and_nothing_waits():
    """A tenant needs ~4 slots, a replica has 2: the prefix becomes cached on a second replica (its
    rendezvous runner-up) and the requests alternate between the two; the other replicas get none."""
    picker, index, slots, duration = Picker(PickerConfig(slots=2, load_cap=3.0)), PrefixIndex(), 2, 4
    running: dict[str, list[int]] = {n: [] for n in NAMES}  # replica -> steps its requests end at
    served = dict.fromkeys(NAMES, 0)
    reasons: dict[str, int] = {}
    for step in range(200):
        for n in NAMES:
            running[n] = [end for end in running[n] if end > step]
        loads = [load(n, running=min(len(r), slots), waiting=max(0, len(r) - slots), inflight=len(r))
                 for n, r in running.items()]
        assert all(e.waiting == 0 for e in loads)  # no request ever waited for a slot
        d = picker.pick(loads, H, index.match(H, NAMES))
        assert d is not None
        running[d.endpoint].append(step + duration)
        served[d.endpoint] += 1
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
        index.record(H, d.endpoint)
    assert set(index.match(H, NAMES)) == {RANK[0], RANK[1]}
    assert served[RANK[0]] >= 80 and served[RANK[1]] >= 80 and served[RANK[2]] == served[RANK[3]] == 0
    assert reasons["spill"] == 1  # once the second replica holds the prefix, both are homes


def _eligible(loads: list[EndpointLoad], load_cap: float, kv_full: float) -> set[str]:
    """The cap, computed here from its definition (not the picker's code): after taking one more request,
    a replica may hold at most (1 + load_cap) times the mean, rounded up."""
    cap = math.ceil((1 + load_cap) * (sum(e.load for e in loads) + 1) / len(loads))
    return {e.name for e in loads if e.load + 1 <= cap and (e.kv_usage or 0.0) < kv_full}


def _random_loads(rng: random.Random, names: list[str]) -> list[EndpointLoad]:
    out = []
    for n in names:
        scraped = rng.random() < 0.8
        out.append(EndpointLoad(n, inflight=rng.randint(0, 12),
                                running=rng.randint(0, 8) if scraped else None,
                                waiting=rng.choice([0, 0, 1, 3, 9]) if scraped else None,
                                kv_usage=rng.choice([0.0, 0.5, 0.9, 0.97, 1.0]) if scraped else None))
    return out


def test_no_choice_pushes_a_replica_past_the_cap_while_another_is_under_it():
    rng = random.Random(1)
    fallbacks = spills = 0
    for _ in range(3000):
        names = NAMES[: rng.randint(2, 4)] + ["e", "f"][: rng.randint(0, 2)]
        cfg = PickerConfig(load_cap=rng.choice([0.0, 0.25, 1.0]), session=rng.random() < 0.3,
                           slots=rng.choice([None, 2, 4]))
        loads = _random_loads(rng, names)
        cached = {n: rng.randint(1, 4) for n in names if rng.random() < 0.4}
        d = Picker(cfg).pick(loads, H, cached, session_endpoint=rng.choice([None, *names]),
                             slots=rng.choice([None, 3.0]))
        assert d is not None
        ok = _eligible(loads, cfg.load_cap, cfg.kv_full)
        if ok:
            assert d.endpoint in ok, (loads, cached, d)
        else:
            assert d.reason == "fallback"
            fallbacks += 1
        spills += d.reason == "spill"
    assert fallbacks > 50 and spills > 300  # both paths were exercised


def test_a_hot_prefix_under_queues_never_passes_the_cap():
    # every request has the same prefix and none finishes: the load only grows, spills and all
    p, index, inflight = Picker(PickerConfig(load_cap=0.25, slots=3)), PrefixIndex(), dict.fromkeys(NAMES, 0)
    for _ in range(200):
        loads = [load(n, running=min(i, 3), waiting=max(0, i - 3), inflight=i) for n, i in inflight.items()]
        d = p.pick(loads, H, index.match(H, NAMES))
        assert d is not None
        inflight[d.endpoint] += 1
        index.record(H, d.endpoint)
        mean = sum(inflight.values()) / len(NAMES)
        assert max(inflight.values()) <= math.ceil(1.25 * mean)


def test_state_learns_slots_from_replicas_that_queue():
    eps = EndpointSet()
    eps.replace([Endpoint(n, f"http://127.0.0.{i + 2}:1") for i, n in enumerate(NAMES)])
    scraper = LoadScraper(eps, session=None)  # type: ignore[arg-type]  # never scrapes here
    # a cap this high never binds here: only the queue can move a request
    state = RouterState(eps, Picker(PickerConfig(load_cap=10)), PromptHasher(ByteTokenizer()), RouterMetrics(),
                        scraper)
    now = time.monotonic()
    scraper.samples = {"a": Sample(0.2, waiting=0, running=6, at=now), "b": Sample(0.2, waiting=2, running=3, at=now)}
    state.loads()
    assert state.slots == 3  # b queues at 3 running; a running 6 with no queue says nothing about the limit
    scraper.samples["c"] = Sample(0.2, waiting=1, running=4, at=now)
    state.loads()
    assert state.slots == 4
    # a replica running 4 would queue its next request: a new prompt whose home it is spills
    state.inflight = {"a": 0, "b": 0, "c": 0, "d": 0}
    scraper.samples = {n: Sample(0.1, waiting=0, running=4 if n == RANK[0] else 0, at=now) for n in NAMES}
    chosen = state.choose(RouteKey(H, 64), set())
    assert chosen is not None and (chosen[0].name, chosen[1].reason) == (RANK[1], "spill")


def test_a_queue_every_replica_has_spills_to_another_holder_once_the_home_passes_the_mean_by_the_margin():
    """All replicas run all their slots, so none would start the request at once: the home keeps it until
    its queue is `spill_margin` above the mean, then it spills to a replica holding part of the prompt (a
    cheap prefill there), never to one without any of it (a whole prefill, and one tenant more there)."""
    home, holder = RANK[0], RANK[2]

    def loads(home_waiting: float) -> list[EndpointLoad]:
        return [load(n, running=4, waiting=home_waiting if n == home else 0) for n in NAMES]

    p = Picker(PickerConfig(load_cap=10))
    # the mean is waiting / 4, so the home's excess is 3/4 of its queue; the margin is 2
    for waiting, to in ((0, home), (2, home), (3, holder), (20, holder)):
        d = p.pick(loads(waiting), H, {home: 4, holder: 2}, slots=4)
        assert d is not None and (d.endpoint, d.reason) == (to, "prefix" if to == home else "spill"), (waiting, d)
        d = p.pick(loads(waiting), H, {home: 4}, slots=4)
        assert d is not None and (d.endpoint, d.reason) == (home, "prefix"), (waiting, d)  # no other holder
    # a wider margin holds the tenant longer; an infinite one is the rule off
    d = Picker(PickerConfig(load_cap=10, spill_margin=3)).pick(loads(4), H, {home: 4, holder: 2}, slots=4)
    assert d is not None and d.endpoint == home  # an excess of 3 is not above 3
    d = Picker(PickerConfig(load_cap=10, spill_margin=math.inf)).pick(loads(20), H, {home: 4, holder: 2}, slots=4)
    assert d is not None and (d.endpoint, d.reason) == (home, "prefix")


def test_the_queue_counts_our_fresh_requests_beyond_the_slots_before_the_scrape_shows_them():
    # no scrape yet (or a stale one): 7 of ours at the home with 4 slots is a queue of 3, 2.25 above the mean
    loads = [EndpointLoad(RANK[0], inflight=7)] + [EndpointLoad(n, inflight=4) for n in RANK[1:]]
    cached = {RANK[0]: 4, RANK[2]: 1}
    d = Picker(PickerConfig(load_cap=10)).pick(loads, H, cached, slots=4)
    assert d is not None and (d.endpoint, d.reason) == (RANK[2], "spill")
    # without slots known only a scraped queue counts: this home stays
    d = Picker(PickerConfig(load_cap=10)).pick(loads, H, cached)
    assert d is not None and d.endpoint == RANK[0]


def test_kv_usage_far_above_the_mean_spills_and_moderate_usage_does_not():
    home, holder = RANK[0], RANK[3]
    for kv, spills in ((0.3, False), (0.6, False), (0.7, True), (0.9, True)):  # over kv / 4 + 0.5 from 2/3 on
        loads = [load(n, running=1, kv=kv if n == home else 0.0) for n in NAMES]
        d = Picker(PickerConfig(load_cap=10)).pick(loads, H, {home: 4, holder: 1})
        assert d is not None and (d.endpoint, d.reason) == ((holder, "spill") if spills else (home, "prefix")), kv


def test_a_spill_never_goes_to_a_replica_over_the_mean_even_one_holding_more_of_the_prefix():
    # queues 9, 6, 0, 0: mean 3.75, so both the home and the longer holder are over it by 2
    home, holder, short = RANK[0], RANK[1], RANK[2]
    loads = [load(home, running=4, waiting=9), load(holder, running=4, waiting=6), load(short, running=4),
             load(RANK[3], running=4)]
    cached = {home: 4, holder: 3, short: 1}
    d = Picker(PickerConfig(load_cap=10)).pick(loads, H, cached, slots=4)
    assert d is not None and (d.endpoint, d.reason, d.hit_blocks) == (short, "spill", 1)
    # with the longer holder under it, it is the better target: it has more of the prompt
    loads[1] = load(holder, running=4, waiting=1)
    d = Picker(PickerConfig(load_cap=10)).pick(loads, H, cached, slots=4)
    assert d is not None and (d.endpoint, d.reason, d.hit_blocks) == (holder, "spill", 3)
    # no holder under it: the home keeps the request
    del cached[short]
    loads[1] = load(holder, running=4, waiting=6)
    d = Picker(PickerConfig(load_cap=10)).pick(loads, H, cached, slots=4)
    assert d is not None and (d.endpoint, d.reason) == (home, "prefix")


def test_spill_margins_are_validated():
    for bad in ({"spill_margin": -1}, {"spill_kv_margin": -0.1}, {"spill_margin": math.nan}):
        try:
            PickerConfig(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")

"""Pure routing decisions: the picker, the prefix index, prompt hashing, endpoint parsing. No I/O."""

from __future__ import annotations

import collections

import pytest

from kvpilot.block_hash import hash_prompt_blocks
from kvpilot.router.endpoints import Endpoint, parse_static, slice_endpoints
from kvpilot.router.picker import EndpointLoad, Picker, PickerConfig, rendezvous_rank
from kvpilot.router.prefix_index import PrefixIndex
from kvpilot.router.prompt import ByteTokenizer, PromptHasher
from kvpilot.router.state import SessionTable

NAMES = ["a", "b", "c", "d"]


def idle(names=NAMES) -> list[EndpointLoad]:
    return [EndpointLoad(n) for n in names]


def hashes(seed: int, blocks: int = 4) -> list[bytes]:
    return hash_prompt_blocks([seed] * 3 + list(range(blocks * 16 - 3)), 16)


def test_rendezvous_is_stable_and_spreads():
    owners = collections.Counter(rendezvous_rank(NAMES, hashes(s), 1)[0] for s in range(400))
    assert set(owners) == set(NAMES)
    assert min(owners.values()) > 60  # roughly 100 each
    # the order does not depend on the order endpoints are listed in (another router may list differently)
    for s in range(20):
        assert rendezvous_rank(NAMES, hashes(s), 1) == rendezvous_rank(NAMES[::-1], hashes(s), 1)


def test_rendezvous_removing_an_endpoint_moves_only_its_keys():
    before = {s: rendezvous_rank(NAMES, hashes(s), 1)[0] for s in range(200)}
    after = {s: rendezvous_rank(NAMES[:3], hashes(s), 1)[0] for s in range(200)}
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s in before if before[s] == "d"}


def test_new_prefix_goes_to_its_hash_owner_and_two_pickers_agree():
    h = hashes(7)
    d1 = Picker().pick(idle(), h)
    d2 = Picker().pick(idle()[::-1], h)
    assert d1 is not None and d2 is not None
    assert d1.endpoint == d2.endpoint == rendezvous_rank(NAMES, h, 1)[0]
    assert d1.reason == "hash"


def test_longest_cached_prefix_wins_over_hash_owner():
    h = hashes(7)
    owner = rendezvous_rank(NAMES, h, 1)[0]
    other = next(n for n in NAMES if n != owner)
    d = Picker().pick(idle(), h, cached={owner: 1, other: 3})
    assert d is not None and (d.endpoint, d.reason, d.hit_blocks) == (other, "prefix", 3)


def test_load_cap_stops_affinity_and_spill_follows_the_hash_ranking():
    h = hashes(7)
    rank = rendezvous_rank(NAMES, h, 1)
    loads = [EndpointLoad(n, inflight=10 if n == rank[0] else 1) for n in NAMES]
    # mean is (13+1)/4 = 3.5; cap ceil(2*3.5)=7: the owner (10) is over it, the prefix holder too
    d = Picker().pick(loads, h, cached={rank[0]: 4})
    assert d is not None and d.endpoint == rank[1] and d.reason == "spill"
    # a large cap lets affinity win again
    d = Picker(PickerConfig(load_cap=10.0)).pick(loads, h, cached={rank[0]: 4})
    assert d is not None and d.endpoint == rank[0] and d.reason == "prefix"


def test_cap_never_exceeds_share_above_mean_under_a_hot_prefix():
    p = Picker(PickerConfig(load_cap=0.25))
    inflight = dict.fromkeys(NAMES, 0)
    h = hashes(1)  # every request has the same prefix
    for _ in range(200):
        d = p.pick([EndpointLoad(n, inflight[n]) for n in NAMES], h, cached={rendezvous_rank(NAMES, h, 1)[0]: 4})
        assert d is not None
        inflight[d.endpoint] += 1
        mean = sum(inflight.values()) / len(NAMES)
        assert max(inflight.values()) <= max(1.25 * mean + 1, 1)


def test_full_kv_cache_is_no_affinity_target():
    h = hashes(3)
    owner = rendezvous_rank(NAMES, h, 1)[0]
    loads = [EndpointLoad(n, kv_usage=0.97 if n == owner else 0.1) for n in NAMES]
    d = Picker().pick(loads, h, cached={owner: 4})
    assert d is not None and d.endpoint != owner


def test_scraped_queue_counts_and_is_not_added_to_our_own():
    assert EndpointLoad("a", inflight=3, running=2, waiting=0).load == 3
    assert EndpointLoad("a", inflight=1, running=4, waiting=5).load == 9
    loads = [EndpointLoad("a", running=8, waiting=4), EndpointLoad("b", running=1)]
    d = Picker(PickerConfig(prefix=False)).pick(loads)
    assert d is not None and (d.endpoint, d.reason) == ("b", "load")


def test_load_off_ignores_scrapes_and_the_cap():
    h = hashes(5)
    owner = rendezvous_rank(["a", "b"], h, 1)[0]
    loads = [EndpointLoad(n, inflight=0, running=50.0 if n == owner else 0.0, kv_usage=0.99) for n in "ab"]
    d = Picker(PickerConfig(load=False)).pick(loads, h)
    assert d is not None and d.endpoint == owner


def test_prefix_off_is_least_loaded():
    loads = [EndpointLoad("a", inflight=2), EndpointLoad("b", inflight=0), EndpointLoad("c", inflight=1)]
    d = Picker(PickerConfig(prefix=False)).pick(loads, hashes(1), cached={"a": 4})
    assert d is not None and (d.endpoint, d.reason) == ("b", "load")


def test_session_then_exclude_then_nothing_left():
    p = Picker(PickerConfig(session=True))
    d = p.pick(idle(), hashes(2), session_endpoint="c")
    assert d is not None and (d.endpoint, d.reason) == ("c", "session")
    d = p.pick(idle(), hashes(2), session_endpoint="c", exclude={"c"})
    assert d is not None and d.endpoint != "c"
    assert p.pick(idle(), hashes(2), exclude=set(NAMES)) is None
    assert p.pick([], hashes(2)) is None


def test_everyone_over_cap_is_a_fallback_not_a_refusal():
    loads = [EndpointLoad(n, kv_usage=0.99) for n in NAMES]
    d = Picker().pick(loads, hashes(2))
    assert d is not None and d.reason == "fallback"


def test_config_is_validated():
    with pytest.raises(ValueError):
        PickerConfig(load_cap=-1)
    with pytest.raises(ValueError):
        PickerConfig(kv_full=0)
    with pytest.raises(ValueError):
        PickerConfig(hash_blocks=0)


def test_prefix_index_longest_match_per_endpoint():
    idx = PrefixIndex(capacity=100)
    h = hashes(1, blocks=6)
    idx.record(h[:2], "a")
    idx.record(h[:5], "b")
    idx.record(hashes(2, blocks=3), "c")
    assert idx.match(h) == {"a": 2, "b": 5}
    assert idx.match(h, endpoints=["a", "c"]) == {"a": 2}
    assert idx.match(hashes(9)) == {}


def test_prefix_index_is_bounded_lru_and_forgets_endpoints():
    idx = PrefixIndex(capacity=8)
    old, new = hashes(1, blocks=4), hashes(2, blocks=4)
    idx.record(old, "a")
    idx.record(new, "b")
    idx.record(old[:1], "a")  # touch: the first block of `old` is now the most recent
    idx.record(hashes(3, blocks=2), "c")
    assert len(idx) == 8
    assert idx.match(old) == {"a": 1}  # its later blocks were evicted first
    assert idx.forget("b") == 4 and idx.match(new) == {}


def test_prompt_hasher_matches_the_engine_function_and_shares_prefixes():
    hasher = PromptHasher(ByteTokenizer(), block_size=16)
    sys = {"role": "system", "content": "You are a careful assistant. " * 4}
    one = {"model": "m", "messages": [sys, {"role": "user", "content": "What is 2+2?"}]}
    two = {"model": "m", "messages": [sys, {"role": "user", "content": "Name a colour."}]}
    ids1 = hasher.token_ids("/v1/chat/completions", one)
    ids2 = hasher.token_ids("/v1/chat/completions", two)
    assert ids1 is not None and ids2 is not None
    h1, h2 = hasher.hashes(ids1), hasher.hashes(ids2)
    assert h1 == hash_prompt_blocks(ids1, 16)
    shared = next(i for i, (x, y) in enumerate(zip(h1, h2, strict=False)) if x != y)
    assert shared >= 6  # the system prompt's blocks are common
    assert hasher.token_ids("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert hasher.token_ids("/v1/completions", {"prompt": ["ab", "cd"]}) == [97, 98]
    assert hasher.token_ids("/v1/chat/completions", {"messages": "nope"}) is None  # the daemon will say why
    assert hasher.token_ids("/v1/models", {}) is None


def test_session_table_is_bounded():
    t = SessionTable(2)
    t.put("u1", "a")
    t.put("u2", "b")
    assert t.get("u1") == "a"
    t.put("u3", "c")  # u2 was least recently used
    assert (t.get("u2"), t.get("u1"), t.get("u3")) == (None, "a", "c")
    t.forget("a")
    assert t.get("u1") is None


def test_parse_static():
    assert parse_static("http://127.0.0.1:8001, 127.0.0.2:8002") == [
        Endpoint("127.0.0.1:8001", "http://127.0.0.1:8001"), Endpoint("127.0.0.2:8002", "http://127.0.0.2:8002")]
    with pytest.raises(ValueError):
        parse_static("http://nohost")


def test_slice_endpoints_ready_only_and_named_port():
    s = {"addressType": "IPv4", "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
         "endpoints": [
             {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": "p1"}},
             {"addresses": ["10.0.0.2"], "conditions": {"ready": False}, "targetRef": {"kind": "Pod", "name": "p2"}},
             {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
             {"addresses": ["10.0.0.4"], "conditions": {}},  # unknown: treated as ready
         ]}
    assert slice_endpoints(s, "http") == [Endpoint("p1", "http://10.0.0.1:8000"),
                                          Endpoint("10.0.0.4:8000", "http://10.0.0.4:8000")]
    assert [e.url for e in slice_endpoints(s, None)] == ["http://10.0.0.1:9000", "http://10.0.0.4:9000"]
    assert slice_endpoints(s, "grpc") == []
    assert slice_endpoints({**s, "addressType": "FQDN"}, "http") == []


async def test_route_key_session_sources():
    from kvpilot.router.endpoints import EndpointSet
    from kvpilot.router.metrics import RouterMetrics
    from kvpilot.router.state import RouterState

    def state(source: str | None, session: bool = True) -> RouterState:
        return RouterState(EndpointSet(), Picker(PickerConfig(session=session)), PromptHasher(ByteTokenizer()),
                           RouterMetrics(), session_source=source)

    body = {"messages": [{"role": "user", "content": "hi " * 20}], "user": "alice"}
    assert (await state("user").route_key("/v1/chat/completions", body, {})).session == "alice"
    key = await state("header:X-Chat").route_key("/v1/chat/completions", body, {"X-Chat": "c-9"})
    assert key.session == "c-9" and key.hashes and key.prompt_tokens > 16 and key.tokenized == "inline"
    assert (await state("user", session=False).route_key("/v1/chat/completions", body, {})).session is None


# --- speed without behaviour change: pick_many, the rendezvous weight cache, the index's match ----------------

def _random_loads(rng, names) -> list[EndpointLoad]:
    # running is sometimes fractional (an averaged scrape): pick_many then sums the cap as pick does
    return [EndpointLoad(n, rng.randrange(0, 6), rng.choice([None, float(rng.randrange(0, 6)), rng.random() * 5]),
                         rng.choice([None, 0.0, float(rng.randrange(0, 3))]), rng.choice([None, rng.random(), 0.97]))
            for n in names]


def test_pick_many_is_the_same_as_picking_one_after_another():
    import random
    from dataclasses import replace
    rng = random.Random(7)
    reasons = collections.Counter()
    for _ in range(400):
        names = [f"r{i}" for i in rng.sample(range(40), rng.randrange(1, 12))]
        cfg = PickerConfig(load=rng.random() < 0.8, load_cap=rng.choice([0.0, 0.25, 1.0]), session=rng.random() < 0.3)
        loads, exclude = _random_loads(rng, names), set(rng.sample(names, rng.randrange(0, len(names))))
        n, weight = rng.randrange(0, 25), rng.choice([0, 1, 3])
        one, many = Picker(cfg), Picker(cfg)
        expected, cur = [], loads
        for _ in range(n):
            d = one.pick(cur, exclude=exclude)
            if d is None:
                break
            expected.append((d.endpoint, d.reason))
            cur = [replace(e, inflight=e.inflight + weight) if e.name == d.endpoint else e for e in cur]
        got = [(d.endpoint, d.reason) for d in many.pick_many(loads, n, weight=weight, exclude=exclude)]
        assert got == expected, (cfg, loads, n, weight, exclude)
        reasons.update(r for _, r in got)
    assert reasons["load"] > 100 and reasons["fallback"] > 10  # both paths were exercised


def test_rendezvous_weight_cache_changes_no_decision():
    import random
    rng = random.Random(3)
    warm = Picker()
    names = [f"10.0.0.{i}:8000" for i in range(60)]
    for i in range(300):
        h = hashes(i % 7, blocks=rng.randrange(1, 5))  # seven tenants: the cache is hit most of the time
        live = rng.sample(names, rng.randrange(1, 60))  # replicas come and go between picks
        loads = _random_loads(rng, live)
        cached = {n: rng.randrange(1, 4) for n in live if rng.random() < 0.2}
        a, b = warm.pick(loads, h, cached, slots=4.0), Picker().pick(loads, h, cached, slots=4.0)
        assert a == b
        assert Picker(PickerConfig(load=False)).pick(idle(live), h).endpoint == rendezvous_rank(live, h, 1)[0]
    assert len(warm._weights) == 7


def _reference_match(blocks: dict, block_hashes, endpoints=None) -> dict[str, int]:
    """The index's contract spelled out: each endpoint's hit length is the first block it does not hold."""
    out = {}
    for name in {n for holders in blocks.values() for n in holders}:
        if endpoints is not None and name not in endpoints:
            continue
        depth = 0
        while depth < len(block_hashes) and name in blocks.get(block_hashes[depth], ()):
            depth += 1
        if depth:
            out[name] = depth
    return out


def test_prefix_index_match_agrees_with_its_contract_under_eviction_and_forgetting():
    import random
    rng = random.Random(11)
    for _ in range(60):
        idx = PrefixIndex(capacity=rng.choice([6, 30, 1000]))
        names = [f"e{i}" for i in range(rng.randrange(1, 10))]
        prompts = [hashes(rng.randrange(3), blocks=rng.randrange(1, 8)) for _ in range(10)]
        for _ in range(80):
            p = rng.choice(prompts)
            if rng.random() < 0.5:
                idx.record(p[:rng.randrange(0, len(p) + 1)], rng.choice(names))
            elif rng.random() < 0.1:
                idx.forget(rng.choice(names))
            else:
                alive = rng.sample(names, rng.randrange(0, len(names) + 1)) if rng.random() < 0.5 else None
                assert idx.match(p, alive) == _reference_match(idx._blocks, p, alive)

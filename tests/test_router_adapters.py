"""LoRA adapter affinity without I/O: what the replicas report (/v1/models, vllm:lora_requests_info), where
an adapter can run (router/adapters.py), the picker's choice among those replicas, and the router state
that joins them."""

from __future__ import annotations

import time

import pytest

from kvpilot.block_hash import hash_prompt_blocks
from kvpilot.router.adapters import LoraInfo, ReplicaModels, adapter_targets, parse_lora_info, parse_models
from kvpilot.router.endpoints import Endpoint, EndpointSet
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.models_poll import ModelsPoller
from kvpilot.router.picker import AdapterTargets, EndpointLoad, Picker, PickerConfig, rendezvous_rank
from kvpilot.router.prompt import ByteTokenizer, PromptHasher
from kvpilot.router.state import RouteKey, RouterState
from kvpilot.router.upstream_metrics import LoadScraper, Sample

NAMES = ["a", "b", "c", "d"]
H = hash_prompt_blocks([5] * 3 + list(range(4 * 16 - 3)), 16)


def load(name: str, running: float = 0, waiting: float = 0, kv: float = 0.0, inflight: int = 0) -> EndpointLoad:
    return EndpointLoad(name, inflight=inflight, running=running, waiting=waiting, kv_usage=kv)


def idle() -> list[EndpointLoad]:
    return [load(n) for n in NAMES]


def sql(listed: str = "abc", hot: str = "", full: str = "") -> AdapterTargets:
    return AdapterTargets("sql", frozenset(listed), frozenset(hot), frozenset(full))


# ---- what the replicas report -------------------------------------------------------------------------


def test_models_list_tells_adapters_by_their_parent():
    body = {"object": "list", "data": [
        {"id": "base", "object": "model", "root": "/models/base", "parent": None},
        {"id": "sql", "object": "model", "root": "/adapters/sql", "parent": "base"},
        {"id": "chat", "object": "model", "parent": "base"},
        {"id": "alias", "object": "model"},  # no parent key at all: a base name too
        {"object": "model", "parent": "base"}, "junk", {"id": ""}]}  # unnamed entries are skipped
    m = parse_models(body)
    assert m == ReplicaModels(frozenset({"base", "alias"}), frozenset({"sql", "chat"}))
    for bad in ({"data": "x"}, [], None, {"object": "list"}):
        with pytest.raises(ValueError):
            parse_models(bad)


PAGE = """# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="base"} 2.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql, chat",waiting_lora_adapters="math"} 1.8e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="older",waiting_lora_adapters=""} 1.6e9
"""


def test_lora_metric_newest_label_set_is_the_current_one():
    info = parse_lora_info(PAGE)
    assert info == LoraInfo(2, frozenset({"sql", "chat"}), frozenset({"math"}))
    assert info.hot == {"sql", "chat", "math"}
    # the daemon's shape with no adapter anywhere; a page without the series; a malformed line
    empty = 'vllm:lora_requests_info{max_lora="0",waiting_lora_adapters="",running_lora_adapters=""} 1.7e9\n'
    assert parse_lora_info(empty) == LoraInfo(0, frozenset(), frozenset())
    assert parse_lora_info('vllm:num_requests_waiting{model_name="base"} 2.0\n') is None
    assert parse_lora_info('vllm:lora_requests_info{max_lora="1",running_lora_adapters="x" 1\n') is None


def test_adapter_targets_from_lists_slots_and_our_requests():
    lists = {"a": ReplicaModels(frozenset({"base"}), frozenset({"sql", "chat"})),
             "b": ReplicaModels(frozenset({"base"}), frozenset({"sql"})),
             "c": ReplicaModels(frozenset({"base"}))}
    lora = {"a": LoraInfo(1, frozenset({"chat"})),  # its one slot holds another adapter
            "b": LoraInfo(2, frozenset(), frozenset({"sql"})),  # sql waits there: hot
            "c": LoraInfo(1, frozenset({"x"}))}
    t = adapter_targets("sql", lists, lora, {"c": {"sql": 1}})
    # c lists no sql, but a request of ours for it runs there (a list polled before it was loaded)
    assert t == AdapterTargets("sql", frozenset("ab"), frozenset("bc"), frozenset("a"))
    assert t is not None and t.serving == {"a", "b", "c"}
    assert adapter_targets("base", lists, lora, {}) is None  # the base model: no adapter routing
    assert adapter_targets(None, lists, lora, {}) is None
    assert adapter_targets("sql", {}, lora, {}) is None  # no list known yet: an adapter looks like an alias
    nope = adapter_targets("nope", lists, lora, {})  # listed nowhere: targets, but no replica serves it
    assert nope is not None and nope.name == "nope" and not nope.serving


# ---- the picker ---------------------------------------------------------------------------------------


def test_a_hot_replica_is_preferred_over_idler_cold_ones_and_unlisted_ones_never_serve():
    rank = rendezvous_rank("abc", H, 1)
    hot = rank[2]  # the last in the hash ranking: only the adapter puts it first
    # the hot replica is the busiest (under the load cap); d is idle but lists no sql
    loads = [load(n, running=1 if n == hot else 0) for n in NAMES]
    d = Picker().pick(loads, H, adapter=sql(hot=hot))
    assert d is not None and (d.endpoint, d.reason, d.adapter) == (hot, "hash", "hit")
    # two hot replicas: the prefix cached on one decides between them
    other = rank[1]
    d = Picker().pick(loads, H, cached={other: 3, "d": 4}, adapter=sql(hot=hot + other))
    assert d is not None and (d.endpoint, d.reason, d.hit_blocks, d.adapter) == (other, "prefix", 3, "hit")
    for _ in range(20):  # whatever the load elsewhere, d (not listing it) never gets the adapter
        d = Picker().pick([load("a", running=3), load("b", running=3), load("c", running=3), load("d")], H,
                          adapter=sql(hot="a"))
        assert d is not None and d.endpoint != "d"


def test_an_adapter_hot_nowhere_goes_to_the_least_loaded_replica_that_lists_it():
    loads = [load("a", running=3), load("b", running=1), load("c", running=2), load("d")]
    d = Picker().pick(loads, H, adapter=sql())
    assert d is not None and (d.endpoint, d.reason, d.adapter) == ("b", "load", "cold")
    # b's adapter slots all hold other adapters: the request would wait there for one, c loads it at once
    d = Picker().pick(loads, H, adapter=sql(full="b"))
    assert d is not None and (d.endpoint, d.adapter) == ("c", "cold")
    # with a prefix cached somewhere (another adapter's requests: the router keys adapters apart, so it
    # would not be), the load still decides
    d = Picker().pick(loads, H, cached={"a": 4}, adapter=sql())
    assert d is not None and d.endpoint == "b"


def test_a_queue_on_the_hot_replica_spills_to_another_hot_one_then_to_one_that_lists_it():
    loads = [load("a", running=4, waiting=2), load("b", running=3), load("c", running=1), load("d")]
    d = Picker().pick(loads, H, adapter=sql(hot="ab"), slots=4)  # b is hot too and runs it at once
    assert d is not None and (d.endpoint, d.adapter) == ("b", "hit")
    # a alone is hot: b or c, whichever the prompt's hash ranks first (every router's choice), not d
    d = Picker().pick(loads, H, adapter=sql(hot="a"), slots=4)
    first = next(n for n in rendezvous_rank(NAMES, H, 1) if n in "bc")
    assert d is not None and (d.endpoint, d.reason, d.adapter) == (first, "spill", "spill")
    # no queue at the hot replica: the adapter stays there although others are idle
    loads[0] = load("a", running=2)
    d = Picker().pick(loads, H, adapter=sql(hot="a"), slots=4)
    assert d is not None and (d.endpoint, d.adapter) == ("a", "hit")


def test_an_adapter_listed_nowhere_routes_as_any_request_and_is_counted_so():
    p = Picker()
    base = p.pick(idle(), H)
    d = p.pick(idle(), H, adapter=AdapterTargets("nope"))
    assert base is not None and d is not None
    assert (d.endpoint, d.reason, d.adapter) == (base.endpoint, base.reason, "unlisted")
    # adapter affinity off: the targets are ignored, as if the model were the base
    d = Picker(PickerConfig(adapter=False)).pick(idle(), H, adapter=sql(listed="d"))
    assert d is not None and (d.endpoint, d.adapter) == (base.endpoint, "")
    # every replica that lists it has been tried: nothing is left (a 404 elsewhere would help no one)
    assert p.pick(idle(), H, exclude={"a", "b", "c"}, adapter=sql()) is None


# ---- the state ----------------------------------------------------------------------------------------


def _state(models: dict[str, ReplicaModels], lora: dict[str, LoraInfo]) -> RouterState:
    eps = EndpointSet()
    eps.replace([Endpoint(n, f"http://127.0.0.{i + 2}:1") for i, n in enumerate(NAMES)])
    scraper = LoadScraper(eps, session=None)  # type: ignore[arg-type]  # never scrapes here
    poller = ModelsPoller(eps, session=None)  # type: ignore[arg-type]
    now = time.monotonic()
    scraper.samples = {n: Sample(0.1, waiting=0, running=1, at=now, lora=lora.get(n)) for n in NAMES}
    poller.lists = {n: (m, now) for n, m in models.items()}
    return RouterState(eps, Picker(), PromptHasher(ByteTokenizer()), RouterMetrics(), scraper, models=poller)


BASE = frozenset({"m"})


async def test_state_routes_an_adapter_to_its_hot_replica_and_tracks_its_own_requests():
    models = {n: ReplicaModels(BASE, frozenset({"sql"}) if n in "bc" else frozenset()) for n in NAMES}
    state = _state(models, {"c": LoraInfo(2, frozenset({"sql"}))})
    key = await state.route_key("/v1/completions", {"model": "sql", "prompt": "select 1 " * 20}, {})
    assert key.model == "sql"
    chosen = state.choose(key, set())
    assert chosen is not None and (chosen[0].name, chosen[1].adapter) == ("c", "hit")
    # c's scrape goes stale: hot nowhere, the cheapest lister (c, with no load known) loads it
    del state.scraper.samples["c"]  # type: ignore[union-attr]
    ep, d = state.choose(key, set()) or (None, None)
    assert ep is not None and d is not None and (ep.name, d.adapter) == ("c", "cold")
    # the request we dispatch there keeps c hot until it finishes, scrape or not
    state.dispatched(ep, d, key)
    assert state.adapter_targets("sql") == AdapterTargets("sql", frozenset("bc"), frozenset("c"))
    again = state.choose(key, set())
    assert again is not None and (again[0].name, again[1].adapter) == ("c", "hit")
    state.finished(ep, d, key)
    assert state.adapter_inflight == {} and state.inflight["c"] == 0
    assert state.adapter_targets("sql") == AdapterTargets("sql", frozenset("bc"))
    # the base model, and a name no list has
    base = await state.route_key("/v1/completions", {"model": "m", "prompt": "x"}, {})
    assert state.adapter_targets(base.model) is None
    nope = state.adapter_targets("nope")
    assert nope is not None and not nope.serving


async def test_an_adapters_prompt_is_keyed_apart_from_the_same_prompt_on_the_base():
    models = {n: ReplicaModels(BASE, frozenset({"sql", "chat"})) for n in NAMES}
    state = _state(models, {})
    body = {"prompt": "the same long prompt for everyone, " * 4}
    keys = {m: await state.route_key("/v1/completions", {**body, "model": m}, {}) for m in ("m", "sql", "chat")}
    # the base model's keys are the engine's own; each adapter's are its own
    assert keys["m"].hashes == hash_prompt_blocks(list(ByteTokenizer().encode(body["prompt"])), 16)
    firsts = {m: k.hashes[0] for m, k in keys.items()}
    assert len(set(firsts.values())) == 3
    # and a cache salt equal to the adapter's key text changes nothing: a salt is no adapter
    salted = await state.route_key("/v1/completions", {**body, "model": "m", "cache_salt": "lora:sql"}, {})
    assert salted.hashes[0] not in firsts.values()


def test_cooling_among_the_adapters_replicas_tries_them_rather_than_refuse():
    models = {n: ReplicaModels(BASE, frozenset({"sql"}) if n == "a" else frozenset()) for n in NAMES}
    state = _state(models, {})
    state.failed("a", 30.0)  # the only replica with the adapter refused a moment ago
    chosen = state.choose(RouteKey(H, 64, model="sql"), set())
    assert chosen is not None and chosen[0].name == "a"

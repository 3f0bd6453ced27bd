"""The router's live state around the pure Picker: endpoints, loads, the prefix index and sessions."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from .adapters import LoraInfo, adapter_targets
from .endpoints import Endpoint, EndpointSet
from .metrics import RouterMetrics
from .models_poll import ModelsPoller
from .picker import AdapterTargets, Decision, EndpointLoad, Picker
from .prefix_index import PrefixIndex
from .prompt import PromptHasher
from .tokenize_pool import TokenizePool
from .upstream_metrics import LoadScraper

SERVED = ("hit", "spill", "cold")  # the adapter outcomes of a request sent to a replica that serves it


@dataclass(frozen=True)
class RouteKey:
    """What one request routes by, computed once even when it is retried."""

    hashes: list[bytes] = field(default_factory=list)
    prompt_tokens: int = 0
    session: str | None = None
    tokenized: str = "none"  # where the prompt was encoded: none, inline, pool or shed (router/tokenize_pool.py)
    model: str | None = None  # the body's `model`: the base model, or a LoRA adapter


class SessionTable:
    """Bounded LRU: session key -> the endpoint that served it last."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str | None) -> str | None:
        if key is None or key not in self._map:
            return None
        self._map.move_to_end(key)
        return self._map[key]

    def put(self, key: str, endpoint: str) -> None:
        self._map[key] = endpoint
        self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        for k in [k for k, v in self._map.items() if v == endpoint]:
            del self._map[k]


class RouterState:
    def __init__(self, endpoints: EndpointSet, picker: Picker, hasher: PromptHasher, metrics: RouterMetrics,
                 scraper: LoadScraper | None = None, index_blocks: int = 200_000,
                 session_source: str | None = None, session_capacity: int = 100_000,
                 tokens: TokenizePool | None = None, models: ModelsPoller | None = None) -> None:
        self.endpoints = endpoints
        self.picker = picker
        self.hasher = hasher
        self.tokens = tokens if tokens is not None else TokenizePool(hasher, threads=0)
        self.metrics = metrics
        self.scraper = scraper
        self.models = models  # the replicas' /v1/models lists (None: adapter affinity off)
        self.index = PrefixIndex(index_blocks)
        self.session_source = session_source  # "user" or "header:<Name>" (None: off)
        self.sessions = SessionTable(session_capacity)
        self.inflight: dict[str, int] = {}
        # endpoint -> adapter -> our requests for it in flight there: the adapter is hot there now, which
        # the scrape tells only up to an interval later (a burst for a cold adapter would scatter meanwhile)
        self.adapter_inflight: dict[str, dict[str, int]] = {}
        self.cooldown: dict[str, float] = {}  # endpoint -> monotonic time it may be picked again
        # the most requests a replica was seen running while others waited there: how many it runs at
        # once (the replicas of one deployment are alike), so a busy one is known before its queue shows
        self.slots: float | None = None
        metrics.endpoints_fn = lambda: len(self.endpoints)
        endpoints.on_removed.append(self._forget)

    def _forget(self, ep: Endpoint) -> None:
        self.index.forget(ep.name)
        self.sessions.forget(ep.name)
        if not any(self.adapter_inflight.get(ep.name, {}).values()):
            self.adapter_inflight.pop(ep.name, None)
        if ep.name in self.inflight and not self.inflight[ep.name]:  # gone and idle: drop its series
            del self.inflight[ep.name]
            self.metrics.drop_endpoint(ep.name)

    # ---- decisions --------------------------------------------------------------------------------

    async def route_key(self, path: str, body: dict[str, Any] | None,
                        headers: Mapping[str, str]) -> RouteKey:
        session = self._session_key(body, headers)
        model = (body or {}).get("model")
        model = model if isinstance(model, str) and model else None
        if body is None or not self.picker.config.prefix:
            return RouteKey(session=session, model=model)
        tokens = await self.tokens.token_ids(path, body)
        if tokens.where == "shed":  # counted here: a request held and refused never reaches decision_time
            self.metrics.tokenize_shed.inc()
        if not tokens.ids:
            return RouteKey(session=session, tokenized=tokens.where, model=model)
        salt = body.get("cache_salt")
        # an adapter's KV is its own on the replica: the same prompt under another adapter is no hit there
        adapter = model if model is not None and self._is_adapter(model) else None
        hashes = self.hasher.hashes(tokens.ids, salt if isinstance(salt, str) else None, adapter)
        return RouteKey(hashes, len(tokens.ids), session, tokens.where, model)

    def _is_adapter(self, model: str) -> bool:
        return self.models is not None and model in self.models.adapters()

    def _session_key(self, body: dict[str, Any] | None, headers: Mapping[str, str]) -> str | None:
        src = self.session_source
        if not src or not self.picker.config.session:
            return None
        if src == "user":
            user = (body or {}).get("user")
            return user if isinstance(user, str) and user else None
        return headers.get(src.removeprefix("header:")) or None

    def loads(self) -> list[EndpointLoad]:
        now = time.monotonic()
        out = []
        for ep in self.endpoints.all():
            s = self.scraper.fresh(ep.name, now) if self.scraper is not None else None
            if s is not None and s.waiting > 0 and s.running >= 1:
                self.slots = max(self.slots or 0.0, s.running)
            out.append(EndpointLoad(ep.name, self.inflight.get(ep.name, 0), s.running if s else None,
                                    s.waiting if s else None, s.kv_usage if s else None))
        return out

    def failed(self, name: str, seconds: float) -> None:
        """A replica refused (503, draining) or could not be reached: skip it until its slice catches up."""
        self.cooldown[name] = time.monotonic() + seconds

    def _cooling(self, exclude: set[str], among: Collection[str] = ()) -> set[str]:
        if not self.cooldown:
            return exclude
        now = time.monotonic()
        for n in [n for n, t in self.cooldown.items() if t <= now]:
            del self.cooldown[n]
        cooling = exclude | self.cooldown.keys()
        # all cooling (of the replicas that may take it): try them anyway rather than refuse (the cooldown
        # is a guess)
        names = [ep.name for ep in self.endpoints.all() if not among or ep.name in among]
        return cooling if any(n not in cooling for n in names) else exclude

    def adapter_targets(self, model: str | None) -> AdapterTargets | None:
        """Where the request's adapter can run; None for the base model, or with adapter affinity off."""
        if self.models is None or model is None:
            return None
        lists = self.models.fresh()
        if not lists or (model not in self.models.adapters() and any(model in m.bases for m in lists.values())):
            return None  # the base model (the common case, answered without looking at the scrapes)
        lora: dict[str, LoraInfo] = {}
        if self.scraper is not None:
            now = time.monotonic()
            for name in lists:
                s = self.scraper.fresh(name, now)
                if s is not None and s.lora is not None:
                    lora[name] = s.lora
        return adapter_targets(model, lists, lora, self.adapter_inflight)

    def choose(self, key: RouteKey, exclude: set[str]) -> tuple[Endpoint, Decision] | None:
        names = [ep.name for ep in self.endpoints.all()]
        cached = self.index.match(key.hashes, names) if key.hashes else {}
        targets = self.adapter_targets(key.model)
        among = targets.serving if targets is not None else ()
        d = self.picker.pick(self.loads(), key.hashes, cached, self.sessions.get(key.session),
                             self._cooling(exclude, among), self.slots, targets)
        if d is None:
            return None
        ep = self.endpoints.get(d.endpoint)
        assert ep is not None
        return ep, d

    def dispatched(self, ep: Endpoint, d: Decision, key: RouteKey | None = None) -> None:
        """An attempt goes to `ep`: count the decision and the request in flight there."""
        self.metrics.decided(d.reason)
        if d.adapter:
            self.metrics.adapter_decided(d.adapter)
        self.add_inflight(ep.name, 1)
        self._adapter_inflight(ep.name, d, key, 1)

    def finished(self, ep: Endpoint, d: Decision, key: RouteKey | None = None) -> None:
        """The attempt on `ep` is over (answered, refused or failed)."""
        self._adapter_inflight(ep.name, d, key, -1)
        self.add_inflight(ep.name, -1)

    def _adapter_inflight(self, name: str, d: Decision, key: RouteKey | None, delta: int) -> None:
        if d.adapter not in SERVED or key is None or key.model is None:
            return
        per = self.adapter_inflight.setdefault(name, {})
        n = per[key.model] = per.get(key.model, 0) + delta
        if n <= 0:
            del per[key.model]
            if not per:
                del self.adapter_inflight[name]

    def accepted(self, key: RouteKey, ep: Endpoint, d: Decision) -> None:
        """`ep` took the request (no 429/503): it will hold the prompt's blocks, and the session is its."""
        m = self.metrics
        if key.prompt_tokens:
            m.prompt_tokens.inc(key.prompt_tokens)
            m.prefix_hit_tokens.inc(d.hit_blocks * self.hasher.block_size)
            self.index.record(key.hashes, ep.name)
        if key.session is not None:
            self.sessions.put(key.session, ep.name)

    def add_inflight(self, name: str, delta: int) -> None:
        n = self.inflight.get(name, 0) + delta
        if n == 0 and self.endpoints.get(name) is None:  # the last request of a replica that left
            self.inflight.pop(name, None)
            self.metrics.drop_endpoint(name)
            return
        self.inflight[name] = n
        self.metrics.set_inflight(name, n)

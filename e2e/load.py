"""Load with the official openai client, round-robin over the ready pods (standing in for the Service).

Every request is kept in a ledger with each attempt: the pod, the outcome and the times. A request is
retried on the next pod after an explicit 429 (honouring Retry-After), a 503 from a draining pod, or a
connection error from a pod that died (what a gateway with retries does); anything else, or running out of
attempts, loses it. Loops are bounded: they stop on their event or their deadline, whichever is first.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from .workload import MODEL_NAME, Job

MAX_ATTEMPTS = 40
REQUEST_DEADLINE = 240.0  # seconds one logical request may take, retries included
RETRY_AFTER_CAP = 2.0


@dataclass(frozen=True)
class Endpoint:
    pod: str
    url: str  # http://ip:port


@dataclass
class Attempt:
    pod: str
    start: float
    end: float = 0.0
    outcome: str = ""  # ok | 429 | 503 | connection | error:<status> | timeout
    retry_after: str | None = None


@dataclass
class Record:
    id: int
    job: Job
    phase: str
    start: float
    end: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    lost: str | None = None  # why, when the request never got a complete answer

    @property
    def ok(self) -> bool:
        return self.text is not None and self.lost is None

    @property
    def pod(self) -> str | None:
        """The pod that gave the final answer."""
        return self.attempts[-1].pod if self.ok and self.attempts else None

    @property
    def served(self) -> Attempt | None:
        return self.attempts[-1] if self.ok and self.attempts else None


@dataclass
class StreamRecord:
    """One streamed completion, as the client saw it: when it was sent, when text first came, how it ended."""

    job: Job
    phase: str
    pod: str  # where it was sent (a router, with routing)
    start: float
    first_token: float | None = None
    end: float = 0.0
    chunks: int = 0  # chunks that carried text
    text: str = ""
    finish_reason: str | None = None
    outcome: str = ""  # completed | error-event | truncated | connection | error:<status> | timeout
    error: dict[str, Any] | None = None  # the SSE error event's body, for error-event


class LoadGenerator:
    def __init__(self, endpoints: Callable[[], Sequence[Endpoint]], clock: Callable[[], float] = time.monotonic,
                 api_key: str = "e2e", model: str = MODEL_NAME) -> None:
        self._endpoints = endpoints
        self.clock = clock
        self.api_key = api_key
        self.model = model  # what requests put in "model": the daemons' --served-model-name
        self.records: list[Record] = []
        self.streams: list[StreamRecord] = []
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._clients: dict[str, openai.AsyncOpenAI] = {}
        self.inflight = 0

    def _client(self, ep: Endpoint) -> openai.AsyncOpenAI:
        client = self._clients.get(ep.url)
        if client is None:
            # max_retries=0: retries are ours, so each 429 is seen and counted, and goes to the next pod.
            client = openai.AsyncOpenAI(base_url=f"{ep.url}/v1", api_key=self.api_key, max_retries=0,
                                        timeout=openai.Timeout(180.0, connect=3.0))
            self._clients[ep.url] = client
        return client

    def _pick(self, slot: int | None, attempt: int) -> Endpoint | None:
        eps = sorted(self._endpoints(), key=lambda e: e.pod)
        if not eps:
            return None
        if slot is None:  # per request: the next pod
            return eps[next(self._rr) % len(eps)]
        return eps[(slot + attempt) % len(eps)]  # a kept-alive connection: the same pod while it is there

    async def request(self, job: Job, phase: str, slot: int | None = None) -> Record:
        rec = Record(id=next(self._ids), job=job, phase=phase, start=self.clock())
        self.records.append(rec)
        self.inflight += 1
        try:
            await self._run(rec, slot)
        finally:
            self.inflight -= 1
            rec.end = self.clock()
        return rec

    async def _run(self, rec: Record, slot: int | None) -> None:
        deadline = rec.start + REQUEST_DEADLINE
        while len(rec.attempts) < MAX_ATTEMPTS:
            if self.clock() > deadline:
                rec.lost = "deadline"
                return
            ep = self._pick(slot, len(rec.attempts))
            if ep is None:  # no ready pod right now: a Service would have no endpoints either
                await asyncio.sleep(0.25)
                continue
            att = Attempt(pod=ep.pod, start=self.clock())
            rec.attempts.append(att)
            try:
                resp = await self._client(ep).completions.create(
                    model=self.model, prompt=rec.job.prompt, max_tokens=rec.job.max_tokens, temperature=0.0)
            except openai.RateLimitError as e:
                att.end, att.outcome = self.clock(), "429"
                att.retry_after = e.response.headers.get("retry-after")
                await asyncio.sleep(_retry_after(att.retry_after))
                continue
            except openai.APIStatusError as e:
                att.end = self.clock()
                if e.status_code == 503:  # draining: "retry on another replica"
                    att.outcome = "503"
                    await asyncio.sleep(0.1)
                    continue
                att.outcome = f"error:{e.status_code}"
                rec.lost = f"HTTP {e.status_code}: {str(e)[:200]}"
                return
            except openai.APITimeoutError:
                att.end, att.outcome = self.clock(), "timeout"
                continue
            except openai.APIConnectionError:
                att.end, att.outcome = self.clock(), "connection"
                await asyncio.sleep(0.2)
                continue
            att.end, att.outcome = self.clock(), "ok"
            choice = resp.choices[0]
            rec.text = choice.text
            rec.finish_reason = choice.finish_reason
            rec.completion_tokens = resp.usage.completion_tokens if resp.usage else None
            return
        rec.lost = f"gave up after {len(rec.attempts)} attempts"

    async def stream(self, job: Job, phase: str, progress: Callable[[StreamRecord], None] | None = None,
                     ) -> StreamRecord:
        """One streamed request, never retried: how the stream ended is what it measures. `progress` is
        called after each chunk with text."""
        ep = None
        while ep is None:  # no endpoint yet: as in _run, a Service with none
            ep = self._pick(None, 0)
            if ep is None:
                await asyncio.sleep(0.25)
        rec = StreamRecord(job=job, phase=phase, pod=ep.pod, start=self.clock())
        self.streams.append(rec)
        self.inflight += 1
        try:
            await self._read_stream(rec, ep, progress)
        finally:
            self.inflight -= 1
            rec.end = self.clock()
        return rec

    async def _read_stream(self, rec: StreamRecord, ep: Endpoint,
                           progress: Callable[[StreamRecord], None] | None) -> None:
        try:
            chunks = await self._client(ep).completions.create(
                model=self.model, prompt=rec.job.prompt, max_tokens=rec.job.max_tokens, temperature=0.0, stream=True)
            async for chunk in chunks:
                choice = chunk.choices[0] if chunk.choices else None
                if choice is not None and choice.text:
                    rec.first_token = rec.first_token or self.clock()
                    rec.chunks += 1
                    rec.text += choice.text
                    if progress is not None:
                        progress(rec)
                if choice is not None and choice.finish_reason:
                    rec.finish_reason = choice.finish_reason
        except openai.APIStatusError as e:
            rec.outcome = f"error:{e.status_code}"
        except (openai.APIConnectionError, openai.APITimeoutError) as e:  # cut without an error event
            rec.outcome = "timeout" if isinstance(e, openai.APITimeoutError) else "connection"
        except openai.APIError as e:  # the client raises this for an SSE event that carries an error
            rec.outcome, rec.error = "error-event", e.body if isinstance(e.body, dict) else {"message": str(e)}
        else:
            rec.outcome = "completed" if rec.finish_reason else "truncated"

    async def clients(self, n: int, jobs: Sequence[Job], phase: str, stop: asyncio.Event,
                      deadline: float, sticky: bool = False) -> None:
        """n concurrent clients, each sending one request after another until `stop` or `deadline`.

        Plain clients spread every request over the pods in turn. Sticky ones behave like clients with a
        kept-alive connection through a Service: client i stays on the i-th ready pod while it exists."""
        counter = itertools.count()

        async def client(i: int) -> None:
            while not stop.is_set() and self.clock() < deadline:
                await self.request(jobs[next(counter) % len(jobs)], phase, slot=i if sticky else None)

        await asyncio.gather(*(client(i) for i in range(n)))

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    # ------------------------------------------------------------------ counts

    def summary(self, expected: dict[str, Any] | None = None) -> dict[str, Any]:
        outcomes: dict[str, int] = {}
        for r in self.records:
            for a in r.attempts:
                outcomes[a.outcome] = outcomes.get(a.outcome, 0) + 1
        out: dict[str, Any] = {
            "requests": len(self.records),
            "completed": sum(r.ok for r in self.records),
            "lost": sum(r.lost is not None for r in self.records),
            "unfinished": sum(r.text is None and r.lost is None for r in self.records),
            "attempts": outcomes,
            "retried_429": sum(any(a.outcome == "429" for a in r.attempts) for r in self.records),
        }
        if expected is not None:
            out["correct"] = sum(r.ok and is_correct(r, expected) for r in self.records)
            out["incorrect"] = sum(r.ok and not is_correct(r, expected) for r in self.records)
        return out


def _retry_after(value: str | None) -> float:
    try:
        return min(max(float(value or 1.0), 0.05), RETRY_AFTER_CAP)
    except ValueError:
        return 1.0


def is_correct(rec: Record, expected: dict[str, Any]) -> bool:
    """Complete (stopped by length or EOS, as the offline run did) and the same greedy text."""
    want = expected.get(rec.job.key)
    return bool(want) and rec.text == want["text"] and rec.finish_reason == want["finish_reason"]

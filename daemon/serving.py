"""The two generation routes: /v1/completions and /v1/chat/completions, streamed (SSE) or not.

A request is validated (protocol.py), tokenized here, checked against the context and KV capacity,
split into one engine request per prompt, then submitted to the AsyncEngine. Results come back on
one asyncio queue; the engine's cumulative text/token ids are turned into deltas per choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import re
import time
import uuid
from typing import Any

from aiohttp import web

from .async_engine import Aborted, Accepted, AsyncEngine, EngineDead, EngineRequest, Rejected
from .engine.request import CompletionOutput, Logprob, RequestOutput
from .engine.sampling_params import SamplingParams
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)

# Per-request storage keys (typed keys where this aiohttp has them).
_RequestKey = getattr(web, "RequestKey", None)
KV_START: Any = _RequestKey("kv_start", float) if _RequestKey else "kv_start"
KV_LOG: Any = _RequestKey("kv_log", dict) if _RequestKey else "kv_log"

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_seq = itertools.count()


def _clamp_logprob(v: float) -> float:
    # JSON has no -inf or NaN; vLLM clamps to the same floor
    if math.isnan(v):
        return -9999.0
    return min(max(v, -9999.0), 0.0)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclasses.dataclass
class _Choice:
    """Streaming state of one choice: how much text/tokens the client has already seen."""

    index: int
    text_len: int = 0
    tok_len: int = 0
    text_offset: int = 0
    started: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None


class _Job:
    """One HTTP request's engine requests and their choices."""

    def __init__(self, rid: str, subs: list[EngineRequest], n: int, prompt_texts: list[str | None]) -> None:
        self.rid = rid
        self.subs = subs
        self.n = n
        self.prompt_texts = prompt_texts
        self.sub_index = {s.request_id: i for i, s in enumerate(subs)}
        self.choices = {(i, j): _Choice(index=i * n + j) for i in range(len(subs)) for j in range(n)}
        self.unfinished = set(self.sub_index)
        self.completion_tokens: dict[str, int] = {}
        self.prompt_tokens = sum(len(s.prompt_token_ids) for s in subs)
        self.cached_tokens: dict[str, int] = {}
        self.first_token_time: float | None = None

    def usage(self) -> dict[str, int]:
        completion = sum(self.completion_tokens.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def finish_reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.choices.values()]


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_names: list[str], scheduling_policy: str,
                 max_num_seqs: int) -> None:
        self.engine = engine
        self._names = list(served_model_names)
        self.scheduling_policy = scheduling_policy
        self.max_num_seqs = max_num_seqs

    @property
    def model_names(self) -> list[str]:
        return self._names or [self.engine.model_name]

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    # ---- shared checks ----------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(f"The model `{model}` does not exist. Served: {', '.join(self.model_names)}",
                           status=404, param="model", code="model_not_found")

    def _check_common(self, params: SamplingParams, priority: int) -> None:
        if params.num_sequences > self.max_num_seqs:
            raise APIError(f"n/best_of ({params.num_sequences}) exceeds this server's max_num_seqs "
                           f"({self.max_num_seqs})", param="n", code="invalid_value")
        if priority != 0 and self.scheduling_policy != "priority":
            raise APIError("'priority' needs the server to run with --scheduling-policy priority",
                           param="priority", code="invalid_value")
        vocab = self.engine.vocab_size
        bad = [t for t in params.stop_token_ids or [] if t >= vocab]
        if bad:
            raise APIError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab})",
                           param="stop_token_ids", code="invalid_value")

    def _fit(self, ids: list[int], params: SamplingParams, max_tokens_set: bool, param: str) -> SamplingParams:
        """Resolve max_tokens and refuse requests that cannot fit in the context or the KV cache."""
        plen = len(ids)
        limit = self.engine.max_model_len
        cap = self.engine.kv_capacity_tokens or limit
        if plen == 0:
            raise APIError("the prompt is empty after tokenization", param=param, code="invalid_value")
        if plen >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                           f"{plen} tokens, leaving no room for a completion. Please shorten the prompt.",
                           param=param, code="context_length_exceeded")
        max_tokens = params.max_tokens
        if not max_tokens_set or max_tokens is None:
            room = min(limit, cap) - plen
            max_tokens = room if max_tokens is None else min(max_tokens, max(room, 1))
            if room < 1:
                raise APIError(f"the prompt ({plen} tokens) does not fit in this server's KV cache ({cap} tokens)",
                               param=param, code="context_length_exceeded")
        if plen + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{plen + max_tokens} tokens ({plen} in the prompt, {max_tokens} for the completion). "
                           f"Please reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        if plen + max_tokens > cap:
            raise APIError(f"this request needs {plen + max_tokens} KV cache slots but the server holds only "
                           f"{cap}; reduce max_tokens or the prompt", param="max_tokens",
                           code="context_length_exceeded")
        if max_tokens == params.max_tokens:
            return params
        return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))

    def _request_id(self, request: web.Request, prefix: str) -> str:
        hdr = request.headers.get("X-Request-Id")
        if hdr and _REQUEST_ID_RE.match(hdr):
            return hdr
        return f"{prefix}-{uuid.uuid4().hex}"

    def _token_str(self, tid: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.engine.tokenizer.decode([tid])

    def _top(self, d: dict[int, Logprob], k: int | None) -> list[tuple[int, Logprob]]:
        items = sorted(d.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf,
                                                  -kv[1].logprob))
        return items if k is None else items[:k]

    # ---- routes -------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion_request(parse_json_body(await request.read()))
        self._check_model(req.model)
        self.engine.check_accepting()
        self._check_common(req.params, req.priority)
        tok = self.engine.tokenizer
        vocab = self.engine.vocab_size
        rid = self._request_id(request, "cmpl")
        seq = next(_seq)
        subs, texts = [], []
        for i, p in enumerate(req.prompts):
            if isinstance(p, str):
                ids = tok.encode(p, add_special_tokens=True)
                texts.append(p)
            else:
                if any(t >= vocab for t in p):
                    raise APIError(f"prompt token ids must be < {vocab} (the vocabulary size)", param="prompt",
                                   code="invalid_value")
                ids = list(p)
                texts.append(tok.decode(ids) if req.echo else None)
            params = self._fit(ids, req.params, req.max_tokens_set, "prompt")
            subs.append(EngineRequest(f"{rid}-{seq}-{i}", ids, params, req.priority))
        if len(subs) > self.engine.max_queued_requests:
            raise APIError(f"{len(subs)} prompts in one request exceed the queue limit "
                           f"({self.engine.max_queued_requests})", param="prompt", code="invalid_value")
        job = _Job(rid, subs, req.params.n, texts)
        request[KV_LOG].update(request_id=rid, stream=req.stream, n=req.params.n, prompts=len(subs))
        return await self._run(request, job, _CompletionFormat(self, job, req), req.stream, req.stream_options)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(parse_json_body(await request.read()))
        self._check_model(req.model)
        self.engine.check_accepting()
        self._check_common(req.params, req.priority)
        tok = self.engine.tokenizer
        try:
            text = tok.apply_chat_template(req.messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message)
        except Exception as exc:  # noqa: BLE001 - jinja errors: the messages broke the template's rules
            raise APIError(f"the chat template rejected the messages: {exc}", param="messages",
                           code="invalid_value") from None
        ids = tok.encode(text, add_special_tokens=False)
        params = self._fit(ids, req.params, req.max_tokens_set, "messages")
        rid = self._request_id(request, "chatcmpl")
        job = _Job(rid, [EngineRequest(f"{rid}-{next(_seq)}-0", ids, params, req.priority)], req.params.n, [None])
        request[KV_LOG].update(request_id=rid, stream=req.stream, n=req.params.n)
        return await self._run(request, job, _ChatFormat(self, job, req), req.stream, req.stream_options)

    # ---- the engine round trip ----------------------------------------------------------------------

    async def _run(self, request: web.Request, job: _Job, fmt: _Format, stream: bool,
                   so: StreamOptions) -> web.StreamResponse:
        sink: asyncio.Queue = asyncio.Queue()
        log = request[KV_LOG]
        self.engine.submit(job.subs, sink)
        try:
            first = await sink.get()
            if isinstance(first, Rejected):
                job.unfinished.clear()
                if first.internal:
                    raise APIError(f"the engine could not take the request: {first.message}", status=500,
                                   type="internal_error", code="engine_error")
                raise APIError(first.message, param=fmt.prompt_param, code="invalid_value")
            if isinstance(first, EngineDead):
                job.unfinished.clear()
                raise APIError(f"the engine stopped: {first.message}", status=503,
                               type="service_unavailable_error", code="engine_dead")
            # an abort (drain timeout) can overtake the acceptance: then it is the first thing to apply
            early = [] if isinstance(first, Accepted) else [first]
            if stream:
                return await self._stream(request, job, fmt, sink, so, early)
            return await self._collect(job, fmt, sink, early)
        finally:
            if job.unfinished:  # client went away (or an error): free the KV blocks now
                self.engine.abort(job.unfinished)
                log.setdefault("outcome", "client_disconnected")
            log.update(prompt_tokens=job.prompt_tokens, completion_tokens=sum(job.completion_tokens.values()),
                       finish_reasons=job.finish_reasons())
            if job.first_token_time is not None:
                log["ttft_s"] = round(job.first_token_time - request[KV_START], 4)

    def _apply(self, job: _Job, item: Any, fmt: _Format) -> list[dict[str, Any]]:
        """Fold one sink item into the job; returns the stream chunks it produces."""
        if isinstance(item, RequestOutput):
            i = job.sub_index[item.request_id]
            if job.first_token_time is None and any(o.token_ids for o in item.outputs):
                job.first_token_time = time.monotonic()
            job.completion_tokens[item.request_id] = sum(len(o.token_ids) for o in item.outputs)
            chunks = []
            for out in item.outputs:
                chunk = fmt.delta(job.choices[(i, out.index)], out)
                if chunk is not None:
                    chunks.append(chunk)
            if item.finished:
                job.unfinished.discard(item.request_id)
            return chunks
        if isinstance(item, Aborted):
            i = job.sub_index[item.request_id]
            job.unfinished.discard(item.request_id)
            chunks = []
            for j in range(job.n):
                c = job.choices[(i, j)]
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    chunks.append(fmt.finish_chunk(c))
            return chunks
        if isinstance(item, EngineDead):
            job.unfinished.clear()
            raise _EngineDied(item.message)
        return []

    async def _collect(self, job: _Job, fmt: _Format, sink: asyncio.Queue, early: list) -> web.Response:
        try:
            for item in early:
                self._apply(job, item, fmt)
            while job.unfinished:
                self._apply(job, await sink.get(), fmt)
        except _EngineDied as exc:
            raise APIError(f"the engine stopped: {exc}", status=503, type="service_unavailable_error",
                           code="engine_dead") from None
        return web.json_response(fmt.final(), headers={"X-Request-Id": job.rid})

    async def _stream(self, request: web.Request, job: _Job, fmt: _Format, sink: asyncio.Queue,
                      so: StreamOptions, early: list) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": job.rid})
        await resp.prepare(request)
        head = fmt.first_chunks()
        if head:
            await resp.write(b"".join(_sse(self._with_usage(c, job, so)) for c in head))
        try:
            while job.unfinished:
                items = early or [await sink.get()]
                early = []
                while not sink.empty():  # the loop fell behind: send everything in one write
                    items.append(sink.get_nowait())
                chunks: list[dict[str, Any]] = []
                for item in items:
                    chunks.extend(self._apply(job, item, fmt))
                if chunks:
                    await resp.write(b"".join(_sse(self._with_usage(c, job, so)) for c in chunks))
        except _EngineDied as exc:
            err = APIError(f"the engine stopped: {exc}", status=503, type="service_unavailable_error",
                           code="engine_dead")
            request[KV_LOG]["outcome"] = "engine_dead"
            await resp.write(_sse(err.body()))
        if so.include_usage:
            await resp.write(_sse(fmt.usage_chunk()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _with_usage(chunk: dict[str, Any], job: _Job, so: StreamOptions) -> dict[str, Any]:
        if so.include_usage:
            chunk["usage"] = job.usage() if so.continuous_usage_stats else None
        return chunk


class _EngineDied(Exception):
    pass


class _Format:
    """Shapes of one route's responses. Subclasses fill in the OpenAI object layouts."""

    prompt_param = "prompt"
    object_name = ""
    chunk_object = ""

    def __init__(self, serving: OpenAIServing, job: _Job) -> None:
        self.s = serving
        self.job = job
        self.created = int(time.time())
        self.model = serving.model_name

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.job.rid, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    def usage_chunk(self) -> dict[str, Any]:
        c = self._chunk([])
        c["usage"] = self.job.usage()
        return c

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def _advance(self, c: _Choice, out: CompletionOutput) -> tuple[str, list[int], list | None, bool]:
        """New text, token ids and logprobs since the last chunk; whether this output just finished."""
        text = out.text[c.text_len:]
        toks = out.token_ids[c.tok_len:]
        lps = out.logprobs[c.tok_len:] if out.logprobs is not None else None
        c.text_len, c.tok_len = len(out.text), len(out.token_ids)
        c.text, c.token_ids, c.logprobs = out.text, out.token_ids, out.logprobs
        just_finished = out.finish_reason is not None and c.finish_reason is None
        if just_finished:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return text, toks, lps, just_finished

    def delta(self, c: _Choice, out: CompletionOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def finish_chunk(self, c: _Choice) -> dict[str, Any]:
        raise NotImplementedError

    def final(self) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, serving: OpenAIServing, job: _Job, req: CompletionRequest) -> None:
        super().__init__(serving, job)
        self.echo = req.echo
        self.k = req.logprobs

    def _prefix(self, c: _Choice) -> str:
        return (self.job.prompt_texts[c.index // self.job.n] or "") if self.echo else ""

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        out = []
        for c in self.job.choices.values():
            c.started = True
            c.text_offset = len(self._prefix(c))
            out.append(self._chunk([{"index": c.index, "text": self._prefix(c), "logprobs": None,
                                     "finish_reason": None, "stop_reason": None}]))
        return out

    def _logprobs(self, c: _Choice, toks: list[int], lps: list | None) -> dict[str, Any] | None:
        if self.k is None or lps is None:
            return None
        res: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, d in zip(toks, lps, strict=False):
            lp = d.get(tid)
            s = self.s._token_str(tid, lp)
            res["tokens"].append(s)
            res["token_logprobs"].append(_clamp_logprob(lp.logprob) if lp is not None else None)
            res["top_logprobs"].append({self.s._token_str(t, v): _clamp_logprob(v.logprob)
                                        for t, v in self.s._top(d, None)})
            res["text_offset"].append(c.text_offset)
            c.text_offset += len(s)
        return res

    def delta(self, c: _Choice, out: CompletionOutput) -> dict[str, Any] | None:
        text, toks, lps, done = self._advance(c, out)
        if not text and not toks and not done:
            return None
        if not c.started:
            c.started = True
            c.text_offset = len(self._prefix(c))
        return self._chunk([{"index": c.index, "text": text, "logprobs": self._logprobs(c, toks, lps),
                             "finish_reason": c.finish_reason if done else None,
                             "stop_reason": c.stop_reason if done else None}])

    def finish_chunk(self, c: _Choice) -> dict[str, Any]:
        return self._chunk([{"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason,
                             "stop_reason": None}])

    def final(self) -> dict[str, Any]:
        choices = []
        for c in sorted(self.job.choices.values(), key=lambda c: c.index):
            c.text_offset = len(self._prefix(c))
            choices.append({"index": c.index, "text": self._prefix(c) + c.text,
                            "logprobs": self._logprobs(c, c.token_ids, c.logprobs),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": self.job.rid, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.job.usage()}


class _ChatFormat(_Format):
    prompt_param = "messages"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, serving: OpenAIServing, job: _Job, req: ChatRequest) -> None:
        super().__init__(serving, job)
        self.logprobs = req.logprobs
        self.k = req.top_logprobs

    def first_chunks(self) -> list[dict[str, Any]]:
        out = []
        for c in self.job.choices.values():
            c.started = True
            out.append(self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        return out

    def _entry(self, tid: int, lp: Logprob | None) -> dict[str, Any]:
        s = self.s._token_str(tid, lp)
        return {"token": s, "logprob": _clamp_logprob(lp.logprob) if lp is not None else -9999.0,
                "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, toks: list[int], lps: list | None) -> dict[str, Any] | None:
        if not self.logprobs or lps is None:
            return None
        content = []
        for tid, d in zip(toks, lps, strict=False):
            e = self._entry(tid, d.get(tid))
            e["top_logprobs"] = [self._entry(t, v) for t, v in self.s._top(d, self.k)]
            content.append(e)
        return {"content": content}

    def delta(self, c: _Choice, out: CompletionOutput) -> dict[str, Any] | None:
        text, toks, lps, done = self._advance(c, out)
        if not text and not toks and not done:
            return None
        return self._chunk([{"index": c.index, "delta": {"content": text} if text else {},
                             "logprobs": self._logprobs(toks, lps),
                             "finish_reason": c.finish_reason if done else None,
                             **({"stop_reason": c.stop_reason} if done else {})}])

    def finish_chunk(self, c: _Choice) -> dict[str, Any]:
        return self._chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}])

    def final(self) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in sorted(self.job.choices.values(), key=lambda c: c.index)]
        return {"id": self.job.rid, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.job.usage()}

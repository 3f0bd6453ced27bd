"""The two generation routes: /v1/completions and /v1/chat/completions, streamed (SSE) or not.

A request is validated (protocol.py), its prompts run through the engine's input processor (token
ids, vocabulary, context length), one submission per prompt goes to the AsyncEngine, and results
come back on one asyncio queue, where response_formats.py turns them into OpenAI bodies or deltas.
Domain errors (errors.py, input_processor.py) propagate; the server's middleware maps them to HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import uuid
from typing import Any

from aiohttp import web

from kvpilot.common.chat_template import render_chat
from kvpilot.common.errors import APIError, invalid
from kvpilot.common.protocol import StreamOptions

from .async_engine import Aborted, Accepted, AsyncEngine, Rejected, Submission
from .engine.input_processor import InputError, InputProcessor
from .engine.lora import LoRARequest
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams
from .errors import EngineDead, EngineRejected
from .http_errors import to_api_error
from .lora_registry import LoRARegistry
from .protocol import ChatRequest, parse_chat_request, parse_completion_request
from .request_body import read_json_body
from .request_log import REQUEST_LOG_FIELDS, REQUEST_STARTED_AT
from .response_formats import ChatFormat, CompletionFormat, RequestState, ResponseFormat, sse
from .served_names import ServedNames

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_seq = itertools.count()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, names: ServedNames, scheduling_policy: str, max_num_seqs: int, *,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 loras: LoRARegistry | None = None) -> None:
        self.engine = engine
        self.names = names
        self.loras = loras
        self.scheduling_policy = scheduling_policy
        self.max_num_seqs = max_num_seqs
        self.auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser or "hermes"  # forced calls are written in Hermes form

    @property
    def model_name(self) -> str:
        return self.names.primary

    # ---- shared checks ----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """What `model` selects: None for the base model (or no `model`), else the adapter's request."""
        if model is None or self.names.accepts(model):
            return None
        lora = self.loras.get(model) if self.loras is not None else None
        if lora is None:
            adapters = [a.name for a in self.loras.adapters] if self.loras is not None else []
            served = ", ".join(self.names.accepted) + (f"; adapters: {', '.join(adapters)}" if adapters else "")
            raise APIError(f"The model `{model}` does not exist. Served: {served}", status=404, param="model",
                           code="model_not_found")
        return lora

    def _check_common(self, params: SamplingParams, priority: int) -> InputProcessor:
        """Checks both routes share; returns the loaded model's input processor."""
        processor = self.engine.check_accepting()
        if params.num_sequences > self.max_num_seqs:
            raise APIError(f"n/best_of ({params.num_sequences}) exceeds this server's max_num_seqs "
                           f"({self.max_num_seqs})", param="n", code="invalid_value")
        if priority != 0 and self.scheduling_policy != "priority":
            raise APIError("'priority' needs the server to run with --scheduling-policy priority",
                           param="priority", code="invalid_value")
        processor.check_params(params)
        return processor

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    continue_final_message: bool, tools: list | None = None) -> str:
        """The chat template applied to checked messages (shared with /tokenize). Tools, tool calls
        and tool results go in natively when the template knows them, else as Hermes text."""
        try:
            return render_chat(self.engine.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message)
        except Exception as exc:  # noqa: BLE001 - jinja errors: the messages broke the template's rules
            raise APIError(f"the chat template rejected the messages: {exc}", param="messages",
                           code="invalid_value") from None

    @staticmethod
    def _request_id(request: web.Request, prefix: str) -> str:
        hdr = request.headers.get("X-Request-Id")
        if hdr and _REQUEST_ID_RE.match(hdr):
            return hdr
        return f"{prefix}-{uuid.uuid4().hex}"

    # ---- routes -------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion_request(await read_json_body(request))
        lora = self._select(request, req.model)
        processor = self._check_common(req.params, req.priority)
        rid = self._request_id(request, "cmpl")
        seq = next(_seq)
        subs, texts = [], []
        for i, p in enumerate(req.prompts):
            prompt = processor.process_prompt(p, param="prompt")
            if prompt.text is None and req.echo:
                texts.append(self.engine.tokenizer.decode(prompt.token_ids))
            else:
                texts.append(prompt.text)
            params = processor.fit(len(prompt.token_ids), req.params, param="prompt",
                                   max_tokens_explicit=req.max_tokens_set)
            subs.append(Submission(f"{rid}-{seq}-{i}", prompt.token_ids, params, req.priority, req.cache_salt,
                                   lora))
        if len(subs) > self.engine.max_queued_requests:
            raise APIError(f"{len(subs)} prompts in one request exceed the queue limit "
                           f"({self.engine.max_queued_requests})", param="prompt", code="invalid_value")
        await self._compile_grammar(req.params)
        job = RequestState(rid, subs, req.params.n, texts)
        request[REQUEST_LOG_FIELDS].update(request_id=rid, stream=req.stream, n=req.params.n, prompts=len(subs))
        fmt = CompletionFormat(self.engine.tokenizer, self._reported(lora), job, req)
        return await self._run(request, job, fmt, req.stream, req.stream_options)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(await read_json_body(request), auto_tool_choice=self.auto_tool_choice)
        lora = self._select(request, req.model)
        processor = self._check_common(req.params, req.priority)
        text = self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools)
        # the template already holds the special tokens
        ids = processor.process_prompt(text, param="messages", add_special_tokens=False).token_ids
        params = processor.fit(len(ids), req.params, param="messages", max_tokens_explicit=req.max_tokens_set)
        await self._compile_grammar(params)
        rid = self._request_id(request, "chatcmpl")
        sub = Submission(f"{rid}-{next(_seq)}-0", ids, params, req.priority, req.cache_salt, lora)
        job = RequestState(rid, [sub], req.params.n, [None])
        request[REQUEST_LOG_FIELDS].update(request_id=rid, stream=req.stream, n=req.params.n)
        fmt = self._chat_format(job, req, self._reported(lora))
        return await self._run(request, job, fmt, req.stream, req.stream_options)

    def _chat_format(self, job: RequestState, req: ChatRequest, model_name: str) -> ChatFormat:
        if req.tool_mode == "none":
            return ChatFormat(self.engine.tokenizer, model_name, job, req)
        from .tools import TOOL_CALL_PARSERS
        from .tools.chat_format import ToolChatFormat  # calls can happen: the text is parsed for them

        return ToolChatFormat(self.engine.tokenizer, model_name, job, req, TOOL_CALL_PARSERS[self.tool_call_parser])

    def _select(self, request: web.Request, model: str | None) -> LoRARequest | None:
        """check_model, with the adapter noted in the request's log line."""
        lora = self.check_model(model)
        if lora is not None:
            request[REQUEST_LOG_FIELDS]["lora_name"] = lora.lora_name
        return lora

    def _reported(self, lora: LoRARequest | None) -> str:
        """The `model` a response reports: the adapter's name when one was selected, as vLLM does."""
        return lora.lora_name if lora is not None else self.model_name

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile a constrained request's grammar before submitting it, so a grammar that does not
        compile is a 400 here; the engine thread then finds it in the same (process-wide) cache."""
        spec = params.structured_outputs
        if spec is None:
            return
        from .engine.structured import StructuredOutputError, shared_compiler

        tok = self.engine.tokenizer
        compiler = shared_compiler(tok, self.engine.vocab_size, [tok.eos_token_id] if tok.eos_token_id is not None else [])
        try:
            await asyncio.wrap_future(compiler.submit(spec))
        except StructuredOutputError as exc:
            raise invalid(exc.field, str(exc)) from None

    # ---- the engine round trip ----------------------------------------------------------------------

    async def _run(self, request: web.Request, job: RequestState, fmt: ResponseFormat, stream: bool,
                   so: StreamOptions) -> web.StreamResponse:
        sink: asyncio.Queue = asyncio.Queue()
        log = request[REQUEST_LOG_FIELDS]
        self.engine.submit(job.submissions, sink)
        try:
            first = await sink.get()
            if isinstance(first, Rejected | EngineDead):
                job.unfinished.clear()
                raise first if isinstance(first, EngineDead) else _rejection(first.error, fmt.prompt_param)
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
                log["ttft_s"] = round(job.first_token_time - request[REQUEST_STARTED_AT], 4)

    def _apply(self, job: RequestState, item: Any, fmt: ResponseFormat) -> list[dict[str, Any]]:
        """Fold one sink item into the job; returns the stream chunks it produces."""
        if isinstance(item, RequestOutput):
            i = job.prompt_index[item.request_id]
            if job.first_token_time is None and any(o.token_ids for o in item.outputs):
                job.first_token_time = time.monotonic()
            job.completion_tokens[item.request_id] = sum(len(o.token_ids) for o in item.outputs)
            if item.prompt_logprobs is not None:
                job.prompt_logprobs[i] = item.prompt_logprobs
            chunks = []
            for out in item.outputs:
                chunk = fmt.delta(job.choices[(i, out.index)], out)
                if chunk is not None:
                    chunks.append(chunk)
            if item.finished:
                job.unfinished.discard(item.request_id)
            return chunks
        if isinstance(item, Aborted):
            i = job.prompt_index[item.request_id]
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
            raise item
        return []

    async def _collect(self, job: RequestState, fmt: ResponseFormat, sink: asyncio.Queue,
                       early: list) -> web.Response:
        for item in early:
            self._apply(job, item, fmt)
        while job.unfinished:
            self._apply(job, await sink.get(), fmt)
        return web.json_response(fmt.final(), headers={"X-Request-Id": job.rid})

    async def _stream(self, request: web.Request, job: RequestState, fmt: ResponseFormat,
                      sink: asyncio.Queue, so: StreamOptions, early: list) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": job.rid})
        await resp.prepare(request)
        head = fmt.first_chunks()
        if head:
            await resp.write(b"".join(sse(self._with_usage(c, job, so)) for c in head))
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
                    await resp.write(b"".join(sse(self._with_usage(c, job, so)) for c in chunks))
        except EngineDead as exc:  # the status line is sent: the error goes into the stream
            request[REQUEST_LOG_FIELDS]["outcome"] = "engine_dead"
            err = to_api_error(exc)
            assert err is not None
            await resp.write(sse(err.body()))
        if so.include_usage:
            await resp.write(sse(fmt.usage_chunk()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _with_usage(chunk: dict[str, Any], job: RequestState, so: StreamOptions) -> dict[str, Any]:
        if so.include_usage:
            chunk["usage"] = job.usage() if so.continuous_usage_stats else None
        return chunk


def _rejection(error: Exception, param: str) -> Exception:
    """What to raise when the engine's add_request refused a submission."""
    if isinstance(error, InputError):
        return error
    if isinstance(error, ValueError | TypeError):  # bad input the engine caught without naming a field
        return InputError(str(error) or type(error).__name__, param)
    return EngineRejected(f"the engine could not take the request: {error or type(error).__name__}")

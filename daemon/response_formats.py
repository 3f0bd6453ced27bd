"""OpenAI response shapes for the generation routes: per-choice deltas, final bodies, logprobs, SSE.

The engine reports cumulative text and token ids per sequence; a ChoiceState remembers how much of
that the client has already been sent, so each format can turn outputs into deltas.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Protocol

from .async_engine import Submission
from .engine.outputs import CompletionOutput, Logprob
from .protocol import ChatRequest, CompletionRequest


class Detokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


def clamp_logprob(v: float) -> float:
    # JSON has no -inf or NaN; vLLM clamps to the same floor
    if math.isnan(v):
        return -9999.0
    return min(max(v, -9999.0), 0.0)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token_text(tokenizer: Detokenizer, tid: int, lp: Logprob | None) -> str:
    """A token's text: the engine's decoded form when it sent one, else the tokenizer's."""
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])


def ranked_logprobs(d: dict[int, Logprob], k: int | None) -> list[tuple[int, Logprob]]:
    """The top-k entries of one position's logprobs, best rank first (all of them when k is None)."""
    items = sorted(d.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf,
                                              -kv[1].logprob))
    return items if k is None else items[:k]


@dataclasses.dataclass
class ChoiceState:
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


class RequestState:
    """One user request: its submissions (one per prompt) and their n choices each."""

    def __init__(self, rid: str, submissions: list[Submission], n: int, prompt_texts: list[str | None]) -> None:
        self.rid = rid
        self.submissions = submissions
        self.n = n
        self.prompt_texts = prompt_texts
        self.prompt_index = {s.request_id: i for i, s in enumerate(submissions)}
        self.choices = {(i, j): ChoiceState(index=i * n + j) for i in range(len(submissions)) for j in range(n)}
        self.unfinished = set(self.prompt_index)
        self.completion_tokens: dict[str, int] = {}
        self.prompt_tokens = sum(len(s.prompt_token_ids) for s in submissions)
        self.first_token_time: float | None = None
        self.prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = {}  # by prompt index

    def usage(self) -> dict[str, int]:
        completion = sum(self.completion_tokens.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def finish_reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.choices.values()]


def prompt_logprobs_body(tokenizer: Detokenizer, plp: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {"id": {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [None if d is None else {str(t): {"logprob": clamp_logprob(v.logprob), "rank": v.rank,
                                             "decoded_token": token_text(tokenizer, t, v)}
                                    for t, v in d.items()}
            for d in plp]


class ResponseFormat:
    """Shapes of one route's responses. Subclasses fill in the OpenAI object layouts."""

    prompt_param = "prompt"
    object_name = ""
    chunk_object = ""

    def __init__(self, tokenizer: Detokenizer, model_name: str, job: RequestState) -> None:
        self.tokenizer = tokenizer
        self.job = job
        self.created = int(time.time())
        self.model = model_name

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.job.rid, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    def usage_chunk(self) -> dict[str, Any]:
        c = self._chunk([])
        c["usage"] = self.job.usage()
        return c

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def _advance(self, c: ChoiceState, out: CompletionOutput) -> tuple[str, list[int], list | None, bool]:
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

    def delta(self, c: ChoiceState, out: CompletionOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def finish_chunk(self, c: ChoiceState) -> dict[str, Any]:
        raise NotImplementedError

    def final(self) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer: Detokenizer, model_name: str, job: RequestState,
                 req: CompletionRequest) -> None:
        super().__init__(tokenizer, model_name, job)
        self.echo = req.echo
        self.k = req.logprobs
        self.want_prompt_logprobs = req.params.prompt_logprobs is not None

    def _prefix(self, c: ChoiceState) -> str:
        return (self.job.prompt_texts[c.index // self.job.n] or "") if self.echo else ""

    @property
    def _echo_scored(self) -> bool:
        """echo with logprobs: the prompt's scores come with the first output, so the echoed prompt waits
        for it and leads the first delta instead of going out up front."""
        return self.echo and self.k is not None

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.echo or self._echo_scored:
            return []
        out = []
        for c in self.job.choices.values():
            c.started = True
            c.text_offset = len(self._prefix(c))
            out.append(self._chunk([{"index": c.index, "text": self._prefix(c), "logprobs": None,
                                     "finish_reason": None, "stop_reason": None}]))
        return out

    def _logprobs(self, c: ChoiceState, toks: list[int], lps: list | None) -> dict[str, Any] | None:
        if self.k is None or lps is None:
            return None
        res: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, d in zip(toks, lps, strict=False):
            lp = d.get(tid)
            s = token_text(self.tokenizer, tid, lp)
            res["tokens"].append(s)
            res["token_logprobs"].append(clamp_logprob(lp.logprob) if lp is not None else None)
            res["top_logprobs"].append({token_text(self.tokenizer, t, v): clamp_logprob(v.logprob)
                                        for t, v in ranked_logprobs(d, None)})
            res["text_offset"].append(c.text_offset)
            c.text_offset += len(s)
        return res

    def _prompt_logprobs(self, c: ChoiceState, res: dict[str, Any] | None) -> dict[str, Any] | None:
        """echo with logprobs: the prompt's tokens lead the logprobs (the first has no score), and
        res (the generated tokens', offsets starting after the prompt) follows."""
        i = c.index // self.job.n
        plp = self.job.prompt_logprobs.get(i)
        if res is None or plp is None:
            return res
        ids = self.job.submissions[i].prompt_token_ids
        head: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for tid, d in zip(ids, plp, strict=True):
            lp = d.get(tid) if d is not None else None
            s = token_text(self.tokenizer, tid, lp)
            head["tokens"].append(s)
            head["token_logprobs"].append(clamp_logprob(lp.logprob) if lp is not None else None)
            head["top_logprobs"].append(None if d is None else {
                token_text(self.tokenizer, t, v): clamp_logprob(v.logprob) for t, v in ranked_logprobs(d, None)})
            head["text_offset"].append(offset)
            offset += len(s)
        return {key: head[key] + res[key] for key in head}

    def delta(self, c: ChoiceState, out: CompletionOutput) -> dict[str, Any] | None:
        text, toks, lps, done = self._advance(c, out)
        if not text and not toks and not done:
            return None
        first = not c.started
        if first:
            c.started = True
            c.text_offset = len(self._prefix(c))
        lp = self._logprobs(c, toks, lps)
        if first and self._echo_scored:
            text = self._prefix(c) + text
            lp = self._prompt_logprobs(c, lp)
        return self._chunk([{"index": c.index, "text": text, "logprobs": lp,
                             "finish_reason": c.finish_reason if done else None,
                             "stop_reason": c.stop_reason if done else None}])

    def finish_chunk(self, c: ChoiceState) -> dict[str, Any]:
        return self._chunk([{"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason,
                             "stop_reason": None}])

    def final(self) -> dict[str, Any]:
        choices = []
        for c in sorted(self.job.choices.values(), key=lambda c: c.index):
            c.text_offset = len(self._prefix(c))
            lp = self._logprobs(c, c.token_ids, c.logprobs)
            choice = {"index": c.index, "text": self._prefix(c) + c.text,
                      "logprobs": self._prompt_logprobs(c, lp) if self.echo else lp,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.want_prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_body(
                    self.tokenizer, self.job.prompt_logprobs.get(c.index // self.job.n))
            choices.append(choice)
        return {"id": self.job.rid, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.job.usage()}


class ChatFormat(ResponseFormat):
    prompt_param = "messages"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Detokenizer, model_name: str, job: RequestState, req: ChatRequest) -> None:
        super().__init__(tokenizer, model_name, job)
        self.logprobs = req.logprobs
        self.k = req.top_logprobs
        self.want_prompt_logprobs = req.params.prompt_logprobs is not None

    def first_chunks(self) -> list[dict[str, Any]]:
        out = []
        for c in self.job.choices.values():
            c.started = True
            out.append(self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        return out

    def _entry(self, tid: int, lp: Logprob | None) -> dict[str, Any]:
        s = token_text(self.tokenizer, tid, lp)
        return {"token": s, "logprob": clamp_logprob(lp.logprob) if lp is not None else -9999.0,
                "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, toks: list[int], lps: list | None) -> dict[str, Any] | None:
        if not self.logprobs or lps is None:
            return None
        content = []
        for tid, d in zip(toks, lps, strict=False):
            e = self._entry(tid, d.get(tid))
            e["top_logprobs"] = [self._entry(t, v) for t, v in ranked_logprobs(d, self.k)]
            content.append(e)
        return {"content": content}

    def delta(self, c: ChoiceState, out: CompletionOutput) -> dict[str, Any] | None:
        text, toks, lps, done = self._advance(c, out)
        if not text and not toks and not done:
            return None
        return self._chunk([{"index": c.index, "delta": {"content": text} if text else {},
                             "logprobs": self._logprobs(toks, lps),
                             "finish_reason": c.finish_reason if done else None,
                             **({"stop_reason": c.stop_reason} if done else {})}])

    def finish_chunk(self, c: ChoiceState) -> dict[str, Any]:
        return self._chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}])

    def final(self) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in sorted(self.job.choices.values(), key=lambda c: c.index)]
        body = {"id": self.job.rid, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.job.usage()}
        if self.want_prompt_logprobs:  # vLLM: on the response, not per choice
            body["prompt_logprobs"] = prompt_logprobs_body(self.tokenizer, self.job.prompt_logprobs.get(0))
        return body

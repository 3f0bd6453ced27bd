"""LLMEngine: requests in, incremental RequestOutputs out, one scheduler iteration per step()."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from .config import EngineConfig
from .detokenizer import TextStream
from .kv_cache import KVCacheManager
from .loader import LoadedModel, load_model
from .request import (
    CompletionOutput,
    Logprob,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from .runner import ModelRunner, SeqBatchEntry
from .sampler import Sampler, SampleResult, SamplingState, make_generator
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("kvpilot.engine")

GiB = 1 << 30


@dataclass
class EngineStats:
    kv_cache_usage: float
    kv_cache_token_usage: float
    num_running: int
    num_waiting: int
    num_preempted_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_waste: float


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one generated sequence (one CompletionOutput)."""

    request: Request
    text: TextStream
    generator: torch.Generator | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0


@dataclass(eq=False)
class _Group:
    """One user request: its n (or best_of) sequences share the prompt's blocks via fork."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[_Sequence] = field(default_factory=list)
    forked: bool = False

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.num_sequences and all(s.request.is_finished() for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config or EngineConfig(**kwargs)
        started = time.perf_counter()
        self.loaded: LoadedModel = load_model(self.config)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.model_name
        self.runner = ModelRunner(self.config, self.loaded)
        num_blocks = self.runner.num_blocks_for_budget()
        num_cpu_blocks = 0
        if self.config.preemption_mode == "swap":
            num_cpu_blocks = max(1, int(self.config.swap_space * GiB // self.runner.kv_bytes_per_block))
        self.runner.init_kv_cache(num_blocks, num_cpu_blocks)
        block_size = self.config.block_size
        self.max_model_len = self.loaded.max_model_len
        if num_blocks * block_size < self.max_model_len:
            logger.warning(
                "KV cache holds %d tokens, less than max_model_len=%d; capping max_model_len",
                num_blocks * block_size,
                self.max_model_len,
            )
            self.max_model_len = num_blocks * block_size
        self.kv = KVCacheManager(num_blocks, block_size, self.config.enable_prefix_caching, num_cpu_blocks)
        self.scheduler = Scheduler(self.config, self.kv, self.max_model_len)
        self.sampler = Sampler()
        self.vocab_size = int(self.loaded.hf_config.vocab_size)
        self.groups: dict[str, _Group] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info("engine ready in %.1fs: %s", time.perf_counter() - started, self.model_name)

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.use_beam_search:
            raise ValueError("use_beam_search: use LLM.beam_search (the engine runs beams as plain requests)")
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, token_ids = self._prompt_tokens(prompt)
        max_tokens = self._check_length(len(token_ids), params)
        if max_tokens != params.max_tokens:
            params = _with_max_tokens(params, max_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = _Group(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival),
        )
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling_params=params,
            arrival_time=arrival,
            priority=priority,
            eos_token_ids=self.loaded.eos_token_ids,
        )
        group.seqs.append(self._new_sequence(group, req, 0))
        self.scheduler.add_request(req)
        self.groups[request_id] = group
        self.prompt_tokens_total += len(token_ids)

    def _prompt_tokens(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, list | tuple):
            if not prompt:
                raise ValueError("prompt_token_ids must not be empty")
            for t in prompt:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt_token_ids: {t!r} is not a token id in [0, {self.vocab_size})")
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _check_length(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(
                f"prompt is too long: {prompt_len} tokens, but this model's maximum context length is "
                f"{limit} tokens and at least one token must be generated"
            )
        if params.max_tokens is None:
            return limit - prompt_len
        if prompt_len + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                f"{params.max_tokens} for max_tokens). Reduce the prompt or max_tokens."
            )
        return params.max_tokens

    def _new_sequence(self, group: _Group, req: Request, index: int) -> _Sequence:
        params = group.params
        seed = None if params.seed is None else params.seed + index
        req.group_id = group.request_id
        req.output_index = index
        return _Sequence(
            request=req,
            text=TextStream(self.tokenizer, group.prompt_token_ids, params),
            generator=make_generator(seed),
            logprobs=[] if params.logprobs is not None else None,
        )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            self.scheduler.abort_requests(s.request.request_id for s in group.seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self._apply_block_moves(out)
        touched: dict[str, _Group] = {}
        for req in out.preempted:
            logger.debug("preempted %s (%s)", req.request_id, req.status.value)
        if out.is_empty:
            return []
        entries = [
            SeqBatchEntry(
                token_ids=e.request.all_token_ids[e.start_pos : e.start_pos + e.num_new_tokens],
                start_pos=e.start_pos,
                block_table=e.block_table,
                compute_logits=e.completes_sequence,
            )
            for e in out.scheduled
        ]
        logits = self.runner.execute(entries)
        self.scheduler.update_after_step(out)
        now = time.monotonic()
        rows: list[int] = []
        seqs: list[_Sequence] = []
        row = 0
        for e in out.scheduled:
            group = self.groups.get(e.request.group_id)
            if group is not None and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            if not e.completes_sequence:
                continue
            if group is not None:
                for seq in self._sequences_to_sample(group, e.request):
                    rows.append(row)
                    seqs.append(seq)
            row += 1
        if seqs:
            if rows != list(range(logits.shape[0])):
                logits = logits[torch.tensor(rows, dtype=torch.long)]
            states = [
                SamplingState(
                    params=s.request.sampling_params,
                    prompt_token_ids=s.request.prompt_token_ids,
                    output_token_ids=s.request.output_token_ids,
                    generator=s.generator,
                    eos_token_ids=s.request.eos_token_ids,
                )
                for s in seqs
            ]
            results = self.sampler(logits, states)
            for seq, result in zip(seqs, results, strict=True):
                group = self.groups[seq.request.group_id]
                self._append_token(group, seq, result, now)
                touched[group.request_id] = group
        return [self._make_output(g) for g in touched.values()]

    def _apply_block_moves(self, out: SchedulerOutput) -> None:
        if out.blocks_to_swap_out:
            self.runner.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self.runner.swap_in(out.blocks_to_swap_in)
        if out.blocks_to_copy:
            self.runner.copy_blocks(out.blocks_to_copy)

    def _sequences_to_sample(self, group: _Group, req: Request) -> list[_Sequence]:
        seq = group.seqs[req.output_index]
        if group.forked or group.params.num_sequences == 1:
            return [seq]
        # First token of an n>1 request: the children share every prompt block with the parent.
        group.forked = True
        for index in range(1, group.params.num_sequences):
            child = Request(
                request_id=f"{group.request_id}#{index}",
                prompt_token_ids=list(group.prompt_token_ids),
                sampling_params=group.params,
                arrival_time=req.arrival_time,
                priority=req.priority,
                eos_token_ids=req.eos_token_ids,
            )
            group.seqs.append(self._new_sequence(group, child, index))
            self.scheduler.add_forked(req, child)
        return list(group.seqs)

    def _append_token(self, group: _Group, seq: _Sequence, result: SampleResult, now: float) -> None:
        req = seq.request
        token = result.token_id
        req.append_output_token(token)
        self.generation_tokens_total += 1
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        seq.cumulative_logprob += result.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(result))
        seq.text.append(token)
        status = self._check_stop(seq, token)
        if status is not None:
            seq.text.finish()
            self.scheduler.finish_request(req, status)
            if group.finished:
                group.metrics.finished_time = now

    def _check_stop(self, seq: _Sequence, token: int) -> RequestStatus | None:
        req = seq.request
        params = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if seq.text.stopped:
            req.stop_reason = seq.text.stop_reason
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _logprob_entry(self, result: SampleResult) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entry: dict[int, Logprob] = {}
        for rank, (tid, lp) in enumerate(result.top_logprobs or [], start=1):
            entry[tid] = Logprob(logprob=lp, rank=rank, decoded_token=decode([tid]))
        if result.token_id not in entry:
            entry[result.token_id] = Logprob(
                logprob=result.logprob, rank=result.rank, decoded_token=decode([result.token_id])
            )
        return entry

    def _make_output(self, group: _Group) -> RequestOutput:
        finished = group.finished
        seqs = group.seqs
        if finished and group.params.num_sequences > group.params.n:
            # best_of: keep the n most likely sequences.
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: group.params.n]
        outputs = []
        for index, seq in enumerate(seqs):
            req = seq.request
            done = req.is_finished()
            text = seq.text.text if done else seq.text.emitted_text
            outputs.append(
                CompletionOutput(
                    index=index if finished and group.params.num_sequences > group.params.n else req.output_index,
                    text=text,
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=req.status.finish_reason if done else None,
                    stop_reason=req.stop_reason,
                )
            )
        if finished:
            del self.groups[group.request_id]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=group.seqs[0].request.num_cached_tokens,
            metrics=group.metrics,
        )

    # ----------------------------------------------------------------- stats
    def get_stats(self) -> EngineStats:
        kv = self.kv.stats()
        return EngineStats(
            kv_cache_usage=kv.usage,
            kv_cache_token_usage=kv.token_usage,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preempted_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries_total=self.kv.prefix_queries_tokens,
            prefix_cache_hits_total=self.kv.prefix_hits_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_total_blocks=kv.num_total_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_waste=kv.waste,
        )

    def warmup(self) -> None:
        self.runner.warmup()

    def reset_prefix_cache(self) -> None:
        self.kv.pool.reset_prefix_cache()


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return replace(params, max_tokens=max_tokens)

"""LLMEngine: requests in, incremental RequestOutputs out, one scheduler iteration per step()."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import EngineConfig
from .detokenizer import TextStream
from .input_processor import InputLimits, InputProcessor
from .loader import LoadedModel, load_model
from .lora import LoRAAdapterError, LoRANotEnabled, LoRARequest
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .request import Request
from .runner import ModelRunner, SeqBatchEntry
from .sampler import Sampler, SampleResult, SamplingState, make_generator
from .sampling_params import RequestOutputKind, SamplingParams
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus
from .spec_decode.verify import GeneratorRewind, emit

if TYPE_CHECKING:
    from .executor.multiproc import MultiprocExecutor
    from .spec_decode.speculator import Speculator
    from .structured.engine_state import StructuredOutputs

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
    model_weight_bytes: int = 0
    quantization: str = "none"
    # speculative decoding (vLLM's vllm:spec_decode_* counters); all zero without a speculative_config
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # LoRA (vllm:lora_requests_info): max_loras (0 without enable_lora) and the adapters' names
    max_loras: int = 0
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()


def _prompt_targets(seq: Sequence, start: int, num_tokens: int) -> list[int] | None:
    """For a sequence scoring its prompt: the prompt token after each position of this chunk that
    has one (position p predicts prompt[p + 1]); None when there is nothing to score."""
    if seq.prompt_logprobs is None:
        return None
    prompt = seq.prompt_token_ids
    end = min(start + num_tokens, len(prompt) - 1)
    return prompt[start + 1 : end + 1] if end > start else None


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s.lora_request.lora_name for s in seqs if s.lora_request is not None))


def _grammar_completed(seq: Sequence) -> bool:
    """The sequence's output so far completes its grammar (only a stop token may follow)."""
    return seq.matcher is not None and not seq.matcher.failed and seq.matcher.is_completed()


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config or EngineConfig(**kwargs)
        started = time.perf_counter()
        # Unseeded requests draw from torch's global generator: seeding it makes a whole run repeatable.
        torch.manual_seed(self.config.seed)
        self.runner: ModelRunner | MultiprocExecutor
        if self.config.world_size > 1:  # one process per rank; the runner's calls reach all of them
            from .executor import start_executor

            self.runner = start_executor(self.config)
            self.loaded: LoadedModel = self.runner.loaded
        else:
            self.loaded = load_model(self.config)
            self.runner = ModelRunner(self.config, self.loaded)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.model_name
        if self.config.enable_lora:  # before the KV cache: on a GPU its slots take memory the cache must leave
            self.runner.enable_lora()
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
        self.scheduler = Scheduler(self.config, num_blocks, num_cpu_blocks)
        self.speculator: Speculator | None = None
        if self.config.speculative is not None:
            from .spec_decode.speculator import make_speculator

            self.speculator = make_speculator(self.config, self.loaded, self.runner, self.max_model_len)
        self.sampler = Sampler()
        self.vocab_size = int(self.loaded.hf_config.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, InputLimits(self.max_model_len, self.vocab_size))
        self.requests: dict[str, Request] = {}  # unfinished requests by request_id
        self._structured: StructuredOutputs | None = None  # made on the first constrained request
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
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. `cache_salt` keeps its prefix-cache entries apart from other salts' (tenants);
        `lora_request` runs it with that adapter (read from its folder now, unless loaded: a bad one is a
        LoRAAdapterError and nothing is queued)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.use_beam_search:
            raise ValueError("use_beam_search: use LLM.beam_search (the engine runs beams as plain requests)")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lora_request is not None:
            self.add_lora(lora_request)
        if params.prompt_logprobs is not None:
            # a cached prefix has no logits to score: a salt of its own keeps this prompt out of the
            # prefix cache, as vLLM does for prompt_logprobs requests
            cache_salt = f"{cache_salt or ''}#prompt-logprobs#{request_id}#{time.monotonic_ns()}"
        processed = self.input_processor.process_prompt(prompt)
        prompt_text, token_ids = processed.text, processed.token_ids
        self.input_processor.check_params(params)
        params = self.input_processor.fit(len(token_ids), params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        request = Request(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival),
        )
        seq = Sequence(
            seq_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling_params=params,
            arrival_time=arrival,
            priority=priority,
            eos_token_ids=self.loaded.eos_token_ids,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        request.seqs.append(self._init_sequence(request, seq, 0))
        if params.prompt_logprobs is not None:  # the parent scores the prompt; forks share it
            seq.prompt_logprobs = [None] * len(token_ids)
        if params.structured_outputs is not None:
            # held outside the scheduler until its grammar compiles (step() admits it)
            self.structured_outputs().hold(request_id, seq, params.structured_outputs)
        else:
            self.scheduler.add_sequence(seq)
        self.requests[request_id] = request
        self.prompt_tokens_total += len(token_ids)

    def _init_sequence(self, request: Request, seq: Sequence, index: int) -> Sequence:
        params = request.params
        seed = None if params.seed is None else params.seed + index
        seq.request_id = request.request_id
        seq.index = index
        seq.text = TextStream(self.tokenizer, request.prompt_token_ids, params)
        seq.generator = make_generator(seed)
        seq.logprobs = [] if params.logprobs is not None else None
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            self.scheduler.abort_sequences(s.seq_id for s in request.seqs)
            held = self._structured.drop(rid) if self._structured is not None else None
            if held is not None:
                held.status = SequenceStatus.FINISHED_ABORTED

    # ----------------------------------------------------------------- adapters (vLLM's names)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter and keep it in the host cache (LoRAAdapterError: nothing is kept)."""
        if self.runner.lora is None:
            raise LoRANotEnabled("LoRA adapters need an engine started with enable_lora", param="lora_request")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        self.runner.lora.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False when none with that id is loaded. Its running requests finish (they read
        it again should it be needed)."""
        return self.runner.lora is not None and self.runner.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set() if self.runner.lora is None else self.runner.lora.list_ids()

    def _drop_unreadable_adapters(self, out: SchedulerOutput) -> list[Request]:
        """Before a step: re-read the adapters its sequences need that left the host cache; a sequence whose
        adapter can no longer be read (its files removed since) ends aborted, its request returned."""
        lora = self.runner.lora
        assert lora is not None
        bad: set[LoRARequest] = set()
        for e in out.scheduled:
            req = e.seq.lora_request
            if req is None or req in bad or lora.holds(req):
                continue
            try:
                lora.add(req)
            except LoRAAdapterError as exc:
                logger.warning("%s; its requests are aborted", exc)
                bad.add(req)
        if not bad:
            return []
        failed: dict[str, Request] = {}
        for e in [e for e in out.scheduled if e.seq.lora_request in bad]:
            out.scheduled.remove(e)
            request = self.requests.get(e.seq.request_id)
            if request is not None and not e.seq.is_finished():
                self._finish(request, e.seq, SequenceStatus.FINISHED_ABORTED, time.monotonic())
                failed[request.request_id] = request
        return list(failed.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        failed = self._admit_compiled()
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running)
        out = self.scheduler.schedule()
        self._apply_block_moves(out)
        for seq in out.preempted:
            logger.debug("preempted %s (%s)", seq.seq_id, seq.status.value)
        if self.runner.lora is not None:
            failed += self._drop_unreadable_adapters(out)
            # rows of one adapter side by side: each LoRA'd layer then runs one segment per adapter
            out.scheduled.sort(key=lambda e: 0 if e.seq.lora_request is None else e.seq.lora_request.lora_int_id)
        if self.speculator is not None:
            self.speculator.forget(out.preempted)
            self.speculator.propose(out.scheduled)
        if out.is_empty:
            if not failed and self._structured is not None and self.requests:
                self._structured.wait(0.05)  # only compiles pending: do not spin
            return [self._make_output(r) for r in failed]
        entries = [
            SeqBatchEntry(
                token_ids=e.seq.all_token_ids[e.start_pos : e.start_pos + e.num_verified_new] + e.draft_token_ids,
                lora_request=e.seq.lora_request,
                start_pos=e.start_pos,
                block_table=e.block_table,
                compute_logits=e.completes_sequence,
                num_logits=1 + e.num_draft_tokens,
                prompt_targets=_prompt_targets(e.seq, e.start_pos, e.num_new_tokens),
                prompt_top_k=e.seq.sampling_params.prompt_logprobs or 0,
            )
            for e in out.scheduled
        ]
        logits = self.runner.execute(entries)
        self._store_prompt_logprobs(out, entries)
        self.scheduler.update_after_step(out)
        touched = self._sample(out, logits, time.monotonic())
        return [self._make_output(r) for r in failed + list(touched.values())
                if r.params.output_kind == RequestOutputKind.CUMULATIVE or r.finished]

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler and masker (made on first use)."""
        if self._structured is None:
            from .structured.engine_state import StructuredOutputs  # xgrammar only when used

            self._structured = StructuredOutputs(self.tokenizer, self.runner.vocab_size, self.loaded.eos_token_ids)
        return self._structured

    def _admit_compiled(self) -> list[Request]:
        """Move held sequences whose grammar is ready into the scheduler; finish (aborted) those
        whose compile failed and return their requests."""
        if self._structured is None or not self._structured.held:
            return []
        ready, failed = self._structured.take_done()
        for seq in ready:
            self.scheduler.add_sequence(seq)
        out = []
        for seq, exc in failed:
            logger.warning("request %s: grammar failed to compile: %s", seq.request_id, exc)
            request = self.requests.get(seq.request_id)
            if request is not None:
                self._abort_unscheduled(request)
                out.append(request)
        return out

    def _abort_unscheduled(self, request: Request) -> None:
        """Finish a request that never reached the scheduler, with all of its n sequences."""
        request.forked = True
        for index in range(len(request.seqs), request.params.num_sequences):
            child = Sequence(seq_id=f"{request.request_id}#{index}", prompt_token_ids=list(request.prompt_token_ids),
                             sampling_params=request.params)
            request.seqs.append(self._init_sequence(request, child, index))
        for seq in request.seqs:
            seq.status = SequenceStatus.FINISHED_ABORTED
            seq.text.finish()
        request.metrics.finished_time = time.monotonic()

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, now: float) -> dict[str, Request]:
        """Sample the next token of every sequence whose chunk reached its end, and verify the drafts of the
        speculating ones (spec_decode.verify); returns the requests touched."""
        touched: dict[str, Request] = {}
        rows, seqs, prefixes, verifying = self._sampling_rows(out, now)
        if not seqs:
            return touched
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, dtype=torch.long)]
        off_grammar: set[int] = set()
        if self._structured is not None and any(s.grammar is not None for s in seqs):
            off_grammar = self._structured.mask(logits, seqs, prefixes) if verifying else \
                self._structured.mask(logits, seqs)
        states = [
            SamplingState(
                params=s.sampling_params,
                prompt_token_ids=s.prompt_token_ids,
                # a row verifying drafts is sampled as if the drafts before it were output already
                output_token_ids=s.output_token_ids + prefix if prefix else s.output_token_ids,
                generator=s.generator,
                # a completed grammar allows only EOS: min_tokens must not ban it then
                eos_token_ids=frozenset() if _grammar_completed(s) else s.eos_token_ids,
            )
            for s, prefix in zip(seqs, prefixes, strict=True)
        ]
        rewinds = {i: GeneratorRewind.take(e.seq.generator, e.seq.sampling_params, self.runner.vocab_size)
                   for i, e in verifying.items()}
        results = self.sampler(logits, states)
        i = 0
        while i < len(seqs):
            seq = seqs[i]
            request = self.requests[seq.request_id]
            touched[request.request_id] = request
            entry = verifying.get(i)
            if i in off_grammar:  # its tokens left the grammar: end it rather than sample on
                logger.warning("sequence %s left its grammar; finishing it", seq.seq_id)
                self._finish(request, seq, SequenceStatus.FINISHED_ABORTED, now)
            elif entry is None:
                self._append_token(request, seq, results[i], now)
            else:
                self._verify(request, entry, results[i : i + 1 + entry.num_draft_tokens], rewinds[i], now)
            i += 1 if entry is None else 1 + entry.num_draft_tokens
        return touched

    def _sampling_rows(self, out: SchedulerOutput, now: float) -> tuple[
            list[int], list[Sequence], list[list[int]], dict[int, ScheduledSequence]]:
        """Per row to sample: the logits row, the sequence, the drafts before it; and the entries verifying
        drafts, by their first row (each has 1 + its drafts rows)."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        prefixes: list[list[int]] = []
        verifying: dict[int, ScheduledSequence] = {}
        row = 0
        for e in out.scheduled:
            request = self.requests.get(e.seq.request_id)
            if request is not None and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            if not e.completes_sequence:
                continue
            if request is not None and e.num_draft_tokens:
                verifying[len(seqs)] = e
                for j in range(1 + e.num_draft_tokens):
                    rows.append(row + j)
                    seqs.append(e.seq)
                    prefixes.append(e.draft_token_ids[:j])
            elif request is not None:
                for seq in self._sequences_to_sample(request, e.seq):
                    rows.append(row)
                    seqs.append(seq)
                    prefixes.append([])
            row += 1 + e.num_draft_tokens
        return rows, seqs, prefixes, verifying

    def _verify(self, request: Request, entry: ScheduledSequence, results: list[SampleResult],
                rewind: GeneratorRewind | None, now: float) -> None:
        """Emit the accepted drafts and the token after them, then give back what was not used: the rejected
        drafts' KV slots and (seeded rows) the uniforms of the rows past the walk."""
        seq = entry.seq

        def append(j: int) -> bool:
            self._append_token(request, seq, results[j], now)
            return seq.is_finished()

        used, accepted = emit([r.token_id for r in results], entry.draft_token_ids, append)
        if rewind is not None:
            rewind.keep(used)
        assert self.speculator is not None
        self.speculator.verified(entry, accepted)
        self.scheduler.finish_drafts(entry, accepted)

    def _store_prompt_logprobs(self, out: SchedulerOutput, entries: list[SeqBatchEntry]) -> None:
        """The runner's prompt scores, by prompt position: a recomputed chunk (after a preemption)
        overwrites the same positions with the same values."""
        decode = self.tokenizer.decode
        for i, scored in self.runner.last_prompt_logprobs.items():
            e, targets = out.scheduled[i], entries[i].prompt_targets or []
            plp = e.seq.prompt_logprobs
            if plp is None:
                continue
            for j, tid in enumerate(targets):
                entry = {t: Logprob(logprob=lp, rank=r, decoded_token=decode([t]))
                         for r, (t, lp) in enumerate(scored.top[j], start=1)}
                if tid not in entry:
                    entry[tid] = Logprob(logprob=scored.logprobs[j], rank=scored.ranks[j], decoded_token=decode([tid]))
                plp[e.start_pos + j + 1] = entry

    def _apply_block_moves(self, out: SchedulerOutput) -> None:
        if out.blocks_to_swap_out:
            self.runner.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self.runner.swap_in(out.blocks_to_swap_in)
        if out.blocks_to_copy:
            self.runner.copy_blocks(out.blocks_to_copy)
            if self.speculator is not None and self.speculator.draft is not None:
                self.speculator.draft.copy_blocks(out.blocks_to_copy)

    def _sequences_to_sample(self, request: Request, seq: Sequence) -> list[Sequence]:
        if request.forked or request.params.num_sequences == 1:
            return [seq]
        # First token of an n>1 request: the children share every prompt block with the parent.
        request.forked = True
        for index in range(1, request.params.num_sequences):
            child = Sequence(
                seq_id=f"{request.request_id}#{index}",
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=request.params,
                arrival_time=seq.arrival_time,
                priority=seq.priority,
                eos_token_ids=seq.eos_token_ids,
                cache_salt=seq.cache_salt,
                lora_request=seq.lora_request,
            )
            request.seqs.append(self._init_sequence(request, child, index))
            child.grammar = seq.grammar  # each child walks the grammar on its own
            child.matcher = seq.matcher.fresh() if seq.matcher is not None else None
            self.scheduler.add_forked(seq, child)
        return list(request.seqs)

    def _append_token(self, request: Request, seq: Sequence, result: SampleResult, now: float) -> None:
        token = result.token_id
        seq.append_output_token(token)
        self.generation_tokens_total += 1
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        seq.cumulative_logprob += result.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(result))
        seq.text.append(token)
        status = self._check_stop(seq, token)
        if status is not None:
            self._finish(request, seq, status, now)

    def _finish(self, request: Request, seq: Sequence, status: SequenceStatus, now: float) -> None:
        seq.text.finish()
        seq.matcher = None  # a finished sequence (stop string, length, EOS) needs no grammar state
        self.scheduler.finish_sequence(seq, status)
        if request.finished:
            request.metrics.finished_time = now

    def _check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        params = seq.sampling_params
        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens or (token in seq.eos_token_ids and _grammar_completed(seq)):
            if not params.ignore_eos and token in seq.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if seq.text.stopped:
            seq.stop_reason = seq.text.stop_reason
            return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
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

    def _make_output(self, request: Request) -> RequestOutput:
        finished = request.finished
        seqs = request.seqs
        best_of = request.params.num_sequences > request.params.n
        if finished and best_of:
            # best_of: keep the n most likely sequences.
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: request.params.n]
        outputs = []
        for index, seq in enumerate(seqs):
            done = seq.is_finished()
            text = seq.text.text if done else seq.text.emitted_text
            outputs.append(
                CompletionOutput(
                    index=index if finished and best_of else seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.status.finish_reason if done else None,
                    stop_reason=seq.stop_reason,
                )
            )
        if finished:
            del self.requests[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            metrics=request.metrics,
            prompt_logprobs=request.seqs[0].prompt_logprobs,
        )

    # ----------------------------------------------------------------- stats
    def get_stats(self) -> EngineStats:
        kv = self.scheduler.kv_stats()
        spec = self.speculator.stats if self.speculator is not None else None
        return EngineStats(
            kv_cache_usage=kv.usage,
            kv_cache_token_usage=kv.token_usage,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preempted_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries_total=kv.prefix_cache_queries,
            prefix_cache_hits_total=kv.prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_total_blocks=kv.num_total_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_waste=kv.waste,
            model_weight_bytes=self.loaded.weight_bytes,
            quantization=self.loaded.quantization,
            spec_decode_num_drafts=spec.num_drafts if spec else 0,
            spec_decode_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_decode_num_accepted_tokens_per_pos=tuple(spec.accepted_per_pos) if spec else (),
            max_loras=self.config.max_loras if self.runner.lora is not None else 0,
            lora_running=_adapter_names(self.scheduler.running),
            lora_waiting=_adapter_names(self.scheduler.waiting),
        )

    def warmup(self) -> None:
        self.runner.warmup()

    def wait_for_kv_cache_mapped(self, num_blocks: int | None = None) -> None:
        """Block until the KV cache's first ``num_blocks`` blocks (None: all) are mapped in: the blocks
        the scheduler hands out first (see ``host_malloc.PagePopulation``)."""
        self.runner.wait_for_kv_cache_mapped(num_blocks)

    def pause_kv_cache_mapping_while(self, busy: Callable[[], bool]) -> None:
        """From now on the rest of the KV cache maps in only while ``busy()`` is false: in a server's idle
        time, off its steps' cores. Offline runs keep it beside their steps, where it finishes sooner."""
        self.runner.pause_kv_cache_mapping_while(busy)

    def check_health(self) -> None:
        """Raise when the engine cannot take another step (a rank of several is gone); nothing with one."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        """Stop the other ranks' processes (nothing to do with one rank); the engine takes no steps after."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

"""LLM: the offline API, shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine
from .lora import LoRARequest
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    cum_logprob: float = 0.0
    text: str = ""
    finished: bool = False
    generated: list[int] = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def _final_only(params: SamplingParams) -> SamplingParams:
    """The offline API returns finished outputs only, so it asks the engine for nothing else (as vLLM's LLM
    does); on a copy, leaving the caller's params as they were."""
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


class LLM:
    def __init__(self, model: str = "builtin://smollm2-135m", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        # as the daemon does at start: the first kernels run, and on a GPU the decode graphs are captured
        self.engine.warmup()
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; ``lora_request``: one adapter for all of them, or one (or None, the
        base model) per prompt."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompts)} prompts; pass one or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts; pass one or one per prompt")
        for p in params_list:
            if p.use_beam_search:
                raise ValueError("use_beam_search: call LLM.beam_search with BeamSearchParams")
        params_list = [_final_only(p) for p in params_list]
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, params, priority=priority[i] if priority else 0,
                                        lora_request=loras[i])
                ids.append(rid)
        except ValueError:
            self.engine.abort_request(ids)  # all-or-nothing: never leave half a batch running
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(list(self.engine.requests))
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> list[int]:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        text = self.engine.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
        )
        return list(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search as in vLLM v1: each beam step is one token per beam, with prefix caching sharing
        every full KV block among the beams (a hit is a reference-count increment, no recompute)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        tok = self.engine.tokenizer
        eos = self.engine.loaded.eos_token_ids
        width = params.beam_width
        step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width)
        results = []
        for prompt in prompts:
            prompt_ids = self.engine.input_processor.process_prompt(prompt).token_ids
            beams = [BeamSearchSequence(tokens=list(prompt_ids))]
            finished: list[BeamSearchSequence] = []
            for _ in range(params.max_tokens):
                if not beams:
                    break
                outs = self.generate([{"prompt_token_ids": b.tokens} for b in beams], step_params, use_tqdm=False)
                candidates: list[BeamSearchSequence] = []
                for beam, out in zip(beams, outs, strict=True):
                    step_logprobs = out.outputs[0].logprobs[0]
                    for tid, lp in step_logprobs.items():
                        candidates.append(
                            BeamSearchSequence(
                                tokens=beam.tokens + [tid],
                                cum_logprob=beam.cum_logprob + lp.logprob,
                                generated=beam.generated + [tid],
                            )
                        )
                candidates.sort(key=lambda c: c.cum_logprob, reverse=True)
                beams = []
                for cand in candidates[: 2 * width]:
                    if not params.ignore_eos and cand.generated[-1] in eos:
                        cand.finished = True
                        finished.append(cand)
                    elif len(beams) < width:
                        beams.append(cand)
                    if len(beams) >= width:
                        break
                if len(prompt_ids) + len(beams[0].generated if beams else []) >= self.engine.max_model_len - 1:
                    break
            finished.extend(beams)

            def score(s: BeamSearchSequence) -> float:
                return s.cum_logprob / (max(1, len(s.generated)) ** params.length_penalty)

            best = sorted(finished, key=score, reverse=True)[:width]
            for s in best:
                s.text = tok.decode(s.generated, skip_special_tokens=True)
            results.append(BeamSearchOutput(sequences=best))
        return results


__all__ = ["LLM", "BeamSearchOutput", "BeamSearchSequence", "CompletionOutput"]

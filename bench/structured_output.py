"""Structured-output costs on the builtin model (CPU): grammar compile time (cold / cache hit), the
mask cost per token per sequence (xgrammar fill + apply on [rows, vocab] logits), and what
constrained requests cost a real LLMEngine batch: all-free vs half-constrained (regex and JSON
schema), run interleaved so that machine noise hits every configuration alike.

Constrained requests run through the engine's own path (SamplingParams.structured_outputs); the
engine's mask step and sampler are timed in place. Usage: python bench/structured_output.py [--quick]
Writes bench/results/structured_output.json."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvpilot.common.tools import parse_tool_choice, parse_tools
from kvpilot.daemon.engine import LLM, SamplingParams
from kvpilot.daemon.engine.structured import (
    BatchMasker,
    GrammarCompiler,
    StructuredOutputSpec,
    apply_token_bitmask,
)
from kvpilot.daemon.tools import forced_call_spec

RESULTS = Path(__file__).resolve().parent / "results"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
SPECS = {
    "choice": StructuredOutputSpec.choice(["yes", "no", "maybe"]),
    "regex_phone": StructuredOutputSpec.regex(r"\(\d{3}\) \d{3}-\d{4}"),
    "json_object": StructuredOutputSpec.json_object(),
    "json_schema_person": StructuredOutputSpec.json_schema(PERSON),
    "json_schema_people_50": StructuredOutputSpec.json_schema({"type": "array", "items": PERSON, "minItems": 50}),
    "ebnf_arith": StructuredOutputSpec.grammar('root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"'),
    "tool_required_2": forced_call_spec(*(lambda t: (t, parse_tool_choice("required", t, auto_enabled=False)))(
        parse_tools([{"type": "function", "function": {"name": n, "parameters": PERSON}} for n in ("a", "b")]))),
}
# Never complete within max_tokens, so every constrained row is masked on every step.
LONG_REGEX = StructuredOutputSpec.regex(r"[a-z ,.]{2000}")
LONG_JSON = SPECS["json_schema_people_50"]


def compile_times(llm: LLM) -> dict:
    eng = llm.engine
    out = {}
    for name, spec in SPECS.items():
        comp = GrammarCompiler(eng.tokenizer, eng.vocab_size, eng.loaded.eos_token_ids)  # empty cache
        t = time.perf_counter()
        comp.compile(spec)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        comp.compile(spec)
        warm = time.perf_counter() - t
        comp.shutdown()
        out[name] = {"cold_ms": round(cold * 1e3, 3), "cache_hit_ms": round(warm * 1e3, 4)}
    return out


def mask_costs(llm: LLM, batch_sizes: list[int], reps: int) -> dict:
    """Per masked row: fill (grammar) and apply (logits write), at mid-JSON positions."""
    eng = llm.engine
    comp = GrammarCompiler(eng.tokenizer, eng.vocab_size, eng.loaded.eos_token_ids)
    ids = eng.tokenizer.encode(json.dumps([{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}] * 3),
                               add_special_tokens=False)
    out = {}
    for spec_name, spec in (("json_schema_people_50", LONG_JSON), ("regex_long", LONG_REGEX)):
        compiled = comp.compile(spec)
        prefix = ids if spec is LONG_JSON else eng.tokenizer.encode("hello there, kv", add_special_tokens=False)
        for b in batch_sizes:
            matchers = []
            for i in range(b):
                m = comp.matcher(compiled)
                assert m.sync(prefix[: (i * 7) % len(prefix)])
                matchers.append(m)
            masker, logits = BatchMasker(eng.vocab_size), torch.randn(b, eng.vocab_size)
            bitmask = masker._rows_buffer(b)  # noqa: SLF001 - timing the two halves separately
            fills, applies = [], []
            for _ in range(reps):
                t = time.perf_counter()
                for r, m in enumerate(matchers):
                    m.fill_bitmask(bitmask, r)
                t2 = time.perf_counter()
                apply_token_bitmask(logits, list(range(b)), bitmask)
                t3 = time.perf_counter()
                fills.append((t2 - t) / b)
                applies.append((t3 - t2) / b)
            out[f"{spec_name}/rows={b}"] = {"fill_us_per_row": round(statistics.median(fills) * 1e6, 1),
                                            "apply_us_per_row": round(statistics.median(applies) * 1e6, 1)}
    comp.shutdown()
    return out


class EngineTimer:
    """Times the engine's own mask step and its sampler; constrained requests go in through
    SamplingParams.structured_outputs, as users send them."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.state = eng.structured_outputs()
        self.compiler = self.state.compiler
        self.inner_sampler, self.inner_mask = eng.sampler, self.state.mask
        self.mask_seconds = self.sample_seconds = 0.0
        self.masked_rows = 0
        eng.sampler, self.state.mask = self._sample, self._mask

    def _mask(self, logits, seqs):
        t = time.perf_counter()
        failed = self.inner_mask(logits, seqs)
        self.mask_seconds += time.perf_counter() - t
        self.masked_rows += sum(1 for s in seqs if s.grammar is not None) - len(failed)
        return failed

    def _sample(self, logits, states):
        t = time.perf_counter()
        res = self.inner_sampler(logits, states)
        self.sample_seconds += time.perf_counter() - t
        return res

    def close(self) -> None:
        self.eng.sampler = self.inner_sampler
        del self.state.mask  # back to the class's method


def batch_run(llm: LLM, hook: EngineTimer, batch: int, constrained: StructuredOutputSpec | None,
              max_tokens: int) -> dict:
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe person number {i}."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(batch)]
    params = []
    for i in range(batch):
        spec = constrained if i % 2 == 0 else None
        params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True,
                                     structured_outputs=spec))
    hook.mask_seconds = hook.sample_seconds = 0.0
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_tok == batch * max_tokens
    return {"wall_s": wall, "tokens": n_tok, "mask_s": hook.mask_seconds, "sample_s": hook.sample_seconds}


def mixed_batches(llm: LLM, batch: int, max_tokens: int, rounds: int) -> dict:
    hook = EngineTimer(llm.engine)
    configs = {"none": None, "half_regex": LONG_REGEX, "half_json_schema": LONG_JSON}
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    batch_run(llm, hook, batch, None, 8)  # warm-up
    for _ in range(rounds):
        for name, spec in configs.items():  # interleaved: noise hits every config alike
            runs[name].append(batch_run(llm, hook, batch, spec, max_tokens))
    hook.close()
    out = {}
    base = statistics.median(r["tokens"] / r["wall_s"] for r in runs["none"])
    for name, rs in runs.items():
        tps = statistics.median(r["tokens"] / r["wall_s"] for r in rs)
        out[name] = {
            "tokens_per_s": round(tps, 1),
            "relative_to_none": round(tps / base, 4),
            "mask_ms_per_step": round(statistics.median(r["mask_s"] for r in rs) / max_tokens * 1e3, 3),
            "sample_ms_per_step": round(statistics.median(r["sample_s"] for r in rs) / max_tokens * 1e3, 3),
            "step_ms": round(statistics.median(r["wall_s"] for r in rs) / max_tokens * 1e3, 2),
            # The mask's share of a step: what every row in the batch (constrained or not) waits for.
            "mask_share_of_step": round(statistics.median(r["mask_s"] / r["wall_s"] for r in rs), 5),
            "walls_s": [round(r["wall_s"], 3) for r in rs],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.rounds = 8, 16, 1
    llm = LLM(model="builtin://smollm2-135m", num_kv_blocks=1024)
    result = {
        "model": "builtin://smollm2-135m", "device": "cpu", "torch_threads": torch.get_num_threads(),
        "note": "shared 2-core CPU; unconstrained and constrained rows share each step, so the cost to "
                "unconstrained rows is the step-time increase (relative_to_none)",
        "compile": compile_times(llm),
        "mask_cost": mask_costs(llm, [1, 8, 32] if not args.quick else [1, 8], 20 if not args.quick else 3),
        "mixed_batch": {"batch": args.batch, "constrained_fraction": 0.5, "max_tokens": args.max_tokens,
                        **mixed_batches(llm, args.batch, args.max_tokens, args.rounds)},
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("structured_output_quick.json" if args.quick else "structured_output.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Structured outputs on the real model: SamplingParams(structured_outputs=...) through the real
LLMEngine (compile, hold, mask, n > 1, stop strings, preemption), plus spec validation,
compile cache, matcher rollback/fork and masking of padded vocabularies."""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from kvpilot.daemon.engine import LLM, SamplingParams
from kvpilot.daemon.engine.structured import (
    BatchMasker,
    GrammarCompiler,
    StructuredOutputError,
    StructuredOutputSpec,
    spec_from_request,
)

MODEL = "builtin://smollm2-135m"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


class GuidedSampler:
    """Constrains requests through the engine's own path (SamplingParams.structured_outputs) and
    counts what its masking step does: rows masked, and outputs that left their grammar."""

    def __init__(self, engine) -> None:
        self.state = engine.structured_outputs()
        self.compiler = self.state.compiler
        self.rejected = 0
        self.masked_rows = 0
        inner = self.state.mask

        def counting_mask(logits, seqs):
            failed = inner(logits, seqs)
            self.rejected += len(failed)
            self.masked_rows += sum(1 for i, s in enumerate(seqs) if s.grammar is not None and i not in failed)
            return failed

        self.state.mask = counting_mask

    def constrain(self, params: SamplingParams, spec: StructuredOutputSpec) -> SamplingParams:
        return dataclasses.replace(params, structured_outputs=spec.validate())

    def close(self) -> None:
        del self.state.mask  # back to the class's method


@pytest.fixture
def guided(llm):
    g = GuidedSampler(llm.engine)
    yield g
    g.close()


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def run(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


# ----------------------------------------------------------------- generation on the real model
def test_choice_regex_json_schema_json_object(llm, guided):
    cases = [
        (chat(llm, "Is the sky green? Answer yes, no or maybe."), StructuredOutputSpec.choice(["yes", "no", "maybe"])),
        (chat(llm, "Give me a phone number."), StructuredOutputSpec.regex(r"\d{3}-\d{4}")),
        (chat(llm, "Describe a person as JSON with name and age."), StructuredOutputSpec.json_schema(PERSON)),
        (chat(llm, "Return a JSON object about Paris."), StructuredOutputSpec.json_object()),
    ]
    params = [guided.constrain(SamplingParams(temperature=0, max_tokens=96), spec) for _, spec in cases]
    outs = run(llm, [p for p, _ in cases], params)
    texts = [o[0].text for o in outs]
    assert texts[0] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\d{3}-\d{4}", texts[1]), texts[1]
    jsonschema.validate(json.loads(texts[2]), PERSON)
    assert isinstance(json.loads(texts[3]), dict), texts[3]
    assert [o[0].finish_reason for o in outs] == ["stop"] * 4  # the grammar ended, then EOS was forced
    assert guided.rejected == 0 and guided.masked_rows > 0


def test_unconstrained_rows_are_untouched_in_a_mixed_batch(llm, guided):
    free_prompt = chat(llm, "Write one sentence about the sea.")
    alone = run(llm, [free_prompt], SamplingParams(temperature=0, max_tokens=24))[0][0].token_ids
    constrained = [guided.constrain(SamplingParams(temperature=0, max_tokens=24), StructuredOutputSpec.json_schema(PERSON))
                   for _ in range(3)]
    prompts = [chat(llm, f"Person number {i} as JSON.") for i in range(3)]
    outs = run(llm, [prompts[0], free_prompt, prompts[1], prompts[2]],
               [constrained[0], SamplingParams(temperature=0, max_tokens=24), constrained[1], constrained[2]])
    assert outs[1][0].token_ids == alone
    assert all(o[0].text.startswith("{") for o in (outs[0], outs[2], outs[3]))


def test_n_greater_than_one_each_sequence_has_its_own_matcher(llm, guided):
    spec = StructuredOutputSpec.regex(r"(red|green|blue)( (red|green|blue)){2}")
    params = guided.constrain(SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16), spec)
    outs = run(llm, [chat(llm, "Name three colours.")], params)[0]
    assert len(outs) == 4
    for o in outs:
        assert re.fullmatch(r"(red|green|blue)( (red|green|blue)){2}", o.text), o.text
    assert len({tuple(o.token_ids) for o in outs}) > 1  # independent samples, not one copied four times
    assert guided.rejected == 0


def test_stop_string_ends_a_constrained_sequence(llm, guided):
    spec = StructuredOutputSpec.regex(r"[0-9]{4}-[0-9]{4}")
    params = guided.constrain(SamplingParams(temperature=0, max_tokens=32, stop=["-"]), spec)
    out = run(llm, [chat(llm, "A serial number:")], params)[0][0]
    assert re.fullmatch(r"[0-9]{4}", out.text) and out.finish_reason == "stop" and out.stop_reason == "-"


def test_preemption_keeps_outputs_in_the_grammar():
    small = LLM(model=MODEL, num_kv_blocks=10, block_size=16)  # 160 tokens for 4 x ~90: preempts
    guided = GuidedSampler(small.engine)
    try:
        spec = StructuredOutputSpec.regex(r"[0-9]{50}")
        prompts = [chat(small, f"Digits, list {i}:") for i in range(4)]
        params = [guided.constrain(SamplingParams(temperature=1.0, seed=i, max_tokens=60), spec) for i in range(4)]
        outs = run(small, prompts, params)
        assert small.engine.get_stats().num_preempted_total > 0
        for o in outs:
            assert re.fullmatch(r"[0-9]{50}", o[0].text), o[0].text
        assert guided.rejected == 0
    finally:
        guided.close()


# ----------------------------------------------------------------- matcher state
@pytest.fixture(scope="module")
def compiler(llm):
    c = GrammarCompiler(llm.get_tokenizer(), llm.engine.vocab_size, llm.engine.loaded.eos_token_ids)
    yield c
    c.shutdown()


def _allowed(compiler, matcher) -> set[int]:
    logits = torch.zeros(1, compiler.vocab_size)
    BatchMasker(compiler.vocab_size).apply(logits, [0], [matcher])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_rollback_fork_and_sync_replay(llm, compiler):
    tok = llm.get_tokenizer()
    compiled = compiler.compile(StructuredOutputSpec.json_schema(PERSON))
    ids = tok.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    m = compiler.matcher(compiled)
    start = _allowed(compiler, m)
    assert all(m.accept(t) for t in ids[:5])
    mid = _allowed(compiler, m)
    twin = m.fork()
    assert all(m.accept(t) for t in ids[5:])
    assert m.is_completed() and _allowed(compiler, m) == set(llm.engine.loaded.eos_token_ids)
    assert _allowed(compiler, twin) == mid  # the fork did not move with m
    m.rollback(len(ids) - 5)
    assert _allowed(compiler, m) == mid and m.num_accepted == 5
    # Preemption/recompute or a restart: sync replays or rolls back to whatever the output now is.
    assert m.sync(ids) and m.is_completed()
    assert m.sync([]) and _allowed(compiler, m) == start
    assert m.sync(ids[:3]) and m.accepted == ids[:3]
    assert not m.sync(ids[:3] + tok.encode("zzz", add_special_tokens=False)) and m.failed
    assert not _allowed(compiler, m) < set(range(compiler.vocab_size))  # a failed matcher masks nothing


def test_padded_vocabulary_ids_are_masked(llm):
    tok = llm.get_tokenizer()
    width = llm.engine.vocab_size + 64  # embedding rows padded past the tokenizer
    c = GrammarCompiler(tok, width, llm.engine.loaded.eos_token_ids)
    try:
        m = c.matcher(c.compile(StructuredOutputSpec.choice(["yes", "no"])))
        logits = torch.randn(3, width)
        before = logits.clone()
        assert BatchMasker(width).apply(logits, [1], [m]) == [1]
        assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
        assert torch.isinf(logits[1, llm.engine.vocab_size :]).all()
        allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
        assert allowed and all(("yes".startswith(s) or "no".startswith(s)) and s for s in map(tok.decode, allowed))
    finally:
        c.shutdown()


# ----------------------------------------------------------------- cache
def test_compile_cache_is_keyed_by_canonical_spec(compiler):
    a = StructuredOutputSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputSpec.json_schema('{ "type" : "object",\n  "properties": {"x": {"type": "integer"}}}')
    hits = compiler.stats.hits
    fa, fb = compiler.submit(a), compiler.submit(b)
    assert fa is fb and compiler.stats.hits == hits + 1
    assert fa.result(timeout=60) is not None
    assert compiler.submit(StructuredOutputSpec.regex("x+")) is not fa


# ----------------------------------------------------------------- request parsing and errors
@pytest.mark.parametrize(("body", "spec"), [
    ({"response_format": {"type": "json_object"}}, StructuredOutputSpec.json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     StructuredOutputSpec.json_schema(PERSON)),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputSpec.choice(["a", "b"])),
    ({"structured_outputs": {"regex": "[a-z]+", "backend": "xgrammar"}}, StructuredOutputSpec.regex("[a-z]+")),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, StructuredOutputSpec.grammar('root ::= "a" | "b"')),
    ({"structured_outputs": {"grammar": 'start: "a" "b"+'}}, StructuredOutputSpec.grammar('start: "a" "b"+')),
    ({"guided_json": json.dumps(PERSON)}, StructuredOutputSpec.json_schema(PERSON)),
    ({"guided_choice": ["x"]}, StructuredOutputSpec.choice(["x"])),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
])
def test_spec_from_request(body, spec):
    assert spec_from_request(body) == spec


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
     "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar", '"foo" is not defined'),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"guided_json": {"type": "string", "minLength": -1}}, "guided_json", "minLength"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
])
def test_bad_constraints_name_the_field(body, field, words):
    with pytest.raises(StructuredOutputError) as info:
        spec_from_request(body)
    assert info.value.field == field
    assert words in info.value.message
    assert "/project/cpp" not in str(info.value)  # xgrammar's source location is cleaned away


# ----------------------------------------------------------------- engine edges
def test_sampling_params_take_the_vllm_dict_form():
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs == \
        StructuredOutputSpec.choice(["a", "b"])
    with pytest.raises(StructuredOutputError):
        SamplingParams(structured_outputs={"regex": "a(b"})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


def test_held_requests_abort_and_failed_compiles_finish(llm, monkeypatch):
    eng = llm.engine
    params = SamplingParams(n=2, max_tokens=4, structured_outputs={"regex": "[a-z]{3}"})
    eng.add_request("held-abort", chat(llm, "hi"), params)
    eng.abort_request("held-abort")
    assert eng.step() == [] and not eng.has_unfinished_requests()
    broken: Future = Future()
    broken.set_exception(StructuredOutputError("structured_outputs.regex", "cannot compile: test"))
    monkeypatch.setattr(eng.structured_outputs().compiler, "submit", lambda _spec: broken)
    eng.add_request("held-fail", chat(llm, "hi"), params)
    (out,) = eng.step()
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort", "abort"]
    assert not eng.has_unfinished_requests()

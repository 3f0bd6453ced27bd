"""Speculative decoding without a model: the config's checks, the n-gram lookup, the policy, and the
verification rule against the target distribution (chi-square), seeded runs included."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import pytest
import torch

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.sampler import Sampler, SamplingState, make_generator
from kvpilot.daemon.engine.sampling_params import SamplingParams
from kvpilot.daemon.engine.sequence import Sequence as Seq
from kvpilot.daemon.engine.spec_decode import parse_speculative_config
from kvpilot.daemon.engine.spec_decode.ngram import ngram_propose
from kvpilot.daemon.engine.spec_decode.policy import BASE_COOLDOWN, AcceptanceGate
from kvpilot.daemon.engine.spec_decode.speculator import Speculator
from kvpilot.daemon.engine.spec_decode.verify import GeneratorRewind, accepted_prefix, emit

# --- config ---------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.parametrize("raw, field", [
    ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({**NGRAM, "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
    ({**NGRAM, "method": "medusa"}, "method must be one of ngram, draft_model"),
    ({**NGRAM, "method": "eagle"}, "method: eagle is not supported .*out of scope"),
    ({"num_speculative_tokens": 3}, "method is required"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(3\)"),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
    ({**NGRAM, "model": "self:3"}, "speculative_config.model is for method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model is required"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "self:0"}, "layer count N >= 1"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "self:4", "prompt_lookup_max": 3},
     "are for method ngram"),
    ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
    ({**NGRAM, "num_spec_tokens": 3}, "unknown key.*num_spec_tokens"),
    ("{not json", "speculative_config is not JSON"),
    ("[4]", "must be a JSON object"),
])
def test_bad_configs_name_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=raw)


def test_config_defaults_and_json():
    spec = parse_speculative_config(json.dumps(NGRAM))
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 4, 3, 5)
    assert spec.disable_by_batch_size == 8
    assert EngineConfig(speculative_config=json.dumps(NGRAM)).speculative_config == NGRAM
    assert parse_speculative_config({**NGRAM, "prompt_lookup_max": 2}).prompt_lookup_min == 2  # follows the max
    assert parse_speculative_config({**NGRAM, "prompt_lookup_min": 7}).prompt_lookup_max == 7  # follows the min
    draft = parse_speculative_config({"model": "self:6", "num_speculative_tokens": 2})  # method inferred, as vLLM
    assert (draft.method, draft.self_draft_layers) == ("draft_model", 6)
    assert parse_speculative_config({"model": "hf://org/d", "num_speculative_tokens": 2}).self_draft_layers is None
    assert EngineConfig().speculative is None


# --- ngram ----------------------------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    assert ngram_propose(ctx, 3, 2, 4) == [7, 8, 6]  # "1 2 3" last seen before 7 8 6
    assert ngram_propose(ctx, 6, 2, 4) == [7, 8, 6, 1, 2, 3]  # up to the end of the context
    assert ngram_propose(ctx, 8, 2, 4) == [4, 5, 9, 9, 1, 2, 3, 7]  # the latest match with 8 tokens after it
    assert ngram_propose(ctx + [5], 2, 2, 4) == []  # "3 5" never occurs before
    assert ngram_propose(ctx + [5], 2, 1, 4) == [9, 9]  # a 1-gram does
    assert ngram_propose([4, 4, 4, 4], 3, 2, 3) == [4]  # a repeated token: the match overlaps the suffix
    assert ngram_propose([4] * 9, 3, 2, 3) == [4, 4, 4]  # in a longer run, an earlier match gives k tokens
    loop = [1, 2, 3] * 4  # a cycle: the latest match with three tokens after it, not the very latest
    assert ngram_propose(loop, 3, 1, 1) == [1, 2, 3] and ngram_propose(loop, 5, 1, 1) == [1, 2, 3, 1, 2]
    assert ngram_propose([1], 3, 1, 3) == [] and ngram_propose([], 3, 1, 3) == []


def test_ngram_prefers_the_longest_suffix():
    # "2 3" last occurs before 0, but the longer "1 2 3" only before 5
    ctx = [1, 2, 3, 5, 8, 2, 3, 0, 1, 2, 3]
    assert ngram_propose(ctx, 1, 2, 3) == [5]
    assert ngram_propose(ctx, 1, 2, 2) == [0]


# --- policy ---------------------------------------------------------------------------------------------------

def test_gate_pauses_a_request_that_keeps_rejecting_and_backs_off():
    gate = AcceptanceGate()
    assert gate.allows()
    gate.record(4, 0)
    assert gate.allows()  # 0.5: still above 0.3
    gate.record(4, 0)  # 0.25: paused
    paused = 0
    while not gate.allows():
        paused += 1
    assert paused == BASE_COOLDOWN
    gate.record(4, 0)  # 0.25 again: the pause doubles
    paused = 0
    while not gate.allows():
        paused += 1
    assert paused == 2 * BASE_COOLDOWN
    gate.record(4, 4)
    assert gate.cooldown == BASE_COOLDOWN and gate.allows()


def test_draft_length_follows_the_last_verification():
    gate = AcceptanceGate()
    assert gate.draft_limit(4) == 4
    gate.record(4, 0)
    assert gate.draft_limit(4) == 1  # a probe after a miss at the first draft
    gate.record(1, 1)
    assert gate.draft_limit(4) == 4  # all accepted: the full k again
    gate.record(4, 2)
    assert gate.draft_limit(4) == 3 and gate.draft_limit(2) == 2


def _running(n: int, tokens: list[int]) -> list[Seq]:
    seqs = []
    for i in range(n):
        seq = Seq(f"s{i}", list(tokens), SamplingParams(max_tokens=100))
        seq.append_output_token(tokens[0])
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    return seqs


def test_no_drafts_above_disable_by_batch_size():
    spec = parse_speculative_config({**NGRAM, "disable_by_batch_size": 3})
    speculator = Speculator(spec, max_model_len=1000)
    tokens = [5, 6, 7, 8] * 4
    running = _running(4, tokens)
    speculator.plan(running)
    assert [s.num_draft_tokens for s in running] == [0, 0, 0, 0]
    speculator.plan(running[:3])
    assert [s.num_draft_tokens for s in running[:3]] == [4, 4, 4]


def test_drafts_fit_max_tokens_and_max_model_len():
    tokens = [5, 6, 7, 8] * 4
    (seq,) = _running(1, tokens)
    seq.sampling_params = SamplingParams(max_tokens=3)  # 1 out, 2 to go: the step's token and one draft
    Speculator(parse_speculative_config(NGRAM), max_model_len=1000).plan([seq])
    assert seq.num_draft_tokens == 1
    seq.sampling_params = SamplingParams(max_tokens=100)
    Speculator(parse_speculative_config(NGRAM), max_model_len=seq.num_tokens + 2).plan([seq])
    assert seq.num_draft_tokens == 2  # every verified position must fit the context


# --- verification: the target distribution, exactly ----------------------------------------------------------

V = 4
# A first-order "model": P[a] is the next-token distribution after token a. Every cell of the joint law of
# two tokens is >= 0.01, so 40,000 draws expect >= 400 in each.
P = torch.tensor([[0.50, 0.25, 0.15, 0.10],
                  [0.10, 0.20, 0.30, 0.40],
                  [0.25, 0.25, 0.25, 0.25],
                  [0.70, 0.10, 0.10, 0.10]], dtype=torch.float64)
CHI2_CRITICAL_15DF = 37.70  # p = 0.001 for 15 degrees of freedom (16 cells)

Rule = Callable[[Sequence[int], Sequence[int], Callable[[int], bool]], tuple[int, int]]


def _sample_rows(prev: list[int], params: SamplingParams) -> list[int]:
    """The engine's sampler on one row per entry of prev: the next token after each."""
    if not prev:
        return []
    logits = P[torch.tensor(prev)].log().float()
    states = [SamplingState(params=params, prompt_token_ids=[], output_token_ids=[]) for _ in prev]
    return [r.token_id for r in Sampler()(logits, states)]


def joint_counts(drafts: list[int], params: SamplingParams, trials: int, rule: Rule = emit) -> torch.Tensor:
    """Counts of the first two tokens after token 0, generated speculatively: one verification of ``drafts``
    (rows: after 0, after d1, after d2, ...), then plain steps for whatever the verification left."""
    torch.manual_seed(1234)
    rows_per_trial = 1 + len(drafts)
    sampled = _sample_rows([0, *drafts] * trials, params)
    outs: list[list[int]] = []
    for t in range(trials):
        got: list[int] = []
        row = sampled[t * rows_per_trial : (t + 1) * rows_per_trial]
        rule(row, drafts, lambda j, got=got, row=row: got.append(row[j]) or len(got) >= 2)
        outs.append(got)
    short = [t for t, got in enumerate(outs) if len(got) < 2]
    for t, tok in zip(short, _sample_rows([outs[t][-1] for t in short], params), strict=True):
        outs[t].append(tok)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for a, b in outs:
        counts[a, b] += 1
    return counts


def chi_square(counts: torch.Tensor) -> float:
    expected = P[0][:, None] * P * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("drafts", [[0, 0], [0, 3], [3, 0], [1], [2, 2, 2]])
def test_speculative_sampling_keeps_the_target_distribution(drafts):
    """Likely and unlikely drafts alike: the first two tokens follow P[0][a] * P[a][b]. With a wrong rule
    (accept d whenever P(d) >= 0.2, else sample) this fails with statistics in the hundreds."""
    counts = joint_counts(drafts, SamplingParams(temperature=1.0), trials=40_000)
    assert chi_square(counts) < CHI2_CRITICAL_15DF, counts


def test_the_chi_square_check_catches_a_biased_sampler():
    counts = joint_counts([0, 0], SamplingParams(temperature=0.8), trials=40_000)  # the law of P ** 1.25
    assert chi_square(counts) > CHI2_CRITICAL_15DF


def test_greedy_rows_accept_exactly_the_argmax():
    sampled = _sample_rows([0, 1, 3], SamplingParams(temperature=0.0))
    assert sampled == [0, 3, 0]
    assert accepted_prefix(sampled, [0, 3]) == 2 and accepted_prefix(sampled, [0, 2]) == 1


def test_emit_stops_at_a_finish_inside_the_accepted_run():
    appended: list[int] = []
    used, accepted = emit([7, 8, 9, 4], [7, 8, 9], lambda j: appended.append(j) or j == 1)
    assert (used, accepted, appended) == (2, 2, [0, 1])
    appended.clear()
    assert emit([7, 5, 9], [7, 8], lambda j: appended.append(j) or False) == (2, 1) and appended == [0, 1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.7, top_k=3,
                                                                                          top_p=0.9, seed=7)])
def test_seeded_speculation_emits_what_plain_sampling_does(params):
    """One uniform per emitted token, the unused ones given back: a seeded run with drafts (some right, some
    wrong) emits token for token what the same seed emits without them."""
    def plain(n: int) -> list[int]:
        gen, out = make_generator(params.seed), [0]
        while len(out) <= n:
            state = SamplingState(params, [], [], generator=gen)
            out.append(Sampler()(P[out[-1]][None].log().float(), [state])[0].token_id)
        return out[1:]

    def speculative(n: int) -> list[int]:
        gen, out = make_generator(params.seed), [0]
        while len(out) <= n:
            drafts = [out[-1], 0, 1][: 1 + len(out) % 3]  # a changing guess
            prev = [out[-1], *drafts]
            states = [SamplingState(params, [], [], generator=gen) for _ in prev]
            rewind = GeneratorRewind.take(gen, params, V)
            row = [r.token_id for r in Sampler()(P[torch.tensor(prev)].log().float(), states)]
            used, _ = emit(row, drafts, lambda j, row=row: out.append(row[j]) or False)
            rewind.keep(used)
        return out[1 : n + 1]

    assert speculative(60) == plain(60)

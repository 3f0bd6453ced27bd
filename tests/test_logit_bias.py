"""logit_bias in SamplingParams and the batched sampler: greedy and sampled rows, neighbours untouched."""

from __future__ import annotations

import pytest
import torch

from kvpilot.daemon.engine.input_processor import InputLimits, InputProcessor, TokenOutOfVocab
from kvpilot.daemon.engine.sampler import Sampler, SamplingState
from kvpilot.daemon.engine.sampling_params import SamplingParams


def state(**kw) -> SamplingState:
    return SamplingState(params=SamplingParams(**kw), prompt_token_ids=[1, 2], output_token_ids=[3])


def test_bias_moves_greedy_and_leaves_other_rows_alone():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0  # every row's greedy pick is 4
    logits_before = logits.clone()
    out = Sampler()(logits, [state(temperature=0.0, logit_bias={4: -100}),
                             state(temperature=0.0),
                             state(temperature=0.0, logit_bias={7: 100, 4: 0.0}, logprobs=1)])
    assert [r.token_id for r in out] == [int(logits[0, :4].argmax()), 4, 7]
    assert out[0].token_id != 4
    assert out[2].top_logprobs[0][0] == 7  # logprobs see the biased distribution, as in vLLM
    assert torch.equal(logits, logits_before)  # the caller's logits are not modified


def test_bias_applies_before_penalties_and_to_sampled_rows():
    logits = torch.zeros(2, 6)
    out = Sampler()(logits, [state(temperature=1.0, seed=1, logit_bias={5: 100}),
                             state(temperature=0.7, top_k=3, seed=2, repetition_penalty=1.5, logit_bias={2: 100})])
    assert [r.token_id for r in out] == [5, 2]  # 2 is a prompt token: the penalty divides 100 by 1.5, still the max


@pytest.mark.parametrize("bias", [{-1: 1.0}, {True: 1.0}, {"3": 1.0}, {1: 100.5}, {1: -101}, {1: "x"}, [1]])
def test_sampling_params_refuse_bad_bias(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_input_processor_checks_bias_ids_against_the_vocabulary():
    proc = InputProcessor(tokenizer=None, limits=InputLimits(max_model_len=64, vocab_size=10))
    proc.check_params(SamplingParams(logit_bias={9: 1.0}))
    with pytest.raises(TokenOutOfVocab) as e:
        proc.check_params(SamplingParams(logit_bias={10: 1.0}))
    assert e.value.param == "logit_bias"

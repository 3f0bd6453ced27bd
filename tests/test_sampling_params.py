"""SamplingParams validation."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine import RequestOutputKind, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"output_kind": 1}, "output_kind"),  # vLLM's DELTA: not offered here
        ({"output_kind": True}, "output_kind"),
        ({"output_kind": "FINAL_ONLY"}, "output_kind"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_output_kind_takes_vllm_values():
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY

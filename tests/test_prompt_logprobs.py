"""prompt_logprobs in the engine: chunked prefill accumulates per chunk, the prefix cache is skipped, and the
scores equal a plain log_softmax over the model's logits at every prompt position."""

from __future__ import annotations

import pytest
import torch

from kvpilot.daemon.engine import LLM
from kvpilot.daemon.engine.runner import SeqBatchEntry
from kvpilot.daemon.engine.sampling_params import SamplingParams

# longer than two KV blocks (16 tokens each), so that a plain request can hit the prefix cache
PROMPT = ("The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy is Rome, "
          "the capital of Spain is Madrid, and the capital of Portugal is")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPILOT_NUM_THREADS", "1")
        # a 5-token budget: the prompt is prefilled in several chunks
        # float32 on every machine ("auto" is bfloat16 where the CPU has AMX or AVX512-BF16): the
        # comparison with a one-prefix-at-a-time reference is float32's
        return LLM(dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=4, max_num_batched_tokens=5).engine


def run(engine, rid, ids, **kw):
    engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=2, **kw))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs[-1]


def test_chunked_prompt_logprobs_match_the_model(engine):
    ids = engine.tokenizer.encode(PROMPT)
    first = run(engine, "a", ids, prompt_logprobs=2)
    run(engine, "p1", ids)
    plain = run(engine, "p2", ids)
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # the cache does work
    again = run(engine, "b", ids, prompt_logprobs=2, n=2)  # same prompt: would be a prefix-cache hit
    assert again.num_cached_tokens == 0 and len(again.outputs) == 2
    for out in (first, again):
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for tid, d in zip(ids[1:], plp[1:], strict=True):
            assert tid in d and 2 <= len(d) <= 3 and d[tid].rank >= 1
            assert sorted(v.rank for t, v in d.items() if t != tid or v.rank <= 2)[:2] == [1, 2]
    assert [d[t].logprob for t, d in zip(ids[1:], again.prompt_logprobs[1:], strict=True)] == pytest.approx(
        [d[t].logprob for t, d in zip(ids[1:], first.prompt_logprobs[1:], strict=True)], abs=1e-5)
    # reference: the model's logits at each position, one prefix at a time (the engine is done with its blocks)
    runner = engine.runner
    table = list(range(runner.num_blocks - 8, runner.num_blocks))
    for p in range(1, len(ids)):
        logits = runner.execute([SeqBatchEntry(ids[:p], 0, table, True)])[0]
        ref = torch.log_softmax(logits, -1)
        assert first.prompt_logprobs[p][ids[p]].logprob == pytest.approx(ref[ids[p]].item(), abs=1e-3)
        best = int(ref.argmax())
        assert first.prompt_logprobs[p][best].rank == 1

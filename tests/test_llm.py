"""The offline LLM API on the real model: generate, sampling, stops, bad input, chat, beam search."""

from __future__ import annotations

import pytest

from kvpilot.daemon.engine import LLM, BeamSearchParams, RequestOutputKind, SamplingParams
from support.engine import all_free


def test_generate_text_and_token_prompts(llm):
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    text = outs[0].outputs[0].text
    assert "Paris" in text
    ids = outs[0].prompt_token_ids
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert again[0].outputs[0].finish_reason == "length"
    assert all_free(llm)


def test_one_params_per_prompt(llm):
    outs = llm.generate(
        ["Hello", "Count: one, two,"],
        [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)],
        use_tqdm=False,
    )
    assert len(outs[0].outputs[0].token_ids) <= 3
    assert len(outs[1].outputs[0].token_ids) == 7


def test_seed_reproducible_alone_and_in_batch_of_16(llm):
    prompt = "Write a short poem about the sea:"
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True) for _ in range(15)]
    batch_prompts = [f"Story number {i}:" for i in range(15)]
    batch = llm.generate(batch_prompts[:7] + [prompt] + batch_prompts[7:], others[:7] + [seeded] + others[7:],
                         use_tqdm=False)
    assert batch[7].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate([prompt], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_prompt_too_long_is_rejected_and_leaks_nothing(llm):
    too_long = [5] * (llm.engine.max_model_len + 10)
    with pytest.raises(ValueError, match="too long"):
        llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=llm.engine.max_model_len),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [-3]}, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert all_free(llm)


def test_stop_string_and_stop_token(llm):
    base = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert " 5" in base.text
    stopped = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=20, stop=[" 5"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 5"
    assert stopped.text == base.text[: base.text.index(" 5")]
    stop_tok = base.token_ids[2]
    by_token = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=20,
                                                                 stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert by_token.outputs[0].token_ids == base.token_ids[:3]
    assert by_token.outputs[0].stop_reason == stop_tok


def test_min_tokens_holds_back_eos(llm):
    out = llm.generate(["Say hi."], SamplingParams(temperature=0, max_tokens=40, min_tokens=30),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 30


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_beam_search_returns_ranked_beams(llm):
    out = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=3, max_tokens=6))[0]
    assert len(out.sequences) == 3
    scores = [s.cum_logprob / len(s.generated) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    greedy = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0].outputs[0]
    # The best beam is at least as likely as the greedy path.
    assert out.sequences[0].cum_logprob >= greedy.cumulative_logprob - 1e-3 or len(out.sequences[0].generated) < 6
    assert all_free(llm)


def test_llm_warms_up_at_init(llm):
    # as the daemon does: on a GPU the warm-up captures the decode CUDA graphs, which offline runs went
    # without while only the daemon called it
    assert llm.engine.runner.warmed_up


def test_warm_up_fits_a_tiny_max_model_len():
    # the warm-up's prefill and decode must fit the context: max_model_len=2 leaves one token of each
    tiny = LLM(model="builtin://smollm2-135m", dtype="float32", max_model_len=2, num_kv_blocks=8)
    assert tiny.engine.runner.warmed_up
    out = tiny.generate([[1]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1


def test_generate_asks_only_for_final_outputs_and_gets_the_streamed_text(llm):
    """LLM.generate runs its requests as FINAL_ONLY (the engine returns finished outputs only, and decodes
    each text once at the end); the texts and tokens are what a server's CUMULATIVE stream ends with."""
    prompts = ["Write a haiku about the sea.", "Emoji party: 🎉", "List three colors:"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, skip_special_tokens=False),
              SamplingParams(temperature=0, max_tokens=40, stop=["\n\n", "4."])]
    offline = llm.generate(prompts, params, use_tqdm=False)
    assert all(p.output_kind is RequestOutputKind.CUMULATIVE for p in params)  # the caller's params untouched

    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"cumulative{i}", prompt, p)
    final, per_step = {}, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        per_step.append(len(outs))
        final.update({o.request_id: o for o in outs if o.finished})
    assert max(per_step) == 3  # a CUMULATIVE request has an output every step it runs
    for i, out in enumerate(offline):
        streamed = final[f"cumulative{i}"].outputs[0]
        assert out.outputs[0].text == streamed.text and out.outputs[0].text
        assert out.outputs[0].token_ids == streamed.token_ids
        assert out.outputs[0].finish_reason == streamed.finish_reason
    assert offline[2].outputs[0].finish_reason == final["cumulative2"].outputs[0].finish_reason

    for i, prompt in enumerate(prompts):
        engine.add_request(f"final{i}", prompt, SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True,
                                                               output_kind=RequestOutputKind.FINAL_ONLY))
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert [o.request_id for o in seen] == ["final0", "final1", "final2"]  # each once, when it finished
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 + 4 * i for i, o in enumerate(seen))
    assert all_free(llm)

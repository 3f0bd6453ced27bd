"""Issue 36's engine across ranks on the CPU (gloo): the offline API with tensor_parallel_size and
pipeline_parallel_size gives a single process's greedy tokens and prompt logprobs under chunked prefill,
prefix caching, preemption (recompute and swap), n > 1, n-gram speculation and LoRA adapters; SmolLM2 at
tensor 3; bad
sizes and unsupported combinations refused; a rank that hangs makes the engine fail instead of stall."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpilot.daemon.engine import LLM, EngineConfig, LLMEngine
from kvpilot.daemon.engine.executor.layout import DEFAULT_DIST_PORT, node_layout
from kvpilot.daemon.engine.executor.multiproc import RankFailed
from kvpilot.daemon.engine.executor.shm_broadcast import ShmBroadcast
from kvpilot.daemon.engine.lora import LoRARequest
from kvpilot.daemon.engine.sampling_params import SamplingParams
from tests.support import quant_formats as qf
from tests.support.hf_parity import save_tiny, token_prompts
from tests.support.lora_adapters import write_adapter
from tests.support.rank_procs import spawned_ranks

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def llama8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 query heads, 4 KV heads, 3 layers (an odd count for two stages), an untied head."""
    folder = tmp_path_factory.mktemp("llama8")
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False)
    save_tiny(cfg, LlamaForCausalLM, folder, lambda n: "norm" in n)
    return folder


def _engine_kwargs(**kw: Any) -> dict[str, Any]:
    # chunked prefill (32-token budget under 50-token prompts) and few blocks: the sequences preempt
    base = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 32, "num_kv_blocks": 8,
            "max_model_len": 128, "num_threads": 1}
    return {**base, **kw}


def _scenario(llm: LLM) -> dict[str, Any]:
    """Greedy tokens and prompt logprobs of three prompts (two sharing a prefix), one of them n=2 with a
    seed, run twice (the second pass hits the prefix cache)."""
    vocab = min(512, int(llm.engine.loaded.hf_config.vocab_size))
    prompts = [{"prompt_token_ids": p} for p in token_prompts(vocab=vocab)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=1, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=6, ignore_eos=True)
    runs = [llm.generate(prompts, [greedy, greedy, sampled], use_tqdm=False) for _ in range(2)]
    stats = llm.engine.get_stats()
    return {
        "tokens": [[list(c.token_ids) for c in o.outputs] for run in runs for o in run],
        "prompt_logprobs": [[{k: v.logprob for k, v in pos.items()} for pos in o.prompt_logprobs[1:]]
                            for run in runs for o in run if o.prompt_logprobs],
        "preempted": stats.num_preempted_total,
        "prefix_hits": stats.prefix_cache_hits_total,
    }


def _run(folder: Path, **kw: Any) -> dict[str, Any]:
    llm = LLM(str(folder), **_engine_kwargs(**kw))
    try:
        out = _scenario(llm)
        out["quantization"] = llm.engine.loaded.quantization
        runner = llm.engine.runner
        if llm.engine.config.world_size > 1:  # several ranks: each ran its part of every step
            out["rank_stats"] = runner.pipeline_stats()
            out["driver_share"] = runner.rank_weight_bytes / llm.engine.get_stats().model_weight_bytes
        return out
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def single(llama8: Path) -> dict[str, Any]:
    return _run(llama8)


def _assert_same(ref: dict[str, Any], got: dict[str, Any]) -> None:
    assert got["tokens"] == ref["tokens"]
    worst = max(abs(a[k] - b[k]) for ra, rb in zip(ref["prompt_logprobs"], got["prompt_logprobs"], strict=True)
                for a, b in zip(ra, rb, strict=True) for k in a)
    assert worst < LOGPROB_TOL
    assert got["preempted"] > 0 and got["prefix_hits"] > 0


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_ranks_match_one_process(llama8: Path, single: dict[str, Any], tp: int, pp: int) -> None:
    assert single["preempted"] > 0 and single["prefix_hits"] > 0  # the scenario exercises both
    got = _run(llama8, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    _assert_same(single, got)
    assert got["driver_share"] < 0.75  # the driver holds a shard, not the model
    if pp > 1:  # every rank, on every stage, took micro-batches; later stages waited on earlier ones
        assert len(got["rank_stats"]) == tp * pp
        assert all(s.micro_batches > 0 for s in got["rank_stats"])


def test_swap_preemption_and_ngram_speculation_across_ranks(llama8: Path) -> None:
    kw = {"preemption_mode": "swap", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    _assert_same(_run(llama8, **kw), _run(llama8, tensor_parallel_size=2, **kw))


def _moe_model(arch: str, folder: Path) -> Path:
    """Tiny Qwen3-MoE (experts on alternate layers, per-head q/k norms) or gpt-oss (sinks, expert biases)."""
    import transformers as tf

    tiny = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 512, "max_position_embeddings": 256, "num_experts_per_tok": 2, "initializer_range": 0.08}
    if arch == "qwen3_moe":
        cfg, cls = tf.Qwen3MoeConfig(**tiny, num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=32,
                                     num_experts=8, decoder_sparse_step=2), tf.Qwen3MoeForCausalLM
    else:
        cfg, cls = tf.GptOssConfig(**tiny, num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
                                   sliding_window=8, layer_types=["sliding_attention", "full_attention"]), \
            tf.GptOssForCausalLM
    save_tiny(cfg, cls, folder, lambda n: n.endswith(("bias", "sinks", "gate.weight", "router.weight")) or "norm" in n)
    return folder


@pytest.mark.parametrize("tp", [2, 4])
def test_olmo2_projection_norms_across_ranks(tmp_path: Path, tp: int) -> None:
    """OLMo 2 norms q and k over the whole projection: the ranks sum their squares (at tensor 4 each of its 2
    KV heads sits on two ranks and counts once)."""
    import transformers as tf

    cfg = tf.Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         max_position_embeddings=256, num_hidden_layers=2, attention_bias=True,
                         initializer_range=0.08)
    save_tiny(cfg, tf.Olmo2ForCausalLM, tmp_path, lambda n: "norm" in n or n.endswith("bias"))
    _assert_same(_run(tmp_path), _run(tmp_path, tensor_parallel_size=tp))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_mixture_of_experts_at_tensor_two(tmp_path: Path, arch: str) -> None:
    """Experts split along their intermediate size, sinks and q/k norms per rank: one process's outputs."""
    folder = _moe_model(arch, tmp_path)
    _assert_same(_run(folder), _run(folder, tensor_parallel_size=2))


def test_gguf_experts_at_tensor_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-MoE GGUF on its blocks: each rank takes its rows of the gate and up experts and its block-aligned
    columns of down (64 = 2 x 32: one Q4_0 block each); one process's outputs on the same file."""
    import numpy as np
    import transformers as tf

    from tests.support.gguf_blocks import quantize
    from tests.support.gguf_files import BPE_TOKENS, write_gguf

    def blocks(name: str, data: Any) -> tuple[Any, int] | None:
        if not name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")):
            return None
        qtype = 2 if name.endswith("down_proj") else 3  # Q4_0 down, Q4_1 the others
        flat = quantize(data.reshape(-1, data.shape[-1]), qtype, np.random.default_rng(0))
        return flat.reshape(*data.shape[:-1], -1), qtype

    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tf.Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            vocab_size=len(BPE_TOKENS), max_position_embeddings=256, num_experts_per_tok=2,
                            num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=64, num_experts=4,
                            norm_topk_prob=True, bos_token_id=257, eos_token_id=259, pad_token_id=257,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = tf.Qwen3MoeForCausalLM(cfg).float().eval()
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_gguf(path, "qwen3moe", hf, blocks)
    single = _run(path)
    assert single["quantization"] == "gguf"
    _assert_same(single, _run(path, tensor_parallel_size=2))


_CHECKPOINTS = {  # quantizer of one projection's float weight, and the checkpoint's quantization_config
    "awq": (lambda _, w: qf.awq_gemm(w, 32), qf.awq_config(32)),
    "gptq": (lambda _, w: qf.gptq(w, 32, desc_act=False, sym=True), qf.gptq_config(32, desc_act=False, sym=True)),
    "fp8": (lambda _, w: qf.fp8_channel(w), qf.fp8_ct_config("channel")),
}


@pytest.mark.parametrize("fmt", sorted(_CHECKPOINTS))
def test_quantized_checkpoints_at_tensor_two(tmp_path: Path, llama8: Path, fmt: str) -> None:
    """A quantized checkpoint's slices (row-split layers' groups of input columns, per-channel scales) give
    the single process's outputs on the same checkpoint."""
    quantize, config = _CHECKPOINTS[fmt]
    qf.rewrite_checkpoint(llama8, tmp_path / fmt, quantize, config, {})
    single, split = _run(tmp_path / fmt), _run(tmp_path / fmt, tensor_parallel_size=2)
    assert single["quantization"] == split["quantization"] == fmt  # the checkpoint's own method ran
    _assert_same(single, split)


def test_smollm2_at_tensor_three() -> None:
    """SmolLM2: 9 query heads and 3 KV heads over 3 ranks, on its own GGUF weights (the same greedy text)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    texts = []
    for tp in (1, 3):
        llm = LLM("builtin://smollm2-135m", dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=512,
                  tensor_parallel_size=tp)
        try:
            texts.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            weight_bytes = llm.engine.get_stats().model_weight_bytes
        finally:
            llm.engine.shutdown()
        if tp == 1:
            single_bytes = weight_bytes
    assert texts[0] == texts[1]
    assert weight_bytes >= single_bytes  # the metrics count every rank's shard


def test_sizes_that_do_not_divide_are_named(llama8: Path) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\).*tensor_parallel_size \(3\)"):
        LLM(str(llama8), **_engine_kwargs(tensor_parallel_size=3))
    with pytest.raises(ValueError, match=r"num_hidden_layers \(3\).*pipeline_parallel_size \(4\)"):
        LLM(str(llama8), **_engine_kwargs(pipeline_parallel_size=4))


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_lora_adapters_follow_the_split(tmp_path: Path, llama8: Path, tp: int, pp: int) -> None:
    """Two adapters on every projection (row-split o and down included) and the base, mixed in each step:
    the same greedy tokens and prompt logprobs as one process; an adapter removed on every rank."""
    hf = LlamaForCausalLM.from_pretrained(llama8)
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp_path / f"a{i}", hf, rank=8, seed=i, std=0.2)))
                for i in range(2)]
    prompts = [{"prompt_token_ids": p} for p in token_prompts(vocab=512)]
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1, ignore_eos=True)
    runs = []
    for t, p in ((1, 1), (tp, pp)):
        llm = LLM(str(llama8), **_engine_kwargs(tensor_parallel_size=t, pipeline_parallel_size=p, enable_lora=True,
                                               max_loras=2, num_kv_blocks=32))
        try:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[adapters[0], None, adapters[1]])
            runs.append(([list(o.outputs[0].token_ids) for o in outs],
                         [pos[tok].logprob for o in outs for pos, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:],
                                                                              strict=True)]))
            base = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
            assert list(base) != runs[-1][0][0]  # the adapter changes the output: it is applied
            assert llm.engine.remove_lora(1) and llm.engine.list_loras() == {2}
        finally:
            llm.engine.shutdown()
    assert runs[1][0] == runs[0][0]
    assert max(abs(a - b) for a, b in zip(runs[0][1], runs[1][1], strict=True)) < LOGPROB_TOL


def test_combinations_not_supported_are_refused() -> None:
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(pipeline_parallel_size=2, speculative_config={"method": "draft_model", "model": "self:1",
                                                                   "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="nnodes"):
        EngineConfig(tensor_parallel_size=2, nnodes=3)


def _worker_pids() -> list[int]:
    return spawned_ranks(os.getpid())


def test_a_rank_that_hangs_fails_the_engine(llama8: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama8), tensor_parallel_size=2, distributed_timeout=4.0,
                                    **_engine_kwargs()))
    try:
        engine.add_request("a", token_prompts(vocab=512)[0], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        (pid,) = _worker_pids()
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RankFailed):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - started < 30
        with pytest.raises(RankFailed):  # dead for good: no call waits again
            engine.step()
        os.kill(pid, signal.SIGCONT)
    finally:
        engine.shutdown()
    assert not _worker_pids()


def test_a_rank_that_dies_before_the_ranks_meet_fails_the_start(llama8: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The spawned rank exits at interpreter start (a sitecustomize on its PYTHONPATH): the engine's start
    fails at once, naming it, instead of waiting out the rendezvous."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\nif '--multiprocessing-fork' in sys.argv:\n    os._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    started = time.monotonic()
    with pytest.raises(RankFailed, match="exited with code 3"):
        LLMEngine(EngineConfig(model=str(llama8), tensor_parallel_size=2, distributed_timeout=20.0,
                               **_engine_kwargs()))
    assert time.monotonic() - started < 15


# ------------------------------------------------------------------ pure parts


def test_layout_from_flags_and_from_the_lws_environment() -> None:
    cfg = EngineConfig(tensor_parallel_size=4, pipeline_parallel_size=2)
    one = node_layout(cfg, {})
    assert (one.nnodes, one.node_rank, one.ranks_per_node, one.init_addr) == (1, 0, 8, None)
    lws = node_layout(cfg, {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "leader.svc"})
    assert (lws.nnodes, lws.node_rank, list(lws.local_ranks), lws.remote_ranks) == (2, 1, [4, 5, 6, 7], [4, 5, 6, 7])
    assert lws.init_addr == ("leader.svc", DEFAULT_DIST_PORT)
    flags = node_layout(EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr="10.0.0.1:1234"),
                        {"LWS_GROUP_SIZE": "4"})
    assert (flags.nnodes, flags.init_addr, list(flags.local_ranks)) == (2, ("10.0.0.1", 1234), [0])
    with pytest.raises(ValueError, match="dist_init_addr"):
        node_layout(EngineConfig(tensor_parallel_size=2, nnodes=2), {})
    with pytest.raises(ValueError, match="nnodes"):
        node_layout(cfg, {"LWS_GROUP_SIZE": "3"})


def test_shm_broadcast_chunks_large_messages_and_notices_a_reader_gone() -> None:
    import multiprocessing
    import threading

    bus = ShmBroadcast(multiprocessing.get_context("spawn"), 2, capacity=1024, timeout_s=5.0)
    readers = [bus.reader(i).open() for i in range(2)]
    got: list[list[Any]] = [[], []]

    def read(i: int, n: int) -> None:
        for _ in range(n):
            got[i].append(readers[i].read(lambda: True))

    threads = [threading.Thread(target=read, args=(i, 2)) for i in range(2)]
    for t in threads:
        t.start()
    big = list(range(5000))  # many chunks of 1 KiB
    bus.publish(("execute", [], big), lambda: None)
    bus.publish(("noop",), lambda: None)
    for t in threads:
        t.join(10)
    assert got == [[("execute", [], big), ("noop",)]] * 2
    # a reader that stopped reading: the next chunk's wait asks check(), which reports it
    calls = []

    def check() -> None:
        calls.append(1)
        raise RankFailed("rank 1 exited")

    with pytest.raises(RankFailed):
        bus.publish(("execute", [], big), check)
    assert calls
    bus.close()
    assert not Path(bus.path).exists()

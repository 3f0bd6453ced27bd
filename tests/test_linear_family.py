"""The linear-layer family: a quant method times a parallel split. Each rank's part of a checkpoint tensor,
and the sum or concatenation of the ranks' outputs, must give the one-rank layer's result; two real gloo
ranks check the collectives."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from kvpilot.daemon.engine.models.linear import Linear, prepack_supported
from kvpilot.daemon.engine.models.parallel import SINGLE, ParallelContext
from kvpilot.daemon.engine.models.quantization import QUANTIZATION_METHODS, get_quant_method

_NO_GROUP = object()  # shard arithmetic needs no collectives: a placeholder group


def ranks(tp: int) -> list[ParallelContext]:
    return [ParallelContext(tp_rank=r, tp_size=tp, tp_group=_NO_GROUP if tp > 1 else None) for r in range(tp)]


def test_replicated_is_f_linear_with_bias_and_residual() -> None:
    torch.manual_seed(0)
    w, b, x, res = torch.randn(6, 5), torch.randn(6), torch.randn(3, 5), torch.randn(3, 6)
    layer = Linear.replicated(5, 6, bias=True)
    layer.load("weight", w)
    layer.load("bias", b)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))
    torch.testing.assert_close(layer(x, residual=res), res + F.linear(x, w, b))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_ranks_hold_slices_of_each_partition(tp: int) -> None:
    torch.manual_seed(1)
    gate, up, x = torch.randn(8, 4), torch.randn(8, 4), torch.randn(2, 4)
    outs = []
    for ctx in ranks(tp):
        layer = Linear.column(4, [8, 8], parallel=ctx, what="intermediate_size")
        layer.load("weight", gate, 0)
        layer.load("weight", up, 1)
        assert layer.weight.shape == (16 // tp, 4)
        outs.append(layer.quant_method.apply(layer, x, None, None).split(8 // tp, dim=-1))
    # each rank's output is [its gate rows | its up rows]: regroup by partition
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), x @ up.T)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_ranks_sum_to_the_whole_product(tp: int) -> None:
    torch.manual_seed(2)
    w, x = torch.randn(3, 8), torch.randn(5, 8)
    total = torch.zeros(5, 3)
    for ctx in ranks(tp):
        layer = Linear.row(8, 3, parallel=ctx, what="intermediate_size")
        layer.load("weight", w)
        part = slice(ctx.tp_rank * 8 // tp, (ctx.tp_rank + 1) * 8 // tp)
        total += layer.quant_method.apply(layer, x[:, part], None, None)
    torch.testing.assert_close(total, x @ w.T)


def test_qkv_splits_query_heads_and_replicates_kv_heads_below_the_rank_count() -> None:
    # 8 query heads, 2 KV heads, head_dim 2, over 4 ranks: 2 query heads each; KV head 0 on ranks 0-1, 1 on 2-3
    parts = [Linear.qkv(4, 2, 8, 2, parallel=ctx).partitions for ctx in ranks(4)]
    assert [p[0] for p in parts] == [(16, 0, 4), (16, 4, 4), (16, 8, 4), (16, 12, 4)]
    assert [p[1] for p in parts] == [(4, 0, 2), (4, 0, 2), (4, 2, 2), (4, 2, 2)]
    assert [p[2] for p in parts] == [p[1] for p in parts]
    # as many KV heads as ranks: one each
    assert [Linear.qkv(4, 2, 8, 2, parallel=ctx).partitions[1] for ctx in ranks(2)] == [(4, 0, 2), (4, 2, 2)]


def test_qkv_loads_each_rank_its_heads() -> None:
    torch.manual_seed(3)
    q, k, v = torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4)  # 4 query heads, 2 KV heads of 2 dims
    for ctx in ranks(2):
        layer = Linear.qkv(4, 2, 4, 2, parallel=ctx)
        for i, t in enumerate((q, k, v)):
            layer.load("weight", t, i)
        r = ctx.tp_rank
        torch.testing.assert_close(layer.weight, torch.cat([q[4 * r:4 * r + 4], k[2 * r:2 * r + 2], v[2 * r:2 * r + 2]]))


@pytest.mark.parametrize(("build", "message"), [
    (lambda ctx: Linear.qkv(4, 2, 6, 2, parallel=ctx), r"num_attention_heads \(6\) is not divisible by tensor_parallel_size \(4\)"),
    (lambda ctx: Linear.qkv(4, 2, 12, 3, parallel=ctx), r"tensor_parallel_size \(4\) is not a multiple of num_key_value_heads \(3\)"),
    (lambda ctx: Linear.row(10, 4, parallel=ctx, what="intermediate_size"), r"intermediate_size \(10\) is not divisible"),
])
def test_sizes_that_do_not_divide_name_both_numbers(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(ranks(4)[1])


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused() -> None:
    layer = Linear.column(4, [8, 8], bias=True)
    with pytest.raises(RuntimeError, match=r"checkpoint shape \(8, 5\) != expected \(8, 4\)"):
        layer.load("weight", torch.zeros(8, 5), 1)
    with pytest.raises(RuntimeError, match=r"checkpoint shape \(7,\) != expected \(8,\)"):
        layer.load("bias", torch.zeros(7), 0)
    with pytest.raises(RuntimeError, match="no bias"):
        Linear.row(4, 4).load("bias", torch.zeros(4))


def test_prepacked_weights_give_the_dense_result() -> None:
    if not prepack_supported(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN prepacking is not available here")
    torch.manual_seed(4)
    w, b, x = torch.randn(64, 32), torch.randn(64), torch.randn(9, 32)
    layer = Linear.replicated(32, 64, bias=True)
    layer.load("weight", w)
    layer.load("bias", b)
    dense = layer(x)
    layer.prepack(keep_panels=True)
    assert layer.weight.is_mkldnn
    torch.testing.assert_close(layer(x), dense, rtol=1e-5, atol=1e-5)


def test_quantization_names_are_checked() -> None:
    assert get_quant_method(None).name == get_quant_method("none").name == "none"
    with pytest.raises(ValueError, match=r"quantization must be one of \['awq', 'fp8', 'gguf', 'gptq', 'none'\], "
                                         r"got 'int3'"):
        get_quant_method("int3")
    assert set(QUANTIZATION_METHODS) == {"none", "gguf", "fp8", "awq", "gptq"}


def test_the_context_checks_its_ranks() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        ParallelContext(tp_rank=2, tp_size=2, tp_group=_NO_GROUP)
    with pytest.raises(ValueError, match="process group"):
        ParallelContext(tp_rank=0, tp_size=2)
    x = torch.ones(2)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x


# ---------------------------------------------------------------------------------------- two real ranks


def _mlp(ctx: ParallelContext, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias: torch.Tensor,
         x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A gated MLP as the models run it: column-split gate|up, row-split down with bias and residual."""
    inter = gate.shape[0]
    gate_up = Linear.column(x.shape[1], [inter, inter], parallel=ctx, what="intermediate_size")
    gate_up.load("weight", gate, 0)
    gate_up.load("weight", up, 1)
    down_proj = Linear.row(inter, down.shape[0], bias=True, parallel=ctx, what="intermediate_size")
    down_proj.load("weight", down)
    down_proj.load("bias", bias)
    g, u = gate_up(x).chunk(2, dim=-1)
    return down_proj(F.silu(g) * u, residual=residual)


def _rank_main(rank: int, port: int, tensors: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ctx = ParallelContext(tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD)
        y = _mlp(ctx, *tensors)
        if rank == 0:
            out.copy_(y)
        shard = torch.full((2,), float(rank))
        out_gathered = ctx.all_gather(shard)
        assert out_gathered.tolist() == [0.0, 0.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_give_the_one_rank_result() -> None:
    torch.manual_seed(5)
    tensors = (torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16), torch.randn(8), torch.randn(3, 8),
               torch.randn(3, 8))
    expected = _mlp(SINGLE, *tensors)
    out = torch.zeros_like(expected).share_memory_()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(port, tensors, out), nprocs=2, join=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

"""CUDA graphs for decode steps, captured per batch-size bucket (as vLLM does).

A decode step of a small model on a GPU is launch-bound: ~10 kernels per layer, each a few
microseconds of work. Replaying a captured graph costs one launch. A graph has fixed shapes, so
one is captured per bucket size and a batch of n decodes runs in the smallest bucket >= n; the
padding rows write to slot -1 (store_kv skips it) and attend over one token of block 0, and their
outputs are dropped. Off on the CPU (nothing to gain there, and no CUDA); the engine's ``enforce_eager``
(vLLM's name) turns it off on CUDA.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from .models import AttentionMetadata

logger = logging.getLogger(__name__)

def capture_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, then every multiple of 8 up to max_num_seqs (vLLM's default ladder)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds num_seqs decode rows; None when it exceeds them all."""
    if num_seqs < 1 or not sizes:
        return None
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def enabled(device: torch.device, enforce_eager: bool = False) -> bool:
    return device.type == "cuda" and not enforce_eager


class DecodeGraphs:
    """Static input buffers and one captured graph per bucket; ``run`` returns the hidden states of
    the real rows, or None when the batch does not fit a bucket (the caller runs eagerly)."""

    def __init__(self, model: torch.nn.Module, sizes: Sequence[int], max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        kw = {"device": device}
        self.input_ids = torch.zeros(n, dtype=torch.int64, **kw)
        self.positions = torch.zeros(n, dtype=torch.int64, **kw)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **kw)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, **kw)
        self.context_lens = torch.ones(n, dtype=torch.int32, **kw)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **kw)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, b: int) -> AttentionMetadata:
        # max_context_len is a fixed upper bound: the captured kernels must not depend on the step
        return AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.context_lens[:b],
                                 self.query_start_loc[: b + 1], max_query_len=1, max_context_len=self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, so the smaller graphs reuse its memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                for _ in range(2):  # warm up (allocator, autotuned kernels) outside the capture
                    self.model(self.input_ids[:b], self.positions[:b], self._meta(b))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[b] = self.model(self.input_ids[:b], self.positions[:b], self._meta(b))
                self.pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        n = input_ids.shape[0]
        b = bucket_for(n, self.sizes)
        width = meta.block_tables.shape[1]
        if b is None or b not in self.graphs or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)  # padding rows write nothing
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[n:b].zero_()
        self.context_lens[:n].copy_(meta.context_lens)
        self.context_lens[n:b].fill_(1)  # padding rows attend over one token of block 0
        self.graphs[b].replay()
        return self.outputs[b][:n]

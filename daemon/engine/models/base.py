"""What every native model gets per step, besides the token ids and positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.kernels.ops import LoRASegments


@dataclass
class AttentionMetadata:
    """One flattened varlen batch (see DESIGN.md, Kernels); built once per step by the runner.

    ``context_lens[i]`` counts sequence i's tokens in the cache including this step's, since the
    model stores K/V before attending.
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    context_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    max_query_len: int
    max_context_len: int


@dataclass
class OutputRows:
    """The rows of a step whose final hidden states are used: the last token of each entry that samples.

    The last layer needs every row's K and V (for the cache) but its attention, O projection and MLP only
    for these rows: ``meta`` attends each of them as a one-token query over its sequence's whole context,
    which for the last token of a prefill chunk is exactly its causal attention.
    """

    rows: torch.Tensor  # int64 [R]: indices into the step's T rows, in output order
    meta: AttentionMetadata  # R one-token queries


@dataclass
class LoRABatch:
    """The adapter slot of each row of a step that mixes adapters (see lora/): ``rows`` for the step's T rows,
    ``output_rows`` for the R rows of ``OutputRows`` when the last layer computes only those."""

    rows: LoRASegments
    output_rows: LoRASegments | None = None

"""What every native model gets per step, besides the token ids and positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

"""Draft models: k greedy autoregressive steps over the speculating sequences, in the target's block tables.

Two kinds:

* ``self:N``, a layer-skip draft: the target's first N layers, its final norm and LM head, sharing the
  target's weights. Its layers are the target's, so the target's K/V of layers 0..N-1 for the verified
  tokens are exactly the draft's: the draft reads them and needs no cache or prefill of its own. The
  slots its steps write (the draft positions) are the ones the verification then overwrites.
* a separate model (``model: <uri>``) with the target's tokenizer vocabulary: loaded beside the target
  with its own KV cache of as many blocks (so the target's block tables address it), filled lazily: a
  sequence's first proposal feeds it everything the draft has not seen.

Drafts are the argmax of the draft's logits, so the draft distribution is a point mass and the target's
verification (spec_decode.verify) accepts a draft with exactly the target's probability of it.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from ..config import EngineConfig
from ..loader import LoadedModel, load_model
from ..runner import ModelRunner, SeqBatchEntry
from ..scheduler import ScheduledSequence
from .config import SpeculativeConfig

logger = logging.getLogger("kvpilot.spec_decode")


def layer_skip_view(target: nn.Module, num_layers: int) -> nn.Module:
    """The target model cut to its first ``num_layers`` layers: the same class and forward, the same weight
    tensors, its own module tables (so the target keeps all of its layers)."""
    total = getattr(target, "num_layers", None)
    if not isinstance(getattr(target, "layers", None), nn.ModuleList) or total is None:
        raise ValueError(f"speculative_config.model: self:N needs a decoder model, not {type(target).__name__}")
    if not 1 <= num_layers < total:
        raise ValueError(f"speculative_config.model: self:{num_layers} must keep 1 to {total - 1} of the "
                         f"target's {total} layers")
    view = object.__new__(type(target))
    view.__dict__.update(target.__dict__)
    for table in ("_modules", "_parameters", "_buffers"):
        setattr(view, table, dict(getattr(target, table)))
    view.layers = nn.ModuleList(list(target.layers)[:num_layers])
    view.num_layers = num_layers
    view._logits_out = None  # its own logits buffer: the target's may still be read
    view._native_decode = None  # its own native decode records, over its own layers (native_decode.py)
    return view


def same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


class DraftModel:
    """Proposes drafts with a draft model (see the module docstring)."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, loaded: LoadedModel,
                 target_runner: ModelRunner) -> None:
        self.target_runner = target_runner
        self.self_draft = spec.self_draft_layers is not None
        if self.self_draft:
            view = layer_skip_view(loaded.model, spec.self_draft_layers or 0)
            self.runner = ModelRunner(config, replace(loaded, model=view))
        else:
            self.runner = ModelRunner(config, self._load_separate(spec, config, loaded))
        # logits columns both models give meaning to: a padded draft head may be wider than the target's
        self.width = min(self.runner.vocab_size, target_runner.vocab_size)
        self.computed: dict[str, int] = {}  # separate model: tokens of each sequence in its own cache

    @staticmethod
    def _load_separate(spec: SpeculativeConfig, config: EngineConfig, loaded: LoadedModel) -> LoadedModel:
        draft_config = replace(config, model=spec.model or "", served_model_name=None,
                               max_model_len=loaded.max_model_len, speculative_config=None)
        draft = load_model(draft_config)
        if not same_vocabulary(loaded.tokenizer, draft.tokenizer):
            raise ValueError(f"speculative_config.model: {spec.model!r} has another tokenizer vocabulary than the "
                             f"target {config.model!r}; a draft must tokenize text exactly as the target does")
        return draft

    def init_kv_cache(self) -> None:
        """After the target's cache exists: the self-draft binds the target's first layers' caches, a separate
        model gets a cache of as many blocks."""
        target = self.target_runner
        if self.self_draft:
            n = self.runner.num_layers
            self.runner.k_caches, self.runner.v_caches = target.k_caches[:n], target.v_caches[:n]
            self.runner.num_blocks = target.num_blocks
            self.runner.model.bind_kv_caches(self.runner.k_caches, self.runner.v_caches)
        else:
            self.runner.init_kv_cache(target.num_blocks)
            logger.info("draft model KV cache: %d blocks, %.1f MiB", target.num_blocks,
                        target.num_blocks * self.runner.kv_bytes_per_block / 2**20)

    # ------------------------------------------------------------------ block moves and preemption
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not self.self_draft:  # the self-draft's blocks are the target's, copied with them
            self.runner.copy_blocks(pairs)

    def forget(self, seq_id: str) -> None:
        """The sequence's blocks changed under the draft (preempted, swapped, finished)."""
        self.computed.pop(seq_id, None)

    # ------------------------------------------------------------------ proposing
    def propose(self, entries: list[ScheduledSequence]) -> list[list[int]]:
        """Up to ``entry.num_draft_tokens`` greedy drafts per entry (each entry verifies its last token)."""
        drafts: list[list[int]] = [[] for _ in entries]
        if not entries:
            return drafts
        first = []
        for e in entries:
            seq = e.seq
            last = seq.num_tokens - 1  # the position of the token this step computes
            start = last if self.self_draft else min(self.computed.get(seq.seq_id, 0), last)
            first.append(SeqBatchEntry(token_ids=seq.all_token_ids[start : last + 1], start_pos=start,
                                       block_table=e.block_table, compute_logits=True))
        tokens = self._argmax(self.runner.execute(first))
        for i, tok in enumerate(tokens):
            drafts[i].append(tok)
        for step in range(1, max(e.num_draft_tokens for e in entries)):
            live = [i for i, e in enumerate(entries) if e.num_draft_tokens > step]
            batch = [SeqBatchEntry(token_ids=[drafts[i][-1]], start_pos=entries[i].seq.num_tokens - 1 + step,
                                   block_table=entries[i].block_table, compute_logits=True) for i in live]
            for i, tok in zip(live, self._argmax(self.runner.execute(batch)), strict=True):
                drafts[i].append(tok)
        return drafts

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        return logits[:, : self.width].argmax(dim=-1).tolist()

    def verified(self, entry: ScheduledSequence, num_accepted: int) -> None:
        """After verification: what of this step's draft K/V stays valid in a separate model's cache. It fed
        the verified token at num_tokens - 1 and drafts 1..k-1 after it; the accepted ones are good."""
        if self.self_draft:
            return
        seq = entry.seq
        last = entry.start_pos  # the verified token this step computed
        self.computed[seq.seq_id] = last + 1 + min(num_accepted, max(entry.num_draft_tokens - 1, 0))

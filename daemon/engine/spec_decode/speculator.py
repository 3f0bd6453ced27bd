"""The engine's side of speculative decoding, step by step.

1. ``plan(running)``, before scheduling: how many drafts each decoding sequence verifies in this step
   (``seq.num_draft_tokens``; 0 where the policy says no). ngram looks its drafts up here already.
2. the scheduler reserves budget and KV slots for them (and may cut them).
3. ``propose(scheduled)``: the drafts into each ScheduledSequence (a draft model runs its k steps now,
   in the slots just reserved), cut where a grammar refuses them.
4. the target scores 1 + k positions per speculating sequence; the engine samples and walks them
   (spec_decode.verify) and calls ``verified(entry, accepted)``, which counts and feeds the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..scheduler import ScheduledSequence
from ..sequence import Sequence
from .config import SpeculativeConfig
from .ngram import ngram_propose
from .policy import AcceptanceGate, batch_allows

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..loader import LoadedModel
    from ..runner import ModelRunner
    from .draft import DraftModel


@dataclass
class SpecStats:
    """vLLM's spec-decode counters, all time."""

    num_drafts: int = 0  # verifications (one per speculating sequence and step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: verifications that accepted draft j + 1


def grammar_prefix(seq: Sequence, drafts: list[int]) -> list[int]:
    """The longest prefix of drafts that the sequence's grammar allows after its output (all of them
    without a grammar; none while its matcher is not made yet)."""
    if seq.grammar is None or not drafts:
        return drafts
    m = seq.matcher
    if m is None or not m.sync(seq.output_token_ids):
        return []
    n = m.try_advance(drafts)
    m.rollback(n)
    return drafts[:n]


class Speculator:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None) -> None:
        if (spec.method == "draft_model") != (draft is not None):
            raise ValueError("speculative_config: method draft_model needs a draft model, ngram none")
        self.spec = spec
        self.max_model_len = max_model_len
        self.draft = draft
        self.stats = SpecStats(accepted_per_pos=[0] * spec.num_speculative_tokens)
        self._ngram: dict[str, list[int]] = {}  # this step's lookups, from plan to propose

    # ------------------------------------------------------------------ before the step
    def plan(self, running: list[Sequence]) -> None:
        allowed = batch_allows(len(running), self.spec.disable_by_batch_size)
        self._ngram.clear()
        for seq in running:
            seq.num_draft_tokens = 0
            if not allowed or not self._may_speculate(seq):
                continue
            k = min(seq.spec_gate.draft_limit(self.spec.num_speculative_tokens), self._room(seq))
            if k < 1:
                continue
            if self.draft is None:
                drafts = grammar_prefix(seq, ngram_propose(seq.all_token_ids, k, self.spec.prompt_lookup_min,
                                                           self.spec.prompt_lookup_max))
                if not drafts:
                    continue
                self._ngram[seq.seq_id] = drafts
                k = len(drafts)
            seq.num_draft_tokens = k
        if self.draft is not None and len(self.draft.computed) > 2 * len(running) + 64:
            live = {s.seq_id for s in running}
            self.draft.computed = {i: n for i, n in self.draft.computed.items() if i in live}

    def _may_speculate(self, seq: Sequence) -> bool:
        if len(seq.all_token_ids) - seq.num_computed_tokens != 1 or seq.num_output_tokens == 0:
            return False  # still in its prompt
        params = seq.sampling_params
        if seq.grammar is not None and seq.num_output_tokens < params.min_tokens:
            return False  # the EOS rule of a completed grammar under min_tokens is judged per step only
        if seq.spec_gate is None:
            seq.spec_gate = AcceptanceGate()
        return seq.spec_gate.allows()

    def _room(self, seq: Sequence) -> int:
        """Drafts that can still matter: each step emits at most 1 + drafts tokens, and every verified
        position must fit max_model_len."""
        room = self.max_model_len - seq.num_tokens
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return room

    # ------------------------------------------------------------------ after scheduling
    def propose(self, scheduled: list[ScheduledSequence]) -> None:
        entries = [e for e in scheduled if e.num_draft_tokens]
        if self.draft is None:
            for e in entries:
                e.set_drafts(self._ngram.get(e.seq.seq_id, [])[: e.num_draft_tokens])
        else:
            for e, drafts in zip(entries, self.draft.propose(entries), strict=True):
                e.set_drafts(grammar_prefix(e.seq, drafts[: e.num_draft_tokens]))
        self._ngram.clear()

    def forget(self, seqs: list[Sequence]) -> None:
        """Sequences whose blocks were taken (preempted): a separate draft model's cache of them is gone."""
        if self.draft is not None:
            for seq in seqs:
                self.draft.forget(seq.seq_id)

    # ------------------------------------------------------------------ after sampling
    def verified(self, entry: ScheduledSequence, num_accepted: int) -> None:
        proposed = entry.num_draft_tokens
        if proposed == 0:
            return
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += proposed
        st.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            st.accepted_per_pos[j] += 1
        if entry.seq.spec_gate is not None:
            entry.seq.spec_gate.record(proposed, num_accepted)
        if self.draft is not None:
            self.draft.verified(entry, num_accepted)


def make_speculator(config: EngineConfig, loaded: LoadedModel, runner: ModelRunner, max_model_len: int) -> Speculator:
    """The engine's Speculator for ``config.speculative``; a draft model is loaded (or cut from the target)
    and its KV cache made here, after the target's."""
    spec = config.speculative
    if spec is None:
        raise ValueError("speculative_config is not set")
    draft = None
    if spec.method == "draft_model":
        from .draft import DraftModel  # torch and the loader, only for draft models

        draft = DraftModel(spec, config, loaded, runner)
        draft.init_kv_cache()
    return Speculator(spec, max_model_len, draft)

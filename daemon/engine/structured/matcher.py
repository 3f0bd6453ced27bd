"""Per-sequence grammar state, kept in step with the sequence's output tokens."""

from __future__ import annotations

import logging

import torch
import xgrammar as xgr

logger = logging.getLogger("kvpilot.structured")


class SequenceMatcher:
    """One sequence's position in its grammar.

    The engine owns the truth (the sequence's output tokens); `sync(output_token_ids)` brings the
    matcher to it: it accepts tokens it has not seen and rolls back ones that are gone (a preempted
    sequence recomputed from fewer tokens, or a sequence restarted from scratch). Accepting at the
    next mask, rather than right after sampling, means no engine path can forget to advance it.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int] | None = None,
                 _matcher: xgr.GrammarMatcher | None = None, _accepted: list[int] | None = None) -> None:
        self._compiled = compiled
        self._stops = list(stop_token_ids or [])
        self._m = _matcher or xgr.GrammarMatcher(compiled, override_stop_tokens=self._stops or None)
        self.accepted: list[int] = _accepted if _accepted is not None else []
        self.failed = False  # a token the grammar rejects was appended (the mask was not applied)

    # ------------------------------------------------------------- state
    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    def is_terminated(self) -> bool:
        """The grammar finished and a stop token was accepted: nothing more may be generated."""
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token would be allowed now)."""
        return self._m.is_completed()

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged, `failed` set) when the grammar rejects it."""
        if self.failed or not self._m.accept_token(token_id):
            self.failed = True
            return False
        self.accepted.append(token_id)
        return True

    def try_advance(self, token_ids: list[int]) -> int:
        """Accept the longest prefix of token_ids the grammar allows (speculative drafts); returns its length.
        A refused token leaves the state as it was and `failed` unset: the caller rolls the prefix back."""
        if self.failed:
            return 0
        n = 0
        for tok in token_ids:
            if not self._m.accept_token(tok):
                break
            self.accepted.append(tok)
            n += 1
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (preemption, speculative rejection)."""
        num_tokens = min(num_tokens, len(self.accepted))
        if num_tokens <= 0:
            return
        self._m.rollback(num_tokens)
        del self.accepted[-num_tokens:]
        self.failed = False

    def sync(self, output_token_ids: list[int]) -> bool:
        """Match the output tokens exactly: roll back past the first difference, then replay the rest.
        Returns False if some token is not in the grammar."""
        n = len(self.accepted)
        if n <= len(output_token_ids) and output_token_ids[:n] == self.accepted:
            common = n  # the usual case: only new tokens at the end
        else:
            common = 0
            while common < min(n, len(output_token_ids)) and self.accepted[common] == output_token_ids[common]:
                common += 1
        self.rollback(len(self.accepted) - common)
        for tok in output_token_ids[len(self.accepted):]:
            if not self.accept(tok):
                logger.warning("grammar rejected token %d after %d tokens", tok, len(self.accepted))
                return False
        return True

    def fork(self) -> SequenceMatcher:
        """An independent copy at the same position (n > 1: each sequence needs its own)."""
        return SequenceMatcher(self._compiled, self._stops, self._m.fork(), list(self.accepted))

    def fresh(self) -> SequenceMatcher:
        """A new matcher for the same grammar, at the start."""
        return SequenceMatcher(self._compiled, self._stops)

    # ------------------------------------------------------------- masks
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]. False when nothing constrains the row
        (terminated or failed): the caller then leaves that row of the logits alone."""
        if self.failed or self._m.is_terminated():
            return False
        self._m.fill_next_token_bitmask(bitmask, row)
        return True

"""When to speculate, so that it never costs throughput.

Two rules, checked before every step:

* the batch: above ``disable_by_batch_size`` running sequences nobody speculates. A large batch keeps
  the hardware busy by itself, and verifying k drafts per sequence would multiply the rows of every
  layer's GEMMs for a gain that shrinks as the batch grows.
* the request: each sequence keeps an acceptance average (exponential, half weight to the latest
  verification: accepted drafts / proposed drafts). When it falls below ``MIN_ACCEPTANCE`` the
  sequence stops speculating for ``cooldown`` steps, then tries again from an average of
  ``RESUME_ACCEPTANCE``. The cooldown starts at ``BASE_COOLDOWN`` steps, doubles every time the
  sequence is paused again (up to ``MAX_COOLDOWN``), and goes back to the base after a verification
  that accepts every draft. A request that keeps rejecting drafts therefore speculates on a vanishing
  fraction of its steps, while one that reaches a copied passage later in its output still finds it.
* the draft length: after a verification that rejected a draft, the next one proposes one draft more
  than were accepted (a probe of one after a miss at the first); after one that accepted them all, the
  full k again. Acceptance comes in runs (the output copies its context for a while, or it does not),
  and every verified row costs a fraction of a step (a sixth on the 2-core CPU host,
  bench/results/speculative.json): a miss with k drafts wastes k rows, a probe one.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ACCEPTANCE = 0.3
RESUME_ACCEPTANCE = 0.5
BASE_COOLDOWN = 4
MAX_COOLDOWN = 64


@dataclass
class AcceptanceGate:
    """One sequence's side of the rule above (kept on the Sequence as ``spec_gate``)."""

    average: float = 1.0  # optimistic: a new request speculates at once
    paused_steps: int = 0
    cooldown: int = BASE_COOLDOWN
    max_drafts: int | None = None  # the draft-length rule's cap for the next step (None: k)

    def draft_limit(self, k: int) -> int:
        return k if self.max_drafts is None else min(k, self.max_drafts)

    def allows(self) -> bool:
        """True when this sequence may speculate in the coming step (counts down a pause)."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            if self.paused_steps == 0:
                self.average = RESUME_ACCEPTANCE
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.average = 0.5 * self.average + 0.5 * (accepted / proposed)
        self.max_drafts = None if accepted == proposed else accepted + 1
        if accepted == proposed:
            self.cooldown = BASE_COOLDOWN
        if self.average < MIN_ACCEPTANCE:
            self.paused_steps = self.cooldown
            self.cooldown = min(2 * self.cooldown, MAX_COOLDOWN)


def batch_allows(num_running: int, disable_by_batch_size: int) -> bool:
    return num_running <= disable_by_batch_size

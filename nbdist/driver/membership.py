"""Who trains in an elastic run (docs/elastic.md): the driver's one record of membership, by generation.

A worker keeps its launch rank as its name for the whole run (its connection, its handle, its line in the
run state: a "slot"); within a generation it has a collective rank, its place in ``members``. When a member's
The first generation is the workers that started in time (``first``; until then no job is sent). When a member's
process ends (``leave``) the generation is broken: every survivor abandons its collective and reports
``Lost`` (``report``) with the commit it holds; once all have (``ready``), ``regroup`` opens the next
generation over the survivors, from their commit. Below ``minimum`` survivors the run is not elastic any more
(``leave`` says so) and fails or restarts as any run. Pure bookkeeping: the run (training.py) acts on it.
"""
from __future__ import annotations

import time

from ..wire.reports import Lost
from .state import MembershipChange


class Membership:
    def __init__(self, minimum: int, world: int) -> None:
        self.minimum = minimum
        self.members: list[int] = list(range(world))  # slots, in collective-rank order
        self.generation = 0
        self.leaving: dict[int, str] = {}  # slot -> why, members of the broken generation that are gone
        self.lost: dict[int, Lost] = {}  # slot -> its report, survivors of the broken generation
        self.broken_at: float | None = None  # when the current generation broke (None: it trains)
        self.gone: set[int] = set()  # every slot that left, in any generation
        self.formed = False  # the first generation is formed once its workers have started (training.py)

    @property
    def broken(self) -> bool:
        return self.broken_at is not None

    @property
    def survivors(self) -> list[int]:
        return [s for s in self.members if s not in self.leaving]

    def slot(self, rank: int) -> int:
        """The slot of collective rank ``rank`` in this generation."""
        return self.members[rank]

    def leave(self, slot: int, why: str) -> bool:
        """Member ``slot`` is gone; True while enough are left to go on (else the run ends as any run)."""
        if slot in self.members and slot not in self.leaving:
            self.leaving[slot] = why
            self.gone.add(slot)
            if self.broken_at is None:
                self.broken_at = time.monotonic()
        return len(self.survivors) >= self.minimum

    def report(self, slot: int, lost: Lost) -> bool:
        """A survivor's ``Lost``; False for one of another generation (late, or not a member: dropped)."""
        if lost.generation != self.generation or slot not in self.members or slot in self.leaving:
            return False
        self.lost[slot] = lost
        return True

    def ready(self) -> bool:
        """Every survivor of the broken generation has reported."""
        return self.broken and all(s in self.lost for s in self.survivors)

    def first(self, started: list[int], why: str, initial_epoch: int) -> MembershipChange:
        """The first generation: only the workers that started (the rest did not, for ``why``)."""
        left = sorted(set(self.members) - set(started))
        self.gone.update(left)
        self.members = list(started)
        return MembershipChange(generation=0, left=left, why=why, workers=list(started), committed=initial_epoch,
                                steps_lost=0, started=False)

    def regroup(self) -> MembershipChange:
        """The next generation: the survivors, from the oldest commit any of them holds (epoch, then step: a
        worker keeps its commit before the last, so one that committed once more than another rolls back too)."""
        survivors = self.survivors
        reports = [self.lost[s] for s in survivors]
        committed, step = min((r.committed, r.step) for r in reports)
        # A worker past the oldest point in the same epoch lost its steps since it as well.
        lost = max(r.steps_lost + (r.step - step if r.committed == committed else 0) for r in reports)
        change = MembershipChange(
            generation=self.generation + 1, left=sorted(self.leaving), why="; ".join(
                dict.fromkeys(self.leaving[s] for s in sorted(self.leaving))),
            workers=survivors, committed=committed, step=step, steps_lost=lost)
        self.generation += 1
        self.members = survivors
        self.leaving, self.lost, self.broken_at = {}, {}, None
        return change

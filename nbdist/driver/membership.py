"""Who trains in an elastic run (docs/elastic.md): the driver's one record of membership, by generation.

A worker keeps its launch rank as its name for the whole run (a "slot"); within a generation it has a collective
rank, its place in ``members``. The first generation is the workers that started in time (``first``). A
generation ends when a member's process ends (``leave``: broken; every survivor reports ``Lost`` with its
commit), or when workers wait to join (``starting``, then ``waiting`` once they said hello: the members are
asked to stop at their next commit, ``pause``, and report ``AtCommit``). Once every survivor has reported
(``ready``; a pause also waits for joiners still starting, until their deadline), ``regroup`` opens the next
generation over the survivors, then the joiners (rank 0 holds a commit), from the oldest commit reported. Below
``minimum`` the run fails or restarts as any run; never more than ``most`` workers; ``replace`` bounds
replacements. Pure bookkeeping: the run (training.py) acts on it.
"""
from __future__ import annotations

import time

from ..wire.reports import AtCommit, Lost
from .state import MembershipChange


class Membership:
    def __init__(self, minimum: int, world: int) -> None:
        self.minimum = minimum
        self.most = world  # the launch's world (MAX, or fewer where the data allows fewer): never more members
        self.members: list[int] = list(range(world))  # slots, in collective-rank order
        self.generation = 0
        self.leaving: dict[int, str] = {}  # slot -> why, members of the broken generation that are gone
        self.lost: dict[int, Lost | AtCommit] = {}  # slot -> its report, survivors of the ending generation
        self.broken_at: float | None = None  # when the current generation broke (None: it trains)
        self.gone: set[int] = set()  # every slot that left, in any generation
        self.formed = False  # the first generation is formed once its workers have started (training.py)
        self.never_started: set[int] = set()  # launch slots not in the first generation: they may join later
        self.starting: dict[int, float] = {}  # joiners launched, not connected yet: slot -> when they are given up
        self.waiting: list[int] = []  # joiners that said hello, in that order: they join at the next change
        self.pausing = False  # the members were asked to stop at their next commit, for the joiners
        self.paused_at: float | None = None  # when the first member reported it stopped there
        self.replaced = 0  # replacements launched so far (``replace``)

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

    def report(self, slot: int, lost: Lost | AtCommit) -> bool:
        """A survivor's ``Lost`` or ``AtCommit``; False for one of another generation (late, or not a member:
        dropped)."""
        if lost.generation != self.generation or slot not in self.members or slot in self.leaving:
            return False
        if isinstance(lost, AtCommit) and self.paused_at is None:
            self.paused_at = time.monotonic()
        self.lost[slot] = lost
        return True

    def ready(self, now: float | None = None) -> bool:
        """Every survivor of the ending generation has reported; a pause also waits for the joiners still
        starting (until they are given up), a break does not (they join at the next commit)."""
        if not (self.broken or self.pausing) or not all(s in self.lost for s in self.survivors):
            return False
        now = time.monotonic() if now is None else now
        return self.broken or all(deadline <= now for deadline in self.starting.values())

    # -- joiners --------------------------------------------------------
    def room(self) -> int:
        """How many more workers may join or start to: the launch's world less the members and the joiners."""
        return self.most - len(self.survivors) - len(self.waiting) - len(self.starting)

    def replace(self, slot: int, new: int, deadline: float) -> bool:
        """Launch ``new`` in lost member ``slot``'s place? At most ``most`` replacements in a run, while there is
        room; a joiner that did not join is not replaced (no relaunch loop: docs/elastic.md)."""
        if self.replaced >= self.most or self.room() < 1:
            return False
        self.replaced += 1
        self.starting[new] = deadline
        return True

    def hello(self, slot: int) -> bool:
        """Joiner ``slot`` said hello: it waits for the next generation change. A launch slot that did not start
        in time joins too, if there is room. False: it is not wanted (the run stops it)."""
        if slot in self.starting:
            del self.starting[slot]
        elif not (slot in self.never_started and slot not in self.waiting and self.room() >= 1):
            return False
        self.never_started.discard(slot)
        self.waiting.append(slot)
        return True

    def drop_joiner(self, slot: int) -> bool:
        """Joiner ``slot`` ended or was given up before it joined; True if it was one."""
        was = slot in self.starting or slot in self.waiting
        self.starting.pop(slot, None)
        if slot in self.waiting:
            self.waiting.remove(slot)
        return was

    def wants_pause(self) -> bool:
        """A training generation with joiners: ask its members to stop at their next commit."""
        return self.formed and not self.broken and not self.pausing and bool(self.starting or self.waiting)

    def pause(self) -> None:
        self.pausing, self.paused_at = True, None

    # -- generations ----------------------------------------------------
    def first(self, started: list[int], why: str, initial_epoch: int) -> MembershipChange:
        """The first generation: only the workers that started (the rest did not, for ``why``)."""
        left = sorted(set(self.members) - set(started))
        self.gone.update(left)
        self.never_started.update(left)
        self.members = list(started)
        return MembershipChange(generation=0, left=left, why=why, workers=list(started), committed=initial_epoch,
                                steps_lost=0, started=False)

    def regroup(self) -> MembershipChange:
        """The next generation: the survivors, then the joiners that said hello (up to ``most``), from the oldest
        commit any survivor holds (epoch, then step: a worker keeps its commit before the last, so one that
        committed once more than another rolls back too)."""
        survivors = self.survivors
        joined = self.waiting[:max(0, self.most - len(survivors))]
        reports = [self.lost[s] for s in survivors]
        committed, step = min((r.committed, r.step) for r in reports)
        # A worker past the oldest point in the same epoch lost its steps since it as well.
        lost = max(r.steps_lost + (r.step - step if r.committed == committed else 0) for r in reports)
        change = MembershipChange(
            generation=self.generation + 1, left=sorted(self.leaving), why="; ".join(
                dict.fromkeys(self.leaving[s] for s in sorted(self.leaving))),
            workers=survivors + joined, committed=committed, step=step, steps_lost=lost, joined=joined)
        self.generation += 1
        self.members = survivors + joined
        self.waiting = [s for s in self.waiting if s not in joined]
        self.gone.difference_update(joined)
        self.leaving, self.lost, self.broken_at = {}, {}, None
        self.pausing, self.paused_at = False, None
        return change

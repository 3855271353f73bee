"""``--dynamic``: GA3C's adjustment of the numbers of trainers, predictors and agents (NT, NP, NA) by measured
training throughput (upstream ``ThreadDynamicAdjustment``), as a pure state machine.

Upstream's rule: measure the current setting over a window; then, again and again, take a random step of -1, 0
or +1 on each of NT, NP and NA (at least one of them moves; each stays within its bounds), run it for a window,
and keep it if the throughput of that window beat the best setting's, else go back (and measure the best setting
afresh for a window before the next step, so that one lucky window does not decide all later ones). Upstream measured
updates per second; here an update's size depends on the segments' lengths, so the measure is *trained
transitions per second* (the agent steps that reached an optimizer step), exact from the trainers' counters.

``DynamicAdjuster.observe(now, trained)`` is called often (by the main process, with the trainers' transition
count); it returns the counts to run from now on when they change, else None. Until a setting is all running
(processes started and ready, the server's counts at their targets, a first update made) the main process calls
``hold`` instead, which starts the window again: start-up is not measured as a setting's throughput. Every decision is also in
``events`` as one line for the log.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

Counts = tuple[int, int, int]  # (NT, NP, NA)


def format_counts(c: Counts) -> str:
    return f"NT {c[0]} NP {c[1]} NA {c[2]}"


def random_step(current: Counts, lower: Counts, upper: Counts, rng: random.Random) -> Counts:
    """A random neighbour of ``current``: each count moved by -1, 0 or +1 within ``[lower, upper]``, at least one
    moved (``current`` itself when no count can move)."""
    if all(lo == hi for lo, hi in zip(lower, upper)):
        return current
    while True:
        step = tuple(min(hi, max(lo, c + rng.choice((-1, 0, 1)))) for c, lo, hi in zip(current, lower, upper))
        if step != current:
            return step


@dataclass
class DynamicAdjuster:
    """See the module docstring. ``window`` seconds per measurement; ``lower``/``upper`` bound each count."""

    start: Counts
    lower: Counts
    upper: Counts
    window: float
    seed: int = 0
    current: Counts = field(init=False)
    best: Counts = field(init=False)
    best_rate: float | None = field(init=False, default=None)
    events: list[str] = field(init=False, default_factory=list)

    def __post_init__(self):
        if not all(lo <= s <= hi for s, lo, hi in zip(self.start, self.lower, self.upper)):
            raise ValueError(f"start {self.start} is not within {self.lower}..{self.upper}")
        self.current = self.best = tuple(self.start)
        self._rng = random.Random(self.seed)
        self._t0: float | None = None
        self._n0 = 0

    def hold(self, now: float, trained: int) -> None:
        """The current setting is not all running yet (processes starting, a change not yet in effect): its window
        starts again from here, so that the start-up is not measured as its throughput."""
        self._t0, self._n0 = now, trained

    def observe(self, now: float, trained: int) -> Counts | None:
        """Feed the clock and the trained-transition count; returns new counts to apply, or None."""
        if self._t0 is None:
            self._t0, self._n0 = now, trained
            return None
        if now - self._t0 < self.window:
            return None
        rate = (trained - self._n0) / (now - self._t0)
        if self.best_rate is None:  # the first window measured the starting setting
            self.best_rate = rate
            self.events.append(f"{format_counts(self.current)}: {rate:.0f} trained steps/s")
        elif self.current == self.best:  # the best setting re-measured after a trial was undone: noise moves it
            self.best_rate = rate
        else:  # a trial ends
            if rate > self.best_rate:
                self.events.append(f"keep {format_counts(self.current)}: {rate:.0f} trained steps/s beats "
                                   f"{format_counts(self.best)} ({self.best_rate:.0f})")
                self.best, self.best_rate = self.current, rate
            else:
                self.events.append(f"back to {format_counts(self.best)} ({self.best_rate:.0f} trained steps/s): "
                                   f"{format_counts(self.current)} gave {rate:.0f}")
                self.current = self.best
                self._t0, self._n0 = now, trained
                return self.current
        trial = random_step(self.current, self.lower, self.upper, self._rng)
        self._t0, self._n0 = now, trained
        if trial == self.current:
            return None
        self.events.append(f"try {format_counts(trial)} (from {format_counts(self.current)})")
        self.current = trial
        return trial

"""Linear schedules over the run's global agent steps: the learning rate (``--lr-anneal-steps``, as A3C's paper
annealed it) and the entropy bonus (``--entropy-anneal-steps``). Each worker (A3G) or trainer (GA3C) reads the
global step count before an update and uses the value for that count."""
from __future__ import annotations


def linear_anneal(start: float, steps: int, anneal_steps: int) -> float:
    """``start`` falling linearly to 0 at ``anneal_steps`` global steps, 0 from there on; ``start`` itself when
    ``anneal_steps`` is 0 (no schedule)."""
    if anneal_steps <= 0:
        return start
    return start * max(0.0, 1.0 - steps / anneal_steps)

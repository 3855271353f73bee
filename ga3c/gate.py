"""A copy of the shared weights from one moment between two optimizer steps, for the processes that read them while
GA3C's trainers step them: a sequence lock in shared memory, without any lock that a process could die holding.

GA3C's trainers, threads of the server process, step the shared model one at a time under the server's own
``step_lock``. Two other processes copy what they change: the main process (a checkpoint: the weights, the
optimizer statistics, the moving average and the version) and the monitor (each game's weights). A copy made
while a step is applied holds that step half applied, or statistics one step ahead of the version. A
multiprocessing lock would prevent that, and would wedge the run when a process dies holding it (docs/design.md,
Shared state). ``StepGate`` instead, one shared ``int64`` tensor ``[seq, hold_0, hold_1]``:

- ``seq`` is odd while a step is applied: a trainer (``writing``) makes it odd, applies the step, and makes it
  even again, with a release fence each time.
- A reader (``read``) waits for an even ``seq``, copies, and keeps the copy only if ``seq`` has not moved since
  (acquire fences); else it tries again.
- A reader first sets its ``hold`` slot to a deadline on the machine's monotonic clock, which every process
  shares: at least ``HOLD_SECONDS`` ahead, and twice its last copy's time where that was longer. A trainer about
  to start a step waits (``wait_for_holds``, before it takes the server's step lock, so that the predictors are
  not held up) while a hold has not expired, so that a copy longer than the gaps between steps still finds one. A
  reader that dies leaves a hold that expires by itself. A trainer already past that wait finishes its step; the
  reader waits for it, or copies again.
- A step that raises leaves ``seq`` odd, as one that a kill interrupts: it may have changed part of what it
  changes. A server that ended inside a step is then seen (``in_step()``): readers give up (``read`` returns
  ``None``) and the final checkpoint is not written over the last complete one.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ga3c.buffers import ACQUIRE, RELEASE, fence

HOLD_SECONDS = 1.0  # a reader's hold on new steps, renewed at each try; a dead reader's expires
MAIN, MONITOR = 0, 1  # the readers' hold slots


class StepGate:
    """See the module docstring. ``readers``: how many hold slots."""

    def __init__(self, readers: int = 2):
        self.state = torch.zeros(1 + readers, dtype=torch.int64).share_memory_()

    # ---- the writer: a trainer, one at a time (under the server's step_lock) ----------------------------------
    def wait_for_holds(self) -> None:
        """Before a step (and before the step lock): wait while a reader's hold has not expired."""
        while True:
            wait = (int(self.state[1:].max()) - time.monotonic_ns()) / 1e9
            if wait <= 0:
                return
            time.sleep(min(wait, 0.002))

    @contextlib.contextmanager
    def writing(self):
        """Around one optimizer step (and what moves with it): marks the step as being applied until the block
        ends; where the block raises, the mark stays (``in_step``)."""
        self.state[0] += 1
        fence(RELEASE)
        yield
        fence(RELEASE)
        self.state[0] += 1

    # ---- the readers ------------------------------------------------------------------------------------------
    def in_step(self) -> bool:
        """Whether a step is being applied now (after the server has ended: it was killed inside one)."""
        return int(self.state[0]) % 2 == 1

    def read(self, copy, reader: int, alive=lambda: True, timeout: float | None = 10.0):
        """``copy()`` made between two steps, or None where none was found: ``alive()`` (checked about every
        0.1 s, between tries) returned False, or ``timeout`` seconds passed (None: no limit; a copy under way when
        it passes is finished and checked)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        slot = 1 + reader
        checked, took = time.monotonic(), 0.0
        try:
            while deadline is None or time.monotonic() < deadline:
                hold = max(HOLD_SECONDS, 2 * took)  # a copy longer than the hold would find a step in it each time
                self.state[slot] = time.monotonic_ns() + int(hold * 1e9)
                fence(RELEASE)
                before = int(self.state[0])
                if before % 2 == 0:
                    fence(ACQUIRE)
                    t0 = time.monotonic()
                    result = copy()
                    took = time.monotonic() - t0
                    fence(ACQUIRE)
                    if int(self.state[0]) == before:
                        return result
                else:
                    time.sleep(0.001)
                if time.monotonic() - checked >= 0.1:
                    checked = time.monotonic()
                    if not alive():
                        return None
            return None
        finally:
            self.state[slot] = 0


class _NoGate:
    """A trainer's gate without counters (tests, benchmarks): no other process copies its weights."""

    @staticmethod
    def wait_for_holds() -> None:
        pass

    @staticmethod
    def writing():
        return contextlib.nullcontext()


NO_GATE = _NoGate()

"""``ga3c.gate.StepGate``: a reader's copy is of one moment between two steps, a reader's hold delays the next step
and expires by itself, and a step that never ends leaves no moment to copy."""
import threading
import time

import torch

from ga3c.gate import HOLD_SECONDS, MAIN, MONITOR, StepGate


def stepping(gate: StepGate, step, pause: float = 0.0):
    """A started thread that makes steps as a trainer does (``step()`` inside ``writing``, after the holds), each
    ``pause`` s after the last, until the returned event is set; and the thread, to join."""
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            gate.wait_for_holds()
            with gate.writing():
                step()
            time.sleep(pause)

    thread = threading.Thread(target=writer)
    thread.start()
    return stop, thread


def test_every_copy_is_between_two_steps_while_a_writer_steps_without_pause():
    """The writer moves two tensors one after the other inside each step, so a copy in the middle of a step sees
    them differ; 200 copies taken while it steps back to back must all see them equal."""
    gate, a, b = StepGate(), torch.zeros(50_000), torch.zeros(50_000)
    steps = [0]

    def step():
        a.add_(1.0)
        time.sleep(0.0005)
        b.add_(1.0)
        steps[0] += 1

    def copy_now_and_then(i):
        time.sleep(0.005)  # the writer steps between two reads (their holds cleared)
        return gate.read(lambda: (a.clone(), b.clone()), MAIN if i % 2 else MONITOR)

    stop, thread = stepping(gate, step)
    try:
        copies = [copy_now_and_then(i) for i in range(200)]
    finally:
        stop.set()
        thread.join()
    assert all(c is not None for c in copies)
    torn = [(float(x[0]), float(y[0])) for x, y in copies if not torch.equal(x, y)]
    assert not torn, f"{len(torn)} of 200 copies were made inside a step: {torn[:5]}"
    assert steps[0] > 10 and float(copies[-1][0][0]) > float(copies[0][0][0])  # it stepped between the copies


def test_a_readers_hold_delays_the_next_step_until_it_ends_or_expires():
    """A step does not start while a reader's hold runs (here one set 0.3 s ahead and never cleared: a reader
    that died), and starts once it has expired; the hold a reader sets is ``HOLD_SECONDS`` ahead and is cleared
    when its read returns."""
    gate, entered = StepGate(), []
    until = time.monotonic_ns() + 300_000_000
    gate.state[1 + MONITOR] = until

    def step():
        gate.wait_for_holds()
        with gate.writing():
            entered.append(time.monotonic_ns())

    thread = threading.Thread(target=step)
    thread.start()
    thread.join(10)
    assert entered and entered[0] >= until, "the step started while the hold ran"
    holds = []
    assert gate.read(lambda: holds.append(int(gate.state[1 + MAIN]) - time.monotonic_ns()) or 1, MAIN) == 1
    assert 0 < holds[0] <= HOLD_SECONDS * 1e9 and int(gate.state[1 + MAIN]) == 0


def test_a_copy_that_a_whole_step_ran_through_is_made_again():
    """The check after the copy: a step that started and ended while the copy ran (the sequence moved by 2, even
    both times) makes the reader copy again; the second copy is the one returned."""
    gate, calls = StepGate(), []

    def copy():
        calls.append(1)
        if len(calls) == 1:
            gate.state[0] += 2  # a whole step during the first copy
        return len(calls)
    assert gate.read(copy, MAIN, timeout=2) == 2


def test_a_copy_longer_than_the_hold_holds_longer_the_next_time(monkeypatch):
    """A copy that outlasts its hold finds steps in it (the hold expired, the writer went on); the next try holds
    twice as long as that copy took, and succeeds. Before, every try failed while steps kept coming."""
    import ga3c.gate as gate_module
    monkeypatch.setattr(gate_module, "HOLD_SECONDS", 0.05)
    gate, tries = StepGate(), []

    def copy():
        tries.append(1)
        time.sleep(0.15)
        return len(tries)

    stop, thread = stepping(gate, lambda: time.sleep(0.002), pause=0.005)
    try:
        got = gate.read(copy, MAIN, timeout=5)
    finally:
        stop.set()
        thread.join()
    assert got is not None and got >= 2, f"{len(tries)} tries, none between two steps"


def test_a_step_that_never_ends_leaves_no_moment_to_copy():
    """A writer that dies inside a step (a killed server), or whose step raises (it may have changed part of what
    it changes), leaves the sequence odd: ``in_step`` says so, and a read gives up when ``alive`` turns False or
    at its timeout, without calling ``copy``."""
    gate = StepGate()
    try:
        with gate.writing():
            raise RuntimeError("a failed step")
    except RuntimeError:
        pass
    assert gate.in_step()
    copied = []
    t = time.monotonic()
    assert gate.read(lambda: copied.append(1), MAIN, alive=lambda: time.monotonic() - t < 0.3) is None
    assert gate.read(lambda: copied.append(1), MAIN, timeout=0.2) is None
    assert copied == [] and int(gate.state[1 + MAIN]) == 0

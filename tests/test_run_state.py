"""run_state's lock-free pieces, one by one: the error board (text written before its length, long reports cut
to head and tail), the stop flag, the step counter and a stop condition made of several flags."""
import queue
import re
import threading
import time

import pytest
import torch

from run_state import ERROR_BYTES, AnyOf, ErrorBoard, Flag, RunState, StepCounter, fit_text


# ------------------------------------------------------------------------------------------ fit_text
def test_fit_text_keeps_a_text_that_fits_as_it_is():
    assert fit_text("short", 64) == "short"
    assert fit_text("x" * 64, 64) == "x" * 64
    assert fit_text("é" * 32, 64) == "é" * 32  # 64 bytes of UTF-8


def test_fit_text_keeps_head_and_tail_of_a_long_text_within_the_size():
    head = "Traceback (most recent call last):\n"
    tail = "\nRecursionError: maximum recursion depth exceeded"
    text = head + "".join(f"  frame {i}\n" for i in range(30000)) + tail
    size = 4096
    out = fit_text(text, size)
    assert len(out.encode("utf-8")) <= size
    m = re.fullmatch(r"(.*)\n\[\.\.\. ([\d,]+) characters cut \.\.\.\]\n(.*)", out, re.DOTALL)
    assert m, f"no cut note in {out[:200]!r}..."
    kept_head, cut, kept_tail = m.group(1), int(m.group(2).replace(",", "")), m.group(3)
    assert text.startswith(kept_head) and text.endswith(kept_tail)  # verbatim pieces of the text
    assert kept_head.startswith(head) and kept_tail.endswith(tail)  # the first lines and what went wrong
    assert len(kept_head) + cut + len(kept_tail) == len(text)  # the note says how much is missing
    assert len(kept_head) > 100 and len(kept_tail) > len(kept_head)  # the tail (the error) gets the most room


@pytest.mark.parametrize("size", [56, 100, 128, 256, 343, 512, 4096])
def test_fit_text_fits_small_sizes_too_and_keeps_the_last_line(size):
    text = "Traceback (most recent call last):\n" + "".join(f"  frame {i}\n" for i in range(500)) + "ValueError: x"
    out = fit_text(text, size)
    assert len(out.encode("utf-8")) <= size, (size, len(out.encode("utf-8")))
    m = re.fullmatch(r"(.*)\n\[\.\.\. ([\d,]+) characters cut \.\.\.\]\n(.*)", out, re.DOTALL)
    assert m and len(m.group(1)) + int(m.group(2).replace(",", "")) + len(m.group(3)) == len(text)
    if size >= 128:
        assert out.endswith("ValueError: x")
    board = ErrorBoard(1, size=size)
    board.report(0, "worker 0", text)
    role, got = board.get(timeout=0)
    assert role == "worker 0" and (size < 128 or got.endswith("ValueError: x")), got


def test_fit_text_counts_bytes_not_characters():
    text = "€" * 5000  # 3 bytes each
    out = fit_text(text, 1024)
    assert len(out.encode("utf-8")) <= 1024 and "characters cut" in out


# ---------------------------------------------------------------------------------------- ErrorBoard
def test_error_board_reads_back_each_report_by_slot():
    board = ErrorBoard(3, size=256)
    assert board.read_all() == []
    board.report(2, "monitor", "line 1\nline 2")
    board.report(0, "worker 0", "boom")
    assert board.read_all() == [("worker 0", "boom"), ("monitor", "line 1\nline 2")]
    assert board.get(timeout=0) == ("worker 0", "boom")
    assert board.get(timeout=0) == ("monitor", "line 1\nline 2")
    t = time.monotonic()
    with pytest.raises(queue.Empty):
        board.get(timeout=0.1)  # each report is taken once
    assert time.monotonic() - t < 5


def test_a_huge_report_keeps_its_head_and_tail_and_fits_its_slot():
    board = ErrorBoard(2)
    text = "first line\n" + "x" * 200_000 + "\nValueError: injected fault"
    board.report(1, "worker 1", text)
    ((role, got),) = board.read_all()
    assert role == "worker 1"
    assert got.startswith("first line\n") and got.endswith("\nValueError: injected fault")
    assert "characters cut" in got and len(("worker 1\n" + got).encode()) <= ERROR_BYTES


def test_an_empty_slot_reads_as_nothing_even_with_text_in_it():
    """The length is the commit mark: text whose length was never written (a process killed mid-report) is not
    a report; ``read_all`` returns nothing for it and ``get`` times out."""
    board = ErrorBoard(2, size=128)
    data = b"worker 0\nhalf a report"
    board._text[0, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert board.read_all() == []
    with pytest.raises(queue.Empty):
        board.get(timeout=0.05)
    board._lengths[0] = len(data)
    assert board.read_all() == [("worker 0", "half a report")]


class _Recorder:
    """A tensor wrapper that logs, in order, which of the board's tensors was written."""

    def __init__(self, tensor, name, log):
        self.tensor, self.name, self.log = tensor, name, log

    def __setitem__(self, key, value):
        self.log.append(self.name)
        self.tensor[key] = value

    def __getitem__(self, key):
        return self.tensor[key]

    def __getattr__(self, attr):
        return getattr(self.tensor, attr)


def test_a_report_writes_its_text_before_its_length():
    """So a reader never sees a length over text not yet written (half a report)."""
    board = ErrorBoard(2, size=128)
    log = []
    board._text, board._lengths = _Recorder(board._text, "text", log), _Recorder(board._lengths, "length", log)
    board.report(1, "monitor", "boom")
    assert log == ["text", "length"]
    assert board.read_all() == [("monitor", "boom")]


def test_a_second_report_in_a_slot_replaces_the_first():
    board = ErrorBoard(1, size=128)
    board.report(0, "worker 0", "a long first report")
    board.report(0, "worker 0", "short")
    assert board.read_all() == [("worker 0", "short")]


# ---------------------------------------------------------------------------------------------- Flag
def test_flag_set_clear_and_is_set():
    f = Flag()
    assert not f.is_set()
    f.set()
    assert f.is_set()
    f.set()  # idempotent
    assert f.is_set()
    f.clear()
    assert not f.is_set()


def test_flag_wait_times_out_returns_at_once_when_set_and_wakes_when_set_meanwhile():
    f = Flag()
    t = time.monotonic()
    assert f.wait(0.2) is False
    waited = time.monotonic() - t
    assert 0.2 <= waited < 5  # the timeout, not forever (generous: a busy machine)
    assert f.wait(0) is False
    f.set()
    t = time.monotonic()
    assert f.wait(10) is True and f.wait() is True
    assert time.monotonic() - t < 1
    f.clear()
    threading.Timer(0.1, f.set).start()
    t = time.monotonic()
    assert f.wait(30) is True
    assert time.monotonic() - t < 10


def test_flag_is_shared_memory():
    f = Flag()
    assert f._value.is_shared()


# ----------------------------------------------------------------------------------------- StepCounter
def test_step_counter_sums_every_slot():
    c = StepCounter(3)
    assert c.value == 0
    c.add(0, 20)
    c.add(2, 5)
    c.add(0, 20)
    assert c.value == 45
    assert c.slots.tolist() == [40, 0, 5, 0]  # workers' slots, the base last
    assert c.slots.is_shared()


def test_step_counter_restore_sets_the_base_and_forgets_the_slots():
    c = StepCounter(2)
    c.add(1, 7)
    c.value = 1000  # restore from a checkpoint
    assert c.value == 1000 and c.slots.tolist() == [0, 0, 1000]
    c.add(0, 20)
    c.add(1, 3)
    assert c.value == 1023


def test_run_state_counts_steps_over_a_restored_base():
    run = RunState(2)
    run.restore({"global_steps": 500})
    run.add_steps(1, 20)
    assert run.global_steps.value == 520
    assert run.snapshot()["global_steps"] == 520


# ---------------------------------------------------------------------------------------------- AnyOf
@pytest.mark.parametrize("old_window, new_window", [(4, 10), (10, 4), (4, 4)])
def test_the_monitor_window_after_a_resume_with_another_score_window(old_window, new_window):
    """A resumed run's window mean is the mean of the last ``new_window`` known scores, None until it knows that
    many (never NaN: the CSV and --target-score read it), and its checkpoint saves only known scores."""
    run = RunState(1, score_window=old_window)
    scores = [float(s) for s in range(1, 7)]
    for s in scores:
        run.record_game(s)
    resumed = RunState(1, score_window=new_window)
    resumed.restore(run.snapshot())
    known = scores[-old_window:]
    for s in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0):
        known.append(s)
        mean = resumed.record_game(s)
        if len(known) >= new_window:
            assert mean == pytest.approx(sum(known[-new_window:]) / new_window)
        else:
            assert mean is None
        assert resumed.recent_scores() == known[-new_window:]
        again = RunState(1, score_window=new_window)
        again.restore(resumed.snapshot())
        assert again.recent_scores() == known[-new_window:]


def test_any_of_is_set_when_any_one_flag_is():
    a, b, e = Flag(), Flag(), threading.Event()
    stop = AnyOf(a, b, e)
    assert not stop.is_set()
    b.set()
    assert stop.is_set()
    b.clear()
    assert not stop.is_set()
    e.set()
    assert stop.is_set()
    e.clear()
    a.set()
    assert stop.is_set()
    assert not AnyOf().is_set()  # no flag: never set


def test_a_checkpoint_never_takes_the_monitors_statistics_in_the_middle_of_a_game_being_recorded():
    """The main process reads the monitor's statistics (``snapshot``) while the monitor process may be recording a
    game: a score already in the window but not yet in the count would make a resumed window mean wrong. While a
    write is under way (``monitor_seq`` odd) the read waits for its end, then takes both from between writes."""
    import threading
    run = RunState(1, score_window=4)
    for score in (1.0, 2.0, 3.0, 4.0, 5.0):
        run.record_game(score)
    games = int(run.monitor[0])
    run.monitor_seq += 1  # the monitor process is between record_game's first and last write:
    run.recent[games % 4] = 100.0  # the score is in the window, the count not yet
    got = {}
    reader = threading.Thread(target=lambda: got.update(run.snapshot()))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # it waits for the write to end
    run.monitor[0] += 1
    run.monitor[1] += 100.0
    run.monitor[2] = 100.0
    run.monitor_seq += 1
    reader.join(5)
    assert got["monitor"].tolist() == [6.0, 115.0, 100.0] and got["best_score"] == 100.0
    assert got["recent_scores"] == [3.0, 4.0, 5.0, 100.0]
    resumed = RunState(1, score_window=4)
    resumed.restore(got)
    assert resumed.record_game(6.0) == (4.0 + 5.0 + 100.0 + 6.0) / 4


def test_a_monitor_killed_while_recording_a_game_does_not_hold_a_checkpoint_for_ever(monkeypatch):
    import run_state
    monkeypatch.setattr(run_state, "STATE_TRIES", 50)
    run = RunState(1, score_window=4)
    run.record_game(7.0)
    run.monitor_seq += 1  # left odd: the writer died mid-write
    t = time.monotonic()
    monitor, recent = run.monitor_state()
    assert time.monotonic() - t < 5 and monitor.tolist() == [1.0, 7.0, 7.0] and recent == [7.0]

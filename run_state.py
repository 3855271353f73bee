"""What the processes of one run share: counters, flags, statistics, the error channel.

Everything here is created by the main process before the workers start and handed to them at spawn time.

Nothing here has a lock or a waiter list. A ``multiprocessing`` Event, Lock, Value or Queue can wedge a whole run
when a process dies while holding or waiting on it (a killed monitor left ``Event.set`` in the main process
waiting forever for it to wake; a worker with a long error text blocked on exit flushing its Queue). So each
piece of state is a shared-memory tensor that one process writes and the others read: per-process slots for
counters and statistics, single flags that are only ever set, and a fixed-size text slot per process for errors.
A process killed at any moment leaves at most a stale value, never a held lock.
"""
from __future__ import annotations

import math
import queue
import time

import torch

UPDATE_FIELDS = ("updates", "steps", "policy_loss", "value_loss", "entropy", "grad_norm")
EMA = 0.99  # smoothing of the per-worker loss statistics shown in logs and TensorBoard
ERROR_BYTES = 64 * 1024  # per process; a longer report keeps its head and its tail (``ErrorBoard.report``)
POLL_SECONDS = 0.02
STATE_TRIES = 2000  # RunState.monitor_state's reads while a write is under way (a write takes microseconds)


class Flag:
    """A boolean in shared memory: ``set``, ``clear``, ``is_set`` and a polling ``wait``, like an Event, without
    the Event's lock and condition variable."""

    def __init__(self):
        self._value = torch.zeros(1, dtype=torch.int32).share_memory_()

    def set(self) -> None:
        self._value[0] = 1

    def clear(self) -> None:
        self._value[0] = 0

    def is_set(self) -> bool:
        return bool(self._value[0].item())

    def wait(self, timeout: float | None = None) -> bool:
        """Return True as soon as the flag is set, False after ``timeout`` seconds (polling, never blocking)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(POLL_SECONDS, left))
            else:
                time.sleep(POLL_SECONDS)
        return True


class StartError(RuntimeError):
    """A mode could not start its parts (Ray: an actor that never answered, or a stop signal while waiting for
    one); the message is one line. Defined here, not in ``main.py``, so that it is one class whether ``main`` is
    the script or an imported module."""


class AnyOf:
    """A stop condition made of several flags (``Flag``, ``threading.Event``): ``is_set()`` when any one is."""

    def __init__(self, *flags):
        self.flags = flags

    def is_set(self) -> bool:
        return any(f.is_set() for f in self.flags)


class StepCounter:
    """Global agent steps: one slot per worker (each written only by its worker) plus a base (resumed runs).

    ``value`` is the sum, read without a lock; ``add(rank, n)`` touches only the caller's slot.
    """

    def __init__(self, workers: int):
        self._slots = torch.zeros(workers + 1, dtype=torch.int64).share_memory_()
        self._base = workers

    @property
    def value(self) -> int:
        return int(self._slots.sum().item())

    @value.setter
    def value(self, steps: int) -> None:  # restore, before any worker starts
        self._slots.zero_()
        self._slots[self._base] = int(steps)

    def add(self, rank: int, steps: int) -> None:
        self._slots[rank] += steps

    @property
    def slots(self) -> torch.Tensor:
        """The shared per-process slots, base last (GA3C's counters count agent steps into them)."""
        return self._slots


class ErrorBoard:
    """One fixed-size text slot per process for its failure report (role and traceback).

    Writing never blocks: the text goes into shared memory, its length last, so a reader never sees half a
    report. A report longer than the slot keeps its first and last lines around a note of what was cut (the
    last lines of a traceback say what went wrong). ``get`` and ``read_all`` return the filled slots.
    """

    def __init__(self, processes: int, size: int = ERROR_BYTES):
        self._text = torch.zeros(processes, size, dtype=torch.uint8).share_memory_()
        self._lengths = torch.zeros(processes, dtype=torch.int64).share_memory_()
        self._seen = set()  # per process: slots already returned by ``get``

    def report(self, slot: int, role: str, text: str) -> None:
        size = self._text.shape[1]
        prefix = f"{role}\n".encode("utf-8", "replace")
        data = (prefix + fit_text(text, max(0, size - len(prefix))).encode("utf-8", "replace"))[:size]
        self._text[slot, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._lengths[slot] = len(data)

    def _read(self, slot: int) -> tuple[str, str]:
        n = int(self._lengths[slot].item())
        raw = bytes(self._text[slot, :n].numpy()).decode("utf-8", "replace")
        role, _, text = raw.partition("\n")
        return role, text

    def read_all(self) -> list[tuple[str, str]]:
        """Every ``(role, text)`` reported so far, in slot order."""
        return [self._read(s) for s in range(self._lengths.numel()) if self._lengths[s].item() > 0]

    def get(self, timeout: float | None = None) -> tuple[str, str]:
        """The next report this process has not yet taken; ``queue.Empty`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for s in range(self._lengths.numel()):
                if s not in self._seen and self._lengths[s].item() > 0:
                    self._seen.add(s)
                    return self._read(s)
            if deadline is not None and time.monotonic() >= deadline:
                raise queue.Empty
            time.sleep(POLL_SECONDS)

    def __getstate__(self):
        return {"_text": self._text, "_lengths": self._lengths}

    def __setstate__(self, state):
        self.__dict__.update(state, _seen=set())


NOTE_BYTES = 48  # fit_text's note, "\n[... N characters cut ...]\n", with N up to 10**15


def fit_text(text: str, size: int) -> str:
    """``text`` if it fits in ``size`` bytes of UTF-8, else its head and tail around ``[... N characters cut ...]``:
    a quarter of the characters that surely fit (4 bytes each at most, after the note's bytes) from the head, the
    rest (the error, in a traceback) from the tail. Under ``NOTE_BYTES`` + 8 bytes the note alone is left."""
    if len(text.encode("utf-8", "replace")) <= size:
        return text
    room = max(0, size - NOTE_BYTES) // 4
    head = room // 4
    tail = room - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut:,} characters cut ...]\n{text[len(text) - tail:]}"


class RunState:
    """Shared state of a run (see the module docstring for why nothing here can be left locked).

    - ``global_steps``: agent steps over all workers (and over resumed runs); ``.value`` reads it,
      ``add_steps(rank, n)`` counts a worker's steps.
    - ``stop``: set by the main process (stop condition, Ctrl-C, a dead process); every process checks it.
    - ``target_reached``: set by the monitor when the mean of its last ``score_window`` games reaches the target.
    - ``short_games``: set by the monitor when that mean first reaches ``--short-games-after-score`` (or restored
      from a GA3C checkpoint); GA3C mode's short-game slots cut their games from their next reset on.
    - ``norm_stats (norm_rows + 1, 3)``: each environment's frame-normalisation (mean, std, count), one row per
      learner environment (``norm_rows``, default ``workers``: a worker's, or in GA3C mode an env slot's), and the
      monitor's last (``monitor_norm``). Saved in checkpoints; a run restores it whatever its number of rows.
    - ``update_stats (workers, 6)``: per worker updates, steps and smoothed per-step losses (``UPDATE_FIELDS``).
    - ``monitor (3,)``: games played, sum of their scores, best score; ``recent (score_window,)`` last scores;
      ``monitor_seq``: odd while the monitor writes them, so that other processes copy them whole
      (``monitor_state``, a bounded retry, not a lock).
    - ``errors``: ``ErrorBoard`` with a slot per process (worker r: slot r; the monitor: slot ``workers``).
    - ``ready (workers + 1,)``: set by each process (same slots) when its loop starts; a process still starting up
      has nothing to finish and is stopped at once (``a3g.run.shutdown``).
    """

    def __init__(self, workers: int, score_window: int = 10, norm_rows: int | None = None):
        self.workers = workers
        self.global_steps = StepCounter(workers)
        self.stop = Flag()
        self.target_reached = Flag()
        self.short_games = Flag()
        rows = workers if norm_rows is None else norm_rows
        self.norm_stats = torch.zeros(rows + 1, 3, dtype=torch.float64).share_memory_()
        self.update_stats = torch.zeros(workers, len(UPDATE_FIELDS), dtype=torch.float64).share_memory_()
        self.monitor = torch.tensor([0.0, 0.0, -math.inf], dtype=torch.float64).share_memory_()
        self.recent = torch.full((score_window,), math.nan, dtype=torch.float64).share_memory_()
        # odd while record_game writes monitor and recent (its one writer, the monitor process), so that a reader
        # in another process takes a copy of both from between two writes (monitor_state)
        self.monitor_seq = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.errors = ErrorBoard(workers + 1)
        self.ready = torch.zeros(workers + 1, dtype=torch.int32).share_memory_()

    @property
    def monitor_slot(self) -> int:
        return self.workers

    @property
    def monitor_norm(self) -> int:
        """The monitor's row of ``norm_stats`` (the last)."""
        return self.norm_stats.shape[0] - 1

    def mark_ready(self, slot: int) -> None:
        self.ready[slot] = 1

    def add_steps(self, rank: int, steps: int) -> None:
        self.global_steps.add(rank, steps)

    def record_update(self, rank: int, steps: int, policy: float, value: float, entropy: float,
                      grad_norm: float) -> None:
        """Count an update of ``steps`` agent steps; ``policy``, ``value`` and ``entropy`` are per step."""
        row = self.update_stats[rank]
        first = row[0].item() == 0
        row[0] += 1
        row[1] += steps
        for i, v in zip((2, 3, 4, 5), (policy, value, entropy, grad_norm)):
            row[i] = v if first else EMA * row[i].item() + (1 - EMA) * v

    def record_game(self, score: float) -> float | None:
        """Add a monitor game; return the mean of the last ``score_window`` games once that many were played and
        are known (a resume with a larger ``--score-window`` than its checkpoint's knows fewer at first)."""
        games = int(self.monitor[0].item())
        self.monitor_seq += 1  # odd: a write is under way
        self.recent[games % self.recent.numel()] = score
        self.monitor[0] += 1
        self.monitor[1] += score
        if score > self.monitor[2].item():
            self.monitor[2] = score
        self.monitor_seq += 1
        if games + 1 >= self.recent.numel() and not bool(self.recent.isnan().any()):
            return float(self.recent.mean())
        return None

    def recent_scores(self) -> list[float]:
        """The monitor's last ``score_window`` scores that are known, oldest first."""
        return self.monitor_state()[1]

    def monitor_state(self) -> tuple[torch.Tensor, list[float]]:
        """A consistent copy of the monitor's statistics: ``monitor`` (games, sum of scores, best) and its last
        known scores (``recent_scores``), both read between two of ``record_game``'s writes, retried while one is
        under way. A monitor killed mid-write leaves ``monitor_seq`` odd: after ``STATE_TRIES`` the values are
        taken as they are, so nothing here can wait for ever."""
        for _ in range(STATE_TRIES):
            before = int(self.monitor_seq[0])
            if before % 2 == 0:
                monitor, recent = self.monitor.clone(), self.recent.clone()
                if int(self.monitor_seq[0]) == before:
                    break
            time.sleep(POLL_SECONDS / 20)
        else:
            monitor, recent = self.monitor.clone(), self.recent.clone()
        games, n = int(monitor[0].item()), recent.numel()
        scores = [recent[i % n].item() for i in range(max(0, games - n), games)]
        return monitor, [s for s in scores if not math.isnan(s)]

    def snapshot(self) -> dict:
        """Counters and statistics for a checkpoint (plain values and CPU tensors)."""
        monitor, recent = self.monitor_state()
        return {
            "global_steps": int(self.global_steps.value),
            "norm_stats": self.norm_stats.clone(),
            "monitor": monitor,
            "best_score": float(monitor[2].item()),
            "recent_scores": recent,
        }

    def restore(self, ckpt: dict) -> None:
        """Restore counters and statistics from a checkpoint, tolerating a different number of workers."""
        self.global_steps.value = int(ckpt.get("global_steps", 0))
        saved = ckpt.get("norm_stats")
        if saved is not None and saved.shape[0] >= 2:  # learner rows round-robin (another mode or count), monitor last
            n_saved = saved.shape[0] - 1
            for r in range(self.monitor_norm):
                self.norm_stats[r] = saved[r % n_saved]
            self.norm_stats[self.monitor_norm] = saved[-1]
        if ckpt.get("monitor") is not None:
            self.monitor.copy_(ckpt["monitor"])
        games, n = int(self.monitor[0].item()), self.recent.numel()
        recent = list(ckpt.get("recent_scores", []))[-n:]
        for i, score in enumerate(recent):
            self.recent[(games - len(recent) + i) % n] = score

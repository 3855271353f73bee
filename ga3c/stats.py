"""Exact counters of a GA3C run, its per-episode records, the upstream console line and ``results.txt``.

Like ``run_state``, everything shared is a tensor in shared memory with one writer per slot and no lock:

- ``Ga3cCounters``: agent steps (one slot per agent process), predictions (one per predictor), training updates
  and per-update statistics (one per trainer), plus a base slot each for resumed runs. Sums are exact: every
  agent step is counted once by the process that took it (upstream GA3C summed episode lengths that were
  over-counted by about 20%, which inflated its PPS). The sum of the update slots is the model *version* that
  predictors stamp on every action, so a trainer can measure the policy lag. Its ``gate`` (``ga3c.gate.StepGate``)
  marks each optimizer step, so that other processes copy the weights between two steps.
- ``EpisodeLog``: per agent process a ring of finished games (end time, unclipped score, length, env slot); the
  process that prints reads every agent's new entries by count, so nothing blocks and nothing is pickled.
- ``ConsoleStats``: GA3C's per-episode line
  ``[Time: %8d] [Episode: %8d Score: %10.4f] [RScore: %10.4f RPPS: %5d] [PPS: %5d TPS: %5d] [NT: %2d NP: %2d NA: %2d]``
  with RScore and RPPS over the last ``window`` games (1000 upstream), PPS (agent steps) and TPS (updates) per
  second since the start (a resumed run counts only its own steps and updates; Episode goes on from the
  checkpoint's count, as upstream's did), and ``results_line`` / ``ResultsWriter`` for upstream's ``results.txt``
  (``YYYY-MM-DD HH:MM:SS, score, length``, one line per game).
"""
from __future__ import annotations

import math
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import torch

from checkpoint import write_errors
from ga3c.buffers import ACQUIRE, RELEASE, fence
from ga3c.gate import StepGate
from utils import close_quietly, drop_cut_line

TRAINER_FIELDS = ("steps", "segments", "lag_mean", "lag_max", "policy_loss", "value_loss", "entropy", "grad_norm")
EMA = 0.99
STATS_LINE = ("[Time: %8d] [Episode: %8d Score: %10.4f] [RScore: %10.4f RPPS: %5d] "
              "[PPS: %5d TPS: %5d] [NT: %2d NP: %2d NA: %2d]")
RESULTS_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
LAG_BINS = 256  # policy-lag histogram: lags 0..254 exactly, 255 means >= 255 updates


class Ga3cCounters:
    """Counters with one slot per process (or thread) that writes it; see the module docstring.

    ``max_agents``, ``max_predictors``, ``max_trainers`` bound how many may ever run (dynamic adjustment starts
    and stops some; a stopped one's slot keeps its counts). ``active (3,)``: the numbers of trainers, predictors
    and agents running now (NT, NP, NA), written by the process that starts them.
    """

    def __init__(self, max_agents: int, max_predictors: int, max_trainers: int, agent_steps: torch.Tensor | None = None):
        # A run passes its ``RunState.global_steps`` slots (one per process, the base last), so the monitor, the stop
        # conditions and the checkpoints count the same steps.
        if agent_steps is None:
            agent_steps = torch.zeros(max_agents + 1, dtype=torch.int64).share_memory_()
        elif agent_steps.numel() < max_agents + 1 or not agent_steps.is_shared():
            raise ValueError(f"agent_steps must be a shared tensor of at least {max_agents + 1} slots")
        self.agent_steps = agent_steps
        self.predictions = torch.zeros(max_predictors, dtype=torch.int64).share_memory_()
        self.updates = torch.zeros(max_trainers + 1, dtype=torch.int64).share_memory_()
        self.trainer_stats = torch.zeros(max_trainers, len(TRAINER_FIELDS), dtype=torch.float64).share_memory_()
        self.lag_hist = torch.zeros(max_trainers, LAG_BINS, dtype=torch.int64).share_memory_()
        self.active = torch.zeros(3, dtype=torch.int32).share_memory_()
        self.targets = torch.zeros(3, dtype=torch.int32).share_memory_()  # --dynamic: wanted NT, NP (NA: main)
        self.gate = StepGate()  # the trainers mark each step in it; the main process and the monitor copy between

    # writers, each on its own slot
    def add_steps(self, agent: int, n: int) -> None:
        self.agent_steps[agent] += n

    def add_predictions(self, predictor: int, n: int) -> None:
        self.predictions[predictor] += n

    def record_update(self, trainer: int, *, steps: int, segments: int, lag_mean: float, lag_max: float,
                      policy: float, value: float, entropy: float, grad_norm: float,
                      lags: torch.Tensor | None = None) -> None:
        """Count one update of ``steps`` transitions in ``segments`` segments. ``lag_mean``/``lag_max`` are the
        last batch's, ``lags`` (one per transition) go into the cumulative histogram ``lag_hist`` (exact means and
        maxima over any stretch: ``lag_summary``); the losses (per step) and the gradient norm are smoothed (EMA
        0.99) for display."""
        if lags is not None:
            self.lag_hist[trainer] += torch.bincount(lags.to(torch.int64).clamp(0, LAG_BINS - 1).cpu(),
                                                     minlength=LAG_BINS)
        row = self.trainer_stats[trainer]
        first = int(self.updates[trainer]) == 0
        row[0] += steps
        row[1] += segments
        row[2], row[3] = lag_mean, lag_max
        for i, v in zip((4, 5, 6, 7), (policy, value, entropy, grad_norm)):
            row[i] = v if first else EMA * row[i].item() + (1 - EMA) * v
        fence(RELEASE)
        self.updates[trainer] += 1  # last: the version moves once the statistics are in

    def set_active(self, trainers: int, predictors: int, agents: int) -> None:
        self.active[0], self.active[1], self.active[2] = trainers, predictors, agents

    def restore(self, steps: int, updates: int) -> None:
        """Resume: counts of earlier runs go into the base slots (before any process starts)."""
        self.agent_steps.zero_()
        self.agent_steps[-1] = int(steps)
        self.updates.zero_()
        self.updates[-1] = int(updates)

    # readers
    def lag_snapshot(self) -> torch.Tensor:
        """The histogram of every transition's policy lag so far, over all trainers (a copy, for ``lag_summary``)."""
        return self.lag_hist.sum(0).clone()

    def lag_summary(self, since: torch.Tensor | None = None,
                    until: torch.Tensor | None = None) -> tuple[float, int, int]:
        """``(mean, max, transitions)`` of the policy lag of every transition trained between the histograms
        ``since`` and ``until`` (``lag_snapshot``s; None: the start, and now). A caller that reports stretch after
        stretch passes the same snapshot as one stretch's ``until`` and the next one's ``since``, so that an update
        landing between two reads is in exactly one stretch. Mean and max are 0 when nothing was trained."""
        hist = self.lag_snapshot() if until is None else until
        if since is not None:
            hist = hist - since
        n = int(hist.sum())
        if n == 0:
            return 0.0, 0, 0
        lags = torch.arange(LAG_BINS, dtype=torch.float64)
        return float((hist.double() * lags).sum() / n), int(hist.nonzero().max()), n

    @property
    def steps(self) -> int:
        """Agent steps over all agents (and resumed runs)."""
        return int(self.agent_steps.sum())

    @property
    def version(self) -> int:
        """Training updates over all trainers (and resumed runs): the model's version."""
        return int(self.updates.sum())

    @property
    def total_predictions(self) -> int:
        return int(self.predictions.sum())


class Episode(NamedTuple):
    """A finished game: end time (``time.time()``), unclipped score over all lives, agent steps, and the env slot
    that played it (-1 where the writer did not say)."""

    time: float
    score: float
    length: int
    slot: int = -1


class EpisodeLog:
    """Per agent process, a ring of its last ``capacity`` games (``Episode``: end time, score, length, env slot) and
    how many it has finished (one writer each).

    ``read_new()`` (in the one process that reports) returns every game finished since its last call, oldest
    first; a reader that fell ``capacity`` games or more behind on an agent reads only the newest ``capacity - 1``
    (the oldest slot is the one the agent's next game is written into, perhaps at that moment) and counts the
    others in ``lost``.
    """

    def __init__(self, max_agents: int, capacity: int = 64):
        self.records = torch.zeros(max_agents, capacity, 4, dtype=torch.float64).share_memory_()
        self.counts = torch.zeros(max_agents, dtype=torch.int64).share_memory_()
        self._cursors = [0] * max_agents
        self.lost = 0

    def record(self, agent: int, score: float, length: int, when: float | None = None, slot: int = -1) -> None:
        n = int(self.counts[agent])
        cap = self.records.shape[1]
        self.records[agent, n % cap] = torch.tensor([time.time() if when is None else when, score, length, slot],
                                                    dtype=torch.float64)
        fence(RELEASE)
        self.counts[agent] = n + 1  # last: the record is complete before it is counted

    def read_new(self) -> list[Episode]:
        cap = self.records.shape[1]
        counts = self.counts.tolist()
        fence(ACQUIRE)  # the records counted are read after their counts (record's release fence)
        out = []
        for a, n in enumerate(counts):
            start = self._cursors[a]
            if n - start > cap - 1:
                self.lost += n - start - (cap - 1)
                start = n - (cap - 1)
            for k in range(start, n):
                t, score, length, slot = self.records[a, k % cap].tolist()
                out.append(Episode(t, score, int(length), int(slot)))
            self._cursors[a] = n
        out.sort(key=lambda e: e.time)
        return out

    def __getstate__(self):
        return {"records": self.records, "counts": self.counts}

    def __setstate__(self, state):
        self.__dict__.update(state, _cursors=[0] * state["counts"].numel(), lost=0)


class ScoresById:
    """The mean score of the last ``window`` learner games of each env id, for runs whose learners play several
    (``--train-envs``): GA3C's console line averages over all of them. Ids keep the order of their first game."""

    def __init__(self, window: int = 100):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.recent: dict[str, deque[float]] = {}

    def add(self, env_id: str, score: float) -> None:
        self.recent.setdefault(env_id, deque(maxlen=self.window)).append(float(score))

    def means(self) -> dict[str, tuple[float, int]]:
        """``{env id: (mean of its last games, how many)}``."""
        return {env_id: (sum(q) / len(q), len(q)) for env_id, q in self.recent.items()}

    def text(self) -> str:
        """E.g. ``learner games (last 100 of each): ALE/Pong-v5 17.20, Pong-v0 9.10 (42 games)``; the count is
        given where fewer than ``window`` were played; empty before the first game."""
        parts = [f"{env_id} {mean:.2f}" + (f" ({n} game{'s' if n > 1 else ''})" if n < self.window else "")
                 for env_id, (mean, n) in self.means().items()]
        return f"learner games (last {self.window} of each): {', '.join(parts)}" if parts else ""


def format_stats_line(seconds: float, episode: int, score: float, rscore: float, rpps: float, pps: float,
                      tps: float, nt: int, np_: int, na: int) -> str:
    """GA3C's per-episode console line, formatted exactly as upstream (``%d`` truncates)."""
    return STATS_LINE % (int(seconds), episode, score, rscore, int(rpps), int(pps), int(tps), nt, np_, na)


class ConsoleStats:
    """Rolling statistics behind GA3C's console line (upstream ``ProcessStats``).

    ``add(episode)`` for each finished game, then ``line(now, steps, updates, nt, np, na)`` for that game:
    RScore is the mean score of the last ``window`` games; RPPS the agent steps of those games divided by the
    time since the end of the game that dropped out of the window (the start while fewer than ``window`` games
    were played); PPS and TPS are the exact step and update counts per second since the start. A resumed run
    passes the checkpoint's counts to ``resume`` so that its rates count only its own steps and updates.
    """

    def __init__(self, start_time: float, window: int = 1000, episodes: int = 0):
        self.start_time = start_time
        self.window = window
        self.recent: deque[Episode] = deque()
        self.first_time = start_time
        self.rolling_score = 0.0
        self.rolling_steps = 0
        self.episodes = episodes
        self.base_steps = 0
        self.base_updates = 0

    def resume(self, steps: int, updates: int, episodes: int) -> None:
        """Counts at the checkpoint this run starts from: excluded from PPS and TPS; Episode goes on from
        ``episodes``."""
        self.base_steps, self.base_updates, self.episodes = steps, updates, episodes

    def restart_clock(self, now: float) -> None:
        """The run's processes start now: Time, PPS and TPS count from here."""
        self.start_time = self.first_time = now

    def add(self, episode: Episode) -> None:
        self.episodes += 1
        self.recent.append(episode)
        self.rolling_score += episode.score
        self.rolling_steps += episode.length
        if len(self.recent) > self.window:
            old = self.recent.popleft()
            self.rolling_score -= old.score
            self.rolling_steps -= old.length
            self.first_time = old.time

    def line(self, now: float, steps: int, updates: int, nt: int, np_: int, na: int) -> str:
        last = self.recent[-1]
        elapsed = max(now - self.start_time, 1e-9)
        span = max(now - self.first_time, 1e-9)
        rscore = self.rolling_score / len(self.recent)
        return format_stats_line(elapsed, self.episodes, last.score, rscore, self.rolling_steps / span,
                                 (steps - self.base_steps) / elapsed, (updates - self.base_updates) / elapsed,
                                 nt, np_, na)


def results_line(when: float | datetime, score: float, length: int) -> str:
    """One ``results.txt`` line, ``YYYY-MM-DD HH:MM:SS, score, length`` (upstream ``'%s, %d, %d'``), local time."""
    if not isinstance(when, datetime):
        when = datetime.fromtimestamp(when)
    if not math.isfinite(score):
        raise ValueError(f"score must be finite, got {score}")
    return "%s, %d, %d\n" % (when.strftime(RESULTS_TIME_FORMAT), score, length)


class ResultsWriter:
    """Appends one ``results_line`` per game to ``path`` (flushed per line). A file whose last line was cut short
    (a run killed, or out of disk, while writing it) loses that line first (``drop_cut_line``): ended, a line cut
    inside its game length would read as a game of the wrong length (``plot.py`` also leaves out a last line
    without its newline)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with write_errors(self.path):  # a file that cannot be opened is one line (CheckpointWriteError)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            drop_cut_line(self.path)
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, episode: Episode) -> None:
        """Append the game's line; raises ``CheckpointWriteError`` (one line) when it cannot be written."""
        with write_errors(self.path):
            self._file.write(results_line(episode.time, episode.score, episode.length))
            self._file.flush()

    def close(self) -> None:
        """Close the file; a line left unwritten by a failed ``write`` (already reported) is dropped."""
        close_quietly(self._file)

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""What the processes of one run share: counters, flags, statistics, the error channel.

Everything here is created by the main process before the workers start and handed to them at spawn time.
"""
from __future__ import annotations

import math
import multiprocessing as mp

import torch

UPDATE_FIELDS = ("updates", "steps", "policy_loss", "value_loss", "entropy", "grad_norm")
EMA = 0.99  # smoothing of the per-worker loss statistics shown in logs and TensorBoard


class RunState:
    """Shared state of a run.

    - ``global_steps``: agent steps over all workers (and over resumed runs).
    - ``stop``: set by the main process (stop condition, Ctrl-C, a dead worker); every process checks it.
    - ``target_reached``: set by the monitor when the mean of its last ``score_window`` games reaches the target.
    - ``norm_stats (workers + 1, 3)``: each process's frame-normalisation (mean, std, count); row ``workers`` is
      the monitor's. Saved in checkpoints.
    - ``update_stats (workers, 6)``: per worker updates, steps and smoothed losses (``UPDATE_FIELDS``).
    - ``monitor (3,)``: games played, sum of their scores, best score; ``recent (score_window,)`` last scores.
    - ``errors``: (role, traceback) from a process that failed.
    """

    def __init__(self, ctx: mp.context.BaseContext, workers: int, score_window: int = 10):
        self.workers = workers
        self.global_steps = ctx.Value("q", 0)
        self.stop = ctx.Event()
        self.target_reached = ctx.Event()
        self.norm_stats = torch.zeros(workers + 1, 3, dtype=torch.float64).share_memory_()
        self.update_stats = torch.zeros(workers, len(UPDATE_FIELDS), dtype=torch.float64).share_memory_()
        self.monitor = torch.tensor([0.0, 0.0, -math.inf], dtype=torch.float64).share_memory_()
        self.recent = torch.full((score_window,), math.nan, dtype=torch.float64).share_memory_()
        self.errors = ctx.Queue()

    def record_update(self, rank: int, steps: int, policy: float, value: float, entropy: float,
                      grad_norm: float) -> None:
        row = self.update_stats[rank]
        first = row[0].item() == 0
        row[0] += 1
        row[1] += steps
        for i, v in zip((2, 3, 4, 5), (policy, value, entropy, grad_norm)):
            row[i] = v if first else EMA * row[i].item() + (1 - EMA) * v

    def record_game(self, score: float) -> float | None:
        """Add a monitor game; return the mean of the last ``score_window`` games once that many were played."""
        games = int(self.monitor[0].item())
        self.recent[games % self.recent.numel()] = score
        self.monitor[0] += 1
        self.monitor[1] += score
        if score > self.monitor[2].item():
            self.monitor[2] = score
        if games + 1 >= self.recent.numel():
            return float(self.recent.mean())
        return None

    def recent_scores(self) -> list[float]:
        """The monitor's last ``score_window`` scores, oldest first."""
        games, n = int(self.monitor[0].item()), self.recent.numel()
        return [self.recent[i % n].item() for i in range(max(0, games - n), games)]

    def snapshot(self) -> dict:
        """Counters and statistics for a checkpoint (plain values and CPU tensors)."""
        return {
            "global_steps": int(self.global_steps.value),
            "norm_stats": self.norm_stats.clone(),
            "monitor": self.monitor.clone(),
            "recent_scores": self.recent_scores(),
        }

    def restore(self, ckpt: dict) -> None:
        """Restore counters and statistics from a checkpoint, tolerating a different number of workers."""
        self.global_steps.value = int(ckpt.get("global_steps", 0))
        saved = ckpt.get("norm_stats")
        if saved is not None and saved.shape[0] >= 2:
            n_saved_workers = saved.shape[0] - 1
            for r in range(self.workers):
                self.norm_stats[r] = saved[r % n_saved_workers]
            self.norm_stats[self.workers] = saved[-1]
        if ckpt.get("monitor") is not None:
            self.monitor.copy_(ckpt["monitor"])
        games, n = int(self.monitor[0].item()), self.recent.numel()
        recent = list(ckpt.get("recent_scores", []))[-n:]
        for i, score in enumerate(recent):
            self.recent[(games - len(recent) + i) % n] = score

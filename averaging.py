"""An exponential moving average of the shared weights (``--ema-steps N``): the model the monitor plays and the
``.dat`` holds, while training goes on with the latest weights.

Why: after a Pong run's greedy monitor first reaches +19, single games still fall apart (a -21, a loop scoring 3)
between games of 20 (docs/results.md), the greedy policy of one snapshot of weights that every update moves. An
average of the recent weights (Polyak averaging) is a smoother policy than any one snapshot; training itself is
unchanged, and only what is played and saved is the average.

The average is a model of its own in shared memory, updated by whoever steps the optimizer, right after each update:
a GA3C trainer under its ``step_lock``, once per batch of ``n`` agent steps (after the last of its
``--train-passes``), an A3G worker after its hogwild step (two workers may blend at once, as their steps already
do). An update of ``n`` agent steps blends ``avg <- avg + w (weights - avg)`` with ``w = 1 - exp(-n / N)``: after
any sequence of updates totalling ``s`` agent steps, a weight held constant is reached to within ``exp(-s / N)`` of
where the average started, so N is a time constant in global agent steps whatever the mode's update size (an A3G
worker's 20 steps, a GA3C trainer's 80). The average is float32 and CPU, as the shared weights are; it goes into the
checkpoint as ``average_model`` and is resumed from there.
"""
from __future__ import annotations

import math

import torch

from model import A3Clstm
from player_util import sync_weights


def ema_weight(steps: int, horizon: int) -> float:
    """The blend weight ``1 - exp(-steps / horizon)`` of an update of ``steps`` agent steps (0 for no steps)."""
    if horizon <= 0:
        raise ValueError(f"the average's horizon must be > 0 steps, got {horizon}")
    return -math.expm1(-steps / horizon)


def make_average(model: A3Clstm) -> A3Clstm:
    """A copy of ``model``'s weights as a model of its own in shared memory, float32 and contiguous, without
    gradients: the start of the average."""
    average = A3Clstm(model.conv1.in_channels, model.num_actions, model.hidden_size)
    sync_weights(average, model)
    average.requires_grad_(False)
    return average.share_memory()


@torch.no_grad()
def update_average(average: A3Clstm, model: A3Clstm, steps: int, horizon: int) -> None:
    """Blend ``model``'s weights into ``average`` for an update of ``steps`` agent steps (the module docstring)."""
    w = ema_weight(steps, horizon)
    for a, p in zip(average.parameters(), model.parameters()):
        a.lerp_(p.detach(), w)


def average_line(args) -> str | None:
    """The start-up line of a run with ``--ema-steps``; None without it."""
    if not getattr(args, "ema_steps", 0):
        return None
    return (f"the monitor plays, and the .dat holds, a moving average of the weights with a time constant of "
            f"{args.ema_steps:,} global steps (--ema-steps); training goes on with the latest weights")

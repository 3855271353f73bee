"""A segment: one env slot's consecutive transitions, the unit a trainer batches.

A predictor opens a segment at a slot's step when none is open, records each step it acts on (frame, action,
behaviour probability ``mu``, model version) and closes the segment when the step's outcome ends it:

- after ``num_steps`` steps: bootstrap from V(s_T), the value the predictor computed for the next observation;
- at a termination (game over, or a lost life for learners): bootstrap 0, and the terminal transition *with its
  reward* is kept (upstream GA3C dropped it, its issue 31);
- at a truncation (time limit): bootstrap from V of the truncated episode's last observation (the agent sends it
  as a ``final`` request, see ``buffers``).

The LSTM state at the segment's first step travels with it, so a trainer can replay the segment from there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """``frames (L, 1, 80, 80)``, ``actions (L,)`` int64, clipped ``rewards (L,)``, behaviour probabilities
    ``mu (L,)`` of the actions taken, model ``versions (L,)`` that acted, the LSTM ``state`` ``(hx, cx)`` each
    ``(1, H)`` before the first step, how it ended, and the bootstrap value R_L (0 after a termination)."""

    slot: int
    frames: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    mu: torch.Tensor
    versions: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor]
    terminated: bool
    truncated: bool
    bootstrap: float

    def __len__(self) -> int:
        return int(self.actions.shape[0])

    def as_rollout(self):
        """The same data as the A3C worker's ``player_util.Rollout`` (for the per-segment reference loss)."""
        from player_util import Rollout
        return Rollout(self.frames, self.actions, self.rewards, self.state, self.terminated, self.truncated,
                       self.bootstrap)


class SegmentBuilder:
    """The open segment of one slot, step by step (used by the predictor)."""

    def __init__(self, slot: int, state: tuple[torch.Tensor, torch.Tensor]):
        self.slot = slot
        self.state = (state[0].detach().clone(), state[1].detach().clone())
        self.frames: list[torch.Tensor] = []
        self.actions: list[int] = []
        self.mu: list[float] = []
        self.versions: list[int] = []
        self.rewards: list[float] = []

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def pending(self) -> bool:
        """True while the last step's outcome (reward, flags) is unknown."""
        return len(self.rewards) < len(self.actions)

    def add_step(self, frame: torch.Tensor, action: int, mu: float, version: int) -> None:
        self.frames.append(frame)
        self.actions.append(action)
        self.mu.append(mu)
        self.versions.append(version)

    def add_outcome(self, reward: float) -> None:
        self.rewards.append(reward)

    def close(self, *, terminated: bool, truncated: bool, bootstrap: float) -> Segment:
        assert not self.pending and len(self) > 0
        return Segment(
            slot=self.slot,
            frames=torch.stack(self.frames),
            actions=torch.tensor(self.actions, dtype=torch.int64),
            rewards=torch.tensor(self.rewards, dtype=torch.float32),
            mu=torch.tensor(self.mu, dtype=torch.float32),
            versions=torch.tensor(self.versions, dtype=torch.int64),
            state=self.state,
            terminated=terminated,
            truncated=truncated,
            bootstrap=0.0 if terminated else float(bootstrap),
        )

"""A segment: one env slot's consecutive transitions, the unit a trainer batches.

A predictor opens a segment at a slot's step when none is open, records each step it acts on (frame, action,
behaviour probability ``mu``, model version) and closes the segment when the step's outcome ends it:

- after ``num_steps`` steps: bootstrap from V(s_T), the value the predictor computed for the next observation;
- at a termination (game over, or a lost life for learners): bootstrap 0, and the terminal transition *with its
  reward* is kept (upstream GA3C dropped it, its issue 31);
- at a truncation (time limit): bootstrap from V of the truncated episode's last observation (the agent sends it
  as a ``final`` request, see ``buffers``).

The LSTM state at the segment's first step travels with it, so a trainer can replay the segment from there. With
``acts``, so do the conv activations the predictor computed for each frame (``ACT_FIELDS``): the trainer then
computes the conv gradients from them instead of running the convolutions again (``trainer.batched_unroll``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The conv activations saved per frame, each a batch-first tensor: the encoder's input, then each of the four conv
# blocks' max-pool indices and output (a block's input is the previous block's output, stored once).
ACT_FIELDS = ("input", "indices1", "output1", "indices2", "output2", "indices3", "output3", "indices4", "output4")


def activation_rows(cache, j: int) -> list[torch.Tensor]:
    """Row ``j`` of a batched forward's ``model.ActivationCache`` (one step of 4 conv blocks), as ``ACT_FIELDS``
    views of one row each."""
    (step,) = cache.steps
    rows = [step[0][0][j: j + 1]]
    for _, indices, output in step:
        rows += [indices[j: j + 1], output[j: j + 1]]
    return rows


def conv_blocks(acts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``ACT_FIELDS`` tensors as ``model._Replay``'s blocks ``[(input, indices, output)] * 4``."""
    return [(acts[2 * k], acts[2 * k + 1], acts[2 * k + 2]) for k in range(4)]


def cat_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate batch-first rows, keeping channels-last 4-d tensors channels-last."""
    out = torch.cat(rows)
    if out.dim() == 4 and rows[0].is_contiguous(memory_format=torch.channels_last):
        out = out.contiguous(memory_format=torch.channels_last)
    return out


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
    acts: list[torch.Tensor] | None = None  # ACT_FIELDS, each (L, ...), or None
    greedy: bool = False  # a --greedy-slots slot's: argmax actions, mu = 1

    def __len__(self) -> int:
        return int(self.actions.shape[0])

    def as_rollout(self):
        """The same data as the A3C worker's ``player_util.Rollout`` (for the per-segment reference loss)."""
        from player_util import Rollout
        return Rollout(self.frames, self.actions, self.rewards, self.state, self.terminated, self.truncated,
                       self.bootstrap)


class SegmentBuilder:
    """The open segment of one slot, step by step (used by the predictor)."""

    def __init__(self, slot: int, state: tuple[torch.Tensor, torch.Tensor], greedy: bool = False):
        self.slot = slot
        self.greedy = greedy
        self.state = (state[0].detach().clone(), state[1].detach().clone())
        self.frames: list[torch.Tensor] = []
        self.actions: list[int] = []
        self.mu: list[float] = []
        self.versions: list[int] = []
        self.rewards: list[float] = []
        self.acts: list[list[torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def pending(self) -> bool:
        """True while the last step's outcome (reward, flags) is unknown."""
        return len(self.rewards) < len(self.actions)

    def add_step(self, frame: torch.Tensor, action: int, mu: float, version: int,
                 acts: list[torch.Tensor] | None = None) -> None:
        if acts is not None:
            self.acts.append(acts)
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
            acts=([cat_rows([a[i] for a in self.acts]) for i in range(len(ACT_FIELDS))]
                  if len(self.acts) == len(self.actions) else None),
            greedy=self.greedy,
        )

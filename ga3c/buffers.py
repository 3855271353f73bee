"""Env slots in shared memory: how agent processes and predictors exchange observations, actions and rewards.

Each of the N env slots is one environment, stepped by exactly one agent process and served by exactly one
predictor. A slot is a request/response pair of mailboxes made of shared tensors, created by the main process
before any process is spawned and handed to the children at spawn time.

Why not queues: a pickled ``multiprocessing.Queue`` copies every 25 KB frame twice through a pipe and has a feeder
thread and a lock; a process that dies holding either can wedge the run (see ``run_state``). Here nothing can be
left locked: every field has one writer, and readers poll sequence counters.

Protocol for slot ``i`` (one request in flight per slot):

1. The agent writes the request fields (``obs``, the previous action's ``reward``, ``terminated``,
   ``truncated``, and the ``episode_start`` and ``final`` flags), then *last* ``req_seq[i] += 1``.
2. A predictor sees ``req_seq[i] != resp_seq[i]``, copies the request, acts, writes ``action``, ``mu`` (the
   behaviour probability of that action) and ``version`` (the model's update count), then *last* sets
   ``resp_seq[i] = req_seq``.
3. The agent sees ``resp_seq[i] == req_seq[i]`` and reads the action. It writes nothing in slot ``i`` between
   1 and 3, so the predictor's copy is never torn.

Writers: the agent owns ``obs``, ``reward``, ``terminated``, ``truncated``, ``episode_start``, ``final``,
``req_seq`` and ``norm_stats``; the predictor owns ``action``, ``mu``, ``version`` and ``resp_seq``. The counters
are aligned int64 stores, atomic on x86-64, and each is written after its payload (x86-64 keeps stores in order;
every store here is a separate call into torch, which the Python interpreter does not reorder).

Request meanings:

- ``episode_start``: ``obs`` begins a new learner episode (after a reset, a lost life included): the predictor
  zeroes the slot's LSTM state first.
- ``final``: ``obs`` is the last observation of a *truncated* episode; the predictor only evaluates V(obs) to
  bootstrap the open segment; the action it answers is ignored, and an ``episode_start`` request follows.
- ``reward``, ``terminated``, ``truncated``: the outcome of the slot's previous action. After a termination the
  request already carries the next episode's first observation (with ``episode_start``), because the bootstrap
  is 0 and no value of the terminal observation is needed.
- ``episode_start`` with neither flag set while the predictor still waits for an outcome: the agent restarted
  (e.g. a replacement for a dead agent process): the predictor drops that slot's unfinished segment.

A dead agent leaves at most an answered request that nobody reads; the predictor never waits on a slot.
"""
from __future__ import annotations

import time

import torch

FRAME_SHAPE = (1, 80, 80)

AGENT_FIELDS = ("obs", "reward", "terminated", "truncated", "episode_start", "final", "req_seq", "norm_stats")
PREDICTOR_FIELDS = ("action", "mu", "version", "resp_seq")


class EnvSlots:
    """The shared tensors of ``num_slots`` env slots (see the module docstring for the protocol).

    ``obs (N, 1, 80, 80) float32``; ``reward (N,) float32`` (clipped); ``terminated``, ``truncated``,
    ``episode_start``, ``final (N,) uint8``; ``req_seq``, ``resp_seq``, ``version``, ``action (N,) int64``;
    ``mu (N,) float32``; ``norm_stats (N, 3) float64``: each slot's frame-normalisation (mean, std, count), for
    checkpoints and for restoring an agent's normaliser.
    """

    def __init__(self, num_slots: int, frame_shape: tuple[int, ...] = FRAME_SHAPE,
                 norm_stats: torch.Tensor | None = None):
        if num_slots < 1:
            raise ValueError(f"need at least one env slot, got {num_slots}")
        n = num_slots
        self.num_slots = n
        self.obs = torch.zeros((n, *frame_shape), dtype=torch.float32)
        self.reward = torch.zeros(n, dtype=torch.float32)
        self.terminated = torch.zeros(n, dtype=torch.uint8)
        self.truncated = torch.zeros(n, dtype=torch.uint8)
        self.episode_start = torch.zeros(n, dtype=torch.uint8)
        self.final = torch.zeros(n, dtype=torch.uint8)
        self.req_seq = torch.zeros(n, dtype=torch.int64)
        # A run passes its own rows (``RunState.norm_stats[:n]``, a view of shared memory) so checkpoints see them.
        self.norm_stats = torch.zeros(n, 3, dtype=torch.float64) if norm_stats is None else norm_stats
        self.action = torch.zeros(n, dtype=torch.int64)
        self.mu = torch.zeros(n, dtype=torch.float32)
        self.version = torch.zeros(n, dtype=torch.int64)
        self.resp_seq = torch.zeros(n, dtype=torch.int64)
        if norm_stats is not None and (tuple(norm_stats.shape) != (n, 3) or not norm_stats.is_shared()):
            raise ValueError(f"norm_stats must be a shared ({n}, 3) tensor")
        for name in AGENT_FIELDS + PREDICTOR_FIELDS:
            if not getattr(self, name).is_shared():
                getattr(self, name).share_memory_()

    # ---- agent side -------------------------------------------------------------------------------------------
    def submit(self, slot: int, obs, *, reward: float = 0.0, terminated: bool = False, truncated: bool = False,
               episode_start: bool = False, final: bool = False) -> int:
        """Write a request for ``slot`` and publish it; returns its sequence number (the response will carry it).

        ``obs`` is a ``(1, 80, 80)`` array or tensor. The sequence counter is written last.
        """
        self.obs[slot].copy_(torch.as_tensor(obs))
        self.reward[slot] = float(reward)
        self.terminated[slot] = int(terminated)
        self.truncated[slot] = int(truncated)
        self.episode_start[slot] = int(episode_start)
        self.final[slot] = int(final)
        seq = int(self.req_seq[slot]) + 1
        self.req_seq[slot] = seq
        return seq

    def answered(self, slots: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
        """Boolean mask: which of ``slots`` have the response to request ``seqs``."""
        return self.resp_seq[slots] == seqs

    # ---- predictor side ---------------------------------------------------------------------------------------
    def waiting(self, slots: torch.Tensor) -> torch.Tensor:
        """Those of ``slots`` with a request not yet answered."""
        return slots[self.req_seq[slots] != self.resp_seq[slots]]

    def read_requests(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copy the requests of ``slots`` (their sequence numbers first, the payload after)."""
        seq = self.req_seq[slots].clone()
        return {
            "seq": seq,
            "obs": self.obs[slots],  # advanced indexing copies
            "reward": self.reward[slots],
            "terminated": self.terminated[slots].bool(),
            "truncated": self.truncated[slots].bool(),
            "episode_start": self.episode_start[slots].bool(),
            "final": self.final[slots].bool(),
        }

    def respond(self, slots: torch.Tensor, seqs: torch.Tensor, actions: torch.Tensor, mu: torch.Tensor,
                version: int) -> None:
        """Write the answers for ``slots``, then publish them by setting ``resp_seq`` (last)."""
        self.action[slots] = actions.to(torch.int64).cpu()
        self.mu[slots] = mu.to(torch.float32).cpu()
        self.version[slots] = int(version)
        self.resp_seq[slots] = seqs


class Backoff:
    """Polling with an exponentially growing sleep (``low`` to ``high`` seconds), reset on progress.

    A reader waiting for an answer that takes t seconds sleeps about log2(t / low) + t / high times and
    oversleeps by at most ``min(t, high)``. An idle reader wakes 500 times a second: an idle agent process
    (stop-flag check and a 5 us poll per wake-up) used 3-4% of a core on a loaded 2-core VM, where a busy spin
    would burn a whole core.
    """

    def __init__(self, low: float = 5e-5, high: float = 2e-3):
        self.low, self.high = low, high
        self.delay = low

    def reset(self) -> None:
        self.delay = self.low

    def wait(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.high, self.delay * 2)

"""Env slots in shared memory: how agent processes and predictors exchange observations, actions and rewards.

Each of the N env slots is one environment, stepped by exactly one agent process and served by exactly one
predictor. A slot is a request/response pair of mailboxes made of shared tensors, created by the main process
before any process is spawned and handed to the children at spawn time.

Why not queues: a pickled ``multiprocessing.Queue`` copies every 25 KB frame twice through a pipe and has a feeder
thread and a lock; a process that dies holding either can wedge the run (see ``run_state``). Here nothing can be
left locked: every field has one writer, and readers poll sequence counters.

Protocol for slot ``i`` (one request in flight per slot):

1. The agent writes the request fields (``obs``, the previous action's ``reward``, ``terminated``,
   ``truncated``, and the ``episode_start`` and ``final`` flags), then a release fence, then *last*
   ``req_seq[i] += 1``.
2. A predictor sees ``req_seq[i] != resp_seq[i]``; after an acquire fence it copies the request, acts, writes
   ``action``, ``mu`` (the behaviour probability of that action) and ``version`` (the version of the weights
   that acted), then a release fence, then *last* sets ``resp_seq[i] = req_seq``.
3. The agent sees ``resp_seq[i] == req_seq[i]`` and, after an acquire fence, reads the action. It writes nothing
   in slot ``i`` between 1 and 3, so the predictor's copy is never torn.

Writers: the agent owns ``obs``, ``reward``, ``terminated``, ``truncated``, ``episode_start``, ``final``,
``req_seq`` and ``norm_stats``; the predictor owns ``action``, ``mu``, ``version`` and ``resp_seq``.

Memory order. Program order alone is not enough: every store here is a separate call into torch, which neither
the interpreter nor the compiler reorders, but a weakly ordered CPU (aarch64, POWER) may make a process's stores
visible to another core in another order, and satisfy its loads out of order; a predictor could then read a
new ``req_seq`` with a torn or old observation. The fences (``fence``: C11 ``atomic_thread_fence`` from
libatomic, through ctypes, about 0.3 us a call) forbid that: a release fence keeps every earlier load and store
before the counter store that follows it, an acquire fence every later load and store after the counter load
that precedes it. Reading ``action``, ``mu`` or ``version`` (properties) issues an acquire fence; the agent
also issues one as soon as it sees a slot answered (``EnvRunner.answered``, ``AgentStepper.poll``, and before a
slot is taken over in ``EnvRunner.begin``), since the answer to a ``final`` request is followed by a new request
with no action read. On x86-64, whose loads and stores are already ordered this way, the
fences compile to nothing and only the call is paid. The counters themselves are aligned 8-byte stores and
loads, single-copy atomic on x86-64 and aarch64. Where libatomic cannot be loaded, x86-64 needs nothing and
runs; any other CPU refuses to build env slots (``ordering_problem`` says why in one line) rather than run
unordered. Fences, not a refusal of every CPU but x86-64: the protocol stays lock-free and the same on every
CPU, and costs x86-64 a call. The order of each fence among the loads and stores is tested on any CPU; the
protocol has not been run on an aarch64 machine. ``norm_stats`` is outside the protocol: statistics that a
checkpoint reads as they are.

Request meanings:

- ``episode_start``: ``obs`` begins a new learner episode (after a reset, a lost life included): the predictor
  zeroes the slot's LSTM state first.
- ``final``: ``obs`` is the last observation of a *truncated* episode; the predictor only evaluates V(obs) to
  bootstrap the open segment; the action it answers is ignored, and an ``episode_start`` request follows.
- ``reward``, ``terminated``, ``truncated``: the outcome of the slot's previous action. After a termination the
  request already carries the next episode's first observation (with ``episode_start``), because the bootstrap
  is 0 and no value of the terminal observation is needed.
- ``episode_start`` with neither flag set while the predictor still waits for an outcome: the agent restarted
  (e.g. a replacement for a dead agent process): the predictor drops that slot's unfinished segment. The new
  agent writes the slot only once the old one's last request is answered (``EnvRunner.begin``; after a timeout
  when no predictor answers), so step 3's rule holds across a takeover too.

A dead agent leaves at most an answered request that nobody reads; the predictor never waits on a slot.
"""
from __future__ import annotations

import ctypes
import platform
import time

import torch

FRAME_SHAPE = (1, 80, 80)
ACQUIRE, RELEASE = 2, 3  # C11 memory_order_acquire, memory_order_release
ORDERED_CPUS = ("x86_64", "amd64")  # loads and stores already ordered as the protocol needs (x86-TSO)


def _load_thread_fence():
    """libatomic's ``atomic_thread_fence(memory_order)`` (GCC's runtime, LIBATOMIC_1.2), or None."""
    try:
        f = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_int], None
    return f


_thread_fence = _load_thread_fence()


def fence(order: int) -> None:
    """A memory fence of ``order`` (``ACQUIRE`` or ``RELEASE``) between this thread's earlier and later loads and
    stores (see the module docstring); nothing where libatomic is missing on an ordered CPU."""
    if _thread_fence is not None:
        _thread_fence(order)


def ordering_problem(machine: str | None = None, have_fence: bool | None = None) -> str | None:
    """Why env slots cannot be shared safely on this machine, in one line, or None when they can."""
    machine = platform.machine() if machine is None else machine
    have_fence = _thread_fence is not None if have_fence is None else have_fence
    if have_fence or machine.lower() in ORDERED_CPUS:
        return None
    return (f"GA3C mode needs memory fences between its processes on this {machine} CPU, and libatomic.so.1 "
            f"could not be loaded: install GCC's libatomic (e.g. apt-get install libatomic1)")


AGENT_FIELDS = ("obs", "reward", "terminated", "truncated", "episode_start", "final", "req_seq", "norm_stats")
PREDICTOR_FIELDS = ("action", "mu", "version", "resp_seq")


class EnvSlots:
    """The shared tensors of ``num_slots`` env slots (see the module docstring for the protocol).

    ``obs (N, 1, 80, 80) float32``; ``reward (N,) float32`` (clipped); ``terminated``, ``truncated``,
    ``episode_start``, ``final (N,) uint8``; ``req_seq``, ``resp_seq``, ``version``, ``action (N,) int64``;
    ``mu (N,) float32``; ``norm_stats (N, 3) float64``: each slot's frame-normalisation (mean, std, count), for
    checkpoints and for restoring an agent's normaliser. ``action``, ``mu`` and ``version`` are read through an
    acquire fence (see the module docstring); raises ``RuntimeError`` where ``ordering_problem`` finds one.
    """

    def __init__(self, num_slots: int, frame_shape: tuple[int, ...] = FRAME_SHAPE,
                 norm_stats: torch.Tensor | None = None):
        if num_slots < 1:
            raise ValueError(f"need at least one env slot, got {num_slots}")
        problem = ordering_problem()
        if problem is not None:
            raise RuntimeError(problem)
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
        self._action = torch.zeros(n, dtype=torch.int64)
        self._mu = torch.zeros(n, dtype=torch.float32)
        self._version = torch.zeros(n, dtype=torch.int64)
        self.resp_seq = torch.zeros(n, dtype=torch.int64)
        if norm_stats is not None and (tuple(norm_stats.shape) != (n, 3) or not norm_stats.is_shared()):
            raise ValueError(f"norm_stats must be a shared ({n}, 3) tensor")
        for name in AGENT_FIELDS + PREDICTOR_FIELDS:
            if not getattr(self, name).is_shared():
                getattr(self, name).share_memory_()

    # ---- the answer, read after an acquire fence -------------------------------------------------------------
    @property
    def action(self) -> torch.Tensor:
        fence(ACQUIRE)
        return self._action

    @property
    def mu(self) -> torch.Tensor:
        fence(ACQUIRE)
        return self._mu

    @property
    def version(self) -> torch.Tensor:
        fence(ACQUIRE)
        return self._version

    # ---- agent side -------------------------------------------------------------------------------------------
    def submit(self, slot: int, obs, *, reward: float = 0.0, terminated: bool = False, truncated: bool = False,
               episode_start: bool = False, final: bool = False) -> int:
        """Write a request for ``slot`` and publish it; returns its sequence number (the response will carry it).

        ``obs`` is a ``(1, 80, 80)`` array or tensor. The sequence counter is written last, after a release fence.
        """
        self.obs[slot].copy_(torch.as_tensor(obs))
        self.reward[slot] = float(reward)
        self.terminated[slot] = int(terminated)
        self.truncated[slot] = int(truncated)
        self.episode_start[slot] = int(episode_start)
        self.final[slot] = int(final)
        seq = int(self.req_seq[slot]) + 1
        fence(RELEASE)
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
        """Copy the requests of ``slots`` (their sequence numbers first, then an acquire fence, then the payload)."""
        seq = self.req_seq[slots].clone()
        fence(ACQUIRE)
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
        """Write the answers for ``slots``, then publish them by setting ``resp_seq`` (last, after a release
        fence)."""
        self._action[slots] = actions.to(torch.int64).cpu()
        self._mu[slots] = mu.to(torch.float32).cpu()
        self._version[slots] = int(version)
        fence(RELEASE)
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

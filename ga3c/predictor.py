"""The predictor: one batched LSTM forward for every waiting env slot, each action routed back to its slot.

Each step takes the requests waiting in the slots this predictor owns, up to ``predict_batch`` of them (starting
after the last slot served, so no slot starves when more are waiting), and runs ``A3Clstm.forward`` once on
``(B, 1, 80, 80)`` with the per-slot LSTM states gathered into ``(B, H)``. A batched forward equals stepping
each env alone at batch 1 (tested). It then samples each action from its softmax (a ``--greedy-slots`` slot
takes the argmax and records ``mu = 1``), answers each slot with the action, its probability ``mu`` under the
acting policy and the version of the weights that acted (the update
count they include), and scatters the new states back. Slots not in the batch keep their state.

The LSTM state of every slot lives here, not in the agent: the agent never runs the model. A request flagged
``episode_start`` (a reset, after a game over, a time limit or, for learners, a lost life) zeroes its slot's
state before the forward, as the A3C worker does at every episode end.

The predictor also assembles each slot's transitions into ``Segment`` s (see ``segment``) and hands each closed
segment to ``sink`` (a ``queue.Queue`` read by the trainers in this process).

Several predictors may run (threads), each owning a disjoint set of slots; they share the state tensors, each
writing only its own slots' rows. With ``source`` the predictor acts with a private ``model`` (e.g. channels-last,
or on another device) and copies ``source``'s weights into it once the version moved by ``sync_every``; the
version it stamps is then that of its last copy, not the current one, so the trainers' policy lag counts the
updates the private weights are behind.
"""
from __future__ import annotations

import contextlib
import queue
from dataclasses import dataclass
import torch
import torch.nn.functional as F

from ga3c.buffers import Backoff, EnvSlots
from ga3c.segment import Segment, SegmentBuilder, activation_rows
from model import ActivationCache
from player_util import sync_weights


class SlotStates:
    """The LSTM state ``(hx, cx)`` of every env slot, each ``(N, H)`` on ``device``."""

    def __init__(self, num_slots: int, hidden_size: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.hx = torch.zeros(num_slots, hidden_size, device=device)
        self.cx = torch.zeros(num_slots, hidden_size, device=device)

    def reset(self, slots: torch.Tensor) -> None:
        self.hx[slots] = 0.0
        self.cx[slots] = 0.0

    def get(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hx[slots], self.cx[slots]

    def put(self, slots: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.hx[slots] = state[0]
        self.cx[slots] = state[1]


@dataclass
class PredictionBatch:
    """What one predictor step did: the slots served, in order, and the model's outputs for them."""

    slots: torch.Tensor
    values: torch.Tensor
    logits: torch.Tensor
    actions: torch.Tensor
    version: int


class Predictor:
    """Serves the env ``slots`` it owns (see the module docstring).

    ``counters`` (``Ga3cCounters``) gives the model version (its update count), and counts this predictor's
    predictions in its slot ``index``; ``sink(segment)`` receives closed segments (``None``: segments are not
    kept, e.g. evaluation). With ``source``, ``model`` is a private copy refreshed from ``source`` once
    ``counters.version`` moved by ``sync_every`` (so ``source`` needs ``counters``), and every action is stamped
    with the version of that copy; without it, with the current version of ``model`` itself.
    """

    def __init__(self, model, buffers: EnvSlots, slots, states: SlotStates, *, num_steps: int,
                 predict_batch: int, counters=None, index: int = 0, sink=None,
                 device: torch.device | str = "cpu", source=None, seed: int = 0, greedy: bool = False,
                 open_segments: dict | None = None, sync_every: int = 1, save_activations: bool = False,
                 step_lock=None, greedy_slots=()):
        self.model = model
        # held while reading the version and copying the weights: the trainers step the optimizer and move the
        # version under it, so the copy and its stamp are always one version's
        self.step_lock = step_lock if step_lock is not None else contextlib.nullcontext()
        self.buffers = buffers
        self.slots = torch.as_tensor(list(slots), dtype=torch.int64)
        self.states = states
        self.num_steps = num_steps
        self.predict_batch = predict_batch
        self.counters = counters
        self.index = index
        self.sink = sink
        self.device = torch.device(device)
        self.source = source
        self.greedy = greedy
        # --greedy-slots: these slots take the argmax action and record mu = 1 (a deterministic behaviour policy)
        self.greedy_slots = frozenset(int(s) for s in greedy_slots)
        self.greedy_mask = torch.zeros(buffers.num_slots if self.greedy_slots else 0, dtype=torch.bool)
        for s in self.greedy_slots:
            self.greedy_mask[s] = True
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Open segments by slot; predictors that replace this one (``Server.set_counts``) take the same dict over.
        self.open: dict[int, SegmentBuilder] = {} if open_segments is None else open_segments
        self.sync_every = sync_every
        self.save_activations = save_activations and sink is not None
        self._next = 0  # round-robin start, an index into self.slots
        self._synced = -1
        self.predictions = 0

    def _take(self) -> torch.Tensor:
        """The waiting slots, at most ``predict_batch``, starting after the last one served."""
        n = self.slots.numel()
        order = torch.cat([self.slots[self._next:], self.slots[: self._next]])
        waiting = self.buffers.waiting(order)[: self.predict_batch]
        if waiting.numel():
            last = int((self.slots == waiting[-1]).nonzero()[0, 0])
            self._next = (last + 1) % n
        return waiting

    @torch.no_grad()
    def step(self) -> PredictionBatch | None:
        """Serve the waiting requests (one batched forward); None when nothing was waiting."""
        slots = self._take()
        if slots.numel() == 0:
            return None
        req = self.buffers.read_requests(slots)
        version = self.counters.version if self.counters is not None else 0
        if self.source is not None:
            with self.step_lock:
                version = self.counters.version if self.counters is not None else 0
                if self._synced < 0 or version - self._synced >= self.sync_every:
                    sync_weights(self.model, self.source)
                    self._synced = version
            # the private copy acts with the weights of its last sync, up to sync_every - 1 updates older than
            # ``version``: those are the weights the answer and the segment must name, or the lag is under-counted
            version = self._synced
        state_slots = slots.to(self.states.device)
        starts = req["episode_start"]
        if bool(starts.any()):
            self.states.reset(state_slots[starts.to(self.states.device)])
        state = tuple(t.to(self.device) for t in self.states.get(state_slots))
        cache = ActivationCache() if self.save_activations else None
        obs = req["obs"].to(self.device)
        if cache is None:
            value, logits, new_state = self.model(obs, state)
        else:  # the conv blocks' activations are kept for the trainer (no LSTM gates: it runs the LSTM again)
            new_state = self.model.lstm(self.model.features(obs, cache), state)
            value, logits = self.model.heads(new_state[0])
        self.states.put(state_slots, tuple(t.to(self.states.device) for t in new_state))
        probs = F.softmax(logits, dim=1)
        if self.greedy:
            actions = logits.argmax(1)
        else:
            actions = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        g = self.greedy_mask[slots].to(actions.device) if self.greedy_slots else None
        if g is not None and bool(g.any()):
            actions = torch.where(g, logits.argmax(1), actions)
        mu = probs.gather(1, actions.unsqueeze(1)).squeeze(1)
        if g is not None:
            mu = mu.masked_fill(g, 1.0)
        self.buffers.respond(slots, req["seq"], actions, mu, version)
        self.predictions += slots.numel()
        if self.counters is not None:
            self.counters.add_predictions(self.index, slots.numel())
        if self.sink is not None:
            self._record(slots, req, state, value.squeeze(1).cpu(), actions.cpu(), mu.cpu(), version, cache)
        return PredictionBatch(slots, value.squeeze(1), logits, actions, version)

    def _record(self, slots, req, state, values, actions, mu, version, cache=None) -> None:
        """Segment bookkeeping for the served slots: the previous step's outcome, closing, the new step."""
        rewards, term, trunc = req["reward"].tolist(), req["terminated"].tolist(), req["truncated"].tolist()
        starts, final = req["episode_start"].tolist(), req["final"].tolist()
        for j, slot in enumerate(slots.tolist()):
            seg = self.open.get(slot)
            if seg is not None and seg.pending:
                if term[j] or trunc[j]:
                    seg.add_outcome(rewards[j])
                    self.sink(seg.close(terminated=bool(term[j]), truncated=bool(trunc[j]) and not term[j],
                                         bootstrap=float(values[j])))
                    seg = None
                elif starts[j]:  # a restarted agent: the last step's outcome will never come
                    seg = None
                else:
                    seg.add_outcome(rewards[j])
                    if len(seg) >= self.num_steps:
                        self.sink(seg.close(terminated=False, truncated=False, bootstrap=float(values[j])))
                        seg = None
            if final[j]:  # only V(obs) was wanted, for the bootstrap above
                self.open.pop(slot, None)
                continue
            if seg is None:
                seg = SegmentBuilder(slot, (state[0][j: j + 1].cpu(), state[1][j: j + 1].cpu()),
                                     greedy=slot in self.greedy_slots)
                self.open[slot] = seg
            seg.add_step(req["obs"][j], int(actions[j]), float(mu[j]), version,
                         None if cache is None else activation_rows(cache, j))

    def run(self, stop, max_batches: int | None = None) -> int:
        """Serve until ``stop.is_set()`` (or ``max_batches`` batches); returns the number of predictions made."""
        backoff = Backoff()
        batches = 0
        while not stop.is_set() and (max_batches is None or batches < max_batches):
            if self.step() is None:
                backoff.wait()
            else:
                backoff.reset()
                batches += 1
        return self.predictions


def queue_sink(q: "queue.Queue[Segment]", stop, poll: float = 0.05):
    """A ``sink`` that puts segments on an in-process queue, waiting while it is full but never past ``stop``
    (a full queue slows the predictor, and thereby the agents: back-pressure from the trainers)."""

    def put(segment: Segment) -> None:
        while not stop.is_set():
            try:
                q.put(segment, timeout=poll)
                return
            except queue.Full:
                continue

    return put

"""GA3C's shared-memory env slots across real spawned processes: several agent processes, one predictor; every
action reaches the env it was computed for (a fake model's action encodes the slot, the step and the slot's LSTM
state, which the env checks), per-slot states are reset at episode starts, and a killed agent wedges nothing: the
other agents carry on, and a replacement agent takes its slots over."""
import multiprocessing as mp
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from ga3c.agent import agent_process
from ga3c.buffers import Backoff, EnvSlots
from ga3c.stats import EpisodeLog, Ga3cCounters
from run_state import ErrorBoard, Flag

NUM_ACTIONS = 18
K = 4  # envs per agent


def code_action(slot, t):
    return (slot * 7 + t * 3) % NUM_ACTIONS


class CodeModel(torch.nn.Module):
    """Reads (slot, t) from the frame and answers ``code_action(slot, t)`` with probability 1, but only when the
    slot's LSTM state (here: a count of forwards since the last reset) says t as well: a state routed to the
    wrong slot, or not reset at an episode start, gives a wrong action."""

    hidden_size = 4

    def forward(self, x, state):
        slot, t = x[:, 0, 0, 0].round().long(), x[:, 0, 0, 1].round().long()
        count = state[0][:, 0].round().long()
        action = code_action(slot, t) + (count != t).long()
        logits = torch.full((x.shape[0], NUM_ACTIONS), -1e4)
        logits[torch.arange(x.shape[0]), action % NUM_ACTIONS] = 0.0
        return torch.zeros(x.shape[0], 1), logits, (state[0] + 1, state[1])


class CodeEnv:
    """Frames carry (slot, t since the episode start); episodes of 5 + slot % 3 steps end alternately by
    truncation and termination. ``tally[slot]`` counts right and wrong actions received."""

    def __init__(self, slot, tally):
        self.slot, self.tally = slot, tally
        self.episodes = 0

    def _obs(self):
        o = np.zeros((1, 80, 80), np.float32)
        o[0, 0, 0], o[0, 0, 1] = self.slot, self.t
        return o

    def reset(self, seed=None):
        self.t = 0
        self.episodes += 1
        return self._obs(), {}

    def step(self, action):
        self.tally[self.slot, 0 if action == code_action(self.slot, self.t) else 1] += 1
        self.t += 1
        end = self.t == 5 + self.slot % 3
        terminated = end and self.episodes % 2 == 0
        return self._obs(), 1.0, terminated, end and not terminated, {}

    def close(self):
        pass


@dataclass(frozen=True)
class CodeEnvFactory:
    tally: torch.Tensor

    def __call__(self, slot):
        return CodeEnv(slot, self.tally)


def test_requests_and_answers_round_trip_by_sequence_number():
    buffers = EnvSlots(3)
    slots = torch.arange(3)
    assert buffers.waiting(slots).numel() == 0
    seq = buffers.submit(1, np.ones((1, 80, 80), np.float32), reward=0.5, terminated=True, episode_start=True)
    assert seq == 1 and buffers.waiting(slots).tolist() == [1]
    req = buffers.read_requests(torch.tensor([1]))
    assert req["seq"].tolist() == [1] and bool(req["terminated"][0]) and bool(req["episode_start"][0])
    assert not bool(req["truncated"][0]) and req["reward"].tolist() == [0.5] and req["obs"].sum() == 6400
    assert not buffers.answered(torch.tensor([1]), torch.tensor([1])).item()
    buffers.respond(torch.tensor([1]), req["seq"], torch.tensor([4]), torch.tensor([0.25]), version=9)
    assert buffers.answered(torch.tensor([1]), torch.tensor([1])).item() and buffers.waiting(slots).numel() == 0
    assert (int(buffers.action[1]), buffers.mu[1].item(), int(buffers.version[1])) == (4, 0.25, 9)
    b = Backoff(low=1e-4, high=4e-4)
    for _ in range(4):
        b.wait()
    assert b.delay == 4e-4
    b.reset()
    assert b.delay == 1e-4


def test_each_counter_is_published_and_read_across_a_fence(monkeypatch):
    """The memory-order half of the protocol, checked at each fence (so on any CPU): a release fence after the
    payload stores and before the counter store (``submit``, ``respond``); an acquire fence after the counter
    load and before the payload loads (``read_requests``, and the agent's read of its action). A fence that
    writes new data shows which loads come after it: those see the new data."""
    import ga3c.buffers as module

    b = EnvSlots(2)
    seen = []
    monkeypatch.setattr(module, "fence", lambda order: seen.append((order, hook(order))))
    frame = np.full((1, 80, 80), 3.0, np.float32)

    def hook(order):  # what the slot holds at the fence
        return {"obs": float(b.obs[1].mean()), "reward": float(b.reward[1]), "final": int(b.final[1]),
                "req_seq": int(b.req_seq[1]), "action": int(b._action[1]), "mu": float(b._mu[1]),
                "version": int(b._version[1]), "resp_seq": int(b.resp_seq[1])}

    assert b.submit(1, frame, reward=-1.0, final=True) == 1
    assert seen == [(module.RELEASE, {"obs": 3.0, "reward": -1.0, "final": 1, "req_seq": 0, "action": 0, "mu": 0.0,
                                      "version": 0, "resp_seq": 0})]  # payload in, counter not yet

    def publish_during_fence(order):  # the agent's next request lands at the fence
        b.obs[1] = 5.0
        b.req_seq[1] += 1
        seen.append((order, None))
    seen.clear()
    monkeypatch.setattr(module, "fence", publish_during_fence)
    req = b.read_requests(torch.tensor([1]))
    assert seen == [(module.ACQUIRE, None)]
    assert req["seq"].tolist() == [1] and float(req["obs"].mean()) == 5.0  # counter before, payload after

    seen.clear()
    monkeypatch.setattr(module, "fence", lambda order: seen.append((order, hook(order))))
    b.respond(torch.tensor([1]), torch.tensor([2]), torch.tensor([4]), torch.tensor([0.5]), version=9)
    assert [(order, {k: at[k] for k in ("action", "mu", "version", "resp_seq")}) for order, at in seen] == [
        (module.RELEASE, {"action": 4, "mu": 0.5, "version": 9, "resp_seq": 0})]  # answer in, counter not yet

    def answer_during_fence(order):
        b._action[1] = 7
        seen.append((order, None))
    seen.clear()
    monkeypatch.setattr(module, "fence", answer_during_fence)
    assert int(b.action[1]) == 7 and seen == [(module.ACQUIRE, None)]  # the agent's action load comes after


def test_the_fence_is_real_here_and_an_unordered_cpu_without_one_is_refused(monkeypatch):
    import ga3c.buffers as module

    for order in (module.ACQUIRE, module.RELEASE):
        module.fence(order)
    assert module.ordering_problem("x86_64", have_fence=False) is None  # already ordered
    assert module.ordering_problem("aarch64", have_fence=True) is None
    problem = module.ordering_problem("aarch64", have_fence=False)
    assert "aarch64" in problem and "libatomic" in problem and "\n" not in problem
    monkeypatch.setattr(module, "_thread_fence", None)
    monkeypatch.setattr(module.platform, "machine", lambda: "aarch64")
    with pytest.raises(RuntimeError, match="needs memory fences"):
        EnvSlots(1)


def test_routing_across_agent_processes_and_a_dead_agent_wedges_nothing():
    from ga3c.predictor import Predictor, SlotStates  # here: spawned children import only what they need

    ctx = mp.get_context("spawn")
    n_slots = 3 * K
    buffers = EnvSlots(n_slots)
    tally = torch.zeros(n_slots, 2, dtype=torch.int64).share_memory_()
    counters, episodes, errors, stop = Ga3cCounters(4, 1, 1), EpisodeLog(4), ErrorBoard(4), Flag()
    segments = []
    pred = Predictor(CodeModel(), buffers, range(n_slots), SlotStates(n_slots, 4), num_steps=4, predict_batch=5,
                     counters=counters, sink=segments.append)
    procs = {}

    def start(agent, slots):
        p = ctx.Process(target=agent_process, args=(agent, slots, buffers, CodeEnvFactory(tally), stop, counters,
                                                   episodes, None, errors, agent), name=f"agent {agent}")
        p.start()
        procs[agent] = p

    def serve_until(done, timeout=60.0):
        deadline, backoff = time.monotonic() + timeout, Backoff()
        while not done():
            assert time.monotonic() < deadline, f"no progress: {tally[:, 0].tolist()}, {errors.read_all()}"
            if pred.step() is None:
                backoff.wait()
            else:
                backoff.reset()

    try:
        for a in range(3):
            start(a, list(range(a * K, (a + 1) * K)))
        serve_until(lambda: int(tally[:, 0].min()) >= 20)
        procs[2].kill()  # mid-run, maybe mid-request
        procs[2].join(10)
        before = tally[:, 0].clone()
        serve_until(lambda: int((tally[: 2 * K, 0] - before[: 2 * K]).min()) >= 20)  # the others carry on
        assert torch.equal(tally[2 * K:, 0], before[2 * K:])
        start(3, list(range(2 * K, 3 * K)))  # a replacement takes the dead agent's slots over
        serve_until(lambda: int((tally[2 * K:, 0] - before[2 * K:]).min()) >= 20)
        stop.set()
        for p in procs.values():
            p.join(10)
        assert [procs[a].exitcode for a in (0, 1, 3)] == [0, 0, 0] and procs[2].exitcode != 0
    finally:
        stop.set()
        for p in procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert errors.read_all() == []
    assert int(tally[:, 1].sum()) == 0, "an action reached the wrong env (or a slot's state was not reset)"
    # exact step counts for the agents that lived; the killed one may have stepped once per env uncounted
    for a in (0, 1):
        assert int(counters.agent_steps[a]) == int(tally[a * K: (a + 1) * K].sum())
    counted = int(counters.agent_steps[2] + counters.agent_steps[3])
    assert counted <= int(tally[2 * K:].sum()) <= counted + K
    # segments hold one slot's consecutive steps each, with the actions that slot was sent
    assert len(segments) > 3 * n_slots
    assert any(seg.terminated for seg in segments) and any(seg.truncated for seg in segments)
    for seg in segments:
        slots, ts = seg.frames[:, 0, 0, 0].long(), seg.frames[:, 0, 0, 1].long()
        assert (slots == seg.slot).all() and torch.equal(ts, ts[0] + torch.arange(len(seg)))
        assert seg.actions.tolist() == [code_action(seg.slot, int(t)) for t in ts]
        if seg.terminated or seg.truncated:  # the episode's last transition is in it
            assert int(ts[-1]) + 1 == 5 + seg.slot % 3
        else:
            assert len(seg) == 4

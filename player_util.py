"""The agent a worker drives: acting in its environment, and one A3C update from a rollout.

Acting runs under ``torch.no_grad`` and keeps only what the update needs: frames, actions, rewards, the LSTM
state at the rollout's start, and the conv blocks' and the LSTM's activations (``ActivationCache``). The update
replays the rollout with gradients through ``A3Clstm.unroll``: the conv and LSTM gradients come from the saved
activations, and only the heads run again, once over the whole rollout. The weights do not change during a
rollout (the local copy is synced only between rollouts), so this is upstream's forward-with-grad at every step
and gives the same gradient (tested against that slow path), at a fraction of the cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F

from environment import FIRE_RESET_ACTIONS, LifeCounter, presses_fire
from losses import A3CLoss, a3c_loss, bootstrap_value
from model import A3Clstm, ActivationCache


@dataclass
class Rollout:
    """One agent's rollout: ``frames (T, 1, 80, 80)``, ``actions (T,)``, clipped ``rewards (T,)``, the LSTM state
    before the first step, and how it ended."""

    frames: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor]
    terminated: bool
    truncated: bool
    bootstrap: float
    cache: ActivationCache | None = None


class Agent:
    """An environment, a local model on ``device``, and the LSTM state carried between rollouts."""

    def __init__(self, model: A3Clstm, env: gym.Env, device: torch.device, seed: int | None = None):
        self.model = model
        self.env = env
        self.device = device
        self.seed = seed
        self.hx, self.cx = model.initial_state(1, device)
        self.obs = None
        self.episode_done = True  # start with a reset
        self.episode_reward = 0.0  # unclipped, over the learner's (life-long) episode
        self.episode_length = 0

    def _frame(self, obs: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(obs).to(self.device).unsqueeze(0)

    def reset(self) -> None:
        """Reset the environment (a real reset, or the next life) and start from a zero LSTM state: new tensors,
        not the old ones zeroed in place, since an earlier rollout's ``ActivationCache`` holds the last state it
        handed over (which its replay reads)."""
        if self.seed is not None:
            obs, _ = self.env.reset(seed=self.seed)
            self.seed = None
        else:
            obs, _ = self.env.reset()
        self.obs = self._frame(obs)
        self.hx, self.cx = self.model.initial_state(1, self.device)
        self.episode_done = False
        self.episode_reward = 0.0
        self.episode_length = 0

    @torch.no_grad()
    def rollout(self, num_steps: int, greedy: bool = False) -> Rollout:
        """Act up to ``num_steps`` steps, stopping early at an episode end (a lost life included for learners).

        The LSTM state handed over in the result is detached (no gradient crosses rollouts).
        """
        if self.episode_done:
            self.reset()
        state = (self.hx.clone(), self.cx.clone())
        cache = ActivationCache()
        frames, actions, rewards = [], [], []
        hx, cx = self.hx, self.cx
        terminated = truncated = False
        for _ in range(num_steps):
            frames.append(self.obs)
            _, logits, (hx, cx) = self.model(self.obs, (hx, cx), cache)
            if greedy:
                action = int(logits.argmax(1))
            else:
                action = int(torch.multinomial(F.softmax(logits, dim=1), 1))
            obs, reward, terminated, truncated, _ = self.env.step(action)
            self.obs = self._frame(obs)
            actions.append(action)
            rewards.append(max(-1.0, min(1.0, float(reward))))
            self.episode_reward += float(reward)
            self.episode_length += 1
            if terminated or truncated:
                break
        self.hx, self.cx = hx, cx
        if terminated:
            bootstrap = 0.0
        else:  # cut by num_steps or by the time limit: bootstrap from V(s_T)
            value, _, _ = self.model(self.obs, (hx, cx))
            bootstrap = bootstrap_value(False, value)
        self.episode_done = terminated or truncated
        return Rollout(torch.cat(frames), torch.tensor(actions, device=self.device),
                       torch.tensor(rewards, dtype=torch.float32), state, terminated, truncated, bootstrap, cache)


def rollout_loss(model: A3Clstm, rollout: Rollout, *, gamma: float, tau: float, entropy_coef: float,
                 value_coef: float) -> A3CLoss:
    """Replay ``rollout`` through ``model`` with gradients and return the A3C loss terms.

    ``model`` must hold the weights the rollout was acted with (its conv activations are reused).
    """
    values, logits = model.unroll(rollout.frames, rollout.state, rollout.cache)
    return a3c_loss(logits, values, rollout.actions, rollout.rewards.to(values.device), rollout.bootstrap,
                    gamma=gamma, tau=tau, entropy_coef=entropy_coef, value_coef=value_coef)


def stepwise_rollout_loss(model: A3Clstm, rollout: Rollout, *, gamma: float, tau: float, entropy_coef: float,
                          value_coef: float) -> A3CLoss:
    """The slow reference: one batch-1 forward per step with gradients, as upstream does. Used by the tests."""
    hx, cx = rollout.state
    values, logits = [], []
    for t in range(rollout.frames.shape[0]):
        v, lg, (hx, cx) = model(rollout.frames[t: t + 1], (hx, cx))
        values.append(v.view(1))
        logits.append(lg)
    return a3c_loss(torch.cat(logits), torch.cat(values), rollout.actions, rollout.rewards, rollout.bootstrap,
                    gamma=gamma, tau=tau, entropy_coef=entropy_coef, value_coef=value_coef)


class GradientHandoff:
    """Hands a worker's fresh local gradients to the shared model, explicitly, on every update.

    The shared parameters' ``.grad`` is per process. Upstream aliased it to the local grad tensor once and
    relied on ``zero_grad`` zeroing that tensor in place; since torch 2.0 ``zero_grad`` sets grads to None, so
    the alias kept the first gradient forever (a3g.md section 7.1). Here each update *assigns* the current
    gradient when it already has the shared parameter's device and memory layout (no copy), and otherwise
    *copies* it into a preallocated buffer with the shared parameter's layout: GPU gradients (pinned host
    buffers), and the channels-last conv gradients of a CPU worker, whose shared weights are contiguous. The
    optimizer always sees this update's gradient, laid out as its parameter (torch's fused Adam misreads a
    gradient whose strides differ from its parameter's; see ``shared_optim.match_grad_layout``).
    """

    def __init__(self, local: torch.nn.Module, shared: torch.nn.Module):
        self.pairs = list(zip(local.parameters(), shared.parameters()))
        pin = torch.cuda.is_available() and any(lp.device.type != "cpu" for lp, _ in self.pairs)
        self.buffers: list[torch.Tensor | None] = [None] * len(self.pairs)
        self._pin = pin

    def _buffer(self, i: int, sp: torch.Tensor) -> torch.Tensor:
        buf = self.buffers[i]
        if buf is None:
            buf = torch.empty_strided(sp.shape, sp.stride(), dtype=sp.dtype, device=sp.device,
                                      pin_memory=self._pin and sp.device.type == "cpu")
            self.buffers[i] = buf
        return buf

    def __call__(self) -> None:
        for i, (lp, sp) in enumerate(self.pairs):
            g = lp.grad
            if g is None:
                sp.grad = None
            elif g.device == sp.device and g.stride() == sp.stride():
                sp.grad = g
            else:
                sp.grad = self._buffer(i, sp).copy_(g)


@torch.no_grad()
def sync_weights(local: torch.nn.Module, shared: torch.nn.Module) -> None:
    """Copy the shared weights into the local model's existing tensors (cheaper than ``load_state_dict``)."""
    for lp, sp in zip(local.parameters(), shared.parameters()):
        lp.copy_(sp)


def sync_between_steps(local: torch.nn.Module, shared: torch.nn.Module, gate, stopped) -> bool:
    """``sync_weights`` between two optimizer steps of GA3C's trainers (``gate``: the run's ``ga3c.gate.StepGate``,
    read as the monitor; waiting until ``stopped()``); at once without a gate (A3G's hogwild workers have no
    moment between steps). True when copied, False when the run stopped first (a server killed inside a step
    leaves no moment after it)."""
    if gate is None:
        sync_weights(local, shared)
        return True
    from ga3c.gate import MONITOR
    return gate.read(lambda: sync_weights(local, shared) or True, MONITOR, alive=lambda: not stopped(),
                     timeout=None) is not None


@torch.no_grad()
def play_game(model: A3Clstm, env: gym.Env, device: torch.device, *, seed: int | None = None,
              should_stop=None, on_frame=None, points: list | None = None,
              trace: list | None = None, cut: list | None = None) -> tuple[float, int, bool]:
    """Play one whole game greedily (argmax of the policy) with an env built with ``episodic_life=False``.

    A lost life restarts the way a learner's episode starts (``EpisodicLife`` and ``FireReset``): one NOOP, then
    FIRE and action 2 where the game has FIRE, and a zeroed LSTM state; upstream's test and evaluation did the
    same. Learners never press FIRE to relaunch the ball themselves, so without this a greedy policy stalls
    Breakout after its first lost life until the time limit. With sticky actions (0.25) a press is lost when every
    raw frame of its agent step repeats the action before it (0.25^k for a step of k frames: about 0.4% at a skip
    of 4, 6.25% at 2), and then it still stalls.

    Returns ``(score, length, finished)``: the unclipped score and agent steps over all lives (the restart steps
    after a lost life included), and False when ``should_stop()`` became true mid-game. The time limit counts
    the reset's FIRE and action 2 as well, so in a game with FIRE a game it cuts has a length 2 under it.
    ``on_frame(env)`` is called after the reset and after every step (recording: the first frame, then one video
    frame per agent step: ``length + 1`` in all). ``points``, when
    given, gets ``(agent step, reward)`` appended for every step with a non-zero reward (the step counted from 1,
    as ``length`` counts it). ``trace``, when given, gets ``(agent step, action, reward, value, probabilities)``
    appended for every step the policy chose (not the restart steps after a lost life): the critic's value and
    the policy's probabilities of the state it acted in. ``cut``, when given, gets one bool appended when the game
    ends: whether it was cut short (truncated: the time limit, or the emulator's frame cap) rather than played out.
    """
    obs, _ = env.reset(seed=seed) if seed is not None else env.reset()
    if on_frame is not None:
        on_frame(env)
    restart = (0, *FIRE_RESET_ACTIONS) if presses_fire(env.unwrapped.get_action_meanings()) else (0,)
    lives = LifeCounter(env)
    hx, cx = model.initial_state(1, device)
    score, length = 0.0, 0

    def step(action: int):
        nonlocal score, length
        obs, reward, terminated, truncated, _ = env.step(action)
        score += float(reward)
        length += 1
        if cut is not None and (terminated or truncated):
            cut.append(bool(truncated and not terminated))
        if points is not None and reward:
            points.append((length, float(reward)))
        if on_frame is not None:
            on_frame(env)
        return obs, terminated or truncated

    while True:
        if should_stop is not None and should_stop():
            return score, length, False
        x = torch.from_numpy(obs).to(device).unsqueeze(0)
        value, logits, (hx, cx) = model(x, (hx, cx))
        action = int(logits.argmax(1))
        before = score
        obs, over = step(action)
        if trace is not None:
            trace.append((length, action, score - before, float(value),
                          F.softmax(logits.float(), dim=1)[0].tolist()))
        if over:
            return score, length, True
        if lives.lost():  # a lost life (``LifeCounter``), and the game goes on
            for action in restart:
                obs, over = step(action)
                if over:
                    return score, length, True
            hx, cx = model.initial_state(1, device)

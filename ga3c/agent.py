"""The GA3C agent: a process that only steps environments, K of them (``envs_per_agent``), through env slots.

An agent never runs the model. For each of its env slots it posts the current observation as a request
(``buffers.EnvSlots.submit``), and when the predictor's answer is there it steps that environment with the
action and posts the next request, carrying the step's clipped reward and how it ended. With several
environments per process the agent steps one while the predictor works on the others' requests, so the agent
process count (and its memory) need not grow with the number of environments.

Episode ends follow the A3C worker (``player_util.Agent``): learner envs are built with ``episodic_life=True``,
so a lost life *terminates* the learner's episode (bootstrap 0, a fresh LSTM state: the next request is flagged
``episode_start``) while the game goes on; a time limit *truncates* it: the agent first posts the last
observation as a ``final`` request (the predictor needs V of it to bootstrap), then the reset observation.
Rewards are clipped to [-1, 1] for learning; the unclipped score and the agent steps of each whole learner game (all
lives; not the games of ``--short-game-slots`` or ``--greedy-slots``) go to the ``EpisodeLog``, and every step is
counted exactly once in ``Ga3cCounters``.

Waiting polls the response counters with a short, growing sleep (``buffers.Backoff``): an idle agent costs
almost nothing, and a dead predictor never blocks it past ``stop``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ga3c.buffers import ACQUIRE, Backoff, EnvSlots, fence
from run_state import AnyOf


@dataclass(frozen=True)
class AtariEnvFactory:
    """Builds a learner's environment for an env slot with ``environment.atari_env`` (``episodic_life=True``).
    Slot s plays ``env_ids[s % len(env_ids)]`` (``--train-envs``), or ``env_id`` when ``env_ids`` is empty; slots
    below ``short_slots`` have the time limit ``short_length`` (``--short-game-slots``), the others
    ``max_episode_length``; with a ``short_switch`` (``--short-games-after-score``) the short slots play to
    ``max_episode_length`` until the switch is set at a game's reset (``environment.SwitchedTimeLimit``). The
    ``greedy_slots`` after them (``--greedy-slots``, whose actions the predictor picks by argmax) play whole games
    that are not counted as learner games either. Picklable, so it can be handed to a spawned agent process."""

    env_id: str
    env_config: str | Path
    max_episode_length: int = 10000
    skip_rate: int = 4
    see_skipped: bool = False  # --see-skipped-frames
    seed: int | None = None  # env slot s is seeded with seed + s
    env_ids: tuple[str, ...] = ()
    short_slots: int = 0
    short_length: int = 150
    greedy_slots: int = 0
    short_switch: object = None  # a run_state.Flag: the short slots' cut starts once it is set

    @classmethod
    def for_args(cls, args, short_switch=None) -> "AtariEnvFactory":
        """The factory a training run's agents use (``Ga3cRun`` builds it from the run's flags, and hands it the
        run's ``short_games`` flag, which counts only with ``--short-games-after-score``)."""
        return cls(args.env, args.env_config, args.max_episode_length, args.skip_rate, seed=args.seed,
                   env_ids=tuple(getattr(args, "train_envs", None) or ()),
                   short_slots=getattr(args, "short_game_slots", 0),
                   short_length=getattr(args, "short_game_length", 150),
                   greedy_slots=getattr(args, "greedy_slots", 0),
                   see_skipped=getattr(args, "see_skipped_frames", False),
                   short_switch=short_switch if getattr(args, "short_games_after_score", None) is not None else None)

    def env_id_of(self, slot: int) -> str:
        return self.env_ids[slot % len(self.env_ids)] if self.env_ids else self.env_id

    def counts_games(self, slot: int) -> bool:
        """Whether slot ``slot``'s games are learner games (not ``--short-game-slots``' cut ones, nor the
        ``--greedy-slots``' argmax ones)."""
        return slot >= self.short_slots + self.greedy_slots

    def max_length_of(self, slot: int) -> int:
        """Slot ``slot``'s time limit from its first game on (a switched short slot's: the whole game's)."""
        short = slot < self.short_slots and self.short_switch is None
        return self.short_length if short else self.max_episode_length

    def __call__(self, slot: int):
        from environment import atari_env, load_env_config  # here: a spawned child imports ALE only if it needs it
        env_id = self.env_id_of(slot)
        switched = slot < self.short_slots and self.short_switch is not None
        env = atari_env(env_id, load_env_config(self.env_config, env_id),
                        max_episode_length=self.max_length_of(slot), skip_rate=self.skip_rate, episodic_life=True,
                        see_skipped=self.see_skipped,
                        short_game=(self.short_length, self.short_switch) if switched else None)
        if self.seed is not None:
            env.action_space.seed(self.seed + slot)
        return env

    def seed_for(self, slot: int) -> int | None:
        return None if self.seed is None else self.seed + slot


def find_normalizer(env):
    """The ``NormalizeFrame`` layer of ``env``'s wrapper stack, or None (a test's fake env has none)."""
    environment = sys.modules.get("environment")  # not imported: no env here can be a NormalizeFrame
    if environment is None:
        return None
    e = env
    while e is not None:
        if isinstance(e, environment.NormalizeFrame):
            return e
        e = getattr(e, "env", None)
    return None


class EnvRunner:
    """One env slot: its environment and the request it has in flight (see the module docstring)."""

    def __init__(self, slot: int, env, buffers: EnvSlots, seed: int | None = None, counts_games: bool = True):
        self.slot = slot
        self.counts_games = counts_games  # False: a --short-game-slots or --greedy-slots slot: not learner games
        self.env = env
        self.buffers = buffers
        self.seed = seed
        self.seq = 0
        self.awaiting_final = False
        self.score = 0.0
        self.length = 0
        self.cut = False
        self.norm = find_normalizer(env)
        if self.norm is not None:
            mean, std, count = buffers.norm_stats[slot].tolist()
            if count > 0:  # a resumed run: continue from the saved statistics
                self.norm.set_stats(mean, std, int(count))

    def _reset(self):
        """Reset the environment; returns its first observation. ``self.cut`` says whether a step taken inside
        the reset ended the running game (``info["game_cut"]``, see ``EpisodicLife``): no ``step`` reported it."""
        if self.seed is not None:
            obs, info = self.env.reset(seed=self.seed)
            self.seed = None
        else:
            obs, info = self.env.reset()
        self.cut = bool(info.get("game_cut", False))
        return obs

    def begin(self, timeout: float = 1.0) -> None:
        """Reset the environment and post its first observation. A slot taken over from a dead or retired agent
        continues its sequence numbers; ``episode_start`` makes the predictor drop that agent's unfinished
        segment. While that agent's last request is still unanswered the predictor may be copying it, so the slot
        is written only once the answer is there (the protocol's rule), or after ``timeout`` seconds, when no
        predictor is answering."""
        obs = self._reset()
        deadline = time.monotonic() + timeout
        backoff = Backoff()
        while self.buffers.req_seq[self.slot] != self.buffers.resp_seq[self.slot] and time.monotonic() < deadline:
            backoff.wait()
        fence(ACQUIRE)  # the slot is written after the answer was seen (the predictor's copy of it is done)
        self.seq = self.buffers.submit(self.slot, obs, episode_start=True)

    def answered(self) -> bool:
        """Whether the answer to this slot's last request is there; once it is, an acquire fence orders what the
        agent does next (reading the action, or writing the slot again) after the predictor's writes and reads."""
        if int(self.buffers.resp_seq[self.slot]) != self.seq:
            return False
        fence(ACQUIRE)
        return True

    def on_response(self) -> tuple[int, tuple[float, int] | None]:
        """Act on the answer and post the next request. Returns ``(agent steps taken (0 or 1), the finished game's
        (score, length) or None)``."""
        if self.awaiting_final:  # the answer to a ``final`` request: no action to take, start the next episode
            self.awaiting_final = False
            self.seq = self.buffers.submit(self.slot, self._reset(), episode_start=True)
            return 0, None
        action = int(self.buffers.action[self.slot])
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.score += float(reward)
        self.length += 1
        clipped = max(-1.0, min(1.0, float(reward)))
        finished = None
        if info.get("game_over", terminated or truncated):
            finished = self._finish_game()
        if terminated:
            obs = self._reset()
            if self.cut and finished is None and self.length > 0:  # a time limit ended the game inside the reset
                finished = self._finish_game()
            self.seq = self.buffers.submit(self.slot, obs, reward=clipped, terminated=True, episode_start=True)
        elif truncated:
            self.seq = self.buffers.submit(self.slot, obs, reward=clipped, truncated=True, final=True)
            self.awaiting_final = True
        else:
            self.seq = self.buffers.submit(self.slot, obs, reward=clipped)
        return 1, finished

    def _finish_game(self) -> tuple[float, int]:
        """The game that just ended: returns its (score, length), starts the next one's count and saves the
        normalisation statistics."""
        finished = (self.score, self.length)
        self.score, self.length = 0.0, 0
        self.save_norm_stats()
        return finished

    def save_norm_stats(self) -> None:
        if self.norm is not None:
            self.buffers.norm_stats[self.slot] = torch.tensor(self.norm.get_stats(), dtype=torch.float64)


class AgentStepper:
    """The K env runners of one agent process; ``poll()`` acts on every answered slot once."""

    def __init__(self, agent_id: int, runners: list[EnvRunner], buffers: EnvSlots, counters=None, episodes=None):
        self.agent_id = agent_id
        self.runners = runners
        self.buffers = buffers
        self.counters = counters
        self.episodes = episodes
        self._slots_np = np.array([r.slot for r in runners], dtype=np.int64)
        self.steps = 0
        self.games = 0

    def begin(self) -> None:
        for r in self.runners:
            r.begin()

    def poll(self) -> int:
        """Handle every slot whose answer has arrived; returns how many were handled.

        The check reads the response counters through a NumPy view of the shared tensor (a few microseconds;
        torch's per-call overhead would make an idle agent's polling cost several percent of a core)."""
        resp = self.buffers.resp_seq.numpy()[self._slots_np]
        expected = np.fromiter((r.seq for r in self.runners), dtype=np.int64, count=len(self.runners))
        ready = np.flatnonzero(resp == expected).tolist()
        if ready:
            fence(ACQUIRE)  # what follows (the action read, the slot written again) after the answers seen
        steps = 0
        for i in ready:
            n, finished = self.runners[i].on_response()
            steps += n
            if finished is not None and self.runners[i].counts_games:
                self.games += 1
                if self.episodes is not None:
                    self.episodes.record(self.agent_id, *finished, slot=self.runners[i].slot)
        if steps:
            self.steps += steps
            if self.counters is not None:
                self.counters.add_steps(self.agent_id, steps)
        return len(ready)

    def close(self) -> None:
        for r in self.runners:
            r.save_norm_stats()
            r.env.close()


def make_runners(slots, buffers: EnvSlots, make_env, seed: int | None = None) -> list[EnvRunner]:
    """The env runners of an agent's ``slots``: slot s plays ``make_env(s)``, its first reset seeded with
    ``seed + s``; its games count as learner games unless ``make_env.counts_games(s)`` says otherwise (an
    ``AtariEnvFactory`` with ``--short-game-slots``)."""
    counts = getattr(make_env, "counts_games", lambda slot: True)
    return [EnvRunner(s, make_env(s), buffers, None if seed is None else seed + s, counts_games=counts(s))
            for s in slots]


def run_agent(agent_id: int, slots, buffers: EnvSlots, make_env, stop, *, counters=None, episodes=None,
              seed: int | None = None, max_steps: int | None = None, on_ready=None) -> int:
    """The agent loop: step the environments ``make_env(slot)`` of ``slots`` until ``stop.is_set()`` (or
    ``max_steps`` agent steps). Slot s's first reset is seeded with ``seed + s``. Returns the steps taken.
    ``on_ready()`` is called once the environments are built."""
    stepper = AgentStepper(agent_id, make_runners(slots, buffers, make_env, seed), buffers, counters, episodes)
    if on_ready is not None:
        on_ready()
    try:
        stepper.begin()
        backoff = Backoff()
        while not stop.is_set() and (max_steps is None or stepper.steps < max_steps):
            if stepper.poll():
                backoff.reset()
            else:
                backoff.wait()
    finally:
        stepper.close()
    return stepper.steps


def agent_process(agent_id: int, slots, buffers: EnvSlots, make_env, stop, counters=None, episodes=None,
                  seed: int | None = None, errors=None, error_slot: int | None = None, retire=None,
                  ready: torch.Tensor | None = None) -> None:
    """Process entry point of agent ``agent_id``: set the process up (``utils.setup_child_process``), run the
    loop until ``stop`` or its own ``retire`` flag (``--dynamic``) is set, and report a failure to ``errors`` (an
    ``ErrorBoard``) before exiting non-zero. ``ready[error_slot]`` is set once its environments are built."""
    from utils import describe_failure, end_child_process, setup_child_process
    setup_child_process(f"ga3c agent {agent_id}")
    slot = agent_id if error_slot is None else error_slot
    try:
        run_agent(agent_id, slots, buffers, make_env, stop if retire is None else AnyOf(stop, retire),
                  counters=counters, episodes=episodes, seed=seed,
                  on_ready=None if ready is None else (lambda: ready.__setitem__(slot, 1)))
    except BaseException as e:
        if errors is not None and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            errors.report(slot, f"ga3c agent {agent_id}", describe_failure(e))
        end_child_process(1)
    end_child_process(0)

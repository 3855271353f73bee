"""Atari environments on gymnasium 1.x + ale-py, preprocessed as the A3G line of work expects.

The stack, innermost first (see docs/design.md, "The environment"):

1. ``gymnasium.make(id)``; for ``XNoFrameskip`` ids ``NoopReset`` (1..30 raw NOOPs at a real reset) and
   ``MaxAndSkip`` (repeat the action ``skip_rate`` times, sum the rewards, max over the last 3 raw frames);
   other ids skip frames in the emulator, or, with ``see_skipped`` (``--see-skipped-frames``), are stepped one raw
   frame at a time and wrapped in ``MaxAndSkip`` with the id's own skip (fixed, or drawn from the env's RNG for a
   range such as ``X-v0``'s 2-4): the same game, with the last raw frames maxed as for ``NoFrameskip`` ids.
2. A time limit of ``max_episode_length`` agent steps (``truncated``); with ``short_game=(length, switch)`` a
   ``SwitchedTimeLimit``: ``length`` from the first real reset at which ``switch.is_set()``.
3. ``EpisodicLife`` for learners: a lost life ends the learner's episode (``terminated``) but not the game.
4. ``FireReset`` when the game's action 1 is FIRE (``presses_fire``).
5. ``ProcessFrame``: crop, resize to 80x80, grayscale -> float32 (1, 80, 80) in 0..255.
6. ``NormalizeFrame``: running scalar mean/std normalisation, per process.

``terminated`` and ``truncated`` stay distinct at every layer: the learner bootstraps on truncation only.
"""
from __future__ import annotations

import difflib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import gymnasium as gym
import numpy as np

import ale_py

gym.register_envs(ale_py)
ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # no banner per environment

FRAME_SHAPE = (1, 80, 80)
NOOP_MAX = 30
FIRE_RESET_ACTIONS = (1, 2)  # FIRE, then action 2, after a reset in games whose action 1 is FIRE (see ``FireReset``)
SCREEN_ROWS = 210  # every ALE game's screen is 210 x 160
MAX_OVER_FRAMES = 3  # upstream A3G maxes over the last 3 raw frames (baselines uses 2); kept for model compatibility
# gymnasium's notice for old-version ids ("The environment Pong-v0 is out of date ..."); the v0/v4 ids are accepted on
# purpose (upstream's protocols), so the notice is not printed once per environment and process
_OUT_OF_DATE = r".*The environment \S+ is out of date"

_ID_RE = re.compile(r"^(?P<ale>ALE/)?(?P<game>[A-Za-z0-9]+?)(?P<variant>NoFrameskip|Deterministic)?-v(?P<version>\d+)\Z")


class EnvIdError(ValueError):
    """An environment id that ale-py cannot make; the message suggests close ids."""


@dataclass(frozen=True)
class EnvSpec:
    """How an accepted env id is built.

    ``make_id`` is passed to ``gymnasium.make`` together with ``make_kwargs``; ``frameskip_by_us`` says whether
    ``MaxAndSkip`` and ``NoopReset`` wrap it (``NoFrameskip`` ids) or the emulator skips frames itself.
    """

    env_id: str
    game: str
    make_id: str
    make_kwargs: dict
    frameskip_by_us: bool
    frameskip: Any
    repeat_action_probability: float


def _atari_ids() -> list[str]:
    ids = [k for k, s in gym.registry.items() if str(getattr(s, "entry_point", "")).startswith("ale_py")]
    # Deterministic ids are no longer registered; we build them (frameskip 4, SpaceInvaders 3) and accept them.
    games = sorted({m.group("game") for k in ids if (m := _ID_RE.match(k)) and m.group("ale")})
    ids += [f"{g}Deterministic-v4" for g in games] + [f"{g}Deterministic-v0" for g in games]
    return sorted(ids)


def deterministic_frameskip(game: str) -> int:
    """The fixed frame skip of ``<game>Deterministic-v0``/``-v4`` as gym registered them: 3 for SpaceInvaders
    (gym's reason: at 4 its laser beams disappear from the frames the agent sees), 4 for every other game."""
    return 3 if game == "SpaceInvaders" else 4


def resolve_env_id(env_id: str) -> EnvSpec:
    """Map an accepted id (``XNoFrameskip-v4``, ``XNoFrameskip-v0``, ``ALE/X-v5``, ``X-v4``, ``X-v0``,
    ``XDeterministic-v4``/``-v0``) to how it is made; raise ``EnvIdError`` naming close ids otherwise."""
    if env_id in gym.registry and str(getattr(gym.registry[env_id], "entry_point", "")).startswith("ale_py"):
        spec = gym.registry[env_id]
        kw = dict(spec.kwargs)
        fs = kw.get("frameskip", 4)
        m = _ID_RE.match(env_id)
        game = m.group("game") if m else kw.get("game", env_id)
        return EnvSpec(env_id, game, env_id, {}, fs == 1, fs, float(kw.get("repeat_action_probability", 0.0)))
    m = _ID_RE.match(env_id)
    if m and m.group("variant") == "Deterministic" and not m.group("ale") and m.group("version") in ("0", "4"):
        base = f"ALE/{m.group('game')}-v5"
        if base in gym.registry:
            rap = 0.25 if m.group("version") == "0" else 0.0
            skip = deterministic_frameskip(m.group("game"))
            kw = {"frameskip": skip, "repeat_action_probability": rap, "full_action_space": False,
                  "max_num_frames_per_episode": 108000}
            return EnvSpec(env_id, m.group("game"), base, kw, False, skip, rap)
    close = difflib.get_close_matches(env_id, _atari_ids(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; Atari ids look like PongNoFrameskip-v4 or ALE/Pong-v5"
    raise EnvIdError(f"unknown environment id {env_id!r}{hint}")  # repr: an id with a newline stays one line


def load_env_config(path: str | Path, env_id: str) -> dict:
    """Per-game crop rows from ``config.json``: the last key that is a substring of ``env_id`` wins, else Default.

    Raises ``ValueError`` (one line, without the path: the caller names it) for a table that is not a JSON object of objects, or where ``env_id``'s entry
    lacks integer ``crop1`` and ``crop2`` that keep some rows: ``[crop1, crop2 + 160)``, cut at the screen's 210
    (upstream's table ends VideoPinball's at 220)."""
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict):
        raise ValueError('it is not a JSON object of games (like {"Pong": {"crop1": 34, "crop2": 34}})')
    for key, value in table.items():
        if not isinstance(value, dict):
            raise ValueError(f"the entry for '{key}' is not an object with crop1 and crop2")
    conf = dict(table.get("Default", {"crop1": 34, "crop2": 34}))
    for key, value in table.items():
        if key != "Default" and key in env_id:
            conf = dict(value)
    for k in ("crop1", "crop2"):
        if not isinstance(conf.get(k), int) or isinstance(conf.get(k), bool):
            raise ValueError(f"the entry for {env_id} needs integer '{k}'")
    crop1, crop2 = conf["crop1"], conf["crop2"]
    if not 0 <= crop1 < min(crop2 + 160, SCREEN_ROWS):
        raise ValueError(f"the entry for {env_id} keeps no rows of the {SCREEN_ROWS}-row screen (rows "
                         f"[crop1, crop2 + 160) = [{crop1}, {crop2 + 160})): crop1 must be >= 0 and below both "
                         f"{SCREEN_ROWS} and crop2 + 160")
    return conf


def _reset_kwargs_without_seed(kwargs: dict) -> dict:
    """Internal re-resets must not reseed (that would replay the same start forever)."""
    return {k: v for k, v in kwargs.items() if k != "seed"}


class NoopReset(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """At a real reset take 1..noop_max NOOPs (drawn from the env's RNG); reset again if the game ends meanwhile."""

    def __init__(self, env: gym.Env, noop_max: int = NOOP_MAX):
        gym.utils.RecordConstructorArgs.__init__(self, noop_max=noop_max)
        gym.Wrapper.__init__(self, env)
        self.noop_max = noop_max
        assert env.unwrapped.get_action_meanings()[0] == "NOOP"

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        noops = int(self.env.unwrapped.np_random.integers(1, self.noop_max + 1))
        for _ in range(noops):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset(**_reset_kwargs_without_seed(kwargs))
        return obs, info


class MaxAndSkip(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Repeat the action ``skip`` raw frames, sum the rewards, stop early at an episode end, and return the
    element-wise max over the last ``MAX_OVER_FRAMES`` raw frames (removes Atari sprite flicker, shows motion).

    ``skip`` is an int, or a ``(low, high)`` range from which each step draws ``low <= k < high`` with the
    wrapped env's ``np_random``, as ale-py's ``AtariEnv`` draws a stochastic frameskip.

    With ``finish_skip`` a step that ends the episode early still sends the action for the rest of its ``k``
    frames, as ale-py's own frameskip does: the emulator plays no more of the ended game, but each frame still
    draws from ALE's sticky-action generator, which an unseeded reset does not reseed, so the next game is the
    one the emulator's skip would have played. The observation stays the max up to the end frame."""

    def __init__(self, env: gym.Env, skip: int | tuple[int, int] = 4, finish_skip: bool = False):
        gym.utils.RecordConstructorArgs.__init__(self, skip=skip, finish_skip=finish_skip)
        gym.Wrapper.__init__(self, env)
        self.skip = tuple(skip) if isinstance(skip, (tuple, list)) else int(skip)
        self.finish_skip = bool(finish_skip)
        self._buf = np.zeros((MAX_OVER_FRAMES,) + env.observation_space.shape, dtype=env.observation_space.dtype)

    def step(self, action):
        skip = self.skip if isinstance(self.skip, int) else int(self.env.unwrapped.np_random.integers(*self.skip))
        total = 0.0
        terminated = truncated = False
        n = 0
        info: dict = {}
        for i in range(skip):
            obs, reward, terminated, truncated, info = self.env.step(action)
            self._buf[n % MAX_OVER_FRAMES] = obs
            n += 1
            total += float(reward)
            if terminated or truncated:
                if self.finish_skip:
                    for _ in range(i + 1, skip):  # the step's remaining frames: no more game, the draws go on
                        _, reward, after_terminated, after_truncated, info = self.env.step(action)
                        total += float(reward)
                        terminated, truncated = terminated or after_terminated, truncated or after_truncated
                break
        frames = self._buf[: min(n, MAX_OVER_FRAMES)]
        return frames.max(axis=0), total, terminated, truncated, info


# Games whose lives counter goes down once at the start of every game, before play, with no life lost: the
# counter's drop at or before this emulator frame of a game is not a lost life. Galaxian counts the ship about to
# come on screen as a reserve ship until frame 64 of every game (4 -> 3 there, whatever the actions).
LIVES_SETTLE_FRAMES = {"Galaxian": 70}


def game_name(env: gym.Env) -> str:
    """The game of an ALE env as the ids spell it (``Pong``, ``Galaxian``), from its registered id (``resolve_env_id``);
    "" for an env without one."""
    spec = env.unwrapped.spec
    try:
        return resolve_env_id(spec.id).game if spec is not None else ""
    except EnvIdError:
        return ""


class LifeCounter:
    """The lives counter of an ALE game, and whether it says a life was lost since the last look.

    A life is lost when the counter goes down, to 0 as well: some games play their last life with the counter at
    0 (it shows the reserve: DonkeyKong, BankHeist, Turmoil), so a 1 -> 0 drop in a game that goes on is a lost
    life too. Not lost: a drop at or before ``LIVES_SETTLE_FRAMES`` of the game's emulator frames (Galaxian's
    counter settles at frame 64), and a counter that goes up (a bonus life). Games without lives read 0 always.
    """

    def __init__(self, env: gym.Env):
        self.ale = env.unwrapped.ale
        self.settle = LIVES_SETTLE_FRAMES.get(game_name(env), 0)
        self.lives = self.ale.lives()

    def reset(self) -> None:
        """Read the counter afresh (after a reset, or a restart step), without counting a loss."""
        self.lives = self.ale.lives()

    def lost(self) -> bool:
        """Whether the counter went down since the last look (``reset`` or ``lost``), as a lost life."""
        now = self.ale.lives()
        lost = now < self.lives and (not self.settle or self.ale.getEpisodeFrameNumber() > self.settle)
        self.lives = now
        return lost


class EpisodicLife(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """A lost life ends the learner's episode (``terminated=True``) but not the game.

    The ``reset`` that follows a lost life takes one NOOP step instead of a real reset; any other reset (after
    game over, mid-episode, or with a seed) is a real one. A life lost on the step that a time limit truncates
    is still a termination (``terminated`` and ``truncated`` both true: the learner bootstraps 0 from it), and
    the reset after it is a real one, since the game was cut. ``info["game_over"]`` tells whether the game itself
    ended (used to count games). When the NOOP step of a reset ends the game (a time limit), the reset is a real
    one and its ``info["game_cut"]`` is True: no ``step`` reported that game's end.
    """

    def __init__(self, env: gym.Env):
        gym.utils.RecordConstructorArgs.__init__(self)
        gym.Wrapper.__init__(self, env)
        self.counter = LifeCounter(env)
        self.life_lost = False

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        game_over = bool(terminated or truncated)
        lost = self.counter.lost() and not terminated  # (``LifeCounter``)
        self.life_lost = lost and not truncated
        if lost:
            terminated = True
        info["game_over"] = game_over
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        if self.life_lost and kwargs.get("seed") is None:
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset(**_reset_kwargs_without_seed(kwargs))
                info["game_cut"] = True
        else:
            obs, info = self.env.reset(**kwargs)
        self.life_lost = False
        self.counter.reset()
        return obs, info


def presses_fire(action_meanings: list[str]) -> bool:
    """Whether a reset presses FIRE (action 1) then action 2: where action 1 is FIRE and there are three actions or
    more (the games that wait for FIRE to start). A game whose FIRE is another index (``ALE/Backgammon-v5``,
    ``ALE/VideoCheckers-v5``: FIRE is action 0) gets no presses: actions 1 and 2 move there."""
    return len(action_meanings) >= 3 and action_meanings[1] == "FIRE"


class FireReset(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Press FIRE (action 1) then action 2 after a reset, for games that wait for FIRE to start.

    When one of these steps ends a game (a time limit after a lost life, under ``EpisodicLife``), the game is
    reset for real and the reset's ``info["game_cut"]`` is True, as ``EpisodicLife``'s own NOOP step sets it.
    """

    def __init__(self, env: gym.Env):
        gym.utils.RecordConstructorArgs.__init__(self)
        gym.Wrapper.__init__(self, env)

    def reset(self, **kwargs):
        _, first = self.env.reset(**kwargs)
        cut = bool(first.get("game_cut", False))
        for action in FIRE_RESET_ACTIONS:
            obs, _, terminated, truncated, info = self.env.step(action)
            if info.get("game_over", terminated or truncated):
                cut = True
            if terminated or truncated:
                obs, info = self.env.reset(**_reset_kwargs_without_seed(kwargs))
                cut = cut or bool(info.get("game_cut", False))
        if cut:
            info["game_cut"] = True
        return obs, info


def process_frame(frame: np.ndarray, crop1: int, crop2: int) -> np.ndarray:
    """210x160 RGB uint8 -> (1, 80, 80) float32 gray in 0..255.

    Crop rows ``[crop1, crop2 + 160)``, resize with INTER_AREA to 80x80 (on uint8, cheaper than on floats),
    then luminance 0.2989 R + 0.587 G + 0.114 B.
    """
    cropped = frame[crop1: crop2 + 160, :160]
    small = cv2.resize(cropped, (80, 80), interpolation=cv2.INTER_AREA)
    gray = small.astype(np.float32) @ np.array([0.2989, 0.587, 0.114], dtype=np.float32)
    return gray.reshape(FRAME_SHAPE)


class ProcessFrame(gym.ObservationWrapper, gym.utils.RecordConstructorArgs):
    """Crop, resize and gray every frame (see ``process_frame``)."""

    def __init__(self, env: gym.Env, crop1: int, crop2: int):
        gym.utils.RecordConstructorArgs.__init__(self, crop1=crop1, crop2=crop2)
        gym.ObservationWrapper.__init__(self, env)
        self.crop1, self.crop2 = crop1, crop2
        self.observation_space = gym.spaces.Box(0.0, 255.0, FRAME_SHAPE, dtype=np.float32)

    def observation(self, observation):
        return process_frame(observation, self.crop1, self.crop2)


class NormalizeFrame(gym.ObservationWrapper, gym.utils.RecordConstructorArgs):
    """Running scalar normalisation with bias correction: ``(x - mean) / (std + 1e-8)``.

    mean and std are exponential averages (``alpha``) of each frame's mean and std, divided by
    ``1 - alpha**n``. The statistics can be saved (``get_stats``) and restored (``set_stats``); a reset with a
    seed restarts from the statistics last set, so seeded resets are reproducible.
    """

    def __init__(self, env: gym.Env, alpha: float = 0.9999):
        gym.utils.RecordConstructorArgs.__init__(self, alpha=alpha)
        gym.ObservationWrapper.__init__(self, env)
        self.alpha = alpha
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, FRAME_SHAPE, dtype=np.float32)
        self._initial = (0.0, 0.0, 0)
        self.state_mean, self.state_std, self.num_steps = self._initial

    def get_stats(self) -> tuple[float, float, int]:
        return float(self.state_mean), float(self.state_std), int(self.num_steps)

    def set_stats(self, mean: float, std: float, num_steps: int) -> None:
        self._initial = (float(mean), float(std), int(num_steps))
        self.state_mean, self.state_std, self.num_steps = self._initial

    def reset(self, **kwargs):
        if kwargs.get("seed") is not None:
            self.state_mean, self.state_std, self.num_steps = self._initial
        return super().reset(**kwargs)

    def observation(self, observation):
        a = self.alpha
        self.state_mean = self.state_mean * a + float(observation.mean()) * (1 - a)
        self.state_std = self.state_std * a + float(observation.std()) * (1 - a)
        self.num_steps += 1
        correction = 1 - a ** self.num_steps
        mean = self.state_mean / correction
        std = self.state_std / correction
        return ((observation - np.float32(mean)) / np.float32(std + 1e-8)).astype(np.float32, copy=False)


class SwitchedTimeLimit(gym.wrappers.TimeLimit):
    """A time limit of ``max_episode_steps`` agent steps until ``switch.is_set()`` (any object with ``is_set()``,
    such as ``run_state.Flag``) at a real reset, then ``short_steps`` from that game on. The limit is chosen at
    each real reset only: a game under way when the switch is set keeps its limit, and ``EpisodicLife``'s reset
    after a lost life (a NOOP step, not a reset) changes nothing."""

    def __init__(self, env: gym.Env, max_episode_steps: int, short_steps: int, switch):
        super().__init__(env, max_episode_steps=max_episode_steps)
        self.full_steps = max_episode_steps
        self.short_steps = short_steps
        self.switch = switch

    def reset(self, **kwargs):
        self._max_episode_steps = self.short_steps if self.switch.is_set() else self.full_steps
        return super().reset(**kwargs)


def atari_env(env_id: str, env_conf: dict, *, max_episode_length: int = 10000, skip_rate: int = 4,
              episodic_life: bool = True, render_mode: str | None = None, see_skipped: bool = False,
              short_game: tuple[int, Any] | None = None) -> gym.Env:
    """Build the full preprocessed stack for ``env_id`` (see module docstring).

    ``episodic_life`` is on for learners and off for the monitor and evaluation, which play whole games.
    ``see_skipped`` steps an id whose emulator skips frames one raw frame at a time under ``MaxAndSkip`` with the
    id's own skip; it changes nothing for ``NoFrameskip`` ids. ``short_game=(length, switch)`` makes the time
    limit a ``SwitchedTimeLimit``: ``max_episode_length`` until ``switch`` is set at a real reset, then ``length``.
    """
    spec = resolve_env_id(env_id)
    kwargs = dict(spec.make_kwargs)
    if see_skipped and not spec.frameskip_by_us:
        kwargs["frameskip"] = 1
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    env = _gym_make(spec.make_id, kwargs)
    if spec.frameskip_by_us:
        env = NoopReset(env, NOOP_MAX)
        env = MaxAndSkip(env, skip_rate)
    elif see_skipped:
        env = MaxAndSkip(env, spec.frameskip, finish_skip=True)
    # agent steps (the reset's NOOPs do not count; FIRE presses and the NOOP after a lost life do)
    if short_game is None:
        env = gym.wrappers.TimeLimit(env, max_episode_steps=max_episode_length)
    else:
        env = SwitchedTimeLimit(env, max_episode_length, *short_game)
    if episodic_life:
        env = EpisodicLife(env)
    if presses_fire(env.unwrapped.get_action_meanings()):
        env = FireReset(env)
    env = ProcessFrame(env, env_conf["crop1"], env_conf["crop2"])
    env = NormalizeFrame(env)
    return env


def _gym_make(make_id: str, kwargs: dict[str, Any]) -> gym.Env:
    """``gymnasium.make(make_id, **kwargs)`` without gymnasium's out-of-date notice for v0/v4 ids; any other
    warning passes through."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_OUT_OF_DATE, category=DeprecationWarning)
        return gym.make(make_id, **kwargs)


def num_actions(env_id: str) -> int:
    """The size of the minimal action set of ``env_id`` (makes the bare emulator once, no preprocessing)."""
    spec = resolve_env_id(env_id)
    env = _gym_make(spec.make_id, spec.make_kwargs)
    try:
        return int(env.action_space.n)
    finally:
        env.close()


def max_over_frames(env_id: str, *, skip_rate: int, see_skipped: bool = False) -> int:
    """How many raw frames an observation is the max of: ``min(skip, MAX_OVER_FRAMES)`` where ``MaxAndSkip``
    skips (the largest skip of a range), 1 where the emulator does."""
    spec = resolve_env_id(env_id)
    if spec.frameskip_by_us:
        return min(skip_rate, MAX_OVER_FRAMES)
    if not see_skipped:
        return 1
    skip = spec.frameskip[1] - 1 if isinstance(spec.frameskip, (tuple, list)) else spec.frameskip
    return min(int(skip), MAX_OVER_FRAMES)


def protocol(env_id: str, *, max_episode_length: int, skip_rate: int, episodic_life: bool,
             see_skipped: bool = False) -> dict:
    """The evaluation protocol in words and numbers, so a score can be compared with papers."""
    spec = resolve_env_id(env_id)
    return {
        "env_id": env_id,
        "frameskip": skip_rate if spec.frameskip_by_us else spec.frameskip,
        "max_over_frames": max_over_frames(env_id, skip_rate=skip_rate, see_skipped=see_skipped),
        "repeat_action_probability": spec.repeat_action_probability,
        "noop_starts": NOOP_MAX if spec.frameskip_by_us else 0,
        "episodic_life": episodic_life,
        "after_a_lost_life": "the learner's episode start: NOOP, FIRE and action 2 where the game has FIRE, "
                             "a fresh LSTM state",
        "time_limit_agent_steps": max_episode_length,
        "full_action_space": False,
    }


def normalizer(env: gym.Env) -> NormalizeFrame:
    """The ``NormalizeFrame`` layer of a stack built by ``atari_env``."""
    e = env
    while not isinstance(e, NormalizeFrame):
        e = e.env
    return e

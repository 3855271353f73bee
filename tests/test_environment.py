"""The environment stack: wrappers on a fake Atari first, then on real ALE (ROMs ship with ale-py)."""
import json
import re
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import environment
from environment import (MAX_OVER_FRAMES, EnvIdError, EpisodicLife, FireReset, MaxAndSkip, NoopReset, atari_env,
                         load_env_config, normalizer, num_actions, process_frame, protocol, resolve_env_id)


class FakeALE:
    def __init__(self):
        self.lives_left = 3

    def lives(self):
        return self.lives_left


class FakeAtari(gym.Env):
    """Frames are filled with the step index; a life is lost at every ``life_every`` steps; game over at 0 lives."""

    observation_space = gym.spaces.Box(0, 255, (210, 160, 3), np.uint8)
    action_space = gym.spaces.Discrete(4)

    def __init__(self, life_every=5, lives=3):
        self.ale = FakeALE()
        self.life_every, self.start_lives = life_every, lives
        self.t = 0
        self.resets = 0
        self.actions = []

    def get_action_meanings(self):
        return ["NOOP", "FIRE", "RIGHT", "LEFT"]

    def _frame(self):
        return np.full((210, 160, 3), self.t % 256, np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.resets += 1
        self.ale.lives_left = self.start_lives
        return self._frame(), {}

    def step(self, action):
        self.actions.append(action)
        self.t += 1
        if self.t % self.life_every == 0:
            self.ale.lives_left -= 1
        return self._frame(), 1.0, self.ale.lives_left == 0, False, {}


class ScriptedFrames(gym.Env):
    """Returns the given raw frames and rewards one per step; ``terminated`` on the step given."""

    observation_space = gym.spaces.Box(0, 255, (3,), np.uint8)
    action_space = gym.spaces.Discrete(4)

    def __init__(self, frames, rewards, terminate_at=None):
        self.frames, self.rewards, self.terminate_at = frames, rewards, terminate_at
        self.t = 0
        self.actions = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.uint8), {}

    def step(self, action):
        self.actions.append(action)
        obs, reward = np.array(self.frames[self.t], np.uint8), self.rewards[self.t]
        self.t += 1
        return obs, reward, self.t == self.terminate_at, False, {}


def test_max_and_skip_maxes_each_pixel_over_the_last_3_raw_frames_only():
    assert MAX_OVER_FRAMES == 3  # upstream A3G's choice, as the docstring and protocol() say (baselines uses 2)
    frames = [[200, 0, 0],  # raw frame 1: outside the last 3, its 200 must not show
              [10, 90, 0],  # frame 2: the earliest of the last 3 holds pixel 1's maximum (not in the last 2)
              [20, 30, 60],  # frame 3: the frame with the largest sum, but not every pixel's maximum
              [5, 40, 50],  # frame 4, the last: the maximum of no pixel
              [1, 2, 3], [4, 1, 0]]  # the next agent step: the game ends on its 2nd raw frame
    env = MaxAndSkip(ScriptedFrames(frames, [1.0, 0.0, 2.0, 0.0, 5.0, -1.0], terminate_at=6), skip=4)
    env.reset()
    obs, reward, terminated, truncated, _ = env.step(2)
    assert obs.tolist() == [20, 90, 60] and obs.dtype == np.uint8  # element-wise max of raw frames 2, 3, 4
    assert reward == 3.0 and not terminated and not truncated
    obs, reward, terminated, _, _ = env.step(3)
    assert terminated and reward == 4.0
    assert obs.tolist() == [4, 2, 3]  # the max of this step's 2 raw frames only: nothing left from the last step
    assert env.env.actions == [2, 2, 2, 2, 3, 3]  # each action repeated; the second cut short by the game's end


def test_max_and_skip_stops_early_at_game_end():
    env = MaxAndSkip(FakeAtari(life_every=1, lives=2), skip=4)
    env.reset()
    _, reward, terminated, _, _ = env.step(0)
    assert terminated and reward == 2.0


def test_noop_reset_takes_between_1_and_30_noops():
    counts = set()
    for seed in range(20):
        inner = FakeAtari(life_every=1000)
        env = NoopReset(inner)
        env.reset(seed=seed)
        assert all(a == 0 for a in inner.actions)
        counts.add(len(inner.actions))
    assert min(counts) >= 1 and max(counts) <= 30 and len(counts) > 3


class Draw:
    """A stand-in for the env's ``np_random`` that always draws ``n`` and records the bounds it was asked for."""

    def __init__(self, n):
        self.n, self.bounds = n, []

    def integers(self, low, high):
        self.bounds.append((low, high))
        return self.n


class ShortGame(gym.Env):
    """A game over after ``length`` steps; stepping a finished game is an error (a real emulator would silently
    go on from a dead game). The frame holds (games started, steps into this game)."""

    observation_space = gym.spaces.Box(0, 255, (2,), np.uint8)
    action_space = gym.spaces.Discrete(4)

    def __init__(self, length, noops):
        self.length = length
        self.np_random = Draw(noops)
        self.games, self.t, self.over = 0, 0, True
        self.reset_seeds, self.actions = [], []

    def get_action_meanings(self):
        return ["NOOP", "FIRE", "RIGHT", "LEFT"]

    def _frame(self):
        return np.array([self.games, self.t], np.uint8)

    def reset(self, *, seed=None, options=None):
        self.reset_seeds.append(seed)  # no super().reset: it would replace the fixed draw
        self.games, self.t, self.over = self.games + 1, 0, False
        return self._frame(), {}

    def step(self, action):
        assert not self.over, "stepped a finished game"
        self.actions.append(action)
        self.t += 1
        self.over = self.t == self.length
        return self._frame(), 0.0, self.over, False, {}


def test_noop_reset_resets_again_without_the_seed_when_the_game_ends_during_the_noops():
    inner = ShortGame(length=5, noops=7)
    obs, _ = NoopReset(inner).reset(seed=3)
    assert inner.np_random.bounds == [(1, 31)]  # 1..30 NOOPs
    assert inner.actions == [0] * 7
    # NOOPs 1-5 end the first game; the wrapper resets (without reseeding) and NOOPs 6-7 are the new game's
    assert inner.reset_seeds == [3, None] and not inner.over
    assert obs.tolist() == [2, 2]  # the new game's frame after its 2 NOOPs, not the finished game's last frame
    inner.step(2)  # the game handed over is alive
    quiet = ShortGame(length=5, noops=4)
    obs, _ = NoopReset(quiet).reset(seed=3)
    assert quiet.reset_seeds == [3] and obs.tolist() == [1, 4]  # no game end, no second reset


def test_episodic_life_semantics():
    inner = FakeAtari(life_every=3, lives=2)
    env = EpisodicLife(inner)
    env.reset()
    steps = [env.step(0) for _ in range(3)]
    _, _, terminated, truncated, info = steps[-1]
    assert terminated and not truncated and info["game_over"] is False  # a life lost, the game goes on
    env.reset()
    assert inner.resets == 1  # no real reset after a lost life: one NOOP step instead
    for _ in range(2):
        env.step(0)
    _, _, terminated, _, info = env.step(0)
    assert terminated and info["game_over"] is True
    env.reset()
    assert inner.resets == 2  # game over: a real reset
    env.step(0)
    env.reset(seed=5)
    assert inner.resets == 3  # a reset mid-game (or seeded) is a real one


def test_a_switched_time_limit_changes_only_at_a_real_reset():
    """``SwitchedTimeLimit`` under ``EpisodicLife`` (the learners' stack), limits 100 and 4, a life lost every 3
    steps: the switch set after the first lost life leaves that game whole (the reset after a lost life is a NOOP
    step, not a reset), and the next real game is cut at 4. There the NOOP step after a lost life is the 4th:
    the cut ends the game inside that reset, which is then a real one, under the same short limit."""
    from run_state import Flag
    switch = Flag()
    inner = FakeAtari(life_every=3, lives=3)
    env = EpisodicLife(environment.SwitchedTimeLimit(inner, 100, 4, switch))
    env.reset()
    ends = [env.step(0)[2:4] for _ in range(3)]
    assert ends[-1] == (True, False)  # a life lost, under the long limit
    switch.set()
    env.reset()
    assert inner.resets == 1
    steps = [env.step(0) for _ in range(5)]  # the NOOP made 4 steps; 5 more: game over at 9, never cut at 4
    assert [s[3] for s in steps] == [False] * 5 and steps[-1][2] and steps[-1][4]["game_over"] and inner.t == 9
    env.reset()
    assert inner.resets == 2
    assert [env.step(0)[2:4] for _ in range(3)] == [(False, False), (False, False), (True, False)]
    _, info = env.reset()  # the NOOP step is the 4th: truncated, so the reset is a real one
    assert inner.resets == 3 and info["game_cut"] is True
    assert [env.step(0)[2:4] for _ in range(3)] == [(False, False), (False, False), (True, False)]
    switch.clear()
    _, info = env.reset()  # the cut again; the real reset reads the cleared switch: the long limit
    assert inner.resets == 4 and info["game_cut"] is True
    assert [env.step(0)[3] for _ in range(4)] == [False] * 4


def learner_episode_ends(env_id: str, action: int, steps: int) -> list[tuple[int, int, bool]]:
    """``(agent step, lives after it, game over)`` for every learner episode end (``terminated``) in ``steps``
    agent steps of ``env_id``'s learner stack from seed 0, holding ``action`` (the reset after each end as a
    learner takes it)."""
    env = atari_env(env_id, load_env_config("config.json", env_id), episodic_life=True, max_episode_length=100000)
    env.reset(seed=0)
    ends = []
    for t in range(1, steps + 1):
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            ends.append((t, env.unwrapped.ale.lives(), info["game_over"]))
            if info["game_over"]:
                break
            env.reset()
    return ends


def test_a_last_life_played_at_lives_0_ends_the_learners_episode():
    """BankHeist's counter shows the reserve, so its last life is played at lives() == 0 (holding action 11 from
    seed 0: 4 -> 3 -> 2 -> 1 -> 0, the game going on for about 100 steps at 0). The 1 -> 0 loss ends the learner's
    episode as the others do; the game's end ends the last one."""
    ends = learner_episode_ends("BankHeistNoFrameskip-v4", 11, 2000)
    assert [(lives, over) for _, lives, over in ends] == [(3, False), (2, False), (1, False), (0, False), (0, True)]
    assert ends[-1][0] - ends[-2][0] > 50, ends


def test_galaxians_lives_counter_settling_at_the_start_is_not_a_lost_life():
    """Galaxian's counter goes 4 -> 3 at frame 64 of every game, when the first ship comes on screen, with no life
    lost: no learner episode ends there; the first end is a ship destroyed, well after it."""
    ends = learner_episode_ends("ALE/Galaxian-v5", 0, 400)
    assert ends and ends[0][0] > 30 and ends[0][1] == 2 and not ends[0][2], ends


def test_a_life_lost_on_the_time_limit_step_is_a_termination():
    """The learner bootstraps 0 from a lost life even when the time limit cuts that same step, and the reset
    after it is a real one (the game was cut). Both agent paths test ``terminated`` before ``truncated``."""
    inner = FakeAtari(life_every=3, lives=3)
    env = EpisodicLife(gym.wrappers.TimeLimit(inner, max_episode_steps=3))
    env.reset()
    assert [env.step(0)[2:4] for _ in range(2)] == [(False, False)] * 2
    _, _, terminated, truncated, info = env.step(0)
    assert terminated and truncated and info["game_over"] is True
    env.reset()
    assert inner.resets == 2 and inner.ale.lives() == 3  # a real reset, not the NOOP after a lost life
    inner_short = FakeAtari(life_every=5, lives=3)
    env = EpisodicLife(gym.wrappers.TimeLimit(inner_short, max_episode_steps=3))
    env.reset()
    _, _, terminated, truncated, _ = [env.step(0) for _ in range(3)][-1]
    assert truncated and not terminated  # cut with no life lost: bootstrap from V(s)


@pytest.mark.parametrize("limit", [6, 7, 8, 9, 100])
def test_a_game_cut_inside_the_reset_after_a_lost_life_is_counted_once(limit):
    """Real resets press FIRE and 2 (fake steps 1-2), a life is lost at step 5, and the reset after it takes a NOOP,
    FIRE and 2 (steps 6-8). A time limit on one of those ends the game inside the reset, where no ``step`` reports
    it: the reset says so (``game_cut``) and a GA3C env slot counts the game then. A limit at step 9 cuts the next
    learner step (reported by ``step``), and 100 cuts nothing."""
    from ga3c.agent import EnvRunner
    from ga3c.buffers import EnvSlots
    inner = FakeAtari(life_every=5, lives=3)
    env = environment.ProcessFrame(FireReset(EpisodicLife(gym.wrappers.TimeLimit(inner, max_episode_steps=limit))),
                                   34, 34)
    buffers = EnvSlots(1)
    runner = EnvRunner(0, env, buffers)
    runner.begin(timeout=0.0)
    buffers.action[0] = 0
    results = [runner.on_response() for _ in range(3)]  # learner steps 3, 4 and 5 (the life lost)
    assert results[:2] == [(1, None), (1, None)]
    cut_in_reset = limit in (6, 7, 8)
    assert results[2] == (1, (3.0, 3) if cut_in_reset else None)
    assert inner.resets == (2 if cut_in_reset else 1) and runner.cut is cut_in_reset
    assert (runner.score, runner.length) == ((0.0, 0) if cut_in_reset else (3.0, 3))
    step = runner.on_response()  # fake step 9 (after a cut: step 3 of the new game)
    assert step == (1, (4.0, 4) if limit == 9 else None)


def test_fire_reset_presses_fire_then_2():
    inner = FakeAtari(life_every=1000)
    env = FireReset(inner)
    env.reset()
    assert inner.actions == [1, 2]


def test_fire_is_pressed_only_where_action_1_is_fire(env_config):
    """Both v5-only games whose FIRE is action 0 get no FIRE presses (there, actions 1 and 2 move); Breakout does."""
    from environment import presses_fire
    assert presses_fire(["NOOP", "FIRE", "RIGHT", "LEFT"]) and not presses_fire(["NOOP", "FIRE"])
    for env_id, fire in [("ALE/Backgammon-v5", False), ("ALE/VideoCheckers-v5", False), ("ALE/Breakout-v5", True),
                         ("PongNoFrameskip-v4", True)]:
        env = atari_env(env_id, load_env_config(env_config, env_id), episodic_life=True)
        layers, e = [], env
        while e is not None:
            layers.append(type(e).__name__)
            e = getattr(e, "env", None)
        assert ("FireReset" in layers) is fire, env_id
        env.close()


def test_process_frame_crop_resize_gray():
    frame = np.zeros((210, 160, 3), np.uint8)
    frame[34:194] = [255, 255, 255]  # the Pong crop is all white
    out = process_frame(frame, 34, 34)
    assert out.shape == (1, 80, 80) and out.dtype == np.float32
    assert np.allclose(out, 255 * (0.2989 + 0.587 + 0.114), atol=1e-3)
    frame[:] = 0
    frame[34:194, :, 0] = 100  # red only
    assert np.allclose(process_frame(frame, 34, 34), 29.89, atol=1e-3)


def test_env_config_lookup(env_config):
    assert load_env_config(env_config, "SpaceInvadersNoFrameskip-v4") == {"crop1": 8, "crop2": 36}
    assert load_env_config(env_config, "PongNoFrameskip-v4") == {"crop1": 34, "crop2": 34}
    assert load_env_config(env_config, "FreewayNoFrameskip-v4") == {"crop1": 34, "crop2": 34}  # Default


@pytest.mark.parametrize("table, message", [
    ([1], "it is not a JSON object of games"),
    ({"Pong": 5}, "the entry for 'Pong' is not an object with crop1 and crop2"),
    ({"Pong": {"crop1": 34.5, "crop2": 34}}, "the entry for PongNoFrameskip-v4 needs integer 'crop1'"),
    ({"Pong": {"crop1": True, "crop2": 34}}, "the entry for PongNoFrameskip-v4 needs integer 'crop1'"),
    ({"Pong": {"crop1": 250, "crop2": 34}}, "the entry for PongNoFrameskip-v4 keeps no rows of the 210-row screen"),
    ({"Pong": {"crop1": -1, "crop2": 34}}, "the entry for PongNoFrameskip-v4 keeps no rows of the 210-row screen"),
    ({"Pong": {"crop1": 34, "crop2": -130}}, "the entry for PongNoFrameskip-v4 keeps no rows of the 210-row screen")])
def test_a_crop_table_that_cannot_crop_is_one_line_naming_the_entry(tmp_path, table, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_env_config(path, "PongNoFrameskip-v4")
    from config import validate_common
    from gym_eval import build_parser
    errors = validate_common(build_parser().parse_args(["--env-config", str(path)]))
    assert errors == [e for e in errors if e.startswith(f"env config '{path}' is not valid: {message}")] != []


def test_upstreams_table_crops_every_game_within_the_screen(env_config):
    """VideoPinball's rows end at 220, past the screen's 210: the slice stops at 210, as upstream's did."""
    table = json.loads(Path(env_config).read_text())
    for game in table:
        conf = load_env_config(env_config, f"{game}NoFrameskip-v4")
        assert process_frame(np.zeros((210, 160, 3), np.uint8), conf["crop1"], conf["crop2"]).shape == (1, 80, 80)


@pytest.mark.parametrize("env_id,skip_by_us,rap", [
    ("PongNoFrameskip-v4", True, 0.0), ("PongNoFrameskip-v0", True, 0.25), ("ALE/Pong-v5", False, 0.25),
    ("Pong-v4", False, 0.0), ("Pong-v0", False, 0.25), ("PongDeterministic-v4", False, 0.0)])
def test_accepted_ids(env_id, skip_by_us, rap):
    spec = resolve_env_id(env_id)
    assert spec.frameskip_by_us == skip_by_us and spec.repeat_action_probability == rap


@pytest.mark.parametrize("env_id,skip", [("PongDeterministic-v4", 4), ("PongDeterministic-v0", 4),
                                         ("SpaceInvadersDeterministic-v4", 3), ("SpaceInvadersDeterministic-v0", 3)])
def test_deterministic_ids_skip_the_frames_gym_registered(env_id, skip):
    """gym registered SpaceInvadersDeterministic with a skip of 3 (its laser beams disappear at 4) and every other game
    with 4: counted on the emulator's frame counter over real steps."""
    assert resolve_env_id(env_id).frameskip == skip
    env = make(env_id)
    try:
        env.reset(seed=1)
        ale = env.unwrapped.ale
        before = ale.getEpisodeFrameNumber()
        for _ in range(5):
            env.step(0)
        assert ale.getEpisodeFrameNumber() - before == 5 * skip
    finally:
        env.close()


def test_unknown_id_suggests_close_ids():
    with pytest.raises(EnvIdError, match="did you mean.*PongNoFrameskip-v4"):
        resolve_env_id("PongNoFrameSkip-v4")  # upstream's default typo
    with pytest.raises(EnvIdError, match="unknown environment id 'CartPole-v1'"):
        resolve_env_id("CartPole-v1")
    for env_id in ("PongDeterministic-v4\n", "PongNoFrameskip-v4\n"):  # not an id, and the error stays one line
        with pytest.raises(EnvIdError, match=r"unknown environment id 'Pong\w+-v4\\n'") as e:
            resolve_env_id(env_id)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("env_id", ["Pong-v0", "PongNoFrameskip-v0", "Pong-v4", "PongNoFrameskip-v4", "ALE/Pong-v5"])
def test_old_ids_make_without_gymnasium_s_out_of_date_notice(env_id):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make(env_id).close()
        assert num_actions(env_id) == 6
    assert not [w for w in caught if "out of date" in str(w.message)], [str(w.message) for w in caught]


def test_only_the_out_of_date_notice_is_silenced(monkeypatch):
    def noisy_make(make_id, **kwargs):
        gym.logger.deprecation(f"The environment {make_id} is out of date. You should consider upgrading.")
        warnings.warn("some other deprecation", DeprecationWarning)
        return "env"
    monkeypatch.setattr(environment.gym, "make", noisy_make)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert environment._gym_make("Pong-v0", {}) == "env"
    assert [str(w.message) for w in caught] == ["some other deprecation"]


def make(env_id="PongNoFrameskip-v4", **kw):
    return atari_env(env_id, load_env_config("config.json", env_id), **kw)


def test_real_pong_api_shapes_dtype():
    env = make()
    obs, info = env.reset(seed=0)
    assert env.observation_space == gym.spaces.Box(-np.inf, np.inf, (1, 80, 80), np.float32)
    assert obs.shape == (1, 80, 80) and obs.dtype == np.float32
    assert env.action_space.n == 6
    out = env.step(0)
    assert len(out) == 5 and isinstance(out[2], bool) and isinstance(out[3], bool)
    assert out[0] in env.observation_space


def test_real_pong_is_seeded():
    a, b = make(), make()
    oa, _ = a.reset(seed=7)
    ob, _ = b.reset(seed=7)
    assert np.array_equal(oa, ob)
    for _ in range(30):
        ra, rb = a.step(3), b.step(3)
        assert np.array_equal(ra[0], rb[0]) and ra[1] == rb[1]


@pytest.mark.parametrize("env_id", ["PongNoFrameskip-v4", "BreakoutNoFrameskip-v4", "ALE/Pong-v5"])
def test_gymnasium_env_checker_passes(env_id):
    check_env(make(env_id), skip_render_check=True)


@pytest.mark.parametrize("env_id", ["PongNoFrameskip-v4", "ALE/Pong-v5"])
def test_time_limit_in_agent_steps_truncates_not_terminates(env_id):
    env = make(env_id, max_episode_length=12, episodic_life=False)
    env.reset(seed=0)
    results = [env.step(0) for _ in range(10)]  # Pong's FIRE reset already took 2 agent steps of the game
    assert [r[3] for r in results] == [False] * 9 + [True]
    assert not any(r[2] for r in results)


def test_real_breakout_episodic_life():
    env = make("BreakoutNoFrameskip-v4", episodic_life=True)
    ale = env.unwrapped.ale
    env.reset(seed=0)
    assert ale.lives() == 5
    for _ in range(2000):  # NOOP never moves the paddle: the ball is lost
        obs, reward, terminated, truncated, info = env.step(0)
        if terminated:
            break
    assert terminated and not truncated and info["game_over"] is False and ale.lives() == 4
    frames_then = ale.getEpisodeFrameNumber()
    env.reset()
    assert ale.getEpisodeFrameNumber() > frames_then  # the same game continues: no real reset
    assert ale.lives() == 4


def test_whole_games_without_episodic_life():
    env = make("BreakoutNoFrameskip-v4", episodic_life=False)
    env.reset(seed=0)
    ale = env.unwrapped.ale
    lives_seen = set()
    for _ in range(20000):  # FIRE relaunches the ball after each lost life; the paddle never moves
        _, _, terminated, truncated, _ = env.step(1)
        lives_seen.add(ale.lives())
        if terminated or truncated:
            break
    assert terminated and 1 in lives_seen and 5 in lives_seen  # the game went through all lives


def test_normalizer_stats_roundtrip_and_seeded_reset():
    env = make()
    env.reset(seed=1)
    for _ in range(5):
        env.step(0)
    stats = normalizer(env).get_stats()
    assert stats[2] == 6 + 0 and stats[1] > 0  # reset frame + 5 steps
    other = make()
    normalizer(other).set_stats(*stats)
    assert normalizer(other).get_stats() == stats
    o1, _ = other.reset(seed=3)
    o2, _ = other.reset(seed=3)
    assert np.array_equal(o1, o2)  # a seeded reset restarts from the statistics set


def test_protocol_words():
    p = protocol("PongNoFrameskip-v0", max_episode_length=10000, skip_rate=4, episodic_life=False)
    assert p["repeat_action_probability"] == 0.25 and p["frameskip"] == 4 and p["noop_starts"] == 30
    assert p["max_over_frames"] == 3


@pytest.mark.parametrize("skip", [1, 2, 3, 5])
def test_the_protocol_names_the_frames_the_skip_maxes_over(skip):
    """``max_over_frames`` is what ``MaxAndSkip`` does at that skip: the last min(skip, 3) raw frames."""
    frames = [[10 * (i + 1), 0, 0] for i in range(skip)]  # raw frame i holds 10 (i + 1): the max is the last
    frames[0][1] = 255  # the first raw frame of the step has pixel 1's maximum
    env = MaxAndSkip(ScriptedFrames(frames, [0.0] * skip), skip=skip)
    env.reset()
    obs, *_ = env.step(0)
    maxed = protocol("PongNoFrameskip-v4", max_episode_length=10000, skip_rate=skip,
                     episodic_life=False)["max_over_frames"]
    assert maxed == min(skip, 3)
    assert obs[1] == (255 if maxed == skip else 0)  # the first raw frame is maxed over iff all frames are


class SeededFrames(ScriptedFrames):
    """``ScriptedFrames`` with an endless script: raw frame t is ``[255 - t, 0, 0]`` (falling, so that a max over a
    frame left from the step before would show), reward 1 per frame."""

    def __init__(self):
        super().__init__(None, None)

    def step(self, action):
        self.actions.append(action)
        self.t += 1
        assert self.t <= 255, "the script has 255 frames"
        return np.array([255 - self.t, 0, 0], np.uint8), 1.0, False, False, {}


def test_max_and_skip_draws_a_range_skip_per_step_from_the_env_rng_as_ale_py_does():
    """A ``(low, high)`` skip: each step repeats the action k raw frames, k drawn by ``np_random.integers(low,
    high)`` of the wrapped env, the call and generator ale-py's ``AtariEnv.step`` uses for ``Pong-v0``'s (2, 5)."""
    env = MaxAndSkip(SeededFrames(), skip=(2, 5))
    env.reset(seed=11)
    reference, _ = gym.utils.seeding.np_random(11)
    ks = []
    for _ in range(60):
        before = env.env.t
        obs, reward, *_ = env.step(1)
        k = env.env.t - before
        assert k == int(reference.integers(2, 5)) and reward == float(k)
        # the max over this step's last min(k, 3) frames: the first of them, the frames falling
        assert obs.tolist() == [255 - (env.env.t - min(k, MAX_OVER_FRAMES) + 1), 0, 0]
        ks.append(k)
    assert set(ks) == {2, 3, 4}


@pytest.mark.parametrize("env_id", ["Pong-v0", "ALE/Pong-v5", "PongDeterministic-v4", "SpaceInvadersDeterministic-v0"])
def test_see_skipped_frames_plays_the_same_game_as_the_emulator_s_own_skip(env_id):
    """The production stack with ``see_skipped`` against the one without, both seeded alike and given the same
    actions: the same skip at every step (the emulator's frame counter), rewards, ends and RAM (the whole game
    state, sticky actions included); only the observation differs, the max over the last raw frames."""
    plain = make(env_id, episodic_life=False)
    seen = make(env_id, episodic_life=False, see_skipped=True)
    try:
        assert not any(isinstance(e, MaxAndSkip) for e in _layers(plain))
        assert any(isinstance(e, MaxAndSkip) for e in _layers(seen))
        plain.reset(seed=4)
        seen.reset(seed=4)
        actions = np.random.default_rng(4).integers(0, plain.action_space.n, 400)
        skips, pa, sa = set(), plain.unwrapped.ale, seen.unwrapped.ale
        observations_differ = 0
        for a in actions:
            before = pa.getEpisodeFrameNumber()
            p, s = plain.step(int(a)), seen.step(int(a))
            assert p[1:4] == s[1:4]
            assert pa.getEpisodeFrameNumber() == sa.getEpisodeFrameNumber()
            assert np.array_equal(pa.getRAM(), sa.getRAM())
            skips.add(pa.getEpisodeFrameNumber() - before)
            observations_differ += not np.array_equal(p[0], s[0])
            if p[2] or p[3]:
                break
        assert skips == ({2, 3, 4} if env_id == "Pong-v0" else {resolve_env_id(env_id).frameskip})
        assert observations_differ > 0
    finally:
        plain.close()
        seen.close()


@pytest.mark.parametrize("env_id", ["Pong-v0", "ALE/Pong-v5"])
def test_see_skipped_frames_plays_the_emulator_s_next_games_after_one_ends_inside_a_step(monkeypatch, env_id):
    """Learner stacks (episodic life, the unseeded resets after a game) whose games end inside an agent step: ALE's
    frame cap set to 50, which a skip of 4 does not divide. ale-py sends the action for the step's remaining frames,
    each a draw from ALE's sticky-action generator, which the reset does not reseed; with ``see_skipped`` the next
    games must be the emulator's own, RAM for RAM and skip for skip."""
    make_env = environment._gym_make
    monkeypatch.setattr(environment, "_gym_make",
                        lambda env_id, kwargs: make_env(env_id, dict(kwargs, max_num_frames_per_episode=50)))
    plain = make(env_id, episodic_life=True)
    seen = make(env_id, episodic_life=True, see_skipped=True)
    try:
        plain.reset(seed=6)
        seen.reset(seed=6)
        actions = np.random.default_rng(6).integers(0, plain.action_space.n, 600)
        pa, sa = plain.unwrapped.ale, seen.unwrapped.ale
        games = 0
        for a in actions:
            p, s = plain.step(int(a)), seen.step(int(a))
            assert p[1:4] == s[1:4]
            assert pa.getEpisodeFrameNumber() == sa.getEpisodeFrameNumber()
            assert np.array_equal(pa.getRAM(), sa.getRAM()), f"game {games + 1}"
            if p[2] or p[3]:
                games += 1
                assert pa.getEpisodeFrameNumber() == 50
                plain.reset()
                seen.reset()
                assert np.array_equal(pa.getRAM(), sa.getRAM()), f"the reset after game {games}"
        assert games >= 20
    finally:
        plain.close()
        seen.close()


def _layers(env):
    while True:
        yield env
        if not hasattr(env, "env"):
            return
        env = env.env


def test_see_skipped_frames_leaves_no_frameskip_ids_as_they_are():
    """``NoFrameskip`` ids already skip in ``MaxAndSkip``: the same stack, the same observations."""
    a, b = make("PongNoFrameskip-v0"), make("PongNoFrameskip-v0", see_skipped=True)
    try:
        assert [type(e) for e in _layers(a)] == [type(e) for e in _layers(b)]
        oa, _ = a.reset(seed=2)
        ob, _ = b.reset(seed=2)
        assert np.array_equal(oa, ob)
        for t in range(50):
            ra, rb = a.step(t % 6), b.step(t % 6)
            assert np.array_equal(ra[0], rb[0]) and ra[1:4] == rb[1:4]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("env_id,plain,seen", [("Pong-v0", 1, 3), ("ALE/Pong-v5", 1, 3), ("PongNoFrameskip-v4", 3, 3),
                                               ("SpaceInvadersDeterministic-v4", 1, 3)])
def test_the_protocol_names_what_see_skipped_frames_maxes_over(env_id, plain, seen):
    kw = {"max_episode_length": 10000, "skip_rate": 4, "episodic_life": False}
    assert protocol(env_id, **kw)["max_over_frames"] == plain
    p = protocol(env_id, **kw, see_skipped=True)
    assert p["max_over_frames"] == seen
    assert p["frameskip"] == protocol(env_id, **kw)["frameskip"]  # the same skip: only the observation changes

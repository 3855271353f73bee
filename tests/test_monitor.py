"""The monitor's cadence: ``test.game_interval`` by hand, and ``test.run_monitor``'s loop, played in this process
with scripted games, where the clock the loop waits on is the global step count the test advances."""
from argparse import Namespace

import pytest
import torch

import test as monitor
from config import build_parser, validate
from model import A3Clstm
from run_state import RunState


def cadence(every=20000, confirm=5000, target=20.0, seconds=0.0):
    return Namespace(test_every_steps=every, confirm_every_steps=confirm, target_score=target,
                     test_every_seconds=seconds)


@pytest.mark.parametrize("args, recent, expected", [
    (cadence(), [], 20000),                                  # no game yet
    (cadence(), [-21.0, 19.0, 19.5], 20000),                 # none at the target
    (cadence(), [-21.0, 20.0, -21.0], 5000),                 # one at the target, anywhere in the window
    (cadence(), [21.0], 5000),                               # above it
    (cadence(target=None), [21.0, 21.0], 20000),             # no target: the plain cadence
    (cadence(confirm=0), [21.0], 20000),                     # off
    (cadence(confirm=20000), [21.0], 20000),                 # not sooner
    (cadence(confirm=30000), [21.0], 20000),                 # later: the plain cadence stays
    (cadence(every=0, seconds=60), [21.0], 5000),            # no step cadence: the confirming one is sooner
    (cadence(every=0, seconds=60), [0.0], 0),
    (cadence(every=0), [21.0], 0),                           # no cadence at all: back to back, nothing sooner
    (cadence(target=-5.0), [float("nan"), -5.0], 5000),      # a game not known (nan) counts for nothing
    (cadence(target=-5.0), [float("nan")], 20000),
])
def test_game_interval_by_hand(args, recent, expected):
    assert monitor.game_interval(args, recent) == expected


def test_confirm_every_steps_default_and_bad_values():
    args = build_parser().parse_args([])
    assert args.confirm_every_steps == 5000 and args.test_every_steps == 20000
    for value, line in (("-1", "--confirm-every-steps must be >= 0 (0 = off), got -1"),
                        (str(2 ** 63), f"--confirm-every-steps must be < 2**63 (a step count the checkpoint holds), "
                                       f"got {2 ** 63}")):
        assert line in validate(build_parser().parse_args(["--confirm-every-steps", value]))


def play_scripted(tmp_path, monkeypatch, scores, flags, window=3, shared_model=None, after_game=None,
                  switched=None):
    """Runs ``run_monitor`` on games that score ``scores`` in turn; while it waits for the next game, each of its
    sleeps advances the global step count by 500. Returns the global steps at which each game started, the
    monitor's console lines, and whether ``run.target_reached`` was set at each game's start; the loop ends at the
    start of the game after the last score. ``after_game(n)`` is called at the end of game n (from 1); a
    ``switched`` list gets whether ``run.short_games`` was set at each game's start."""
    args = build_parser().parse_args(["--hidden-size", "32", "--score-window", str(window), "--log-dir",
                                      str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models"), *flags])
    assert validate(args) == []
    (tmp_path / "logs").mkdir()
    (tmp_path / "models").mkdir(exist_ok=True)
    run = RunState(1, window)
    starts, reached = [], []

    def game(model, env, device, seed=None, should_stop=None, **kw):
        starts.append(run.global_steps.value)
        reached.append(run.target_reached.is_set())
        if switched is not None:
            switched.append(run.short_games.is_set())
        if len(starts) > len(scores):
            run.stop.set()
            return 0.0, 1, False
        if after_game is not None:
            after_game(len(starts))
        return scores[len(starts) - 1], 1000, True

    def sleep(seconds):
        run.global_steps.value += 500

    lines = []
    monkeypatch.setattr(monitor, "play_game", game)
    monkeypatch.setattr(monitor.time, "sleep", sleep)
    monkeypatch.setattr(monitor, "setup_logger", lambda name, path, console=False: _Lines(lines) if console
                        else _Lines([]))
    monitor.run_monitor(args, A3Clstm(1, 6, 32) if shared_model is None else shared_model, run, torch.device("cpu"))
    return starts, lines, reached


class _Lines:
    def __init__(self, lines):
        self.lines = lines

    def info(self, text):
        self.lines.append(text)


def test_the_monitor_confirms_a_game_at_the_target_sooner_and_goes_back_when_none_is_left(tmp_path, monkeypatch):
    # window 3: after game 2 (20) the window holds a game at the target until game 5 pushes it out
    starts, lines, _ = play_scripted(tmp_path, monkeypatch, [-21.0, 20.0, -21.0, -21.0, -21.0],
                                  ["--target-score", "20"])
    assert starts == [0, 20000, 25000, 30000, 35000, 55000]
    changes = [line for line in lines if "global steps until none does" in line or "back to" in line]
    assert changes == ["[monitor] a game of the last 3 scored at least 20: a game every 5,000 global steps until "
                       "none does",
                       "[monitor] none of the last 3 games scored at least 20: back to --test-every-steps 20000"]


@pytest.mark.parametrize("flags", [["--target-score", "20", "--confirm-every-steps", "0"], []])
def test_without_a_target_or_with_confirming_off_the_cadence_is_test_every_steps(tmp_path, monkeypatch, flags):
    starts, lines, _ = play_scripted(tmp_path, monkeypatch, [-21.0, 20.0, 21.0, 20.0], flags)
    assert starts == [0, 20000, 40000, 60000, 80000]
    assert not [line for line in lines if "until none does" in line or "back to" in line]


def test_the_confirming_cadence_reaches_the_target_and_stops_sooner(tmp_path, monkeypatch):
    # --target-score stops a run through run.target_reached; here the mean of 3 games reaches 20 (exactly: the
    # target is reached at equality) at game 4, and not before
    starts, _, reached = play_scripted(tmp_path, monkeypatch, [-21.0, 20.0, 20.0, 20.0],
                                       ["--target-score", "20", "--confirm-every-steps", "3000"])
    assert starts == [0, 20000, 23000, 26000, 29000]
    assert reached == [False, False, False, False, True]


def test_a_mean_just_below_the_target_does_not_stop_the_run(tmp_path, monkeypatch):
    _, _, reached = play_scripted(tmp_path, monkeypatch, [20.0, 20.0, 19.0, 21.0],
                                  ["--target-score", "20", "--confirm-every-steps", "3000"])
    assert reached == [False, False, False, False, True]  # 19.67 after game 3; 20.0 after game 4


@pytest.mark.parametrize("flags, want", [
    (["--short-game-slots", "2", "--short-games-after-score", "19"], [False] * 4 + [True] * 5),
    (["--short-game-slots", "1", "--short-games-after-score", "-21"], [False] * 3 + [True] * 6),
    (["--short-game-slots", "2"], [False] * 9),  # cut from the start: the agents' factory has no switch
    (["--short-game-slots", "2", "--short-games-after-score", "21.5"], [False] * 9),
])
def test_the_monitor_sets_the_short_games_switch_once_its_mean_first_reaches_the_score(tmp_path, monkeypatch, flags,
                                                                                       want):
    """Window 3: the mean reaches 19 at game 4 (exactly: at equality), and -21 at game 3 (the first full window,
    5.67); the switch is set at the end of that game, with one line, and stays set when the mean falls again."""
    switched = []
    _, lines, _ = play_scripted(tmp_path, monkeypatch, [-21.0, 19.0, 19.0, 19.0, 21.0, 19.0, -21.0, -21.0],
                                flags, switched=switched)
    assert switched == want
    said = [line for line in lines if "--short-games-after-score" in line]
    if True not in want:
        assert said == []
    elif flags[1] == "2":
        assert said == ["[monitor] --short-games-after-score 19 reached at 60,000 steps: mean 19.00 over the last 3 "
                        "games; env slots 0-1 play games cut at 150 agent steps from their next game on"]
    else:
        assert said == ["[monitor] --short-games-after-score -21 reached at 40,000 steps: mean 5.67 over the last "
                        "3 games; env slot 0 plays games cut at 150 agent steps from their next game on"]


def test_weights_gone_nan_end_the_monitor_before_a_game_and_keep_the_last_model_file(tmp_path, monkeypatch):
    """A run that diverged: the shared weights hold NaN after game 2. The monitor plays no game on them and
    writes no .dat: it raises DivergedError (one line, reported by the process), and the .dat of game 2 stays.
    Before, the NaN weights were played and written over the last good model file."""
    from checkpoint import DivergedError, read_weights
    shared = A3Clstm(1, 6, 32)

    def poison(n):
        if n == 2:
            with torch.no_grad():
                shared.actor_linear.weight[0, 0] = float("nan")
    with pytest.raises(DivergedError) as e:
        play_scripted(tmp_path, monkeypatch, [-21.0, -20.0, -19.0], [], shared_model=shared, after_game=poison)
    dat = tmp_path / "models" / "PongNoFrameskip-v4.dat"
    assert str(e.value) == (f"the run diverged: NaN or infinite values in model actor_linear.weight; {dat} is not "
                            f"written (the last one written before is kept): resume from it with --load and a "
                            f"smaller --lr")
    saved = read_weights(dat)
    assert torch.isnan(shared.actor_linear.weight[0, 0]) and saved["actor_linear.weight"][0, 0].isfinite()
    rows = (tmp_path / "logs" / "PongNoFrameskip-v4_monitor.csv").read_text().splitlines()
    assert [r.split(",")[3] for r in rows[1:]] == ["-21.0", "-20.0"]


def test_a_resumed_window_with_a_game_at_the_target_confirms_from_its_first_game(tmp_path, monkeypatch):
    """The window is the checkpoint's (``RunState.recent``): a run resumed with a game at the target in it tests
    at the confirming cadence after its first game."""
    real = RunState.__init__

    def restored(self, *a, **k):
        real(self, *a, **k)
        self.record_game(20.0)
    monkeypatch.setattr(RunState, "__init__", restored)
    starts, lines, _ = play_scripted(tmp_path, monkeypatch, [-21.0, -21.0, -21.0], ["--target-score", "20"])
    assert starts == [0, 5000, 10000, 30000]
    assert lines[-1] == "[monitor] none of the last 3 games scored at least 20: back to --test-every-steps 20000"


@pytest.mark.parametrize("dat_there, written", [(False, True), (True, False)])
def test_save_max_resumed_into_a_folder_without_a_model_writes_one(tmp_path, monkeypatch, dat_there, written):
    """--save-max with a checkpoint whose best game scored 21, resumed into another --save-model-dir: the best to
    beat there starts at 0, so a game of 5 writes the folder's first .dat. Before, the checkpoint's 21 had to be
    matched, and the run could end with no .dat at all (the final save leaves it to the monitor). Where the folder
    already holds the run's .dat, a worse game does not replace it."""
    real = RunState.__init__

    def restored(self, *a, **k):
        real(self, *a, **k)
        self.monitor[2] = 21.0  # the checkpoint's best game
    monkeypatch.setattr(RunState, "__init__", restored)
    dat = tmp_path / "models" / "PongNoFrameskip-v4.dat"
    if dat_there:
        dat.parent.mkdir()
        dat.write_bytes(b"the best model so far")
    play_scripted(tmp_path, monkeypatch, [5.0], ["--save-max"])
    assert dat.exists() and (dat.read_bytes() != b"the best model so far") is written

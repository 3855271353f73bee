"""gym_eval.py and plot.py as subprocesses, on model files written here in the upstream format."""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from conftest import ROOT, always_noop_model, deny_below, kill_session, processes_left, run_entry
from test_faults import START_SECONDS
from model import expected_shapes

SHORT = ["--hidden-size", "32", "--max-episode-length", "60", "--env-config", str(ROOT / "config.json")]
# what an earlier gym_eval.py run left at a --json path: a summary, which a new one may replace
EARLIER_SUMMARY = '{"env": "PongNoFrameskip-v4", "episodes": 1, "scores": [1.0], "lengths": [900], "protocol": {}}\n'


@pytest.fixture
def model_dir(tmp_path):
    """A drop-in file as upstream wrote it (bare OrderedDict, legacy format), random but fixed weights."""
    g = torch.Generator().manual_seed(0)
    sd = OrderedDict((k, 0.1 * torch.randn(s, generator=g)) for k, s in expected_shapes(6, 32).items())
    d = tmp_path / "models"
    d.mkdir()
    torch.save(sd, d / "PongNoFrameskip-v4.dat", _use_new_zipfile_serialization=False)
    return d


def evaluate(tmp_path, model_dir, name, *extra):
    out = tmp_path / f"{name}.json"
    r = run_entry("gym_eval.py", *SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(tmp_path / "logs"),
                  "--json", str(out), *extra, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text()), r


def test_summary_json_and_determinism_across_workers(tmp_path, model_dir):
    a, r = evaluate(tmp_path, model_dir, "a", "--num-episodes", "3", "--seed", "5")
    assert set(a) >= {"env", "model", "episodes", "mean", "std", "min", "max", "median", "scores", "lengths",
                      "seed", "protocol"}
    assert a["episodes"] == 3 and len(a["scores"]) == len(a["lengths"]) == 3 and a["seed"] == 5
    import hashlib
    assert a["model_sha256"] == hashlib.sha256((model_dir / "PongNoFrameskip-v4.dat").read_bytes()).hexdigest()
    assert all(isinstance(x, float) for x in a["scores"]) and all(isinstance(x, int) for x in a["lengths"])
    assert len(a["points"]) == 3 and any(a["points"])  # each game's [agent step, reward] of every point
    for game, score, length in zip(a["points"], a["scores"], a["lengths"]):
        assert sum(r for _, r in game) == score and all(0 < step <= length for step, _ in game)
        assert [step for step, _ in game] == sorted({step for step, _ in game})
    assert a["min"] <= a["mean"] <= a["max"] and a["std"] >= 0
    assert a["protocol"]["repeat_action_probability"] == 0.0 and a["protocol"]["episodic_life"] is False
    assert a["protocol"]["time_limit_agent_steps"] == 60 and "FIRE" in a["protocol"]["after_a_lost_life"]
    assert "3 games, mean" in r.stdout and "± " in r.stdout and "a lost life restarts as in training" in r.stdout
    log = (tmp_path / "logs/PongNoFrameskip-v4_mon_log").read_text()
    assert log.count("episode reward") == 3 and "3 games, mean" in log
    # a second run, its games shared by two processes, plays the same games: seeded per game, whoever plays it
    c, _ = evaluate(tmp_path, model_dir, "c", "--num-episodes", "3", "--seed", "5", "--workers", "2")
    assert (c["scores"], c["lengths"], c["points"]) == (a["scores"], a["lengths"], a["points"])


def test_sticky_actions_env_with_model_file(tmp_path, model_dir):
    s, _ = evaluate(tmp_path, model_dir, "s", "--num-episodes", "1", "--env", "PongNoFrameskip-v0",
                    "--model-file", "PongNoFrameskip-v4")
    assert s["env"] == "PongNoFrameskip-v0" and s["protocol"]["repeat_action_probability"] == 0.25
    assert s["model"].endswith("PongNoFrameskip-v4.dat")


def test_a_float16_file_plays_as_its_values_in_float32(tmp_path, model_dir):
    """A model stored in float16 (half the bytes) is evaluated as the float32 model of the same values: the same
    games, points and, step by step, the same policy and critic (the traces)."""
    sd = torch.load(model_dir / "PongNoFrameskip-v4.dat", weights_only=True)
    half_dir, as32_dir = tmp_path / "half", tmp_path / "as32"
    half_dir.mkdir()
    as32_dir.mkdir()
    torch.save(OrderedDict((k, v.half()) for k, v in sd.items()), half_dir / "PongNoFrameskip-v4.dat")
    torch.save(OrderedDict((k, v.half().float()) for k, v in sd.items()), as32_dir / "PongNoFrameskip-v4.dat")
    runs = []
    for d in (half_dir, as32_dir):
        s, _ = evaluate(tmp_path, d, d.name, "--num-episodes", "2", "--seed", "3", "--trace", str(tmp_path / d.name / "tr"))
        runs.append((s["scores"], s["lengths"], s["points"],
                     [(tmp_path / d.name / "tr" / f"PongNoFrameskip-v4_game{i:03d}.csv").read_text() for i in range(2)]))
    assert runs[0] == runs[1] and len(runs[0][3][0].splitlines()) > 2


def test_trace_writes_every_policy_step_of_every_game(tmp_path, model_dir):
    import csv
    trace_dir = tmp_path / "trace"
    s, r = evaluate(tmp_path, model_dir, "t", "--num-episodes", "2", "--seed", "3", "--trace", str(trace_dir))
    assert "2 trace(s) written" in r.stdout
    assert sorted(p.name for p in trace_dir.iterdir()) == ["PongNoFrameskip-v4_game000.csv",
                                                          "PongNoFrameskip-v4_game001.csv"]
    for i in range(2):
        with open(trace_dir / f"PongNoFrameskip-v4_game{i:03d}.csv") as f:
            rows = list(csv.DictReader(f))
        names = ["NOOP", "FIRE", "RIGHT", "LEFT", "RIGHTFIRE", "LEFTFIRE"]
        assert list(rows[0]) == ["step", "action", "reward", "value", *(f"p_{a}" for a in names)]
        assert [int(r["step"]) for r in rows] == list(range(1, s["lengths"][i] + 1))  # Pong: no restart steps
        assert sum(float(r["reward"]) for r in rows) == s["scores"][i]
        assert [[int(r["step"]), float(r["reward"])] for r in rows if float(r["reward"])] == s["points"][i]
        for row in rows:
            probs = [float(row[f"p_{a}"]) for a in names]
            assert abs(sum(probs) - 1) < 1e-4 and int(row["action"]) == max(range(6), key=probs.__getitem__)
            assert abs(float(row["value"])) < 1e3
        assert len({row["value"] for row in rows}) > 1


def test_record_writes_the_first_frame_and_one_per_step(tmp_path, model_dir):
    import imageio_ffmpeg
    s, _ = evaluate(tmp_path, model_dir, "v", "--num-episodes", "2", "--render-freq", "2", "--record",
                    str(tmp_path / "videos"))
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert [v.name for v in videos] == ["PongNoFrameskip-v4_game000.mp4"]  # every 2nd game: game 0 only
    assert [p.name for p in (tmp_path / "videos").iterdir()] == [videos[0].name]  # no partial file left
    n_frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(videos[0]))
    assert n_frames == s["lengths"][0] + 1  # the game's first frame, then one after every agent step
    assert s["videos"] == {str(videos[0]): n_frames}
    assert seconds == pytest.approx(n_frames / 15.0, abs=0.2)  # real time: 60 frames/s, 4 frames a step
    meta = next(imageio_ffmpeg.read_frames(str(videos[0])))
    assert meta["codec"] == "h264" and meta["size"] == (160, 210)


def test_a_run_stops_at_its_target_score_keeps_save_max_semantics_and_plots(tmp_path, capsys):
    # stops after the monitor's 2nd game (the mean of 2 games is >= -1000), which starts after 100 global steps:
    # a CSV of 2 games, whichever process runs faster
    r = run_entry("main.py", "--workers", "1", "--hidden-size", "32", "--max-steps", "0", "--target-score", "-1000",
                  "--score-window", "2", "--test-every-steps", "100", "--max-episode-length", "200", "--save-max",
                  "--log-dir", str(tmp_path / "run/logs"), "--save-model-dir", str(tmp_path / "run/models"),
                  cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "reached --target-score -1000" in r.stdout
    # --save-max, upstream's: the .dat is written when a monitor game scores >= the best so far, which starts at 0
    # (so not at all after two losing games); the full checkpoint is always written
    scores = [float(line.split(",")[3]) for line in
              (tmp_path / "run/logs/PongNoFrameskip-v4_monitor.csv").read_text().splitlines()[1:]]
    assert len(scores) == 2
    assert (tmp_path / "run/models/PongNoFrameskip-v4.dat").exists() == (max(scores) >= 0), scores
    assert (tmp_path / "run/models/PongNoFrameskip-v4.ckpt").exists()
    out = tmp_path / "curve.png"
    r = run_entry("plot.py", str(tmp_path / "run/logs"), "--out", str(out), cwd=tmp_path)  # the entry point once;
    assert r.returncode == 0, r.stderr  # then plot.main in this process, as the script calls it
    import matplotlib
    import plot
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    h, w = matplotlib.image.imread(out).shape[:2]
    assert h > 200 and w > 400
    svg = tmp_path / "curve.svg"
    assert plot.main([str(tmp_path / "run/logs/PongNoFrameskip-v4_monitor.csv"), "--out", str(svg)]) == 0
    assert svg.read_text().lstrip().startswith("<?xml")

    # two runs' CSVs in one folder: legend names from the file names, or from --labels
    csv = (tmp_path / "run/logs/PongNoFrameskip-v4_monitor.csv").read_text()
    (tmp_path / "cmp").mkdir()
    for name in ("before", "after"):
        (tmp_path / "cmp" / f"{name}_monitor.csv").write_text(csv)
    text_stays_text = {"svg.fonttype": "none"}  # in the SVG, so that the names can be read back
    both = [str(tmp_path / "cmp/before_monitor.csv"), str(tmp_path / "cmp/after_monitor.csv")]
    for extra, names in (([], ("before", "after")), (["--labels", "old code", "new code"], ("old code", "new code"))):
        with matplotlib.rc_context(text_stays_text):
            assert plot.main([*both, "--out", str(svg), *extra]) == 0
        text = svg.read_text()
        assert all(f"{n} (mean of 10)" in text for n in names), names
    capsys.readouterr()
    assert plot.main([*both, "--out", str(svg), "--labels", "only one"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--labels names 1 curve(s)" in err
    # the title names the curves as the legend does
    with matplotlib.rc_context(text_stays_text):
        assert plot.main([*both, "--out", str(svg), "--labels", "old code", "new code"]) == 0
    assert "after, before: old code, new code" in svg.read_text()

    # a run that has not finished a game yet: skipped with a warning, the others drawn; alone, one error line
    header = csv.splitlines()[0] + "\n"
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "PongNoFrameskip-v4_monitor.csv").write_text(header)
    assert plot.main([str(tmp_path / "run/logs"), str(tmp_path / "new"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.strip().endswith("has no games yet (its run has not finished a monitor game); skipped"), err
    assert plot.main([str(tmp_path / "new"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no games yet" in err

    # GA3C's results.txt, named as a file: steps are the running sum of the games' lengths
    results = tmp_path / "ga3c" / "results.txt"
    results.parent.mkdir()
    results.write_text("2026-01-02 03:04:05, -21, 800\n2026-01-02 03:05:05, -20, 900\n")
    curve = plot.read_curve(results)
    assert curve["steps"] == [800, 1700] and curve["score"] == [-21.0, -20.0]
    assert curve["hours"] == [0.0, 60 / 3600]
    assert plot.main([str(results), "--out", str(out)]) == 0
    results.write_text("2026-01-02 03:04:05, -21, many\n")  # not a number of steps (a line cut short: below)
    capsys.readouterr()
    assert plot.main([str(results), "--out", str(out)]) == 2
    assert "line 1 is not a results.txt line" in capsys.readouterr().err


@pytest.mark.slow  # 8 s, three entry runs; seeding per game (below) and an in-process --random-actions run stay
def test_random_actions_play_the_same_protocol_without_a_model(tmp_path):
    """--random-actions reads no model (the default folder holds a file that is not a model), plays the protocol's
    games with seeded random actions whichever process plays them, and writes its JSON beside, not over, a
    model's."""
    (tmp_path / "trained_models").mkdir()
    (tmp_path / "trained_models/PongNoFrameskip-v4.dat").write_bytes(b"not a model")
    flags = ["--random-actions", "--num-episodes", "3", "--seed", "5", "--log-dir", str(tmp_path / "logs"),
             "--max-episode-length", "150"]
    r = run_entry("gym_eval.py", *flags, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    a = json.loads((tmp_path / "logs/PongNoFrameskip-v4_random_eval.json").read_text())
    assert sorted(f.name for f in (tmp_path / "logs").iterdir()) == ["PongNoFrameskip-v4_random_eval.json",
                                                                     "PongNoFrameskip-v4_random_mon_log"]
    assert "policy: uniform random actions" in (tmp_path / "logs/PongNoFrameskip-v4_random_mon_log").read_text()
    assert a["model"] is None and a["model_sha256"] is None and a["policy"] == "uniform random actions"
    assert a["card"] is None
    assert a["episodes"] == 3 and a["lengths"] == [148] * 3 and a["protocol"]["time_limit_agent_steps"] == 150
    assert a["points_lost"]["points"] > 0  # random play gives Pong's points away
    assert "PongNoFrameskip-v4 (uniform random actions): 3 games, mean" in r.stdout
    b_json = tmp_path / "b.json"
    r = run_entry("gym_eval.py", *flags, "--workers", "2", "--json", str(b_json), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    b = json.loads(b_json.read_text())
    assert (b["scores"], b["points"]) == (a["scores"], a["points"])
    # a recorded random game goes beside, not over, a model's video of the same game
    r = run_entry("gym_eval.py", *flags, "--max-episode-length", "30", "--num-episodes", "1", "--record",
                  str(tmp_path / "videos"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [f.name for f in (tmp_path / "videos").iterdir()] == ["PongNoFrameskip-v4_random_game000.mp4"]


def test_random_actions_are_seeded_per_game_whoever_plays_it(monkeypatch):
    """play_games hands game i a policy seeded with --seed + i: game 1's actions are the same played after game 0
    in one process or alone in another, and game 0's differ from game 1's."""
    import argparse
    import queue

    import gym_eval
    import player_util

    seeds = []

    def first_actions(model, env, device, *, seed, **_):
        seeds.append(seed)
        x, state = torch.zeros(1, 1, 80, 80), model.initial_state(1)
        return float(sum(int(model(x, state)[1].argmax(1)) * 6 ** k for k in range(20))), 20, True

    monkeypatch.setattr(player_util, "play_game", first_actions)
    args = argparse.Namespace(env_config=str(ROOT / "config.json"), env="PongNoFrameskip-v4", random_actions=True,
                              seed=5, render=False, record=None, trace=None, render_freq=1, max_episode_length=100,
                              skip_rate=4, hidden_size=32, see_skipped_frames=False)

    def played(games):
        q = queue.Queue()
        gym_eval.play_games(args, None, games, torch.device("cpu"), q)
        return {i: score for i, score, *_ in q.queue}

    together, alone = played([0, 1]), played([1])
    assert together[1] == alone[1] and together[0] != together[1]
    assert seeds == [5, 6, 6]  # each game's env reset with --seed + its index, as the JSON's "seed" says


def test_the_random_policy_is_uniform_and_seeded():
    from gym_eval import UniformRandomPolicy

    x = torch.zeros(1, 1, 80, 80)

    def actions(seed, n=6000):
        policy = UniformRandomPolicy(6, seed)
        state = policy.initial_state(1)
        return [int(policy(x, state)[1].argmax(1)) for _ in range(n)]

    a = actions(3)
    counts = torch.bincount(torch.tensor(a), minlength=6)
    assert counts.sum() == 6000 and all(850 <= c <= 1150 for c in counts.tolist()), counts  # 1000 each, sd ~29
    assert actions(3) == a and actions(4) != a


def bad_eval(tmp_path, *args, env_extra=None):
    """``gym_eval.main`` run in this process, in ``tmp_path``, on input it must refuse before any game: returns its
    one error line (exit 2, nothing on stdout, no log). In-process to keep the suite short; the same checks as a
    process (exit status, the one line on the real stderr) are proven by the subprocess cases below and by
    test_faults.py's broken files."""
    import contextlib
    import io
    import gym_eval
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.chdir(tmp_path)
        for name, value in (env_extra or {}).items():
            mp.setenv(name, value)
        threads = torch.get_num_threads()
        try:
            code = gym_eval.main(["--log-dir", str(tmp_path / "logs"), *args])
        except SystemExit as e:
            code = e.code
        finally:
            torch.set_num_threads(threads)
    assert code == 2, (code, out.getvalue(), err.getvalue())
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gym_eval.py: error: ") and "Traceback" not in err.getvalue()
    assert not out.getvalue() and not (tmp_path / "logs").exists()
    return lines[0]


def test_a_model_file_replaced_while_it_is_read_is_refused(tmp_path, model_dir, monkeypatch, capsys):
    """The sha256 in the JSON is of the file played: one that changes between the digest and the load is refused
    in one line, before any game."""
    import gym_eval
    read = gym_eval.read_weights

    def read_then_replace(path):
        obj = read(path)
        Path(path).write_bytes(Path(path).read_bytes() + b"x")  # another process writes the file meanwhile
        return obj

    monkeypatch.setattr(gym_eval, "read_weights", read_then_replace)
    code = gym_eval.main([*SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(tmp_path / "logs"),
                          "--num-episodes", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "changed while it was read" in err
    assert not (tmp_path / "logs").exists()


def test_games_cut_by_the_time_limit_are_named_in_the_summary_and_the_json(tmp_path, model_dir, capsys):
    """A game the time limit ends is counted with the points scored up to it (upstream's evaluation did the same);
    it is now said so, one line and ``cut_short`` (game numbers from 1) in the JSON. Before, nothing told a summary
    of 100 cut games (a Breakout model that keeps the ball in play) from one of 100 played out."""
    import gym_eval
    out = tmp_path / "e.json"
    code = gym_eval.main([*SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(tmp_path / "logs"),
                          "--num-episodes", "2", "--json", str(out)])  # 60 agent steps: no Pong game ends sooner
    assert code == 0
    assert ("2 of 2 games were cut short by the time limit (60 agent steps) or the emulator's frame cap: their "
            "scores count the points up to the cut (games 1, 2)") in capsys.readouterr().out
    assert json.loads(out.read_text())["cut_short"] == [1, 2]


def test_a_game_that_ends_is_not_cut_and_one_the_limit_ends_is():
    """``play_game``'s ``cut``: False for a game played out (terminated), True for one the time limit truncates."""
    from environment import atari_env, load_env_config
    from player_util import play_game
    conf = load_env_config(str(ROOT / "config.json"), "PongNoFrameskip-v4")
    model = always_noop_model(6, action=0)
    for limit, want in ((50, True), (10_000, False)):  # standing still, Pong is lost 21-0 in about 800 steps
        env = atari_env("PongNoFrameskip-v4", conf, max_episode_length=limit, episodic_life=False)
        cut: list = []
        score, length, _ = play_game(model, env, torch.device("cpu"), seed=1, cut=cut)
        env.close()
        assert cut == [want], (limit, score, length)
        assert (length < limit and score == -21.0) if not want else limit - 2 <= length <= limit  # the reset's FIRE, 2


def test_an_earlier_evaluations_videos_and_traces_are_not_replaced(tmp_path, model_dir):
    """Video and trace names hold the env, the model and the game number, not the seed: a second evaluation into the
    same folders replaced the first one's files without a word. Refused in one line before any game."""
    (tmp_path / "videos").mkdir()
    video = tmp_path / "videos" / "PongNoFrameskip-v4_game000.mp4"
    video.write_bytes(b"an earlier game")
    line = bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir), "--record", str(tmp_path / "videos"))
    assert line == (f"gym_eval.py: error: '{video}' exists, an earlier evaluation's, and this one would replace it: "
                    f"move it away, or pass another --record DIR")
    (tmp_path / "traces").mkdir()
    for g in (0, 1):
        (tmp_path / "traces" / f"PongNoFrameskip-v4_game{g:03d}.csv").write_text("step\n")
    line = bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir), "--num-episodes", "2", "--trace",
                    str(tmp_path / "traces"))
    assert line == (f"gym_eval.py: error: '{tmp_path / 'traces' / 'PongNoFrameskip-v4_game000.csv'}' (and 1 more) "
                    f"exists, an earlier evaluation's, and this one would replace it: move it away, or pass another "
                    f"--trace DIR")
    assert video.read_bytes() == b"an earlier game"


@pytest.mark.parametrize("flag", ["--record"])  # --trace, --log-dir and --json's folders: the same validate_dir
def test_a_dangling_link_for_an_output_folder_names_its_flag(tmp_path, model_dir, flag):
    """A link to nothing where the folder would be made (mkdir fails with File exists): one line naming the flag.
    Before, it was reported as the game log's ("cannot open the game log ... pass --log-dir")."""
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    r = run_entry("gym_eval.py", *SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(tmp_path / "logs"),
                  flag, str(tmp_path / "gone"), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == (f"gym_eval.py: error: {flag} '{tmp_path / 'gone'}': '{tmp_path / 'gone'}' "
                                              f"is a link to '{tmp_path / 'nowhere'}', which does not exist: make "
                                              f"that folder, or pick another\n"), r.stderr


def test_bad_inputs(tmp_path, model_dir):
    assert "does not exist" in bad_eval(tmp_path, "--load-model-dir", str(tmp_path / "nowhere"))
    line = bad_eval(tmp_path, "--load-model-dir", str(model_dir))  # 32-unit file, default --hidden-size 512
    assert "lstm.weight_ih has shape (128, 1024) in the file, the model needs (2048, 1024)" in line
    assert "did you mean" in bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir), "--env", "Pong-v9")
    assert "--num-episodes must be >= 1" in bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir),
                                                     "--num-episodes", "0")
    assert "--record DIR" in bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir), "--new-gym-eval")
    line = bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir), "--render",
                    env_extra={"DISPLAY": "", "WAYLAND_DISPLAY": ""})
    assert "needs a display" in line
    (tmp_path / "afile").write_text("x")
    assert "--trace '" in bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir), "--trace",
                                   str(tmp_path / "afile"))
    assert (tmp_path / "afile").read_text() == "x"
    no_model = [*SHORT[2:], "--random-actions"]  # SHORT without --hidden-size, which random actions refuse
    assert "--random-actions plays without a model: drop --model-file" in bad_eval(
        tmp_path, *no_model, "--model-file", str(model_dir / "PongNoFrameskip-v4.dat"))
    assert "plays without a model: drop --precision" in bad_eval(tmp_path, *no_model, "--precision", "bf16")
    assert "plays without a model: drop --gpu-id" in bad_eval(tmp_path, *no_model, "--gpu-id", "0")
    assert "plays without a model: drop --load-model-dir" in bad_eval(tmp_path, *no_model, "--load-model-dir",
                                                                      str(model_dir))
    assert "plays without a model: drop --hidden-size" in bad_eval(tmp_path, *no_model, "--hidden-size", "32")
    assert "drop --trace or --random-actions" in bad_eval(tmp_path, *no_model, "--trace", str(tmp_path / "traces"))
    assert not (tmp_path / "traces").exists()
    assert bad_eval(tmp_path, *no_model, "--seed", "-5") == (
        "gym_eval.py: error: --seed must be between 0 and 4294967295, got -5")
    assert bad_eval(tmp_path, *no_model, "--seed", "4294967290", "--num-episodes", "10") == (
        "gym_eval.py: error: --seed 4294967290 + --num-episodes 10: game i is seeded with seed + i, which must stay "
        "below 4294967296: pass a smaller --seed")
    assert bad_eval(tmp_path, *no_model, "--render", "--record", str(tmp_path / "videos"),
                    env_extra={"DISPLAY": ":0"}) == (
        "gym_eval.py: error: --render shows the games in a window and --record writes them to files: use one of them")
    assert not (tmp_path / "videos").exists()


@pytest.mark.parametrize("flags, message", [
    (["--json", "{tmp}"], "--json '{tmp}' is a folder: give a file name"),
    (["--json", "/proc/eval.json"], "--json '/proc/eval.json': its folder '/proc' cannot be written: pick a folder "
                                    "you can write to"),
    (["--log-dir", "/proc/a3g-logs"], "--log-dir '/proc/a3g-logs' cannot be written ('/proc', where it would be "
                                      "created): pick a folder you can write to"),
    (["--record", "{tmp}/afile/videos"], "--record '{tmp}/afile/videos': '{tmp}/afile' is a file, not a folder"),
    (["--model-file", "{tmp}/a_folder"], "model file {tmp}/a_folder is a folder, not a model file")])
def test_outputs_and_model_paths_are_checked_before_any_game(tmp_path, model_dir, flags, message):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "a_folder").mkdir()
    flags = [f.format(tmp=tmp_path) for f in flags]
    line = bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir), "--hidden-size", "32", *flags)
    assert line == f"gym_eval.py: error: {message.format(tmp=tmp_path)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_folder", "afile", "models"]  # no game, no log


@pytest.mark.parametrize("flag", ["--model-file", "--json"])
def test_a_path_below_a_folder_that_cannot_be_entered(tmp_path, model_dir, monkeypatch, capsys, flag):
    """A model file or --json below a folder this user may not enter (``Path.exists`` raises PermissionError there):
    one line and exit 2, no game; before, a PermissionError traceback."""
    import gym_eval
    private = tmp_path / "private"
    private.mkdir()
    target = private / "inner" / "m.dat"
    deny_below(monkeypatch, private)
    code = gym_eval.main([*SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(tmp_path / "logs"), flag,
                          str(target)])
    assert code == 2
    want = (f"'{target}' cannot be read (Permission denied): pick folders this user can read and write"
            if flag == "--model-file" else
            f"--json '{target}' cannot be reached (Permission denied): pick a folder you can write to")
    assert capsys.readouterr().err.strip().splitlines() == [f"gym_eval.py: error: {want}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "private"]


@pytest.mark.parametrize("name, message", [
    ("PongNoFrameskip-v4_eval.json", "'{logs}/PongNoFrameskip-v4_eval.json' is a folder, where the summary JSON would "
                                     "be written: move it away, or pass --json PATH"),
    ("PongNoFrameskip-v4_mon_log", "'{logs}/PongNoFrameskip-v4_mon_log' is a folder, where the games would be logged: "
                                   "move it away, or pass --log-dir DIR")])
def test_a_folder_in_place_of_a_default_output_is_refused_before_any_game(tmp_path, model_dir, name, message):
    logs = tmp_path / "logs"
    (logs / name).mkdir(parents=True)
    r = run_entry("gym_eval.py", *SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(logs),
                  "--num-episodes", "1", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr == f"gym_eval.py: error: {message.format(logs=logs)}\n"
    assert [p.name for p in logs.iterdir()] == [name]  # no game played, nothing logged


def test_outputs_that_would_replace_inputs_or_land_on_folders_are_refused_before_any_game(tmp_path, model_dir):
    """--json naming the model, its card or the game log would replace it; a folder where --trace or --record
    writes a game's file would fail after the games: each refused in one line, nothing touched."""
    model = model_dir / "PongNoFrameskip-v4.dat"
    card = model.with_suffix(".json")
    card.write_text("{}")
    before = model.read_bytes()
    logs = tmp_path / "game-logs"  # not bad_eval's "logs", which it checks is never made
    logs.mkdir()
    (logs / "PongNoFrameskip-v4_mon_log").write_text("earlier games\n")
    common = [*SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(logs), "--num-episodes", "3"]
    for target in (model, card, logs / "PongNoFrameskip-v4_mon_log"):
        assert bad_eval(tmp_path, *common, "--json", str(target)) == (
            f"gym_eval.py: error: --json {target} is {target}, which the summary would replace: pass another --json "
            "PATH")
    assert model.read_bytes() == before and card.read_text() == "{}"
    assert (logs / "PongNoFrameskip-v4_mon_log").read_text() == "earlier games\n"
    # any other file that is not an earlier summary: another model's card, a results file a card cites, a config
    # (before, only the three above were protected, and these were replaced with exit 0)
    others = {"other card": ('{"model_file": "BreakoutNoFrameskip-v4.dat"}', "BreakoutNoFrameskip-v4.json"),
              "another model": ("not JSON", "BreakoutNoFrameskip-v4.dat"),
              "a JSON with scores but no protocol": ('{"env": "PongNoFrameskip-v4", "scores": [21.0]}', "cited.json")}
    for text, name in others.values():
        target = model_dir / name
        target.write_text(text)
        for flags in (common, [*SHORT[2:], "--log-dir", str(logs), "--num-episodes", "3", "--random-actions"]):
            assert bad_eval(tmp_path, *flags, "--json", str(target)) == (
                f"gym_eval.py: error: --json {target} exists and is not a gym_eval.py summary, which this one would "
                "replace: pass another --json PATH, or move that file away")
        assert target.read_text() == text
    (tmp_path / "traces" / "PongNoFrameskip-v4_game001.csv").mkdir(parents=True)
    (tmp_path / "traces" / "PongNoFrameskip-v4_game002.csv").mkdir()
    assert bad_eval(tmp_path, *common, "--trace", str(tmp_path / "traces")) == (
        f"gym_eval.py: error: '{tmp_path}/traces/PongNoFrameskip-v4_game001.csv' (and 1 more) is a folder, where "
        f"--trace would write a game's file: move it away, or pass another --trace DIR")
    (tmp_path / "videos" / "PongNoFrameskip-v4_game001.mp4").mkdir(parents=True)  # not recorded: --render-freq 2
    (tmp_path / "videos" / "PongNoFrameskip-v4_game002.mp4").mkdir()
    assert bad_eval(tmp_path, *common, "--record", str(tmp_path / "videos"), "--render-freq", "2") == (
        f"gym_eval.py: error: '{tmp_path}/videos/PongNoFrameskip-v4_game002.mp4' is a folder, where --record would "
        f"write a game's file: move it away, or pass another --record DIR")
    assert sorted(p.name for p in logs.iterdir()) == ["PongNoFrameskip-v4_mon_log"]


@pytest.mark.parametrize("card,problem", [
    ({"evaluations": None}, "its 'evaluations' is not a list of objects"),
    ({"evaluations": [{"env": "PongNoFrameskip-v4", "episodes": 100, "mean": 10 ** 400, "std": 1.0, "source": "x",
                       "protocol": {}}]}, "evaluation 1: 'mean' is not a finite number"),
    ({"evaluations": [{"env": "PongNoFrameskip-v4", "episodes": True, "std": 1.0, "source": "x", "protocol": {},
                       "first_seed": "1"}]},
     "evaluation 1: 'episodes' is not a whole number >= 1, 'mean' is missing, 'first_seed' is not a whole number"),
    ("[" * 100000, "is not JSON that can be read (nested too deeply)"),
    ('{"model_file": ', "is not JSON (Expecting value")])
def test_a_card_gym_eval_could_not_compare_with_is_refused_before_any_game(tmp_path, model_dir, card, problem):
    """A hand-edited card beside the model: before, one whose evaluations were not a list was named only after
    every game (exit 0), a mean too large for a float ended the run after its games with a traceback and no
    summary, and a card nested too deeply ended it with a traceback before any. Now each is one line and exit 2
    before any game, the card and the model as they were."""
    path = model_dir / "PongNoFrameskip-v4.json"
    text = card if isinstance(card, str) else json.dumps({"model_file": "PongNoFrameskip-v4.dat",
                                                          "env": "PongNoFrameskip-v4", **card})
    path.write_text(text)
    line = bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir), "--num-episodes", "1")
    assert line.startswith(f"gym_eval.py: error: card {path}") and problem in line, line
    assert line.endswith(": fix the card, or move it away to evaluate without it")
    assert path.read_text() == text and not (tmp_path / "PongNoFrameskip-v4_eval.json").exists()


def test_a_renamed_copy_keeps_its_card(tmp_path, model_dir):
    """A card is matched to its model by sha256 as well as by name: a copy renamed with its card (``mine.dat``,
    ``mine.json``) still gets the card line and the card's see_skipped_frames. Before, the card was dropped without
    a word, and a model trained on the max over the skipped frames played without it."""
    import hashlib
    model = model_dir / "PongNoFrameskip-v4.dat"
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    from environment import protocol
    proto = json.loads(json.dumps(protocol("Pong-v0", max_episode_length=60, skip_rate=4, episodic_life=False,
                                           see_skipped=True)))
    card = {"model_file": "PongNoFrameskip-v4.dat", "sha256": digest, "env": "Pong-v0", "see_skipped_frames": True,
            "evaluations": [{"env": "Pong-v0", "episodes": 100, "first_seed": 1, "mean": -20.0, "std": 1.0,
                             "source": "results/x.json", "precision": "fp32", "protocol": proto}]}
    model.rename(model_dir / "mine.dat")
    (model_dir / "mine.json").write_text(json.dumps(card))
    out, r = evaluate(tmp_path, model_dir, "renamed", "--env", "Pong-v0", "--model-file", "mine", "--num-episodes",
                      "1")
    assert out["protocol"]["max_over_frames"] == 3 and out["protocol"] == proto
    assert out["card"]["same_file"] and out["card"]["line"].startswith(
        "card: Pong-v0 100 games -20.00 ± 1.00 (results/x.json); this run: 1 games")


def test_a_summary_that_cannot_be_written_leaves_the_old_one_whole(tmp_path, monkeypatch, capsys):
    """The disk fills while the JSON is written: one line, exit 1, the previous JSON as it was, no temporary file."""
    import errno
    import gym_eval
    out = tmp_path / "out" / "keep.json"
    out.parent.mkdir()
    out.write_text(EARLIER_SUMMARY)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gym_eval.os, "fsync", full)
    code = gym_eval.main([*SHORT[2:], "--random-actions", "--num-episodes", "2", "--log-dir", str(tmp_path / "logs"),
                          "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 1 and captured.err == (
        f"gym_eval.py: error: the summary could not be written to {out} (No space left on device); the lines above "
        "are this run's result: free space or pass --json PATH somewhere writable, and run again\n")
    assert "2 games, mean" in captured.out
    assert out.read_text() == EARLIER_SUMMARY and [p.name for p in out.parent.iterdir()] == ["keep.json"]


def test_a_summary_json_that_is_a_link_is_written_through_it(tmp_path, capsys):
    """--json naming a symbolic link: its target gets the summary, and the link stays a link."""
    import gym_eval
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text(EARLIER_SUMMARY)
    link.symlink_to(real)
    assert gym_eval.main([*SHORT[2:], "--random-actions", "--num-episodes", "1", "--log-dir", str(tmp_path / "logs"),
                          "--json", str(link)]) == 0
    assert link.is_symlink() and json.loads(real.read_text())["episodes"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "logs", "real.json"]


def test_an_evaluation_process_killed_mid_run_ends_it_in_one_line(tmp_path):
    """kill -9 of one of two evaluation processes: one line naming it, exit 1, no process left, no JSON."""
    import psutil
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "gym_eval.py"), *SHORT[2:], "--random-actions", "--workers",
                             "2", "--num-episodes", "40", "--max-episode-length", "2000", "--log-dir",
                             str(tmp_path / "logs"), "--json", str(tmp_path / "out.json")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("game "):
                break
        victim = next(c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())
                      or "a3g eval" in " ".join(c.cmdline()))  # a player, not multiprocessing's resource tracker
        victim.kill()
        out, err = proc.communicate(timeout=120)
        left = processes_left(proc.pid)
    finally:
        kill_session(proc)
    lines = err.splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith("gym_eval.py: error: an evaluation process ended with exit code -9 after ")
    assert lines[0].endswith(f" of 40 games; nothing was summarised (the games played are in "
                             f"{tmp_path / 'logs' / 'PongNoFrameskip-v4_random_mon_log'}): run the evaluation again")
    assert not (tmp_path / "out.json").exists() and not left, left


class FakeScreen:
    """An env stand-in for ``VideoWriter``: ``render()`` gives a fixed RGB frame."""

    @staticmethod
    def render():
        import numpy as np
        return np.full((16, 16, 3), 128, dtype=np.uint8)


def test_a_video_appears_under_its_name_only_when_its_game_has_ended(tmp_path):
    """Frames go to a hidden partial file; ``close(finished=True)`` renames it into place, a plain ``close`` (a game
    cut short) removes it, and an earlier complete video of that name stays as it was."""
    from gym_eval import VideoWriter
    final = tmp_path / "PongNoFrameskip-v4_game000.mp4"
    writer = VideoWriter(final, 15.0)
    for _ in range(3):
        writer(FakeScreen)
    assert not final.exists()  # ffmpeg writes partial_video(final) (once its encoder has output)
    writer.close(finished=True)
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
    complete = final.read_bytes()
    writer = VideoWriter(final, 15.0)
    writer(FakeScreen)
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == [final.name] and final.read_bytes() == complete


def test_ctrl_c_while_two_processes_record_leaves_no_video_of_an_unfinished_game(tmp_path, model_dir):
    """SIGINT to the process group while both evaluation processes record their first game (whose partial videos
    are on disk): exit 130 in one line from gym_eval.py, no partial file, no process, and under a video's name only
    a game that had ended before the signal (on a busy machine one may: its frames are that game's whole length)."""
    import imageio_ffmpeg
    import gym_eval
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    videos = tmp_path / "videos"
    flags = [*SHORT[:2], "--env-config", str(ROOT / "config.json"), "--load-model-dir", str(model_dir),
             "--num-episodes", "2", "--max-episode-length", "5000", "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen([sys.executable, str(ROOT / "gym_eval.py"), *flags, "--workers", "2", "--record",
                             str(videos)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + START_SECONDS
        while len(list(videos.glob(".*.partial.mp4"))) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert len(list(videos.glob(".*.partial.mp4"))) == 2, "the two games' partial videos never appeared"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        left = processes_left(proc.pid)
    finally:
        kill_session(proc)
    assert proc.returncode == 130 and re.fullmatch(r"gym_eval\.py: interrupted after [01] of 2 games\n", err), err
    finished = sorted(videos.iterdir())
    assert not left and len(finished) < 2 and all(v.name.startswith("PongNoFrameskip-v4_game") for v in finished), \
        (finished, left)
    lengths = {}
    args = gym_eval.build_parser().parse_args(flags)
    gym_eval.play_games(args, torch.load(model_dir / "PongNoFrameskip-v4.dat"), [int(v.stem[-3:]) for v in finished],
                        torch.device("cpu"), type("Collect", (), {"put": staticmethod(
                            lambda item: lengths.update({item[0]: item[2]}))}))
    for v in finished:
        assert imageio_ffmpeg.count_frames_and_secs(str(v))[0] == lengths[int(v.stem[-3:])] + 1, v


def test_a_failed_write_during_the_games_is_one_line_in_either_process_layout(tmp_path, model_dir):
    """A trace that cannot be written (``/dev/full`` in its temporary file's place: the disk is full): one line,
    exit 1, with one evaluation process as with two, and no temporary file left."""
    for workers in ("1", "2"):
        traces = tmp_path / f"traces{workers}"
        traces.mkdir()
        (traces / "PongNoFrameskip-v4_game000.csv.tmp").symlink_to("/dev/full")
        r = run_entry("gym_eval.py", *SHORT, "--load-model-dir", str(model_dir), "--num-episodes", "1",
                      "--max-episode-length", "20", "--workers", workers, "--trace", str(traces),
                      "--log-dir", str(tmp_path / "logs"), cwd=tmp_path)
        lines = r.stderr.splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert "failed: OSError(28, 'No space left on device') after 0 of 1 games; nothing was summarised" in lines[0]
        assert list(traces.iterdir()) == [], list(traces.iterdir())


def interrupted_while_importing(tmp_path, module: str, script: str, *args: str) -> tuple[int, str]:
    """Run ``script`` with a stand-in for ``module`` that prints ``importing`` and waits; send SIGINT once it
    printed that; ``(exit code, stderr)``."""
    fake = tmp_path / "fake" / module
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import time\nprint('importing', flush=True)\ntime.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "importing":
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_gym_eval_ctrl_c_before_the_first_game_exits_130_in_one_line(tmp_path, model_dir):
    """SIGINT while gym_eval.py sets up (its progress-bar library waits): one line, exit 130, no traceback."""
    assert interrupted_while_importing(tmp_path, "tqdm", "gym_eval.py", *SHORT, "--load-model-dir", str(model_dir),
                                       "--log-dir", str(tmp_path / "logs"), "--num-episodes", "1") == (
        130, "gym_eval.py: interrupted\n")


def test_plot_max_steps_draws_each_curve_up_to_the_budget(tmp_path, monkeypatch, capsys):
    import plot
    rows = ["wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean"]
    rows += [f"{1e9 + i},{10.0 * i},{steps},{score},100,1.0,0,"
             for i, (steps, score) in enumerate([(100, -21), (900, -20), (800, -19), (2000, 5), (3000, 21)])]
    csv = tmp_path / "a_monitor.csv"
    csv.write_text("\n".join(rows) + "\n")
    drawn = []
    real = plot.rolling_mean
    monkeypatch.setattr(plot, "rolling_mean", lambda values, window: drawn.append(list(values)) or real(values, window))
    out = str(tmp_path / "a.png")
    assert plot.main([str(csv), "--out", out, "--max-steps", "1000"]) == 0
    assert drawn == [[-21.0, -19.0]]  # the games at or before 1,000 steps; the one at 900 superseded by a resume
    assert "1 game(s) left out, after which the global steps go back" in capsys.readouterr().err
    assert plot.main([str(csv), "--out", out, "--max-steps", "99"]) == 2
    assert "has no game at or before --max-steps 99" in capsys.readouterr().err
    assert plot.main([str(csv), "--out", out, "--max-steps", "0"]) == 2
    assert "--max-steps must be >= 1, got 0" in capsys.readouterr().err


def test_every_steps_keeps_the_games_a_sparser_monitor_would_have_played(tmp_path, capsys):
    """--every-steps N: the first game, then each first game ending N global steps after the last one kept; the
    time-to-score table is taken over those games only."""
    import plot
    curve = {"steps": [1000, 50000, 90000, 201000, 210000, 400000, 401000], "score": [-21, -20, 5, 19, 20, 21, 21],
             "hours": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]}
    thinned = plot.thin_games(curve, 200000)
    # 1,000 kept; 50,000 and 90,000 too soon; 201,000 exactly 200,000 after it; 210,000 too soon; 400,000 is
    # 199,000 after 201,000 (not kept); 401,000 is 200,000 after it
    assert thinned == {"steps": [1000, 201000, 401000], "score": [-21, 19, 21], "hours": [0.1, 0.4, 0.7]}
    assert plot.thin_games(curve, 1) == curve
    rows = [HEADER] + [f"{1e9 + i},{3600 * h},{s},{v},100,1.0,0," for i, (s, v, h) in
                       enumerate(zip(curve["steps"], curve["score"], curve["hours"]))]
    csv = tmp_path / "a_monitor.csv"
    csv.write_text("\n".join(rows) + "\n")
    assert plot.main([str(csv), "--no-figure", "--window", "2", "--levels", "20"]) == 0
    assert "400k / 36 min" in capsys.readouterr().out  # every game: 20 and 21 make 20.5 at 400,000 steps
    assert plot.main([str(csv), "--no-figure", "--window", "2", "--levels", "20", "--every-steps", "200000"]) == 0
    out = capsys.readouterr().out
    assert "401k / 42 min" in out and "400k" not in out  # the kept 19 and 21 make 20 at the third kept game
    assert plot.main([str(csv), "--no-figure", "--every-steps", "0"]) == 2
    assert "--every-steps must be >= 1, got 0" in capsys.readouterr().err


def test_plot_bad_input(tmp_path):
    r = run_entry("plot.py", str(tmp_path / "missing"), "--out", str(tmp_path / "x.png"), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("plot.py: error: '")


def test_a_failed_figure_write_leaves_the_old_figure_and_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """The figure is written to a temporary file and renamed into place: a full disk leaves the earlier figure
    as it was, no temporary file, and one line (exit 1). A folder named like a monitor CSV inside an input folder
    is not taken for one."""
    import plot
    csv = tmp_path / "runs" / "a_monitor.csv"
    csv.parent.mkdir()
    csv.write_text(HEADER + "\n1e9,10.0,1000,-21,100,1.0,0,\n1e9,20.0,2000,-20,100,1.0,0,\n")
    (tmp_path / "runs" / "b_monitor.csv").mkdir()
    out = tmp_path / "figs" / "a.png"
    assert plot.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    before = out.read_bytes()
    import matplotlib.figure

    def disk_full(self, fname, **kw):
        Path(fname).write_bytes(b"half a png")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", disk_full)
    assert plot.main([str(csv), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == f"plot.py: error: could not write {out}: the disk is full; free space or pass --out in another folder\n"
    assert out.read_bytes() == before and sorted(p.name for p in out.parent.iterdir()) == ["a.png"]


HEADER = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean"


@pytest.mark.parametrize("bad, line", [("1e9,30.0,3000,abc,100,1.0,0,", 4), ("1e9,30.0,3000,5,100,1.0,0,,7", 4),
                                       ("1e9,30.0,,5,100,1.0,0,", 4)])
def test_plot_names_the_line_of_a_broken_row(tmp_path, bad, line):
    rows = [HEADER, "1e9,10.0,1000,-21,100,1.0,0,", "1e9,20.0,2000,-20,100,1.0,0,", bad,
            "1e9,40.0,4000,-19,100,1.0,0,"]
    (tmp_path / "a_monitor.csv").write_text("\n".join(rows) + "\n")
    r = run_entry("plot.py", str(tmp_path / "a_monitor.csv"), "--no-figure", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"plot.py: error: {tmp_path / 'a_monitor.csv'} line {line} is not a monitor CSV row "
                                f"(global_steps, score and elapsed_s as numbers, one value per column)")


@pytest.mark.parametrize("flags, message", [
    (["--out", "{tmp}"], "--out must end in .png, .svg or .pdf, got '{tmp}'"),
    (["--out", "{tmp}/a.png"], "--out '{tmp}/a.png' is a folder: give a file name"),
    (["--out", "/proc/curves.png"], "--out '/proc/curves.png': its folder '/proc' cannot be written: pick a folder "
                                    "you can write to"),
    # a link to nothing as its folder: before, the table was printed, then "could not write ...: File exists", exit 1
    (["--out", "{tmp}/gone/x.png"], "--out '{tmp}/gone/x.png': its folder '{tmp}/gone': '{tmp}/gone' is a link to "
                                    "'{tmp}/nowhere', which does not exist: make that folder, or pick another"),
    (["--levels", "0", "nan"], "--levels must be finite numbers, got nan")])
def test_plot_checks_its_outputs_and_levels_before_reading(tmp_path, flags, message):
    (tmp_path / "a.png").mkdir()
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "a_monitor.csv").write_text(HEADER + "\n1e9,10.0,1000,-21,100,1.0,0,\n")
    r = run_entry("plot.py", str(tmp_path / "a_monitor.csv"), *[f.format(tmp=tmp_path) for f in flags], cwd=tmp_path)
    assert r.returncode == 2 and not r.stdout
    assert r.stderr == f"plot.py: error: {message.format(tmp=tmp_path)}\n"


@pytest.mark.parametrize("content, why", [
    (HEADER + "\n1e9,10.0,1000,-21,100,1.0,0,\n1e9,20.0,2000,nan,100,1.0,0,\n", "line 3 is not a monitor CSV row"),
    (HEADER + "\n1e9,10.0,1000,-21,100,1.0,0,\n1e9,inf,2000,-20,100,1.0,0,\n", "line 3 is not a monitor CSV row"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "is not a monitor CSV ('utf-8' codec can't decode byte 0x89"),
    (HEADER + "\n1e9,10.0,1000," + "1" * 200000 + ",100,1.0,0,\n", "is not a monitor CSV (field larger than field limit")],
    ids=["nan score", "inf time", "binary", "overlong field"])
def test_plot_refuses_a_file_that_is_not_a_clean_monitor_csv_in_one_line(tmp_path, content, why):
    """Not-a-number scores, a binary file, an overlong field: one line naming the file, not a table of dashes or a
    traceback."""
    path = tmp_path / "a_monitor.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    r = run_entry("plot.py", str(path), "--no-figure", cwd=tmp_path)
    assert r.returncode == 2 and not r.stdout and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"plot.py: error: {path} {why}")


def test_plot_checks_its_default_output_before_drawing(tmp_path):
    (tmp_path / "a_monitor.csv").write_text(HEADER + "\n1e9,10.0,1000,-21,100,1.0,0,\n")
    (tmp_path / "runs" / "a_curves.png").mkdir(parents=True)
    r = run_entry("plot.py", str(tmp_path / "a_monitor.csv"), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == ("plot.py: error: 'runs/a_curves.png', where the figure goes by default, "
                                              "is a folder: move it away or pass --out PATH\n")
    (tmp_path / "runs" / "a_curves.png").rmdir()
    (tmp_path / "runs").rmdir()
    (tmp_path / "runs").write_text("a file")
    r = run_entry("plot.py", str(tmp_path / "a_monitor.csv"), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == ("plot.py: error: the figure's default folder 'runs' is a file, not a "
                                              "folder; or pass --out PATH\n")
    # named after the curves drawn: not after a CSV skipped for having no games yet
    (tmp_path / "runs").unlink()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "Aaa_monitor.csv").write_text(HEADER + "\n")
    r = run_entry("plot.py", str(tmp_path / "b" / "Aaa_monitor.csv"), str(tmp_path / "a_monitor.csv"), cwd=tmp_path)
    assert r.returncode == 0 and "wrote runs/a_curves.png" in r.stdout, r.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a_curves.png"]


def test_plot_ctrl_c_while_drawing_exits_130_in_one_line(tmp_path):
    """SIGINT while plot.py imports its drawing library (a stand-in that waits): one line, exit 130."""
    (tmp_path / "a_monitor.csv").write_text(HEADER + "\n1e9,10.0,1000,-21,100,1.0,0,\n")
    assert interrupted_while_importing(tmp_path, "matplotlib", "plot.py", str(tmp_path / "a_monitor.csv"), "--out",
                                       str(tmp_path / "a.png")) == (130, "plot.py: interrupted\n")


def test_a_row_cut_short_is_left_out_and_the_resumed_monitor_starts_a_new_line(tmp_path):
    """A run killed while the monitor wrote a row leaves it cut short; the resumed run's monitor ends that line
    before its own rows, and plot.py leaves the cut row out (with a warning) instead of reading '2' as a score."""
    from test import CSV_FIELDS, open_csv
    path = tmp_path / "PongNoFrameskip-v4_monitor.csv"
    f, writer = open_csv(path)
    writer.writerow([1e9, 10.0, 1000, -21.0, 100, 1.0, 0, ""])
    writer.writerow([1e9, 20.0, 2000, -20.0, 100, 1.0, 0, ""])
    f.close()
    with open(path, "a") as cut:
        cut.write("1000000000.0,30.0,3000,2")  # cut inside the score (-20): 4 of 8 fields
    f, writer = open_csv(path)
    writer.writerow([1e9, 40.0, 4000, 5.0, 100, 1.0, 0, ""])
    f.close()
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(CSV_FIELDS) and lines[3] == "1000000000.0,30.0,3000,2" and len(lines) == 5
    r = run_entry("plot.py", str(path), "--no-figure", "--window", "1", "--levels", "2", "5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"{path} line 4: cut short" in r.stderr
    row = r.stdout.splitlines()[2].split()
    assert row[1:] == ["4k", "/", "1", "min"] * 2  # 2 and 5 reached at 4,000 steps: the cut '2' was never a score


@pytest.mark.parametrize("cut", ["2023-11-14 22:15:00, 2", "2023-11-14 22:15:00, 2, 16"])
def test_a_results_txt_line_cut_short_is_left_out_and_the_next_writer_drops_it(tmp_path, cut):
    """GA3C's results.txt, cut inside a line by a kill (or a full disk): plot.py leaves the unended last line out
    with a warning, and the next run's ``ResultsWriter`` drops it before its own line. Cut inside the game length
    (16 of 1654), the line parsed as a game of 16 steps once a writer had ended it: every later step count was
    short (before, the writer ended the line)."""
    from ga3c.stats import Episode, ResultsWriter
    path = tmp_path / "logs" / "results.txt"
    with ResultsWriter(path) as w:
        w.write(Episode(1_700_000_000.0, -21.0, 1000))
    with open(path, "a") as f:
        f.write(cut)
    r = run_entry("plot.py", str(path), "--no-figure", "--window", "1", "--levels", "2", cwd=tmp_path)
    assert r.returncode == 0 and f"{path} line 2: cut short" in r.stderr, r.stderr
    with ResultsWriter(path) as w:
        w.write(Episode(1_700_000_120.0, 5.0, 3000))
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith(", -21, 1000") and lines[1].endswith(", 5, 3000"), lines
    r = run_entry("plot.py", str(path), "--no-figure", "--window", "1", "--levels", "2", "5", cwd=tmp_path)
    assert r.returncode == 0 and "cut short" not in r.stderr, r.stderr
    row = r.stdout.splitlines()[2].split()
    assert row[1:] == ["4k", "/", "2", "min"] * 2  # 5 at 4,000 steps: the cut line was never a game


def test_a_run_without_a_game_yet_is_skipped_whatever_it_left(tmp_path, capsys):
    """A GA3C results.txt that is still empty (created at the start) and a monitor CSV of 0 bytes (a kill or a
    full disk before its header) are runs without a game yet: skipped with a warning beside a run that has games,
    one error line alone."""
    import plot
    good = tmp_path / "a" / "PongNoFrameskip-v4_monitor.csv"
    good.parent.mkdir()
    good.write_text("wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
                    "1e9,10.0,1000,3.0,100,1.0,3.0,\n")
    empty_csv = tmp_path / "b" / "PongNoFrameskip-v4_monitor.csv"
    empty_txt = tmp_path / "c" / "results.txt"
    for f in (empty_csv, empty_txt):
        f.parent.mkdir()
        f.write_text("")
    assert plot.main([str(tmp_path), "--no-figure", "--window", "1", "--levels", "3"]) == 0  # the folder scan
    err = capsys.readouterr().err
    assert f"{empty_csv} has no games yet" in err and err.count("\n") == 1, err
    assert plot.main([str(good), str(empty_txt), "--no-figure", "--window", "1", "--levels", "3"]) == 0
    err = capsys.readouterr().err
    assert f"{empty_txt} has no games yet" in err and err.count("\n") == 1, err
    for alone in (empty_csv, empty_txt):
        assert plot.main([str(alone), "--no-figure"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has no games yet" in err, err


def render_one_game(tmp_path, model_dir, env_extra):
    r = run_entry("gym_eval.py", *SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(tmp_path / "logs"),
                  "--num-episodes", "1", "--render", cwd=tmp_path, env_extra=env_extra)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 games, mean" in r.stdout


@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="needs Xvfb for a virtual display")
def test_render_opens_a_window_on_a_virtual_display(tmp_path, model_dir):
    display = ":87"
    xvfb = subprocess.Popen(["Xvfb", display, "-screen", "0", "640x480x24"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        render_one_game(tmp_path, model_dir, {"DISPLAY": display})
    finally:
        xvfb.terminate()
        xvfb.wait(10)


def test_render_plays_a_game_through_sdls_dummy_video_driver(tmp_path, model_dir):
    """Runs anywhere, CI included (no X server): the games are made with render_mode "human" and ALE draws every
    frame through SDL, whose dummy driver shows nothing."""
    render_one_game(tmp_path, model_dir, {"DISPLAY": ":87", "SDL_VIDEODRIVER": "dummy"})


def test_the_shipped_pong_model_loads_and_wins_a_seeded_game(shipped_pong_game):
    _, summary = shipped_pong_game
    assert summary["model"] == str(ROOT / "trained_models" / "PongNoFrameskip-v4.dat") and summary["seed"] == 1
    assert summary["episodes"] == 1 and summary["scores"][0] == 21  # it wins all 100 published games 21-0
    assert summary["precision"] == "fp32"  # the default: scores comparable across machines


def test_points_lost_by_hand():
    from gym_eval import points_lost, points_line
    assert points_lost([[[10, 1.0]], [], [[5, 2.0], [9, 1.0]]]) is None  # no negative reward
    games = [[[57, -1.0], [300, 1.0], [700, 1.0]],  # first point lost
             [[60, 1.0], [200, -1.0], [250, -2.0]],  # two later losses, 3 points
             [[80, 1.0]],
             [[62, -1.0]]]  # first point lost
    lost = points_lost(games)
    assert lost == {"points": 5.0, "games": 3, "first_point": 2, "first_point_steps": [57, 62]}
    assert points_line(lost, 4) == ("points given away: 5 in 3 of 4 games; the game's first point in 2 of them "
                                    "(agent steps 57-62)")
    assert points_line(points_lost([[[3, 1.0], [9, -1.0]]]), 1) == "points given away: 1 in 1 of 1 games"


def test_time_to_score_levels_by_hand():
    from plot import first_reached, median_reached
    score = [-21, -21, 0, 21, 21, 21]  # window 2 means: -21, -10.5, 10.5, 21, 21
    steps = [10, 20, 30, 40, 50, 60]
    secs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    got = first_reached(score, steps, secs, [-21, -10, 10, 20, 21.5], window=2)
    assert got == {-21: (20, 2.0), -10: (40, 4.0), 10: (40, 4.0), 20: (50, 5.0), 21.5: None}
    assert first_reached([5.0], [1], [1.0], [0], window=2) == {0: None}  # no full window yet
    tenths = first_reached([0.1] * 10, list(range(1, 11)), [float(t) for t in range(1, 11)], [0.1], window=10)
    assert tenths == {0.1: (10, 10.0)}  # summed exactly: a running float sum ends at 0.9999999999999999

    def exact(steps, secs):
        return (steps, steps), (secs, secs)
    assert median_reached([(300, 30.0), (100, 10.0), (200, 20.0)]) == exact(200, 20.0)
    assert median_reached([(300, 30.0), None, (100, 10.0)]) == exact(300, 30.0)  # no last games: the slowest
    assert median_reached([(300, 30.0), None, None]) is None  # fewer than half reached it
    assert median_reached([(100, 10.0), (300, 30.0)]) == exact(200, 20.0)
    assert median_reached([(100, 10.0), (300, 30.0), None, None]) is None  # between a reached and a missed run
    assert median_reached([(100, 40.0), (300, 20.0), (200, 30.0)]) == exact(200, 30.0)  # each taken separately
    assert median_reached([]) is None
    # with each run's last game: a run that went on past the median without reaching the level cannot move it...
    assert median_reached([(300, 30.0), None, (100, 10.0)], [(300, 30.0), (400, 40.0), (100, 10.0)]) == \
        exact(300, 30.0)
    # ... one that stopped before it could: its steps put the median between 250 and 300; its time (45 s) cannot
    assert median_reached([(300, 30.0), None, (100, 10.0)], [(300, 30.0), (250, 45.0), (100, 10.0)]) == \
        ((250, 300), (30.0, 30.0))
    # two of three stopped early: at least the middle of (their last games, the one that reached it)
    assert median_reached([(300, 30.0), None, None], [(300, 30.0), (100, 10.0), (200, 20.0)]) == \
        ((200, math.inf), (20.0, math.inf))
    assert median_reached([None, None], [(100, 10.0), (200, 20.0)]) == ((150, math.inf), (15.0, math.inf))


def test_plot_prints_the_time_to_score_table_for_each_run_and_the_median(tmp_path):
    header = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
    for name, scores in (("a", [-21, -5, 5, 15]), ("b", [-21, -21, 20, 20]), ("c", [-21, -21, -21, -21])):
        rows = [f"0,{60 * (i + 1)},{1000 * (i + 1)},{s},100,1,0,\n" for i, s in enumerate(scores)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "PongNoFrameskip-v4_monitor.csv").write_text(header + "".join(rows))
    r = run_entry("plot.py", *(str(tmp_path / n) for n in "abc"), "--window", "2", "--levels", "0", "20",
                  "--no-figure", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()[2:]}
    # a: means -13, 0, 10 -> 0 at game 3; b: -21, -0.5, 20 -> 20 at game 4; c: never
    assert lines["a"].split()[1:] == ["3k", "/", "3", "min", "-"]
    assert lines["b"].split()[1:] == ["4k", "/", "4", "min", "4k", "/", "4", "min"]
    assert lines["c"].split()[1:] == ["-", "-"]
    # 0: a and b reached it, c (its last game at 4k) cannot move the median; 20: only b, the others stopped at 4k
    assert lines["median"].split()[3:] == ["4k", "/", "4", "min", "≥4k", "/", "≥4", "min"]
    assert not list(tmp_path.rglob("*.png"))


def test_plot_draws_full_windows_only_and_gives_no_median_over_two_games(tmp_path, monkeypatch, capsys):
    """The drawn mean starts at the first full window, as the table's does (before, a trained run's first game
    alone drew a mean the table said came much later); runs of two games get a line instead of a median (before,
    a median over Pong and Breakout runs); a label that begins with "_" stays in the legend; a missing input is
    one error line, not a second one about --labels."""
    import plot
    header = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
    for name, env in (("a", "PongNoFrameskip-v4"), ("_b", "BreakoutNoFrameskip-v4")):
        (tmp_path / name).mkdir()
        rows = [f"0,{60 * (i + 1)},{1000 * (i + 1)},{s},100,1,0,\n" for i, s in enumerate([20, 0, 10, 2])]
        (tmp_path / name / f"{env}_monitor.csv").write_text(header + "".join(rows))
    assert plot.rolling_mean([20.0, 0.0, 10.0, 2.0], 2)[1:] == [10.0, 5.0, 6.0]
    assert math.isnan(plot.rolling_mean([20.0, 0.0, 10.0, 2.0], 2)[0])
    legends = []
    import matplotlib.axes
    real_legend = matplotlib.axes.Axes.legend
    monkeypatch.setattr(matplotlib.axes.Axes, "legend", lambda self, *a, **k: legends.append(
        [t.get_text() for t in real_legend(self, *a, **k).get_texts()]))
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "_b"), "--window", "2", "--levels", "5",
                      "--out", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "no median row: the runs play 2 games (Breakout, Pong); give one game's runs for their median" in out
    assert not [line for line in out.splitlines() if line.startswith("median of")]
    assert plot.game_of("ALE_Pong-v5") == plot.game_of("PongNoFrameskip-v4") == plot.game_of("Pong-v0") == "Pong"
    assert plot.game_of("pong_ga3c_bf16_seed1") is None  # results/ copies: game unknown, medians as before
    assert legends == [["a (mean of 2)", "\u200b_b (mean of 2)"]]
    (tmp_path / "a" / "PongNoFrameskip-v4_monitor.csv").rename(tmp_path / "a" / "x.csv")
    assert plot.main([str(tmp_path / "a" / "PongNoFrameskip-v4_monitor.csv"), str(tmp_path / "_b"),
                      "--labels", "one", "two", "--no-figure"]) == 2
    err = capsys.readouterr().err
    assert err.count("plot.py: error:") == 1 and "--labels" not in err, err


def test_plot_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """``plot.py ... --no-figure | head -1``: the table's writes meet a closed pipe; no traceback, exit 0."""
    import subprocess
    import sys
    header = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
    (tmp_path / "PongNoFrameskip-v4_monitor.csv").write_text(header + "0,60,1000,-21,100,1,0,\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "plot.py"), str(tmp_path), "--no-figure"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err, err


def test_plot_names_runs_whose_folders_and_files_both_repeat_by_where_their_paths_part(tmp_path, monkeypatch):
    import plot
    header = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
    for top in ("x", "y"):
        (tmp_path / top / "seed1").mkdir(parents=True)
        (tmp_path / top / "seed1" / "PongNoFrameskip-v4_monitor.csv").write_text(header + "0,60,1000,-21,100,1,0,\n")
    inputs = [str(tmp_path / top / "seed1" / "PongNoFrameskip-v4_monitor.csv") for top in ("x", "y")]
    drawn = {}
    real = plot.time_to_score_table
    monkeypatch.setattr(plot, "time_to_score_table", lambda runs, *a: drawn.update(runs) or real(runs, *a))
    assert plot.main([*inputs, "--no-figure"]) == 0
    assert list(drawn) == ["x/seed1/PongNoFrameskip-v4_monitor", "y/seed1/PongNoFrameskip-v4_monitor"]


def test_plot_median_counts_a_run_that_stopped_early_as_slower_than_its_last_game_only(tmp_path):
    """Three seeds, one stopped before the level: the median is a range (docs/results.md's --train-batch 2 seeds:
    949k, 1,074k and a seed stopped at 904k give 949k-1,074k). A run that went on past the median without reaching
    the level leaves it exact, and two runs that stopped early leave only its least value."""
    def write(name, scores):
        (tmp_path / f"{name}_monitor.csv").write_text(HEADER + "\n" + "".join(
            f"0,{60 * (i + 1)},{1000 * (i + 1)},{s},100,1,0,\n" for i, s in enumerate(scores)))
        return str(tmp_path / f"{name}_monitor.csv")
    fast = write("fast", [0, 0, 20, 20])  # window 2: 20 at 4k steps, 4 min
    slow = write("slow", [0] * 8 + [20, 20])  # 20 at 10k, 10 min
    cut = write("cut", [0, 0, 0])  # stopped at 3k, 3 min
    long = write("long", [0] * 15)  # went on to 15k without it

    def median(*runs):
        r = run_entry("plot.py", *runs, "--window", "2", "--levels", "20", "--no-figure", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()[-1].split(maxsplit=3)[3].strip()
    assert median(fast, slow, cut) == "4k-10k / 4-10 min"
    assert median(fast, slow, long) == "10k / 10 min"
    assert median(fast, cut, write("cut2", [0, 0])) == "≥3k / ≥3 min"
    r = run_entry("plot.py", fast, fast, "--window", "2", "--levels", "20", "--no-figure", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == f"plot.py: warning: {fast} is given more than once: each counts as a " \
                                             f"run of its own in the median\n", r.stderr


def test_curve_styles_are_distinct_for_any_number_of_runs():
    from plot import curve_styles
    for n in (1, 10, 11, 40, 41, 60):
        styles = curve_styles(n)
        assert len(styles) == n and len(set(styles)) == n, n
    assert curve_styles(11)[0] == ("#1f77b4", "-") and curve_styles(11)[10] == ("#1f77b4", "--")


def test_plot_draws_eleven_runs_in_eleven_styles(tmp_path, monkeypatch):
    import matplotlib.figure
    import plot
    header = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
    paths = []
    for k in range(11):
        path = tmp_path / f"run{k}_monitor.csv"
        path.write_text(header + "".join(f"0,{60 * (i + 1)},{1000 * (i + 1)},{k - 21 + i},100,1,0,\n" for i in range(3)))
        paths.append(str(path))
    drawn = []
    real = matplotlib.figure.Figure.savefig
    def savefig(fig, *args, **kwargs):
        for ax in fig.axes:
            drawn.append([(line.get_color(), line.get_linestyle(), line.get_label()) for line in ax.get_lines()])
        return real(fig, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    assert plot.main([*paths, "--out", str(tmp_path / "all.png")]) == 0
    assert len(drawn) == 2 and drawn[0] == drawn[1]  # the same style for a run in both panels
    assert len(drawn[0]) == 11 and len({(c, s) for c, s, _ in drawn[0]}) == 11
    assert [label.split(" (")[0] for _, _, label in drawn[0]] == [f"run{k}" for k in range(11)]


def test_plot_keeps_games_at_equal_global_steps_and_leaves_out_those_a_resume_lost(tmp_path):
    """Two games at the same global steps (a Ray run's steps move only at its nodes' syncs) are one timeline; a
    game at fewer steps than the last (a resume from an older checkpoint) drops the games past it."""
    from plot import read_curve
    csv_file = tmp_path / "a_monitor.csv"
    csv_file.write_text(HEADER + "\n" + "".join(f"0,{60 * i},{steps},{score},100,1,0,\n" for i, (steps, score) in
                                                enumerate([(1000, -21), (1000, 5), (1500, 5), (3000, 7),
                                                           (2000, 9)], 1)))
    warnings = []
    curve = read_curve(csv_file, warnings)
    assert curve["steps"] == [1000, 1000, 1500, 2000] and curve["score"] == [-21.0, 5.0, 5.0, 9.0]
    assert len(warnings) == 1 and "1 game(s) left out" in warnings[0]
    r = run_entry("plot.py", str(csv_file), "--window", "2", "--levels", "-10", "--no-figure", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines()[2].split()[1:] == ["1k", "/", "2", "min"], r.stdout


@pytest.mark.parametrize("flags", [["--title", "score $\\frac{1}$"], ["--labels", "$x^$"]])
def test_plot_refuses_text_matplotlib_cannot_draw_in_one_line_and_writes_no_figure(tmp_path, flags):
    (tmp_path / "a_monitor.csv").write_text(HEADER + "\n0,60,1000,-5,100,1,0,\n")
    r = run_entry("plot.py", str(tmp_path / "a_monitor.csv"), "--out", str(tmp_path / "x.png"), *flags, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("plot.py: error: the title or a label is not text that "
                                                     "matplotlib can draw (") and len(r.stderr.splitlines()) == 1, \
        r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x.png").exists()


def test_join_pieces_by_hand():
    from plot import join_pieces
    a = {"steps": [10, 20, 30], "score": [1.0, 2.0, 3.0], "hours": [0.1, 0.2, 0.3]}
    b = {"steps": [25, 40], "score": [4.0, 5.0], "hours": [0.25, 0.4]}  # resumed a checkpoint taken at 20-25
    assert join_pieces([a, b], restarted=False) == (
        {"steps": [10, 20, 25, 40], "score": [1.0, 2.0, 4.0, 5.0], "hours": [0.1, 0.2, 0.25, 0.4]}, 1, [])
    c = {"steps": [5, 15], "score": [6.0, 7.0], "hours": [0.05, 0.15]}  # counted from 0 again
    joined, left_out, continued = join_pieces([a, c, c], restarted=True)
    assert left_out == 0 and continued == [] and joined["steps"] == [10, 20, 30, 35, 45, 50, 60]
    assert joined["score"] == [1.0, 2.0, 3.0, 6.0, 7.0, 6.0, 7.0]
    assert joined["hours"] == pytest.approx([0.1, 0.2, 0.3, 0.35, 0.45, 0.5, 0.6])
    z = {"steps": [0, 15], "score": [8.0, 9.0], "hours": [0.0, 0.15]}  # a first game logged at 0 steps
    joined, left_out, continued = join_pieces([a, z], restarted=True)  # a's last game stays
    assert left_out == 0 and joined["steps"] == [10, 20, 30, 30, 45] and joined["score"] == [1.0, 2.0, 3.0, 8.0, 9.0]
    assert joined["hours"] == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.45])
    d = {"steps": [25, 35], "score": [8.0, 9.0], "hours": [0.25, 0.35]}  # resumed c's checkpoint: goes on counting
    joined, left_out, continued = join_pieces([a, c, d], restarted=True)
    assert left_out == 0 and continued == [2] and joined["steps"] == [10, 20, 30, 35, 45, 55, 65]
    assert joined["hours"] == pytest.approx([0.1, 0.2, 0.3, 0.35, 0.45, 0.55, 0.65])
    late = {"steps": [25, 35], "score": [8.0, 9.0], "hours": [0.1, 0.35]}  # more steps, but its clock started again
    assert join_pieces([a, c, late], restarted=True)[2] == []


def test_plot_joins_the_pieces_of_one_run(tmp_path):
    """``a+b`` is one run: the 10-game window runs across the join, as the monitor's own mean does; with
    ``--restarted-pieces`` each piece goes on from the last game before it; bad joins are one line and exit 2."""
    def write(name, rows):
        (tmp_path / name).write_text(HEADER + "\n" + "".join(f"0,{60 * t},{1000 * t},{s},100,1,0,\n"
                                                                for t, s in rows))
    write("a_monitor.csv", [(1, 0), (2, 0), (3, 10)])
    write("b_monitor.csv", [(4, 10), (5, 20)])  # resumed a's checkpoint: steps and time go on
    write("c_monitor.csv", [(1, 10), (2, 20)])  # started again from 0
    a, b, c = (str(tmp_path / f"{n}_monitor.csv") for n in "abc")

    def table(*args):
        r = run_entry("plot.py", *args, "--window", "2", "--levels", "5", "15", "--no-figure", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()[2].split(), r.stderr
    # a alone: means 0, 5 -> 5 at game 3; b alone: 15 at its 2nd game; a+b: means 0, 5, 10, 15 -> 15 at 5k steps
    assert table(f"{a}+{b}") == (["a", "(2", "pieces)", "3k", "/", "3", "min", "5k", "/", "5", "min"], "")
    row, err = table(f"{a}+{c}", "--restarted-pieces")  # c's games land at 4k and 5k steps, 4 and 5 min
    assert row[3:] == ["3k", "/", "3", "min", "5k", "/", "5", "min"] and err == ""
    write("d_monitor.csv", [(3, 20), (4, 20)])  # resumed c's checkpoint: goes on from c's last game
    d = str(tmp_path / "d_monitor.csv")
    row, err = table(f"{a}+{c}+{d}", "--restarted-pieces")  # c at 4k and 5k, d at 6k and 7k
    assert row[3:] == ["3k", "/", "3", "min", "5k", "/", "5", "min"]
    assert err == (f"plot.py: warning: {a}+{c}+{d}: {d} goes on from {c} (its first game comes after that piece's "
                   f"last, in steps and time: it resumed its checkpoint); joined as continuing it, the others as "
                   f"restarted\n")
    row, err = table(f"{a}+{c}")  # without the flag c's first game goes back before a's: a's games left out
    assert row[3:] == ["2k", "/", "2", "min"] * 2  # c alone: its 2-game mean is 15 at 2k steps
    assert "3 game(s) left out where a piece's global steps go back" in err and "--restarted-pieces" in err
    (tmp_path / "d").mkdir()
    (tmp_path / "results.txt").write_text("2026-01-01 00:00:00, 5, 100\n")
    txt = tmp_path / "results.txt"
    for args, message in ([f"{a}+{tmp_path / 'x.csv'}"], f"'{tmp_path / 'x.csv'}' (in '{a}+{tmp_path / 'x.csv'}') "
                                                          f"does not exist (a name with + in it cannot be joined: rename or link it)"), \
                         ([f"{a}+{tmp_path / 'd'}"], f"'{tmp_path / 'd'}' (in '{a}+{tmp_path / 'd'}') is a folder: "
                                                     f"join files, not folders"), \
                         ([f"{a}+{txt}"], f"'{txt}' (in '{a}+{txt}') is GA3C's results.txt: join monitor CSVs only"), \
                         ([f"{a}+{b}", "--labels", "x", "y"], "--labels names 2 curve(s) but the inputs hold 1: give "
                                                              "one label per run (a monitor CSV, or pieces joined "
                                                              "with +)"), \
                         ([a, "--restarted-pieces"], "--restarted-pieces is about pieces joined with + "
                                                     "(a_monitor.csv+b_monitor.csv); no input joins any"):
        r = run_entry("plot.py", *args, "--no-figure", cwd=tmp_path)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"plot.py: error: {message}\n")


@pytest.mark.parametrize("env_id", ["Pong-v0", "PongNoFrameskip-v4"])
def test_the_frameskip_in_words_is_what_ale_does(env_id):
    """The summary line's frameskip: ``Pong-v0``'s ALE range ``(2, 5)`` steps 2, 3 or 4 raw frames (ALE's upper
    bound is excluded); a NoFrameskip id's wrapper steps 4."""
    from environment import atari_env, load_env_config, protocol
    from gym_eval import frameskip_words
    proto = protocol(env_id, max_episode_length=10000, skip_rate=4, episodic_life=False)
    words = frameskip_words(proto["frameskip"])
    env = atari_env(env_id, load_env_config(ROOT / "config.json", env_id), max_episode_length=10000)
    env.reset(seed=0)
    ale = env.unwrapped.ale
    seen = set()
    for _ in range(200):
        before = ale.getEpisodeFrameNumber()
        _, _, terminated, truncated, _ = env.step(0)
        seen.add(ale.getEpisodeFrameNumber() - before)
        assert not (terminated or truncated)
    env.close()
    if env_id == "Pong-v0":
        assert words == "2-4 (random)" and seen == {2, 3, 4}
    else:
        assert words == "4" and seen == {4}


def test_the_games_are_played_after_use_device(monkeypatch):
    """gym_eval.py's games (in-process and in each worker) start with ``utils.use_device`` on their device, as the
    training processes do: on a GPU that keeps its float32 evaluation in float32 (no TF32)."""
    import argparse
    import queue

    import gym_eval

    calls = []
    monkeypatch.setattr(gym_eval, "use_device", calls.append)
    gym_eval.play_games(argparse.Namespace(env_config=str(ROOT / "config.json"), env="PongNoFrameskip-v4"), {}, [],
                        torch.device("cpu"), queue.Queue())
    assert calls == [torch.device("cpu")]


def test_see_skipped_frames_evaluates_the_same_games_and_says_what_it_maxed(tmp_path):
    """gym_eval.py with ``--see-skipped-frames`` on ``Pong-v0``: random actions (seeded per game) play the same
    games as without it, score for score and length for length, and the JSON's protocol names the 3 frames."""
    flags = ["--env", "Pong-v0", "--random-actions", "--num-episodes", "2", "--seed", "3", "--log-dir",
             str(tmp_path / "logs"), "--max-episode-length", "200"]
    r = run_entry("gym_eval.py", *flags, "--json", str(tmp_path / "plain.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_entry("gym_eval.py", *flags, "--see-skipped-frames", "--json", str(tmp_path / "seen.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    plain, seen = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "seen"))
    assert (seen["scores"], seen["lengths"], seen["points"]) == (plain["scores"], plain["lengths"], plain["points"])
    assert plain["protocol"]["max_over_frames"] == 1 and seen["protocol"]["max_over_frames"] == 3
    assert seen["protocol"]["frameskip"] == plain["protocol"]["frameskip"] == [2, 5]


@pytest.mark.parametrize("card,flags,maxed,line", [
    ({"see_skipped_frames": True}, [], 3, True),
    ({"see_skipped_frames": True}, ["--no-see-skipped-frames"], 1, False),
    ({"see_skipped_frames": True, "model_file": "other.dat"}, [], 3, True),  # the same file (sha256) renamed
    ({"see_skipped_frames": True, "sha256": "0" * 64}, [], 1, False),  # a card of a file since replaced
    ({}, [], 1, False),
    ({}, ["--see-skipped-frames"], 3, False),
    (None, [], 1, False)])  # no card
def test_a_model_s_card_turns_see_skipped_frames_on_unless_told_otherwise(tmp_path, model_dir, card, flags, maxed,
                                                                           line):
    """``--env Pong-v0`` finds ``Pong-v0.dat`` by its name; its card's ``see_skipped_frames`` decides what the games
    show unless a flag does (a card whose sha256 is another file's decides nothing, one whose sha256 is this file's
    decides under any name); the summary JSON's protocol says what they showed."""
    import hashlib
    (model_dir / "PongNoFrameskip-v4.dat").rename(model_dir / "Pong-v0.dat")
    if card is not None:
        sha = hashlib.sha256((model_dir / "Pong-v0.dat").read_bytes()).hexdigest()
        (model_dir / "Pong-v0.json").write_text(json.dumps({"model_file": "Pong-v0.dat", "sha256": sha, **card}))
    s, r = evaluate(tmp_path, model_dir, "s", "--num-episodes", "1", "--env", "Pong-v0", *flags)
    assert s["model"].endswith("Pong-v0.dat") and s["protocol"]["max_over_frames"] == maxed
    assert (f"{model_dir / 'Pong-v0.json'} says the model was trained on the max over each step's last frames: "
            f"--see-skipped-frames is on" in r.stdout) is line


def test_a_card_s_see_skipped_frames_goes_unsaid_for_a_noframeskip_id(tmp_path, model_dir):
    """A ``NoFrameskip`` id shows the max over the skipped frames with or without the flag: no line claims that
    the card turned something on."""
    import hashlib
    sha = hashlib.sha256((model_dir / "PongNoFrameskip-v4.dat").read_bytes()).hexdigest()
    (model_dir / "PongNoFrameskip-v4.json").write_text(json.dumps(
        {"model_file": "PongNoFrameskip-v4.dat", "sha256": sha, "see_skipped_frames": True}))
    s, r = evaluate(tmp_path, model_dir, "s", "--num-episodes", "1", "--env", "PongNoFrameskip-v4")
    assert s["model"].endswith("PongNoFrameskip-v4.dat") and s["protocol"]["max_over_frames"] == 3
    assert "--see-skipped-frames is on" not in r.stdout


@pytest.mark.parametrize("saved", [True, False])
def test_a_checkpoint_s_configuration_turns_see_skipped_frames_on(tmp_path, model_dir, saved):
    """A ``.ckpt`` keeps the run's flags: ``--model-file run.ckpt`` plays as the run trained."""
    from checkpoint import CHECKPOINT_FORMAT
    sd = torch.load(model_dir / "PongNoFrameskip-v4.dat", weights_only=True)
    torch.save({"format": CHECKPOINT_FORMAT, "version": 1, "model": sd, "config": {"see_skipped_frames": saved}},
               model_dir / "run.ckpt")
    s, r = evaluate(tmp_path, model_dir, "s", "--num-episodes", "1", "--env", "Pong-v0", "--model-file",
                    str(model_dir / "run.ckpt"))
    assert s["protocol"]["max_over_frames"] == (3 if saved else 1)
    assert ("the checkpoint's configuration says the model was trained on the max over each step's last frames"
            in r.stdout) is saved


@pytest.mark.parametrize("trained, warned", [("SpaceInvadersNoFrameskip-v4", True), ("ALE/Pong-v5", False),
                                              (None, False)])
def test_a_checkpoint_of_another_game_is_played_with_a_warning(tmp_path, model_dir, trained, warned):
    """A ``.ckpt`` saved by a run of another game with as many actions (SpaceInvaders has Pong's 6) plays, with one
    warning line first; another version of the same game, or a checkpoint that names no game, plays without."""
    from checkpoint import CHECKPOINT_FORMAT
    sd = torch.load(model_dir / "PongNoFrameskip-v4.dat", weights_only=True)
    config = {} if trained is None else {"env": trained}
    torch.save({"format": CHECKPOINT_FORMAT, "version": 1, "model": sd, "config": config}, model_dir / "run.ckpt")
    _, r = evaluate(tmp_path, model_dir, "s", "--num-episodes", "1", "--max-episode-length", "5", "--model-file",
                    str(model_dir / "run.ckpt"))
    line = ("gym_eval.py: warning: the checkpoint's configuration says the model was trained on "
            "SpaceInvadersNoFrameskip-v4, another game than PongNoFrameskip-v4's")
    assert (line in r.stderr) is warned and ("another game" in r.stderr) is warned


def test_a_model_with_nan_weights_is_refused_in_one_line(tmp_path, model_dir):
    """A diverged run's weights would play NOOP after NOOP (argmax of NaN logits) and be scored as a model."""
    sd = torch.load(model_dir / "PongNoFrameskip-v4.dat", weights_only=True)
    sd["lstm.weight_hh"][3, 5] = float("nan")
    sd["critic_linear.bias"][0] = float("inf")
    torch.save(sd, model_dir / "PongNoFrameskip-v4.dat")
    line = bad_eval(tmp_path, *SHORT, "--load-model-dir", str(model_dir))
    assert "holds NaN or infinite weights (lstm.weight_hh, critic_linear.bias): a run that diverged" in line
    assert not (tmp_path / "logs").exists()


def test_a_game_log_that_cannot_be_opened_is_one_line(tmp_path, model_dir):
    """A dangling link where the game log goes passes the checks of paths (it is no folder) and fails only when
    opened: one line and exit 2, no game played."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "PongNoFrameskip-v4_mon_log").symlink_to(tmp_path / "gone" / "log")
    r = run_entry("gym_eval.py", *SHORT, "--load-model-dir", str(model_dir), "--log-dir", str(logs), cwd=tmp_path)
    assert r.returncode == 2 and r.stdout.count("game ") == 0
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"gym_eval.py: error: cannot open the game log {logs / 'PongNoFrameskip-v4_mon_log'} (No such file")
    assert "Traceback" not in r.stderr


def _sleep_forever():
    time.sleep(120)


def test_a_ctrl_c_while_the_evaluation_processes_end_kills_them_and_is_reported():
    """All games in, the processes given 5 s each to end: a Ctrl-C then stops the waiting, kills them, and
    ``end_workers`` says it came (gym_eval.py then exits 130 with one line); without one they are joined."""
    import multiprocessing as mp
    import threading
    from gym_eval import end_workers
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sleep_forever) for _ in range(2)]
    for p in procs:
        p.start()
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    assert end_workers(procs, kill=False) is True
    assert time.monotonic() - t0 < 4.5 and all(p.exitcode == -signal.SIGKILL for p in procs)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is back as it was
    quick = [ctx.Process(target=time.sleep, args=(0.1,)) for _ in range(2)]
    for p in quick:
        p.start()
    assert end_workers(quick, kill=False) is False and all(p.exitcode == 0 for p in quick)


def test_scores_of_a_million_and_more_are_printed_whole(tmp_path, capsys):
    """Atlantis and VideoPinball score millions: the summary line prints them digit for digit, not as 2.87321e+06."""
    import argparse
    import logging
    import gym_eval
    from environment import protocol
    args = argparse.Namespace(num_episodes=2, env="AtlantisNoFrameskip-v4", random_actions=True,
                              compute_precision="fp32", json=str(tmp_path / "a.json"), record=None, trace=None,
                              seed=1, log_dir=str(tmp_path))
    proto = protocol(args.env, max_episode_length=10000, skip_rate=4, episodic_life=False)
    code = gym_eval.summarise_and_write(args, None, None, proto, logging.getLogger("test"), time.time(),
                                        {0: 2873210.0, 1: 1234567.0}, {0: 9000, 1: 9000}, {0: 0, 1: 0}, {0: [], 1: []},
                                        {0: False, 1: False})
    assert code == 0
    out = capsys.readouterr().out
    assert "2 games, mean 2053888.50 ± 819321.50, min 1234567, max 2873210, median 2053888.5 (" in out, out
    assert json.loads((tmp_path / "a.json").read_text())["scores"] == [2873210.0, 1234567.0]

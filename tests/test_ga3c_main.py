"""``main.py --mode ga3c`` as a subprocess with tiny budgets: what it writes, GA3C's console line and results.txt,
resuming in either mode from the other's checkpoint, evaluation of its model, ending on a signal or a dead
process with nothing left running, and bad flags.

Stop conditions hold whatever the processes' relative speed (see test_main.UNTIL_GAME): the run stops right after
the monitor's game number --score-window, and the monitor plays one game at start-up and one after every
--test-every-steps global steps. A queue of one segment bounds how far the agents can get ahead of the trainer:
each update takes 2 segments of 5 steps, at most 3 segments wait (queue, a predictor blocked on it, the trainer's
partial batch) and 4 are open, so 150 global steps need at least (150 - 35) / 10 > 11 updates. Games are cut at
30 agent steps, so that 150 global steps over the 4 env slots finish at least one agent game (one slot took 38 or
more): the console line and results.txt always have something to show.
"""
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_entry
from test_faults import (START_SECONDS, check_end, launch, load_saved,  # noqa: F401 - launch: fixture
                         models_dir, wait_for_steps)

ENV_ID = "PongNoFrameskip-v4"
GA3C_RUN = ["--mode", "ga3c", "--agents", "2", "--envs-per-agent", "2", "--num-steps", "5", "--train-batch", "2",
            "--queue-size", "1"]  # the default two trainers: the fault tests
GA3C = [*GA3C_RUN, "--trainers", "1"]  # one trainer: the update-count bound below, NT in the console line
COMMON = ["--hidden-size", "32", "--test-every-steps", "150", "--env-config", str(ROOT / "config.json"),
          "--max-steps", "0", "--max-episode-length", "30", "--target-score", "-1000", "--score-window"]
CONSOLE = re.compile(r"\[Time: +\d+\] \[Episode: +\d+ Score: +-?\d+\.\d{4}\] \[RScore: +-?\d+\.\d{4} RPPS: +\d+\] "
                     r"\[PPS: +\d+ TPS: +\d+\] \[NT: +\d+ NP: +\d+ NA: +\d+\]")
RESULTS = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d, -?\d+, \d+$")


def dirs(tmp_path):
    return ["--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models")]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_ga3c_run_trains_writes_upstreams_files_and_either_mode_resumes_the_other(tmp_path):
    """... with ``--ema-steps`` in the first two runs: the .dat is the moving average the checkpoint holds beside
    the weights, either mode resumes it, and a run without the flag leaves it and ships the latest weights."""
    r = run_entry("main.py", *GA3C, *COMMON, "2", *dirs(tmp_path), "--tensorboard-logger", "--ema-steps", "300",
                  cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "in GA3C mode: 2 agents x 2 envs" in r.stdout and "reached --target-score -1000" in r.stdout
    assert "a moving average of the weights with a time constant of 300 global steps (--ema-steps)" in r.stdout
    ckpt_path, dat = tmp_path / "models" / f"{ENV_ID}.ckpt", tmp_path / "models" / f"{ENV_ID}.dat"
    ckpt = torch.load(ckpt_path, weights_only=True)
    steps1, updates1 = ckpt["global_steps"], ckpt["ga3c_updates"]
    assert steps1 >= 150 and updates1 > 11 and ckpt["config"]["mode"] == "ga3c" and ckpt["optimizer"]["state"]
    assert ckpt["norm_stats"].shape == (5, 3) and (ckpt["norm_stats"][:, 2] > 0).all()  # 4 env slots + monitor
    sd = torch.load(dat, weights_only=True)
    assert len(sd) == 16 and sd["actor_linear.weight"].shape == (6, 32)
    assert same_weights(sd, ckpt["average_model"]) and not same_weights(sd, ckpt["model"])
    # GA3C's console line for every finished agent game, and the same games in results.txt
    lines = [m.group(0) for m in CONSOLE.finditer(r.stdout)]
    results = (tmp_path / "logs" / "results.txt").read_text().splitlines()
    assert lines and len(results) == len(lines) and all(RESULTS.match(s) for s in results)
    assert int(re.search(r"Episode: +(\d+)", lines[-1]).group(1)) == len(lines)
    assert lines[-1].endswith("[NT:  1 NP:  1 NA:  2]")
    assert ckpt["ga3c_episodes"] == len(lines)
    status = (tmp_path / "logs" / f"{ENV_ID}_train.log").read_text()
    assert re.search(r"updates [\d,]+ \([\d.]+/s\) \| policy lag mean [\d.]+ max \d+ \| per step: policy", status)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "logs/runs/PongNoFrameskip-v4_training"))
    acc.Reload()
    assert {"charts/policy_lag_mean", "charts/policy_lag_max", "charts/updates_per_s", "losses/policy_loss",
            "charts/episode_reward"} <= set(acc.Tags()["scalars"])

    # A3G mode resumes the GA3C checkpoint: weights, optimizer statistics, steps, the monitor's games
    games1 = int(ckpt["monitor"][0])
    r = run_entry("main.py", "--workers", "2", *COMMON, str(games1 + 2), *dirs(tmp_path), "--load",
                  "--ema-steps", "300", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"at {steps1:,} global steps" in r.stdout and "resumed the Adam statistics" in r.stdout
    assert "the checkpoint was trained in GA3C mode; this run goes on in A3G mode\n" in r.stdout
    assert "resumed the moving average of the weights\n" in r.stdout
    ckpt2 = torch.load(ckpt_path, weights_only=True)
    assert ckpt2["global_steps"] >= steps1 + 150 and ckpt2["norm_stats"].shape == (3, 3)
    assert ckpt2["config"]["mode"] == "a3g"
    sd2 = torch.load(dat, weights_only=True)  # the workers moved the average on from the resumed one
    assert same_weights(sd2, ckpt2["average_model"]) and not same_weights(sd2, ckpt["average_model"])

    # ... and GA3C mode resumes the A3G one (its update count starts again from the last GA3C one: 0 here is fine)
    games2 = int(ckpt2["monitor"][0])
    r = run_entry("main.py", *GA3C, *COMMON, str(games2 + 2), *dirs(tmp_path), "--load", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"at {ckpt2['global_steps']:,} global steps" in r.stdout
    assert "the checkpoint was trained in A3G mode; this run goes on in GA3C mode (--mode a3g goes on" in r.stdout
    assert "the checkpoint's moving average of the weights is not resumed (no --ema-steps)" in r.stdout
    ckpt3 = torch.load(ckpt_path, weights_only=True)
    assert ckpt3["global_steps"] >= ckpt2["global_steps"] + 150 and ckpt3["ga3c_updates"] > 11
    assert "average_model" not in ckpt3 and same_weights(torch.load(dat, weights_only=True), ckpt3["model"])
    # the A3G checkpoint had no GA3C games: this run numbered its own from 1 and saved the count
    assert ckpt3["ga3c_episodes"] == len([m for m in CONSOLE.finditer(r.stdout)]) > 0
    results3 = (tmp_path / "logs" / "results.txt").read_text().splitlines()
    assert results3[:len(results)] == results and len(results3) == len(results) + ckpt3["ga3c_episodes"]  # appended

    # the GA3C model evaluates with gym_eval.py unchanged
    r = run_entry("gym_eval.py", "--env", ENV_ID, "--load-model-dir", str(tmp_path / "models"), "--hidden-size",
                  "32", "--num-episodes", "1", "--max-episode-length", "50", "--log-dir", str(tmp_path / "eval"),
                  "--env-config", str(ROOT / "config.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "1 games, mean" in r.stdout


@pytest.mark.slow  # a whole run (5 s); the slots themselves are tested without one
def test_short_game_slots_in_a_run_are_logged_and_left_out_of_the_learner_games(tmp_path):
    """``--short-game-slots 1 --short-game-length 10`` with whole games cut at 30 agent steps (``COMMON``): the start-up
    log names the slot, and every learner game the run counts (console, results.txt, the checkpoint) is a whole one:
    28 agent steps after the reset's FIRE and action 2, none of the short slot's 8."""
    r = run_entry("main.py", *GA3C, *COMMON, "3", "--short-game-slots", "1", "--short-game-length", "10",
                  *dirs(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "env slot 0 of 4 plays games cut at 10 agent steps (--short-game-slots), not counted as learner games" \
        in r.stdout
    results = (tmp_path / "logs" / "results.txt").read_text().splitlines()
    lengths = [int(line.rsplit(", ", 1)[1]) for line in results]
    assert len(lengths) >= 3 and set(lengths) == {28}, lengths
    ckpt = torch.load(tmp_path / "models" / f"{ENV_ID}.ckpt", weights_only=True)
    assert ckpt["ga3c_episodes"] == len(lengths) and ckpt["config"]["short_game_slots"] == 1


@pytest.mark.slow  # two whole runs (10 s); the switch itself is tested without one
def test_short_games_after_score_in_a_run_is_logged_switched_by_the_monitor_and_resumed(tmp_path):
    """``--short-game-slots 1 --short-games-after-score -1000``: the start-up line says when the cut starts, the
    monitor's mean over 2 games reaches it (and the run's --target-score, so the run stops there), the monitor
    says so, and the checkpoint keeps the switch; a resume with --load starts with the cut, and says why."""
    flags = ["--short-game-slots", "1", "--short-game-length", "10", "--short-games-after-score", "-1000"]
    r = run_entry("main.py", *GA3C, *COMMON, "2", *flags, *dirs(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert ("env slot 0 of 4 plays games cut at 10 agent steps (--short-game-slots), once the monitor's mean over "
            "its last 2 games reaches -1000 (--short-games-after-score; whole games until then)") in r.stdout
    assert re.search(r"\[monitor\] --short-games-after-score -1000 reached at [\d,]+ steps: mean -?\d+\.\d\d over "
                     r"the last 2 games; env slot 0 plays games cut at 10 agent steps from their next game on",
                     r.stdout), r.stdout[-3000:]
    ckpt = torch.load(tmp_path / "models" / f"{ENV_ID}.ckpt", weights_only=True)
    assert ckpt["short_games_started"] is True and ckpt["config"]["short_games_after_score"] == -1000
    r = run_entry("main.py", *GA3C, *COMMON, "2", *flags, *dirs(tmp_path), "--load", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert ("env slot 0 of 4 plays games cut at 10 agent steps (--short-game-slots), from the start: the "
            "checkpoint's run reached its --short-games-after-score -1000, not counted") in r.stdout
    assert "--short-games-after-score -1000 reached" not in r.stdout  # set once, by the first run
    assert torch.load(tmp_path / "models" / f"{ENV_ID}.ckpt", weights_only=True)["short_games_started"] is True


@pytest.mark.slow  # a whole run (5 s); the slots themselves are tested without one
def test_greedy_slots_in_a_run_are_logged_trained_on_and_left_out_of_the_learner_games(tmp_path):
    """``--greedy-slots 1`` after ``--short-game-slots 1`` (4 env slots): the start-up log names slot 1, the run
    trains and ends, the checkpoint keeps the flag, and the games it counts are results.txt's (which slots count is
    ``AtariEnvFactory.counts_games``, tested in test_config.py)."""
    r = run_entry("main.py", *GA3C, *COMMON, "3", "--short-game-slots", "1", "--short-game-length", "10",
                  "--greedy-slots", "1", "--train-passes", "1", *dirs(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert ("env slot 1 of 4 acts greedily, as the monitor does (--greedy-slots): policy-gradient terms weighted by "
            "pi(a), games not counted as learner games") in r.stdout
    results = (tmp_path / "logs" / "results.txt").read_text().splitlines()
    ckpt = torch.load(tmp_path / "models" / f"{ENV_ID}.ckpt", weights_only=True)
    assert len(results) >= 3 and ckpt["ga3c_episodes"] == len(results) and ckpt["config"]["greedy_slots"] == 1
    assert ckpt["ga3c_updates"] >= 1


def ga3c_fault_args(tmp_path, *extra):
    return [*GA3C_RUN, "--hidden-size", "32", "--env-config", str(ROOT / "config.json"), "--max-steps", "0",
            "--max-episode-length", "300", "--test-every-steps", "2000", "--checkpoint-every-seconds", "0.5",
            "--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models"), *extra]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_a_signal_stops_a_ga3c_run_and_leaves_nothing(launch, tmp_path, sig, code):  # noqa: F811
    run = launch(ga3c_fault_args(tmp_path, "--agents", "1"))
    wait_for_steps(run, tmp_path, minimum=20)
    t = time.monotonic()
    run.proc.send_signal(sig)
    check_end(run, t, {code})
    saved = load_saved(models_dir(tmp_path))
    assert saved[f"{ENV_ID}.ckpt"]["global_steps"] >= 20 and "ga3c_updates" in saved[f"{ENV_ID}.ckpt"]


@pytest.mark.parametrize("role", ["ga3c server", pytest.param("ga3c agent 1", marks=pytest.mark.slow)])
def test_a_killed_server_or_agent_ends_the_run(launch, tmp_path, role):  # noqa: F811
    run = launch(ga3c_fault_args(tmp_path, "--agents", "2" if role == "ga3c agent 1" else "1"))
    victim = run.role(role)
    wait_for_steps(run, tmp_path, minimum=20)
    t = time.monotonic()
    victim.kill()
    check_end(run, t, {1})
    assert f"{role} exited unexpectedly" in run.stdout(), run.tail()
    assert f"{ENV_ID}.ckpt" in load_saved(models_dir(tmp_path))


def test_a_periodic_checkpoint_is_of_one_moment_between_two_optimizer_steps(launch, tmp_path):  # noqa: F811
    """Every optimizer step of the server sleeps 0.2 s after it has changed the weights and statistics, before the
    version moves (a fault hook; the trainer holds its step lock through both): a checkpoint copied then without
    that lock holds Adam step counts one ahead of its ``ga3c_updates``. In a fresh run every update is one step of
    every parameter, so each checkpoint's step counts must all equal its ``ga3c_updates``."""
    from test_faults import HOOKS
    fired = tmp_path / "fired"
    run = launch(ga3c_fault_args(tmp_path, "--agents", "1", "--checkpoint-every-seconds", "0.3"), env={
        "PYTHONPATH": str(HOOKS), "A3G_FAULT": "slow_step", "A3G_FAULT_ROLE": "a3g ga3c server",
        "A3G_FAULT_FIRED": str(fired)})
    path = models_dir(tmp_path) / f"{ENV_ID}.ckpt"
    seen, last = [], [None]

    def step_counts(ckpt: dict) -> tuple[int, set[float]]:
        return ckpt["ga3c_updates"], {float(s["step"]) for s in ckpt["optimizer"]["state"].values()}

    def enough() -> bool:
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        if (st.st_ino, st.st_mtime_ns) != last[0]:  # each write is a new file renamed over the last
            last[0] = (st.st_ino, st.st_mtime_ns)
            seen.append(step_counts(torch.load(path, map_location="cpu", weights_only=True)))
        return sum(1 for updates, _ in seen if updates >= 1) >= 8

    run.poll_until(enough, START_SECONDS + 60, "8 periodic checkpoints after the first update", period=0.05)
    t = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    check_end(run, t, {143})
    assert fired.exists(), "the slow-step hook never ran in the server"
    seen.append(step_counts(load_saved(models_dir(tmp_path))[f"{ENV_ID}.ckpt"]))
    torn = [(updates, steps) for updates, steps in seen if steps != {float(updates)}]
    assert not torn, f"checkpoints between an optimizer step and its version: {torn} of {seen}"


def test_a_server_killed_inside_an_optimizer_step_leaves_the_last_complete_checkpoint(launch, tmp_path):  # noqa: F811
    """The server's first optimizer step pauses 30 s after it has changed the weights and statistics (a fault hook),
    and the server is killed -9 there: the shared weights hold that step half applied, so the final checkpoint
    is not written over the last complete one (before, it was: Adam's step counts one ahead of its
    ``ga3c_updates``). Whatever checkpoint is on disk is of a moment between two steps."""
    from test_faults import HOOKS
    fired = tmp_path / "fired"
    run = launch(ga3c_fault_args(tmp_path, "--agents", "1", "--trainers", "1"), env={
        "PYTHONPATH": str(HOOKS), "A3G_FAULT": "slow_step", "A3G_FAULT_ROLE": "a3g ga3c server",
        "A3G_FAULT_SLEEP": "30", "A3G_FAULT_FIRED": str(fired)})
    server = run.role("ga3c server")
    run.poll_until(fired.exists, START_SECONDS, "the server's first optimizer step")
    t = time.monotonic()
    server.kill()
    check_end(run, t, {1})
    assert ("the final checkpoint is not written: the ga3c server ended inside an optimizer step"
            in run.stdout()), run.tail()
    saved = load_saved(models_dir(tmp_path), may_be_empty=True)
    if f"{ENV_ID}.ckpt" in saved:
        ckpt = saved[f"{ENV_ID}.ckpt"]
        assert {float(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {float(ckpt["ga3c_updates"])}


def test_a_failing_trainer_thread_is_reported_and_ends_the_run(launch, tmp_path):  # noqa: F811
    fired = tmp_path / "fired"
    run = launch(ga3c_fault_args(tmp_path, "--trainers", "1", "--agents", "1"), env={
        "PYTHONPATH": str(ROOT / "tests" / "fault_hooks"), "A3G_FAULT": "short_error",
        "A3G_FAULT_ROLE": "a3g ga3c server", "A3G_FAULT_AFTER": "2", "A3G_FAULT_FIRED": str(fired)})
    run.poll_until(fired.exists, START_SECONDS, "the injected trainer failure")
    check_end(run, time.monotonic(), {1}, traceback_ok=True)
    out = run.stdout()
    assert "ga3c server failed" in out and "the trainer 0 thread failed" in out and "injected" in out, run.tail()


BAD_FLAGS = [
    (["--agents", "0"], "--agents must be >= 1, got 0"),
    (["--predict-batch", "0"], "--predict-batch must be >= 1, got 0"),
    (["--envs-per-agent", "-2", "--trainers", "0"], "--envs-per-agent must be >= 1, got -2"),
    (["--is-clip", "-1"], "--is-clip must be > 0 (or 0 = off), got -1"),
    (["--dynamic", "--agents", "3", "--dynamic-max", "2", "2", "2"], "--dynamic-max: the bound for agents (2) is "
                                                                     "below --agents 3"),
    (["--distributed-step-size", "5", "10"], "--distributed-step-size: only A3G mode has it"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_bad_ga3c_flags_are_reported(flags, message):
    from config import build_parser, validate
    errors = validate(build_parser().parse_args(["--mode", "ga3c", *flags]))
    assert any(message in e for e in errors) and len([e for e in errors if flags[0] in e]) == 1, errors  # once


def test_bad_ga3c_flags_are_one_line_each_exit_2_and_write_nothing(tmp_path):
    r = run_entry("main.py", "--mode", "ga3c", "--agents", "0", "--predict-batch", "0", "--trainers", "0",
                  *dirs(tmp_path), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == ["main.py: error: --agents must be >= 1, got 0",
                                     "main.py: error: --trainers must be >= 1, got 0",
                                     "main.py: error: --predict-batch must be >= 1, got 0"]
    assert not (tmp_path / "models").exists() and not (tmp_path / "logs").exists()
    r = run_entry("main.py", "--mode", "ga2c", *dirs(tmp_path), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "argument --mode: invalid choice: 'ga2c'" in r.stderr


def test_the_ga3c_flags_are_checked_in_either_mode():
    from config import build_parser, validate
    assert "--trainers must be >= 1, got 0" in validate(build_parser().parse_args(["--trainers", "0"]))


@pytest.mark.slow  # 40 s; the adjuster's rule and the server's thread changes are in test_ga3c_dynamic.py
def test_dynamic_changes_the_counts_within_its_bounds_and_logs_each_change(tmp_path):
    r = run_entry("main.py", *GA3C, "--hidden-size", "32", "--env-config", str(ROOT / "config.json"),
                  "--max-steps", "0", "--max-seconds", "35", "--status-every-seconds", "4", "--dynamic",
                  "--dynamic-seconds", "2", "--dynamic-max", "2", "2", "3", *dirs(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    events = re.findall(r"\[dynamic\] (.*)", r.stdout)
    assert events and re.match(r"NT 1 NP 1 NA 2: \d+ trained steps/s", events[0]), r.stdout[-3000:]
    tried = [tuple(map(int, m)) for m in re.findall(r"try NT (\d+) NP (\d+) NA (\d+)", r.stdout)]
    assert tried and all(1 <= nt <= 2 and 1 <= np_ <= 2 and 1 <= na <= 3 for nt, np_, na in tried)
    shown = {tuple(map(int, m)) for m in re.findall(r"NT (\d+) NP (\d+) NA (\d+) \|(?: lr [\d.e-]+ \|)? (?:fp32|bf16)$",
                                                     r.stdout, re.MULTILINE)}  # the schedule's lr where annealed
    assert len(shown) >= 2  # the status lines saw more than one setting
    assert "exited unexpectedly" not in r.stdout


def test_the_monitors_first_game_is_no_learners_first_game(tmp_path, monkeypatch):
    """The monitor seeds its first game after the learners' first seeds: GA3C env slot s plays ``seed + s`` first
    (``Ga3cRun._start_agent``), A3G worker r ``seed + r``; the monitor ``seed + 16`` with 2 agents x 8 envs, and
    ``seed + 2`` with 2 A3G workers (``test.run_monitor``, played in this process)."""
    import test as monitor
    from config import build_parser, validate
    from ga3c.run import Ga3cRun
    from a3g.run import A3gRun
    from model import A3Clstm
    for flags, mode, expected in ((["--mode", "ga3c", "--agents", "2", "--envs-per-agent", "8"], Ga3cRun, 7 + 16),
                                  (["--workers", "2"], A3gRun, 7 + 2)):
        args = build_parser().parse_args([*flags, "--seed", "7", "--hidden-size", "32", *dirs(tmp_path / mode.name)])
        assert validate(args) == []
        Path(args.log_dir).mkdir(parents=True)  # as main.py makes it
        run = mode(args, A3Clstm(1, 6, 32), None, log=None).run
        seeds = []

        def one_game(model, env, device, seed=None, should_stop=None, **kw):
            seeds.append(seed)
            run.stop.set()
            return 0.0, 1, False
        monkeypatch.setattr(monitor, "play_game", one_game)
        monitor.run_monitor(args, A3Clstm(1, 6, 32), run, torch.device("cpu"))
        assert seeds == [expected], (mode.name, seeds)

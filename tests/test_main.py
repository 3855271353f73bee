"""main.py as a subprocess with tiny budgets: what it writes, resuming, stopping, and bad input."""
import contextlib
import csv
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import ROOT, deny_below, run_entry

TINY = ["--workers", "2", "--hidden-size", "32", "--test-every-steps", "150", "--env-config", str(ROOT / "config.json")]
UPSTREAM_LINE = re.compile(r"^\S+ \S+ : Time \d\dh \d\dm \d\ds, episode reward -?\d+\.0, episode length \d+, "
                           r"reward mean -?\d+\.\d{4}$")


def dirs(tmp_path):
    return ["--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models")]


# Stop conditions the tests can rely on whatever the processes' relative speed: the monitor plays a game at start-up,
# then one more after every --test-every-steps (150) global steps; the mean of its last --score-window games is
# always >= -1000, so the run stops right after the monitor's game number --score-window (counted over resumed runs
# too). With --score-window 2 it has played two games and the workers have made at least 150 steps. Games of at
# most 200 steps keep it short.
UNTIL_GAME = ["--max-steps", "0", "--max-episode-length", "200", "--target-score", "-1000", "--score-window"]


def test_tiny_run_writes_model_log_csv_then_resumes(tmp_path):
    r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, "2", "--tensorboard-logger",
                  cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "reached --target-score -1000" in r.stdout
    dat, ckpt_path = tmp_path / "models/PongNoFrameskip-v4.dat", tmp_path / "models/PongNoFrameskip-v4.ckpt"
    sd = torch.load(dat, weights_only=True)
    assert len(sd) == 16 and sd["actor_linear.weight"].shape == (6, 32)
    assert all(v.device.type == "cpu" for v in sd.values())
    ckpt = torch.load(ckpt_path, weights_only=True)
    steps1, games1 = ckpt["global_steps"], int(ckpt["monitor"][0])
    assert steps1 >= 150 and games1 >= 2 and ckpt["config"]["hidden_size"] == 32 and ckpt["optimizer"]["state"]
    norm = ckpt["norm_stats"]
    assert norm.shape == (3, 3) and norm[2, 2] > 0 and norm[:2, 2].max() > 0  # the monitor's, and a worker's
    log = (tmp_path / "logs/PongNoFrameskip-v4_log").read_text().splitlines()
    assert any(line.endswith("lr: 0.0001") for line in log)
    assert len([line for line in log if UPSTREAM_LINE.match(line)]) == games1
    rows1 = list(csv.DictReader(open(tmp_path / "logs/PongNoFrameskip-v4_monitor.csv")))
    assert len(rows1) == games1 and all(-21 <= float(row["score"]) <= 21 and 0 < int(row["length"]) <= 200
                                        for row in rows1)
    assert int(rows1[-1]["global_steps"]) >= 150
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "logs/runs/PongNoFrameskip-v4_training"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"charts/episode_reward", "charts/episode_length", "charts/steps_per_s"} <= tags
    # the final status line after shutdown logs the losses even though no periodic status line was due
    assert {"losses/policy_loss", "losses/value_loss", "losses/entropy", "charts/train_steps_per_s"} <= tags
    train_log = (tmp_path / "logs/PongNoFrameskip-v4_train.log").read_text()
    assert "per step: policy" in train_log

    # The mean's window counts the first run's games, so this run stops after its own 2nd game, which starts only
    # after 150 more global steps.
    r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, str(games1 + 2), "--load", "--lr", "5e-05",
                  cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"at {steps1:,} global steps" in r.stdout and "resumed the Adam statistics" in r.stdout
    assert "the command line changes the checkpoint's lr 0.0001 -> 5e-05" in r.stdout
    ckpt2 = torch.load(ckpt_path, weights_only=True)
    assert ckpt2["optimizer"]["param_groups"][0]["lr"] == 5e-05  # the new rate was used, not the saved one
    assert ckpt2["global_steps"] >= steps1 + 150
    games2 = int(ckpt2["monitor"][0])
    assert games2 >= games1 + 2  # game count carried on
    step_counts = [s["step"].item() for s in ckpt2["optimizer"]["state"].values()]
    assert min(step_counts) > max(s["step"].item() for s in ckpt["optimizer"]["state"].values())
    log2 = (tmp_path / "logs/PongNoFrameskip-v4_log").read_text().splitlines()
    assert log2[: len(log)] == log  # appended, not truncated
    assert len([line for line in log2 if UPSTREAM_LINE.match(line)]) == games2
    rows2 = list(csv.DictReader(open(tmp_path / "logs/PongNoFrameskip-v4_monitor.csv")))
    assert rows2[: len(rows1)] == rows1 and len(rows2) == games2
    assert int(rows2[-1]["global_steps"]) >= steps1 + 150

    # Normalisation restored into the workers and the monitor (issue 12, 6). A row's count is the number of frames
    # that env has normalised since the first run started: one per step, one per reset, never fewer than its
    # steps. Had the second run's processes started from zero, a row would hold only the second run's frames,
    # short of (first run's count + second run's steps) by the first run's count (>= steps1 >= 150 over the
    # workers, >= the first run's game lengths for the monitor) less the second run's few resets.
    norm2 = ckpt2["norm_stats"]
    assert norm.shape == norm2.shape == (3, 3)
    assert norm[:2, 2].sum() >= steps1 and norm[2, 2] >= sum(int(row["length"]) for row in rows1)
    assert (norm2[:, 2] >= norm[:, 2]).all(), (norm, norm2)  # no row went back to zero
    # the workers: at least their new steps on top of the restored counts (less one rollout each in case a worker
    # was stopped between counting its steps and storing its statistics)
    new_steps = ckpt2["global_steps"] - steps1
    slack = 2 * ckpt["config"]["num_steps"]
    assert norm[:2, 2].sum() > 3 * slack  # so the slack cannot hide a restart from zero
    assert norm2[:2, 2].sum() - norm[:2, 2].sum() >= new_steps - slack, (norm, norm2, new_steps)
    # the monitor: at least the second run's game lengths on top of its restored count (its statistics are stored
    # after each finished game, the last one included)
    new_lengths = sum(int(row["length"]) for row in rows2[len(rows1):])
    assert norm2[2, 2] - norm[2, 2] >= new_lengths, (norm, norm2, new_lengths)


def test_max_seconds_stops_the_run(tmp_path):
    t0 = time.time()
    r = run_entry("main.py", *TINY, *dirs(tmp_path), "--max-seconds", "3", "--max-steps", "0", cwd=tmp_path)
    assert r.returncode == 0 and "reached --max-seconds 3" in r.stdout
    assert time.time() - t0 < 60


def start_main(tmp_path, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(ROOT / "main.py"), *TINY, *dirs(tmp_path), "--max-steps", "0",
                             "--status-every-seconds", "0.2", *extra], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_children(proc, n, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = [c for c in psutil.Process(proc.pid).children(recursive=True) if "a3g" in " ".join(c.cmdline())]
        if len(kids) >= n:
            return psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.5)
    raise AssertionError("workers did not start")


def wait_for_updates(tmp_path, timeout=90):
    """Wait until a status line in the main process's log counts workers' updates (so steps were counted)."""
    log = tmp_path / "logs/PongNoFrameskip-v4_train.log"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if log.exists() and re.search(r"\| updates [1-9]", log.read_text()):
            return
        time.sleep(0.2)
    raise AssertionError("no worker update")


def gone(procs, timeout=10.0):
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)])
def test_ctrl_c_and_sigterm_stop_everything(tmp_path, sig, code):
    proc = start_main(tmp_path)
    try:
        kids = wait_for_children(proc, 3)
        wait_for_updates(tmp_path)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole process group
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, err[-2000:]
    assert gone(kids), "a child process outlived the run"
    assert "Traceback" not in err
    assert (tmp_path / "models/PongNoFrameskip-v4.ckpt").exists()
    assert torch.load(tmp_path / "models/PongNoFrameskip-v4.ckpt", weights_only=True)["global_steps"] > 0


def bad(tmp_path, *args, process=False):
    """main.py on input it refuses before anything is written, in ``tmp_path``: its error lines (exit 2, no
    traceback, no log folder). In this process by default (the parser and ``check_before_start``, what main()
    runs first), which keeps the suite short; ``process``: as a process (test_bad_env_id and the all-at-once test
    prove the exit status and the real stderr)."""
    if process:
        r = run_entry("main.py", *dirs(tmp_path), *args, cwd=tmp_path, timeout=120)
        code, err = r.returncode, r.stderr
    else:
        import contextlib
        import io

        import main
        from config import build_parser
        out = io.StringIO()
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(out), pytest.raises(SystemExit) as e:
            mp.chdir(tmp_path)
            main.check_before_start(build_parser().parse_args([*dirs(tmp_path), *args]))
        code, err = e.value.code, out.getvalue()
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(line.startswith("main.py: error: ") for line in lines)
    assert not (tmp_path / "logs").exists()  # nothing started, nothing written
    return lines


def test_bad_env_id(tmp_path):
    (line,) = bad(tmp_path, "--env", "PongNoFrameSkip-v4", process=True)
    assert "unknown environment id 'PongNoFrameSkip-v4'" in line and "PongNoFrameskip-v4" in line


def test_gpu_that_does_not_exist(tmp_path):
    (line,) = bad(tmp_path, "--gpu-ids", "99")
    assert "CUDA is not available" in line or "GPU 99 does not exist" in line


@pytest.mark.parametrize("flags", [["--queue-size", "1000000000"], ["--mode", "a3g", "--num-steps", "100000",
                                                                     "--workers", "1000"]])
def test_a_run_that_could_not_fit_in_this_machines_memory_is_refused(tmp_path, flags):
    """Before, it started and a child was killed for memory (exit -9) once its rollouts or queue had grown."""
    (line,) = bad(tmp_path, *flags)
    assert "GiB this machine has: use a smaller --num-steps" in line, line


def test_every_problem_reported_at_once(tmp_path):
    lines = bad(tmp_path, "--lr", "-1", "--workers", "0", "--gamma", "2", process=True)
    assert len(lines) == 3


@pytest.fixture
def models(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    return d


def test_corrupt_model_file_is_not_overwritten(tmp_path, models):
    dat = models / "PongNoFrameskip-v4.dat"
    dat.write_bytes(b"\x00garbage" * 10)
    (line,) = bad(tmp_path, "--load")
    assert "is corrupt or not a PyTorch weights file" in line
    assert line.endswith("): replace it with a good copy, or point to another file")
    assert dat.read_bytes() == b"\x00garbage" * 10


def test_model_file_that_is_not_a_weights_file(tmp_path, models):
    import model
    torch.save(model.A3Clstm(1, 6, 8), models / "PongNoFrameskip-v4.dat")
    (line,) = bad(tmp_path, "--load")
    assert "PongNoFrameskip-v4.dat" in line


def test_model_file_for_another_game(tmp_path, models):
    from model import A3Clstm
    torch.save(A3Clstm(1, 4).state_dict(), models / "PongNoFrameskip-v4.dat")  # Breakout has 4 actions
    (line,) = bad(tmp_path, "--load")
    assert "actor_linear.weight has shape (4, 512) in the file, the model needs (6, 512)" in line


@pytest.mark.parametrize("flag", ["--save-model-dir", "--log-dir"])
def test_an_output_folder_that_cannot_be_made_or_written(tmp_path, flag):
    """A folder below a file, or in a folder nobody can write (/proc): one line, and nothing made."""
    (tmp_path / "a_file").write_text("not a folder")
    (line,) = bad(tmp_path, flag, str(tmp_path / "a_file" / "sub"))
    assert line == f"main.py: error: {flag} '{tmp_path / 'a_file' / 'sub'}': '{tmp_path / 'a_file'}' is a file, not a folder"
    (line,) = bad(tmp_path, flag, "/proc/a3g-runs")
    assert line == (f"main.py: error: {flag} '/proc/a3g-runs' cannot be written ('/proc', where it would be "
                    f"created): pick a folder you can write to")
    assert not (tmp_path / "models").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.parametrize("flag", ["--save-model-dir", "--log-dir", "--load-model-dir"])
def test_a_folder_below_one_that_cannot_be_entered(tmp_path, monkeypatch, capsys, flag):
    """A folder named below one this user may not enter: ``Path.exists`` raises PermissionError there. One line and
    exit 2, nothing made; before, a PermissionError traceback (exit 1) from the checks."""
    import lifeline
    import main
    private = tmp_path / "private"
    private.mkdir()
    target = private / "inner" / "x"
    deny_below(monkeypatch, private)
    given = {"--save-model-dir": str(tmp_path / "models"), "--log-dir": str(tmp_path / "logs"), flag: str(target)}
    argv = [*TINY, *[x for kv in given.items() for x in kv], "--max-steps", "100"]
    if flag == "--load-model-dir":
        argv.append("--load")
    monkeypatch.setattr(main, "STOP", lifeline.StopSignals("main.py"), raising=False)
    with main_left_as_found(), pytest.raises(SystemExit) as e:
        main.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = (f"main.py: error: '{target}' cannot be read (Permission denied): pick folders this user can read and write"
            if flag == "--load-model-dir" else
            f"main.py: error: {flag} '{target}' cannot be reached (Permission denied): pick a folder you can write to")
    assert err == [want]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["private"] and not any(private.iterdir())


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_a_seed_out_of_range(tmp_path, seed):
    """gymnasium refuses a negative seed inside the workers: refused here first, in one line."""
    (line,) = bad(tmp_path, "--seed", seed)
    assert line == f"main.py: error: --seed must be between 0 and 4294967295, got {seed}"


@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--target-score", "nan"), ("--gamma", "nan")])
def test_a_number_that_is_not_finite(tmp_path, flag, value):
    (line,) = bad(tmp_path, flag, value)
    assert line == f"main.py: error: {flag} must be a finite number, got {value}"


def test_a_folder_where_the_model_file_would_be(tmp_path, models):
    (models / "PongNoFrameskip-v4.dat").mkdir()
    (line,) = bad(tmp_path)
    assert line.startswith(f"main.py: error: {models / 'PongNoFrameskip-v4.dat'} is a folder where this run would "
                           f"write its model file")
    (line,) = bad(tmp_path, "--load")
    assert line.startswith(f"main.py: error: --load: {models / 'PongNoFrameskip-v4.dat'} is a folder, not a model file")


def test_a_folder_where_the_checkpoint_would_be_is_refused_on_a_resume_into_the_same_folder(tmp_path, models):
    """--load resumes from the .dat beside it, and every checkpoint write would fail after training: refused first."""
    from model import A3Clstm
    torch.save(A3Clstm(1, 6, 32).state_dict(), models / "PongNoFrameskip-v4.dat")
    (models / "PongNoFrameskip-v4.ckpt").mkdir()
    (line,) = bad(tmp_path, *TINY, "--load")
    assert line.startswith(f"main.py: error: {models / 'PongNoFrameskip-v4.ckpt'} is a folder where this run would "
                           f"write its model file")


@pytest.mark.parametrize("extra, limit", [(["--max-steps", "400"], "--max-steps 400: pass a larger --max-steps (0: no limit)"),
                                          (["--lr-anneal-steps", "500"], "the end of --lr-anneal-steps 500: pass a "
                                                                         "larger --lr-anneal-steps (and --max-steps, "
                                                                         "where given: a run stops at the end of its "
                                                                         "schedule), or --lr-anneal-steps 0 for a "
                                                                         "constant --lr,")])
def test_a_resume_already_at_its_step_limit_is_refused(tmp_path, models, extra, limit):
    """A checkpoint at or past the run's last step: one line and nothing written, not a run that stops at once
    and rewrites the checkpoint."""
    from checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION
    from model import A3Clstm
    ckpt = models / "PongNoFrameskip-v4.ckpt"
    torch.save({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "env": "PongNoFrameskip-v4",
                "model": A3Clstm(1, 6, 512).state_dict(), "optimizer": None, "global_steps": 500}, ckpt)
    before = ckpt.read_bytes()
    (line,) = bad(tmp_path, "--load", *extra)
    assert line == f"main.py: error: --load: {ckpt} is at 500 global steps, already at {limit} to train on"
    assert ckpt.read_bytes() == before and sorted(p.name for p in models.iterdir()) == [ckpt.name]


@pytest.mark.parametrize("config, extra, want", [
    # before --lr-anneal-steps and --train-passes existed (a GA3C checkpoint at 2M steps): a constant rate, one pass
    ({"mode": "ga3c"}, [], (0, 1, 50_000_000, "kept the checkpoint's --lr-anneal-steps 0 and --train-passes 1 (GA3C "
                                              "mode's defaults are 1,500,000 and 2; give the flags to change them)")),
    ({"mode": "ga3c", "lr_anneal_steps": 3_000_000, "train_passes": 2}, [],
     (3_000_000, 2, 3_000_000, "kept the checkpoint's --lr-anneal-steps 3,000,000 (GA3C mode's default is 1,500,000; "
                               "give the flag to change it)")),
    ({"mode": "ga3c", "lr_anneal_steps": 1_500_000, "train_passes": 2}, ["--lr-anneal-steps", "4000000"],
     (4_000_000, 2, 4_000_000, "")),  # given: the command line's
    ({"mode": "ga3c"}, ["--lr-anneal-steps", "3000000", "--max-steps", "2500000"],
     (3_000_000, 1, 2_500_000, "kept the checkpoint's --train-passes 1 (GA3C mode's default is 2; give the flag to "
                               "change it)")),
    ({"mode": "ga3c"}, ["--max-steps", "2500000", "--train-passes", "3"],
     (0, 3, 2_500_000, "kept the checkpoint's --lr-anneal-steps 0 (GA3C mode's default is 1,500,000; give the flag "
                       "to change it)")),  # the given --max-steps, cut to 1.5M by the default, comes back
    ({"mode": "a3g", "lr_anneal_steps": 2_500_000}, ["--mode", "a3g"],
     (2_500_000, 1, 2_500_000, "kept the checkpoint's --lr-anneal-steps 2,500,000 (A3G mode's default is 0; give the "
                               "flag to change it)")),
    ({"mode": "a3g"}, [], (0, 2, 50_000_000, "kept the checkpoint's --lr-anneal-steps 0 (GA3C mode's default is "
                                             "1,500,000; give the flag to change it)")),  # A3G's into GA3C mode
    # a run started with --is-clip (one pass then) resumed with its own command: the check sees the kept pass
    ({"mode": "ga3c", "is_clip": 2.0}, ["--is-clip", "2"],
     (0, 1, 50_000_000, "kept the checkpoint's --lr-anneal-steps 0 and --train-passes 1 (GA3C mode's defaults are "
                        "1,500,000 and 2; give the flags to change them)")),
    # --later-passes lstm goes on unless given; given, the command line's
    ({"mode": "ga3c", "lr_anneal_steps": 3_000_000, "train_passes": 2, "later_passes": "lstm"},
     ["--lr-anneal-steps", "3000000"],
     (3_000_000, 2, 3_000_000, "kept the checkpoint's --later-passes lstm (GA3C mode's default is full; give the flag "
                               "to change it)", "lstm")),
    ({"mode": "ga3c", "lr_anneal_steps": 3_000_000, "train_passes": 2, "later_passes": "lstm"},
     ["--later-passes", "full", "--lr-anneal-steps", "3000000"], (3_000_000, 2, 3_000_000, "", "full")),
    ({"mode": "ga3c", "train_passes": 3, "later_passes": "lstm"}, ["--later-passes", "lstm"],
     (0, 3, 50_000_000, "kept the checkpoint's --lr-anneal-steps 0 and --train-passes 3 (GA3C mode's defaults are "
                        "1,500,000 and 2; give the flags to change them)", "lstm")),
    ({"mode": "ga3c", "lr_anneal_steps": 3_000_000, "train_passes": 2, "later_passes": "lstm"},  # one pass: unused
     ["--train-passes", "1", "--lr-anneal-steps", "3000000"], (3_000_000, 1, 3_000_000, "", "full")),
    ({"mode": "a3g", "later_passes": "lstm"}, [],  # an A3G checkpoint's value is not GA3C mode's
     (0, 2, 50_000_000, "kept the checkpoint's --lr-anneal-steps 0 (GA3C mode's default is 1,500,000; give the "
                        "flag to change it)", "full"))])
def test_a_resume_keeps_the_checkpoints_schedule_and_passes_unless_given(tmp_path, models, config, extra, want):
    """A checkpoint from before GA3C mode's defaults became --lr-anneal-steps 1500000 --train-passes 2 (at 2M
    steps, past that schedule's end) goes on as it was started: resumed with the same command, it was refused as
    already at the end of a schedule it never had, or (below 1.5M) went on at another rate and number of passes."""
    import main
    from checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION
    from config import build_parser
    from model import A3Clstm
    torch.save({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "env": "PongNoFrameskip-v4",
                "model": A3Clstm(1, 6, 512).state_dict(), "optimizer": None, "global_steps": 2_000_000,
                "config": {"env": "PongNoFrameskip-v4", **config}}, models / "PongNoFrameskip-v4.ckpt")
    args = build_parser().parse_args([*dirs(tmp_path), "--load", *extra])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        main.check_before_start(args)
    got = (args.lr_anneal_steps, args.train_passes, args.max_steps, args._kept_line)
    assert got + ((args.later_passes,) if len(want) == 5 else ()) == want


def test_a_flag_that_the_kept_single_pass_makes_useless_is_refused(tmp_path, models):
    """--pass-clip passes the first check against GA3C mode's default of two passes; the checkpoint's one pass,
    kept, leaves it changing nothing: refused in one line, as without --load."""
    from checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION
    from model import A3Clstm
    torch.save({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "env": "PongNoFrameskip-v4",
                "model": A3Clstm(1, 6, 512).state_dict(), "optimizer": None, "global_steps": 2_000_000,
                "config": {"env": "PongNoFrameskip-v4", "mode": "ga3c"}}, models / "PongNoFrameskip-v4.ckpt")
    (line,) = bad(tmp_path, "--load", "--pass-clip", "0.3")
    assert line == ("main.py: error: --pass-clip changes nothing here: it clips the surrogate of --train-passes 2 or "
                    "more; give those too, or leave it out")


def test_a_given_max_steps_cut_by_the_schedule_is_named(tmp_path):
    from config import build_parser, max_steps_cut_line, validate
    args = build_parser().parse_args(["--max-steps", "10000000"])
    assert validate(args) == [] and args.max_steps == 1_500_000
    assert max_steps_cut_line(args) == ("--max-steps 10,000,000 is cut to 1,500,000, the end of --lr-anneal-steps "
                                        "(the learning rate is 0 from there): give --lr-anneal-steps 10,000,000 to "
                                        "anneal over the whole run, or 0 for a constant --lr")
    for argv in ([], ["--max-steps", "1000000"], ["--max-steps", "10000000", "--lr-anneal-steps", "0"],
                 ["--max-steps", "10000000", "--mode", "a3g"], ["--max-steps", "0"]):  # the default cut, no cut,
        # no schedule, or "no limit" (the start line says where the run stops)
        args = build_parser().parse_args(argv)
        assert validate(args) == [] and max_steps_cut_line(args) is None, argv


def test_a_run_loads_a_float16_file_and_saves_float32(tmp_path, models):
    """--load from a model stored in float16: the run starts from its values (at a learning rate of 1e-9 the weights
    it saves are those values to within 1e-6; a fresh initialisation differs by far more), trains in float32 and
    writes float32 files (the .dat and the checkpoint's model)."""
    import model
    torch.manual_seed(0)
    half = {k: v.half() for k, v in model.A3Clstm(1, 6, 32).state_dict().items()}
    torch.save(half, models / "PongNoFrameskip-v4.dat")
    r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, "1", "--load", "--lr", "1e-9", "--seed", "5",
                  cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"loaded {models / 'PongNoFrameskip-v4.dat'}" in r.stdout
    dat = torch.load(models / "PongNoFrameskip-v4.dat", weights_only=True)
    ckpt = torch.load(models / "PongNoFrameskip-v4.ckpt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in [*dat.values(), *ckpt["model"].values()])
    assert all(torch.allclose(ckpt["model"][k], v.float(), rtol=0, atol=1e-6) for k, v in half.items())
    assert ckpt["global_steps"] >= 1


def test_load_with_nothing_to_load(tmp_path):
    (line,) = bad(tmp_path, "--load")
    assert "--load: neither" in line


def test_an_existing_model_is_never_overwritten_by_a_new_run(tmp_path, models):
    dat = models / "PongNoFrameskip-v4.dat"
    dat.write_bytes(b"a trained model")
    (line,) = bad(tmp_path)
    assert "PongNoFrameskip-v4.dat exists and this run would overwrite it: to continue training from it, pass --load" in line
    assert dat.read_bytes() == b"a trained model"


def test_a_resume_from_another_folder_onto_a_model_says_which_flag_to_drop(tmp_path, models):
    """``--load --load-model-dir A`` into a --save-model-dir that holds a model: --load is given already, so the
    line says to leave out --load-model-dir or pick another --save-model-dir (before: "pass --load")."""
    from model import A3Clstm
    other = tmp_path / "other"
    other.mkdir()
    torch.save(A3Clstm(1, 6, 512).state_dict(), other / "PongNoFrameskip-v4.dat")
    dat = models / "PongNoFrameskip-v4.dat"
    dat.write_bytes(b"a trained model")
    (line,) = bad(tmp_path, "--load", "--load-model-dir", str(other))
    assert line == (f"main.py: error: {dat} exists and this run, which resumes from --load-model-dir {other}, would "
                    f"overwrite it: leave out --load-model-dir to go on with the run in --save-model-dir {models}, or "
                    f"pass --save-model-dir DIR with another folder"), line
    assert dat.read_bytes() == b"a trained model"


# --------------------------------------------- a worker that stops at --max-steps is a clean stop (issue 12, 6a)
class FakeProcess:
    """Stands in for a started ``mp.Process`` in main's loop, in-process, with no training.

    The monitor and a worker that keeps training stay alive until the run's stop flag is set. A ``finishing``
    worker is alive the first time main asks; the second time, it counts its last ``last_steps`` steps into the
    real shared counter and exits 0, both *at the moment main reads* ``is_alive()``: exactly a worker that counted
    its last steps and exited on its own at the budget between two of main's reads. Main must read which
    processes ended before it reads the counter; read the other way round, it sees the counter short of the
    budget and then a worker that exited, and reports a crash.
    """

    def __init__(self, run, rank=None, last_steps=0, last_code=0):
        self.run, self.rank, self.last_steps, self.last_code = run, rank, last_steps, last_code
        self.exitcode = None
        self.asked = 0
        self.pid = 0

    def is_alive(self):
        self.asked += 1
        if self.exitcode is None:
            if self.last_steps and self.asked >= 2:
                self.run.add_steps(self.rank, self.last_steps)  # counts its last steps, then exits
                self.exitcode = self.last_code
            elif not self.last_steps and self.run.stop.is_set():
                self.exitcode = 0  # stopped through the flag, as a real child does
        return self.exitcode is None

    def join(self, timeout=None):
        self.is_alive()

    def terminate(self):
        if self.exitcode is None:
            self.exitcode = -signal.SIGTERM

    def kill(self):
        if self.exitcode is None:
            self.exitcode = -signal.SIGKILL

    def close(self):
        pass


def in_process_args(tmp_path, *extra):
    from config import build_parser, validate
    args = build_parser().parse_args(["--workers", "2", *dirs(tmp_path), "--hidden-size", "32",
                                      "--env-config", str(ROOT / "config.json"), *extra])
    assert not validate(args)
    return args


@contextlib.contextmanager
def main_left_as_found():
    """Around main's code run in this process: the SIGINT/SIGTERM handlers it changes are put back, and its log's
    file handler closed."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        logger = logging.getLogger("main.PongNoFrameskip-v4")
        for h in list(logger.handlers):
            logger.removeHandler(h)
            h.close()


def run_training_with_fakes(tmp_path, monkeypatch, budget, counted_before, last_steps, last_code=0,
                            interrupt_launch=False):
    """main.run_training, in-process, with fake children: worker 0 and the monitor keep going, worker 1 counts
    ``last_steps`` more and exits ``last_code`` on main's second look. With ``interrupt_launch``, the launch
    raises ``KeyboardInterrupt`` (a second Ctrl-C) after starting the monitor, as ``lifeline.start_child`` does.
    Returns (exit code, main's log, fake processes)."""
    import a3g.run
    import lifeline
    import main

    fakes = {}

    def fake_launch(ctx, args, shared_model, optimizer, run, elapsed_offset=0.0, monitor=True, average_model=None,
                    procs=None):
        procs = [] if procs is None else procs
        run.add_steps(0, counted_before)
        fakes.update({"monitor": FakeProcess(run), "worker 0": FakeProcess(run, 0),
                      "worker 1": FakeProcess(run, 1, last_steps=last_steps, last_code=last_code)})
        for slot in range(run.workers + 1):
            run.mark_ready(slot)
        for role, p in fakes.items():
            procs.append((role, p))
            if interrupt_launch:
                raise KeyboardInterrupt
        return procs

    def no_real_child(process):
        raise AssertionError("run_training started a real child: a3g.run.launch is no longer where children start")

    monkeypatch.setattr(a3g.run, "launch", fake_launch)
    monkeypatch.setattr(lifeline, "start_child", no_real_child)  # never train for real if the fake is bypassed
    args = in_process_args(tmp_path, "--max-steps", str(budget))
    (tmp_path / "models").mkdir()
    with main_left_as_found():
        code = main.run_training(args, [], lifeline.StopSignals(), 6, None, None, None)
    return code, (tmp_path / "logs/PongNoFrameskip-v4_train.log").read_text(), fakes


def test_a_worker_that_counts_its_last_steps_and_exits_at_the_budget_is_a_clean_stop(tmp_path, monkeypatch):
    """Issue 12, 6a: deterministic, on main's real loop (run_training with fake children): the worker's last
    steps and its exit both happen between two of main's reads; the run must stop with 0 at --max-steps."""
    code, log, fakes = run_training_with_fakes(tmp_path, monkeypatch, budget=100, counted_before=60, last_steps=40)
    assert fakes["worker 1"].exitcode == 0 and fakes["worker 1"].asked >= 2  # the fake did exit under main's eyes
    assert "exited unexpectedly" not in log, log
    assert "stopped: reached --max-steps 100;" in log, log
    assert code == 0, log
    assert torch.load(tmp_path / "models/PongNoFrameskip-v4.ckpt", weights_only=True)["global_steps"] == 100


def test_a_worker_that_exits_short_of_the_budget_is_still_a_crash(tmp_path, monkeypatch):
    """The other side of the same decision: exit code 0 below the budget is not a normal stop."""
    code, log, fakes = run_training_with_fakes(tmp_path, monkeypatch, budget=1000, counted_before=60, last_steps=40)
    assert fakes["worker 1"].exitcode == 0
    assert "stopped: worker 1 exited unexpectedly (exit code 0);" in log, log
    assert code == 1, log


def test_a_worker_that_crashes_in_the_tick_the_budget_is_reached_is_still_a_crash(tmp_path, monkeypatch):
    """A process that died is reported before a stop condition met at the same look: worker 1 counts the last
    steps to the budget and exits 1 between two of main's reads. Checked the other way round, the run stopped
    with 0 at --max-steps and the crash went unsaid."""
    code, log, fakes = run_training_with_fakes(tmp_path, monkeypatch, budget=100, counted_before=60, last_steps=40,
                                               last_code=1)
    assert fakes["worker 1"].exitcode == 1
    assert "stopped: worker 1 exited unexpectedly (exit code 1);" in log, log
    assert code == 1, log


def test_a_second_ctrl_c_during_the_launch_stops_the_processes_already_started(tmp_path, monkeypatch):
    """A KeyboardInterrupt out of the launch (a second stop signal while children start) leaves main without the
    launch's return value: the processes started so far (``mode.procs``) are stopped all the same. Before, main
    stopped none of them and said that no process was started."""
    code, log, fakes = run_training_with_fakes(tmp_path, monkeypatch, budget=100, counted_before=0, last_steps=0,
                                               interrupt_launch=True)
    assert code == 130, log
    assert fakes["monitor"].exitcode is not None and fakes["monitor"].asked > 0  # shut down through the stop flag
    assert "stopped: interrupted (Ctrl-C);" in log and "no process was started" not in log, log


def main_in_process(monkeypatch, tmp_path, stop):
    """``main.main`` in this process with ``stop`` as the module's ``STOP`` (the handler main.py installs when run as
    a script); the signal handlers it changes are put back. Returns its exit code."""
    import main
    monkeypatch.setattr(main, "STOP", stop, raising=False)
    with main_left_as_found():
        return main.main([*TINY, *dirs(tmp_path), "--max-steps", "100"])


def test_main_arms_its_stop_signals_before_it_starts_anything(tmp_path, monkeypatch):
    """main.py's handler ends the process at once on a second stop signal during the imports and checks; main()
    must arm it (a second signal raises KeyboardInterrupt) before it takes locks or starts a process, or a second
    Ctrl-C during the launch would exit with "nothing written" and skip the shutdown and the final checkpoint."""
    import a3g.run
    import lifeline
    stop = lifeline.StopSignals("main.py")
    seen = []

    def fake_launch(*a, **k):
        seen.append(stop.prog)
        raise KeyboardInterrupt  # a second Ctrl-C before the first process started

    monkeypatch.setattr(a3g.run, "launch", fake_launch)
    assert main_in_process(monkeypatch, tmp_path, stop) == 130
    assert seen == [None], f"the launch ran with the start-up handler still unarmed: {seen}"


def test_a_second_ctrl_c_before_the_run_proper_is_one_line_and_stops_nothing_it_did_not_start(tmp_path, monkeypatch,
                                                                                             capsys):
    """A KeyboardInterrupt (a second stop signal) after the locks were taken and before run_training's own handling
    (building the model, the mode, the logger): one line, the first signal's exit code, the locks released, no
    process started. Before, a traceback."""
    import lifeline
    import main

    stop = lifeline.StopSignals("main.py")

    def interrupted(folder):
        stop.signal = signal.SIGTERM  # a first signal, then the second one's KeyboardInterrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(main, "remove_stale_temp_files", interrupted)
    assert main_in_process(monkeypatch, tmp_path, stop) == 143
    err = capsys.readouterr().err
    assert err == "main.py: terminated (SIGTERM) before training started; no process was started\n", err
    from checkpoint import RunLock
    RunLock(tmp_path / "models").release()  # the lock was released: another run can take it


def test_a_full_shared_memory_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """torch puts the shared model, optimizer statistics and run state in /dev/shm files; a full or small one
    (Docker's default is 64 MB) fails there with a RuntimeError that is not an allocator's. Before, a traceback and
    exit 1; now one line that says where the space is needed."""
    import lifeline
    import main

    def shm_full(*args, **kwargs):
        raise RuntimeError("unable to write to file </torch_4242_1729_0>: No space left on device (28)")
    monkeypatch.setattr(main, "A3gRun", shm_full)
    assert main_in_process(monkeypatch, tmp_path, lifeline.StopSignals("main.py")) == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "main.py: error: the shared memory is full (unable to write to file </torch_4242_1729_0>: No space left on "
        "device (28)): free space in /dev/shm (in a container, give it more: docker run --shm-size 2g), or use a "
        "smaller --hidden-size or fewer processes or env slots"), out
    assert "Traceback" not in out.out + out.err and not (tmp_path / "models" / "PongNoFrameskip-v4.ckpt").exists()


@pytest.mark.parametrize("failure", [
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 8000000000000 bytes. Error code 12 (Cannot allocate memory)")])
def test_a_run_too_large_for_the_memory_is_one_line_and_exit_2_with_nothing_started(tmp_path, monkeypatch, capsys,
                                                                                   failure):
    """Building the run (the shared model, optimizer and run state, before any process starts) on a machine without
    the memory for it: one line that says which flags make it smaller, exit 2, the locks released, no checkpoint.
    Before, a traceback and exit 1. Any other error there is still raised."""
    import lifeline
    import main

    def too_large(*args, **kwargs):
        raise failure

    monkeypatch.setattr(main, "A3gRun", too_large)
    assert main_in_process(monkeypatch, tmp_path, lifeline.StopSignals("main.py")) == 2
    out = capsys.readouterr()
    gist = "MemoryError" if isinstance(failure, MemoryError) else (
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000000000 bytes. Error code 12 "
        "(Cannot allocate memory)")
    lines = [line for line in (out.out + out.err).splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].endswith(
        f"main.py: error: not enough memory on this machine for the run ({gist}): use a smaller --hidden-size or "
        f"--score-window, or fewer processes or env slots"), out
    assert "Traceback" not in out.out + out.err
    assert not (tmp_path / "models" / "PongNoFrameskip-v4.ckpt").exists()
    from checkpoint import RunLock
    RunLock(tmp_path / "models").release()  # the lock was released: another run can take it

    def a_bug(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(main, "A3gRun", a_bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main_in_process(monkeypatch, tmp_path / "again", lifeline.StopSignals("main.py"))


@pytest.mark.parametrize("error", ["write", "bug"])
def test_a_failure_of_main_itself_mid_run_ends_it_in_one_line_after_the_final_checkpoint(tmp_path, monkeypatch,
                                                                                          error):
    """A file main cannot write while the run goes on (GA3C's results.txt on a full disk: ``tick`` and again in
    ``close``) ends the run with that one line and exit 1, the processes stopped and the final checkpoint
    written; so does any other exception of the main loop, its traceback logged. Before, the exception left the
    loop, ``close`` raised it again, and the final checkpoint was never tried."""
    from a3g.run import A3gRun
    from checkpoint import CheckpointWriteError
    line = "could not write /x/results.txt: the disk is full (No space left on device); free space or use another folder"
    boom = CheckpointWriteError(line) if error == "write" else RuntimeError("boom")
    ticks = []

    def tick(self, now):
        ticks.append(now)
        if len(ticks) >= 2:
            raise boom

    def close(self):
        raise boom

    monkeypatch.setattr(A3gRun, "tick", tick)
    monkeypatch.setattr(A3gRun, "close", close)
    code, log, fakes = run_training_with_fakes(tmp_path, monkeypatch, budget=1000, counted_before=60, last_steps=0)
    assert code == 1, log
    stop = [x for x in log.splitlines() if "stopped:" in x]
    want = line if error == "write" else "the main process failed: RuntimeError: boom"
    assert len(stop) == 1 and f"stopped: {want};" in stop[0], log
    assert ("Traceback" in log) == (error == "bug"), log
    assert all(p.exitcode is not None for p in fakes.values())
    ckpt = torch.load(tmp_path / "models/PongNoFrameskip-v4.ckpt", weights_only=True)
    assert ckpt["global_steps"] == 60 and "checkpoint " in stop[0], log


def test_exited_unexpectedly_accepts_only_a_worker_at_the_budget(tmp_path):
    import main
    from a3g.run import A3gRun
    from run_state import RunState

    class Ended:
        def __init__(self, exitcode):
            self.exitcode = exitcode

        def is_alive(self):
            return self.exitcode is None

    mode = A3gRun(in_process_args(tmp_path), None, None, None)
    ok, alive = Ended(0), Ended(None)
    assert isinstance(mode.run, RunState)
    assert main.exited_unexpectedly([("worker 0", alive), ("worker 1", ok)], mode, True) is None
    assert main.exited_unexpectedly([("worker 1", ok)], mode, False) == ("worker 1", 0)
    assert main.exited_unexpectedly([("worker 1", Ended(1))], mode, True) == ("worker 1", 1)
    assert main.exited_unexpectedly([("worker 0", Ended(-9))], mode, True) == ("worker 0", -9)
    assert main.exited_unexpectedly([("monitor", Ended(0))], mode, True) == ("monitor", 0)  # never expected


def test_every_mode_implements_the_interface_main_drives(tmp_path):
    """``modes.Mode`` is the one description of what main's driver calls: each mode subclasses it and leaves no
    abstract member unwritten, and a mode that lacked one could not be built at all."""
    from a3g.run import A3gRun
    from ga3c.run import Ga3cRun
    from modes import Mode
    from multinode.run import RayRun

    for cls in (A3gRun, Ga3cRun, RayRun):
        assert Mode in cls.__mro__ and not cls.__abstractmethods__, cls
    assert Mode.__abstractmethods__ == {"describe", "restore", "slot_of", "launch", "expected_exit", "status"}

    class NoStatus(A3gRun):
        status = Mode.status

    with pytest.raises(TypeError, match="status"):
        NoStatus(in_process_args(tmp_path), None, None, None)
    mode = A3gRun(in_process_args(tmp_path), None, None, None)
    assert mode.failed is None and mode.errors() == [] and mode.snapshot() == {}


def test_default_folders_keep_the_modes_apart_so_the_readme_commands_run_in_order(tmp_path):
    """After the README's first command (a GA3C run: its model in runs/<env>-ga3c/), its A3G and Ray examples start
    new runs with the default folders: runs/<env>/ and runs/<env>-ray/ (logs/ likewise), so neither is refused for
    the GA3C model, while a second GA3C run into runs/<env>-ga3c/ still is. Each real run stops right after that
    check: the A3G one at a lock that this test holds on its folder, the Ray one at an address where nothing
    answers."""
    import socket

    from checkpoint import RunLock
    from config import build_parser, validate

    env = "PongNoFrameskip-v4"
    for flags, folder in ((["--mode", "a3g"], env), (["--workers", "2"], env), ([], f"{env}-ga3c"),
                          (["--mode", "ga3c"], f"{env}-ga3c"), (["--ray-address", "auto"], f"{env}-ray")):
        args = build_parser().parse_args(["--env-config", str(ROOT / "config.json"), *flags])
        assert not validate(args)
        assert (args.save_model_dir, args.load_model_dir, args.log_dir) == (f"runs/{folder}", f"runs/{folder}",
                                                                            f"logs/{folder}")
    args = build_parser().parse_args(["--mode", "ga3c", "--save-model-dir", "a", "--log-dir", "b"])
    validate(args)
    assert (args.save_model_dir, args.log_dir) == ("a", "b")

    (tmp_path / "runs" / f"{env}-ga3c").mkdir(parents=True)
    (tmp_path / "runs" / f"{env}-ga3c" / f"{env}.ckpt").write_bytes(b"the first run's checkpoint")
    common = ["--env", env, "--env-config", str(ROOT / "config.json")]
    for mode in (["--mode", "ga3c"], []):  # GA3C mode, named or by default
        r = run_entry("main.py", *common, *mode, cwd=tmp_path)
        assert r.returncode == 2 and "would overwrite it" in r.stderr, r.stderr[-2000:]

    (tmp_path / "runs" / env).mkdir()
    lock = RunLock(tmp_path / "runs" / env)
    try:
        r = run_entry("main.py", *common, "--mode", "a3g", cwd=tmp_path)
    finally:
        lock.release()
    assert r.returncode == 2 and f"is writing to runs/{env}:" in r.stderr, r.stderr[-2000:]
    assert "would overwrite" not in r.stderr

    # a plain --load (GA3C mode, the default) finds no run in runs/<env>-ga3c but an A3G-mode one in runs/<env>
    (tmp_path / "runs" / env / f"{env}.ckpt").write_bytes(b"an A3G run's checkpoint")
    (tmp_path / "runs" / f"{env}-ga3c" / f"{env}.ckpt").unlink()
    r = run_entry("main.py", *common, "--load", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert f"an A3G-mode run is in runs/{env}: add --mode a3g to resume it in A3G mode" in r.stderr
    # and the other way: an A3G-mode --load finds a GA3C run only (before: pointed at the shipped model)
    (tmp_path / "runs" / f"{env}-ga3c" / f"{env}.ckpt").write_bytes(b"a GA3C run's checkpoint")
    (tmp_path / "runs" / env / f"{env}.ckpt").unlink()
    r = run_entry("main.py", *common, "--mode", "a3g", "--load", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert (f"a GA3C-mode run is in runs/{env}-ga3c: leave out --mode a3g, --workers and --distributed-step-size to "
            f"resume it in GA3C mode") in r.stderr, r.stderr

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_entry("main.py", *common, "--ray-address", f"127.0.0.1:{port}", cwd=tmp_path)
    assert r.returncode == 2 and "nothing answers there" in r.stderr, r.stderr[-2000:]
    assert "would overwrite" not in r.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [env, f"{env}-ga3c"]


@pytest.mark.parametrize("saved, argv, line", [
    ({"mode": "a3g"}, [], "the checkpoint was trained in A3G mode; this run goes on in GA3C mode (--mode a3g goes "
                          "on in A3G mode)"),
    ({"mode": "a3g", "ray_address": "local"}, [], "the checkpoint was trained in A3G mode on Ray; this run goes on in "
                                                  "GA3C mode (--ray-address ADDRESS goes on on Ray)"),
    ({"mode": "a3g", "ray_address": "local"}, ["--mode", "a3g"],
     "the checkpoint was trained in A3G mode on Ray; this run goes on in A3G mode"),
    ({"mode": "ga3c"}, ["--workers", "2"], "the checkpoint was trained in GA3C mode; this run goes on in A3G mode"),
    ({}, ["--mode", "a3g"], ""),  # a checkpoint from before modes were saved is A3G mode's
    ({"mode": "ga3c"}, [], ""), ({"mode": "a3g", "ray_address": "auto"}, ["--ray-address", "auto"], ""),
])
def test_a_resumed_checkpoint_of_another_mode_is_named_with_the_way_back(saved, argv, line):
    from config import build_parser
    from main import mode_change_line
    assert mode_change_line(saved, build_parser().parse_args(argv)) == line


@pytest.mark.parametrize("saved, argv, line", [
    ({"mode": "ga3c", "train_batch": 4}, ["--agents", "8", "--envs-per-agent", "16"],
     "the checkpoint was trained with --train-batch 4; this run goes on with --train-batch 32"),
    ({"mode": "ga3c", "train_batch": 4}, ["--agents", "2", "--envs-per-agent", "8"], ""),
    ({"mode": "ga3c"}, ["--agents", "8", "--envs-per-agent", "16"], ""),  # saved before the flag existed
    ({"mode": "a3g", "train_batch": 4}, ["--agents", "8", "--envs-per-agent", "16"], ""),  # the mode line says it
    ({"mode": "ga3c", "train_batch": 4}, ["--mode", "a3g"], ""),
])
def test_a_resumed_ga3c_checkpoint_with_another_train_batch_is_named(saved, argv, line):
    from config import build_parser, validate
    from main import train_batch_change_line
    args = build_parser().parse_args(argv)
    validate(args)
    assert train_batch_change_line(saved, args) == line


@pytest.mark.parametrize("saved, argv, line", [
    ({"mode": "ga3c"}, ["--train-passes", "2"],  # saved before the flag existed: one pass
     "the checkpoint was trained with --train-passes 1; this run goes on with --train-passes 2 --pass-clip 0.2"),
    ({"mode": "ga3c", "train_passes": 3, "pass_clip": 0.2}, ["--train-passes", "3", "--pass-clip", "0.1"],
     "the checkpoint was trained with --train-passes 3 --pass-clip 0.2; this run goes on with --train-passes 3 "
     "--pass-clip 0.1"),
    ({"mode": "ga3c", "train_passes": 2, "pass_clip": 0.2}, ["--train-passes", "1"],
     "the checkpoint was trained with --train-passes 2 --pass-clip 0.2; this run goes on with --train-passes 1"),
    ({"mode": "ga3c", "train_passes": 1, "pass_clip": 0.3}, ["--train-passes", "1"], ""),  # unused with one pass
    ({"mode": "ga3c", "train_passes": 2, "pass_clip": 0.2}, [], ""),  # GA3C mode's default
    ({"mode": "ga3c", "train_passes": 2, "pass_clip": 0.2, "later_passes": "full"}, ["--later-passes", "lstm"],
     "the checkpoint was trained with --train-passes 2 --pass-clip 0.2; this run goes on with --train-passes 2 "
     "--pass-clip 0.2 --later-passes lstm"),
    ({"mode": "ga3c", "train_passes": 2, "pass_clip": 0.2, "later_passes": "lstm"}, ["--later-passes", "lstm"], ""),
    ({"mode": "ga3c", "train_passes": 1, "later_passes": "lstm"}, ["--train-passes", "1"], ""),  # unused: one pass
    ({"mode": "a3g"}, ["--train-passes", "2"], ""),  # the mode line says it
])
def test_a_resumed_ga3c_checkpoint_with_other_train_passes_is_named(saved, argv, line):
    from config import build_parser, validate
    from main import train_passes_change_line
    args = build_parser().parse_args(argv)
    validate(args)
    assert train_passes_change_line(saved, args) == line


@pytest.mark.parametrize("saved,argv,line", [
    ({"mode": "ga3c"}, [], ""),  # a checkpoint from before the flags: none
    ({"mode": "ga3c", "short_game_slots": 1, "short_game_length": 20, "greedy_slots": 1}, [],
     "the checkpoint was trained with --short-game-slots 1 --short-game-length 20 --greedy-slots 1; this run goes on "
     "with no short-game or greedy slots"),
    ({"mode": "ga3c", "short_game_slots": 2, "short_game_length": 150, "greedy_slots": 0},
     ["--short-game-slots", "2"], ""),
    ({"mode": "ga3c", "short_game_slots": 2, "short_game_length": 150, "greedy_slots": 0},
     ["--short-game-slots", "2", "--short-game-length", "100"],
     "the checkpoint was trained with --short-game-slots 2 --short-game-length 150; this run goes on with "
     "--short-game-slots 2 --short-game-length 100"),
    ({"mode": "ga3c", "short_game_slots": 0, "short_game_length": 90, "greedy_slots": 0},
     ["--greedy-slots", "2", "--train-passes", "1"],
     "the checkpoint was trained with no short-game or greedy slots; this run goes on with --greedy-slots 2"),
    ({"mode": "a3g"}, ["--greedy-slots", "2", "--train-passes", "1"], ""),  # the mode line says it
    ({"mode": "ga3c", "short_game_slots": 0, "short_game_length": 150, "greedy_slots": 0},
     ["--short-game-slots", "2", "--short-games-after-score", "19"],
     "the checkpoint was trained with no short-game or greedy slots; this run goes on with --short-game-slots 2 "
     "--short-game-length 150 --short-games-after-score 19"),
    ({"mode": "ga3c", "short_game_slots": 2, "short_game_length": 150, "greedy_slots": 0,
      "short_games_after_score": 19.0}, ["--short-game-slots", "2", "--short-games-after-score", "19"], ""),
    ({"mode": "ga3c", "short_game_slots": 2, "short_game_length": 150, "greedy_slots": 0,
      "short_games_after_score": 19.0}, ["--short-game-slots", "2"],
     "the checkpoint was trained with --short-game-slots 2 --short-game-length 150 --short-games-after-score 19; "
     "this run goes on with --short-game-slots 2 --short-game-length 150"),
])
def test_a_resumed_ga3c_checkpoint_with_other_short_game_or_greedy_slots_is_named(saved, argv, line):
    from config import build_parser, validate
    from main import slots_change_line
    args = build_parser().parse_args(argv)
    assert validate(args) == []
    assert slots_change_line(saved, args) == line


@pytest.mark.parametrize("config,field", [
    ({"train_passes": None}, "config.train_passes"), ({"train_passes": "2"}, "config.train_passes"),
    ({"train_passes": 0}, "config.train_passes"), ({"train_passes": True}, "config.train_passes"),
    ({"train_passes": 2, "pass_clip": None}, "config.pass_clip"), ({"pass_clip": float("nan")}, "config.pass_clip"),
    ({"pass_clip": 1.5}, "config.pass_clip"), ({"pass_clip": "0.2"}, "config.pass_clip"),
    ({"short_game_slots": "1"}, "config.short_game_slots"), ({"greedy_slots": -1}, "config.greedy_slots"),
    ({"short_game_length": 1.5}, "config.short_game_length"),
    ({"later_passes": "conv"}, "config.later_passes"), ({"later_passes": None}, "config.later_passes"),
    ({"short_games_after_score": "19"}, "config.short_games_after_score"),
    ({"short_games_after_score": float("inf")}, "config.short_games_after_score"),
    ({"short_games_after_score": True}, "config.short_games_after_score"),
])
def test_a_checkpoint_with_damaged_train_passes_is_refused_in_one_line(config, field, tmp_path):
    """The resume's train_passes_change_line reads these two flags from the checkpoint: a damaged value is the
    damaged-checkpoint line, not a TypeError; the saved values of a real run pass."""
    from checkpoint import CHECKPOINT_FORMAT, ModelFileError, check_checkpoint
    base = {"format": CHECKPOINT_FORMAT, "model": {"w": torch.zeros(1)}}
    with pytest.raises(ModelFileError, match=f"'{field}' is not a"):
        check_checkpoint({**base, "config": {"mode": "ga3c", **config}}, tmp_path / "x.ckpt")
    check_checkpoint({**base, "config": {"mode": "ga3c", "train_passes": 3, "pass_clip": 0.1, "short_game_slots": 2,
                                         "short_game_length": 150, "greedy_slots": 1, "later_passes": "lstm",
                                         "short_games_after_score": -20.5}}, tmp_path / "x.ckpt")


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_checkpoint_whose_short_games_switch_is_not_true_or_false_is_refused_in_one_line(value, tmp_path):
    """``Ga3cRun.restore`` sets the run's switch from ``short_games_started``: anything but a bool is the
    damaged-checkpoint line; True, False and no field pass."""
    from checkpoint import CHECKPOINT_FORMAT, ModelFileError, check_checkpoint
    base = {"format": CHECKPOINT_FORMAT, "model": {"w": torch.zeros(1)}}
    with pytest.raises(ModelFileError, match="'short_games_started' is not true or false"):
        check_checkpoint({**base, "short_games_started": value}, tmp_path / "x.ckpt")
    for ok in ({"short_games_started": True}, {"short_games_started": False}, {}):
        check_checkpoint({**base, **ok}, tmp_path / "x.ckpt")


@pytest.mark.parametrize("ckpt,argv,why", [
    ({"optimizer": {"state": {}}, "optimizer_name": "Adam"}, ["--workers", "2", "--no-shared-optimizer"],
     "--no-shared-optimizer gives each worker a fresh optimizer of its own; the checkpoint's shared statistics "
     "stay unused"),
    ({"optimizer": None, "optimizer_name": "Adam"}, ["--no-shared-optimizer"],
     "--no-shared-optimizer gives the GA3C server a fresh optimizer of its own"),
    ({"optimizer": None, "optimizer_name": "Adam"}, ["--workers", "2"],
     "the checkpoint has none (its run used --no-shared-optimizer)"),
    ({"optimizer": {"state": {}}, "optimizer_name": "RMSprop"}, ["--optimizer", "Adam"],
     "the checkpoint's are RMSprop's and this run uses Adam"),
])
def test_a_resume_says_why_the_optimizer_statistics_start_fresh(ckpt, argv, why):
    from config import build_parser, validate
    from main import optimizer_not_resumed_line
    args = build_parser().parse_args(argv)
    validate(args)
    assert optimizer_not_resumed_line(ckpt, args) == f"optimizer statistics not resumed: {why}"


@pytest.mark.slow  # two whole runs (10 s)
def test_a_run_stopped_at_its_target_prints_a_resume_command_without_it(tmp_path):
    """A run stopped at --target-score prints a resume command without it (its restored games would stop the
    resumed run after one game); the same flags with --load say so and stop after that game."""
    r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, "2", cwd=tmp_path)
    assert r.returncode == 0 and "reached --target-score -1000" in r.stdout, r.stderr[-2000:]
    (command,) = [line.split("resume with: ", 1)[1] for line in r.stdout.splitlines() if "resume with: " in line]
    assert "--target-score" not in command and "--score-window 2" in command and command.endswith(" --load")
    r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, "2", "--load", cwd=tmp_path)
    assert r.returncode == 0 and "reached --target-score -1000" in r.stdout, r.stderr[-2000:]
    assert re.search(r"the checkpoint's last 2 monitor games already average -?\d+\.\d\d, at --target-score -1000: "
                     r"this run stops after its first monitor game if the mean stays there \(to train on, resume "
                     r"with a higher --target-score, or none\)", r.stdout), r.stdout
    other = tmp_path / "other-logs"  # another run's log folder: a resume into it would add to its curve
    other.mkdir()
    (other / "PongNoFrameskip-v4_monitor.csv").write_text(
        "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
        "1795000000.000,10.0,150,-21.0,800,15.0,-21.0000,\n")
    r = run_entry("main.py", *TINY, "--save-model-dir", str(tmp_path / "models"), "--log-dir", str(other), "--load", cwd=tmp_path,
                  timeout=120)
    assert r.returncode == 2 and r.stderr == (
        f"main.py: error: {other / 'PongNoFrameskip-v4_monitor.csv'} holds 1 monitor game(s) that are not "
        f"{tmp_path / 'models' / 'PongNoFrameskip-v4.ckpt'}'s first 3 (another run's), and this run would add its "
        f"own to them: pass --log-dir DIR with this run's log folder, or another one\n"), r.stderr
    assert [p.name for p in other.iterdir()] == ["PongNoFrameskip-v4_monitor.csv"]


@pytest.mark.parametrize("confirm", [["--confirm-every-steps", "2000"], ["--confirm-every-steps=2000"]])
def test_the_resume_command_after_a_target_stop_leaves_out_the_confirming_cadence_too(confirm):
    """``--confirm-every-steps`` given without ``--target-score`` is refused, so the command printed after a target
    stop, which leaves the target out, leaves the cadence out too: the printed command runs."""
    from config import build_parser, validate
    from main import resume_command
    argv = ["--env", "PongNoFrameskip-v4", "--target-score", "20", *confirm, "--score-window", "5"]
    args = build_parser().parse_args(argv)
    assert validate(args) == []
    command = resume_command(argv, args, "reached --target-score 20")
    assert "--target-score" not in command and "--confirm-every-steps" not in command, command
    resumed = shlex.split(command)[2:]
    assert resumed == ["--env", "PongNoFrameskip-v4", "--score-window", "5", "--load"]
    assert validate(build_parser().parse_args(resumed)) == []
    assert "--confirm-every-steps" in resume_command(argv, args, "reached --max-steps 100")  # kept on other stops


def test_a_resume_names_every_training_flag_its_command_line_changes():
    """A resume takes the update's settings from its command line (the defaults where not given): each one that is
    not the checkpoint's is named in one line. Before, only the learning rate was: a resume without the first
    command's flags went back to --gamma 0.99 and --max-grad-norm 0 (no clipping) without a word."""
    from config import build_parser, validate
    from main import training_flags_change_line
    args = build_parser().parse_args(["--mode", "a3g", "--workers", "2", "--distributed-step-size", "5", "9"])
    assert validate(args) == []
    saved = {"num_steps": 20, "gamma": 0.95, "tau": 1.0, "max_grad_norm": 40.0, "distributed_step_size": None,
             "env_config": args.env_config}
    assert training_flags_change_line(saved, args) == (
        "the command line changes the checkpoint's --gamma 0.95 -> 0.99, --max-grad-norm 40.0 -> 0.0, "
        "--distributed-step-size none -> 5 9 (pass the checkpoint's values to keep them: the resume line its run "
        "printed has them)")
    assert training_flags_change_line({"gamma": 0.99, "tau": 1.0}, args) == ""  # the same: no line
    assert training_flags_change_line({}, args) == ""  # a checkpoint that has no record of them


def test_the_resume_command_after_a_step_limit_goes_past_where_the_run_stopped():
    """A GA3C run with --max-steps 5 stops at 21 steps (a batch finishes): "twice the budget", 10, was refused by
    the --load it was printed for. The budget is now past the steps the run reached."""
    from config import build_parser
    from main import resume_command
    argv = ["--env", "PongNoFrameskip-v4", "--max-steps", "5"]
    args = build_parser().parse_args(argv)
    assert shlex.split(resume_command(argv, args, "reached --max-steps 5", steps=21))[-3:] == ["--max-steps", "26",
                                                                                                "--load"]
    assert shlex.split(resume_command(argv, args, "reached --max-steps 5", steps=6))[-3:-1] == ["--max-steps", "11"]


def test_the_resume_command_at_the_schedules_end_anneals_past_where_the_run_stopped():
    """At the end of --lr-anneal-steps: the schedule about twice as long, and past the steps the run reached (a
    batch past a small schedule's end: twice it was refused by the --load it was printed for), without any
    --max-steps, which would cut it again."""
    from config import build_parser
    from main import resume_command
    argv = ["--env", "PongNoFrameskip-v4", "--lr-anneal-steps", "100", "--max-steps", "900", "--target-score", "5"]
    args = build_parser().parse_args(argv)
    end = "reached the end of --lr-anneal-steps 100 (the learning rate is 0)"
    assert shlex.split(resume_command(argv, args, end, steps=350)) == [
        "python", "main.py", "--env", "PongNoFrameskip-v4", "--target-score", "5", "--lr-anneal-steps", "450", "--load"]
    assert shlex.split(resume_command(argv, args, end, steps=100))[-3:] == ["--lr-anneal-steps", "200", "--load"]
    assert shlex.split(resume_command(argv, args, end, steps=200))[-3:] == ["--lr-anneal-steps", "300", "--load"]


def test_a_checkpoint_of_another_game_is_refused_and_another_id_of_the_same_game_is_not(tmp_path):
    """A SpaceInvaders run's --load of a Pong checkpoint (both have 6 actions) went on with Pong's weights, Adam
    statistics, steps and monitor games, with a line about --train-envs, which was not given."""
    from checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION
    from config import build_parser, validate
    from main import resume_problems
    ckpt = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "env": "PongNoFrameskip-v4",
            "model": {}, "optimizer": None, "global_steps": 500}
    path = tmp_path / "SpaceInvadersNoFrameskip-v4.ckpt"
    for env, refused in (("SpaceInvadersNoFrameskip-v4", True), ("Pong-v0", False), ("ALE/Pong-v5", False)):
        args = build_parser().parse_args(["--env", env, "--log-dir", str(tmp_path / "l"), "--save-model-dir",
                                          str(tmp_path / "m")])
        assert validate(args) == []
        problems = resume_problems(ckpt, path, args, 6)
        assert bool(problems) == refused, (env, problems)
    assert problems == [] and resume_problems(ckpt, path, build_parser().parse_args(
        ["--env", "SpaceInvadersNoFrameskip-v4"]), 6) == [
        f"--load: {path} was trained on PongNoFrameskip-v4 (Pong), and --env SpaceInvadersNoFrameskip-v4 is "
        f"SpaceInvaders: pass --env PongNoFrameskip-v4 to go on with it, or --load-model-dir with a SpaceInvaders "
        f"run's folder"]


def test_a_load_of_a_bare_model_file_is_refused_where_the_log_folder_has_its_runs_games(tmp_path):
    """A run killed before its first checkpoint leaves a .dat (written after each monitor game) and a CSV with
    games; ``--load`` from that .dat has no step count, time or games, so its rows would start again at 0 in the
    same file: one line, nothing written."""
    from model import A3Clstm
    logs, models = tmp_path / "logs", tmp_path / "models"
    logs.mkdir(), models.mkdir()
    csv_file = logs / "PongNoFrameskip-v4_monitor.csv"
    csv_file.write_text("wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
                        "1795000000.000,10.0,150,-21.0,800,15.0,-21.0000,\n")
    torch.save(A3Clstm(1, 6, 32).state_dict(), models / "PongNoFrameskip-v4.dat")
    before = {p: p.read_bytes() for p in (csv_file, models / "PongNoFrameskip-v4.dat")}
    r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, "2", "--load", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr == (
        f"main.py: error: {csv_file} holds 1 monitor game(s), and {models / 'PongNoFrameskip-v4.dat'} is a bare "
        f"model file, without the step count, time and games a checkpoint keeps (a run killed before its first "
        f"checkpoint): this run would count from 0 in that file: pass --log-dir DIR with another folder (or move "
        f"the file away)\n"), r.stderr
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["logs", "models", csv_file.name,
                                                                   "PongNoFrameskip-v4.dat"])


def test_a_monitor_csv_is_the_checkpoints_where_its_run_wrote_it_or_where_its_first_games_are_the_checkpoints():
    from main import monitor_csv_is_the_checkpoints
    ckpt = {"monitor": torch.tensor([3.0, -60.0, -19.0]), "config": {"log_dir": "runs/a/logs"}}
    assert monitor_csv_is_the_checkpoints([1.0], ckpt, "runs/a/logs")  # its own folder: never refused
    assert monitor_csv_is_the_checkpoints([-21.0, -20.0, -19.0], ckpt, "moved/logs")  # the run's folders moved
    assert monitor_csv_is_the_checkpoints([-21.0, -20.0, -19.0, 5.0], ckpt, "moved/logs")  # games after the ckpt
    assert not monitor_csv_is_the_checkpoints([-21.0, -20.0], ckpt, "moved/logs")  # fewer games
    assert not monitor_csv_is_the_checkpoints([-21.0, -20.0, -18.0], ckpt, "moved/logs")  # other scores
    # a checkpoint taken before its first game cannot tell: games in the CSV may be its run's, played after it
    assert monitor_csv_is_the_checkpoints([-21.0], {"config": {}}, "moved/logs")


def test_a_fresh_ga3c_run_is_refused_where_results_txt_has_games(tmp_path, capsys):
    """GA3C's results.txt is one per log folder and its lines do not name the env: a fresh GA3C run of another env
    in that folder appended its games to the earlier run's (plot.py then drew one curve of two games). Refused in
    one line like a monitor CSV with games; nothing written."""
    logs = tmp_path / "logs"
    logs.mkdir()
    results = logs / "results.txt"
    results.write_text("2026-11-29 10:00:00, -21, 812\n2026-11-29 10:00:09, -20, 901\n")
    assert refused(capsys, "--mode", "ga3c", "--agents", "1", "--hidden-size", "32", "--env", "BreakoutNoFrameskip-v4",
                   *dirs(tmp_path), "--max-steps", "100") == (
        f"main.py: error: {results} holds 2 game(s) of an earlier GA3C run (of this env or another), and this run "
        f"would add its own to them: to continue that run, pass --load (with its --save-model-dir); to start "
        f"afresh, pass --log-dir DIR with another folder (or move the file away)\n")
    assert [p.name for p in logs.iterdir()] == ["results.txt"] and not (tmp_path / "models").exists()


def test_ga3c_runs_of_two_envs_do_not_share_a_log_folder_at_once(tmp_path):
    """The log folder's lock is per env (``.<env>.lock``), so that A3G runs of other games can share ``logs/``;
    GA3C mode also takes ``.results.lock``, so a second GA3C run, of any env, is refused while one writes
    results.txt there. A3G mode, which writes no results.txt, does not take it."""
    import main
    from checkpoint import RunLock, RunLockedError
    from config import build_parser

    def build_args(tmp_path, *flags):
        return build_parser().parse_args([*dirs(tmp_path), *flags])
    (tmp_path / "logs").mkdir()
    first = RunLock(tmp_path / "logs", "--log-dir", ".results.lock")  # a GA3C run of another env
    try:
        ga3c = build_args(tmp_path, "--mode", "ga3c", "--env", "BreakoutNoFrameskip-v4")
        with pytest.raises(RunLockedError, match="pass --log-dir DIR with another folder"):
            main.take_locks(ga3c)
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [".results.lock"]
        for lock in main.take_locks(build_args(tmp_path, "--mode", "a3g")):
            lock.release()
    finally:
        first.release()


def refused(capsys, *argv) -> str:
    """main's checks before anything is written (``check_before_start``), in this process, on input they refuse:
    asserts exit 2 and returns what they printed on stderr."""
    import main
    from config import build_parser
    with pytest.raises(SystemExit) as e:
        main.check_before_start(build_parser().parse_args(list(argv)))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_fresh_run_is_refused_where_an_earlier_runs_monitor_csv_has_games(tmp_path, capsys):
    """Without --load (or with --load from another folder), a log folder whose monitor CSV holds games would get a
    second run's games appended (plot.py would then drop the first run's): one line, nothing written; with a model
    in the save folder too, both problems at once. A CSV with its header only (a run killed before its first game)
    does not stop a new run. The refusals are main's checks in this process (``refused``); the last run is a
    process."""
    from model import A3Clstm
    logs, models, init = tmp_path / "logs", tmp_path / "models", tmp_path / "init"
    logs.mkdir()
    csv_file = logs / "PongNoFrameskip-v4_monitor.csv"
    csv_file.write_text("wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
                        "1795000000.000,10.0,150,-21.0,800,15.0,-21.0000,\n")
    assert refused(capsys, *TINY, *dirs(tmp_path), *UNTIL_GAME, "2") == (
        f"main.py: error: {csv_file} holds 1 monitor game(s) of an earlier run, and this run would add its own to "
        f"them: to continue that run, pass --load (with its --save-model-dir); to start afresh, pass --log-dir DIR "
        f"with another folder (or move the file away)\n")
    init.mkdir()
    torch.save(A3Clstm(1, 6, 32).state_dict(), init / "PongNoFrameskip-v4.dat")
    assert refused(capsys, *TINY, "--log-dir", str(logs), "--save-model-dir", str(models), "--load",
                   "--load-model-dir", str(init), *UNTIL_GAME, "2") == (
        f"main.py: error: {csv_file} holds 1 monitor game(s) of an earlier run, and this run would add its own to "
        f"them: pass --log-dir DIR with another folder, since this run resumes from --load-model-dir {init} into "
        f"another --save-model-dir (or move the file away)\n")
    models.mkdir()
    (models / "PongNoFrameskip-v4.dat").write_bytes(b"an earlier model")
    err = refused(capsys, *TINY, *dirs(tmp_path), *UNTIL_GAME, "2", "--no-load")
    assert len(err.splitlines()) == 2 and "PongNoFrameskip-v4.dat exists" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init", "logs", "models"]
    assert [p.name for p in logs.iterdir()] == [csv_file.name] and [p.name for p in models.iterdir()] == [
        "PongNoFrameskip-v4.dat"]
    (models / "PongNoFrameskip-v4.dat").unlink()
    csv_file.write_text(csv_file.read_text().splitlines()[0] + "\n")
    r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(list(csv.DictReader(open(csv_file)))) == 2


def test_a_log_folder_in_use_by_another_run_of_the_env_is_refused_and_nothing_is_left(tmp_path):
    """Two runs of one env with their own model folders and one --log-dir would interleave their monitor CSVs: the
    second is refused in one line, and the model folder it would have made is not left behind. A run of another
    env may share the log folder (upstream's logs/)."""
    from checkpoint import RunLock
    logs = tmp_path / "logs"
    logs.mkdir()
    held = RunLock(logs, "--log-dir", ".PongNoFrameskip-v4.lock")  # what a running main.py holds
    try:
        r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, "2", cwd=tmp_path, timeout=120)
        assert r.returncode == 2 and r.stderr == (
            f"main.py: error: another run (pid {os.getpid()}) is writing to {logs}: wait for it to stop, or pass "
            f"--log-dir DIR with another folder\n")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
        assert [p.name for p in logs.iterdir()] == [".PongNoFrameskip-v4.lock"]
        r = run_entry("main.py", *TINY, *dirs(tmp_path), *UNTIL_GAME, "2", "--env", "BreakoutNoFrameskip-v4",
                      cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        held.release()


def test_save_max_keeps_a_better_model_saved_after_the_last_checkpoint(tmp_path):
    """A run killed after a new best game saved its model but before the next checkpoint: the checkpoint's best
    is older. Resumed with --save-max, a game below that best (here 0: games cut at 30 steps end before Pong's
    first point) must not replace the file; the best is read back from the monitor CSV."""
    flags = [*TINY, *dirs(tmp_path), "--save-max", "--max-steps", "0", "--max-episode-length", "30",
             "--target-score", "-1000", "--score-window"]
    r = run_entry("main.py", *flags, "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    csv_path = tmp_path / "logs" / "PongNoFrameskip-v4_monitor.csv"
    rows = list(csv.DictReader(open(csv_path)))  # 2 games (a 3rd may start before the stop on a fast machine)
    assert len(rows) >= 2 and {float(row["score"]) for row in rows} == {0.0}
    # the game that scored 5 after the last checkpoint, and the model it saved
    with open(csv_path, "a") as f:
        f.write(f"{time.time():.3f},99.0,{int(rows[-1]['global_steps']) + 10},5.0,100,1.0,0.6667,\n")
    dat = tmp_path / "models" / "PongNoFrameskip-v4.dat"
    best = dat.read_bytes()
    r = run_entry("main.py", *flags, str(len(rows) + 2), "--load", cwd=tmp_path)  # 2 more games
    assert r.returncode == 0, r.stderr[-2000:]
    scores = [float(row["score"]) for row in csv.DictReader(open(csv_path))]
    new = scores[len(rows) + 1:]
    assert new and max(new) < 5, scores
    assert dat.read_bytes() == best

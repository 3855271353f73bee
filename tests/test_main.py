"""main.py as a subprocess with tiny budgets: what it writes, resuming, stopping, and bad input."""
import csv
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import ROOT, run_entry

TINY = ["--workers", "2", "--hidden-size", "32", "--test-every-steps", "150", "--env-config", str(ROOT / "config.json")]
UPSTREAM_LINE = re.compile(r"^\S+ \S+ : Time \d\dh \d\dm \d\ds, episode reward -?\d+\.0, episode length \d+, "
                           r"reward mean -?\d+\.\d{4}$")


def dirs(tmp_path):
    return ["--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models"),
            "--load-model-dir", str(tmp_path / "models")]


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


def test_target_score_stops_the_run_and_save_max_keeps_upstream_semantics(tmp_path):
    r = run_entry("main.py", *TINY, *dirs(tmp_path), "--target-score", "-21", "--score-window", "1",
                  "--max-steps", "0", "--save-max", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "reached --target-score -21" in r.stdout
    # --save-max: the best starts at 0, so a -21 game writes no .dat; the full checkpoint is always written
    assert not (tmp_path / "models/PongNoFrameskip-v4.dat").exists()
    assert (tmp_path / "models/PongNoFrameskip-v4.ckpt").exists()


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


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
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


def test_a_dead_worker_stops_the_run_with_an_error(tmp_path):
    proc = start_main(tmp_path)
    try:
        kids = wait_for_children(proc, 3)
        worker = next(c for c in kids if "a3g worker 1" in " ".join(c.cmdline()))
        t0 = time.time()
        worker.kill()
        out, err = proc.communicate(timeout=30)
        noticed = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1
    assert "worker 1 exited unexpectedly (exit code -9)" in out
    assert noticed < 15
    assert gone(kids)


def bad(tmp_path, *args):
    r = run_entry("main.py", *dirs(tmp_path), *args, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("main.py: error: ") for line in lines)
    assert not (tmp_path / "logs").exists()  # nothing started, nothing written
    return lines


def test_bad_env_id(tmp_path):
    (line,) = bad(tmp_path, "--env", "PongNoFrameSkip-v4")
    assert "unknown environment id 'PongNoFrameSkip-v4'" in line and "PongNoFrameskip-v4" in line


def test_gpu_that_does_not_exist(tmp_path):
    (line,) = bad(tmp_path, "--gpu-ids", "99")
    assert "CUDA is not available" in line or "GPU 99 does not exist" in line


def test_every_problem_reported_at_once(tmp_path):
    lines = bad(tmp_path, "--lr", "-1", "--workers", "0", "--gamma", "2")
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


def test_load_with_nothing_to_load(tmp_path):
    (line,) = bad(tmp_path, "--load")
    assert "--load: neither" in line


def test_an_existing_model_is_never_overwritten_by_a_new_run(tmp_path, models):
    dat = models / "PongNoFrameskip-v4.dat"
    dat.write_bytes(b"a trained model")
    (line,) = bad(tmp_path)
    assert "PongNoFrameskip-v4.dat exists and this run would overwrite it: to continue training from it, pass --load" in line
    assert dat.read_bytes() == b"a trained model"

"""benchmarks/gpu_session.py: its stages run in order into one folder (on the CPU here, with tiny budgets), the
train stage resumes its run, the faster mode is taken from the benchmark, and bad input gets one line."""
import importlib.util
import json

import pytest

from conftest import ROOT, run_entry

_spec = importlib.util.spec_from_file_location("gpu_session", ROOT / "benchmarks" / "gpu_session.py")
gpu_session = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_session)  # by path: benchmarks/ on sys.path would hide the multinode package
faster_mode = gpu_session.faster_mode


def test_the_faster_mode_comes_from_the_benchmark():
    assert faster_mode({"ga3c_over_a3g": 1.4}) == "ga3c" and faster_mode({"ga3c_over_a3g": 1.4}, True) == "ga3c"
    assert faster_mode({"ga3c_over_a3g": 0.8}) == "a3g" and faster_mode({"ga3c_over_a3g": 0.8}, True) == "a3g"
    # no benchmark, or one without the ratio: GA3C mode on a GPU (2.57x A3G mode on an H200), A3G mode on the CPU
    for bench in (None, {}, {"ga3c_over_a3g": None}, []):
        assert faster_mode(bench) == "a3g" and faster_mode(bench, on_gpu=True) == "ga3c"


def test_the_stages_share_the_budget():
    """Each stage gets what it needs at most and leaves the stages after it their minimum; training the rest."""
    from types import SimpleNamespace
    opts = SimpleNamespace(warmup=10.0, window=40.0)
    seconds = gpu_session.stage_seconds
    assert seconds("tests", ["bench", "train"], 530, opts) == 150  # its cap
    assert seconds("tests", ["bench", "train"], 300, opts) == 300 - 100 - 135  # leaves bench 100, train 60 + 75
    assert seconds("bench", ["train"], 500, opts) == 2 * 50 + 150
    assert seconds("bench", ["train"], 300, opts) == 300 - 135
    assert seconds("bench", [], 100, opts) == 100
    assert seconds("train", [], 321.5, opts) == 321.5
    assert seconds("tests", ["bench", "train"], 100, opts) == 0


def test_a_stage_past_its_time_gets_sigterm_then_sigkill_with_its_children(tmp_path, monkeypatch):
    """A stage that handles SIGTERM (main.py writes its final checkpoint) ends by itself; one that ignores it is
    killed after the grace period, with the process it started: nothing is left running."""
    import os
    import sys
    import time
    monkeypatch.setattr(gpu_session, "KILL_GRACE", 2.0)
    polite = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'w').write('saved'), sys.exit(0)))\n"
              "print('started', flush=True)\ntime.sleep(60)\n")
    res = gpu_session.run_stage("train", [sys.executable, "-c", polite, str(tmp_path / "saved")], tmp_path / "a.log", 3)
    assert res["exit_code"] == 124 and res["seconds"] < 20
    assert (tmp_path / "saved").read_text() == "saved"
    assert "ran past 3 s: SIGTERM" in (tmp_path / "a.log").read_text()
    stubborn = ("import signal, subprocess, sys, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                "open(sys.argv[1], 'w').write(str(child.pid))\ntime.sleep(60)\n")
    start = time.time()
    res = gpu_session.run_stage("bench", [sys.executable, "-c", stubborn, str(tmp_path / "child")], tmp_path / "b.log",
                                3)
    assert res["exit_code"] == 124 and time.time() - start < 20
    assert "SIGKILL" in (tmp_path / "b.log").read_text()
    child = int((tmp_path / "child").read_text())
    for _ in range(50):  # the child is killed with the group; it is reaped by init
        try:
            os.kill(child, 0)
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the stage's child {child} is still running")
    res = gpu_session.run_stage("tests", [sys.executable, "-c", "print('ok')"], tmp_path / "c.log", 30)
    assert res["exit_code"] == 0 and "ok" in (tmp_path / "c.log").read_text()


def test_no_stage_runs_where_the_machine_has_no_gpu_for_gpu_ids(tmp_path):
    """On this CPU machine ``--gpu-ids 0`` fails the check: exit 1, the check in summary.json, no stage's files."""
    out = tmp_path / "out"
    r = run_entry("benchmarks/gpu_session.py", "--out", str(out), cwd=tmp_path, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["preflight"] and summary["preflight"]["cuda"] is False
    assert summary["preflight"]["ok"] is False and summary["preflight"]["missing"] == []
    assert summary["preflight"]["torch"].startswith("2.")
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_training_is_skipped_where_the_budget_leaves_too_little(tmp_path):
    out = tmp_path / "out"
    r = run_entry("benchmarks/gpu_session.py", "--out", str(out), "--gpu-ids", "-1", "--stages", "train",
                  "--budget-seconds", "60", "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    train = json.loads((out / "summary.json").read_text())["train"]
    assert train["skipped"].startswith("the budget left") and train["mode"] == "a3g"
    assert not (tmp_path / "run").exists() and not (out / "train.log").exists()


def test_pytest_counts_and_the_last_monitor_game_are_read_from_what_a_kill_leaves(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("....s\nSKIPPED [1] tests/test_gpu.py:40: needs 2 GPUs\n4 passed, 1 skipped in 33.10s\n")
    assert gpu_session.pytest_counts(log) == {"passed": 4, "skipped": 1}
    log.write_text("F\n1 failed, 2 passed, 1 error in 3.00s\n")
    assert gpu_session.pytest_counts(log) == {"failed": 1, "passed": 2, "errors": 1}
    log.write_text("collecting ...\n")
    assert gpu_session.pytest_counts(log) == {}
    csv_file = tmp_path / "m.csv"
    header = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
    csv_file.write_text(header + "0,60,1000,5,100,1,0,5.0\n0,120,2000,7,100,1,0,6.0\n0,13")  # killed mid-row
    assert gpu_session.last_monitor(csv_file) == {"games": 2, "global_steps": 2000, "elapsed_s": 120.0,
                                                  "last_window_mean": 6.0}
    csv_file.write_text(header)
    assert gpu_session.last_monitor(csv_file) == {"games": 0}


@pytest.mark.parametrize("flags", [["--train-seconds", "0"], ["--workers", "0"], ["--warmup", "-1"],
                                   ["--budget-seconds", "0"]])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, flags):
    r = run_entry("benchmarks/gpu_session.py", "--out", str(tmp_path / "out"), *flags, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "gpu_session.py: error: --" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # about 2 minutes: a benchmark of both modes and two short training runs
def test_all_stages_on_the_cpu_then_the_run_goes_on(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    tiny = ["--gpu-ids", "-1", "--precision", "fp32", "--workers", "1", "--warmup", "2", "--window", "3",
            "--ga3c-flags", "--agents 1 --envs-per-agent 2 --num-steps 5 --train-batch 1 --hidden-size 32",
            "--env", "PongNoFrameskip-v4", "--run-dir", str(run_dir),
            "--extra", "--hidden-size 32 --test-every-steps 100 --max-episode-length 200"]
    r = run_entry("benchmarks/gpu_session.py", "--out", str(out), "--train-seconds", "20", *tiny, cwd=tmp_path,
                  timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["preflight", "tests", "bench", "train"] and summary["preflight"]["ok"]
    assert all(summary[s]["exit_code"] == 0 for s in ("tests", "bench", "train"))
    assert summary["tests"]["passed"] > 0  # the CPU-parametrised GPU tests
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 7
    bench = json.loads((out / "bench.json").read_text())
    assert summary["bench"]["ga3c_over_a3g"] == bench["ga3c_over_a3g"]
    assert summary["train"]["mode"] == faster_mode(bench)
    first = summary["train"]["global_steps"]
    assert first > 0 and (out / "train" / "PongNoFrameskip-v4.dat").is_file()
    r = run_entry("benchmarks/gpu_session.py", "--out", str(out), "--stages", "train", "--load", "--mode", "a3g",
                  "--train-seconds", "15", *tiny, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train"]["global_steps"] > first and "bench" in summary
    assert "loaded" in (out / "train.log").read_text()

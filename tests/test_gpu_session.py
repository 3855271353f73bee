"""benchmarks/gpu_session.py: its stages run in order into one folder (on the CPU here, with tiny budgets), the
train stage resumes its run, the faster mode is taken from the benchmark, and bad input gets one line."""
import importlib.util
import json

import pytest
import torch

from conftest import ROOT, processes_left, run_entry

_spec = importlib.util.spec_from_file_location("gpu_session", ROOT / "benchmarks" / "gpu_session.py")
gpu_session = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_session)  # by path: benchmarks/ on sys.path would hide the multinode package
faster_mode = gpu_session.faster_mode


def test_the_faster_mode_comes_from_the_benchmark():
    assert faster_mode({"ga3c_over_a3g": 1.4}) == "ga3c" and faster_mode({"ga3c_over_a3g": 1.4}, True) == "ga3c"
    assert faster_mode({"ga3c_over_a3g": 0.8}) == "a3g" and faster_mode({"ga3c_over_a3g": 0.8}, True) == "a3g"
    # no benchmark, or one without the ratio: GA3C mode on a GPU (4.06x A3G mode on an H200), A3G mode on the CPU
    for bench in (None, {}, {"ga3c_over_a3g": None}, []):
        assert faster_mode(bench) == "a3g" and faster_mode(bench, on_gpu=True) == "ga3c"
        # but where this call's benchmark ran and measured no ratio (GA3C mode failed there), not GA3C mode again
        assert faster_mode(bench, on_gpu=True, bench_ran=True) == "a3g"
    assert faster_mode({"ga3c_over_a3g": 2.5}, on_gpu=True, bench_ran=True) == "ga3c"


def test_the_train_stage_copies_its_files_while_it_runs(tmp_path, monkeypatch):
    """``every`` is called while the stage runs, each ``COPY_EVERY`` seconds, so that a kill -9 of the session
    (which nothing can catch) leaves the files copied a moment before; the stage's own timeout still holds."""
    import sys
    import time
    monkeypatch.setattr(gpu_session, "COPY_EVERY", 0.3)
    calls = []
    start = time.time()
    res = gpu_session.run_stage("train", [sys.executable, "-c", "import time; time.sleep(1.6)"], tmp_path / "t.log",
                                30, every=lambda: calls.append(time.time() - start))
    assert res["exit_code"] == 0 and 3 <= len(calls) <= 6, calls
    res = gpu_session.run_stage("train", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "u.log",
                                1.0, every=lambda: calls.append(0))
    assert res["exit_code"] == 124 and res["seconds"] < 10


def test_a_stage_whose_handling_raises_is_recorded_and_the_next_stage_runs(tmp_path, monkeypatch):
    """An error in the session's own handling of a stage (a copy that fails, say) is that stage's entry, with its
    traceback; the next stage still runs. Before, it ended the session: no summary of it, no later stage."""
    import signal
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    monkeypatch.setattr(gpu_session, "preflight", lambda py, on_gpu, commands: {"ok": True, "problems": {}})
    seen = []

    def run_one(stage, opts, out, py, seconds):
        summary = json.loads((out / "summary.json").read_text())
        seen.append((stage, summary[stage]))  # written before the stage: what a kill -9 would leave
        if stage == "tests":
            raise OSError(28, "No space left on device")
        return {"command": "x", "exit_code": 0, "seconds": 1.0}
    monkeypatch.setattr(gpu_session, "run_one", run_one)
    try:
        code = gpu_session.main(["--out", str(tmp_path / "out"), "--gpu-ids", "-1", "--stages", "tests", "bench"])
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert code == 1
    assert [s for s, _ in seen] == ["tests", "bench"] and all(entry["running"] for _, entry in seen)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["tests"]["exit_code"] == 1 and summary["tests"]["error"].startswith("OSError: [Errno 28]")
    assert "Traceback" in summary["tests"]["traceback"] and summary["bench"]["exit_code"] == 0


def test_the_stages_share_the_budget():
    """Each stage gets what it needs at most and leaves the stages after it their minimum; training the rest."""
    from types import SimpleNamespace
    opts = SimpleNamespace(warmup=10.0, window=40.0)
    seconds = gpu_session.stage_seconds
    assert seconds("tests", ["bench", "train"], 530, opts) == 150  # its cap
    assert seconds("tests", ["bench", "train"], 300, opts) == 300 - 100 - 100  # leaves bench 100, train 60 + 40
    assert seconds("bench", ["train"], 500, opts) == 2 * 50 + 150
    assert seconds("bench", ["train"], 300, opts) == 300 - 100
    assert seconds("bench", [], 100, opts) == 100
    assert seconds("train", [], 321.5, opts) == 321.5
    assert seconds("tests", ["bench", "train"], 100, opts) == 0


@pytest.mark.slow  # 8 s; the stop-signal test below ends a stage and its children in the default suite
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the session would run for real")
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
    log.write_text("ERROR tests/test_gpu.py - ImportError\n1 error in 0.41s\n")  # a collection error
    assert gpu_session.pytest_counts(log) == {"errors": 1}
    log.write_text("sssssss\n7 skipped in 1.20s\n")
    assert gpu_session.pytest_counts(log) == {"skipped": 7}
    csv_file = tmp_path / "m.csv"
    header = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
    csv_file.write_text(header + "0,60,1000,5,100,1,0,5.0\n0,120,2000,7,100,1,0,6.0\n0,13")  # killed mid-row
    assert gpu_session.last_monitor(csv_file) == {"games": 2, "global_steps": 2000, "elapsed_s": 120.0,
                                                  "last_window_mean": 6.0}
    csv_file.write_text(header)
    assert gpu_session.last_monitor(csv_file) == {"games": 0}


@pytest.mark.parametrize("flags, message", [
    (["--train-seconds", "0"], "--train-seconds must be > 0"), (["--workers", "0"], "--workers must be > 0"),
    (["--warmup", "-1"], "--warmup must be >= 0"), (["--budget-seconds", "0"], "--budget-seconds must be > 0"),
    (["--warmup", "nan"], "--warmup must be a finite number"), (["--budget-seconds", "inf"], "--budget-seconds must be a finite"),
    (["--ga3c-flags", "--agents '2"], "--ga3c-flags \"--agents '2\": No closing quotation"),
    (["--extra", "--seed '7"], "--extra \"--seed '7\": No closing quotation"),
    (["--gpu-ids", "-1", "0"], "--gpu-ids -1 0: give -1 once for the CPU"),
    (["--stages", "train", "--load"], "--load: there is no"),
])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, flags, message):
    r = run_entry("benchmarks/gpu_session.py", "--out", str(tmp_path / "out"), "--run-dir", str(tmp_path / "run"),
                  *flags, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "gpu_session.py: error: --" in r.stderr, r.stderr
    assert message in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_and_a_run_that_would_be_overwritten_are_refused(tmp_path):
    (tmp_path / "f").write_text("")
    r = run_entry("benchmarks/gpu_session.py", "--out", str(tmp_path / "f"), cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and f"--out {tmp_path / 'f'} is a file" in r.stderr and r.stderr.count("\n") == 1
    (tmp_path / "run" / "models").mkdir(parents=True)
    (tmp_path / "run" / "models" / "BreakoutNoFrameskip-v4.ckpt").write_bytes(b"x")
    r = run_entry("benchmarks/gpu_session.py", "--out", str(tmp_path / "out"), "--run-dir", str(tmp_path / "run"),
                  "--stages", "train", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "exists and training would overwrite it: pass --load" in r.stderr, r.stderr
    assert (tmp_path / "run" / "models" / "BreakoutNoFrameskip-v4.ckpt").read_bytes() == b"x"


def test_flags_main_py_refuses_end_the_session_after_the_check_of_the_machine(tmp_path):
    """main.py's own checks of the train stage's command run in the preflight: a flag it refuses is one line and
    exit 2 before any stage, not a failed stage after the tests and the benchmark."""
    out = tmp_path / "out"
    r = run_entry("benchmarks/gpu_session.py", "--out", str(out), "--gpu-ids", "-1", "--stages", "train", "--mode",
                  "a3g", "--run-dir", str(tmp_path / "run"), "--extra=--lr=-1", cwd=tmp_path, timeout=180)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == "gpu_session.py: error: main.py flags of the train a3g: --lr must be > 0, got -1.0"
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["preflight"] and summary["preflight"]["problems"] == {
        "train a3g": ["--lr must be > 0, got -1.0"]}
    assert not (out / "train.log").exists() and not (tmp_path / "run").exists()


def test_which_commands_are_checked_and_which_problems_stop_the_session(tmp_path):
    opts = gpu_session.build_parser().parse_args(["--out", "o", "--run-dir", str(tmp_path / "run")])
    checks = gpu_session.commands_to_check(opts)
    assert sorted(checks) == ["bench a3g", "bench ga3c", "train a3g", "train ga3c"]
    assert "--extra" not in " ".join(checks["bench a3g"]) and checks["train ga3c"][:2] == ["--mode", "ga3c"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / gpu_session.MODE_FILE).write_text("a3g\n")
    opts = gpu_session.build_parser().parse_args(["--out", "o", "--run-dir", str(tmp_path / "run"), "--stages",
                                                  "train", "--load"])
    assert sorted(gpu_session.commands_to_check(opts)) == ["train a3g"]  # a resume goes on in its mode
    fatal = gpu_session.fatal_problems
    assert fatal({"bench ga3c": ["x"], "bench a3g": [], "train a3g": [], "train ga3c": ["x"]}) == ["bench ga3c: x"]
    assert fatal({"train a3g": [], "train ga3c": ["y"]}) == []  # the benchmark may choose A3G mode
    assert fatal({"train a3g": ["z"], "train ga3c": ["y"]}) == ["train a3g: z", "train ga3c: y"]
    assert fatal({"train ga3c": ["y"]}) == ["train ga3c: y"]


def test_the_train_stage_takes_only_the_files_it_wrote(tmp_path):
    import os
    import time
    opts = gpu_session.build_parser().parse_args(["--out", str(tmp_path / "out"), "--run-dir", str(tmp_path / "run"),
                                                  "--env", "PongNoFrameskip-v4"])
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "models").mkdir()
    header = "wall_time,elapsed_s,global_steps,score,length,steps_per_s,reward_mean,window_mean\n"
    old = tmp_path / "run" / "logs" / "PongNoFrameskip-v4_monitor.csv"
    old.write_text(header + "0,60,2000,5,100,1,0,6.0\n")
    os.utime(old, (time.time() - 600, time.time() - 600))  # an earlier call's
    (tmp_path / "out").mkdir()
    assert gpu_session.collect_train(opts, tmp_path / "out", started_at=time.time()) == {}
    assert not (tmp_path / "out" / "train" / old.name).exists()
    (tmp_path / "run" / "models" / "PongNoFrameskip-v4.dat").write_bytes(b"w")
    old.write_text(header + "0,60,2000,5,100,1,0,6.0\n0,70,3000,9,100,1,0,7.0\n")
    got = gpu_session.collect_train(opts, tmp_path / "out", started_at=time.time() - 5)
    assert got == {"games": 2, "global_steps": 3000, "elapsed_s": 70.0, "last_window_mean": 7.0}
    assert (tmp_path / "out" / "train" / "PongNoFrameskip-v4.dat").read_bytes() == b"w"


def test_a_preflight_that_crashes_says_why(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'RuntimeError: CUDA error: no CUDA-capable device is detected' >&2\nexit 1\n")
    fake.chmod(0o755)
    info = gpu_session.preflight(str(fake), on_gpu=True)
    assert info["ok"] is False and "exit code 1" in info["error"] and "no CUDA-capable device" in info["error"]


def test_a_stop_signal_stops_the_stage_writes_the_summary_and_leaves_nothing(tmp_path):
    """SIGTERM to the session while it trains (the device call's time limit): main.py gets SIGTERM and writes its
    final files, the session copies them, writes the summary and exits 143; no process of it is left."""
    import os
    import signal
    import subprocess
    import sys
    import time
    out, run = tmp_path / "out", tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "--out", str(out),
                             "--gpu-ids", "-1", "--stages", "train", "--mode", "a3g", "--workers", "1",
                             "--train-seconds", "300", "--budget-seconds", "500", "--env", "PongNoFrameskip-v4",
                             "--run-dir", str(run), "--extra", "--hidden-size 32 --test-every-steps 100"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 180
        csv_file = run / "logs" / "PongNoFrameskip-v4_monitor.csv"
        while time.time() < deadline and proc.poll() is None and not (
                csv_file.is_file() and csv_file.read_text().count("\n") >= 2):
            time.sleep(0.5)  # training: the monitor has played a game (a row after the header)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM; the stage in progress was stopped" in err and "Traceback" not in err, err
    train = json.loads((out / "summary.json").read_text())["train"]
    assert train["stopped_by"] == "SIGTERM" and train["mode"] == "a3g" and train["games"] >= 1, train
    assert (out / "train" / "PongNoFrameskip-v4.dat").is_file()
    assert "stopped: terminated (SIGTERM)" in (out / "train.log").read_text()
    assert not processes_left(proc.pid)


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

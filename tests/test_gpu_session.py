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
    assert faster_mode({"ga3c_over_a3g": 1.4}) == "ga3c"
    assert faster_mode({"ga3c_over_a3g": 0.8}) == "a3g"
    assert faster_mode(None) == "a3g" and faster_mode({}) == "a3g"


@pytest.mark.parametrize("flags", [["--train-seconds", "0"], ["--workers", "0"], ["--warmup", "-1"]])
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
    assert list(summary) == ["tests", "bench", "train"] and all(s["exit_code"] == 0 for s in summary.values())
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

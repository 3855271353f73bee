"""The benchmark script runs end to end with tiny budgets and its JSON holds consistent numbers."""
import json
import re

import pytest

from conftest import ROOT, run_entry


def test_benchmark_runs_and_its_ratios_follow_from_its_measurements(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_entry("benchmarks/benchmark.py", "--workers", "1", "--warmup", "3", "--window", "4",
                     "--env-seconds", "2", "--rollouts", "2", "--repeats", "1", "--json", str(out), cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    for key in ("plain_step_ms", "plain_keep_freed_step_ms", "env_steps_per_s", "plain_training_steps_per_s"):
        assert res[key] > 0, key
    tr, r = res["training"], res["ratios"]
    assert tr["steps"] > 0 and set(tr["rss_mib_start"]) == {"monitor", "worker 0"}
    assert abs(r["training_over_env"] - tr["steps_per_s"] / res["env_steps_per_s"]) < 1e-9
    assert abs(r["training_over_plain_training"] - tr["steps_per_s"] / res["plain_training_steps_per_s"]) < 1e-9
    assert abs(r["plain_over_ours_step_cost"] - res["plain_step_ms"] / res["ours"]["total_ms"]) < 1e-9
    assert res["machine"]["torch"].startswith("2.") and "plain training" in proc.stdout


@pytest.mark.slow
def test_compile_benchmark_runs_and_the_compiled_forward_matches(tmp_path):
    proc = run_entry("benchmarks/compile_forward.py", "--steps", "2", "--rounds", "1", "--hidden-size", "32",
                     cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    diff = float(re.search(r"max \|logit difference\| (\S+)", proc.stdout).group(1))
    assert diff < 1e-5 and "eager/compiled" in proc.stdout

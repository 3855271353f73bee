"""The benchmark script runs end to end with tiny budgets and its JSON holds consistent numbers."""
import importlib.util
import json
import os
import re
import stat
import time

import pytest
import torch

from conftest import ROOT, kill_session, processes_left, run_entry, session_processes


@pytest.mark.slow  # 70 s: every part of the benchmark runs, each a few seconds
def test_benchmark_runs_and_its_ratios_follow_from_its_measurements(tmp_path):
    out, run_dir = tmp_path / "bench.json", tmp_path / "run"
    proc = run_entry("benchmarks/benchmark.py", "--workers", "1", "--warmup", "3", "--window", "4",
                     "--env-seconds", "2", "--rollouts", "2", "--repeats", "1", "--json", str(out),
                     "--out-dir", str(run_dir), "--ga3c-flags", "--agents 1 --envs-per-agent 2 --num-steps 5 "
                     "--train-batch 1 --hidden-size 32 --ema-steps 100 --later-passes lstm --precision fp32",
                     "--precision", "bf16", cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "PongNoFrameskip-v4_log").is_file()  # the monitor's log, where it was told to write
    res = json.loads(out.read_text())
    for key in ("plain_step_ms", "plain_keep_freed_step_ms", "env_steps_per_s", "plain_training_steps_per_s"):
        assert res[key] > 0, key
    tr, r = res["training"], res["ratios"]
    assert tr["steps"] > 0 and set(tr["rss_mib_start"]) == {"monitor", "worker 0"}
    assert tr["gpu"] is None  # CPU run: no GPU readings
    assert abs(r["training_over_env"] - tr["steps_per_s"] / res["env_steps_per_s"]) < 1e-9
    assert abs(r["training_over_plain_training"] - tr["steps_per_s"] / res["plain_training_steps_per_s"]) < 1e-9
    assert abs(r["plain_over_ours_step_cost"] - res["plain_step_ms"] / res["ours"]["total_ms"]) < 1e-9
    assert res["machine"]["torch"].startswith("2.") and "plain training" in proc.stdout
    assert res["precision"] == "bf16" and "native_bf16" in res["machine"]
    assert "training (bf16)" in proc.stdout and "this model per step (1 thread, bf16)" in proc.stdout
    g, flop = res["ga3c"], res["model_mflop_per_step"]
    assert g["steps"] > 0 and g["updates_per_s"] > 0 and g["flags"]["agents"] == 1
    assert g["flags"]["compute_precision"] == "fp32"  # --ga3c-flags' own --precision
    assert g["flags"]["replay_activations"] is False  # the default
    assert g["flags"]["train_passes"] == 2  # GA3C mode's default: two optimizer steps per batch
    assert g["flags"]["later_passes"] == "lstm"  # --ga3c-flags' own (the default is full)
    assert set(g["rss_mib_start"]) == {"ga3c server", "ga3c agent 0", "monitor"}
    assert abs(res["ga3c_over_a3g"] - g["steps_per_s"] / tr["steps_per_s"]) < 1e-9
    assert 300 < flop["total"] < 600 and abs(flop["total"] - sum(v for k, v in flop.items() if k != "total")) < 1e-9
    assert flop["training_forward"] == flop["acting_forward"]  # the LSTM counted in both
    roof = res["matmul_gflops_1_thread"] * os.cpu_count() * 1e9
    assert abs(res["roof_fraction_a3g"] - tr["steps_per_s"] * flop["total"] * 1e6 / roof) < 1e-9
    assert g["flags"]["ema_steps"] == 100 and g["flags"]["hidden_size"] == 32 and g["model_mflop_per_step"]["total"] < flop["total"]  # its own model
    assert abs(res["roof_fraction_ga3c"] - g["steps_per_s"] * g["model_mflop_per_step"]["total"] * 1e6 / roof) < 1e-9


@pytest.mark.slow
def test_compile_benchmark_runs_and_the_compiled_forward_matches(tmp_path):
    proc = run_entry("benchmarks/compile_forward.py", "--steps", "2", "--rounds", "1", "--hidden-size", "32",
                     cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    diff = float(re.search(r"max \|logit difference\| (\S+)", proc.stdout).group(1))
    assert diff < 1e-5 and "eager/compiled" in proc.stdout


def test_by_default_the_training_processes_write_into_a_temporary_folder_deleted_at_the_end(tmp_path,
                                                                                             monkeypatch):
    bench = load_benchmark()
    folders = []

    def run(opts, out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "PongNoFrameskip-v4.dat").write_bytes(b"a model")
        folders.append(out_dir)
        return 0

    monkeypatch.setattr(bench, "run", run)
    assert bench.main([]) == 0
    assert not folders[0].exists() and ROOT not in folders[0].parents
    assert bench.main(["--out-dir", str(tmp_path / "kept")]) == 0
    assert folders[1] == tmp_path / "kept" and (tmp_path / "kept/PongNoFrameskip-v4.dat").read_bytes() == b"a model"


def test_the_flop_count_includes_the_lstm_of_the_training_pass():
    """torch's FLOP counter sees nothing inside ``torch.lstm`` (the fused LSTM of ``unroll``): the training forward
    is counted step by step, so it equals the acting forward, and exceeds the fused count by the LSTM's products
    counted by hand, 2 x (input + hidden) x 4 hidden a step."""
    from torch.utils.flop_counter import FlopCounterMode

    from model import A3Clstm
    bench = load_benchmark()
    for hidden in (512, 64):
        flops = bench.model_flops_per_step(num_steps=5, hidden_size=hidden)
        assert flops["training_forward"] == flops["acting_forward"] > 0
        model = A3Clstm(1, 6, hidden)
        with FlopCounterMode(display=False) as fc:
            model.unroll(torch.randn(5, 1, 80, 80), model.initial_state())
        lstm_in = model.lstm.weight_ih.shape[1]
        assert flops["training_forward"] - fc.get_total_flops() / 5 == 2 * (lstm_in + hidden) * 4 * hidden
        assert flops["training_backward"] > flops["training_forward"]
        assert flops["total"] == flops["acting_forward"] + flops["training_forward"] + flops["training_backward"]


def test_a_window_that_counted_no_a3g_step_is_one_error_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """A3G workers count their steps when a rollout ends, so a very short --window can count none: one line and
    exit 2 (it was a ZeroDivisionError traceback after the GA3C measurement), before the GA3C measurement."""
    bench = load_benchmark()
    # run() marks this process as a run's main (lifeline.mark_children sets the variable): undone at the end, or
    # every process a later test starts would take pytest for its main process
    monkeypatch.setenv(bench.lifeline.PARENT_ENV, "")
    measured = []
    monkeypatch.setattr(bench, "training_steps_per_s", lambda *a: {
        "steps_per_s": 0.0, "steps": 0, "seconds": 0.01, "rss_mib_start": {"worker 0": 1.0},
        "rss_mib_end": {"worker 0": 1.0}, "gpu": None})
    monkeypatch.setattr(bench, "ga3c_training_steps_per_s", lambda *a: measured.append(a))
    opts = bench.benchmark_parser().parse_args(["--modes-only", "--workers", "1", "--window", "0.01"])
    assert bench.run(opts, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no A3G training step was counted in the --window of 0.01 s" in err, err
    assert measured == [] and os.environ[bench.lifeline.PARENT_ENV] == str(os.getpid())  # undone at teardown


def load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "benchmarks" / "benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) printf '0, 87, 20480\\n1, 3, 500\\n' ;;
  --query-compute-apps=*) printf '111, 1200\\n222, 1300\\n999, 4000\\n' ;;
  *) exit 3 ;;
esac
"""


def test_gpu_readings_come_from_nvidia_smi_and_name_our_processes(tmp_path, monkeypatch):
    bench = load_benchmark()
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    roles = {111: "worker 0", 222: "monitor"}
    first = bench.gpu_sample(roles)
    assert first == {"gpus": {0: {"util_pct": 87.0, "memory_mib": 20480.0}, 1: {"util_pct": 3.0, "memory_mib": 500.0}},
                     "process_memory_mib": {"worker 0": 1200.0, "monitor": 1300.0}}  # pid 999 is not ours
    second = bench.parse_gpu_sample("0, 91, 20000\n1, 5, 700", "111, 1500", roles)
    summary = bench.summarize_gpu_samples([first, second])
    assert summary["samples"] == 2
    assert summary["gpus"][0] == {"util_pct_mean": 89.0, "memory_mib_max": 20480.0}
    assert summary["gpus"][1] == {"util_pct_mean": 4.0, "memory_mib_max": 700.0}
    assert summary["process_memory_mib_max"] == {"monitor": 1300.0, "worker 0": 1500.0}
    assert bench.summarize_gpu_samples([]) is None


def test_no_gpu_readings_without_a_working_nvidia_smi(tmp_path, monkeypatch):
    bench = load_benchmark()
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    assert bench.gpu_sample({}) is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    assert bench.gpu_sample({}) is None  # a driver that does not answer
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n  --query-gpu*) echo '0, [N/A], 20480' ;;\n  *) echo '111, 1200' ;;\n"
                   "esac\n")  # utilisation under MIG
    assert bench.gpu_sample({111: "worker 0"}) is None


def test_the_step_cost_medians_take_the_same_rank_of_each_kind():
    """Of an even count of rounds the lower middle one of each kind: plain over ours is not biased low by taking
    the plain costs' mean of the two middle ones and ours' upper middle one."""
    bench = load_benchmark()
    ours = [{"total_ms": t} for t in (4.0, 1.0, 3.0, 2.0)]
    rounds = {"plain": [40.0, 10.0, 30.0, 20.0], "plain_keep_freed": [4.5, 1.5, 3.5, 2.5], "ours": ours}
    assert bench.median_rounds(rounds) == (20.0, 2.5, {"total_ms": 2.0})
    rounds = {"plain": [3.0, 1.0, 2.0], "plain_keep_freed": [6.0, 5.0, 4.0], "ours": ours[:3]}
    assert bench.median_rounds(rounds) == (2.0, 5.0, {"total_ms": 3.0})


@pytest.mark.slow
def test_benchmark_measures_dynamic_and_counts_its_retired_agents_as_expected(tmp_path):
    """With ``--dynamic`` an agent that the adjuster retires exits 0 on purpose: the benchmark must not take it for
    a death (it did). Seed 1: the adjuster's first trial is NA 1, so agent 1 is retired after the first window."""
    out = tmp_path / "bench.json"
    proc = run_entry("benchmarks/benchmark.py", "--workers", "1", "--modes-only", "--warmup", "3", "--window", "10",
                     "--json", str(out), "--ga3c-flags", "--agents 2 --envs-per-agent 2 --num-steps 5 --train-batch 1 "
                     "--hidden-size 32 --trainers 1 --seed 1 --dynamic --dynamic-seconds 2 --dynamic-max 1 1 3",
                     cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    g = json.loads(out.read_text())["ga3c"]
    assert g["flags"]["dynamic"] and g["steps"] > 0
    assert any(e.endswith("try NT 1 NP 1 NA 1 (from NT 1 NP 1 NA 2)") for e in g["dynamic_events"]), g
    assert "--dynamic at" in proc.stdout and "--dynamic ran NT 1 NP 1 NA" in proc.stdout


@pytest.mark.slow  # about 30 s: both modes, the second failing
def test_a_mode_that_fails_keeps_the_other_modes_figures_and_says_why(tmp_path):
    """The GA3C server's trainer raises at its second optimizer step (a CUDA error on a GPU would do the same):
    exit 1, and the JSON still holds A3G mode's figures, with GA3C mode's error and what its server reported.
    Before, the JSON was written only at the end (nothing was kept) and the server's report was not read."""
    from test_faults import fault_env
    out = tmp_path / "bench.json"
    env = {**fault_env("short_error", tmp_path / "fired"), "A3G_FAULT_ROLE": "a3g ga3c server"}
    proc = run_entry("benchmarks/benchmark.py", "--workers", "1", "--modes-only", "--warmup", "2", "--window", "4",
                     "--json", str(out), "--ga3c-flags", "--agents 1 --envs-per-agent 2 --num-steps 5 --train-batch 1 "
                     "--hidden-size 32 --trainers 1", cwd=tmp_path, timeout=280, env_extra=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "fired").exists()  # the fault fired, in the server
    res = json.loads(out.read_text())
    assert res["training"]["steps_per_s"] > 0 and "ga3c_over_a3g" not in res
    assert res["ga3c"]["error"] in ("ga3c server died during the benchmark",
                                    "the training processes did not start stepping"), res["ga3c"]
    assert "injected fault: a short error" in res["ga3c"]["reports"]
    assert "benchmark.py: error: GA3C mode: " in proc.stderr and "injected fault" in proc.stderr
    assert "Traceback" not in proc.stderr.split("failed:")[0]  # the reports hold the server's traceback, not ours


def test_the_step_budget_runs_and_its_ceilings_follow_from_its_pieces(tmp_path):
    out = tmp_path / "budget.json"
    proc = run_entry("benchmarks/budget.py", "--envs", "3", "--train-batch", "2", "--num-steps", "3", "--repeats",
                     "1", "--rollouts", "1", "--env-steps", "20", "--precision", "fp32", "bf16", "--lagged", "--json",
                     str(out), cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    m = res["median_ms"]
    assert res["precisions"] == ["fp32", "bf16"] and set(m) == {"env", "fp32", "bf16"}
    for p in ("fp32", "bf16"):
        assert set(m[p]) == {"a3g_act", "a3g_update", "ga3c_act", "ga3c_update", "ga3c_update_unchunked",
                             "ga3c_update_lagged", "ga3c_update_lagged_unchunked"}
        assert all(v > 0 for v in m[p].values())
        for mode in ("a3g", "ga3c"):
            key = f"{mode} {p}"
            total = m["env"] + m[p][f"{mode}_act"] + m[p][f"{mode}_update"]
            assert abs(res["step_ms"][key] - total) < 1e-9
            assert abs(res["ceiling_steps_per_s"][key] - os.cpu_count() * 1000 / total) < 1e-9
            assert abs(res["ceiling_over_a3g"][key] - res["step_ms"]["a3g fp32"] / total) < 1e-9
            roof = res["matmul_gflops_1_thread"] * 1000 * os.cpu_count()
            assert abs(res["ceiling_roof_fraction"][key] - res["ceiling_steps_per_s"][key]
                       * res["model_mflop_per_step"] / roof) < 1e-9
    assert res["ceiling_over_a3g"]["a3g fp32"] == 1.0
    for p in ("fp32", "bf16"):  # a default GA3C run: the lagged update, the encoder run again
        total = m["env"] + m[p]["ga3c_act"] + m[p]["ga3c_update_lagged"]
        assert abs(res["ga3c_default_step_ms"][p] - total) < 1e-9
        assert abs(res["ga3c_default_ceiling_over_a3g"][p] - res["step_ms"]["a3g fp32"] / total) < 1e-9
        assert f"{p}: a default GA3C run (no activations saved" in proc.stdout
    assert "GA3C (--replay-activations) / A3G at most" in proc.stdout and "native bf16:" in proc.stdout
    assert proc.stdout.count("with the first conv block in one piece") == 4  # 2 lines in each precision


@pytest.mark.parametrize("flags", [["--envs", "0"], ["--envs", "2", "--train-batch", "3"]])
def test_the_step_budget_rejects_bad_sizes_in_one_line(tmp_path, flags):
    proc = run_entry("benchmarks/budget.py", *flags, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "budget.py: error: --" in proc.stderr


@pytest.mark.parametrize("flags, a3g, ga3c", [
    ([], "fp32", "auto"),  # each mode at main.py's default
    (["--precision", "bf16"], "bf16", "bf16"),
    (["--precision", "fp32"], "fp32", "fp32"),
    (["--precision", "fp32", "--ga3c-flags", "--precision bf16 --agents 3"], "fp32", "bf16"),
    (["--ga3c-flags", "--precision fp32"], "fp32", "fp32"),
])
def test_each_mode_is_measured_at_main_py_s_default_precision_unless_told(tmp_path, flags, a3g, ga3c):
    bench = load_benchmark()
    opts = bench.benchmark_parser().parse_args(flags)
    a, g = bench.a3g_args(opts, tmp_path), bench.ga3c_args(opts, tmp_path / "ga3c")
    assert (a.mode, a.precision, a.lr) == ("a3g", a3g, 0.0001)
    assert (g.mode, g.precision, g.lr) == ("ga3c", ga3c, 0.0002)
    assert g.agents == (3 if "--agents 3" in " ".join(flags) else bench.build_parser().get_default("agents"))


BAD_INPUT = [  # (script, flags, what the one error line says); {tmp} is the test's folder, {file} a file in it
    ("benchmark.py", ["--env", "PongNoFrameskip-v5"],
     "--env: unknown environment id 'PongNoFrameskip-v5'; did you mean PongNoFrameskip-v4"),
    ("budget.py", ["--env", "PongNoFrameskip-v5"],
     "--env: unknown environment id 'PongNoFrameskip-v5'; did you mean PongNoFrameskip-v4"),
    ("benchmark.py", ["--workers", "0"], "--workers must be >= 1, got 0"),
    ("benchmark.py", ["--window", "0"], "--window must be > 0 seconds, got 0.0"),
    ("benchmark.py", ["--warmup", "-1", "--window", "-1"], "--warmup must be >= 0 seconds, got -1.0; --window must"),
    ("benchmark.py", ["--window", "inf"], "--window must be a finite number of seconds, got inf"),
    ("benchmark.py", ["--env-seconds", "0"], "--env-seconds must be > 0 seconds"),
    ("benchmark.py", ["--rollouts", "0"], "--rollouts must be >= 1"),
    ("benchmark.py", ["--repeats", "0"], "--repeats must be >= 1"),
    ("benchmark.py", ["--workers", "two"], "argument --workers: invalid int value: 'two'"),
    ("benchmark.py", ["--gpu-ids", "99"], "--gpu-ids"),  # no CUDA here, or no GPU 99
    ("benchmark.py", ["--ga3c-flags=--bogus"], "--ga3c-flags: unrecognized arguments: --bogus"),
    ("benchmark.py", ["--ga3c-flags", "--agents 0"], "--ga3c-flags: --agents must be >= 1, got 0"),
    ("benchmark.py", ["--ga3c-flags", "--agents '2"], "--ga3c-flags: No closing quotation"),
    ("benchmark.py", ["--ga3c-flags", "--env BreakoutNoFrameskip-v4"],
     "--ga3c-flags: --env BreakoutNoFrameskip-v4: both modes play the benchmark's own --env (PongNoFrameskip-v4); "
     "give --env to benchmark.py instead"),
    ("benchmark.py", ["--ga3c-flags", "--env-config x.json"],
     "--ga3c-flags: --env-config: both modes use the repository's config.json; leave it out"),
    ("benchmark.py", ["--json", "{tmp}"], "--json '{tmp}' is a folder: give a file name"),
    ("budget.py", ["--json", "{tmp}"], "--json '{tmp}' is a folder: give a file name"),
    ("benchmark.py", ["--json", "/proc/x.json"], "--json '/proc/x.json': its folder '/proc' cannot be written"),
    ("budget.py", ["--json", "/proc/x.json"], "--json '/proc/x.json': its folder '/proc' cannot be written"),
    ("benchmark.py", ["--json", "{file}/x.json"], "--json '{file}/x.json': its folder '{file}' is a file"),
    ("benchmark.py", ["--out-dir", "{file}"], "--out-dir '{file}' is a file, not a folder"),
    ("benchmark.py", ["--out-dir", "{file}/run"], "--out-dir '{file}/run': '{file}' is a file, not a folder"),
    ("multinode.py", ["--sync-seconds", "0"], "--sync-seconds must be > 0 and at most 86,400, got 0.0"),
]


def test_multinode_benchmark_checks_every_flag_before_ray_starts(tmp_path):
    """benchmarks/multinode.py's flags (one is run as a process above): before, only --workers and --rounds were
    checked (exit 1), a 0 --sync-seconds made every node sync in a busy loop, and a 0 --ps-gbit divided by zero
    after minutes of measuring."""
    spec = importlib.util.spec_from_file_location("multinode_benchmark", ROOT / "benchmarks" / "multinode.py")
    bench = importlib.util.module_from_spec(spec)  # not "multinode": that is Ray mode's package
    spec.loader.exec_module(bench)

    def problems(*argv):
        return bench.check_options(bench.benchmark_parser().parse_args(list(argv)))
    assert problems() == []
    assert problems("--ps-gbit", "0", "--window", "nan", "--rounds", "0", "--scale-workers", "0", "--warmup", "-1") == [
        "--rounds must be >= 1, got 0", "--warmup must be a finite number of seconds >= 0, got -1.0",
        "--window must be a finite number of seconds > 0, got nan", "--scale-workers must be >= 1, got 0",
        "--ps-gbit must be a finite number > 0, got 0.0"]
    assert problems("--json", str(tmp_path)) == [f"--json '{tmp_path}' is a folder: give a file name"]


@pytest.mark.parametrize("script, flags, message", BAD_INPUT,
                         ids=[f"{s[:-3]} {' '.join(f)}" for s, f, _ in BAD_INPUT])
def test_bad_input_is_one_error_line_and_exit_2_before_anything_is_measured_or_written(tmp_path, script, flags,
                                                                                      message):
    """An env id ale-py cannot make, a size or time out of range, a GPU this machine lacks, GA3C flags main.py
    refuses, a --json or --out-dir that cannot be written: each is refused at once, in one line, where it used to
    hang, give a traceback, or run the whole measurement first."""
    (tmp_path / "a-file").write_text("kept")
    fill = {"tmp": str(tmp_path), "file": str(tmp_path / "a-file")}
    before = sorted(tmp_path.rglob("*"))
    start = time.time()
    proc = run_entry(f"benchmarks/{script}", *[f.format(**fill) for f in flags], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"{script}: error: {message.format(**fill)}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not proc.stdout and time.time() - start < 50  # nothing measured
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "a-file").read_text() == "kept"  # nothing written


@pytest.mark.parametrize("script, flags, after_line, delay", [
    ("benchmark.py", [], None, 1.5),  # importing torch
    ("benchmark.py", ["--workers", "1"], "machine:", 1.5),  # a step-cost measurement in a fresh process
    ("benchmark.py", ["--workers", "1", "--modes-only"], "machine:", 2.0),  # the training processes
    ("budget.py", [], None, 1.5),  # importing torch
    pytest.param("budget.py", [], None, 6.0, marks=pytest.mark.slow),  # timing the pieces
], ids=["benchmark start-up", "benchmark step costs", "benchmark training", "budget start-up", "budget measuring"])
def test_ctrl_c_exits_130_in_one_line_and_leaves_no_process(tmp_path, script, flags, after_line, delay):
    """SIGINT to the process group (a terminal's Ctrl-C), during the imports or a measurement: exit 130 with one
    line, no traceback (the children's neither), and no process of the run left."""
    import signal
    import subprocess
    import sys

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *flags], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if after_line is not None:
            while after_line not in (line := proc.stdout.readline()) and line:
                pass
            assert line, "the benchmark ended before it measured"
        time.sleep(delay)
        if after_line is not None:  # the resource tracker and the measuring processes
            assert len(session_processes(proc.pid)) >= 3, "nothing running to interrupt"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=40)
        assert proc.returncode == 130, err[-2000:]
        assert err == f"{script}: interrupted\n"
        assert not processes_left(proc.pid), "a child process was left running"
    finally:
        kill_session(proc)

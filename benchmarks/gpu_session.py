"""Everything to do in a short session on a GPU machine, in order, within one time budget, writing what it produced
to one folder.

    python benchmarks/gpu_session.py --out OUT                       # all stages in --budget-seconds (540)
    python benchmarks/gpu_session.py --out OUT --stages train --load # go on training the same run, same machine

First a check of the machine, recorded in ``summary.json`` under ``preflight``: torch's version, whether CUDA is
there and the GPU's name and bf16 support, and whether the packages the stages import load. Where ``--gpu-ids``
names a GPU and CUDA is not there, or a package is missing, nothing else runs and the exit code is 1. Then the
stages (``--stages``, in this order):
1. ``tests``: ``pytest tests/test_gpu.py`` (the GPU tests of both modes), with the reasons for any skip ->
   ``tests.log``; the counts of passed, failed and skipped tests go to the summary;
2. ``bench``: ``benchmarks/benchmark.py --modes-only`` on ``--env`` and ``--gpu-ids``: A3G mode with ``--workers``
   and GA3C mode with ``--ga3c-flags``, in ``--precision`` (auto: bf16 where the GPU has it) -> ``bench.log``,
   ``bench.json`` (a ``bench.json`` left from an earlier call is removed first);
3. ``train``: ``main.py`` on ``--env`` in the faster mode of ``bench.json`` (or ``--mode`` when given; without a
   benchmark, GA3C mode on a GPU, 2.57x A3G mode on an H200 in docs/performance.md, and A3G mode on the CPU), into
   ``--run-dir``, for ``--train-seconds`` or whatever the budget leaves; with ``--load`` it resumes the run there
   (a later call on the same machine: ``--run-dir`` is outside ``OUT``, which gets only the files below). It
   copies the ``.dat`` and the monitor CSV into ``OUT/train/``; the run's output is ``train.log``.

The stages share ``--budget-seconds``: each is given what it needs at most (the tests 150 s, the benchmark
2 x (warmup + window) + 150 s) and no more than leaves the stages after it their minimum (the benchmark 100 s,
training 60 s); training gets the rest, less 75 s for its start-up and final save. A stage that runs past its time
is sent SIGTERM (main.py then writes its final checkpoint and ``.dat``), and SIGKILL 30 s later, with every process
it started. A stage that fails is recorded and the next one still runs. ``OUT`` gets at most 7 files: small
enough to copy back whole.

``OUT/summary.json`` records each stage's command, exit code, seconds, and the numbers that matter (steps/s of both
modes and their ratio; the run's global steps, running time and last monitor mean); it is rewritten after each
stage. On an H200 with 16 cores an earlier version's stages took 33 s (tests), 128 s (bench) and 246 s (train,
240 s of it training). The exit code is 0 when every stage ran and succeeded, 1 otherwise, 2 for bad input.

On a machine that has torch but not the other packages, install them first from wheels fetched elsewhere
(``--target`` a folder on ``PYTHONPATH``).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tests", "bench", "train")
PROG = "gpu_session.py"


TESTS_CAP, BENCH_EXTRA, BENCH_MIN, TRAIN_MIN, TRAIN_RESERVE, KILL_GRACE = 150.0, 150.0, 100.0, 60.0, 75.0, 30.0


def faster_mode(bench: dict | None, on_gpu: bool = False) -> str:
    """``ga3c`` when the benchmark measured GA3C mode faster than A3G mode, ``a3g`` when it did not; without a
    benchmark, ``ga3c`` on a GPU (2.57x A3G mode on an H200, docs/performance.md) and ``a3g`` on the CPU."""
    ratio = bench.get("ga3c_over_a3g") if isinstance(bench, dict) else None
    if not isinstance(ratio, (int, float)):
        return "ga3c" if on_gpu else "a3g"
    return "ga3c" if ratio > 1.0 else "a3g"


def stage_seconds(stage: str, later: list[str], left: float, opts) -> float:
    """The seconds ``stage`` may run: what it needs at most, and no more than leaves each ``later`` stage its
    minimum out of the ``left`` seconds of the budget (training: all of that, less nothing)."""
    need = {"tests": TESTS_CAP, "bench": 2 * (opts.warmup + opts.window) + BENCH_EXTRA}.get(stage, float("inf"))
    keep = sum({"tests": 0.0, "bench": BENCH_MIN, "train": TRAIN_MIN + TRAIN_RESERVE}[s] for s in later)
    return max(0.0, min(need, left - keep))


def run_stage(name: str, cmd: list[str], log: Path, timeout: float) -> dict:
    """Run ``cmd`` in the repository root, in a process group of its own, with its output in ``log``;
    ``{command, exit_code, seconds}``. Past ``timeout`` the group is sent SIGTERM, then SIGKILL ``KILL_GRACE``
    seconds later; the exit code is then 124."""
    start = time.time()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            f.write(f"\n{PROG}: the {name} stage ran past {timeout:.0f} s: SIGTERM\n")
            f.flush()
            signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:
                f.write(f"{PROG}: still running {KILL_GRACE:.0f} s later: SIGKILL\n")
            code = 124
        finally:
            signal_group(proc, signal.SIGKILL)  # whatever the stage left running
            proc.wait()
    return {"command": shlex.join(cmd), "exit_code": code, "seconds": round(time.time() - start, 1)}


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def preflight(py: str, on_gpu: bool) -> dict:
    """torch's version, CUDA, the GPU and its bf16, and the packages the stages import, from a child Python (as the
    stages see them); ``ok`` false where a package is missing, or CUDA is, with a GPU asked for."""
    code = ("import importlib, json, torch\n"
            "missing = []\n"
            "for m in ('gymnasium', 'ale_py', 'cv2', 'psutil', 'pytest', 'numpy', 'setproctitle'):\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception as e:\n        missing.append(f'{m}: {e}')\n"
            "cuda = torch.cuda.is_available()\n"
            "print(json.dumps({'torch': torch.__version__, 'cuda': cuda,\n"
            "    'gpu': torch.cuda.get_device_name(0) if cuda else None,\n"
            "    'bf16': torch.cuda.is_bf16_supported() if cuda else None,\n"
            "    'gpus': torch.cuda.device_count() if cuda else 0, 'missing': missing}))\n")
    try:
        r = subprocess.run([py, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        info = json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"ok": False, "error": f"the check did not finish: {e}"}
    info["ok"] = not info["missing"] and (info["cuda"] or not on_gpu)
    return info


def pytest_counts(log: Path) -> dict:
    """``{passed, failed, skipped, errors}`` from pytest's last summary line in ``log`` (those it names)."""
    import re
    lines = [line for line in log.read_text(errors="replace").splitlines() if re.search(r"\d+ (passed|failed)", line)]
    if not lines:
        return {}
    return {word if word != "error" else "errors": int(n)
            for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1])}


def last_monitor(csv_path: Path) -> dict:
    """The last complete monitor game of a run's CSV: global steps, running seconds, and the window mean (a row
    cut short by a kill is left out)."""
    import csv
    with open(csv_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if None not in r.values() and (r.get("global_steps") or "").isdigit()]
    if not rows:
        return {"games": 0}
    last = rows[-1]
    try:
        return {"games": len(rows), "global_steps": int(last["global_steps"]), "elapsed_s": float(last["elapsed_s"]),
                "last_window_mean": float(last["window_mean"]) if last["window_mean"] else None}
    except (KeyError, ValueError):
        return {"games": len(rows)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for everything the stages produce")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES, help="stages to run, in order")
    p.add_argument("--gpu-ids", type=int, nargs="+", default=[0], help="GPUs (default: 0)")
    p.add_argument("--precision", default="auto", choices=["fp32", "bf16", "auto"],
                   help="both modes' precision (default: auto)")
    p.add_argument("--workers", type=int, default=16, help="A3G workers, in the benchmark and training")
    p.add_argument("--ga3c-flags", default="--agents 8 --envs-per-agent 16 --predictors 2 --trainers 2",
                   help="GA3C mode's flags, in the benchmark and training (default: %(default)s; main.py then "
                        "takes --train-batch 32 for the 128 env slots, which keeps the policy lag near 3 updates: "
                        "docs/results.md, 'Policy lag')")
    p.add_argument("--warmup", type=float, default=10.0, help="benchmark warm-up seconds per mode")
    p.add_argument("--window", type=float, default=40.0, help="benchmark window seconds per mode")
    p.add_argument("--env", default="BreakoutNoFrameskip-v4", help="the game to train (default: %(default)s)")
    p.add_argument("--mode", default=None, choices=["a3g", "ga3c"],
                   help="train in this mode (default: the faster one in the benchmark)")
    p.add_argument("--budget-seconds", type=float, default=540.0,
                   help="wall time for all the stages together, the machine check included (default: %(default)s)")
    p.add_argument("--train-seconds", type=float, default=None,
                   help="seconds of training in the train stage at most (default: what the budget leaves)")
    p.add_argument("--run-dir", default="runs/gpu-session",
                   help="the training run's folder (models/, logs/), outside --out and kept between calls on "
                        "one machine (default: %(default)s)")
    p.add_argument("--load", action="store_true", help="resume the run in --run-dir")
    p.add_argument("--extra", default="", help="more main.py flags for the train stage, in one string")
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    opts = build_parser().parse_args(argv)
    errors = [f"--{k.replace('_', '-')} must be > 0" for k in ("workers", "window", "budget_seconds")
              if getattr(opts, k) <= 0]
    if opts.train_seconds is not None and opts.train_seconds <= 0:
        errors.append("--train-seconds must be > 0")
    if opts.warmup < 0:
        errors.append("--warmup must be >= 0")
    for e in errors:
        print(f"{PROG}: error: {e}", file=sys.stderr)
    if errors:
        return 2
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    except ValueError:
        summary = {}
    gpus = [str(g) for g in opts.gpu_ids]
    on_gpu = any(g >= 0 for g in opts.gpu_ids)
    py = sys.executable

    def save():
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")

    summary["preflight"] = preflight(py, on_gpu)
    save()
    print(f"{PROG}: preflight {json.dumps(summary['preflight'])}", flush=True)
    if not summary["preflight"]["ok"]:
        print(f"{PROG}: the machine cannot run the stages (preflight in {summary_path}); nothing else ran",
              flush=True)
        return 1
    ok = True
    stages = [s for s in STAGES if s in opts.stages]
    for k, stage in enumerate(stages):
        left = opts.budget_seconds - (time.time() - started)
        seconds = stage_seconds(stage, stages[k + 1:], left, opts)
        print(f"{PROG}: {stage} (at most {seconds:.0f} s) ...", flush=True)
        if stage == "tests":
            res = run_stage(stage, [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                            out / "tests.log", seconds)
            res.update(pytest_counts(out / "tests.log"))
        elif stage == "bench":
            bench_json = out / "bench.json"
            bench_json.unlink(missing_ok=True)
            res = run_stage(stage, [py, "benchmarks/benchmark.py", "--modes-only", "--env", opts.env,
                                    "--workers", str(opts.workers), "--gpu-ids", *gpus,
                                    "--precision", opts.precision, "--warmup", str(opts.warmup),
                                    "--window", str(opts.window), "--ga3c-flags",
                                    f"{opts.ga3c_flags} --precision {opts.precision}",
                                    "--json", str(bench_json.resolve())],
                            out / "bench.log", seconds)
            try:
                b = json.loads(bench_json.read_text())
                res.update(a3g_steps_per_s=b["training"]["steps_per_s"], precision=b.get("precision"),
                           ga3c_steps_per_s=b.get("ga3c", {}).get("steps_per_s"),
                           ga3c_over_a3g=b.get("ga3c_over_a3g"), machine=b.get("machine"))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                res["bench_json"] = f"not read: {e}"
        else:
            try:
                bench = json.loads((out / "bench.json").read_text())
            except (OSError, ValueError):
                bench = None
            mode = opts.mode or faster_mode(bench, on_gpu)
            train_seconds = min(opts.train_seconds or float("inf"), seconds - TRAIN_RESERVE)
            run_dir = Path(opts.run_dir)
            flags = ["--workers", str(opts.workers)] if mode == "a3g" else ["--mode", "ga3c",
                                                                            *shlex.split(opts.ga3c_flags)]
            cmd = [py, "main.py", "--env", opts.env, *flags, "--gpu-ids", *gpus, "--precision", opts.precision,
                   "--max-seconds", f"{max(train_seconds, 1):.0f}", "--save-model-dir", str(run_dir / "models"),
                   "--log-dir", str(run_dir / "logs"), *shlex.split(opts.extra)] + (["--load"] if opts.load else [])
            if train_seconds < min(TRAIN_MIN, opts.train_seconds or TRAIN_MIN):
                res = {"command": shlex.join(cmd), "exit_code": 1, "seconds": 0.0,
                       "skipped": f"the budget left {seconds:.0f} s: too little to train"}
            else:
                res = run_stage(stage, cmd, out / "train.log", train_seconds + TRAIN_RESERVE)
            res["mode"] = mode
            dest = out / "train"
            dest.mkdir(exist_ok=True)
            name = opts.env.replace("/", "_")
            logs = ROOT / run_dir / "logs" if not run_dir.is_absolute() else run_dir / "logs"
            models = logs.parent / "models"
            for src in (models / f"{name}.dat", logs / f"{name}_monitor.csv"):
                if src.is_file():
                    shutil.copy2(src, dest / src.name)
            if (dest / f"{name}_monitor.csv").is_file():
                res.update(last_monitor(dest / f"{name}_monitor.csv"))
        summary[stage] = res
        save()
        print(f"{PROG}: {stage} exit {res['exit_code']} in {res['seconds']:.0f} s", flush=True)
        ok = ok and res["exit_code"] == 0
    print(f"{PROG}: wrote {summary_path} ({time.time() - started:.0f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

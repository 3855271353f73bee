"""Everything to do in a short session on a GPU machine, in order, writing what it produced to one folder.

    python benchmarks/gpu_session.py --out OUT                       # all stages: tests, bench, train
    python benchmarks/gpu_session.py --out OUT --stages train --load # go on training the same run

Stages (``--stages``, in this order):
1. ``tests``: ``pytest tests/test_gpu.py`` (the GPU tests of both modes; skipped without CUDA) -> ``tests.log``;
2. ``bench``: ``benchmarks/benchmark.py --modes-only`` on ``--gpu-ids``: A3G mode with ``--workers`` and GA3C mode
   with ``--ga3c-flags``, in ``--precision`` (auto: bf16 where the GPU has it) -> ``bench.log``, ``bench.json``;
3. ``train``: ``main.py`` on ``--env`` in the faster mode of ``bench.json`` (or ``--mode`` when given, or A3G mode
   when there is no benchmark), for ``--train-seconds``, into ``--run-dir``; with ``--load`` it resumes the run
   there. It copies the ``.dat``, the monitor CSV and the training log into ``OUT/train/``.

``OUT/summary.json`` records each stage's command, exit code, seconds, and the numbers that matter (steps/s of both
modes and their ratio; the run's global steps, running time and last monitor mean). A stage that fails is recorded
and the next one still runs. At the defaults all three fit in one 10-minute command: on an H200 with 16 cores the
tests took 33 s, the bench stage 128 s and the train stage 246 s (``--train-seconds`` 240), 413 s in all with
the wheels' install. The exit code is 0 when every stage ran and succeeded, 1 otherwise, 2 for bad input.

On a machine that has torch but not the other packages, install them first from wheels fetched elsewhere
(``--target`` a folder on ``PYTHONPATH``).
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tests", "bench", "train")
PROG = "gpu_session.py"


def faster_mode(bench: dict | None) -> str:
    """``ga3c`` when the benchmark measured GA3C mode faster than A3G mode, else ``a3g`` (also without one)."""
    if not bench or "ga3c_over_a3g" not in bench:
        return "a3g"
    return "ga3c" if bench["ga3c_over_a3g"] > 1.0 else "a3g"


def run_stage(name: str, cmd: list[str], log: Path, timeout: float) -> dict:
    """Run ``cmd`` in the repository root with its output in ``log``; ``{command, exit_code, seconds}``."""
    start = time.time()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
            f.write(f"\n{PROG}: the {name} stage ran past {timeout:.0f} s and was stopped\n")
    return {"command": shlex.join(cmd), "exit_code": code, "seconds": round(time.time() - start, 1)}


def last_monitor(csv_path: Path) -> dict:
    """The last monitor game of a run's CSV: global steps, running seconds, and the window mean."""
    import csv
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {"games": 0}
    last = rows[-1]
    return {"games": len(rows), "global_steps": int(last["global_steps"]), "elapsed_s": float(last["elapsed_s"]),
            "last_window_mean": float(last["window_mean"]) if last["window_mean"] else None}


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
    p.add_argument("--train-seconds", type=float, default=240.0, help="seconds of training in the train stage")
    p.add_argument("--run-dir", default="runs/gpu-session",
                   help="the training run's folder (models/, logs/), kept between calls (default: %(default)s)")
    p.add_argument("--load", action="store_true", help="resume the run in --run-dir")
    p.add_argument("--extra", default="", help="more main.py flags for the train stage, in one string")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    errors = [f"--{k.replace('_', '-')} must be > 0" for k in ("workers", "train_seconds", "window")
              if getattr(opts, k) <= 0]
    if opts.warmup < 0:
        errors.append("--warmup must be >= 0")
    for e in errors:
        print(f"{PROG}: error: {e}", file=sys.stderr)
    if errors:
        return 2
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    gpus = [str(g) for g in opts.gpu_ids]
    py = sys.executable
    ok = True
    for stage in [s for s in STAGES if s in opts.stages]:
        print(f"{PROG}: {stage} ...", flush=True)
        if stage == "tests":
            res = run_stage(stage, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                            out / "tests.log", 900)
        elif stage == "bench":
            res = run_stage(stage, [py, "benchmarks/benchmark.py", "--modes-only", "--workers", str(opts.workers),
                                    "--gpu-ids", *gpus, "--precision", opts.precision, "--warmup", str(opts.warmup),
                                    "--window", str(opts.window), "--ga3c-flags",
                                    f"{opts.ga3c_flags} --precision {opts.precision}",
                                    "--json", str((out / "bench.json").resolve())],
                            out / "bench.log", 2 * (opts.warmup + opts.window) + 600)
            if (out / "bench.json").is_file():
                b = json.loads((out / "bench.json").read_text())
                res.update(a3g_steps_per_s=b["training"]["steps_per_s"], precision=b.get("precision"),
                           ga3c_steps_per_s=b.get("ga3c", {}).get("steps_per_s"),
                           ga3c_over_a3g=b.get("ga3c_over_a3g"), machine=b["machine"])
        else:
            bench = json.loads((out / "bench.json").read_text()) if (out / "bench.json").is_file() else None
            mode = opts.mode or faster_mode(bench)
            run_dir = Path(opts.run_dir)
            flags = ["--workers", str(opts.workers)] if mode == "a3g" else ["--mode", "ga3c",
                                                                            *shlex.split(opts.ga3c_flags)]
            cmd = [py, "main.py", "--env", opts.env, *flags, "--gpu-ids", *gpus, "--precision", opts.precision,
                   "--max-seconds", str(opts.train_seconds), "--save-model-dir", str(run_dir / "models"),
                   "--log-dir", str(run_dir / "logs"), *shlex.split(opts.extra)] + (["--load"] if opts.load else [])
            res = run_stage(stage, cmd, out / "train.log", opts.train_seconds + 600)
            res["mode"] = mode
            dest = out / "train"
            dest.mkdir(exist_ok=True)
            name = opts.env.replace("/", "_")
            logs = ROOT / run_dir / "logs" if not run_dir.is_absolute() else run_dir / "logs"
            models = logs.parent / "models"
            for src in (models / f"{name}.dat", logs / f"{name}_monitor.csv", logs / f"{name}_train.log",
                        logs / f"{name}_log"):
                if src.is_file():
                    shutil.copy2(src, dest / src.name)
            if (dest / f"{name}_monitor.csv").is_file():
                res.update(last_monitor(dest / f"{name}_monitor.csv"))
        summary[stage] = res
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"{PROG}: {stage} exit {res['exit_code']} in {res['seconds']:.0f} s", flush=True)
        ok = ok and res["exit_code"] == 0
    print(f"{PROG}: wrote {summary_path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

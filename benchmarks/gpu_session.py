"""Everything to do in a short session on a GPU machine, in order, within one time budget, writing what it produced
to one folder.

    python benchmarks/gpu_session.py --out OUT                       # all stages in --budget-seconds (540)
    python benchmarks/gpu_session.py --out OUT --stages train --load # go on training the same run, same machine

Bad input is one line each and exit code 2 before anything runs: numbers out of range or not finite, a
``--ga3c-flags`` or ``--extra`` that does not split as a shell would, an ``--out`` that is a file, ``--gpu-ids``
mixing -1 with GPU ids, ``--load`` without a checkpoint in ``--run-dir`` or a checkpoint there without it. Then a
check of the machine, recorded in ``summary.json`` under ``preflight``: torch's version, whether CUDA is there and
the GPU's name and bf16 support, whether the packages the stages import load, and what main.py's own checks (on
this machine: ``--gpu-ids`` it lacks, a bad ``--env``, flags main.py refuses) say of the commands the stages would
run. Where ``--gpu-ids`` names a GPU and CUDA is not there, or a package is missing, nothing else runs and the exit
code is 1; where main.py's checks refuse a command the benchmark needs, or every one the train stage may choose,
they are printed and the exit code is 2. Then the stages (``--stages``, in this order):
1. ``tests``: ``pytest tests/test_gpu.py`` (the GPU tests of both modes), with the reasons for any skip ->
   ``tests.log``; the counts of passed, failed and skipped tests go to the summary;
2. ``bench``: ``benchmarks/benchmark.py --modes-only`` on ``--env`` and ``--gpu-ids``: A3G mode with ``--workers``
   and GA3C mode with ``--ga3c-flags``, in ``--precision`` (auto: bf16 where the GPU has it) -> ``bench.log``,
   ``bench.json`` (a ``bench.json`` left from an earlier call is removed first);
3. ``train``: ``main.py`` on ``--env`` in the faster mode of ``bench.json`` (or ``--mode`` when given; without a
   benchmark, GA3C mode on a GPU, 4.06x A3G mode on an H200 in docs/performance.md, and A3G mode on the CPU; A3G
   mode where this call's benchmark measured no ratio, GA3C mode having failed there), into
   ``--run-dir``, for ``--train-seconds`` or whatever the budget leaves; with ``--load`` it resumes the run there
   (a later call on the same machine: ``--run-dir`` is outside ``OUT``, which gets only the files below), in the
   mode it chose before (``--run-dir``'s ``gpu_session_mode``), whatever a new benchmark says. It copies the
   ``.dat`` and the monitor CSV written by this stage into ``OUT/train/`` (emptied first) every 30 s while it
   runs and at its end, so that a kill -9 of this script loses at most 30 s of them; the run's output is
   ``train.log``. (Its ``.ckpt``, about 39 MB at hidden size 512, stays in ``--run-dir``.)

The stages share ``--budget-seconds``: each is given what it needs at most (the tests 150 s, the benchmark
2 x (warmup + window) + 150 s) and no more than leaves the stages after it their minimum (the benchmark 100 s,
training 60 s); training gets the rest, less 40 s for its start-up and final save. A stage that runs past its time
is sent SIGTERM (main.py then writes its final checkpoint and ``.dat``), and SIGKILL 30 s later, with every process
it started; a stage given no time is skipped. A stage that fails is recorded and the next one still runs, also
where this script's own handling of it raised (its error and traceback in the summary). The tests run with
``-v`` and, where pytest-timeout is installed, 60 s a test, so that one test that hangs fails alone. A stop
signal to this script (SIGTERM, as when the device call's time limit comes before ``--budget-seconds``, SIGHUP,
Ctrl-C) stops the stage in progress the same way at once, copies what the train stage wrote, writes the summary
and exits with 128 + the signal; nothing is left running. ``--budget-seconds`` should still fit the call's limit.
``OUT`` gets at most 7 files: small enough to copy back whole.

``OUT/summary.json`` records each stage's command, exit code, seconds, and the numbers that matter (steps/s of both
modes and their ratio; the run's global steps, running time and last monitor mean); it is rewritten as each
stage starts (``"running": true``) and after it. On an H200 with 16 cores, at 3c0b348, the stages took 37 s (tests),
132 s (bench) and 152 s (train, ended by its ``--lr-anneal-steps`` after 146 s). The exit code is 0 when every stage ran and succeeded, 1 otherwise, 2 for bad input.

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


TESTS_CAP, BENCH_EXTRA, BENCH_MIN, TRAIN_MIN, TRAIN_RESERVE, KILL_GRACE = 150.0, 150.0, 100.0, 60.0, 40.0, 30.0
COPY_EVERY = 30.0  # seconds between two copies of the train stage's files into OUT while it runs
TEST_TIMEOUT = 60  # seconds a GPU test may run (pytest-timeout) before it fails and the next one runs


def faster_mode(bench: dict | None, on_gpu: bool = False, bench_ran: bool = False) -> str:
    """``ga3c`` when the benchmark measured GA3C mode faster than A3G mode, ``a3g`` when it did not; without a
    benchmark, ``ga3c`` on a GPU (4.06x A3G mode on an H200, docs/performance.md) and ``a3g`` on the CPU; and
    ``a3g`` where the benchmark ran in this session and measured no ratio (GA3C mode failed there, or it was cut
    short): training would spend the rest of the budget on what just failed."""
    ratio = bench.get("ga3c_over_a3g") if isinstance(bench, dict) else None
    if not isinstance(ratio, (int, float)):
        return "a3g" if bench_ran or not on_gpu else "ga3c"
    return "ga3c" if ratio > 1.0 else "a3g"


def stage_seconds(stage: str, later: list[str], left: float, opts) -> float:
    """The seconds ``stage`` may run: what it needs at most, and no more than leaves each ``later`` stage its
    minimum out of the ``left`` seconds of the budget (training: all of that, less nothing)."""
    need = {"tests": TESTS_CAP, "bench": 2 * (opts.warmup + opts.window) + BENCH_EXTRA}.get(stage, float("inf"))
    keep = sum({"tests": 0.0, "bench": BENCH_MIN, "train": TRAIN_MIN + TRAIN_RESERVE}[s] for s in later)
    return max(0.0, min(need, left - keep))


class SessionStopped(Exception):
    """A stop signal (SIGTERM, SIGHUP, SIGINT) reached this script: the device call's time limit, a hang-up, Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_stop_signal: int | None = None


def _on_stop_signal(signum, frame) -> None:
    """The first stop signal raises ``SessionStopped`` where the main thread is; later ones are only noted, so that
    the stage in progress is still stopped cleanly and the summary written."""
    global _stop_signal
    if _stop_signal is None:
        _stop_signal = signum
        raise SessionStopped(signum)


def run_stage(name: str, cmd: list[str], log: Path, timeout: float, every=None) -> dict:
    """Run ``cmd`` in the repository root, in a process group of its own (in this session, so that whatever ends
    the session's processes ends it too), with its output in ``log``; ``{command, exit_code, seconds}``. While it
    runs, ``every()`` is called each ``COPY_EVERY`` seconds (the train stage copies its files into OUT, so that a
    kill -9 of this script loses at most that much). Past ``timeout`` the group is sent SIGTERM, then SIGKILL
    ``KILL_GRACE`` seconds later; the exit code is then 124. A stop signal to this script (``SessionStopped``)
    stops the stage the same way at once (main.py writes its final checkpoint), adds ``stopped_by`` and raises
    it again."""
    start = time.time()
    stopped = None
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, process_group=0)
        try:
            try:
                code = None
                while code is None:
                    left = start + timeout - time.time()
                    if left <= 0:
                        raise subprocess.TimeoutExpired(cmd, timeout)
                    try:
                        code = proc.wait(timeout=min(left, COPY_EVERY) if every is not None else left)
                    except subprocess.TimeoutExpired:
                        if every is None or time.time() - start >= timeout:
                            raise
                        try:
                            every()
                        except OSError as e:  # a full disk: the stage goes on; the final copy says more
                            f.write(f"\n{PROG}: copying the stage's files failed: {e}\n")
                            f.flush()
            except subprocess.TimeoutExpired:
                f.write(f"\n{PROG}: the {name} stage ran past {timeout:.0f} s: SIGTERM\n")
                code = 124
            except SessionStopped as e:
                stopped = e
                f.write(f"\n{PROG}: stopped by signal {e.signum}: SIGTERM to the {name} stage\n")
                code = 128 + e.signum
            if proc.returncode is None:
                f.flush()
                signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=KILL_GRACE)
                except subprocess.TimeoutExpired:
                    f.write(f"{PROG}: still running {KILL_GRACE:.0f} s later: SIGKILL\n")
        finally:
            signal_group(proc, signal.SIGKILL)  # whatever the stage left running
            proc.wait()
    res = {"command": shlex.join(cmd), "exit_code": code, "seconds": round(time.time() - start, 1)}
    if stopped is not None:
        res["stopped_by"] = signal.Signals(stopped.signum).name
        stopped.result = res
        raise stopped
    return res


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


PREFLIGHT = """
import importlib, json, sys, torch
missing = []
for m in ('gymnasium', 'ale_py', 'cv2', 'psutil', 'pytest', 'numpy', 'setproctitle'):
    try:
        importlib.import_module(m)
    except Exception as e:
        missing.append(f'{m}: {e}')
cuda = torch.cuda.is_available()
problems = {}
if not missing:  # main.py's own checks of each command a stage would run, on this machine
    from config import build_parser, validate
    for label, argv in json.loads(sys.argv[1]).items():
        parser = build_parser()
        def error(message):
            raise ValueError(message)
        parser.error = error
        try:
            problems[label] = validate(parser.parse_args(argv))
        except ValueError as e:
            problems[label] = [str(e)]
print(json.dumps({'torch': torch.__version__, 'cuda': cuda,
    'gpu': torch.cuda.get_device_name(0) if cuda else None,
    'bf16': torch.cuda.is_bf16_supported() if cuda else None,
    'gpus': torch.cuda.device_count() if cuda else 0, 'missing': missing, 'problems': problems}))
"""


def preflight(py: str, on_gpu: bool, commands: dict[str, list[str]] | None = None) -> dict:
    """torch's version, CUDA, the GPU and its bf16, and the packages the stages import, from a child Python (as the
    stages see them); ``ok`` false where a package is missing, or CUDA is, with a GPU asked for. ``problems``:
    for each of ``commands`` (a label and the main.py flags a stage would run), what main.py's checks
    (``config.validate``, on this machine) say of it (none where a package is missing)."""
    try:
        r = subprocess.run([py, "-c", PREFLIGHT, json.dumps(commands or {})], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        info = json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        tail = ""
        if isinstance(e, (ValueError, IndexError)):
            lines = r.stderr.strip().splitlines()
            tail = f"; exit code {r.returncode}" + (f"; {' | '.join(lines[-3:])}" if lines else "")
        return {"ok": False, "error": f"the check did not finish: {type(e).__name__}: {e}{tail}"}
    info["ok"] = not info["missing"] and (info["cuda"] or not on_gpu)
    return info


def pytest_counts(log: Path) -> dict:
    """``{passed, failed, skipped, errors}`` from pytest's last summary line in ``log`` (those it names)."""
    import re
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", line)]
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


def check_input(opts) -> list[str]:
    """What is wrong with the flags, before anything runs (one line each)."""
    import math
    errors = [f"--{k.replace('_', '-')} must be > 0" for k in ("workers", "window", "budget_seconds")
              if getattr(opts, k) <= 0]
    if opts.train_seconds is not None and opts.train_seconds <= 0:
        errors.append("--train-seconds must be > 0")
    if opts.warmup < 0:
        errors.append("--warmup must be >= 0")
    errors += [f"--{k.replace('_', '-')} must be a finite number, got {getattr(opts, k)}"
               for k in ("warmup", "window", "budget_seconds", "train_seconds")
               if getattr(opts, k) is not None and not math.isfinite(getattr(opts, k))]
    for flag, value in (("--ga3c-flags", opts.ga3c_flags), ("--extra", opts.extra)):
        try:
            shlex.split(value)
        except ValueError as e:
            errors.append(f"{flag} {value!r}: {e} (it is split as a shell would)")
    if Path(opts.out).exists() and not Path(opts.out).is_dir():
        errors.append(f"--out {opts.out} is a file, not a folder: pass a folder")
    if any(g < 0 for g in opts.gpu_ids) and (len(opts.gpu_ids) > 1 or not all(g < 0 for g in opts.gpu_ids)):
        errors.append(f"--gpu-ids {' '.join(map(str, opts.gpu_ids))}: give -1 once for the CPU, or GPU ids")
    if "train" in opts.stages:
        name = opts.env.replace("/", "_")
        models = run_path(opts.run_dir) / "models"
        found = [p for p in (models / f"{name}.ckpt", models / f"{name}.dat") if p.exists()]
        if opts.load and not (models / f"{name}.ckpt").is_file():
            errors.append(f"--load: there is no {models / (name + '.ckpt')} to resume: drop --load, or pass the "
                          f"--run-dir of the run to resume")
        elif not opts.load and found:
            errors.append(f"{found[0]} exists and training would overwrite it: pass --load to go on with that run, "
                          f"or another --run-dir")
    return errors


def run_path(run_dir: str) -> Path:
    """``--run-dir`` as the stages see it (they run in the repository root)."""
    return Path(run_dir) if Path(run_dir).is_absolute() else ROOT / run_dir


def stage_commands(opts, extra: bool = True) -> dict[str, list[str]]:
    """main.py's flags in each mode as the train stage gives them (``extra``: with ``--extra``), or as the
    benchmark runs each mode (without it)."""
    gpus = [str(g) for g in opts.gpu_ids]
    run_dir = run_path(opts.run_dir)
    common = ["--env", opts.env, "--gpu-ids", *gpus, "--precision", opts.precision,
              "--save-model-dir", str(run_dir / "models"), "--log-dir", str(run_dir / "logs")]
    more = shlex.split(opts.extra) if extra else []
    return {"a3g": ["--workers", str(opts.workers), *common, *more],
            "ga3c": ["--mode", "ga3c", *shlex.split(opts.ga3c_flags), *common, *more]}


def commands_to_check(opts) -> dict[str, list[str]]:
    """The main.py flag lists the preflight checks: both modes as the benchmark runs them, and the train stage's
    in its mode (both modes where the benchmark will choose)."""
    checks = {}
    if "bench" in opts.stages:
        checks.update({f"bench {m}": argv for m, argv in stage_commands(opts, extra=False).items()})
    if "train" in opts.stages:
        known = opts.mode or (saved_mode(run_path(opts.run_dir)) if opts.load else None)
        checks.update({f"train {m}": argv for m, argv in stage_commands(opts).items() if known in (None, m)})
    return checks


def fatal_problems(problems: dict[str, list[str]]) -> list[str]:
    """The preflight's problems that stop the session: any of the benchmark's, and the train stage's where its
    mode is known or every mode it may choose has some."""
    train = {k: v for k, v in problems.items() if k.startswith("train ")}
    lines = [f"{k}: {e}" for k, v in problems.items() if k.startswith("bench ") for e in v]
    if train and all(train.values()):
        lines += [f"{k}: {e}" for k, v in train.items() for e in v]
    return lines


def saved_mode(run_dir: Path) -> str | None:
    """The mode the train stage chose for the run in ``run_dir`` (``MODE_FILE``), so that ``--load`` goes on in
    it: a later call's ``OUT`` has no ``bench.json``."""
    try:
        mode = (run_dir / MODE_FILE).read_text().strip()
    except OSError:
        return None
    return mode if mode in ("a3g", "ga3c") else None


MODE_FILE = "gpu_session_mode"


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    opts = build_parser().parse_args(argv)
    errors = check_input(opts)
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
    on_gpu = any(g >= 0 for g in opts.gpu_ids)
    py = sys.executable

    def save():
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_stop_signal)
    try:
        summary["preflight"] = preflight(py, on_gpu, commands_to_check(opts))
        save()
        print(f"{PROG}: preflight {json.dumps(summary['preflight'])}", flush=True)
        if not summary["preflight"]["ok"]:
            print(f"{PROG}: the machine cannot run the stages (preflight in {summary_path}); nothing else ran",
                  flush=True)
            return 1
        problems = fatal_problems(summary["preflight"].get("problems") or {})
        for problem in problems:
            print(f"{PROG}: error: main.py flags of the {problem}", file=sys.stderr)
        if problems:
            return 2
        ok = True
        stages = [s for s in STAGES if s in opts.stages]
        for k, stage in enumerate(stages):
            left = opts.budget_seconds - (time.time() - started)
            seconds = stage_seconds(stage, stages[k + 1:], left, opts)
            print(f"{PROG}: {stage} (at most {seconds:.0f} s) ...", flush=True)
            summary[stage] = {"running": True, "at_most_seconds": round(seconds)}  # what a kill -9 leaves
            save()
            stage_start = time.time()
            try:
                res = run_one(stage, opts, out, py, seconds)
            except SessionStopped as e:
                summary[stage] = getattr(e, "result", {"exit_code": 128 + e.signum, "stopped_by":
                                                       signal.Signals(e.signum).name})
                if stage == "train":
                    summary[stage].update(collect_train(opts, out, started_at=time.time() - summary[stage].get(
                        "seconds", 0.0)))
                raise
            except Exception as e:  # noqa: BLE001 -- recorded; the later stages still run
                import traceback
                res = {"exit_code": 1, "seconds": round(time.time() - stage_start, 1),
                       "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                if stage == "train":
                    try:
                        res.update(collect_train(opts, out, started_at=stage_start))
                    except Exception as again:  # noqa: BLE001
                        res["collect_error"] = f"{type(again).__name__}: {again}"
            summary[stage] = res
            save()
            print(f"{PROG}: {stage} exit {res['exit_code']} in {res['seconds']:.0f} s", flush=True)
            ok = ok and res["exit_code"] == 0
    except SessionStopped as e:
        save()
        print(f"{PROG}: stopped by {signal.Signals(e.signum).name}; the stage in progress was stopped and "
              f"{summary_path} written", file=sys.stderr, flush=True)
        return 128 + e.signum
    print(f"{PROG}: wrote {summary_path} ({time.time() - started:.0f} s)", flush=True)
    return 0 if ok else 1


def run_one(stage: str, opts, out: Path, py: str, seconds: float) -> dict:
    """One stage within ``seconds`` (see the module docstring); its summary entry. A stage given no time is
    skipped (exit code 1)."""
    gpus = [str(g) for g in opts.gpu_ids]
    if stage == "tests":
        import importlib.util
        # each test named as it runs, and one that hangs failed after TEST_TIMEOUT s (where pytest-timeout is
        # there), so that the stage's cap never cuts the log short of the later tests and the counts
        timeout = ["--timeout", str(TEST_TIMEOUT)] if importlib.util.find_spec("pytest_timeout") else []
        cmd = [py, "-m", "pytest", "-v", "-rs", *timeout, "-p", "no:cacheprovider", "tests/test_gpu.py"]
        if seconds <= 0:
            return {"command": shlex.join(cmd), "exit_code": 1, "seconds": 0.0, "skipped": "the budget left no time"}
        res = run_stage(stage, cmd, out / "tests.log", seconds)
        res.update(pytest_counts(out / "tests.log"))
        return res
    if stage == "bench":
        bench_json = out / "bench.json"
        bench_json.unlink(missing_ok=True)
        cmd = [py, "benchmarks/benchmark.py", "--modes-only", "--env", opts.env, "--workers", str(opts.workers),
               "--gpu-ids", *gpus, "--precision", opts.precision, "--warmup", str(opts.warmup),
               "--window", str(opts.window), "--ga3c-flags", f"{opts.ga3c_flags} --precision {opts.precision}",
               "--json", str(bench_json.resolve())]
        if seconds <= 0:
            return {"command": shlex.join(cmd), "exit_code": 1, "seconds": 0.0, "skipped": "the budget left no time"}
        res = run_stage(stage, cmd, out / "bench.log", seconds)
        try:
            b = json.loads(bench_json.read_text())
            res.update(a3g_steps_per_s=b["training"]["steps_per_s"], precision=b.get("precision"),
                       ga3c_steps_per_s=b.get("ga3c", {}).get("steps_per_s"),
                       ga3c_over_a3g=b.get("ga3c_over_a3g"), machine=b.get("machine"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            res["bench_json"] = f"not read: {e}"
        return res
    try:
        bench = json.loads((out / "bench.json").read_text())
    except (OSError, ValueError):
        bench = None
    run_dir = run_path(opts.run_dir)
    resumed = saved_mode(run_dir) if opts.load else None
    mode = opts.mode or resumed or faster_mode(bench, any(g >= 0 for g in opts.gpu_ids), "bench" in opts.stages)
    train_seconds = min(opts.train_seconds or float("inf"), seconds - TRAIN_RESERVE)
    cmd = [py, "main.py", *stage_commands(opts)[mode], "--max-seconds", f"{max(train_seconds, 1):.0f}"] + (
        ["--load"] if opts.load else [])
    shutil.rmtree(out / "train", ignore_errors=True)  # an earlier call's files are not this stage's
    if train_seconds < min(TRAIN_MIN, opts.train_seconds or TRAIN_MIN):
        return {"command": shlex.join(cmd), "exit_code": 1, "seconds": 0.0, "mode": mode,
                "skipped": f"the budget left {seconds:.0f} s: too little to train"}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MODE_FILE).write_text(mode + "\n")
    stage_start = time.time()
    try:
        res = run_stage(stage, cmd, out / "train.log", train_seconds + TRAIN_RESERVE,
                        every=lambda: collect_train(opts, out, started_at=stage_start))
    except SessionStopped as e:
        e.result = {**getattr(e, "result", {}), "mode": mode}
        raise
    res["mode"] = mode
    res.update(collect_train(opts, out, started_at=stage_start))
    return res


def collect_train(opts, out: Path, started_at: float) -> dict:
    """Copy the train stage's ``.dat`` and monitor CSV into ``OUT/train/`` (only files written since
    ``started_at``: a file left from before is not this stage's) and read its last monitor game."""
    dest = out / "train"
    dest.mkdir(exist_ok=True)
    name = opts.env.replace("/", "_")
    run_dir = run_path(opts.run_dir)
    for src in (run_dir / "models" / f"{name}.dat", run_dir / "logs" / f"{name}_monitor.csv"):
        if src.is_file() and src.stat().st_mtime >= started_at - 1.0:
            shutil.copy2(src, dest / src.name)
    csv_file = dest / f"{name}_monitor.csv"
    return last_monitor(csv_file) if csv_file.is_file() else {}


if __name__ == "__main__":
    sys.exit(main())

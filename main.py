"""Train A3C-LSTM on Atari with hogwild workers (CPU, or A3G mode with --gpu-ids).

    python main.py --env PongNoFrameskip-v4 --workers 16 --gpu-ids 0

The main process validates the configuration, builds the shared model and optimizer in shared memory, starts
``--workers`` training processes and one monitor, then watches them: it stops the run at ``--max-steps``,
``--max-seconds`` or ``--target-score``, on Ctrl-C or SIGTERM, or when a process dies; it writes the full
checkpoint every ``--checkpoint-every-seconds`` and at the end.

Exit codes: 0 a stop condition was reached; 1 a worker or the monitor failed (its error is printed);
2 bad input (nothing started, nothing written); 130 Ctrl-C; 143 SIGTERM.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import signal
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

from checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, ModelFileError, atomic_save, check_state_dict,
                        checkpoint_path, cpu_state_dict, is_checkpoint, model_path, read_weights, state_dict_of)
from config import build_parser, config_dict, validate
from environment import num_actions
from model import A3Clstm
from run_state import UPDATE_FIELDS, RunState
from shared_optim import make_optimizer
from test import test
from train import train
from utils import safe_name, setup_logger

JOIN_SECONDS = 8.0  # a stopped process gets this long to exit before it is terminated, then killed


def find_resume_file(args: Namespace) -> Path | None:
    """``--load``: the full checkpoint when there is one, else the drop-in ``.dat``."""
    for path in (checkpoint_path(args.load_model_dir, args.env), model_path(args.load_model_dir, args.env)):
        if path.is_file():
            return path
    return None


def fail(errors: list[str]) -> None:
    for e in errors:
        print(f"main.py: error: {e}", file=sys.stderr)
    sys.exit(2)


class Stopper:
    """Turns SIGINT/SIGTERM into a stop request (the workers ignore both and follow ``run.stop``)."""

    def __init__(self):
        self.signal: int | None = None

    def __call__(self, signum, frame):
        if self.signal is None:
            self.signal = signum
        else:  # a second Ctrl-C: stop waiting politely
            raise KeyboardInterrupt

    def install(self):
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)


def save_checkpoint(args: Namespace, shared_model: A3Clstm, optimizer, run: RunState, elapsed: float) -> Path:
    path = checkpoint_path(args.save_model_dir, args.env)
    ckpt = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "env": args.env,
        "model": cpu_state_dict(shared_model),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "optimizer_name": args.optimizer,
        "best_score": float(run.monitor[2].item()),
        "elapsed_seconds": float(elapsed),
        "config": config_dict(args),
        **run.snapshot(),
    }
    atomic_save(ckpt, path)
    return path


def launch(ctx, args: Namespace, shared_model: A3Clstm, optimizer, run: RunState, elapsed_offset: float = 0.0,
           monitor: bool = True) -> list[tuple[str, mp.Process]]:
    """Start the monitor (unless ``monitor`` is False) and ``--workers`` training processes."""
    procs = []
    if monitor:
        p = ctx.Process(target=test, args=(args, shared_model, run, elapsed_offset), name="monitor")
        p.start()
        procs.append(("monitor", p))
    for rank in range(args.workers):
        p = ctx.Process(target=train, args=(rank, args, shared_model, optimizer, run), name=f"worker {rank}")
        p.start()
        procs.append((f"worker {rank}", p))
    return procs


def shutdown(procs: list[tuple[str, mp.Process]], run: RunState, wait: float = JOIN_SECONDS) -> None:
    """Stop every process through ``run.stop``; terminate, then kill, whatever is still alive after ``wait``."""
    run.stop.set()
    deadline = time.time() + wait
    for _, p in procs:
        p.join(max(0.0, deadline - time.time()))
    for _, p in procs:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


def status_line(run: RunState, rate: float) -> str:
    stats = run.update_stats
    done = stats[:, 0] > 0
    if not bool(done.any()):
        return f"steps {run.global_steps.value:,} ({rate:.0f} steps/s)"
    mean = stats[done].mean(0)
    f = dict(zip(UPDATE_FIELDS, mean.tolist()))
    return (f"steps {run.global_steps.value:,} ({rate:.0f} steps/s) | updates {int(stats[:, 0].sum()):,} | "
            f"policy {f['policy_loss']:.3f} value {f['value_loss']:.3f} entropy {f['entropy']:.3f} "
            f"grad-norm {f['grad_norm']:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    errors = validate(args)
    if errors:
        fail(errors)
    n_actions = num_actions(args.env)

    resume_ckpt, resume_sd, resume_path = None, None, None
    if args.load:
        resume_path = find_resume_file(args)
        if resume_path is None:
            fail([f"--load: neither {checkpoint_path(args.load_model_dir, args.env)} nor "
                  f"{model_path(args.load_model_dir, args.env)} exists (check --load-model-dir and --env)"])
        try:
            obj = read_weights(resume_path)
            resume_sd = state_dict_of(obj, resume_path)
            check_state_dict(resume_sd, n_actions, args.hidden_size, resume_path, args.env)
        except ModelFileError as e:
            fail([str(e)])
        resume_ckpt = obj if is_checkpoint(obj) else None
    same_dir = Path(args.load_model_dir).resolve() == Path(args.save_model_dir).resolve()
    if not (args.load and same_dir):
        existing = [p for p in (model_path(args.save_model_dir, args.env), checkpoint_path(args.save_model_dir, args.env))
                    if p.exists()]
        if existing:
            fail([f"{existing[0]} exists and this run would overwrite it: pass --load to continue training from it, "
                  f"or --save-model-dir DIR to write elsewhere"])

    Path(args.save_model_dir).mkdir(parents=True, exist_ok=True)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    log = setup_logger(f"main.{safe_name(args.env)}", Path(args.log_dir) / f"{safe_name(args.env)}_train.log",
                       console=True)

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    torch.manual_seed(args.seed)
    shared_model = A3Clstm(1, n_actions, args.hidden_size)
    if resume_sd is not None:
        shared_model.load_state_dict(resume_sd, strict=True)
    shared_model.share_memory()
    optimizer = None
    if args.shared_optimizer:
        optimizer = make_optimizer(args.optimizer, shared_model.parameters(), args.lr, args.amsgrad, shared=True)
    run = RunState(ctx, args.workers, args.score_window)
    elapsed_offset = 0.0
    if resume_ckpt is not None:
        run.restore(resume_ckpt)
        elapsed_offset = float(resume_ckpt.get("elapsed_seconds", 0.0))
        opt_state = resume_ckpt.get("optimizer")
        if optimizer is not None and opt_state is not None and resume_ckpt.get("optimizer_name") == args.optimizer:
            optimizer.load_state_dict(opt_state)
            log.info(f"resumed the {args.optimizer} statistics")
            saved = optimizer.saved_hyperparameters(opt_state)[0]
            changed = [f"{k} {saved[k]} -> {v}" for k, v in optimizer.param_groups[0].items()
                       if k in ("lr", "amsgrad") and k in saved and saved[k] != v]
            if changed:
                log.info("the command line changes the checkpoint's " + ", ".join(changed))
        else:
            log.info("optimizer statistics not resumed (none saved, or another optimizer)")
    if resume_path is not None:
        log.info(f"loaded {resume_path}" + (f" at {run.global_steps.value:,} global steps" if resume_ckpt else ""))

    log.info(f"training {args.env} ({n_actions} actions) with {args.workers} workers on "
             f"{'CPU' if args.gpu_ids[0] < 0 else 'GPUs ' + str(args.gpu_ids)}; stop at "
             + ", ".join(s for s in [
                 f"{args.max_steps:,} steps" if args.max_steps else "",
                 f"{args.max_seconds:g} s" if args.max_seconds else "",
                 f"mean score {args.target_score:g}" if args.target_score is not None else "",
                 "Ctrl-C"] if s))

    # Children inherit "ignore SIGINT/SIGTERM" during their start-up; only this process reacts to Ctrl-C.
    stopper = Stopper()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    procs: list[tuple[str, mp.Process]] = []
    code, reason = 0, ""
    tb = None
    start = time.time()
    try:
        procs = launch(ctx, args, shared_model, optimizer, run, elapsed_offset)
        stopper.install()
        if args.tensorboard_logger:
            from torch.utils.tensorboard import SummaryWriter
            tb = SummaryWriter(str(Path(args.log_dir) / "runs" / f"{safe_name(args.env)}_training"))
        last_ckpt = last_status = time.time()
        status_steps = run.global_steps.value
        while True:
            run.stop.wait(0.2)
            now = time.time()
            if stopper.signal is not None:
                code = 130 if stopper.signal == signal.SIGINT else 143
                reason = "interrupted (Ctrl-C)" if code == 130 else "terminated (SIGTERM)"
                break
            if args.max_steps and run.global_steps.value >= args.max_steps:
                reason = f"reached --max-steps {args.max_steps:,}"
                break
            if args.max_seconds and now - start >= args.max_seconds:
                reason = f"reached --max-seconds {args.max_seconds:g}"
                break
            if run.target_reached.is_set():
                reason = f"reached --target-score {args.target_score:g}"
                break
            dead = [(role, p) for role, p in procs if not p.is_alive()]
            if dead:
                role, p = dead[0]
                code, reason = 1, f"{role} exited unexpectedly (exit code {p.exitcode})"
                break
            if now - last_ckpt >= args.checkpoint_every_seconds:
                save_checkpoint(args, shared_model, optimizer, run, elapsed_offset + now - start)
                last_ckpt = now
            if now - last_status >= args.status_every_seconds:
                steps = run.global_steps.value
                rate = (steps - status_steps) / (now - last_status)
                log.info(status_line(run, rate))
                if tb is not None:
                    mean = run.update_stats[run.update_stats[:, 0] > 0].mean(0).tolist()
                    if mean:
                        for name, value in zip(UPDATE_FIELDS[2:], mean[2:]):
                            tb.add_scalar(f"losses/{name}", value, steps)
                    tb.add_scalar("charts/train_steps_per_s", rate, steps)
                    tb.flush()
                last_status, status_steps = now, steps
    except KeyboardInterrupt:
        code, reason = 130, "interrupted (Ctrl-C)"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the shutdown below is bounded; let it finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shutdown(procs, run)
        while True:
            try:
                role, tb_text = run.errors.get(timeout=0.1)
            except Exception:
                break
            code = 1
            log.info(f"{role} failed:\n{tb_text.rstrip()}")
        elapsed = time.time() - start
        ckpt = save_checkpoint(args, shared_model, optimizer, run, elapsed_offset + elapsed)
        if not args.save_max:
            atomic_save(cpu_state_dict(shared_model), model_path(args.save_model_dir, args.env))
        rate = (run.global_steps.value - (resume_ckpt or {}).get("global_steps", 0)) / max(elapsed, 1e-9)
        log.info(f"stopped: {reason}; {run.global_steps.value:,} global steps, {rate:.0f} steps/s over "
                 f"{elapsed:.0f} s; checkpoint {ckpt}")
        if tb is not None:
            tb.close()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""A3G mode of ``main.py``: the processes of a run, how they stop, and what the main process reports.

Processes (spawned by the main process, bound to it by ``lifeline``, stopped through ``run.stop``):

- ``worker r`` for r < ``--workers``: ``train.train``, playing its own environment with its own model copy (on
  the CPU, or on GPU ``gpu_ids[r % n]``) and updating the shared model;
- ``monitor``: ``test.test``, greedy test games with the shared weights (their moving average with
  ``--ema-steps``).

Process slots of ``run_state.RunState``: worker r -> r, the monitor last. ``launch`` starts them (a Ray node starts
its workers with it too, without the monitor); ``shutdown`` stops any mode's processes in bounded time;
``status_line`` is the main process's periodic line; ``A3gRun`` is the mode that ``main.run_training`` drives
(``modes.Mode``).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from argparse import Namespace

import lifeline
from model import A3Clstm
from modes import Mode
from run_state import UPDATE_FIELDS, RunState
from test import test
from train import train

JOIN_SECONDS = 8.0  # stopped processes get this long to exit; then all are terminated, then killed (<= 10 s)


def launch(ctx, args: Namespace, shared_model: A3Clstm, optimizer, run: RunState, elapsed_offset: float = 0.0,
           monitor: bool = True, average_model: A3Clstm | None = None,
           procs: list[tuple[str, mp.Process]] | None = None) -> list[tuple[str, mp.Process]]:
    """Start the monitor (unless ``monitor`` is False) and ``--workers`` training processes; returns ``procs`` (a
    new list by default), to which each process is appended as soon as it has started, so that a caller
    interrupted during the launch (a second Ctrl-C) still knows every process it has to stop.

    ``average_model`` (``--ema-steps``): the moving average of the weights, which each worker updates after its
    step and the monitor plays instead of the shared weights.

    They start with SIGINT/SIGTERM blocked and bound to this process (``lifeline``); a stop signal that arrives
    meanwhile stays pending here and is handled as soon as the block ends, after the last start.
    """
    lifeline.mark_children()
    played = shared_model if average_model is None else average_model
    todo = [("monitor", test, (args, played, run, elapsed_offset))] if monitor else []
    todo += [(f"worker {rank}", train, (rank, args, shared_model, optimizer, run, average_model))
             for rank in range(args.workers)]
    procs = [] if procs is None else procs
    for role, target, target_args in todo:
        p = ctx.Process(target=target, args=target_args, name=role)
        lifeline.start_child(p)
        procs.append((role, p))
    return procs


def a3g_slot(run: RunState, role: str) -> int:
    """A3G's process slot of ``role`` (``worker r`` -> r, the monitor last)."""
    return run.monitor_slot if role == "monitor" else int(role.rsplit(" ", 1)[1])


class A3gRun(Mode):
    """A3G mode: ``--workers`` hogwild workers and the monitor (process slots: worker r -> r, monitor last).
    ``ga3c.run.Ga3cRun`` and ``multinode.run.RayRun`` are its siblings; ``main.run_training`` drives any of them
    through ``modes.Mode``, whose defaults this mode keeps for everything but the members below."""

    name = "a3g"

    def __init__(self, args: Namespace, shared_model: A3Clstm, optimizer, log):
        self.args, self.shared_model, self.optimizer, self.log = args, shared_model, optimizer, log
        self.run = RunState(args.workers, args.score_window)
        self.procs: list[tuple[str, mp.Process]] = []

    def describe(self) -> str:
        where = "CPU" if self.args.gpu_ids[0] < 0 else "GPUs " + str(self.args.gpu_ids)
        return f"with {self.args.workers} workers on {where}"

    def restore(self, ckpt: dict) -> None:
        self.run.restore(ckpt)

    def slot_of(self, role: str) -> int:
        return a3g_slot(self.run, role)

    def launch(self, ctx, elapsed_offset: float = 0.0) -> list[tuple[str, mp.Process]]:
        self.procs = []
        return launch(ctx, self.args, self.shared_model, self.optimizer, self.run, elapsed_offset,
                      average_model=self.average_model, procs=self.procs)

    def expected_exit(self, role: str, process: mp.Process, budget_reached: bool) -> bool:
        """A worker ends on its own at the step budget."""
        return process.exitcode == 0 and role.startswith("worker") and budget_reached

    def status(self, rate: float, span: float) -> tuple[str, dict]:
        scalars = {"charts/train_steps_per_s": rate}
        stats = self.run.update_stats
        done = stats[:, 0] > 0
        if bool(done.any()):
            scalars.update({f"losses/{k}": v for k, v in zip(UPDATE_FIELDS[2:], stats[done].mean(0).tolist()[2:])})
        return status_line(self.run, rate), scalars


def shutdown(procs: list[tuple[str, mp.Process]], run: RunState, wait: float = JOIN_SECONDS,
             slot_of=None) -> None:
    """Stop every process through ``run.stop``. Those still starting up (not ``ready``: importing, building
    their env) have nothing to finish and are terminated at once; the others get ``wait`` seconds to end their
    update or game, then all that are still alive are terminated at once, and one second later killed: at most
    ``wait`` + 2 seconds in all. ``slot_of(role)``: a process's slot in ``run`` (default: A3G's)."""
    run.stop.set()
    if slot_of is None:
        def slot_of(role: str) -> int:
            return a3g_slot(run, role)
    for role, p in procs:
        if p.is_alive() and not run.ready[slot_of(role)].item():
            p.terminate()
    for grace, action in ((wait, None), (1.0, "terminate"), (1.0, "kill")):
        alive = [p for _, p in procs if p.is_alive()]
        if not alive:
            break
        for p in alive:
            if action is not None:
                getattr(p, action)()
        deadline = time.monotonic() + grace
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
    for _, p in procs:
        if p.exitcode is not None:
            p.close()


def status_line(run: RunState, rate: float) -> str:
    """The main process's status line: global steps and steps/s, then, once a worker has updated, the update
    count and the workers' mean smoothed losses per step and gradient norm."""
    stats = run.update_stats
    done = stats[:, 0] > 0
    if not bool(done.any()):
        return f"steps {run.global_steps.value:,} ({rate:.0f} steps/s)"
    mean = stats[done].mean(0)
    f = dict(zip(UPDATE_FIELDS, mean.tolist()))
    return (f"steps {run.global_steps.value:,} ({rate:.0f} steps/s) | updates {int(stats[:, 0].sum()):,} | "
            f"per step: policy {f['policy_loss']:.4f} value {f['value_loss']:.4f} entropy {f['entropy']:.3f} | "
            f"grad-norm {f['grad_norm']:.2f}")

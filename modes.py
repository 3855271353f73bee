"""The interface through which ``main.py`` drives a training mode, written down once.

Three modes implement it: ``a3g.run.A3gRun`` (hogwild workers and the monitor, ``--mode a3g``),
``ga3c.run.Ga3cRun`` (the default) and ``multinode.run.RayRun`` (``--ray-address``). ``main.run_training``
builds one, ``restore``s it from a checkpoint (``--load``), ``launch``es its processes, then, about five times a
second, calls ``tick``, checks ``failed`` and asks ``expected_exit`` about every process that ended; it calls
``status`` every ``--status-every-seconds`` and ``save`` every ``--checkpoint-every-seconds``. At the end it stops
the processes (``a3g.run.shutdown`` with the mode's ``slot_of``), then calls ``close``, reads ``errors``, makes the
final ``save`` and calls ``release``.

The modes subclass ``Mode`` explicitly: the members marked abstract are theirs to write, and the others are hooks
with a default that a mode overrides only when it has something to do there.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
from abc import abstractmethod
from argparse import Namespace
from pathlib import Path
from typing import Protocol

import torch

from checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, atomic_save, checkpoint_path, cpu_state_dict, model_path,
                        refuse_non_finite)
from config import config_dict
from model import A3Clstm
from run_state import RunState


def copy_tensors(obj):
    """``obj`` (nested dicts, lists and tuples) with every tensor replaced by a detached CPU copy: what a
    checkpoint writes is then no view of the live shared weights or statistics, which go on changing."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, copy_tensors(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_tensors(v) for v in obj)
    return obj


def checkpoint_contents(args: Namespace, shared_model: A3Clstm, optimizer: torch.optim.Optimizer | None,
                        run: RunState, elapsed: float, extra: dict | None = None,
                        average_model: A3Clstm | None = None) -> dict:
    """The full checkpoint as copies (``copy_tensors``): taken between two optimizer steps, it holds that
    moment's weights and statistics whatever steps are made while it is written. ``extra``: a mode's own fields
    (GA3C: ``ga3c_updates``); either mode ignores the other's. ``average_model``: the moving average of the
    weights (``--ema-steps``), saved as ``average_model``."""
    ckpt = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "env": args.env,
        "model": cpu_state_dict(shared_model),
        "optimizer": copy_tensors(optimizer.state_dict()) if optimizer is not None else None,
        "optimizer_name": args.optimizer,
        "elapsed_seconds": float(elapsed),
        "config": config_dict(args),
        **run.snapshot(),  # best_score among them, read with the monitor's other statistics
        **(extra or {}),
    }
    if average_model is not None:
        ckpt["average_model"] = cpu_state_dict(average_model)
    return ckpt


def write_checkpoint(args: Namespace, ckpt: dict) -> Path:
    """Write ``ckpt`` (``checkpoint_contents``) atomically, after checking that its weights are finite; raises
    ``CheckpointWriteError`` (one line) when it cannot, ``DivergedError`` when a weight is not finite."""
    path = checkpoint_path(args.save_model_dir, args.env)
    refuse_non_finite(path, model=ckpt["model"], optimizer=ckpt["optimizer"], average_model=ckpt.get("average_model"))
    atomic_save(ckpt, path)
    return path


def save_checkpoint(args: Namespace, shared_model: A3Clstm, optimizer: torch.optim.Optimizer | None, run: RunState,
                    elapsed: float, extra: dict | None = None, average_model: A3Clstm | None = None) -> Path:
    """``checkpoint_contents`` written by ``write_checkpoint``, the copy made at once (``Mode.save`` makes it
    through the mode's ``consistent``)."""
    return write_checkpoint(args, checkpoint_contents(args, shared_model, optimizer, run, elapsed, extra,
                                                      average_model))


class Mode(Protocol):
    """One training mode as ``main.run_training`` drives it (see the module docstring)."""

    name: str  # "a3g", "ga3c" or "ray"
    args: Namespace  # the run's flags
    shared_model: A3Clstm  # in shared memory: the weights the monitor plays and the checkpoint holds
    optimizer: torch.optim.Optimizer | None  # the shared optimizer (None with --no-shared-optimizer)
    run: RunState  # the flags, global steps, monitor statistics and error slots shared with the processes
    log: logging.Logger  # the run's log (console and <log-dir>/<env>.log)
    failed: str | None = None  # a failure the mode noticed other than a process that ended (Ray: a node's worker)
    average_model: A3Clstm | None = None  # --ema-steps: the moving average of the weights, in shared memory
    procs: list[tuple[str, mp.Process]]  # the processes started so far, each added as soon as it has started

    @property
    def played_model(self) -> A3Clstm:
        """The weights the monitor plays and the ``.dat`` holds: the moving average with ``--ema-steps``, else the
        shared weights themselves."""
        return self.shared_model if self.average_model is None else self.average_model

    @abstractmethod
    def describe(self) -> str:
        """What runs where, for the start line (``training <env> (<n> actions) <this>; stop at ...``)."""

    @abstractmethod
    def restore(self, ckpt: dict) -> None:
        """Take a checkpoint's counters (``--load``); main loads the weights and the optimizer statistics."""

    @abstractmethod
    def slot_of(self, role: str) -> int:
        """The ``run`` slot (ready flag, error slot) of the process named ``role``."""

    @abstractmethod
    def launch(self, ctx, elapsed_offset: float = 0.0) -> list[tuple[str, mp.Process]]:
        """Start the mode's processes from the multiprocessing context ``ctx``; returns them with their roles.
        ``elapsed_offset``: the seconds a resumed run had already trained (the monitor's clock goes on from
        there). Raises ``StartError`` or ``CheckpointWriteError`` (one line) when the start-up fails."""

    @abstractmethod
    def expected_exit(self, role: str, process: mp.Process, budget_reached: bool) -> bool:
        """Whether ``process``, which has ended, ended on purpose (not a failure of the run)."""

    @abstractmethod
    def status(self, rate: float, span: float) -> tuple[str, dict]:
        """The status line and its TensorBoard scalars for the last ``span`` seconds (``rate``: global steps/s)."""

    def snapshot(self) -> dict:
        """The mode's own checkpoint fields, added to the common ones; none by default."""
        return {}

    def tick(self, now: float) -> None:
        """Called about five times a second while the run goes on (GA3C's console lines and ``--dynamic``, Ray's
        polls of its actors); nothing by default."""

    def consistent(self, copy, final: bool):
        """``copy()`` (the checkpoint's contents) of one moment between two optimizer steps where the mode has such
        moments, or None, with a line in the log, where none was found: the checkpoint is then not written and the
        last complete one stays. ``final``: every process has stopped. By default the copy is made at once: A3G
        mode's hogwild workers step the shared weights without any lock, so there is no moment between their
        steps to wait for."""
        return copy()

    def save(self, elapsed: float, final: bool = False) -> Path | None:
        """Write the checkpoint (``checkpoint_contents`` with ``snapshot()``, copied through ``consistent``) and,
        when ``final`` and not ``--save-max``, the ``.dat`` of the same moment, from this process; returns the
        checkpoint's path, or None where ``consistent`` found no moment (nothing written: the last complete
        checkpoint stays). Raises ``CheckpointWriteError`` (one line). Ray's parameter server writes a multi-node
        run's instead."""
        path = checkpoint_path(self.args.save_model_dir, self.args.env)
        ckpt = self.consistent(lambda: checkpoint_contents(self.args, self.shared_model, self.optimizer, self.run,
                                                           elapsed, self.snapshot(), self.average_model), final)
        if ckpt is None:
            return None
        write_checkpoint(self.args, ckpt)
        if final and not self.args.save_max:
            # the played weights, of the same moment, were checked finite by write_checkpoint
            played = ckpt["model"] if self.average_model is None else ckpt["average_model"]
            atomic_save(played, model_path(self.args.save_model_dir, self.args.env))
        return path

    def close(self) -> None:
        """After the mode's processes were stopped, before the final checkpoint: finish what they left (GA3C's
        last console lines; Ray's nodes stop and sync); nothing by default."""

    def errors(self) -> list[tuple[str, str]]:
        """Failure reports ``(role, text)`` of parts outside ``run.errors`` (Ray's nodes); none by default."""
        return []

    def release(self) -> None:
        """After the final checkpoint: let go of what the mode holds outside its processes (Ray: the actors and
        the connection); nothing by default."""

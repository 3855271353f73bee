"""The parameter server: the global weights of a multi-node run, the nodes' step counts, and the checkpoint.

A plain class (tested without Ray); ``multinode.run`` makes it a Ray actor pinned to the driver's machine, so the
checkpoint and ``.dat`` it writes are where a single-machine run writes them. Ray restarts it if it dies: it then
comes back from the last checkpoint *this run* wrote (``run_id``), so losing it loses at most
``--checkpoint-every-seconds`` of training; the nodes keep their own progress meanwhile and send it on their next
sync.
"""
from __future__ import annotations

import time
from argparse import Namespace

import torch

from checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointWriteError, ModelFileError, atomic_save,
                        checkpoint_path, is_checkpoint, model_path, read_weights)
from multinode.merge import apply_change, clone_weights, merge_scale


class ParameterServer:
    """Global weights plus bookkeeping (see the module docstring and ``multinode.merge``).

    Made with the run's flags and ``run_id`` (this run's token, written into its checkpoints) only, so that Ray
    can restart it from those alone; ``begin`` then hands it the starting weights, step count and ``payload``
    (``optimizer``: a node's optimizer state_dict, ``norm_stats``: its workers' normalisation rows, handed to
    joining nodes; None for a fresh run) and writes the first checkpoint, so that a restarted server always has
    one of this run's to come back from.
    """

    def __init__(self, args: Namespace, run_id: str):
        self.args = args
        self.run_id = run_id
        self.scale = merge_scale(args.merge, args.nodes)
        self.weights: dict[str, torch.Tensor] | None = None
        self.global_steps = 0
        self.payload = None
        self.nodes = [self._fresh_node() for _ in range(args.nodes)]
        self.busy_seconds = 0.0  # time spent applying changes (the scale table's per-sync cost)
        self.pushes = 0
        self.recovered_from = None
        self.started = time.time()  # tells the driver that a restarted server's counts start again
        self._recover()

    def begin(self, weights: dict[str, torch.Tensor], global_steps: int, payload: dict | None,
              fields: dict) -> tuple[bool, str]:
        """The run's starting point (ignored by a server that came back from this run's checkpoint), then the
        first checkpoint (``save``'s answer)."""
        if self.weights is None:
            self.weights = clone_weights(weights)
            self.global_steps = int(global_steps)
            self.payload = payload
        return self.save(fields)

    @staticmethod
    def _fresh_node() -> dict:
        return {"steps": 0, "syncs": 0, "last_sync": None, "joins": 0, "stats": None}

    def _recover(self) -> None:
        """After a restart: take the weights, steps and statistics of this run's last checkpoint, if it wrote one."""
        path = checkpoint_path(self.args.save_model_dir, self.args.env)
        if not path.is_file():
            return
        try:
            ckpt = read_weights(path)
        except ModelFileError:
            return
        if not is_checkpoint(ckpt) or ckpt.get("ray_run_id") != self.run_id:
            return
        self.weights = clone_weights(ckpt["model"])
        self.global_steps = int(ckpt.get("global_steps", 0))
        if ckpt.get("optimizer") is not None or ckpt.get("norm_stats") is not None:
            rows = ckpt.get("norm_stats")
            self.payload = {"optimizer": ckpt.get("optimizer"), "norm_stats": None if rows is None else rows[:-1]}
        self.recovered_from = str(path)

    # ---- what nodes call ----------------------------------------------------------------------------------------
    def join(self, node: int) -> dict:
        """A node (new, or restarted by Ray) starts from the global weights and the latest statistics."""
        if self.weights is None:
            raise RuntimeError("the parameter server has no weights yet (begin was not called)")
        n = self.nodes[node]
        n["joins"] += 1
        n["last_sync"] = time.time()
        return {"weights": self.weights, "payload": self.payload, "joins": n["joins"]}

    def push(self, node: int, change: dict[str, torch.Tensor], steps: int, stats: list | None = None,
             payload: dict | None = None) -> dict[str, torch.Tensor]:
        """Apply a node's change, count its steps, keep its statistics; answer with the global weights."""
        t0 = time.perf_counter()
        apply_change(self.weights, change, self.scale)
        self.busy_seconds += time.perf_counter() - t0
        self.pushes += 1
        self.global_steps += int(steps)
        n = self.nodes[node]
        n["steps"] += int(steps)
        n["syncs"] += 1
        n["last_sync"] = time.time()
        if stats is not None:
            n["stats"] = stats
        if payload is not None:
            self.payload = payload
        return self.weights

    # ---- what the driver calls ----------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        return self.weights

    def status(self) -> dict:
        return {"global_steps": self.global_steps, "nodes": [dict(n) for n in self.nodes], "time": time.time(),
                "started": self.started,
                "busy_seconds": self.busy_seconds, "pushes": self.pushes, "recovered_from": self.recovered_from}

    def save(self, fields: dict, write_model: bool = False) -> tuple[bool, str]:
        """Write the full checkpoint (and with ``write_model`` the ``.dat``) atomically, as a single-machine run
        does. ``fields``: what the driver knows (monitor statistics, its normalisation row, elapsed time, config).
        Returns ``(True, path)`` or ``(False, one-line reason)``; the previous files stay as they were on failure."""
        payload = self.payload or {}
        fields = dict(fields)
        monitor_row = fields.pop("monitor_norm_row")
        learner_rows = payload.get("norm_stats")
        if learner_rows is None:
            learner_rows = torch.zeros(self.args.workers, 3, dtype=torch.float64)
        ckpt = {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "env": self.args.env,
            "model": clone_weights(self.weights),
            "optimizer": payload.get("optimizer"),
            "optimizer_name": self.args.optimizer,
            **fields,
            "global_steps": self.global_steps,
            "norm_stats": torch.cat([learner_rows, monitor_row.reshape(1, 3)]),  # learners' rows, the monitor's last
            "ray_run_id": self.run_id,
        }
        path = checkpoint_path(self.args.save_model_dir, self.args.env)
        try:
            atomic_save(ckpt, path)
            if write_model:
                atomic_save(ckpt["model"], model_path(self.args.save_model_dir, self.args.env))
        except CheckpointWriteError as e:
            return False, str(e)
        return True, str(path)

    def pid(self) -> int:
        import os
        return os.getpid()

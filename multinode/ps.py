"""The parameter server: the global weights of a multi-node run, the nodes' step counts, and the checkpoint.

A plain class (tested without Ray); ``multinode.run`` makes it a Ray actor pinned to the driver's machine, so the
checkpoint and ``.dat`` it writes are where a single-machine run writes them. Ray restarts it if it dies: it then
comes back from the last checkpoint *this run* wrote (``run_id``), so losing it loses at most
``--checkpoint-every-seconds`` of training; the nodes keep their own progress meanwhile and send it on their next
sync.

Every push is applied at most once. A node numbers its pushes within its *epoch* (a number its join gets, larger
than any epoch that node had before); the server applies a push only when its epoch is the node's current one (or a
later one that a server restarted from an older checkpoint has not seen) and its number is above the last one it
applied for that node. A node whose push got no answer asks ``landed`` before it pushes again
(``multinode.node.Uplink``). The epochs and last numbers go into the checkpoint, so a server that comes back from
it does not take a push it already holds for a new one.
"""
from __future__ import annotations

import time
from argparse import Namespace

import torch

from checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointWriteError, ModelFileError, atomic_save,
                        checkpoint_path, is_checkpoint, model_path, read_weights, refuse_non_finite)
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
        """A node's record: ``epoch`` and ``seq`` are its current join's epoch and the number of the last push
        applied from it (0: none); ``refused`` counts pushes not applied (repeated, or from a replaced node)."""
        return {"steps": 0, "syncs": 0, "last_sync": None, "joins": 0, "stats": None, "epoch": 0, "seq": 0,
                "refused": 0}

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
        seqs = ckpt.get("ray_push_seqs") or []
        for n, (epoch, seq) in zip(self.nodes, seqs if len(seqs) == len(self.nodes) else []):
            n["epoch"], n["seq"] = int(epoch), int(seq)
        if ckpt.get("optimizer") is not None or ckpt.get("norm_stats") is not None:
            rows = ckpt.get("norm_stats")
            self.payload = {"optimizer": ckpt.get("optimizer"), "norm_stats": None if rows is None else rows[:-1]}
        self.recovered_from = str(path)

    # ---- what nodes call ----------------------------------------------------------------------------------------
    def join(self, node: int) -> dict:
        """A node (new, or restarted by Ray) starts from the global weights and the latest statistics, in a new
        epoch: the time in nanoseconds, and above the node's last epoch (pushes of the instance it replaces are
        refused from now on; the server is pinned to one machine, so one clock orders a restarted server's epochs
        after those in its checkpoint)."""
        if self.weights is None:
            raise RuntimeError("the parameter server has no weights yet (begin was not called)")
        n = self.nodes[node]
        n["joins"] += 1
        n["last_sync"] = time.time()
        n["epoch"], n["seq"] = max(time.time_ns(), n["epoch"] + 1), 0
        return {"weights": self.weights, "payload": self.payload, "joins": n["joins"], "epoch": n["epoch"]}

    def landed(self, node: int, epoch: int) -> int:
        """The number of the last push of ``epoch`` applied from ``node`` (0: none of that epoch)."""
        n = self.nodes[node]
        return n["seq"] if n["epoch"] == epoch else 0

    def push(self, node: int, epoch: int, seq: int, change: dict[str, torch.Tensor], steps: int,
             stats: list | None = None, payload: dict | None = None) -> dict[str, torch.Tensor]:
        """Apply a node's change, count its steps, keep its statistics, once per push (see the module docstring:
        a push of an older epoch, or numbered at or below the last applied, changes nothing); answer with the
        global weights."""
        n = self.nodes[node]
        if epoch < n["epoch"] or (epoch == n["epoch"] and seq <= n["seq"]):
            n["refused"] += 1
            return self.weights
        n["epoch"], n["seq"] = epoch, seq
        t0 = time.perf_counter()
        apply_change(self.weights, change, self.scale)
        self.busy_seconds += time.perf_counter() - t0
        self.pushes += 1
        self.global_steps += int(steps)
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
        Returns ``(True, path)`` or ``(False, one-line reason)``. Each file is replaced whole or not at all: a
        failed ``.ckpt`` write leaves both files as they were; a failed ``.dat`` write leaves the new ``.ckpt`` (a
        complete checkpoint) beside the previous ``.dat``, as a single-machine run's save does."""
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
            "ray_push_seqs": [[n["epoch"], n["seq"]] for n in self.nodes],  # what a restarted server has applied
        }
        path = checkpoint_path(self.args.save_model_dir, self.args.env)
        try:
            refuse_non_finite(path, model=ckpt["model"], optimizer=ckpt["optimizer"])
            atomic_save(ckpt, path)
            if write_model:
                atomic_save(ckpt["model"], model_path(self.args.save_model_dir, self.args.env))
        except CheckpointWriteError as e:
            return False, str(e)
        return True, str(path)

    def pid(self) -> int:
        import os
        return os.getpid()

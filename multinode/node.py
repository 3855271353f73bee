"""One node of a multi-node run: today's hogwild node (its own shared model, ``--workers`` worker processes, its own
shared optimizer statistics) plus a sync thread that trades its weight change for the global weights every
``--sync-seconds`` (``multinode.merge``).

``HogwildNode`` is a plain class that talks to the parameter server through ``call(method, *args)`` (tested
in-process with a ``ParameterServer`` object); ``RayNode`` is the Ray actor, where ``call`` is a remote call.
Its worker processes are bound to the node's process (``lifeline``): when Ray kills or loses the node, they die
with it, and Ray starts the node again, which joins from the current global weights.

``Uplink`` is the node's side of the push protocol, which applies every push at most once (``multinode.ps``).
"""
from __future__ import annotations

import copy
import multiprocessing as mp
import os
import threading
import time
from argparse import Namespace

import torch

from model import A3Clstm
from multinode.merge import clone_weights, rebase, weight_change
from run_state import RunState
from shared_optim import make_optimizer

CALL_TIMEOUT = 60.0  # seconds a node waits for the parameter server's answer before trying again next sync


def node_args(args: Namespace, index: int, gpu_map: list[int] | None = None) -> Namespace:
    """The node's copy of the run's flags: the driver alone decides when to stop (no step or time budget here),
    node ``index``'s worker r is seeded ``seed + index * workers + r``, and its GPU ids are the ones Ray gave it."""
    a = copy.copy(args)
    a.max_steps, a.max_seconds, a.target_score = 0, 0, None
    a.seed = args.seed + index * args.workers
    if gpu_map is not None:
        a.gpu_ids = gpu_map
    return a


def local_gpu_ids(gpu_ids: list[int]) -> list[int] | None:
    """``--gpu-ids`` as a node sees them: Ray gives the node one GPU per distinct id and shows them to it as
    ``cuda:0..k-1`` (``CUDA_VISIBLE_DEVICES``), so id g becomes its rank among the distinct ids. None for the CPU."""
    if not gpu_ids or gpu_ids[0] < 0:
        return None
    distinct = sorted(set(gpu_ids))
    return [distinct.index(g) for g in gpu_ids]


def one_line(e: BaseException) -> str:
    """``TypeName: the message's last line`` (at most 200 characters): a remote error's text is a traceback."""
    text = str(e).strip()
    return type(e).__name__ + (f": {text.splitlines()[-1][:200]}" if text else "")


class Uplink:
    """A node's pushes to the parameter server (``call(method, *args)``), each applied at most once.

    Pushes are numbered 1, 2, ... within the node's join ``epoch``, and the server refuses a number it has already
    applied (``ParameterServer.push``). A push whose answer does not come (a timeout does not cancel the remote
    call: it can still run later, after a slow checkpoint write or other nodes' syncs) is kept as ``pending``, and
    no push goes out while one is pending: the next sync first asks the server for the last number it applied
    (``landed``). The server runs one call at a time, a caller's calls in the order they were sent (Ray does so for
    a single-threaded actor whose calls are not retried, as ``multinode.run`` makes it), so that answer comes after
    the pending push ran, or after it was lost with a server that died. Then the change sent is ``live - base``,
    where ``base`` has become the pending push's ``sent`` if it landed: only what has not landed, with only the
    steps that have not been counted.
    """

    def __init__(self, call, index: int, epoch: int, weights: dict[str, torch.Tensor]):
        self._call = call
        self.index = index
        self.epoch = epoch
        self.base = clone_weights(weights)  # the next change is measured from here: the global weights last
        # received, or a pending push's sent weights once it landed
        self.reported = 0  # the node's step count the server has counted up to
        self.seq = 0  # the number of the last push sent
        self.pending: tuple[int, dict[str, torch.Tensor], int] | None = None  # (seq, sent, step count) unanswered

    def sync(self, live: dict[str, torch.Tensor], steps: int, stats: list | None = None,
             payload: dict | None = None) -> None:
        """Send ``live``'s change that has not landed with the steps (``steps``: the node's count now) not yet
        counted, then move ``live`` onto the global weights (``multinode.merge.rebase``). Raises what ``call``
        raises when the server does not answer; the change then goes with a later sync."""
        if self.pending is not None:
            seq, sent, counted = self.pending
            if self._call("landed", self.index, self.epoch) >= seq:
                self.base, self.reported = sent, counted
            self.pending = None
        sent = clone_weights(live)
        self.seq += 1
        try:
            received = self._call("push", self.index, self.epoch, self.seq, weight_change(sent, self.base),
                                  steps - self.reported, stats, payload)
        except BaseException:
            self.pending = (self.seq, sent, steps)
            raise
        received = clone_weights(received)
        rebase(live, sent, received)
        self.base, self.reported = received, steps


class HogwildNode:
    """A hogwild node joined to a parameter server (see the module docstring)."""

    def __init__(self, args: Namespace, index: int, call, n_actions: int):
        from a3g.run import launch  # the same start-up as a single-machine run (lifeline, spawn, blocked signals)
        torch.set_num_threads(1)
        gpu_map = local_gpu_ids(args.gpu_ids)
        if gpu_map is not None and torch.cuda.device_count() < len(set(gpu_map)):
            raise RuntimeError(f"node {index}: --gpu-ids needs {len(set(gpu_map))} GPUs, "
                               f"this machine shows {torch.cuda.device_count()}")
        self.args = node_args(args, index, gpu_map)
        self.index = index
        joined = call("join", index)
        self.joins = int(joined["joins"])
        self.model = A3Clstm(1, n_actions, args.hidden_size)
        self.model.load_state_dict(joined["weights"])
        self.model.share_memory()
        self.live = self.model.state_dict()  # views of the shared memory the workers update
        self.uplink = Uplink(call, index, joined["epoch"], joined["weights"])
        self.optimizer = None
        payload = joined.get("payload") or {}
        if args.shared_optimizer:
            self.optimizer = make_optimizer(args.optimizer, self.model.parameters(), args.lr, args.amsgrad,
                                            shared=True, eps=args.optimizer_eps)
            if payload.get("optimizer") is not None:
                try:
                    self.optimizer.load_state_dict(payload["optimizer"])
                except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
                    pass  # another optimizer's statistics: start this node's afresh
        self.run = RunState(args.workers, args.score_window)
        rows = payload.get("norm_stats")
        if rows is not None and rows.shape[0] > 0:
            for r in range(args.workers):
                self.run.norm_stats[r] = rows[r % rows.shape[0]]
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._last_payload = 0.0
        self.syncs = 0
        self.sync_seconds = 0.0  # wall time of the successful syncs (copying, the round trip, rebasing)
        self.failed_syncs = 0
        self.last_sync = time.time()
        self.sync_error = ""  # the last failed sync's error, one line (kept until a sync succeeds)
        self._failing_since: float | None = None  # monotonic time of the first failure since the last success
        self.failed_in_a_row = 0  # failed syncs since the last successful one
        self._sync_ended = ""  # why the sync thread ended other than by stop(), one line
        self.procs = launch(mp.get_context("spawn"), self.args, self.model, self.optimizer, self.run, monitor=False)
        self._worker_pids = [p.pid for _, p in self.procs]  # readable after shutdown() closed the processes
        self._thread = threading.Thread(target=self._sync_loop, name=f"node {index} sync", daemon=True)
        self._thread.start()

    # ---- syncing --------------------------------------------------------------------------------------------
    def _sync_loop(self) -> None:
        try:
            while not self._halt.wait(self.args.sync_seconds):
                self.sync()
        except BaseException as e:  # the node would train on alone: health() reports it, and the driver ends the run
            self._sync_ended = one_line(e)

    def _stats(self) -> list[float] | None:
        stats = self.run.update_stats
        done = stats[:, 0] > 0
        if not bool(done.any()):
            return None
        mean = stats[done].mean(0).tolist()
        mean[0], mean[1] = float(stats[:, 0].sum()), float(stats[:, 1].sum())
        return mean

    def _payload(self, final: bool) -> dict | None:
        """Node 0 sends its optimizer statistics and normalisation rows for the checkpoint, about twice per
        ``--checkpoint-every-seconds`` and at its last sync."""
        now = time.time()
        if self.index != 0 or not (final or now - self._last_payload >= self.args.checkpoint_every_seconds / 2):
            return None
        self._last_payload = now
        state = self.optimizer.state_dict() if self.optimizer is not None else None
        return {"optimizer": copy.deepcopy(state), "norm_stats": self.run.norm_stats[:self.args.workers].clone()}

    def sync(self, final: bool = False) -> bool:
        """Send the change since the last sync, take the global weights (``Uplink.sync``); False if the server did
        not answer (the change is kept and goes with the next sync, at most once)."""
        with self._lock:
            t0 = time.perf_counter()
            try:
                self.uplink.sync(self.live, self.run.global_steps.value, self._stats(), self._payload(final))
            except Exception as e:  # the server is busy, restarting or unreachable: try again next time
                self.failed_syncs += 1
                self.failed_in_a_row += 1
                self.sync_error = one_line(e)
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                return False
            self.sync_error, self._failing_since, self.failed_in_a_row = "", None, 0
            self.syncs += 1
            self.sync_seconds += time.perf_counter() - t0
            self.last_sync = time.time()
            return True

    # ---- what the driver calls ------------------------------------------------------------------------------
    def health(self) -> dict:
        """Its processes, and any that ended (a worker never ends on its own here: the node has no budget); its
        syncs: ``failing_for`` the seconds since the first of the failed syncs that followed the last successful
        one (None while the last one succeeded), ``failed_in_a_row`` how many, ``sync_error`` the last failure,
        ``sync_ended`` why the sync thread ended before ``stop`` ("" while it runs)."""
        since, ended = self._failing_since, self._sync_ended
        thread_ended = not (self._halt.is_set() or self._thread.is_alive())
        return {"pid": os.getpid(), "host": os.uname().nodename, "joins": self.joins,
                "workers": list(self._worker_pids),
                "dead": [] if self._halt.is_set() else [(role, p.exitcode) for role, p in self.procs
                                                        if not p.is_alive()],
                "errors": self.run.errors.read_all(), "syncs": self.syncs, "failed_syncs": self.failed_syncs,
                "sync_seconds": self.sync_seconds, "steps": self.run.global_steps.value,
                "failing_for": None if since is None else time.monotonic() - since,
                "failed_in_a_row": self.failed_in_a_row, "sync_error": self.sync_error,
                # the thread records its error before it ends: read again once it has ended
                "sync_ended": ended or (self._sync_ended or "it ended without an error" if thread_ended else "")}

    def stop(self) -> dict:
        """Stop the workers (``a3g.run.shutdown``), then make a last sync so that their last updates count."""
        from a3g.run import shutdown
        self._halt.set()
        self._thread.join(timeout=CALL_TIMEOUT + 5)
        shutdown(self.procs, self.run)
        synced = self.sync(final=True)
        return {"synced": synced, "errors": self.run.errors.read_all(), "steps": self.run.global_steps.value}


class RayNode(HogwildNode):
    """``HogwildNode`` as a Ray actor: its calls to the parameter server are remote calls."""

    def __init__(self, args: Namespace, index: int, ps_name: str, n_actions: int):
        import ray
        ps = ray.get_actor(ps_name)

        def call(method: str, *call_args):
            return ray.get(getattr(ps, method).remote(*call_args), timeout=CALL_TIMEOUT)

        super().__init__(args, index, call, n_actions)



"""Multi-node mode of ``main.py`` (``--ray-address``): the driver's side.

The driver (the ``main.py`` process) connects to Ray (``connect``), then ``RayRun`` starts:

- the parameter server (``multinode.ps``), a Ray actor pinned to the driver's machine;
- ``--nodes`` node actors (``multinode.node.RayNode``), each asking Ray for ``--workers`` CPUs (and one GPU per
  distinct ``--gpu-ids`` id), so Ray spreads them over the machines; Ray restarts a node that dies, and it rejoins
  from the current global weights;
- the monitor, a local process as in a single-machine run, playing the global weights (copied from the
  parameter server every ``--sync-seconds``), writing the usual logs, CSV, TensorBoard and ``.dat``.

``main.run_training`` drives it like the other modes (``modes.Mode``): ``tick`` reads the parameter server's step
count (the run's global steps), notices nodes that rejoined or whose workers failed; ``status`` gives per-node
steps/s and the time since each node's last sync; ``save`` has the parameter server write the checkpoint; ``close``
stops every node after a last sync; ``release`` removes every actor and disconnects (and stops a ``local``
cluster). A stop signal while a Ray call of the start-up is stuck ends the driver (``lifeline.StartupWatch``).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sys
import threading
import time
import warnings
from argparse import Namespace
from pathlib import Path

import torch

import lifeline
from model import A3Clstm
from modes import Mode
from multinode import guard
from run_state import UPDATE_FIELDS, RunState, StartError

REPO = Path(__file__).resolve().parent.parent
CONNECT_SECONDS = 15.0  # an address that does not answer within this is bad input
CALL_SECONDS = 5.0  # the driver's calls to actors (status, health) give up after this
START_SECONDS = 300.0  # the parameter server's first answer (a busy machine starts a Ray actor slowly)
SAVE_SECONDS = 60.0  # the parameter server writes a checkpoint (39 MB) within this
NODE_START_SECONDS = 600.0  # a node (or the parameter server) that has not answered this long fails the run
SHUTDOWN_SECONDS = 8.0  # Ray's own shutdown, before a local cluster's processes are killed
STOP_SECONDS = 10.0  # nodes get this long (together) to stop their workers and make their last sync
SYNC_TRIES_IN_A_ROW = 3  # a node whose syncs failed this often in a row while the server answers (and long) fails
SERVER_LATE_SECONDS = 10.0  # a status call unanswered this long: the parameter server is down or restarting
START_GRACE_SECONDS = 10.0  # after a stop signal, how long a Ray call of the start-up may keep the driver waiting


class Poll:
    """One outstanding call to an actor at a time, read without blocking: ``poll`` returns its result (or the
    exception it raised) once it is ready, else None; the next call goes out after a result was read."""

    def __init__(self, ray):
        self.ray = ray
        self.ref = None
        self.since: float | None = None

    def poll(self, make_call, now: float):
        if self.ref is None:
            self.ref, self.since = make_call(), now
        ready, _ = self.ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        ref, self.ref = self.ref, None
        try:
            return self.ray.get(ref)
        except Exception as e:  # the actor died, or its call failed
            return e

    def waiting(self, now: float) -> float:
        return 0.0 if self.ref is None else now - self.since


class RayConnectError(RuntimeError):
    """Ray could not be reached or does not have what the run needs; the message is one line."""


def parse_address(address: str) -> tuple[str, int] | None:
    """``host:port`` of an explicit address (``ray://`` client addresses included), None for ``auto``/``local``."""
    if address in ("auto", "local"):
        return None
    a = address.split("://", 1)[-1]
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit() or not host.strip("[]"):
        raise RayConnectError(f"--ray-address {address!r}: expected auto, local or HOST:PORT (e.g. 10.0.0.1:6379)")
    if not 1 <= int(port) <= 65535:
        raise RayConnectError(f"--ray-address {address!r}: port {int(port)} is not a TCP port (1-65535)")
    return host.strip("[]"), int(port)


# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server (a Ray head's control store, Ray
# Client's server) answers with a SETTINGS frame of its own (a 9-byte frame header of type 4)
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
HTTP2_SETTINGS = 4


def check_reachable(address: str, timeout: float = CONNECT_SECONDS) -> None:
    """Fail fast (one line) when an explicit address does not accept connections, or when what answers there does
    not speak gRPC as a Ray head's port does (a web server, the dashboard's port): ``ray.init`` would retry for
    minutes either way. With ``RAY_USE_TLS`` (Ray's gRPC over TLS) only the connection is checked."""
    hp = parse_address(address)
    if hp is None:
        return
    tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    try:
        with socket.create_connection(hp, timeout=timeout) as s:
            first = b"" if tls else first_frame_header(s, timeout)
    except UnicodeError:  # a host name the resolver cannot encode (an empty or over-long label)
        raise RayConnectError(f"--ray-address {address!r}: {hp[0]!r} is not a host name (e.g. 10.0.0.1 or "
                              f"head.example.org)") from None
    except OSError as e:
        raise RayConnectError(f"--ray-address {address}: nothing answers there ({e.strerror or e}); start the "
                              f"head with `ray start --head --port {hp[1]}` on {hp[0]}, or check the address "
                              f"and that the port is open") from None
    if not tls and (len(first) < 9 or first[3] != HTTP2_SETTINGS):
        raise RayConnectError(f"--ray-address {address}: something answers there, but not as a Ray head does (no "
                              f"gRPC within {timeout:.0f} s); give the port that `ray start --head` printed (6379 "
                              f"unless --port said otherwise), not the dashboard's (8265) or another service's")


def first_frame_header(sock: socket.socket, timeout: float) -> bytes:
    """Send ``HTTP2_PREFACE`` on ``sock`` and return the first 9 bytes of the answer (fewer if the peer closed,
    reset or said nothing more within ``timeout`` seconds)."""
    data = b""
    deadline = time.monotonic() + timeout
    try:
        sock.sendall(HTTP2_PREFACE)
        while len(data) < 9 and time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(9 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:  # reset, or silent until the deadline
        pass
    return data


class RayStopped(Exception):
    """A stop signal arrived while Ray was starting (Ray's own SIGTERM handler turns it into ``SystemExit``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def connect(args: Namespace, stop=None):
    """Connect to (``auto``, ``HOST:PORT``) or start (``local``) a Ray cluster, and check that it has the CPUs
    (and GPUs) the nodes ask for. Returns the ``ray`` module; raises ``RayConnectError`` with one line.

    ``ray.init`` installs a SIGTERM handler of its own that exits the process; ``stop`` (``lifeline.StopSignals``)
    is installed again before this returns, and a SIGTERM that Ray's handler caught meanwhile comes out as
    ``RayStopped``, so that the caller stops the run as for any stop signal."""
    check_reachable(args.ray_address)
    try:
        with lifeline.StartupWatch(stuck_connecting(args.ray_address),
                                   pending=lambda: None if stop is None else stop.signal, grace=START_GRACE_SECONDS):
            ray = _connect(args)
        if stop is not None:
            stop.install()
    except SystemExit as e:  # Ray's handler: sys.exit(SIGTERM)
        shutdown_quietly()
        raise RayStopped(e.code if isinstance(e.code, int) and e.code > 0 else signal.SIGTERM) from None
    return ray


def stuck_connecting(address: str):
    """``lifeline.StartupWatch``'s ``on_stuck`` while ``ray.init`` connects (a stop signal came and the call did
    not return within ``START_GRACE_SECONDS``): one line on stderr, and a ``local`` cluster's processes killed."""
    return _on_stuck(lambda line: print(f"main.py: {line}", file=sys.stderr, flush=True), address == "local",
                     f"while connecting to Ray at {address}, which did not return within {START_GRACE_SECONDS:.0f} s; "
                     f"nothing written")


def _on_stuck(say, local: bool, what: str):
    """An ``on_stuck(signum)``: ``say`` (one line: the signal's name and ``what``), then, for a ``local`` cluster,
    kill it (``kill_local_cluster``), whatever ``say`` raised."""
    def on_stuck(signum: int) -> None:
        try:
            name = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
            say(f"{name} {what}")
        finally:
            if local:
                kill_local_cluster()
    return on_stuck


def shutdown_quietly(local: bool = True, timeout: float = SHUTDOWN_SECONDS) -> bool:
    """``ray.shutdown()``, bounded: a stop signal sent to the whole process group (a terminal's Ctrl-C, a batch
    system's SIGTERM) also reaches a ``local`` cluster's processes, and Ray's shutdown can then wait on them for
    long. After ``timeout`` seconds every process this driver started is killed (``local``), which lets it
    finish. Returns False if it still did not: the caller must end the process with ``os._exit`` (Ray's exit
    handler would wait on the same lock)."""
    try:
        import ray
    except ImportError:
        return True

    def run():
        try:
            ray.shutdown()
        except BaseException:  # noqa: BLE001 - already stopping; nothing more to do
            pass

    global _SHUTDOWN_HUNG
    t = threading.Thread(target=run, name="ray shutdown", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive() and local:
        kill_local_cluster()
        t.join(5.0)
    if local:  # Ray's shutdown may return with workers left that a raylet killed by the signal had orphaned
        kill_local_cluster(children=False)
    _SHUTDOWN_HUNG = t.is_alive()
    return not _SHUTDOWN_HUNG


_SHUTDOWN_HUNG = False


def kill_local_cluster(children: bool = True) -> None:
    """Kill every process this driver started (``children``) but its guard (``multinode.guard``: it stays to
    kill what is left once this process ended), and the ``local`` cluster's processes that a stop signal
    orphaned (``guard.session_processes``)."""
    import psutil
    me = psutil.Process()
    mine = {p.pid: p for p in me.children(recursive=True)} if children else {}
    mine.update({p.pid: p for p in guard.session_processes(me.pid, me.create_time())})
    for pid in (me.pid, guard.guard_pid()):
        mine.pop(pid, None)
    guard.kill_all(mine.values())


def stuck_start_up(log, local: bool):
    """What the driver does when a Ray call of the start-up is still blocked ``START_GRACE_SECONDS`` after a stop
    signal (``lifeline.StartupWatch``'s ``on_stuck``, before the process exits with 128 + the signal): say so in
    ``log``, then, for a ``local`` cluster, kill it (``kill_local_cluster``), whatever the log did. A signal sent to
    the whole process group also reaches a ``local`` cluster's processes, and a Ray call (seen: creating the
    parameter server's actor, which waits on the cluster's control store) can then block for a minute or more
    inside Ray's C++ client."""
    return _on_stuck(lambda line: log.info(f"stopped: {line}"), local, f"while Ray was starting, and a Ray call did not return within "
                                      f"{START_GRACE_SECONDS:.0f} s; nothing was trained in this run, its "
                                      f"checkpoints are as they were")


def shutdown_hung() -> bool:
    """Whether the last ``shutdown_quietly`` did not finish (the process must end with ``os._exit``)."""
    return _SHUTDOWN_HUNG


def _connect(args: Namespace):
    if args.ray_address != "local" and "RAY_AUTH_MODE" not in os.environ and _auth_token_available():
        # `ray start` enables Ray's token authentication when a token exists; a driver joining that cluster
        # must say so too (read when Ray is imported), or the head refuses it ("Authentication token is missing
        # or incorrect")
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        import ray
    except ImportError:
        raise RayConnectError("--ray-address needs Ray: pip install -r requirements-ray.txt") from None
    logging.getLogger("ray").setLevel(logging.ERROR)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    runtime_env = {"env_vars": {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore::DeprecationWarning"}}
    kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                  runtime_env=runtime_env, configure_logging=True)
    if args.ray_address == "local":
        # Ray runs its workers at nice 15 by default; on one machine the nodes' workers then lose the CPU to the
        # monitor and the driver, which a single-machine run's workers share it with equally.
        os.environ.setdefault("RAY_worker_niceness", "0")
        guard.start()  # the cluster's processes end with this one, however it ends
        # the GPUs are the ones Ray finds on this machine (the check below wants --nodes x the ids of --gpu-ids)
        kwargs.update(num_cpus=max(os.cpu_count() or 1, args.nodes * args.workers),
                      object_store_memory=max(256, 64 * args.nodes) * 1024 ** 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ray.init(address=args.ray_address, **kwargs)
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, ValueError... with long texts
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = " (no running cluster found: start one with `ray start --head`, or use --ray-address local)" \
            if args.ray_address == "auto" else ""
        if "auth" in str(e).lower():
            hint = " (the cluster uses token authentication: copy the head's ~/.ray/auth_token to this machine)"
        raise RayConnectError(f"--ray-address {args.ray_address}: could not connect to Ray: {first[:200]}"
                              f"{hint}") from None
    total, free = ray.cluster_resources(), ray.available_resources()
    cpus, gpus = free.get("CPU", 0), free.get("GPU", 0)
    need_cpus, need_gpus = args.nodes * args.workers, args.nodes * gpus_needed(args)
    if cpus < need_cpus or gpus < need_gpus:
        ray.shutdown()
        busy = (f" ({total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all; another run holds the rest)"
                if (total.get("CPU", 0), total.get("GPU", 0)) != (cpus, gpus) else "")
        raise RayConnectError(
            f"the Ray cluster at {args.ray_address} has {cpus:g} CPUs and {gpus:g} GPUs free{busy}; --nodes "
            f"{args.nodes} x --workers {args.workers} needs {need_cpus} CPUs (one per worker)"
            + (f" and {need_gpus} GPUs" if need_gpus else "") + ": lower --nodes or --workers, or add machines")
    return ray


def _auth_token_available() -> bool:
    """Whether Ray would find an authentication token here (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``, the file ``ray start --head`` writes)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).is_file()


def gpus_needed(args: Namespace) -> int:
    """GPUs per node: one per distinct ``--gpu-ids`` id (0 on the CPU)."""
    return 0 if args.gpu_ids[0] < 0 else len(set(args.gpu_ids))


def absolute_paths(args: Namespace) -> Namespace:
    """Actors do not share the driver's working folder: give them absolute paths (the same checkout at the same
    path on every machine, see the README)."""
    for name in ("save_model_dir", "log_dir", "env_config", "load_model_dir"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(args, name, str(Path(value).resolve()))
    return args


class RayRun(Mode):
    """Multi-node mode (see the module docstring), driven by ``main.run_training`` through ``modes.Mode``.
    Process slots: the monitor only (slot 0)."""

    name = "ray"

    def __init__(self, args: Namespace, shared_model: A3Clstm, optimizer, log, ray_module=None, stop=None):
        import copy
        self.args = absolute_paths(copy.copy(args))
        self.shared_model, self.optimizer, self.log = shared_model, optimizer, log
        self.ray = ray_module
        self.stop = stop  # lifeline.StopSignals: a stop signal ends the waits of the start-up
        if self.ray is None:
            import ray
            self.ray = ray
        self.run = RunState(0, args.score_window)  # the driver's: global steps (from the server) and the monitor
        self.run_id = secrets.token_hex(8)
        self.ps_name = f"a3g-parameter-server-{self.run_id}"  # nodes find it by name (no handle in their arguments)
        self.procs: list[tuple[str, mp.Process]] = []
        self.ps = None
        self.nodes: list = []
        self.node_info: list[dict | None] = [None] * args.nodes
        self.failed: str | None = None
        self._errors: list[tuple[str, str]] = []
        self._resume: dict | None = None
        self._last_poll = 0.0
        self._last_pull = 0.0
        self._ps_status: dict | None = None
        self._status_prev: dict | None = None
        self._ps_down_since: float | None = None
        self._joins = [0] * args.nodes  # each node's joins as the parameter server counts them
        self._sync_fail_base = [0] * args.nodes  # each node's failed syncs in a row while the server did not answer
        self._starts = [0] * args.nodes  # each node's starts in this run, counted here (a restarted server's count
        # of joins begins again at 0)
        self._polls: dict = {}
        self._node_down_since: list[float | None] = []
        self._node_error: list[str] = []

    def describe(self) -> str:
        where = "CPU" if self.args.gpu_ids[0] < 0 else f"{gpus_needed(self.args)} GPU(s) each"
        return (f"on Ray ({self.args.ray_address}): {self.args.nodes} node(s) x {self.args.workers} workers on "
                f"{where}, syncing every {self.args.sync_seconds:g} s (--merge {self.args.merge})")

    def restore(self, ckpt: dict) -> None:
        self.run.restore(ckpt)
        self._resume = ckpt

    def slot_of(self, role: str) -> int:
        return self.run.monitor_slot

    def expected_exit(self, role: str, process: mp.Process, budget_reached: bool) -> bool:
        return False

    def errors(self) -> list[tuple[str, str]]:
        return list(self._errors)

    # ---- start ----------------------------------------------------------------------------------------------
    def launch(self, ctx, elapsed_offset: float = 0.0) -> list[tuple[str, mp.Process]]:
        """Start the parameter server, the nodes and the monitor; a stop signal while a Ray call of this start-up
        is stuck ends the driver after ``START_GRACE_SECONDS`` (``lifeline.StartupWatch``, ``stuck_start_up``)."""
        with lifeline.StartupWatch(stuck_start_up(self.log, self.args.ray_address == "local"),
                                   pending=lambda: None if self.stop is None else self.stop.signal,
                                   grace=START_GRACE_SECONDS):
            return self._launch(ctx, elapsed_offset)

    def _launch(self, ctx, elapsed_offset: float) -> list[tuple[str, mp.Process]]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from checkpoint import CheckpointWriteError
        from environment import num_actions
        from multinode.node import RayNode
        from multinode.ps import ParameterServer
        from test import test
        ray = self.ray
        weights = {k: v.detach().clone() for k, v in self.shared_model.state_dict().items()}
        payload = None
        if self._resume is not None:
            rows = self._resume.get("norm_stats")
            same_opt = self._resume.get("optimizer_name") == self.args.optimizer
            payload = {"optimizer": self._resume.get("optimizer") if same_opt else None,
                       "norm_stats": None if rows is None else rows[:-1].clone()}
        here = ray.get_runtime_context().get_node_id()
        self.ps = ray.remote(ParameterServer).options(  # one call at a time, in each caller's order: node.Uplink
            num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
            name=self.ps_name,
        ).remote(self.args, self.run_id)
        ref = self.ps.begin.remote(weights, self.run.global_steps.value, payload, self._fields(elapsed_offset))
        deadline = time.time() + START_SECONDS
        while not ray.wait([ref], timeout=0.2)[0]:  # a stop signal ends the wait (a busy machine starts slowly)
            if self.stop is not None and self.stop.signal is not None:
                raise StartError("stopped while the parameter server was starting")
            if time.time() > deadline:
                raise StartError(f"the parameter server did not start within {START_SECONDS:.0f} s")
        try:
            ok, text = ray.get(ref)
        except Exception as e:  # it could not start
            raise StartError(f"the parameter server did not start ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else 'no message'})") from None
        if not ok:
            raise CheckpointWriteError(text)
        n_actions = num_actions(self.args.env)
        node_cls = ray.remote(RayNode)
        node_cls = node_cls.options(num_cpus=self.args.workers, num_gpus=gpus_needed(self.args), max_restarts=-1,
                                    max_task_retries=0)
        self.nodes = [node_cls.remote(self.args, i, self.ps_name, n_actions) for i in range(self.args.nodes)]
        self._polls = {"status": Poll(ray), "weights": Poll(ray), **{i: Poll(ray) for i in range(self.args.nodes)}}
        self._node_down_since = [time.time()] * self.args.nodes  # until each first answers
        self._node_error = [""] * self.args.nodes
        lifeline.mark_children()
        monitor_args = Namespace(**vars(self.args))
        monitor_args.seed = self.args.seed + self.args.nodes * self.args.workers
        monitor_args.gpu_ids = [-1]  # the driver's monitor plays on its CPU: --gpu-ids are the nodes' GPUs
        p = ctx.Process(target=test, args=(monitor_args, self.shared_model, self.run, elapsed_offset), name="monitor")
        lifeline.start_child(p)
        self.procs = [("monitor", p)]
        return self.procs

    # ---- while it runs ----------------------------------------------------------------------------------------
    def _get(self, refs, timeout: float = CALL_SECONDS):
        return self.ray.get(refs, timeout=timeout)

    def tick(self, now: float) -> None:
        """About once a second, without blocking: the global step count; every ``--sync-seconds`` the global
        weights for the monitor; which nodes (re)started; whether a node's worker failed."""
        if now - self._last_poll < 1.0:
            return
        self._last_poll = now
        status = self._polls["status"].poll(lambda: self.ps.status.remote(), now)
        if status is not None:
            self._server_answered(status, now)
        elif self._polls["status"].waiting(now) > SERVER_LATE_SECONDS and self._ps_down_since is None \
                and self._ps_status is not None:
            self._ps_down_since = self._polls["status"].since
            self.log.info("the parameter server does not answer; Ray restarts it if it died (from the last "
                          "checkpoint)")
        if self._ps_down_since is not None and now - self._ps_down_since > NODE_START_SECONDS and self.failed is None:
            self.failed = (f"the parameter server has not answered for {NODE_START_SECONDS:.0f} s (Ray did not bring "
                           f"it back): without it no node syncs and the global step count stands still")
        if now - self._last_pull >= self.args.sync_seconds:
            weights = self._polls["weights"].poll(lambda: self.ps.get_weights.remote(), now)
            if weights is not None:
                self._last_pull = now
                self.load_global_weights(weights)
        for i, node in enumerate(self.nodes):
            h = self._polls[i].poll(lambda node=node: node.health.remote(), now)
            if h is not None:
                self._node_answered(i, h, now)
            since = self._node_down_since[i]
            if since is not None and now - since > NODE_START_SECONDS and self.failed is None:
                self.failed = (f"node {i} did not start within {NODE_START_SECONDS:.0f} s"
                               + (f" ({self._node_error[i]})" if self._node_error[i] else ""))

    def _server_answered(self, status: dict, now: float) -> None:
        if isinstance(status, Exception):  # it died: Ray restarts it; the next call waits for that
            if self._ps_down_since is None:
                self._ps_down_since = now
                self.log.info(f"the parameter server died ({type(status).__name__}); Ray restarts it from the "
                              f"last checkpoint")
            return
        if self._ps_down_since is not None:
            self.log.info(f"the parameter server is back after {now - self._ps_down_since:.0f} s"
                          + (f", from {status['recovered_from']}" if status.get("recovered_from") else "")
                          + f", at {status['global_steps']:,} global steps")
            self._ps_down_since = None
        if self._ps_status is not None and self._ps_status["started"] != status["started"]:
            self._joins = [0] * self.args.nodes  # a restarted server counts joins and per-node steps afresh
            self._status_prev = None
        self._ps_status = status
        self.run.global_steps.slots[-1] = int(status["global_steps"])
        for i, n in enumerate(status["nodes"]):
            if n["joins"] > self._joins[i]:  # the node (re)started since the last status: count its starts here
                self._starts[i] += n["joins"] - self._joins[i]
                if self._starts[i] > 1:
                    self.log.info(f"node {i} rejoined (start {self._starts[i]}) from the global weights at "
                                  f"{status['global_steps']:,} global steps")
                self._joins[i] = n["joins"]

    def poll_server(self, timeout: float = CALL_SECONDS) -> bool:
        """Wait (up to ``timeout``) for the parameter server's counts: the final step count at the end."""
        try:
            status = self._get(self.ps.status.remote(), timeout=timeout)
        except Exception:
            return False
        self._server_answered(status, time.time())
        return True

    def load_global_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if isinstance(weights, Exception):
            return
        with torch.no_grad():
            for k, v in self.shared_model.state_dict().items():
                v.copy_(weights[k])

    def _node_answered(self, i: int, h, now: float) -> None:
        if isinstance(h, Exception):  # it died (Ray restarts it and it rejoins) or failed to start
            from multinode.node import one_line
            text = str(h)
            self._node_error[i] = one_line(h)
            if "creation task" in text and self.failed is None:  # its constructor raised: a restart would too
                self.failed = f"node {i} could not start ({self._node_error[i]})"
            if self.node_info[i] is not None and self.node_info[i].get("pid"):
                self.log.info(f"node {i} lost ({type(h).__name__}); Ray restarts it")
                self.node_info[i] = {"pid": None}
                self._node_down_since[i] = now
            return
        self._node_down_since[i] = None
        self._node_error[i] = ""
        if self.node_info[i] is None or self.node_info[i]["pid"] != h["pid"]:
            self.log.info(f"node {i}: pid {h['pid']} on {h['host']}, workers {h['workers']}")
        self.node_info[i] = h
        if h["dead"] and self.failed is None:
            role, code = h["dead"][0]
            self.failed = f"node {i}: {role} exited unexpectedly (exit code {code})"
            self._errors += [(f"node {i} {r}", t) for r, t in h["errors"]]
        if h.get("sync_ended") and self.failed is None:
            self.failed = (f"node {i}: its sync thread ended ({h['sync_ended']}); the node would train on without "
                           f"the others")
        # A node's failed syncs count only while the parameter server answers the driver: one that is down (or has
        # not answered yet) makes every node's syncs fail, and has its own limits (tick). So the node's count of
        # failures in a row is noted while the server does not answer, and the run fails once the node has failed
        # SYNC_TRIES_IN_A_ROW more times since and for NODE_START_SECONDS in all (with a long --sync-seconds, the
        # tries take longer than that).
        if self._ps_down_since is not None or self._ps_status is None:
            self._sync_fail_base[i] = h.get("failed_in_a_row", 0)
        elif h.get("failed_in_a_row", 0) < self._sync_fail_base[i]:  # it synced since: count afresh
            self._sync_fail_base[i] = 0
        failing, tries = h.get("failing_for"), h.get("failed_in_a_row", 0) - self._sync_fail_base[i]
        if failing is not None and failing > NODE_START_SECONDS and tries >= SYNC_TRIES_IN_A_ROW \
                and self.failed is None:
            self.failed = (f"node {i} has not synced with the parameter server for {failing:.0f} s ({tries} tries in "
                           f"a row while the server answers the driver; last error: {h['sync_error']})")

    def status(self, rate: float, span: float) -> tuple[str, dict]:
        line = f"steps {self.run.global_steps.value:,} ({rate:.0f} steps/s)"
        scalars = {"charts/train_steps_per_s": rate}
        st = self._ps_status
        if st is None:
            return line + " | parameter server not answering yet", scalars
        prev = self._status_prev
        parts, stats = [], []
        for i, n in enumerate(st["nodes"]):
            ago = ("never synced" if n["last_sync"] is None
                   else f"synced {max(0.0, st['time'] - n['last_sync']):.1f} s ago")
            if prev is not None and st["time"] > prev["time"]:
                node_rate = (n["steps"] - prev["nodes"][i]["steps"]) / (st["time"] - prev["time"])
                parts.append(f"node {i} {node_rate:.0f} steps/s, {ago}")
                scalars[f"nodes/node{i}_steps_per_s"] = node_rate
            else:  # no earlier report to take a rate from (the first status line): the node's steps so far
                parts.append(f"node {i} {n['steps']:,} steps, {ago}")
            if n["stats"] is not None:
                stats.append(n["stats"])
        self._status_prev = st
        line += " | " + " | ".join(parts)
        if stats:
            f = dict(zip(UPDATE_FIELDS, torch.tensor(stats, dtype=torch.float64).mean(0).tolist()))
            line += (f" | per step: policy {f['policy_loss']:.4f} value {f['value_loss']:.4f} entropy "
                     f"{f['entropy']:.3f} | grad-norm {f['grad_norm']:.2f}")
            scalars.update({f"losses/{k}": f[k] for k in UPDATE_FIELDS[2:]})
        return line, scalars

    # ---- checkpoints and the end ------------------------------------------------------------------------------
    def _fields(self, elapsed: float) -> dict:
        """What the driver adds to the parameter server's checkpoint: the monitor's statistics, its normalisation
        row, the elapsed time and the flags."""
        from config import config_dict
        monitor, recent = self.run.monitor_state()
        return {"best_score": float(monitor[2].item()), "elapsed_seconds": float(elapsed),
                "config": config_dict(self.args), "monitor": monitor, "recent_scores": recent,
                "monitor_norm_row": self.run.norm_stats[self.run.monitor_norm].clone()}

    def save(self, elapsed: float, final: bool = False) -> Path:
        """The parameter server writes the checkpoint (and, at the end, the ``.dat``) where a single-machine run
        does; raises ``CheckpointWriteError`` with its one line."""
        from checkpoint import CheckpointWriteError
        from checkpoint import checkpoint_path
        fields = self._fields(elapsed)
        if self._ps_down_since is not None and not final:  # it is restarting: its last checkpoint stays
            self.log.info("checkpoint skipped: the parameter server is restarting")
            return checkpoint_path(self.args.save_model_dir, self.args.env)
        try:
            ok, text = self._get(self.ps.save.remote(fields, final and not self.args.save_max),
                                 timeout=SAVE_SECONDS)
        except Exception as e:  # died or restarting: the last complete checkpoint stays
            if not final:
                self.log.info(f"checkpoint skipped: the parameter server did not answer ({type(e).__name__})")
                return checkpoint_path(self.args.save_model_dir, self.args.env)
            raise CheckpointWriteError(f"the parameter server did not write the final checkpoint "
                                       f"({type(e).__name__}); the last complete one is kept") from None
        if not ok:  # it answered that the write failed (a full disk): a failure of the run, as on one machine
            raise CheckpointWriteError(text)
        return Path(text)

    def close(self) -> None:
        """Stop every node (its workers, then a last sync), then read the final step count."""
        if not self.nodes:
            return
        refs = [n.stop.remote() for n in self.nodes]
        deadline = time.time() + STOP_SECONDS  # one deadline for all: they stop in parallel
        for i, ref in enumerate(refs):
            try:
                out = self._get(ref, timeout=max(0.5, deadline - time.time()))
            except Exception as e:
                self.log.info(f"node {i} did not stop cleanly ({type(e).__name__}); its last updates since its "
                              f"last sync are lost")
                continue
            for role, text in out["errors"]:
                if (f"node {i} {role}", text) not in self._errors:
                    self._errors.append((f"node {i} {role}", text))
        self.poll_server()  # the final step count, with every node's last sync

    def release(self, disconnect: bool = True) -> None:
        """Remove every actor (their worker processes die with them) and disconnect; a ``local`` cluster stops.
        ``disconnect=False`` keeps the connection (a benchmark's next measurement)."""
        for actor in [*self.nodes, self.ps]:
            if actor is not None:
                try:
                    self.ray.kill(actor, no_restart=True)
                except Exception:
                    pass
        self.nodes, self.ps = [], None
        if disconnect:
            shutdown_quietly(self.args.ray_address == "local")

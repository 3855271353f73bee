"""Several machines on Ray (``--ray-address``): the merge arithmetic by hand, the parameter server and a hogwild
node in-process, bad input, and real local clusters under faults (a node killed, Ctrl-C, the parameter server
killed, signals during start-up).

The Ray cases start a one-machine cluster (``--ray-address local``) with tiny models and budgets; they use the
fault-injection harness of ``test_faults`` (a new session per run, every process of the run found and killed at
teardown; Ray's own processes are in that session too).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from conftest import ROOT
from test_faults import launch  # noqa: F401 - the fixture
from test_faults import (CKPT, END_SECONDS, START_SECONDS, TRACEBACK, check_end, describe, load_saved, models_dir,
                         pause, resume_run, title, train_args)

from multinode.merge import (apply_change, max_nodes, merge_scale, rebase, scale_row, sync_traffic, weight_bytes,
                             weight_change)

ray = pytest.importorskip("ray", reason="needs Ray: pip install -r requirements-ray.txt")

RAY_START_SECONDS = 240.0  # a local cluster, its actors and their workers on a busy 2-core machine
RAY_END_SECONDS = 30.0  # the nodes stop together (up to 10 s), then Ray's own shutdown takes seconds more


def w(*values) -> dict[str, torch.Tensor]:
    return {"a": torch.tensor([float(v) for v in values])}


# --------------------------------------------------------------------------------------------- the arithmetic
def test_two_nodes_syncing_from_the_same_weights_sum_or_average_their_changes():
    """Hand-computed: global [1, 2]; node A moved to [1.5, 2], node B to [1, 1]."""
    base = w(1, 2)
    change_a, change_b = weight_change(w(1.5, 2), base), weight_change(w(1, 1), base)
    assert change_a["a"].tolist() == [0.5, 0.0] and change_b["a"].tolist() == [0.0, -1.0]
    for mode, expected in (("sum", [1.5, 1.0]), ("average", [1.25, 1.5])):
        g = w(1, 2)
        apply_change(g, change_a, merge_scale(mode, 2))
        apply_change(g, change_b, merge_scale(mode, 2))
        assert g["a"].tolist() == expected, mode
    assert merge_scale("average", 4) == 0.25 and merge_scale("sum", 4) == 1.0
    with pytest.raises(ValueError):
        merge_scale("median", 2)


def test_rebase_keeps_the_updates_made_while_the_sync_was_on_its_way():
    """Sent [2, 2]; the workers added [0.5, -1] meanwhile (live [2.5, 1]); the server answered [3, 0]:
    live becomes [3.5, -1], the answer plus what was added since."""
    live, sent, received = w(2.5, 1), w(2, 2), w(3, 0)
    before = live["a"]
    rebase(live, sent, received)
    assert live["a"].tolist() == [3.5, -1.0] and live["a"] is before  # in place: the workers' shared memory


def test_weight_change_refuses_weights_of_another_model():
    with pytest.raises(ValueError, match="do not match"):
        weight_change({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


def test_traffic_and_the_scale_table_by_hand():
    """13 MB up and 13 MB down every 5 s is 5.2 MB/s per node; a 100 MB/s link and 0.1 s of server time per
    sync: 10 nodes load the link 0.52 and the server 0.2; 20 nodes: 1.04 -> saturated, syncs every 5.2 s."""
    mb = 13_000_000
    assert sync_traffic(mb, 5.0) == 5_200_000
    row = scale_row(10, 100.0, mb, 5.0, 100e6, 0.1)
    assert row["steps_per_s"] == 1000 and row["ps_traffic_bytes_per_s"] == 52e6
    assert abs(row["ps_net_load"] - 0.52) < 1e-12 and abs(row["ps_cpu_load"] - 0.2) < 1e-12
    assert not row["saturated"] and row["effective_sync_seconds"] == 5.0
    row = scale_row(20, 100.0, mb, 5.0, 100e6, 0.1)
    assert row["saturated"] and abs(row["effective_sync_seconds"] - 5.2) < 1e-9
    assert max_nodes(mb, 5.0, 100e6, 0.1) == 19  # 1 / 0.052 = 19.2: 19 nodes load it 0.988
    assert weight_bytes({"x": torch.zeros(3, 4), "y": torch.zeros(2, dtype=torch.float64)}) == 3 * 4 * 4 + 2 * 8


# --------------------------------------------------------------------------- the parameter server, in-process
def ps_args(tmp_path, **kw) -> Namespace:
    from config import build_parser
    a = build_parser().parse_args(["--workers", "1", "--hidden-size", "32", "--save-model-dir", str(tmp_path / "m"),
                                   "--log-dir", str(tmp_path / "l"), "--env-config", str(ROOT / "config.json"),
                                   "--ray-address", "local"])
    (tmp_path / "m").mkdir(exist_ok=True)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def fields() -> dict:
    return {"best_score": -21.0, "elapsed_seconds": 3.0, "config": {}, "monitor": torch.zeros(3, dtype=torch.float64),
            "recent_scores": [], "monitor_norm_row": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}


def test_parameter_server_applies_changes_counts_steps_and_comes_back_from_its_own_checkpoint(tmp_path):
    from checkpoint import check_checkpoint, is_checkpoint, read_weights
    from model import A3Clstm
    from multinode.ps import ParameterServer
    args = ps_args(tmp_path, nodes=2, merge="sum")
    model = A3Clstm(1, 6, 32)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ps = ParameterServer(args, "run-1")
    with pytest.raises(RuntimeError, match="no weights"):
        ps.join(0)
    ok, path = ps.begin(start, 100, None, fields())
    assert ok and is_checkpoint(read_weights(path))  # the first checkpoint is written at once
    joined = ps.join(1)
    assert joined["joins"] == 1 and torch.equal(joined["weights"]["critic_linear.bias"], start["critic_linear.bias"])
    change = {k: torch.full_like(v, 0.5) for k, v in start.items()}
    got = ps.push(1, joined["epoch"], 1, change, 40, [1.0] * 7, None)
    assert torch.allclose(got["critic_linear.bias"], start["critic_linear.bias"] + 0.5)
    st = ps.status()
    assert st["global_steps"] == 140 and st["nodes"][1]["steps"] == 40 and st["nodes"][1]["syncs"] == 1
    ok, path = ps.save(fields(), write_model=True)
    ckpt = read_weights(path)
    check_checkpoint(ckpt, path)
    assert ckpt["global_steps"] == 140 and ckpt["ray_run_id"] == "run-1"
    assert ckpt["norm_stats"].shape == (2, 3) and ckpt["norm_stats"][-1].tolist() == [1.0, 2.0, 3.0]
    assert torch.equal(read_weights(tmp_path / "m" / "PongNoFrameskip-v4.dat")["actor_linear.weight"],
                       got["actor_linear.weight"])
    again = ParameterServer(args, "run-1")  # as Ray restarts it: from this run's checkpoint, begin ignored
    assert again.recovered_from == str(path) and again.global_steps == 140
    assert again.landed(1, joined["epoch"]) == 1 and again.landed(0, joined["epoch"]) == 0  # what it has applied
    again.begin(start, 0, None, fields())
    assert torch.equal(again.weights["critic_linear.bias"], got["critic_linear.bias"])
    other = ParameterServer(args, "run-2")  # another run's checkpoint is not this run's state
    assert other.recovered_from is None and other.weights is None


def test_average_merge_scales_each_change_by_one_over_the_nodes(tmp_path):
    from multinode.ps import ParameterServer
    ps = ParameterServer(ps_args(tmp_path, nodes=4, merge="average"), "r")
    ps.weights = {"a": torch.zeros(2)}  # as begin() sets them
    got = ps.push(0, 1, 1, {"a": torch.tensor([4.0, -8.0])}, 0)
    assert got["a"].tolist() == [1.0, -2.0]


@pytest.mark.timeout(300)
def test_a_hogwild_node_trains_and_trades_its_changes_with_the_parameter_server(tmp_path):
    """The node of a multi-node run, in this process, joined to an in-process parameter server: its worker
    process trains, the node's changes reach the server, the server's steps follow, stop() syncs once more."""
    from model import A3Clstm
    from multinode.node import HogwildNode
    from multinode.ps import ParameterServer
    args = ps_args(tmp_path, nodes=1, sync_seconds=0.5, max_steps=50)  # the node ignores budgets: it has none
    ps = ParameterServer(args, "r")
    start = {k: v.clone() for k, v in A3Clstm(1, 6, 32).state_dict().items()}
    ps.begin(start, 0, None, fields())
    node = HogwildNode(args, 0, lambda name, *a: getattr(ps, name)(*a), 6)
    try:
        assert node.args.max_steps == 0 and node.args.seed == args.seed
        deadline = time.monotonic() + START_SECONDS
        while ps.status()["global_steps"] < 200:
            assert time.monotonic() < deadline, f"no steps reached the server: {node.health()}"
            assert not node.health()["dead"], node.health()
            time.sleep(0.2)
    finally:
        out = node.stop()
    assert out["synced"] and not out["errors"]
    assert ps.status()["global_steps"] == out["steps"]  # the last sync reported every step
    moved = max((ps.weights[k] - start[k]).abs().max().item() for k in start)
    assert moved > 0
    assert out["steps"] > 0 and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                                        for pid in node.health()["workers"])


class QueuedServer:
    """An in-process ``ParameterServer`` reached as the Ray actor is: one call at a time, in the order sent
    (``max_concurrency=1``); a call that waits behind a ``hold()`` not yet released gets ``TimeoutError`` after
    ``timeout`` seconds while it stays queued and still runs later, as ``ray.get(..., timeout=...)`` cancels
    nothing. ``hold()`` keeps the server busy (as a slow checkpoint write, or other nodes' syncs, do) until the
    event it returns is set; ``restart(ps)`` loses the calls still queued and puts ``ps`` in their place, as Ray's
    restart of a dead server does.

    Whether a call times out depends only on the holds, never on how fast the server's thread gets the CPU: a call
    that nothing holds up is waited for ``answer_seconds`` (a loaded machine may keep the thread off the CPU for
    longer than the node's short timeout), and one queued behind a hold cannot run before the test releases it."""

    def __init__(self, ps, timeout: float = 0.5, answer_seconds: float = 60.0):
        self.ps, self.timeout, self.answer_seconds = ps, timeout, answer_seconds
        self.pool = ThreadPoolExecutor(1)
        self.held: list[threading.Event] = []  # every hold, released at close()
        self.holding: list[threading.Event] = []  # the holds queued on the current server

    def call(self, method: str, *args):
        ps = self.ps
        answer = self.pool.submit(lambda: getattr(ps, method)(*args))
        held = any(not release.is_set() for release in self.holding)
        return answer.result(self.timeout if held else self.answer_seconds)

    def hold(self) -> threading.Event:
        release = threading.Event()
        self.held.append(release)
        self.holding.append(release)
        self.pool.submit(release.wait, 60)
        return release

    def drain(self) -> None:
        self.pool.submit(lambda: None).result(30)

    def restart(self, ps) -> None:
        old, self.pool, self.ps, self.holding = self.pool, ThreadPoolExecutor(1), ps, []
        old.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        for release in self.held:
            release.set()
        self.pool.shutdown(wait=True, cancel_futures=True)


def change_of(weights: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in weights.items()}


def plus(weights: dict[str, torch.Tensor], *changes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v + sum(c[k] for c in changes) for k, v in weights.items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[k], b[k], atol=1e-5, rtol=0) for k in a)


@pytest.fixture
def idle_node(tmp_path):
    """``(node, server, start, train)``: a ``HogwildNode`` without workers (``train(change, steps)`` plays their
    part: it adds to the node's shared weights and step count) joined to an in-process parameter server behind a
    ``QueuedServer``; the node's own sync thread waits an hour, so only the test syncs."""
    from model import A3Clstm
    from multinode.node import HogwildNode
    from multinode.ps import ParameterServer
    args = ps_args(tmp_path, nodes=1, workers=0, sync_seconds=3600.0, merge="sum")
    start = {k: v.clone() for k, v in A3Clstm(1, 6, 32).state_dict().items()}
    ps = ParameterServer(args, "run-1")
    assert ps.begin(start, 0, None, fields())[0]
    server = QueuedServer(ps)
    node = HogwildNode(args, 0, server.call, 6)

    def train(change: dict[str, torch.Tensor], steps: int) -> None:
        with torch.no_grad():
            for k, v in node.live.items():
                v.add_(change[k])
        node.run.global_steps.add(0, steps)

    yield node, server, start, train
    node.stop()
    server.close()


def test_a_node_reports_how_long_its_syncs_have_failed_and_the_last_error(idle_node, monkeypatch):
    """A sync that raises is counted as failed and tried again later (the server may be restarting); what failed
    and since when go into the node's health, so that the driver can tell a server that is back from a node whose
    every sync fails. A successful sync clears both."""
    node, server, start, train = idle_node
    assert node.health()["failing_for"] is None and node.health()["sync_error"] == ""
    real = server.call

    def broken(method, *args):
        if method == "push":
            raise ValueError("line 1 of a remote traceback\nValueError: the change has another shape")
        return real(method, *args)
    monkeypatch.setattr(server, "call", broken)
    node.uplink._call = broken
    train(change_of(start, 0.25), 10)
    t = time.monotonic()
    assert not node.sync()
    time.sleep(0.3)
    assert not node.sync()
    h = node.health()
    assert h["failed_syncs"] == h["failed_in_a_row"] == 2
    assert h["sync_error"] == "ValueError: ValueError: the change has another shape" and h["sync_ended"] == ""
    assert 0.3 <= h["failing_for"] <= time.monotonic() - t  # since the first failure of the two, not the last
    node.uplink._call = real
    assert node.sync()
    h = node.health()
    assert h["failing_for"] is None and h["failed_in_a_row"] == 0 and h["sync_error"] == ""
    assert server.ps.global_steps == 10


def test_a_nodes_sync_thread_that_ends_is_reported(tmp_path, monkeypatch):
    """The sync thread catches a failed sync's error and tries again; anything else that ends it (here a
    ``SystemExit`` from inside a sync) would leave the node training alone: its health says why it ended."""
    from model import A3Clstm
    from multinode.node import HogwildNode
    from multinode.ps import ParameterServer
    args = ps_args(tmp_path, nodes=1, workers=0, sync_seconds=0.05, merge="sum")
    ps = ParameterServer(args, "run-1")
    assert ps.begin({k: v.clone() for k, v in A3Clstm(1, 6, 32).state_dict().items()}, 0, None, fields())[0]
    server = QueuedServer(ps)

    def ends(self, final=False):
        raise SystemExit("the sync ended")
    monkeypatch.setattr(HogwildNode, "sync", ends)
    node = HogwildNode(args, 0, server.call, 6)
    try:
        deadline = time.monotonic() + 30
        while node.health()["sync_ended"] == "" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.health()["sync_ended"] == "SystemExit: the sync ended"
    finally:
        monkeypatch.undo()
        node.stop()
        server.close()


def test_the_driver_ends_the_run_for_a_node_that_cannot_sync_while_the_server_answers():
    """A node whose syncs have failed for ``NODE_START_SECONDS`` and ``SYNC_TRIES_IN_A_ROW`` times in a row while the
    parameter server answers the driver fails the run, naming the last error. Not for failures while the server
    does not answer (down, or not answered yet: every node's syncs fail then, and the server has its own limits),
    nor for a single failed try with a long --sync-seconds. A sync thread that ended fails it at once."""
    from config import build_parser
    from multinode.run import NODE_START_SECONDS, RayRun
    args = build_parser().parse_args(["--ray-address", "local", "--nodes", "2", "--workers", "1"])
    long = NODE_START_SECONDS + 1

    class Log:
        def info(self, line):
            pass

    def health(failing_for=None, tries=0, ended=""):
        return {"pid": 7, "host": "h", "workers": [8], "dead": [], "errors": [], "failing_for": failing_for,
                "failed_in_a_row": tries, "sync_error": "ValueError: bad shape" if tries else "", "sync_ended": ended}

    def driver():  # as launch() leaves it, every node up and the server answering
        run = RayRun(args, torch.nn.Linear(1, 1), None, Log(), ray_module=object())
        run._node_down_since, run._node_error, run._ps_status = [None, None], ["", ""], {"nodes": []}
        return run

    run = driver()
    run._node_answered(0, health(NODE_START_SECONDS - 1, tries=50), 0.0)  # not long enough yet
    run._node_answered(1, health(long, tries=1), 0.0)  # one try of a long --sync-seconds
    assert run.failed is None
    run._ps_down_since = 1.0  # the server is down: the failures so far are its
    run._node_answered(0, health(long, tries=60), 2.0)
    assert run.failed is None
    run._ps_down_since = None  # it is back: two more failures are not yet three
    run._node_answered(0, health(long + 10, tries=62), 3.0)
    assert run.failed is None
    run._node_answered(0, health(long + 20, tries=63), 4.0)
    assert run.failed == ("node 0 has not synced with the parameter server for 621 s (3 tries in a row while the "
                          "server answers the driver; last error: ValueError: bad shape)")
    run = driver()
    run._ps_status = None  # the server has not answered yet
    run._node_answered(1, health(long, tries=5), 0.0)
    assert run.failed is None
    run = driver()
    run._node_answered(1, health(long, tries=3), 0.0)
    assert run.failed.startswith("node 1 has not synced with the parameter server for 601 s (3 tries in a row")
    run = driver()
    run._node_answered(0, health(ended="MemoryError"), 0.0)
    assert run.failed == "node 0: its sync thread ended (MemoryError); the node would train on without the others"


def test_a_push_that_times_out_and_runs_later_is_applied_once(idle_node):
    """The push waits behind a busy server past the node's timeout, and runs later: the next syncs (one while it
    still waits, one after) must not send its change and steps again."""
    node, server, start, train = idle_node
    first, second = change_of(start, 0.25), change_of(start, -0.5)
    train(first, 40)
    release = server.hold()
    assert not node.sync()  # timed out; the push stays queued behind the hold
    assert not node.sync()  # still busy: nothing new goes out while the first push may land
    release.set()
    server.drain()  # the queued push ran
    ps = server.ps
    assert ps.global_steps == 40, f"{ps.global_steps} steps counted for 40"
    assert same_weights(ps.weights, plus(start, first)), "the change was applied more than once"
    train(second, 25)
    assert node.sync()
    assert ps.global_steps == 65 and ps.status()["nodes"][0]["steps"] == 65, f"{ps.global_steps} steps for 65"
    assert same_weights(ps.weights, plus(start, first, second)), "a change was applied more than once"
    assert same_weights(node.live, ps.weights)


def test_a_push_lost_with_a_dead_server_is_sent_again_once(idle_node, tmp_path):
    """The push times out and the server dies before running it; Ray's new server comes back from the checkpoint:
    the node's next sync sends the change again (it never landed), once."""
    from multinode.ps import ParameterServer
    node, server, start, train = idle_node
    change = change_of(start, 0.25)
    train(change, 40)
    release = server.hold()
    assert not node.sync()
    server.restart(ParameterServer(server.ps.args, "run-1"))  # the queued push is lost with the old server
    release.set()
    assert server.ps.recovered_from is not None and server.ps.global_steps == 0
    assert node.sync()
    assert server.ps.global_steps == 40, f"{server.ps.global_steps} steps counted for 40"
    assert same_weights(server.ps.weights, plus(start, change))


def test_a_push_that_landed_before_a_checkpoint_is_not_sent_again_after_a_restart(idle_node):
    """The push lands (its answer does not come back in time), the server writes a checkpoint, dies, and comes
    back from it: the checkpoint holds the push and says so, so the node's next sync does not send it again."""
    from multinode.ps import ParameterServer
    node, server, start, train = idle_node
    first, second = change_of(start, 0.25), change_of(start, -0.5)
    train(first, 40)
    release = server.hold()
    assert not node.sync()
    release.set()
    server.drain()
    assert server.ps.save(fields())[0]
    server.restart(ParameterServer(server.ps.args, "run-1"))
    assert server.ps.global_steps == 40
    train(second, 25)
    assert node.sync()
    assert server.ps.global_steps == 65, f"{server.ps.global_steps} steps counted for 65"
    assert same_weights(server.ps.weights, plus(start, first, second)), "a change was applied more than once"


LATE_PUSH = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
from config import build_parser
from model import A3Clstm
from multinode.node import HogwildNode
from multinode.ps import ParameterServer
from multinode.run import connect
args = build_parser().parse_args(["--ray-address", "local", "--nodes", "1", "--workers", "0", "--hidden-size", "32",
                                  "--sync-seconds", "3600", "--merge", "sum", "--save-model-dir", {models!r},
                                  "--log-dir", {logs!r}])
ray = connect(args)


class BusyServer(ParameterServer):
    def busy(self, seconds):  # as a slow checkpoint write keeps the server from the nodes' calls
        time.sleep(seconds)


ps = ray.remote(BusyServer).options(max_concurrency=1, max_task_retries=0).remote(args, "run-1")
start = A3Clstm(1, 6, 32).state_dict()
fields = dict(best_score=0.0, elapsed_seconds=0.0, config={{}}, monitor=torch.zeros(3, dtype=torch.float64),
              recent_scores=[], monitor_norm_row=torch.zeros(3, dtype=torch.float64))
assert ray.get(ps.begin.remote(start, 0, None, fields))[0]


def call(method, *call_args):  # RayNode's call, with a shorter wait
    return ray.get(getattr(ps, method).remote(*call_args), timeout=0.5)


node = HogwildNode(args, 0, call, 6)  # no workers: the script makes their updates


def train(value, steps):
    with torch.no_grad():
        for v in node.live.values():
            v.add_(value)
    node.run.global_steps.add(0, steps)


train(0.25, 40)
ps.busy.remote(2.0)
print("answered" if node.sync() else "timed out", flush=True)
time.sleep(2.0)
train(-0.5, 25)
while not node.sync():
    print("timed out", flush=True)
weights = ray.get(ps.get_weights.remote())
print(json.dumps({{"steps": ray.get(ps.status.remote())["global_steps"],
                  "error": max((weights[k] - start[k] + 0.25).abs().max().item() for k in start)}}), flush=True)
node.stop()
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_push_that_times_out_on_ray_is_applied_once(tmp_path):
    """The same on a real ``local`` cluster: the server actor is busy past the node's wait, Ray's timeout cancels
    nothing, and the server runs the node's calls in the order it sent them."""
    script = tmp_path / "late_push.py"
    script.write_text(LATE_PUSH.format(root=str(ROOT), models=str(tmp_path / "m"), logs=str(tmp_path / "l")))
    (tmp_path / "m").mkdir()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "timed out", proc.stdout
    got = json.loads(lines[-1])
    assert got["steps"] == 65, f"{got['steps']} steps counted for 65"
    assert got["error"] < 1e-5, f"the server's weights are {got['error']} off one application of each change"


def test_the_server_applies_a_push_once_and_refuses_a_replaced_nodes_pushes(tmp_path):
    """By hand, at the server: a number it applied is refused; a rejoined node starts a new epoch, numbered from 1;
    a late push of the instance it replaced changes nothing; a push of an epoch the server has not seen (a node
    that joined after the checkpoint a restarted server came back from) is applied."""
    from multinode.ps import ParameterServer
    ps = ParameterServer(ps_args(tmp_path, nodes=1, merge="sum"), "r")
    ps.begin({"a": torch.zeros(2)}, 0, None, fields())
    old = ps.join(0)["epoch"]
    one = {"a": torch.tensor([1.0, 0.0])}
    ps.push(0, old, 1, one, 10)
    ps.push(0, old, 1, one, 10)  # the same push again
    assert ps.weights["a"].tolist() == [1.0, 0.0] and ps.global_steps == 10 and ps.landed(0, old) == 1
    new = ps.join(0)["epoch"]
    assert new > old and ps.landed(0, new) == 0
    ps.push(0, old, 2, one, 10)  # the replaced instance's late push
    ps.push(0, new, 1, {"a": torch.tensor([0.0, 2.0])}, 5)
    assert ps.weights["a"].tolist() == [1.0, 2.0] and ps.global_steps == 15
    assert ps.status()["nodes"][0]["refused"] == 2
    ps.push(0, new + 7, 3, one, 1)
    assert ps.weights["a"].tolist() == [2.0, 2.0] and ps.landed(0, new + 7) == 3 and ps.landed(0, new) == 0


def test_a_node_that_rejoins_starts_from_the_global_weights_and_trains_on_from_them(idle_node):
    """As Ray restarts a lost node: a second ``HogwildNode`` with the same index joins the in-process server after
    the first one's changes landed. Its model and its base are the global weights, not a fresh initialisation; its
    next push adds only what it trained since, and the replaced node's late push is refused."""
    from multinode.node import HogwildNode
    node, server, start, train = idle_node
    first, second = change_of(start, 0.25), change_of(start, -0.5)
    train(first, 40)
    assert node.sync()
    ps = server.ps
    global_weights = {k: v.clone() for k, v in ps.weights.items()}
    assert same_weights(global_weights, plus(start, first))
    again = HogwildNode(ps.args, 0, server.call, 6)
    try:
        assert again.joins == 2
        assert same_weights(again.model.state_dict(), global_weights), "the rejoined node has not the global weights"
        assert not same_weights(again.model.state_dict(), start)
        assert same_weights(again.uplink.base, global_weights)
        with torch.no_grad():
            for k, v in again.live.items():
                v.add_(second[k])
        again.run.global_steps.add(0, 25)
        assert again.sync()
        assert same_weights(ps.weights, plus(start, first, second)), "the rejoined node's push was not its own training"
        assert ps.global_steps == 65
        train(first, 10)
        assert node.sync()  # the replaced node's late push: answered, not applied
        assert same_weights(ps.weights, plus(start, first, second)) and ps.global_steps == 65
        assert ps.status()["nodes"][0]["refused"] == 1
    finally:
        again.stop()


# -------------------------------------------------------------------------------------------------- bad input
def run_main(tmp_path, *args, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "--save-model-dir", str(tmp_path / "m"),
                           "--log-dir", str(tmp_path / "l"), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (["--ray-address", "local", "--nodes", "0"], "--nodes must be >= 1, got 0"),
    (["--nodes", "2"], "--nodes 2 needs --ray-address"),
    (["--ray-address", "local", "--sync-seconds", "0"], "--sync-seconds must be > 0"),
    (["--ray-address", "local", "--mode", "ga3c"], "--ray-address: only A3G mode has it"),
    (["--ray-address", "nowhere"], "expected auto, local or HOST:PORT"),
    (["--ray-address", "a..b:6379"], "'a..b' is not a host name"),
])
def test_bad_multinode_flags_are_one_line_and_exit_2(tmp_path, flags, message):
    """Each in one line (before, --mode ga3c with --ray-address had two, and a host name with an empty label was a
    UnicodeError traceback)."""
    proc = run_main(tmp_path, *flags)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and TRACEBACK not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m").exists()  # nothing created


def test_more_bad_multinode_input_is_one_line_each():
    """The same checks in this process (main.py prints each as above): --sync-seconds beyond a day (a node's wait
    on it overflowed and killed its sync thread), the Ray flags without --ray-address (they changed nothing), and
    addresses that are not HOST:PORT with a TCP port (a port above 65535 was tried modulo 65536)."""
    from config import build_parser, validate
    from multinode.run import RayConnectError, check_reachable

    def errors(*argv):
        return validate(build_parser().parse_args(list(argv)))
    assert errors("--ray-address", "local", "--sync-seconds", "1e10") == [
        "--sync-seconds must be at most 86,400 (a day), got 1e+10"]
    assert errors("--sync-seconds", "3") == [
        "--sync-seconds: only runs with --ray-address use it (a node's sync with the parameter server): add "
        "--ray-address, or leave it out"]
    assert errors("--merge", "average", "--sync-seconds", "3") == [
        "--sync-seconds, --merge: only runs with --ray-address use them (a node's sync with the parameter server): "
        "add --ray-address, or leave them out"]
    for address, message in ((":6379", "--ray-address ':6379': expected auto, local or HOST:PORT (e.g. 10.0.0.1:6379)"),
                             ("127.0.0.1:70000", "--ray-address '127.0.0.1:70000': port 70000 is not a TCP port "
                                                 "(1-65535)"),
                             ("a..b:6379", "--ray-address 'a..b:6379': 'a..b' is not a host name (e.g. 10.0.0.1 or "
                                           "head.example.org)")):
        with pytest.raises(RayConnectError) as e:
            check_reachable(address, timeout=1.0)
        assert str(e.value) == message


def test_an_address_that_does_not_answer_is_one_line_and_exit_2_within_bounded_time(tmp_path):
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    proc = run_main(tmp_path, "--ray-address", f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 2, proc.stderr
    assert f"--ray-address 127.0.0.1:{port}: nothing answers there" in proc.stderr
    assert "ray start --head" in proc.stderr and TRACEBACK not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m").exists()


class Listener:
    """A TCP server in a thread: ``http`` (Python's web server, as on a dashboard's port), ``grpc`` (a gRPC server
    with no service), ``silent`` (accepts and says nothing) or ``stalling`` (answers HTTP/2's preface with a
    SETTINGS frame, as a gRPC server does, then says nothing more: a client's calls wait). ``grpc`` and
    ``stalling`` listen on every address of the machine (``ray.init`` connects to the machine's own address, not
    127.0.0.1), the others on 127.0.0.1. ``accepted`` counts the connections (``silent`` and ``stalling``)."""

    def __init__(self, kind: str):
        import socket
        self.kind, self.accepted, self.stop = kind, 0, lambda: None
        if kind == "http":
            import http.server
            srv = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self.port, self.stop = srv.server_address[1], srv.shutdown
        elif kind == "grpc":
            import grpc
            srv = grpc.server(ThreadPoolExecutor(1))
            self.port = srv.add_insecure_port("0.0.0.0:0")
            srv.start()
            self.stop = lambda: srv.stop(0)
        else:
            sock = socket.socket()
            sock.bind(("0.0.0.0" if kind == "stalling" else "127.0.0.1", 0))
            sock.listen(16)
            self.port, self._sock, self._held = sock.getsockname()[1], sock, []
            self.stop = self._close
            threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self.accepted += 1
            self._held.append(conn)
            if self.kind == "stalling":
                try:
                    conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an empty SETTINGS frame
                except OSError:
                    pass

    def _close(self) -> None:
        self._sock.close()
        for conn in self._held:
            conn.close()


@pytest.mark.parametrize("kind", ["http", pytest.param("silent", marks=pytest.mark.slow)])  # silent: 16 s of timeout
def test_an_address_where_something_else_answers_is_one_line_and_exit_2_within_bounded_time(tmp_path, kind):
    """A web server (the dashboard's port, say) or a port that accepts and says nothing: ``ray.init`` would retry
    for minutes; the check sees no gRPC and refuses at once (``silent``: after CONNECT_SECONDS)."""
    listener = Listener(kind)
    try:
        t0 = time.monotonic()
        proc = run_main(tmp_path, "--ray-address", f"127.0.0.1:{listener.port}")
        assert time.monotonic() - t0 < 60
    finally:
        listener.stop()
    assert proc.returncode == 2, proc.stderr
    assert f"--ray-address 127.0.0.1:{listener.port}: something answers there, but not as a Ray head" in proc.stderr
    assert TRACEBACK not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "m").exists()


def test_the_grpc_check_passes_a_grpc_server_and_is_left_out_with_tls(monkeypatch):
    from multinode.run import RayConnectError, check_reachable
    grpc_server, web = Listener("grpc"), Listener("http")
    try:
        check_reachable(f"127.0.0.1:{grpc_server.port}", timeout=10)  # a Ray head's control store is a gRPC server
        with pytest.raises(RayConnectError, match="not as a Ray head"):
            check_reachable(f"127.0.0.1:{web.port}", timeout=10)
        monkeypatch.setenv("RAY_USE_TLS", "1")  # gRPC over TLS: the plain-text preface would get no answer
        check_reachable(f"127.0.0.1:{web.port}", timeout=10)
    finally:
        grpc_server.stop()
        web.stop()


# slow (14 s each): the watch that ends a stuck start-up is tested in the default suite by test_lifeline.py's
# test_a_stop_signal_during_a_stuck_start_up_ends_the_driver_and_its_processes, on a start-up stuck on purpose
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_while_ray_init_retries_ends_the_driver_in_one_line(tmp_path, sig):
    """A server that passes the check (it answers as gRPC does) but never answers a call: ``ray.init`` waits and
    retries for minutes. One stop signal ends the driver within START_GRACE_SECONDS, in one line (after Ray's
    own warnings), nothing written, nothing left."""
    from multinode.run import START_GRACE_SECONDS
    listener = Listener("stalling")
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "--ray-address", f"127.0.0.1:{listener.port}",
                                 "--save-model-dir", str(tmp_path / "m"), "--log-dir", str(tmp_path / "l")],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None and listener.accepted < 2:
                time.sleep(0.1)  # the check's connection, then ray.init's
            pause(3.0)  # inside ray.init's retries
            assert proc.poll() is None and time.monotonic() < deadline, "ray.init never connected to the server"
            t0 = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=START_GRACE_SECONDS + 30)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        listener.stop()
    assert proc.returncode == 128 + int(sig), err
    assert took < START_GRACE_SECONDS + 20
    name = "interrupted (Ctrl-C)" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert f"main.py: {name} while connecting to Ray at 127.0.0.1:{listener.port}" in err, err
    ours = [line for line in err.strip().splitlines() if "main.py" in line]
    assert TRACEBACK not in err and len(ours) == 1 and err.strip().endswith(ours[0]), err
    assert not (tmp_path / "m").exists()


def test_gpu_ids_of_a_local_cluster_are_checked_on_this_machine(tmp_path):
    """A ``local`` cluster's GPUs are this machine's: --gpu-ids is checked as on one machine (one line, exit 2);
    on a remote cluster only -1 mixed with GPU ids can be told here."""
    from config import validate_gpu_ids
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; tests/test_gpu.py covers a local cluster on a GPU")
    proc = run_main(tmp_path, "--ray-address", "local", "--gpu-ids", "0", "--workers", "1")
    assert proc.returncode == 2, proc.stderr
    assert "--gpu-ids 0: CUDA is not available on this machine" in proc.stderr, proc.stderr
    assert TRACEBACK not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m").exists()
    assert validate_gpu_ids([0], machine=False) == []
    assert validate_gpu_ids([-1, 0], machine=False) == ["--gpu-ids: do not mix -1 (CPU) with GPU ids [-1, 0]"]


def test_a_clusters_processes_are_the_drivers_only_when_they_started_after_it():
    """guard.session_processes: a session name ends with the pid of the process that started the cluster. A
    ``ray start`` that exited left its pid free for a driver, whose clean-up must not kill that cluster: a process
    created before ``since`` (the driver's creation) is not the driver's."""
    from multinode.guard import session_processes
    fake_pid = 4_000_000 + os.getpid()  # beyond pid_max: no process is the starter of this made-up session
    code = "import time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, f"--session-name=session_2026_{fake_pid}"])
    try:
        deadline = time.monotonic() + 30
        while not session_processes(fake_pid, 0.0) and time.monotonic() < deadline:
            time.sleep(0.05)
        created = psutil.Process(proc.pid).create_time()
        assert [p.pid for p in session_processes(fake_pid, created)] == [proc.pid]
        assert session_processes(fake_pid, created + 1.0) == []  # a driver created after it: not its cluster
    finally:
        proc.kill()
        proc.wait()


def test_a_node_that_rejoins_after_the_parameter_server_restarted_is_logged_as_rejoined():
    """The driver counts each node's starts itself: a restarted parameter server counts joins from 0 again, and a
    node that then restarts (its first join there) is still a rejoin."""
    from config import build_parser
    from multinode.run import RayRun
    args = build_parser().parse_args(["--ray-address", "local", "--nodes", "2", "--workers", "1"])
    lines: list[str] = []

    class Log:
        def info(self, line):
            lines.append(line)
    run = RayRun(args, torch.nn.Linear(1, 1), None, Log(), ray_module=object())

    def status(started, steps, *joins):
        return {"started": started, "global_steps": steps, "time": 0.0,
                "nodes": [{"joins": j, "steps": 0, "last_sync": None, "stats": None} for j in joins]}
    run._server_answered(status(1.0, 0, 1, 1), 0.0)  # both nodes' first starts
    assert not [ln for ln in lines if "rejoined" in ln]
    run._server_answered(status(1.0, 100, 2, 1), 1.0)  # node 0 killed and restarted
    assert [ln for ln in lines if "rejoined" in ln] == ["node 0 rejoined (start 2) from the global weights at 100 "
                                                          "global steps"]
    run._server_answered(status(2.0, 80, 0, 0), 2.0)  # the server restarted from its checkpoint: joins from 0
    run._server_answered(status(2.0, 90, 0, 1), 3.0)  # then node 1 restarted: the new server's first join
    assert [ln for ln in lines if "rejoined" in ln][1:] == ["node 1 rejoined (start 2) from the global weights at "
                                                            "90 global steps"]


def test_a_parameter_server_that_never_comes_back_ends_the_run():
    """A server whose restart fails leaves every status call unanswered: no node syncs and the global step count
    stands still, so a run bounded by --max-steps alone went on for ever (the driver only logged it). After
    NODE_START_SECONDS without an answer the run fails, as for a node that does not come back."""
    from config import build_parser
    from multinode.run import NODE_START_SECONDS, SERVER_LATE_SECONDS, Poll, RayRun
    args = build_parser().parse_args(["--ray-address", "local", "--nodes", "1", "--workers", "1"])
    lines: list[str] = []

    class Log:
        def info(self, line):
            lines.append(line)

    class NeverReady:  # Ray's wait on a call to an actor that is gone for good
        def wait(self, refs, timeout=0):
            return [], refs

    class Silent:
        def __getattr__(self, name):
            return type("M", (), {"remote": staticmethod(lambda *a: object())})()
    run = RayRun(args, torch.nn.Linear(1, 1), None, Log(), ray_module=NeverReady())
    run.ps, run._ps_status = Silent(), {"started": 1.0, "global_steps": 100, "nodes": []}
    run._polls = {"status": Poll(NeverReady()), "weights": Poll(NeverReady())}
    t = 1000.0
    run.tick(t)
    run.tick(t + SERVER_LATE_SECONDS + 1)
    assert lines == ["the parameter server does not answer; Ray restarts it if it died (from the last checkpoint)"]
    run.tick(t + NODE_START_SECONDS - 1)
    assert run.failed is None
    run.tick(t + NODE_START_SECONDS + 2)
    assert run.failed == (f"the parameter server has not answered for {NODE_START_SECONDS:.0f} s (Ray did not bring "
                          f"it back): without it no node syncs and the global step count stands still")


def test_without_ray_address_ray_is_never_imported(tmp_path):
    code = ("import sys, main\n"
            f"rc = main.main(['--env', 'PongNoFrameskip-v4', '--workers', '1', '--hidden-size', '32', '--max-steps',"
            f" '40', '--save-model-dir', {str(tmp_path / 'm')!r}, '--log-dir', {str(tmp_path / 'l')!r}])\n"
            "print('exit', rc, 'ray imported:', 'ray' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert "exit 0 ray imported: False" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


# ------------------------------------------------------------------------------------- real local clusters
def ray_args(tmp_path, *extra: str) -> list[str]:
    """Two nodes of one worker on a local cluster, tiny model, syncing every second; no budget unless added."""
    return train_args(tmp_path, "--ray-address", "local", "--nodes", "2", "--workers", "1", "--sync-seconds", "1",
                      "--checkpoint-every-seconds", "5", "--status-every-seconds", "2", *extra)


def node_steps(run, node: int) -> int:
    """The last status line's steps/s of ``node`` (0 if none yet)."""
    rates = re.findall(rf"node {node} (\d+) steps/s", run.stdout())
    return int(rates[-1]) if rates else 0


def ray_processes(run) -> list[psutil.Process]:
    return [p for p in run.processes() if any(k in title(p) for k in ("ray", "raylet", "gcs_server", "a3g"))]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_killed_node_rejoins_the_run_goes_on_and_ctrl_c_leaves_nothing(launch, tmp_path):
    """Two nodes; kill -9 node 0's actor process once it trains: Ray restarts it, it rejoins from the global
    weights (the checkpoint after its rejoined node's first pushes is the one before them plus a little training,
    not a fresh initialisation) and trains again while node 1 goes on; then Ctrl-C (SIGINT to the run's process
    group, as a terminal sends it) stops everything: exit 130, no process of the run and no Ray process left,
    loadable checkpoint and .dat written by the parameter server; a single-machine run resumes from them (a
    multi-node resume: the slow test below)."""
    from checkpoint import read_weights
    path = models_dir(tmp_path) / CKPT

    def saved_after(t: float, what: str, condition=lambda ckpt: True) -> dict:
        """The first checkpoint written after ``t`` (time.time()) that meets ``condition``."""
        def get():
            if path.stat().st_mtime <= t:
                return None
            ckpt = read_weights(path)
            return ckpt if condition(ckpt) else None
        return run.poll_until(get, 120, what)

    run = launch(ray_args(tmp_path))
    pid = int(run.wait_for_output(r"node 0: pid (\d+) on", RAY_START_SECONDS).group(1))
    other = psutil.Process(int(run.wait_for_output(r"node 1: pid (\d+) on", RAY_START_SECONDS).group(1)))
    run.poll_until(lambda: node_steps(run, 0) > 0, RAY_START_SECONDS, "node 0 training")
    old_epoch = saved_after(time.time(), "a checkpoint of node 0's pushes")["ray_push_seqs"][0][0]
    # Both nodes are paused (SIGSTOP) before the kill, and node 1 stays paused until the rejoined node's pushes are
    # in a checkpoint: from the pause on, the global weights are those the rejoined node must start from (a checkpoint
    # written after the pause holds them, whenever Ray restarts the node), and what moves them then is its training.
    other.suspend()
    try:
        psutil.Process(pid).suspend()
        time.sleep(1.0)  # pushes already sent land
        before = saved_after(time.time(), "a checkpoint with both nodes paused")
        epoch, seq = before["ray_push_seqs"][0]
        assert epoch == old_epoch, "node 0 was restarted before it was killed"
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        run.wait_for_output(r"node 0 lost|node 0 rejoined", 60)
        run.wait_for_output(r"node 0 rejoined \(start 2\) from the global weights at [\d,]+ global steps", 120)
        new_pid = int(run.wait_for_output(rf"node 0: pid (?!{pid}\b)(\d+) on", 120).group(1))
        assert new_pid != pid
        after = saved_after(killed, "a checkpoint with the rejoined node's trained steps",  # its first pushes
                            lambda c: c["ray_push_seqs"][0][0] > old_epoch  # may come before it trained
                            and c["global_steps"] > before["global_steps"])
    finally:
        other.resume()
    # Trained on from the global weights, the rejoined node moved them by its few seconds of training (sum merge);
    # from a fresh initialisation, its first push would have carried the whole difference (about 1.4 times them).
    assert after["global_steps"] > before["global_steps"], "the rejoined node's steps were not counted"
    moved = sum(float((after["model"][k] - before["model"][k]).double().norm()) ** 2 for k in before["model"]) ** 0.5
    size = sum(float(v.double().norm()) ** 2 for v in before["model"].values()) ** 0.5
    assert 0 < moved < 0.5 * size, (f"the rejoined node moved the global weights by {moved / size:.2f} of their "
                                    f"norm: it did not train from them")
    mark = len(run.stdout())
    run.poll_until(lambda: re.search(r"node 0 [1-9]\d* steps/s", run.stdout()[mark:]), 120,
                   "node 0 training again after its restart")
    assert run.proc.poll() is None
    fault = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    check_end(run, fault, {130}, end_seconds=RAY_END_SECONDS)
    assert not ray_processes(run)
    out = run.stdout()
    assert "stopped: interrupted (Ctrl-C)" in out and "did not stop cleanly" not in out, run.tail()
    saved = load_saved(models_dir(tmp_path))
    ckpt = saved[CKPT]
    assert ckpt["global_steps"] > 0 and ckpt["optimizer"] is not None and "ray_run_id" in ckpt
    assert set(saved) == {CKPT, "PongNoFrameskip-v4.dat"}
    # a single-machine run continues from the checkpoint the parameter server wrote
    assert resume_run(launch, tmp_path) is not None


def kill_driver(run, what: str) -> None:
    """``kill -9`` of the run's driver once Ray's agents run (they outlived a killed driver by a minute); no
    process of the run may be left ``END_SECONDS`` later."""
    agents = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
    run.poll_until(lambda: all(any(a in title(p) for p in run.processes()) for a in agents), RAY_START_SECONDS,
                   "Ray's agents")
    assert run.proc.poll() is None, f"the driver ended before it was killed{run.tail()}"
    fault = time.monotonic()
    run.proc.kill()
    run.proc.wait(timeout=10)
    run.exit_time = time.monotonic()
    left = run.leftovers(fault + END_SECONDS)
    assert not left, (f"{describe(left)} outlived the driver, killed {what}, by {END_SECONDS:.0f} s"
                      f"{run.tail()}")


DRIVER = """
import os, sys, time
sys.path.insert(0, {root!r})
from config import build_parser
from multinode.run import connect
ray = connect(build_parser().parse_args(["--ray-address", "local", "--nodes", "1", "--workers", "1"]))


@ray.remote
class Pid:
    def pid(self):
        return os.getpid()


print("actor", ray.get(Pid.remote().pid.remote()), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_nothing_of_a_local_cluster_outlives_a_killed_driver(launch, tmp_path):
    """A driver that started a ``local`` cluster (``multinode.run.connect``) and an actor, killed with SIGKILL."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT)))
    run = launch([], script=str(script))
    run.wait_for_output(r"actor \d+", RAY_START_SECONDS)
    kill_driver(run, "once its actor answered")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nothing_of_a_ray_run_outlives_its_killed_driver(launch, tmp_path):
    """Two nodes training, then ``kill -9`` of ``main.py``: the nodes, their workers, the parameter server, the
    monitor and every process of Ray are gone within ``END_SECONDS``; the last checkpoint loads."""
    run = launch(ray_args(tmp_path))
    run.poll_until(lambda: node_steps(run, 0) > 0 and node_steps(run, 1) > 0, RAY_START_SECONDS, "both nodes training")
    kill_driver(run, "while both nodes trained")
    assert CKPT in load_saved(models_dir(tmp_path))  # the parameter server writes one as it begins


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_ray_run_stops_at_its_budget_and_a_ray_run_continues_from_its_checkpoint(launch, tmp_path):
    """A two-node run to a step budget exits 0 with nothing left; ``--load`` continues it to a larger budget
    (every node's last sync counted) from the parameter server's checkpoint."""
    first = launch(ray_args(tmp_path, "--max-steps", "300"))
    code = first.wait_exit(time.monotonic() + RAY_START_SECONDS + 120)
    assert code == 0, f"exit {code}{first.tail()}"
    assert not first.leftovers(time.monotonic() + 5), describe(first.processes())
    steps = load_saved(models_dir(tmp_path))[CKPT]["global_steps"]
    assert steps >= 300
    again = launch(ray_args(tmp_path, "--load", "--max-steps", str(steps + 200)), name="ray-resume")
    code = again.wait_exit(time.monotonic() + RAY_START_SECONDS + 120)
    assert code == 0, f"exit {code}{again.tail()}"
    assert not again.leftovers(time.monotonic() + 5), describe(again.processes())
    assert f"at {steps:,} global steps" in again.stdout()
    assert load_saved(models_dir(tmp_path))[CKPT]["global_steps"] >= steps + 200
    assert not ray_processes(again)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_parameter_server_comes_back_from_the_last_checkpoint(launch, tmp_path):
    """``kill -9`` of the parameter server: Ray restarts it from the last checkpoint the killed one wrote, at that
    checkpoint's step count and weights exactly (what was trained since that checkpoint is lost, nothing more),
    and the run's step count goes on up from there. Both nodes are paused (SIGSTOP) from just before the kill until
    the restarted server has written a checkpoint, so that no push moves its state before the test reads it."""
    from checkpoint import read_weights
    path = models_dir(tmp_path) / CKPT
    run = launch(ray_args(tmp_path))
    pids = [int(run.wait_for_output(rf"node {i}: pid (\d+) on", RAY_START_SECONDS).group(1)) for i in range(2)]
    run.poll_until(lambda: node_steps(run, 0) > 0 and node_steps(run, 1) > 0, RAY_START_SECONDS, "both nodes training")
    time.sleep(6)  # a checkpoint with steps in it (every 5 s)
    ps = run.poll_until(lambda: next((p for p in run.processes() if "ParameterServer" in title(p)), None), 30,
                        "the parameter server's process")
    nodes = [psutil.Process(pid) for pid in pids]
    for p in nodes:
        p.suspend()
    try:
        time.sleep(1.0)  # a push already sent lands (and is lost with the server) or dies with it
        ps.kill()
        ps.wait(timeout=10)
        killed = time.time()
        last = read_weights(path)  # the last checkpoint of the killed server: a restart must come back from it
        assert last["global_steps"] > 0
        run.wait_for_output(r"the parameter server (died|does not answer)", 60)
        back = run.wait_for_output(r"the parameter server is back after \d+ s, from .*\.ckpt, at ([\d,]+) global "
                                   r"steps", 120)
        assert int(back.group(1).replace(",", "")) == last["global_steps"], (
            f"the restarted server counts {back.group(1)} global steps, its checkpoint {last['global_steps']:,}")
        run.poll_until(lambda: path.stat().st_mtime > killed, 60, "a checkpoint of the restarted server")
        first = read_weights(path)
    finally:
        for p in nodes:
            p.resume()
    assert first["global_steps"] == last["global_steps"]
    changed = [k for k in last["model"] if not torch.equal(first["model"][k], last["model"][k])]
    assert not changed, f"the restarted server's weights are not its checkpoint's: {changed}"
    mark = len(run.stdout())
    run.poll_until(lambda: re.search(r"steps [\d,]+ \([1-9]\d* steps/s\)", run.stdout()[mark:]), 120,
                   "training going on after the server came back")
    fault = time.monotonic()
    os.kill(run.proc.pid, signal.SIGTERM)  # to the driver: the stop is its to make (the group case: below)
    check_end(run, fault, {143}, end_seconds=RAY_END_SECONDS)
    assert "did not write the final checkpoint" not in run.stdout(), run.tail()
    assert not ray_processes(run)
    final = load_saved(models_dir(tmp_path))[CKPT]
    assert final["global_steps"] > last["global_steps"], "the run's steps did not go on from the checkpoint's"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("moment", ["connecting", "actors starting", "random"])
def test_a_signal_during_start_up_stops_the_run_and_leaves_nothing(launch, tmp_path, moment):
    run = launch(ray_args(tmp_path))
    if moment == "connecting":
        run.poll_until(lambda: any("gcs_server" in title(p) for p in run.processes()), RAY_START_SECONDS,
                       "Ray starting", period=0.05)
    elif moment == "actors starting":
        run.wait_for_output(r"training PongNoFrameskip-v4", RAY_START_SECONDS)
    else:
        pause(random.uniform(0.5, 25.0))
    sig = random.choice([signal.SIGINT, signal.SIGTERM])
    fault = time.monotonic()
    os.killpg(run.proc.pid, sig)  # as a terminal or a batch system sends it: Ray's processes get it too
    # A SIGTERM to the group also ends the parameter server's process, so a run that had started may be unable
    # to write its final checkpoint: exit 1, saying so, with the last complete checkpoint kept (it loads below).
    codes = {128 + int(sig), 1} if sig == signal.SIGTERM else {128 + int(sig)}
    check_end(run, fault, codes, stopped=False, end_seconds=RAY_END_SECONDS)
    if run.proc.returncode == 1:
        out = run.stdout()
        assert "did not write the final checkpoint" in out and "the last complete one is kept" in out, run.tail()
    assert not ray_processes(run)
    load_saved(models_dir(tmp_path), may_be_empty=True)  # a signal while connecting comes before any write


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_worker_that_dies_inside_a_node_ends_the_run(launch, tmp_path):
    """As on one machine: a training process that dies is a failure of the run (exit 1), reported by name."""
    run = launch(ray_args(tmp_path))
    run.poll_until(lambda: node_steps(run, 1) > 0, RAY_START_SECONDS, "node 1 training")
    # node 0's worker may still be starting when node 1 reports its first steps (a busy machine)
    run.poll_until(lambda: len([p for p in run.processes() if "a3g worker" in title(p)]) == 2, RAY_START_SECONDS,
                   "both nodes' workers")
    workers = [p for p in run.processes() if "a3g worker" in title(p)]
    assert len(workers) == 2, describe(workers)
    fault = time.monotonic()
    workers[0].kill()
    check_end(run, fault, {1}, end_seconds=RAY_END_SECONDS)
    assert re.search(r"stopped: node \d: worker 0 exited unexpectedly \(exit code -9\)", run.stdout()), run.tail()
    assert not ray_processes(run)
    assert CKPT in load_saved(models_dir(tmp_path))  # the parameter server wrote the final checkpoint


def test_the_first_status_line_gives_each_nodes_steps_not_a_rate_of_zero():
    """With no earlier parameter-server report there is no rate to take: the first status line says each node's
    steps so far and logs no per-node rate (it said '0 steps/s' for nodes that had stepped); the next line gives
    each node's rate over the time between the two reports."""
    from types import SimpleNamespace
    from multinode.run import RayRun

    def report(t, steps):
        return {"time": t, "nodes": [{"steps": s, "last_sync": t - 0.5, "stats": None} for s in steps]}

    mode = SimpleNamespace(run=SimpleNamespace(global_steps=SimpleNamespace(value=7_878)), _status_prev=None,
                           _ps_status=report(100.0, [3_900, 3_978]))
    line, scalars = RayRun.status(mode, 131.0, 60.0)
    assert line == ("steps 7,878 (131 steps/s) | node 0 3,900 steps, synced 0.5 s ago | node 1 3,978 steps, "
                    "synced 0.5 s ago"), line
    assert scalars == {"charts/train_steps_per_s": 131.0}
    mode._ps_status = report(110.0, [5_100, 5_178])
    line, scalars = RayRun.status(mode, 240.0, 10.0)
    assert "node 0 120 steps/s, synced 0.5 s ago | node 1 120 steps/s" in line, line
    assert scalars["nodes/node0_steps_per_s"] == scalars["nodes/node1_steps_per_s"] == 120.0

"""Multi-node overhead and scale: a single-machine run against the same cores as Ray nodes, in one run.

    python benchmarks/multinode.py --workers 2 --rounds 2 --json runs/multinode.json

Needs Ray (``pip install -r requirements-ray.txt``). On this machine, in alternated rounds (so that a slow spell of
a shared machine hits every configuration), each with the monitor at its default cadence:

1. a single-machine run, ``main.py --workers W`` (the real training processes, as ``benchmark.py`` counts them);
2. one Ray node of W workers (``main.py --ray-address local --nodes 1 --workers W``);
3. W Ray nodes of one worker each (``--nodes W --workers 1``);

agent steps/s over the same window after the same warm-up (the nodes' own step counters, read together), and
the ratios to the single-machine run (medians over the rounds). Also measured: the parameter server's CPU time
per sync (its process's user+system time over the window, over the syncs it served: applying a change plus
Ray's (de)serialisation of the change and the weights) and a node's wall time per sync (copy, round trip,
rebase). Then the scale table on paper: nodes of ``--scale-workers`` workers at the measured per-worker rate,
the model's size, ``--sync-seconds`` and a parameter-server link of ``--ps-gbit`` (``multinode.merge.scale_row``).

The training processes write into a temporary folder, deleted at the end.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import psutil  # noqa: E402
import torch  # noqa: E402

from benchmark import machine, training_steps_per_s  # noqa: E402
from config import build_parser  # noqa: E402
from environment import num_actions  # noqa: E402
from model import A3Clstm  # noqa: E402
from multinode.merge import max_nodes, scale_row, weight_bytes  # noqa: E402

SCALE_NODES = (1, 2, 4, 8, 16, 32, 64)


def run_args(opts: argparse.Namespace, out_dir: Path, nodes: int | None, workers: int) -> argparse.Namespace:
    flags = ["--env", opts.env, "--workers", str(workers), "--max-steps", "0", "--log-dir", str(out_dir),
             "--save-model-dir", str(out_dir), "--sync-seconds", str(opts.sync_seconds)]
    if nodes is not None:
        flags += ["--ray-address", "local", "--nodes", str(nodes)]
    args = build_parser().parse_args(flags)
    out_dir.mkdir(parents=True, exist_ok=True)
    args.env_config = str(ROOT / "config.json")
    return args


def ray_training_steps_per_s(args: argparse.Namespace, ray, warmup: float, window: float) -> dict:
    """Run the real multi-node mode (``multinode.run.RayRun``, as ``main.py --ray-address`` drives it) on the
    connected cluster and count the nodes' agent steps over ``window`` seconds."""
    from a3g.run import shutdown
    from multinode.run import RayRun

    log = logging.getLogger("benchmark.ray")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    shared = A3Clstm(1, num_actions(args.env), args.hidden_size)
    shared.share_memory()
    mode = RayRun(args, shared, None, log, ray)
    procs = []
    try:
        procs = mode.launch(mp.get_context("spawn"))

        def health() -> list[dict]:
            return ray.get([n.health.remote() for n in mode.nodes], timeout=60)

        deadline = time.perf_counter() + 600
        while sum(h["steps"] for h in health()) == 0:
            if time.perf_counter() > deadline:
                raise RuntimeError("the nodes did not start stepping")
            time.sleep(0.5)
        end = time.perf_counter() + warmup
        while time.perf_counter() < end:
            mode.tick(time.time())
            time.sleep(0.2)
        ps = psutil.Process(ray.get(mode.ps.pid.remote()))
        h0, st0, cpu0, t0 = health(), ray.get(mode.ps.status.remote()), ps.cpu_times(), time.perf_counter()
        end = t0 + window
        while time.perf_counter() < end:
            mode.tick(time.time())
            time.sleep(0.2)
        h1, st1, cpu1, t1 = health(), ray.get(mode.ps.status.remote()), ps.cpu_times(), time.perf_counter()
        dead = [f"node {i} {role}" for i, h in enumerate(h1) for role, _ in h["dead"]]
    finally:
        shutdown(procs, mode.run, slot_of=mode.slot_of)
        mode.close()
        mode.release(disconnect=False)
    if dead or any(a["pid"] != b["pid"] for a, b in zip(h0, h1)):
        raise RuntimeError(f"a node or worker died during the benchmark: {dead}")
    steps = sum(b["steps"] - a["steps"] for a, b in zip(h0, h1))
    syncs = sum(b["syncs"] - a["syncs"] for a, b in zip(h0, h1))
    pushes = st1["pushes"] - st0["pushes"]
    ps_cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return {"steps_per_s": steps / (t1 - t0), "steps": steps, "seconds": t1 - t0,
            "node_steps_per_s": [(b["steps"] - a["steps"]) / (t1 - t0) for a, b in zip(h0, h1)],
            "syncs": syncs, "node_seconds_per_sync": sum(b["sync_seconds"] - a["sync_seconds"]
                                                         for a, b in zip(h0, h1)) / max(syncs, 1),
            "ps_pushes": pushes, "ps_cpu_seconds_per_sync": ps_cpu / max(pushes, 1),
            "ps_apply_seconds_per_sync": (st1["busy_seconds"] - st0["busy_seconds"]) / max(pushes, 1)}


def benchmark_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--workers", type=int, default=2, help="W: the cores the three configurations share")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of the three configurations")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of training before counting")
    p.add_argument("--window", type=float, default=60.0, help="seconds of training counted")
    p.add_argument("--sync-seconds", type=float, default=5.0, help="the nodes' --sync-seconds")
    p.add_argument("--scale-workers", type=int, default=16, help="workers per node in the scale table")
    p.add_argument("--ps-gbit", type=float, default=10.0, help="the parameter server's link in the scale table")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def check_options(opts: argparse.Namespace) -> list[str]:
    """Every problem with the flags, each as one phrase, found before Ray starts or anything is measured (a zero
    --sync-seconds had every node sync in a busy loop for the whole measurement, then a division by zero)."""
    import math
    from benchmark import env_and_json_problems
    from config import MAX_SYNC_SECONDS
    checks = [("workers", opts.workers >= 1, ">= 1"), ("rounds", opts.rounds >= 1, ">= 1"),
              ("warmup", math.isfinite(opts.warmup) and opts.warmup >= 0, "a finite number of seconds >= 0"),
              ("window", math.isfinite(opts.window) and opts.window > 0, "a finite number of seconds > 0"),
              ("sync_seconds", 0 < opts.sync_seconds <= MAX_SYNC_SECONDS, f"> 0 and at most {MAX_SYNC_SECONDS:,}"),
              ("scale_workers", opts.scale_workers >= 1, ">= 1"),
              ("ps_gbit", math.isfinite(opts.ps_gbit) and opts.ps_gbit > 0, "a finite number > 0")]
    problems = [f"--{name.replace('_', '-')} must be {bound}, got {getattr(opts, name)}"
                for name, ok, bound in checks if not ok]
    return problems + env_and_json_problems(opts)


def main(argv=None) -> int:
    opts = benchmark_parser().parse_args(argv)
    problems = check_options(opts)
    if problems:
        for problem in problems:
            print(f"multinode.py: error: {problem}", file=sys.stderr)
        return 2
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit("multinode.py: error: needs Ray: pip install -r requirements-ray.txt") from None
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="a3g-multinode-benchmark-") as tmp:
        return run(opts, Path(tmp))


def run(opts: argparse.Namespace, out_dir: Path) -> int:
    from multinode.run import connect
    w = opts.workers
    configs = {"single": (None, w), "ray_1_node": (1, w), "ray_nodes": (w, 1)}
    labels = {"single": f"single machine, --workers {w}", "ray_1_node": f"Ray, 1 node x {w} workers",
              "ray_nodes": f"Ray, {w} nodes x 1 worker"}
    res = {"machine": machine(), "env": opts.env, "workers": w, "sync_seconds": opts.sync_seconds,
           "rounds": {k: [] for k in configs}}
    print(f"machine: {res['machine']}", flush=True)
    ray = connect(run_args(opts, out_dir, w, 1))  # one local cluster for every Ray measurement
    try:
        for r in range(opts.rounds):
            for key, (nodes, workers) in configs.items():
                args = run_args(opts, out_dir / f"{key}-{r}", nodes, workers)
                if nodes is None:
                    m = training_steps_per_s(args, opts.warmup, opts.window)
                    m = {k: m[k] for k in ("steps_per_s", "steps", "seconds")}
                else:
                    m = ray_training_steps_per_s(args, ray, opts.warmup, opts.window)
                res["rounds"][key].append(m)
                print(f"round {r + 1}: {labels[key]}: {m['steps_per_s']:.0f} steps/s", flush=True)
    finally:
        ray.shutdown()
    med = {k: statistics.median(m["steps_per_s"] for m in v) for k, v in res["rounds"].items()}
    res["steps_per_s"] = med
    res["ratios"] = {"ray_1_node_over_single": med["ray_1_node"] / med["single"],
                     "ray_nodes_over_single": med["ray_nodes"] / med["single"]}
    ray_rounds = res["rounds"]["ray_1_node"] + res["rounds"]["ray_nodes"]
    ps_sync = statistics.median(m["ps_cpu_seconds_per_sync"] for m in ray_rounds)
    res["ps_cpu_seconds_per_sync"] = ps_sync
    res["ps_apply_seconds_per_sync"] = statistics.median(m["ps_apply_seconds_per_sync"] for m in ray_rounds)
    res["node_seconds_per_sync"] = statistics.median(m["node_seconds_per_sync"] for m in ray_rounds)
    print(f"medians over {opts.rounds} round(s): " + ", ".join(f"{labels[k]} {v:.0f}" for k, v in med.items())
          + " steps/s", flush=True)
    print(f"Ray 1 node / single machine: {res['ratios']['ray_1_node_over_single']:.3f}; Ray {w} nodes / single "
          f"machine: {res['ratios']['ray_nodes_over_single']:.3f}", flush=True)
    print(f"per sync: parameter server CPU {ps_sync * 1e3:.1f} ms (of which applying the change "
          f"{res['ps_apply_seconds_per_sync'] * 1e3:.1f} ms); a node's sync {res['node_seconds_per_sync'] * 1e3:.0f}"
          f" ms of wall time", flush=True)

    model_bytes = weight_bytes(A3Clstm(1, num_actions(opts.env), 512).state_dict())
    per_worker = med["single"] / w
    node_rate = per_worker * opts.scale_workers
    link = opts.ps_gbit * 1e9 / 8
    res["scale"] = {"model_bytes": model_bytes, "per_worker_steps_per_s": per_worker, "node_steps_per_s": node_rate,
                    "ps_bytes_per_s": link,
                    "rows": [scale_row(n, node_rate, model_bytes, opts.sync_seconds, link, ps_sync)
                             for n in SCALE_NODES],
                    "max_nodes": max_nodes(model_bytes, opts.sync_seconds, link, ps_sync)}
    print(f"scale on paper: nodes of {opts.scale_workers} workers at {per_worker:.0f} steps/s each (measured "
          f"here), model {model_bytes / 1e6:.1f} MB, --sync-seconds {opts.sync_seconds:g}, a {opts.ps_gbit:g} "
          f"Gbit/s link at the parameter server, {ps_sync * 1e3:.1f} ms of its CPU per sync", flush=True)
    print("nodes | steps/s | PS traffic MB/s | PS link load | PS CPU load | effective sync s", flush=True)
    for row in res["scale"]["rows"]:
        print(f"{row['nodes']:5d} | {row['steps_per_s']:7.0f} | {row['ps_traffic_bytes_per_s'] / 1e6:15.0f} | "
              f"{row['ps_net_load']:12.2f} | {row['ps_cpu_load']:11.2f} | {row['effective_sync_seconds']:.1f}"
              + (" (saturated)" if row["saturated"] else ""), flush=True)
    print(f"one parameter server serves up to {res['scale']['max_nodes']} nodes without a queue", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

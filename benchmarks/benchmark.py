"""Throughput benchmark: environment-only, training, and the model's step costs, measured in one run.

    python benchmarks/benchmark.py --workers 2 --window 60 --json bench.json

Prints, in one run on this machine:
1. environment-only agent steps/s with N processes (the training preprocessing, random actions);
2. training agent steps/s of the real training processes (N workers + the monitor at its default cadence),
   counted over a fixed window after a warm-up, and each process's resident memory; with ``--gpu-ids``, also
   each GPU's utilisation (mean over the window) and each process's GPU memory, read with ``nvidia-smi``;
3. the plain reference step cost: NCHW model, batch 1, one thread, a forward with gradients per step, the A3C
   loss, one backward per 20 steps, no environment (upstream's way of doing it);
   3. and 4. each run in a fresh process; 3. is also timed with this project's allocator setting;
4. this project's model costs on one thread: the acting forward (no gradient) and the update (batched replay
   plus backward) per agent step;
5. plain training: upstream's worker loop (the plain model and step above, with the environment, the sampled
   actions, a state_dict copy per rollout and the shared Adam) in N processes, over the same window;
6. the ratios: training / environment, training / (N x plain reference rate), training / plain training, and
   the plain reference step cost / this model's step cost;
7. GA3C mode (``main.py --mode ga3c``: the server's predictor and trainer threads, the agents, the monitor) over
   the same warm-up and window, with its flags from ``--ga3c-flags``: steps/s, trained steps/s, updates/s, the
   policy lag, and GA3C / A3G; each mode runs at main.py's default precision for it (A3G fp32, GA3C auto, so
   GA3C / A3G is the README's first command against ``--mode a3g``) unless ``--precision`` names one for both;
8. the fraction of the machine's compute roof each mode reaches: model FLOPs per training step (acting forward,
   training forward and backward, counted by torch's FLOP counter) x steps/s, over this core's single-thread
   fp32 matrix-multiply rate x the cores.
Runs vary by 15-25% on shared machines: compare the ratios within one run.

The training processes write their logs, CSV and model (the monitor's ``<env>.dat``) to ``--out-dir``; by default
that is a temporary folder, deleted at the end, so a benchmark leaves nothing behind.

Exit codes: 0 done; 2 bad input (one line on stderr, found before anything is measured or written); 130 Ctrl-C
(one line; the measuring processes are stopped).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lifeline  # noqa: E402

if __name__ == "__main__":  # before the seconds of heavy imports: a Ctrl-C there is one line and exit 130
    lifeline.quit_on_interrupt("benchmark.py")
if __name__ == "__mp_main__":  # a spawned child of this script: dies with it, leaves Ctrl-C to it (lifeline.py)
    lifeline.bind_to_parent()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from cli import Parser, validate_dir, validate_file  # noqa: E402
from config import build_parser, validate_gpu_ids  # noqa: E402
from environment import EnvIdError, atari_env, load_env_config, resolve_env_id  # noqa: E402
import precision  # noqa: E402
from losses import a3c_loss  # noqa: E402
from model import A3Clstm  # noqa: E402
from run_state import RunState  # noqa: E402
from shared_optim import make_optimizer  # noqa: E402
from utils import keep_freed_memory  # noqa: E402


def _env_worker(env_id: str, config: str, seconds: float, seed: int, out) -> None:
    torch.set_num_threads(1)
    env = atari_env(env_id, load_env_config(config, env_id), episodic_life=True)
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    n_actions = env.action_space.n
    for _ in range(200):  # warm-up
        if any(env.step(int(rng.integers(n_actions)))[2:4]):
            env.reset()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _, _, terminated, truncated, _ = env.step(int(rng.integers(n_actions)))
        steps += 1
        if terminated or truncated:
            env.reset()
    out.put(steps / (time.perf_counter() - t0))


def env_steps_per_s(env_id: str, config: str, processes: int, seconds: float) -> float:
    """Agent steps/s of ``processes`` environment processes stepping together."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_env_worker, args=(env_id, config, seconds, i, out)) for i in range(processes)]
    try:
        for p in procs:
            lifeline.start_child(p)
        rates = [out.get(timeout=seconds + 120) for _ in procs]
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    finally:
        for p in procs:
            if p.pid is not None:
                p.join()
    return float(sum(rates))


class BenchmarkFailed(RuntimeError):
    """A mode's processes did not start stepping or died: the first line says which, the rest is what each
    failed process reported (``run.errors``: on a GPU, the CUDA error)."""


def failure(what: str, run: RunState) -> BenchmarkFailed:
    """``BenchmarkFailed`` for ``what``, with every report the run's processes left."""
    reports = "".join(f"\n{role} failed:\n{text.rstrip()}" for role, text in run.errors.read_all())
    return BenchmarkFailed(what + reports)


def _wait_for_first_steps(count, procs, timeout: float = 300.0) -> None:
    """Wait until the processes have started stepping (process start-up is not part of the warm-up)."""
    deadline = time.perf_counter() + timeout
    while count() == 0:
        if time.perf_counter() > deadline or not all(p.is_alive() for p in procs):
            raise RuntimeError("the training processes did not start stepping")
        time.sleep(0.2)


def parse_gpu_sample(gpus_csv: str, apps_csv: str, roles_by_pid: dict[int, str]) -> dict:
    """Parse ``nvidia-smi --query-gpu=index,utilization.gpu,memory.used`` and
    ``--query-compute-apps=pid,used_memory`` (both ``--format=csv,noheader,nounits``) into
    ``{"gpus": {index: {"util_pct", "memory_mib"}}, "process_memory_mib": {role: MiB}}``; processes that are not
    ours are left out."""
    gpus, procs = {}, {}
    for line in gpus_csv.strip().splitlines():
        index, util, mem = (f.strip() for f in line.split(","))
        gpus[int(index)] = {"util_pct": float(util), "memory_mib": float(mem)}
    for line in apps_csv.strip().splitlines():
        pid, mem = (f.strip() for f in line.split(","))
        role = roles_by_pid.get(int(pid))
        if role is not None:
            procs[role] = procs.get(role, 0.0) + float(mem)
    return {"gpus": gpus, "process_memory_mib": procs}


def gpu_sample(roles_by_pid: dict[int, str]) -> dict | None:
    """One ``nvidia-smi`` reading (see ``parse_gpu_sample``); None where there is no working ``nvidia-smi``, or
    where it gives a field that is not a number (``[N/A]`` under MIG, ``[Insufficient Permissions]``)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out = []
    for query in ("--query-gpu=index,utilization.gpu,memory.used", "--query-compute-apps=pid,used_memory"):
        try:
            r = subprocess.run([exe, query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                               timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode != 0:
            return None
        out.append(r.stdout)
    try:
        return parse_gpu_sample(out[0], out[1], roles_by_pid)
    except ValueError:  # a field that is not a number, or a line of another shape
        return None


def summarize_gpu_samples(samples: list[dict]) -> dict | None:
    """Mean utilisation and peak memory per GPU, and peak GPU memory per process, over the window's samples."""
    if not samples:
        return None
    gpus = {}
    for index in samples[0]["gpus"]:
        readings = [s["gpus"][index] for s in samples if index in s["gpus"]]
        gpus[index] = {"util_pct_mean": statistics.fmean(r["util_pct"] for r in readings),
                       "memory_mib_max": max(r["memory_mib"] for r in readings)}
    roles = sorted({role for s in samples for role in s["process_memory_mib"]})
    procs = {role: max(s["process_memory_mib"].get(role, 0.0) for s in samples) for role in roles}
    return {"samples": len(samples), "gpus": gpus, "process_memory_mib_max": procs}


def training_steps_per_s(args: argparse.Namespace, warmup: float, window: float) -> dict:
    """Run the real training processes (as main.py does) and count global steps over ``window`` seconds."""
    from environment import num_actions
    from a3g.run import launch, shutdown

    ctx = mp.get_context("spawn")
    shared = A3Clstm(1, num_actions(args.env), args.hidden_size)
    shared.share_memory()
    optimizer = make_optimizer(args.optimizer, shared.parameters(), args.lr, args.amsgrad, shared=True,
                               eps=args.optimizer_eps)
    run = RunState(args.workers, args.score_window)
    procs = launch(ctx, args, shared, optimizer, run)
    try:
        try:
            _wait_for_first_steps(lambda: run.global_steps.value, [p for _, p in procs])
        except RuntimeError as e:
            raise failure(str(e), run) from None
        time.sleep(warmup)
        s0, t0 = run.global_steps.value, time.perf_counter()
        rss, gpu = [], []
        on_gpu = any(g >= 0 for g in args.gpu_ids)
        roles_by_pid = {p.pid: role for role, p in procs}
        deadline = t0 + window
        while time.perf_counter() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.perf_counter())))
            rss.append({role: psutil.Process(p.pid).memory_info().rss / 2 ** 20 for role, p in procs if p.is_alive()})
            sample = gpu_sample(roles_by_pid) if on_gpu else None
            if sample is not None:
                gpu.append(sample)
        s1, t1 = run.global_steps.value, time.perf_counter()
        dead = [role for role, p in procs if not p.is_alive()]
    finally:
        shutdown(procs, run)
    if dead:
        raise failure(f"{', '.join(dead)} died during the benchmark", run)
    return {"steps_per_s": (s1 - s0) / (t1 - t0), "steps": s1 - s0, "seconds": t1 - t0,
            "rss_mib_start": rss[0], "rss_mib_end": rss[-1], "gpu": summarize_gpu_samples(gpu)}


def ga3c_training_steps_per_s(args: argparse.Namespace, warmup: float, window: float) -> dict:
    """Run the real GA3C processes (as ``main.py --mode ga3c`` does: the server, the agents and the monitor) and
    count global steps, updates and trained transitions over ``window`` seconds."""
    import logging

    from environment import num_actions
    from ga3c.run import Ga3cRun
    from a3g.run import shutdown

    ctx = mp.get_context("spawn")
    shared = A3Clstm(1, num_actions(args.env), args.hidden_size)
    shared.share_memory()
    optimizer = make_optimizer(args.optimizer, shared.parameters(), args.lr, args.amsgrad, shared=True,
                               eps=args.optimizer_eps)
    log = logging.getLogger("benchmark.ga3c")
    log.propagate = False
    dynamic_events: list[str] = []  # --dynamic's decisions, as main.py would log them

    class Collect(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("[dynamic] "):
                dynamic_events.append(f"{time.perf_counter() - started:.0f} s: {msg[len('[dynamic] '):]}")

    log.handlers[:] = [Collect()]
    log.setLevel(logging.INFO)
    started = time.perf_counter()
    mode = Ga3cRun(args, shared, optimizer, log)
    if args.ema_steps:  # as main.py's start_average: the trainers blend it after every batch, a cost measured too
        from averaging import make_average
        mode.average_model = make_average(shared)
    run = mode.run
    procs = mode.launch(ctx)
    try:
        try:
            _wait_for_first_steps(lambda: mode.counters.version, [p for _, p in procs])
        except RuntimeError as e:
            raise failure(str(e), run) from None
        deadline = time.perf_counter() + warmup
        while time.perf_counter() < deadline:
            mode.tick(time.time())
            time.sleep(0.2)
        s0, u0, n0, t0 = run.global_steps.value, mode.counters.version, mode.trained_steps(), time.perf_counter()
        lag0 = mode.counters.lag_hist.sum(0).clone()
        rss, gpu = [], []
        on_gpu = any(g >= 0 for g in args.gpu_ids)
        deadline = t0 + window
        while time.perf_counter() < deadline:
            for _ in range(25):
                mode.tick(time.time())
                time.sleep(min(0.2, max(0.0, deadline - time.perf_counter())))
            rss.append({role: psutil.Process(p.pid).memory_info().rss / 2 ** 20 for role, p in procs if p.is_alive()})
            sample = gpu_sample({p.pid: role for role, p in procs}) if on_gpu else None  # procs grows (--dynamic)
            if sample is not None:
                gpu.append(sample)
        s1, u1, n1, t1 = run.global_steps.value, mode.counters.version, mode.trained_steps(), time.perf_counter()
        lag_mean, lag_max, _ = mode.counters.lag_summary(lag0)
        counts_end = [int(v) for v in mode.counters.active.tolist()]  # NT, NP, NA running at the end
        # agents that --dynamic retired exit 0 on purpose (procs grows as it starts new ones)
        dead = [role for role, p in procs if not p.is_alive() and not mode.expected_exit(role, p, False)]
    finally:
        shutdown(procs, run, slot_of=mode.slot_of)
        mode.close()
    if dead:
        raise failure(f"{', '.join(dead)} died during the benchmark", run)
    return {"steps_per_s": (s1 - s0) / (t1 - t0), "steps": s1 - s0, "seconds": t1 - t0,
            "updates_per_s": (u1 - u0) / (t1 - t0), "trained_steps_per_s": (n1 - n0) / (t1 - t0),
            "policy_lag_mean": lag_mean, "policy_lag_max": lag_max, "counts_end": counts_end,
            "dynamic_events": dynamic_events, "rss_mib_start": rss[0], "rss_mib_end": rss[-1],
            "gpu": summarize_gpu_samples(gpu)}


def model_flops_per_step(num_steps: int = 20, hidden_size: int = 512) -> dict:
    """Model FLOPs of one training agent step (torch's FLOP counter: matrix products and convolutions): the
    acting forward (batch 1), and the training forward and backward over a rollout, per step. Both modes are
    charged all three, whatever they skip (A3G's update replays the saved conv activations): this is the work
    the algorithm needs, so the fraction of the compute roof compares the modes' throughput fairly. The training
    pass is counted over the rollout stepped one frame at a time: the same products as ``unroll``, whose fused
    LSTM (``torch.lstm``) the counter does not see into (it counted the LSTM's 6.3 MFLOP a step forward and 12.6
    backward as 0)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = A3Clstm(1, 6, hidden_size)
    frames = torch.randn(num_steps, 1, 80, 80)
    state = model.initial_state()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(frames[:1], state)
    act = fc.get_total_flops()
    outputs = []
    with FlopCounterMode(display=False) as fc:
        for t in range(num_steps):
            value, logits, state = model(frames[t: t + 1], state)
            outputs.append(value.sum() + logits.sum())
    fwd = fc.get_total_flops() / num_steps
    with FlopCounterMode(display=False) as fc:
        torch.stack(outputs).sum().backward()
    bwd = fc.get_total_flops() / num_steps
    return {"acting_forward": act, "training_forward": fwd, "training_backward": bwd, "total": act + fwd + bwd}


def matmul_gflops(size: int = 1024, repeats: int = 10, rounds: int = 3) -> float:
    """This core's single-thread fp32 matrix-multiply rate (the best of ``rounds``), GFLOP/s."""
    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * size ** 3 * repeats / (time.perf_counter() - t) / 1e9)
    return best


def _plain_worker(env_id: str, config: str, shared: A3Clstm, optimizer, rank: int, counter, stop) -> None:
    """Upstream's worker loop, plainly: load the shared state_dict, then per step a batch-1 NCHW forward with
    gradients, a sampled action and an environment step; every 20 steps the A3C loss, one backward, the
    gradients copied to the shared model and the shared optimizer's step. Default allocator."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    env = atari_env(env_id, load_env_config(config, env_id), episodic_life=True)
    model = A3Clstm(1, env.action_space.n)
    obs, _ = env.reset(seed=rank)
    hx, cx = model.initial_state()
    while not stop.is_set():
        model.load_state_dict(shared.state_dict())
        hx, cx = hx.detach(), cx.detach()
        values, logits, actions, rewards = [], [], [], []
        done = False
        for _ in range(20):
            v, lg, (hx, cx) = model(torch.from_numpy(obs).unsqueeze(0), (hx, cx))
            action = int(torch.multinomial(F.softmax(lg, dim=1), 1))
            obs, reward, terminated, truncated, _ = env.step(action)
            values.append(v.view(1))
            logits.append(lg)
            actions.append(action)
            rewards.append(max(-1.0, min(1.0, float(reward))))
            done = terminated or truncated
            if done:
                break
        bootstrap = 0.0
        if not done:
            with torch.no_grad():
                bootstrap = float(model(torch.from_numpy(obs).unsqueeze(0), (hx, cx))[0])
        loss = a3c_loss(torch.cat(logits), torch.cat(values), torch.tensor(actions), torch.tensor(rewards),
                        bootstrap, gamma=0.99, tau=1.0, entropy_coef=0.01, value_coef=0.5)
        model.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
        for lp, sp in zip(model.parameters(), shared.parameters()):
            sp.grad = lp.grad
        optimizer.step()
        with counter.get_lock():
            counter.value += len(actions)
        if done:
            obs, _ = env.reset()
            hx, cx = model.initial_state()


def plain_training_steps_per_s(env_id: str, config: str, processes: int, warmup: float, window: float) -> float:
    """Agent steps/s of ``processes`` plain workers (``_plain_worker``) training one shared model with the
    shared Adam, counted over ``window`` seconds after ``warmup``: what upstream's design gives on this machine."""
    from environment import num_actions

    ctx = mp.get_context("spawn")
    shared = A3Clstm(1, num_actions(env_id))
    shared.share_memory()
    optimizer = make_optimizer("Adam", shared.parameters(), 1e-4, True, shared=True)
    counter, stop = ctx.Value("q", 0), ctx.Event()
    procs = [ctx.Process(target=_plain_worker, args=(env_id, config, shared, optimizer, i, counter, stop),
                         daemon=True) for i in range(processes)]
    try:
        for p in procs:
            lifeline.start_child(p)
        _wait_for_first_steps(lambda: counter.value, procs)
        time.sleep(warmup)
        s0, t0 = counter.value, time.perf_counter()
        time.sleep(window)
        steps, seconds = counter.value - s0, time.perf_counter() - t0
        if not all(p.is_alive() for p in procs):
            raise RuntimeError("a plain worker died during the benchmark")
    finally:
        stop.set()
        for p in procs:
            if p.pid is None:  # not started
                continue
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return steps / seconds


def _timeit(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def plain_step_ms(rollouts: int, num_steps: int = 20) -> float:
    """Upstream's step cost without the environment: NCHW, batch 1, forward with grad per step, loss, one backward
    per ``num_steps`` steps (ms per agent step, one thread)."""
    torch.manual_seed(0)
    model = A3Clstm(1, 6)
    frames = torch.randn(num_steps, 1, 1, 80, 80)
    actions = torch.randint(0, 6, (num_steps,))
    rewards = torch.zeros(num_steps)

    def rollout():
        hx, cx = model.initial_state()
        values, logits = [], []
        for t in range(num_steps):
            v, lg, (hx, cx) = model(frames[t], (hx, cx))
            values.append(v.view(1))
            logits.append(lg)
        loss = a3c_loss(torch.cat(logits), torch.cat(values), actions, rewards, 0.0, gamma=0.99, tau=1.0,
                        entropy_coef=0.01, value_coef=0.5)
        model.zero_grad(set_to_none=True)
        loss.total.backward()

    return _timeit(rollout, rollouts) / num_steps * 1000


def our_step_ms(rollouts: int, num_steps: int = 20, precision: str = "fp32") -> dict:
    """This project's costs per agent step (one thread) in ``precision``: the acting forward (no gradient, saving
    the conv activations) and the update (replay from the saved activations, LSTM over the rollout, backward),
    and one shared optimizer step (amortised over the rollout)."""
    from model import ActivationCache
    from precision import compute_dtype
    from shared_optim import SharedAdam

    torch.manual_seed(0)
    model = A3Clstm(1, 6).channels_last().set_precision(compute_dtype(precision))
    frames = torch.randn(num_steps, 1, 80, 80)
    actions = torch.randint(0, 6, (num_steps,))
    rewards = torch.zeros(num_steps)
    state = model.initial_state()
    box = {}

    @torch.no_grad()
    def act():
        cache = ActivationCache()
        hx, cx = state
        for t in range(num_steps):
            _, _, (hx, cx) = model(frames[t: t + 1], (hx, cx), cache)
        box["cache"] = cache

    def update():
        values, logits = model.unroll(frames, state, box["cache"])
        loss = a3c_loss(logits, values, actions, rewards, 0.0, gamma=0.99, tau=1.0, entropy_coef=0.01,
                        value_coef=0.5)
        model.zero_grad(set_to_none=True)
        loss.total.backward()

    forward = _timeit(act, rollouts) / num_steps * 1000
    upd = _timeit(update, rollouts) / num_steps * 1000
    shared = A3Clstm(1, 6)
    shared.share_memory()
    opt = SharedAdam(shared.parameters(), lr=1e-4)
    for p in shared.parameters():
        p.grad = torch.randn_like(p)
    step = _timeit(opt.step, rollouts) / num_steps * 1000
    return {"forward_ms": forward, "update_ms": upd, "optimizer_ms": step, "total_ms": forward + upd + step}


def _measure_child(name: str, rollouts: int, keep_freed: bool, out, kwargs: dict) -> None:
    torch.set_num_threads(1)
    if keep_freed:
        keep_freed_memory()
    out.put(globals()[name](rollouts, **kwargs))


def measure_isolated(name: str, rollouts: int, *, keep_freed: bool, **kwargs):
    """Run ``plain_step_ms`` or ``our_step_ms`` (with ``kwargs``) in a fresh process, so that neither sees the
    other's heap; ``keep_freed`` applies the allocator setting the training processes use
    (``utils.keep_freed_memory``)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_measure_child, args=(name, rollouts, keep_freed, out, kwargs))
    try:
        lifeline.start_child(proc)
        return out.get(timeout=1800)
    except BaseException:  # an error or Ctrl-C: the measurement is not waited for
        if proc.is_alive():
            proc.kill()
        raise
    finally:
        if proc.pid is not None:
            proc.join()


def machine() -> dict:
    import ale_py
    import cv2
    import gymnasium
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2 ** 30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "gymnasium": gymnasium.__version__,
            "ale_py": ale_py.__version__, "opencv": cv2.__version__, "numpy": np.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu_bf16_flags": sorted(precision.cpu_flags() & set(precision.CPU_BF16_FLAGS)),
            "native_bf16": precision.cpu_has_native_bf16()}


def benchmark_parser() -> argparse.ArgumentParser:
    p = Parser(prog="benchmark.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--gpu-ids", type=int, nargs="+", default=[-1])
    p.add_argument("--warmup", type=float, default=20.0,
                   help="seconds of training, after the first steps, before counting")
    p.add_argument("--window", type=float, default=60.0, help="seconds of training counted")
    p.add_argument("--env-seconds", type=float, default=15.0, help="seconds of environment-only stepping")
    p.add_argument("--rollouts", type=int, default=20, help="rollouts timed for the model step costs")
    p.add_argument("--repeats", type=int, default=3, help="alternated rounds of the step-cost timings (their median; the lower middle one of an even count)")
    p.add_argument("--ga3c-flags", default="",
                   help="main.py flags for the GA3C-mode measurement, in one string (default: main.py's GA3C "
                        "defaults), e.g. \"--agents 2 --envs-per-agent 8 --train-batch 4\"")
    p.add_argument("--no-ga3c", dest="ga3c", action="store_false", help="skip the GA3C-mode measurement")
    p.add_argument("--modes-only", action="store_true",
                   help="measure only the two modes' training (A3G, GA3C) and the compute roof: no step costs, "
                        "environment-only or plain-training parts")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "auto"],
                   help="A3G mode's precision and this model's step costs; GA3C mode's too unless --ga3c-flags "
                        "gives its own --precision (default: each mode at main.py's default, fp32 in A3G mode "
                        "and for the step costs, auto in GA3C mode)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--out-dir", default=None,
                   help="folder for the training processes' logs, CSV and model (default: a temporary folder, "
                        "deleted at the end)")
    return p


def env_id_problem(env_id: str) -> str | None:
    """``--env``'s problem (an id ale-py cannot make; the message names close ids), or None."""
    try:
        resolve_env_id(env_id)
    except EnvIdError as e:
        return f"--env: {e}"
    return None


class FlagsError(ValueError):
    """``--ga3c-flags`` that main.py's parser refuses; the message is its error."""


def env_and_json_problems(opts: argparse.Namespace) -> list[str]:
    """An ``--env`` that ale-py cannot make, and a ``--json`` that cannot be written (the benchmarks' common
    flags)."""
    problem = env_id_problem(opts.env)
    return ([problem] if problem else []) + (validate_file(opts.json, "--json") if opts.json is not None else [])


def _size_problems(opts: argparse.Namespace) -> list[str]:
    """The counts and durations that the measurement needs in range (a zero window measured nothing, no worker
    never starts stepping)."""
    problems = []
    for name in ("warmup", "window", "env_seconds"):
        if not math.isfinite(getattr(opts, name)):
            problems.append(f"--{name.replace('_', '-')} must be a finite number of seconds, got {getattr(opts, name)}")
    checks = [("workers", opts.workers >= 1, ">= 1"), ("warmup", opts.warmup >= 0, ">= 0 seconds"),
              ("window", opts.window > 0, "> 0 seconds"), ("env_seconds", opts.env_seconds > 0, "> 0 seconds"),
              ("rollouts", opts.rollouts >= 1, ">= 1"), ("repeats", opts.repeats >= 1, ">= 1")]
    problems += [f"--{name.replace('_', '-')} must be {bound}, got {getattr(opts, name)}"
                 for name, ok, bound in checks if not ok and math.isfinite(getattr(opts, name))]
    return problems


def check_options(opts: argparse.Namespace) -> list[str]:
    """Every problem with the benchmark's flags, each as one phrase (empty when all is well): found before
    anything is measured or written, so that a typo never waits for minutes of measurement."""
    problems = _size_problems(opts)
    problem = env_id_problem(opts.env)
    if problem:
        problems.append(problem)
    problems += validate_gpu_ids(opts.gpu_ids)
    if opts.json is not None:
        problems += validate_file(opts.json, "--json")
    if opts.out_dir is not None:
        problems += validate_dir(opts.out_dir, "--out-dir")
    if problems:
        return problems
    out_dir = Path(opts.out_dir) if opts.out_dir is not None else Path(tempfile.gettempdir()) / "a3g-benchmark"
    from config import validate, validate_precision
    problems += validate_precision(a3g_args(opts, out_dir))
    if problems or not opts.ga3c:
        return problems
    try:
        gargs = ga3c_args(opts, out_dir / "ga3c")
    except FlagsError as e:
        return [f"--ga3c-flags: {e}"]
    if gargs.mode != "ga3c":
        return [f"--ga3c-flags: --mode {gargs.mode}: the GA3C measurement runs GA3C mode; leave --mode out"]
    plain = ga3c_args(argparse.Namespace(**{**vars(opts), "ga3c_flags": ""}), out_dir / "ga3c")
    if gargs.env != plain.env:
        return [f"--ga3c-flags: --env {gargs.env}: both modes play the benchmark's own --env ({opts.env}); give "
                f"--env to benchmark.py instead"]
    if gargs.env_config != plain.env_config:
        return ["--ga3c-flags: --env-config: both modes use the repository's config.json; leave it out"]
    gargs.env_config = str(ROOT / "config.json")
    ga3c_problems = [e for e in validate(gargs) if "save-model-dir" not in e]
    return [f"--ga3c-flags: {'; '.join(ga3c_problems)}"] if ga3c_problems else []


def end_children() -> None:
    """Kill the processes this one started and has not stopped yet (after a Ctrl-C: the training processes are
    stopped by their own ``finally``, a measurement in a fresh process is not waited for)."""
    children = mp.active_children()
    for p in children:
        p.kill()
    for p in children:
        p.join(10)


def main(argv=None) -> int:
    try:
        opts = benchmark_parser().parse_args(argv)
        problems = check_options(opts)
        if problems:
            print("benchmark.py: error: " + "; ".join(problems), file=sys.stderr)
            return 2
        if opts.out_dir is not None:
            return run(opts, Path(opts.out_dir))
        with tempfile.TemporaryDirectory(prefix="a3g-benchmark-") as tmp:
            return run(opts, Path(tmp))
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the clean-up below is bounded; let it finish
        end_children()
        print("benchmark.py: interrupted", file=sys.stderr, flush=True)
        return 130


def precision_flag(name: str | None) -> list[str]:
    """``["--precision", name]``, or nothing when ``name`` is None so that main.py's default for the mode holds."""
    return [] if name is None else ["--precision", name]


def a3g_args(opts: argparse.Namespace, out_dir: Path) -> argparse.Namespace:
    """main.py's arguments for the A3G-mode measurement: its defaults (``--precision fp32`` among them), then
    ``--workers``, ``--gpu-ids`` and ``--precision`` when given."""
    return build_parser().parse_args(["--env", opts.env, "--mode", "a3g", "--workers", str(opts.workers),
                                      "--max-steps", "0", *precision_flag(opts.precision),
                                      "--gpu-ids", *map(str, opts.gpu_ids),
                                      "--log-dir", str(out_dir), "--save-model-dir", str(out_dir)])


def ga3c_args(opts: argparse.Namespace, out_dir: Path) -> argparse.Namespace:
    """main.py's arguments for the GA3C-mode measurement: its defaults (``--precision auto`` among them), then
    ``--precision`` when given, then ``--ga3c-flags``, whose own ``--precision`` wins. Raises ``FlagsError`` with
    main.py's parser's message when it refuses ``--ga3c-flags``."""
    import shlex
    try:
        flags = shlex.split(opts.ga3c_flags)
    except ValueError as e:  # an unclosed quote
        raise FlagsError(f"{e}: {opts.ga3c_flags!r}") from None
    parser = build_parser()

    def refuse(message):
        raise FlagsError(message)

    parser.error = refuse  # main.py's "main.py: error: ..." and exit, as this benchmark's error instead
    return parser.parse_args(["--env", opts.env, "--mode", "ga3c", "--max-steps", "0",
                              *precision_flag(opts.precision), "--gpu-ids", *map(str, opts.gpu_ids),
                              "--log-dir", str(out_dir), "--save-model-dir", str(out_dir), *flags])


def median_rounds(rounds: dict[str, list]) -> tuple[float, float, dict]:
    """The median of each kind of step-cost round: ``plain`` and ``plain_keep_freed`` (ms), and ``ours`` (a record
    of parts, taken whole by its ``total_ms``). Of an even count, the lower middle one of each, so that no kind is
    taken from a higher rank than another (a ratio of them is then not biased)."""
    middle = (len(rounds["ours"]) - 1) // 2
    return (sorted(rounds["plain"])[middle], sorted(rounds["plain_keep_freed"])[middle],
            sorted(rounds["ours"], key=lambda r: r["total_ms"])[middle])


def base_costs(opts: argparse.Namespace, args: argparse.Namespace, res: dict) -> None:
    """Parts 1, 3, 4 and 5: the step costs, the environment alone, upstream's plain training."""
    rounds = {"plain": [], "plain_keep_freed": [], "ours": []}
    for _ in range(opts.repeats):  # alternated, so that a slow spell of a shared machine hits all three
        rounds["plain"].append(measure_isolated("plain_step_ms", opts.rollouts, keep_freed=False))
        rounds["plain_keep_freed"].append(measure_isolated("plain_step_ms", opts.rollouts, keep_freed=True))
        rounds["ours"].append(measure_isolated("our_step_ms", opts.rollouts, keep_freed=True,
                                               precision=args.compute_precision))
    res["step_cost_rounds"] = rounds
    res["plain_step_ms"], res["plain_keep_freed_step_ms"], res["ours"] = median_rounds(rounds)
    print(f"step costs: the median of {opts.repeats} alternated rounds, each in fresh processes", flush=True)
    print(f"plain reference step (NCHW, batch 1, grad per step, 1 thread): {res['plain_step_ms']:.2f} ms", flush=True)
    print(f"  the same with this project's allocator setting: {res['plain_keep_freed_step_ms']:.2f} ms", flush=True)
    o = res["ours"]
    print(f"this model per step (1 thread, {args.compute_precision}): forward {o['forward_ms']:.2f} ms + update {o['update_ms']:.2f} ms "
          f"+ optimizer {o['optimizer_ms']:.2f} ms = {o['total_ms']:.2f} ms", flush=True)
    res["env_steps_per_s"] = env_steps_per_s(opts.env, args.env_config, opts.workers, opts.env_seconds)
    print(f"environment only, {opts.workers} processes: {res['env_steps_per_s']:.0f} steps/s", flush=True)
    res["plain_training_steps_per_s"] = plain_training_steps_per_s(opts.env, args.env_config, opts.workers,
                                                                   opts.warmup, opts.window)
    print(f"plain training (upstream's worker loop), {opts.workers} workers: "
          f"{res['plain_training_steps_per_s']:.0f} steps/s", flush=True)


def run(opts: argparse.Namespace, out_dir: Path) -> int:
    """The whole benchmark (see the module docstring); the training processes write into ``out_dir``."""
    torch.set_num_threads(1)
    lifeline.mark_children()  # every child started from here on dies with this process and leaves Ctrl-C to it
    args = a3g_args(opts, out_dir)
    args.env_config = str(ROOT / "config.json")
    from config import precision_warnings, validate_precision
    problems = validate_precision(args)
    if problems:
        raise SystemExit("benchmark.py: error: " + "; ".join(problems))
    for line in precision_warnings(args):
        print(f"benchmark.py: {line}", file=sys.stderr, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)

    res = {"machine": machine(), "env": opts.env, "workers": opts.workers, "gpu_ids": opts.gpu_ids,
           "precision": args.compute_precision}
    print(f"machine: {res['machine']}", flush=True)
    if not opts.modes_only:
        base_costs(opts, args, res)
    try:
        res["training"] = training_steps_per_s(args, opts.warmup, opts.window)
    except BenchmarkFailed as e:
        return mode_failed(opts, res, "training", e)
    tr = res["training"]
    print(f"training ({args.compute_precision}), {opts.workers} workers + monitor: {tr['steps_per_s']:.0f} steps/s "
          f"({tr['steps']} steps in {tr['seconds']:.0f} s)", flush=True)
    if tr["steps"] == 0:  # nothing to divide by below
        print(f"benchmark.py: error: no A3G training step was counted in the --window of {opts.window:g} s (a "
              f"worker counts its steps when a rollout ends): give a longer --window", file=sys.stderr, flush=True)
        return 2
    print("resident memory MiB (start -> end of window): " + ", ".join(
        f"{k} {tr['rss_mib_start'][k]:.0f} -> {tr['rss_mib_end'].get(k, float('nan')):.0f}"
        for k in tr["rss_mib_start"]), flush=True)
    if tr["gpu"] is not None:
        g = tr["gpu"]
        print("GPU over the window (nvidia-smi, every 5 s): " + ", ".join(
            f"GPU {i} utilisation {v['util_pct_mean']:.0f}%, memory {v['memory_mib_max']:.0f} MiB"
            for i, v in g["gpus"].items()) + "; per process MiB: " + ", ".join(
            f"{k} {v:.0f}" for k, v in g["process_memory_mib_max"].items()), flush=True)
    elif any(i >= 0 for i in opts.gpu_ids):
        print("GPU utilisation and memory: not read (no working nvidia-smi)", flush=True)
    res["model_mflop_per_step"] = {k: v / 1e6 for k, v in model_flops_per_step(hidden_size=args.hidden_size).items()}
    flop = res["model_mflop_per_step"]["total"] * 1e6
    on_gpu = any(i >= 0 for i in opts.gpu_ids)
    print(f"model per training step: acting forward {res['model_mflop_per_step']['acting_forward']:.0f} + "
          f"training forward {res['model_mflop_per_step']['training_forward']:.0f} + backward "
          f"{res['model_mflop_per_step']['training_backward']:.0f} = {flop / 1e6:.0f} MFLOP", flush=True)
    if on_gpu:  # the CPU's matmul rate says nothing about a GPU's: no roof fractions (None in the JSON)
        res["matmul_gflops_1_thread"] = res["roof_fraction_a3g"] = None
        print("compute roof: not measured on a GPU run (it is the CPU's fp32 matmul rate x its cores)", flush=True)
    else:
        res["matmul_gflops_1_thread"] = matmul_gflops()
        roof = res["matmul_gflops_1_thread"] * (os.cpu_count() or 1)
        res["roof_fraction_a3g"] = tr["steps_per_s"] * flop / (roof * 1e9)
        print(f"fp32 matmul {res['matmul_gflops_1_thread']:.1f} GFLOP/s per thread x {os.cpu_count()} cores (the "
              f"compute roof; bf16 can pass it); A3G mode: {res['roof_fraction_a3g']:.2f} of it", flush=True)
    write_json(opts, res)  # A3G mode's figures kept whatever happens to GA3C mode's measurement
    if opts.ga3c:
        gargs = ga3c_args(opts, out_dir / "ga3c")
        gargs.env_config = args.env_config
        from config import validate
        problems = [e for e in validate(gargs) if "save-model-dir" not in e]
        if problems:
            raise SystemExit("benchmark.py: error: --ga3c-flags: " + "; ".join(problems))
        try:
            g = res["ga3c"] = ga3c_training_steps_per_s(gargs, opts.warmup, opts.window)
        except BenchmarkFailed as e:
            return mode_failed(opts, res, "ga3c", e)
        g["flags"] = {k: getattr(gargs, k) for k in ("agents", "envs_per_agent", "predictors", "trainers",
                                                     "predict_batch", "train_batch", "queue_size", "num_steps",
                                                     "dynamic", "compute_precision", "replay_activations",
                                                     "train_passes", "later_passes", "hidden_size",
                                                     "ema_steps")}
        # its own model's FLOPs (--ga3c-flags may give another --hidden-size; the ratio then compares two models)
        g["model_mflop_per_step"] = (res["model_mflop_per_step"] if gargs.hidden_size == args.hidden_size else
                                     {k: v / 1e6 for k, v in model_flops_per_step(
                                         hidden_size=gargs.hidden_size).items()})
        res["roof_fraction_ga3c"] = (None if on_gpu else
                                     g["steps_per_s"] * g["model_mflop_per_step"]["total"] * 1e6 / (roof * 1e9))
        res["ga3c_over_a3g"] = g["steps_per_s"] / tr["steps_per_s"]
        print(f"GA3C mode ({' '.join(f'{k}={v}' for k, v in g['flags'].items())}) + monitor: "
              f"{g['steps_per_s']:.0f} steps/s, {g['trained_steps_per_s']:.0f} trained steps/s, "
              f"{g['updates_per_s']:.1f} updates/s, policy lag mean {g['policy_lag_mean']:.2f} max "
              f"{g['policy_lag_max']}; "
              + ("" if on_gpu else f"{res['roof_fraction_ga3c']:.2f} of the fp32 compute roof; ")
              + f"GA3C / A3G {res['ga3c_over_a3g']:.2f}x", flush=True)
        for event in g["dynamic_events"]:
            print(f"  --dynamic at {event}", flush=True)
        if gargs.dynamic:
            print("  --dynamic ran NT {} NP {} NA {} at the end".format(*g["counts_end"]), flush=True)
        print("GA3C resident memory MiB (start -> end of window): " + ", ".join(
            f"{k} {g['rss_mib_start'][k]:.0f} -> {g['rss_mib_end'].get(k, float('nan')):.0f}"
            for k in g["rss_mib_start"]), flush=True)
    if not opts.modes_only:
        o = res["ours"]
        plain_rate = opts.workers * 1000.0 / res["plain_step_ms"]
        res["ratios"] = {
            "training_over_env": tr["steps_per_s"] / res["env_steps_per_s"],
            "training_over_plain": tr["steps_per_s"] / plain_rate,
            "training_over_plain_training": tr["steps_per_s"] / res["plain_training_steps_per_s"],
            "plain_over_ours_step_cost": res["plain_step_ms"] / o["total_ms"],
            "plain_keep_freed_over_ours_step_cost": res["plain_keep_freed_step_ms"] / o["total_ms"],
        }
        r = res["ratios"]
        print(f"ratios: training / environment {r['training_over_env']:.3f}; training / ({opts.workers} x plain "
              f"rate {plain_rate:.0f}) {r['training_over_plain']:.2f}x; training / plain training "
              f"{r['training_over_plain_training']:.2f}x; plain / our model step cost "
              f"{r['plain_over_ours_step_cost']:.2f}x (plain with the allocator setting: "
              f"{r['plain_keep_freed_over_ours_step_cost']:.2f}x)", flush=True)
    if opts.json:
        write_json(opts, res)
        print(f"wrote {opts.json}")
    return 0


def write_json(opts, res: dict) -> None:
    """``res`` to ``--json`` (where given), whole: written after each mode, so that a mode that fails or a run
    cut short keeps what was measured before."""
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(opts.json).with_name(Path(opts.json).name + ".tmp")
        tmp.write_text(json.dumps(res, indent=2) + "\n")
        os.replace(tmp, opts.json)


def mode_failed(opts, res: dict, key: str, e: BenchmarkFailed) -> int:
    """A mode whose processes failed: ``res[key]`` says so (``error``: the first line; ``reports``: what the
    processes reported), the JSON keeps what was measured before, the reports go to stderr; exit code 1."""
    first, _, reports = str(e).partition("\n")
    res[key] = {"error": first, "reports": reports}
    write_json(opts, res)
    print(f"benchmark.py: error: {'A3G' if key == 'training' else 'GA3C'} mode: {first}" + (f"\n{reports}" if reports
                                                                                            else ""),
          file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    lifeline.unwind_on_interrupt()  # the imports are done: the ``finally`` blocks stop the children
    sys.exit(main())

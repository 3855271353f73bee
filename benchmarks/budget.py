"""The cost of one training agent step in each mode, piece by piece, on one thread, and the speed it allows.

    python benchmarks/budget.py --json budget.json

A training agent step costs the same pieces in both modes, done differently:

- the environment step (ALE, frame skip and preprocessing), the same in both;
- the acting forward, saving the conv activations: an A3G worker runs it for one frame (batch 1), a GA3C
  predictor for every waiting env at once (batch ``--envs``, up to ``--predict-batch`` in a run);
- the update: the conv blocks' backward from the saved activations, the LSTM over the rollout, the loss and
  backward (an A3G worker: one rollout of ``--num-steps`` frames; a GA3C trainer: ``--train-batch`` segments
  at once, through ``Trainer.update``, the call the server makes), and the shared optimizer's step.

Each piece is timed here alone on one thread (the median of ``--repeats`` rounds), in one run, so the two modes
are compared on the same machine at the same moment. Their sum is the single-thread cost of a step; a mode
cannot train faster than ``cores x 1000 / cost`` steps/s, whatever its processes and threads do, so the ratio of
the two ceilings bounds what GA3C mode can gain over A3G mode on this CPU. ``benchmark.py`` measures the real
runs; the measured rate over the ceiling is how well a mode keeps the cores busy with its own work.

Also timed: the first conv block's backward in one piece against pieces of ``model.FIRST_BLOCK_CHUNK`` frames.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import model as model_module  # noqa: E402
from benchmark import machine, matmul_gflops, model_flops_per_step, our_step_ms  # noqa: E402
from config import build_parser  # noqa: E402
from ga3c.segment import ACT_FIELDS, Segment, activation_rows, cat_rows  # noqa: E402
from ga3c.settings import Ga3cSettings  # noqa: E402
from ga3c.trainer import Trainer  # noqa: E402
from model import A3Clstm, ActivationCache  # noqa: E402
from shared_optim import make_optimizer  # noqa: E402
from utils import keep_freed_memory  # noqa: E402


def env_step_ms(env_id: str, config: str, steps: int) -> float:
    """One training environment step (random actions), ms."""
    from ga3c.agent import AtariEnvFactory
    env = AtariEnvFactory(env_id, config, seed=0)(0)
    env.reset(seed=0)

    def play(n):
        for _ in range(n):
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()

    play(100)
    t0 = time.perf_counter()
    play(steps)
    ms = (time.perf_counter() - t0) / steps * 1000
    env.close()
    return ms


def batched_act_ms(batch: int, steps: int) -> tuple[float, list[ActivationCache]]:
    """A GA3C predictor's acting forward over ``batch`` envs, saving the activations and cutting them into
    per-env rows as it does; ms per frame. Returns the caches of ``steps`` consecutive batched steps."""
    torch.manual_seed(0)
    net = A3Clstm(1, 6).channels_last()
    frames = torch.rand(steps, batch, 1, 80, 80)
    caches: list[ActivationCache] = []

    @torch.no_grad()
    def act():
        caches.clear()
        state = net.initial_state(batch)
        for t in range(steps):
            cache = ActivationCache()
            _, _, state = net(frames[t], state, cache)
            for j in range(batch):
                activation_rows(cache, j)
            caches.append(cache)

    act()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        act()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (steps * batch) * 1000, caches


def segments_from(caches: list[ActivationCache], count: int) -> list[Segment]:
    """``count`` segments of ``len(caches)`` steps, env slots 0..count-1 of the batched steps in ``caches``."""
    steps = len(caches)
    out = []
    for j in range(count):
        rows = [activation_rows(c, j) for c in caches]
        acts = [cat_rows([r[i] for r in rows]) for i in range(len(ACT_FIELDS))]
        out.append(Segment(slot=j, frames=acts[0].clone(), actions=torch.randint(0, 6, (steps,)),
                           rewards=torch.zeros(steps), mu=torch.full((steps,), 1 / 6),
                           versions=torch.zeros(steps, dtype=torch.int64),
                           state=(torch.zeros(1, 512), torch.zeros(1, 512)), terminated=False, truncated=False,
                           bootstrap=0.0, acts=acts))
    return out


def trainer_update_ms(segments: list[Segment], repeats: int) -> float:
    """``Trainer.update`` (sync, assemble, replay, loss, backward, hand-off, shared Adam step) on ``segments``;
    ms per agent step."""
    args = build_parser().parse_args(["--mode", "ga3c", "--train-batch", str(len(segments)),
                                      "--num-steps", str(len(segments[0]))])
    shared = A3Clstm(1, 6)
    shared.share_memory()
    optimizer = make_optimizer("Adam", shared.parameters(), 1e-4, False, shared=True)
    trainer = Trainer(shared, optimizer, Ga3cSettings.from_args(args))
    steps = sum(len(s) for s in segments)
    trainer.update(segments)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        trainer.update(segments)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / steps * 1000


def measure(opts: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    keep_freed_memory()  # as every training process
    res: dict = {"machine": machine(), "cores": os.cpu_count(), "envs": opts.envs, "train_batch": opts.train_batch,
                 "num_steps": opts.num_steps}
    rounds = []
    for _ in range(opts.repeats):  # alternated, so a slow spell of a shared machine hits every piece
        r = {"env": env_step_ms(opts.env, str(ROOT / "config.json"), opts.env_steps)}
        a3g = our_step_ms(opts.rollouts, opts.num_steps)
        r["a3g_act"], r["a3g_update"] = a3g["forward_ms"], a3g["update_ms"] + a3g["optimizer_ms"]
        r["ga3c_act"], caches = batched_act_ms(opts.envs, opts.num_steps)
        segments = segments_from(caches, opts.train_batch)
        r["ga3c_update"] = trainer_update_ms(segments, opts.rollouts)
        chunk = model_module.FIRST_BLOCK_CHUNK
        model_module.FIRST_BLOCK_CHUNK = 10 ** 9  # the first block's backward in one piece
        try:
            r["ga3c_update_unchunked"] = trainer_update_ms(segments, opts.rollouts)
        finally:
            model_module.FIRST_BLOCK_CHUNK = chunk
        rounds.append(r)
    res["rounds"] = rounds
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    res["median_ms"] = med
    cores = res["cores"]
    for mode in ("a3g", "ga3c"):
        total = med["env"] + med[f"{mode}_act"] + med[f"{mode}_update"]
        res[f"{mode}_step_ms"] = total
        res[f"{mode}_ceiling_steps_per_s"] = cores * 1000 / total
    res["ceiling_ratio"] = res["a3g_step_ms"] / res["ga3c_step_ms"]
    res["matmul_gflops_1_thread"] = matmul_gflops()
    res["model_mflop_per_step"] = model_flops_per_step(opts.num_steps)["total"] / 1e6
    for mode in ("a3g", "ga3c"):  # benchmark.py's roof fraction, were the mode to run at its ceiling
        res[f"{mode}_ceiling_roof_fraction"] = (res[f"{mode}_ceiling_steps_per_s"] * res["model_mflop_per_step"]
                                                / (res["matmul_gflops_1_thread"] * 1000 * cores))
    return res


def report(res: dict) -> None:
    m = res["median_ms"]
    print(f"machine: {res['machine']['cpu']}, {res['cores']} cores, torch {res['machine']['torch']}")
    print(f"one agent step on one thread, ms (median of {len(res['rounds'])} rounds):")
    print(f"  {'':28s}{'A3G mode':>10s}{'GA3C mode':>11s}")
    print(f"  {'environment step':28s}{m['env']:10.2f}{m['env']:11.2f}")
    print(f"  {'acting forward':28s}{m['a3g_act']:10.2f}{m['ga3c_act']:11.2f}   (batch 1 / batch {res['envs']})")
    print(f"  {'update + optimizer':28s}{m['a3g_update']:10.2f}{m['ga3c_update']:11.2f}   "
          f"(1 x {res['num_steps']} / {res['train_batch']} x {res['num_steps']} frames)")
    print(f"  {'total':28s}{res['a3g_step_ms']:10.2f}{res['ga3c_step_ms']:11.2f}")
    print(f"ceiling on {res['cores']} cores: A3G {res['a3g_ceiling_steps_per_s']:.0f} steps/s, GA3C "
          f"{res['ga3c_ceiling_steps_per_s']:.0f} steps/s; GA3C / A3G at most {res['ceiling_ratio']:.2f}x")
    print(f"GA3C update with the first conv block's backward in one piece: {m['ga3c_update_unchunked']:.2f} ms, "
          f"in pieces of {model_module.FIRST_BLOCK_CHUNK} frames: {m['ga3c_update']:.2f} ms")
    print(f"fp32 matmul {res['matmul_gflops_1_thread']:.1f} GFLOP/s per thread; {res['model_mflop_per_step']:.0f} "
          f"MFLOP per step (benchmark.py's count): at their ceilings A3G mode would reach "
          f"{res['a3g_ceiling_roof_fraction']:.2f} and GA3C mode {res['ga3c_ceiling_roof_fraction']:.2f} of the "
          f"compute roof")


def budget_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--envs", type=int, default=16, help="GA3C predictor batch: the envs acting at once")
    p.add_argument("--train-batch", type=int, default=4, help="segments per GA3C update")
    p.add_argument("--num-steps", type=int, default=20, help="steps per rollout / segment")
    p.add_argument("--repeats", type=int, default=3, help="rounds, alternated (the median is reported)")
    p.add_argument("--rollouts", type=int, default=5, help="timed updates per round")
    p.add_argument("--env-steps", type=int, default=1000, help="timed environment steps per round")
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    opts = budget_parser().parse_args(argv)
    for name in ("envs", "train_batch", "num_steps", "repeats", "rollouts", "env_steps"):
        if getattr(opts, name) < 1:
            print(f"budget.py: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if opts.train_batch > opts.envs:
        print("budget.py: error: --train-batch must be <= --envs (each segment is one env's)", file=sys.stderr)
        return 2
    res = measure(opts)
    report(res)
    if opts.json:
        Path(opts.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

With ``--precision fp32 bf16`` the model pieces are timed in each precision (``--precision bf16``: the conv
encoder in bfloat16, see ``precision.py``), alternated within each round, and every ceiling is given against A3G
mode in the first precision listed.

Also timed: the GA3C update with the first conv block in one piece against pieces of ``model.FIRST_BLOCK_CHUNK``
frames, and with ``--lagged`` the GA3C update on segments acted on by an older model version (both ways): a
trainer replays only the activations of frames acted on by the weights it holds, so these run the conv encoder
again (``ga3c.trainer``), the first block forward and backward in pieces.

The GA3C pieces above are those of ``--replay-activations`` (the predictor saves activations, the update at lag 0
replays them). A GA3C run's default saves none and runs the encoder again for every frame: its update is the
``--lagged`` one, and its acting forward saves nothing (a little cheaper than the one timed here). The update timed
is one optimizer step on a batch (``--train-passes 1``); GA3C mode's default makes two on each, the second one
the ``--lagged`` update (the weights moved), so a default run's update costs about that one more.

Exit codes: 0 done; 2 bad input (one line on stderr, found before anything is measured or written); 130 Ctrl-C.
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
    lifeline.quit_on_interrupt("budget.py")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import model as model_module  # noqa: E402
from benchmark import env_and_json_problems, machine, matmul_gflops, model_flops_per_step, our_step_ms  # noqa: E402
from cli import Parser  # noqa: E402
from config import build_parser  # noqa: E402
from ga3c.segment import ACT_FIELDS, Segment, activation_rows, cat_rows  # noqa: E402
from ga3c.settings import Ga3cSettings  # noqa: E402
from ga3c.trainer import Trainer  # noqa: E402
from model import A3Clstm, ActivationCache  # noqa: E402
import precision as precision_module  # noqa: E402
from precision import PRECISIONS, compute_dtype  # noqa: E402
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


def batched_act_ms(batch: int, steps: int, precision: str = "fp32") -> tuple[float, list[ActivationCache]]:
    """A GA3C predictor's acting forward over ``batch`` envs in ``precision``, saving the activations and cutting
    them into per-env rows as it does; ms per frame. Returns the caches of ``steps`` consecutive batched steps."""
    torch.manual_seed(0)
    net = A3Clstm(1, 6).channels_last().set_precision(compute_dtype(precision))
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


def trainer_update_ms(segments: list[Segment], repeats: int, precision: str = "fp32", lag: int = 0) -> float:
    """``Trainer.update`` (sync, assemble, replay, loss, backward, hand-off, shared Adam step) on ``segments`` in
    ``precision`` (the segments' saved activations must be in it), each time stamped as acted on ``lag`` updates
    before (0: the trainer's own version, so every frame's activations are replayed; >= 1: none are, the encoder
    runs again); ms per agent step."""
    args = build_parser().parse_args(["--mode", "ga3c", "--train-batch", str(len(segments)),
                                      "--num-steps", str(len(segments[0])), "--train-passes", "1"])
    args.compute_precision = precision
    shared = A3Clstm(1, 6)
    shared.share_memory()
    optimizer = make_optimizer("Adam", shared.parameters(), 1e-4, False, shared=True)
    trainer = Trainer(shared, optimizer, Ga3cSettings.from_args(args))
    steps = sum(len(s) for s in segments)

    def update():
        for s in segments:
            s.versions.fill_(trainer.version() - lag)
        trainer.update(segments)

    update()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        update()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / steps * 1000


def model_pieces_ms(opts: argparse.Namespace, precision: str) -> dict:
    """The model's pieces of one agent step in ``precision``, ms: each mode's acting forward and update."""
    r = {}
    a3g = our_step_ms(opts.rollouts, opts.num_steps, precision)
    r["a3g_act"], r["a3g_update"] = a3g["forward_ms"], a3g["update_ms"] + a3g["optimizer_ms"]
    r["ga3c_act"], caches = batched_act_ms(opts.envs, opts.num_steps, precision)
    segments = segments_from(caches, opts.train_batch)
    r["ga3c_update"] = trainer_update_ms(segments, opts.rollouts, precision)
    chunk = model_module.FIRST_BLOCK_CHUNK
    model_module.FIRST_BLOCK_CHUNK = 10 ** 9  # the first block in one piece
    try:
        r["ga3c_update_unchunked"] = trainer_update_ms(segments, opts.rollouts, precision)
        if opts.lagged:
            r["ga3c_update_lagged_unchunked"] = trainer_update_ms(segments, opts.rollouts, precision, lag=1)
    finally:
        model_module.FIRST_BLOCK_CHUNK = chunk
    if opts.lagged:
        r["ga3c_update_lagged"] = trainer_update_ms(segments, opts.rollouts, precision, lag=1)
    return r


def measure(opts: argparse.Namespace) -> dict:
    """Every piece, ``--repeats`` rounds; per precision the medians, each mode's step cost and ceiling, and the
    ceilings over A3G mode's in the first precision."""
    torch.set_num_threads(1)
    keep_freed_memory()  # as every training process
    res: dict = {"machine": machine(), "cores": os.cpu_count(), "envs": opts.envs, "train_batch": opts.train_batch,
                 "num_steps": opts.num_steps, "precisions": opts.precisions,
                 "native_bf16": precision_module.cpu_has_native_bf16()}
    rounds = []
    for _ in range(opts.repeats):  # alternated, so a slow spell of a shared machine hits every piece
        r = {"env": env_step_ms(opts.env, str(ROOT / "config.json"), opts.env_steps)}
        for p in opts.precisions:
            r[p] = model_pieces_ms(opts, p)
        rounds.append(r)
    res["rounds"] = rounds
    med = {"env": statistics.median(r["env"] for r in rounds)}
    for p in opts.precisions:
        med[p] = {k: statistics.median(r[p][k] for r in rounds) for k in rounds[0][p]}
    res["median_ms"] = med
    cores = res["cores"]
    res["matmul_gflops_1_thread"] = matmul_gflops()
    res["model_mflop_per_step"] = model_flops_per_step(opts.num_steps)["total"] / 1e6
    res["step_ms"], res["ceiling_steps_per_s"], res["ceiling_roof_fraction"] = {}, {}, {}
    for p in opts.precisions:
        for mode in ("a3g", "ga3c"):
            total = med["env"] + med[p][f"{mode}_act"] + med[p][f"{mode}_update"]
            key = f"{mode} {p}"
            res["step_ms"][key] = total
            res["ceiling_steps_per_s"][key] = cores * 1000 / total
            # benchmark.py's roof fraction (fp32 matmul rate), were the mode to run at its ceiling
            res["ceiling_roof_fraction"][key] = (res["ceiling_steps_per_s"][key] * res["model_mflop_per_step"]
                                                 / (res["matmul_gflops_1_thread"] * 1000 * cores))
    base = res["step_ms"][f"a3g {opts.precisions[0]}"]
    res["ceiling_over_a3g"] = {key: base / ms for key, ms in res["step_ms"].items()}
    if opts.lagged:  # a default GA3C run: no activations replayed, every update runs the encoder again
        res["ga3c_default_step_ms"] = {p: med["env"] + med[p]["ga3c_act"] + med[p]["ga3c_update_lagged"]
                                       for p in opts.precisions}
        res["ga3c_default_ceiling_over_a3g"] = {p: base / ms for p, ms in res["ga3c_default_step_ms"].items()}
    return res


def report(res: dict) -> None:
    m, precisions = res["median_ms"], res["precisions"]
    print(f"machine: {res['machine']['cpu']}, {res['cores']} cores, torch {res['machine']['torch']}, native bf16: "
          f"{'yes' if res['native_bf16'] else 'no'}")
    print(f"one agent step on one thread, ms (median of {len(res['rounds'])} rounds):")
    keys = [f"{mode} {p}" for p in precisions for mode in ("a3g", "ga3c")]
    print(f"  {'':22s}" + "".join(f"{k.replace('a3g', 'A3G').replace('ga3c', 'GA3C'):>11s}" for k in keys))

    def row(label, values, note=""):
        print(f"  {label:22s}" + "".join(f"{v:11.2f}" for v in values) + note)

    row("environment step", [m["env"]] * len(keys))
    row("acting forward", [m[k.split()[1]][f"{k.split()[0]}_act"] for k in keys], f"   (batch 1 / {res['envs']})")
    row("update + optimizer", [m[k.split()[1]][f"{k.split()[0]}_update"] for k in keys],
        f"   (1 x {res['num_steps']} / {res['train_batch']} x {res['num_steps']} frames)")
    row("total", [res["step_ms"][k] for k in keys])
    print(f"ceiling on {res['cores']} cores, steps/s (and over A3G {precisions[0]}; GA3C with "
          f"--replay-activations): " + ", ".join(
        f"{k} {res['ceiling_steps_per_s'][k]:.0f} ({res['ceiling_over_a3g'][k]:.2f}x)" for k in keys))
    for p in precisions:
        ratio = res["ceiling_over_a3g"][f"ga3c {p}"] / res["ceiling_over_a3g"][f"a3g {p}"]
        print(f"{p}: GA3C (--replay-activations) / A3G at most {ratio:.2f}x; GA3C update with the first conv "
              f"block in one piece {m[p]['ga3c_update_unchunked']:.2f} ms, in pieces of {model_module.FIRST_BLOCK_CHUNK} frames "
              f"{m[p]['ga3c_update']:.2f} ms")
        if "ga3c_update_lagged" in m[p]:
            print(f"{p}: GA3C update on segments acted on by an older version (the encoder runs again) "
                  f"{m[p]['ga3c_update_lagged']:.2f} ms, {m[p]['ga3c_update_lagged'] / m[p]['ga3c_update']:.2f}x "
                  f"the replay's; with the first conv block in one piece {m[p]['ga3c_update_lagged_unchunked']:.2f} "
                  f"ms")
        if "ga3c_default_step_ms" in res:
            print(f"{p}: a default GA3C run (no activations saved, the encoder runs again in every update): "
                  f"{res['ga3c_default_step_ms'][p]:.2f} ms a step, at most "
                  f"{res['ga3c_default_ceiling_over_a3g'][p]:.2f}x A3G {precisions[0]} (the acting forward timed "
                  f"saves activations, so a little high)")
    print(f"fp32 matmul {res['matmul_gflops_1_thread']:.1f} GFLOP/s per thread; {res['model_mflop_per_step']:.0f} "
          f"MFLOP per step (benchmark.py's count); fraction of that fp32 roof at the ceilings (bf16 can pass 1): "
          + ", ".join(
              f"{k} {res['ceiling_roof_fraction'][k]:.2f}" for k in keys))


def budget_parser() -> argparse.ArgumentParser:
    p = Parser(prog="budget.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--envs", type=int, default=16, help="GA3C predictor batch: the envs acting at once")
    p.add_argument("--train-batch", type=int, default=4, help="segments per GA3C update")
    p.add_argument("--num-steps", type=int, default=20, help="steps per rollout / segment")
    p.add_argument("--repeats", type=int, default=3, help="rounds, alternated (the median is reported)")
    p.add_argument("--rollouts", type=int, default=5, help="timed updates per round")
    p.add_argument("--env-steps", type=int, default=1000, help="timed environment steps per round")
    p.add_argument("--precision", dest="precisions", nargs="+", default=["fp32"], choices=list(PRECISIONS),
                   help="the model pieces' precision(s), each timed in every round; auto = bf16 on a CPU with "
                        "native bf16, else fp32 (default: fp32)")
    p.add_argument("--lagged", action="store_true",
                   help="also time the GA3C update on segments that lag (no activations replayed)")
    p.add_argument("--json", help="also write the results here")
    return p


def check_options(opts: argparse.Namespace) -> list[str]:
    """Every problem with the flags, each as one phrase (empty when all is well), before anything is measured."""
    problems = [f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}"
                for name in ("envs", "train_batch", "num_steps", "repeats", "rollouts", "env_steps")
                if getattr(opts, name) < 1]
    if not problems and opts.train_batch > opts.envs:
        problems.append("--train-batch must be <= --envs (each segment is one env's)")
    return problems + env_and_json_problems(opts)


def main(argv=None) -> int:
    try:
        opts = budget_parser().parse_args(argv)
        problems = check_options(opts)
        if problems:
            print("budget.py: error: " + "; ".join(problems), file=sys.stderr)
            return 2
        resolved = [precision_module.resolve(p, [torch.device("cpu")])[0] for p in opts.precisions]
        opts.precisions = list(dict.fromkeys(resolved))  # auto named once, in its place
        res = measure(opts)
        report(res)
        if opts.json:
            Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.json).write_text(json.dumps(res, indent=1))
        return 0
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("budget.py: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    lifeline.unwind_on_interrupt()
    sys.exit(main())

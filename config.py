"""Every training flag in one place (upstream A3G's names and short flags; its defaults, but for the mode and the
mode's ``--lr`` and ``--precision``), and their validation.

``build_parser()`` declares the flags; ``validate(args)`` checks the whole configuration before any process
starts and returns every problem at once, each as one line a user can act on.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
from pathlib import Path

import torch

import precision
from cli import BoolFlag, Parser, validate_dir, validate_file
from ga3c.settings import LATER_PASSES
from precision import PRECISIONS
from environment import EnvIdError, load_env_config, resolve_env_id
from utils import safe_name

DEFAULT_ENV = "PongNoFrameskip-v4"
REPO = Path(__file__).resolve().parent


def resolve_env_config(path: str) -> str:
    """A relative ``--env-config`` is looked up in the working folder, then next to the code."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO / p).is_file():
        return str(REPO / p)
    return path


SEED_LIMIT = 2**32  # seeds run from 0 to SEED_LIMIT - 1 (gymnasium refuses negative ones)
STEP_COUNT_LIMIT = 2**63  # step counts are int64 in the counters and refused from here on in a checkpoint
# the most of each size a run is built with: far beyond any useful run, and below what would fail to allocate (a
# traceback) or spawn processes until the machine runs out of memory
SIZE_LIMITS = {"hidden_size": 8192, "score_window": 1_000_000, "workers": 1024, "agents": 1024,
               "envs_per_agent": 1024, "predictors": 1024, "trainers": 1024}
STEP_COUNT_FLAGS = ("max_steps", "lr_anneal_steps", "entropy_anneal_steps", "ema_steps", "test_every_steps",
                    "confirm_every_steps")


# Peak memory of an update per frame of its rollouts or segments, from ``ru_maxrss`` before and after one update in
# fp32 (hidden size 512, Pong): an A3G worker's rollout and replay 2.15 MiB, a GA3C trainer's update over lagging
# frames 2.19 MiB (1.41 in bf16). A queued GA3C segment holds its frames (80 x 80 float32), and with
# --replay-activations the acting activations too (about 0.9 MiB a frame).
UPDATE_BYTES_PER_FRAME = int(2.2 * 2**20)
SEGMENT_BYTES_PER_FRAME = 80 * 80 * 4
REPLAY_BYTES_PER_FRAME = int(0.9 * 2**20)


def machine_memory() -> int | None:
    """Bytes of memory this process's container may use: the cgroup limit where one is set below the machine's
    physical memory; None where neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = int(text)
            total = limit if total is None else min(total, limit)
        break
    return total


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: ``taskset``, a container's cpuset), which
    ``os.cpu_count`` does not see."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity on this platform
        return os.cpu_count() or 1


def add_model_env_flags(p: argparse.ArgumentParser, log_dir_short: str = "-lg",
                        seed_help: str = "random seed; worker r uses seed + r",
                        log_dir_help: str = "folder for logs, CSVs and TensorBoard (default: logs/<env>; a GA3C-mode "
                                            "or Ray training run's: logs/<env>-ga3c, logs/<env>-ray)",
                        see_skipped_default: str = "the emulator's last frame") -> None:
    """Flags shared by training and evaluation (same names as upstream); the help of ``--log-dir`` and the default
    that ``--see-skipped-frames``' help names are each program's own."""
    p.add_argument("--env", "-ev", default=DEFAULT_ENV, help="environment id (default: %(default)s)")
    p.add_argument("--env-config", "-evc", default="config.json", help="per-game crop table (default: %(default)s)")
    p.add_argument("--max-episode-length", "-mel", type=int, default=10000,
                   help="time limit of a game in agent steps (default: %(default)s)")
    p.add_argument("--skip-rate", "-sk", type=int, default=4,
                   help="frames per agent step for NoFrameskip ids (default: %(default)s)")
    p.add_argument("--see-skipped-frames", action="store_true",
                   help="for ids whose emulator skips frames (X-v0, X-v4, ALE/X-v5, XDeterministic-v4): step the "
                        "emulator one frame at a time with the id's own skip (fixed, or a random 2-4) and show the max "
                        "over the step's last frames (up to 3), as for NoFrameskip ids; the same game, an "
                        f"observation that shows motion (default: {see_skipped_default})")
    p.add_argument("--hidden-size", "-hs", type=int, default=512,
                   help="LSTM hidden size, at most 8192 (default: %(default)s)")
    p.add_argument("--seed", "-s", type=int, default=1, help=f"{seed_help} (default: %(default)s)")
    p.add_argument("--log-dir", log_dir_short, default=None, help=log_dir_help)


# The defaults that depend on the mode: GA3C mode's were measured on Pong over three seeds each and checked on
# Breakout's first 1.5M steps (docs/results.md); A3G mode keeps upstream's, which all of its seeds used.
MODE_DEFAULTS = {"ga3c": {"lr": 0.0002, "precision": "auto", "lr_anneal_steps": 1_500_000, "train_passes": 2},
                 "a3g": {"lr": 0.0001, "precision": "fp32", "lr_anneal_steps": 0, "train_passes": 1}}
A3G_ONLY_DESTS = ("workers", "distributed_step_size", "ray_address")  # flags only A3G mode has, None when not given
GA3C_ONLY_DESTS = ("agents", "envs_per_agent", "predictors", "trainers", "predict_batch", "train_batch", "queue_size",
                   "replay_activations", "is_clip", "dynamic", "dynamic_max", "dynamic_seconds", "sync_every",
                   "short_game_slots", "short_game_length", "short_games_after_score", "greedy_slots",
                   "train_passes", "pass_clip", "later_passes")
_NOT_GIVEN = object()


def resolve_mode(args: argparse.Namespace) -> argparse.Namespace:
    """Fills in what depends on the mode, in place: ``mode`` from ``--mode``, else ``a3g`` where the command line
    gives a flag that only A3G mode has (``--workers``, ``--distributed-step-size``, ``--ray-address``, as
    upstream's commands do, in any spelling argparse accepts), else ``ga3c``; then that mode's ``--lr``,
    ``--precision``, ``--lr-anneal-steps`` and ``--train-passes`` unless given (``MODE_DEFAULTS``), and
    ``--workers``'s default, the number of CPU cores."""
    if args.mode is None:
        args.mode = "a3g" if any(getattr(args, d) is not None for d in A3G_ONLY_DESTS) else "ga3c"
    for name, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.workers is None:
        args.workers = usable_cores()
    return args


class TrainParser(Parser):
    """``main.py``'s parser: every caller of ``parse_args`` gets the mode and its defaults resolved
    (``resolve_mode``); the flags that depend on the mode parse to None when not given."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)  # --help and usage errors exit here
        # once more with a marker for the defaults of the flags that belong to one mode: which of them were given
        # and of the flags refused where they would change nothing
        watched = A3G_ONLY_DESTS + GA3C_ONLY_DESTS + ("confirm_every_steps", "sync_seconds", "merge", "amsgrad",
                                                      "num_steps", "lr_anneal_steps", "max_steps")
        defaults = {d: self.get_default(d) for d in watched}
        self.set_defaults(**dict.fromkeys(watched, _NOT_GIVEN))
        try:
            marked, _ = super().parse_known_args(args, None)
        finally:
            self.set_defaults(**defaults)
        ns._given = tuple(d for d in watched if getattr(marked, d) is not _NOT_GIVEN)
        return resolve_mode(ns), rest


def build_parser() -> argparse.ArgumentParser:
    p = TrainParser(prog="main.py", description="A3C-LSTM on Atari: batched GA3C mode (the default) or hogwild "
                                                "workers (A3G mode, --mode a3g).")
    add_model_env_flags(p)
    p.add_argument("--lr", "-l", type=float, help="learning rate (default: 0.0002 in GA3C mode, 0.0001 in A3G mode)")
    p.add_argument("--lr-anneal-steps", type=int,
                   help="anneal the learning rate linearly from --lr to 0 at this many global agent steps (as A3C's "
                        "paper did); the run stops there at the latest (a larger --max-steps, or 0, is cut to it); "
                        "0 = a constant --lr; for a longer run give the steps it should take (default: 1500000 in "
                        "GA3C mode, 0 in A3G mode)")
    p.add_argument("--entropy-coef", "-ec", type=float, default=0.01, help="entropy bonus weight (default: %(default)s)")
    p.add_argument("--entropy-anneal-steps", type=int, default=0,
                   help="anneal the entropy bonus weight linearly from --entropy-coef to 0 at this many global agent "
                        "steps; training goes on without it after that; 0 = a constant --entropy-coef (default: "
                        "%(default)s)")
    p.add_argument("--value-coef", "-vc", type=float, default=0.5,
                   help="value loss weight; 0.5 is upstream's fixed factor (default: %(default)s)")
    p.add_argument("--gamma", "-g", type=float, default=0.99, help="discount (default: %(default)s)")
    p.add_argument("--tau", "-t", type=float, default=1.00, help="GAE lambda (default: %(default)s)")
    p.add_argument("--train-envs", nargs="+", default=None, metavar="ID",
                   help="the learners' env ids, spread over GA3C mode's env slots or A3G mode's workers: slot or "
                        "worker i plays ID[i %% len] (repeat an id to weight it); each must be --env's game, e.g. "
                        "ALE/Pong-v5 PongNoFrameskip-v4 for sticky and non-sticky games. The monitor and the saved "
                        "files stay --env's (default: --env)")
    p.add_argument("--workers", "-w", type=int, default=None,
                   help="A3G mode's training processes; giving it selects A3G mode unless --mode says otherwise "
                        f"(default: the CPU cores this process may use, {usable_cores()} here)")
    p.add_argument("--num-steps", "-ns", type=int, default=20, help="rollout length in agent steps (default: %(default)s)")
    p.add_argument("--shared-optimizer", "-so", action=BoolFlag, default=True,
                   help="share the optimizer statistics between workers; --no-shared-optimizer gives each "
                        "worker its own (default: on)")
    p.add_argument("--load", "-ld", action=BoolFlag, default=False,
                   help="resume from <load-model-dir>/<env>.ckpt, else start from <env>.dat")
    p.add_argument("--save-max", "-sm", action=BoolFlag, default=False,
                   help="write <env>.dat only when a test game scores >= the best so far, which starts at 0 as "
                        "upstream's (so no .dat until a game scores 0 or more)")
    p.add_argument("--optimizer", "-o", default="Adam", choices=["Adam", "RMSprop"],
                   help="shared optimizer (default: %(default)s)")
    p.add_argument("--load-model-dir", "-lmd", default=None,
                   help="where --load looks (default: --save-model-dir, i.e. resume this run; "
                        "trained_models/ to start from a shipped model)")
    p.add_argument("--save-model-dir", "-smd", default=None,
                   help="where <env>.dat and <env>.ckpt are written (default: runs/<env>; in GA3C mode "
                        "runs/<env>-ga3c, on Ray runs/<env>-ray)")
    p.add_argument("--gpu-ids", "-gp", type=int, nargs="+", default=[-1],
                   help="GPUs: A3G mode's workers round-robin; GA3C mode's trainers and predictors (with two or "
                        "more ids, the first half trains, the second half predicts); the monitor uses the last; "
                        "-1 = CPU (default)")
    p.add_argument("--amsgrad", "-a", action=BoolFlag, default=False, help="AMSGrad variant of Adam")
    p.add_argument("--optimizer-eps", type=float, default=None,
                   help="the term added to the root of the optimizer's second moment; a smaller one lets parameters "
                        "with small gradients (most of the LSTM's) take Adam's full step (default: upstream's, "
                        "1e-3 for Adam and 0.1 for RMSprop)")
    p.add_argument("--tensorboard-logger", "-tl", action=BoolFlag, default=False,
                   help="write TensorBoard scalars to <log-dir>/runs/<env>_training")
    p.add_argument("--distributed-step-size", "-dss", type=int, nargs="+", default=None,
                   help="per-worker rollout lengths: worker r uses dss[r %% len] (default: --num-steps)")
    # Beyond upstream: stop conditions, gradient clipping, monitor and checkpoint cadence.
    p.add_argument("--precision", choices=list(PRECISIONS),
                   help="the conv encoder's precision: fp32, bf16 (bfloat16 convolutions; weights, gradients, "
                        "optimizer, LSTM and losses stay float32), or auto: bf16 where the CPU or GPU runs it "
                        "natively, else fp32 (default: auto in GA3C mode, fp32 in A3G mode)")
    p.set_defaults(compute_precision="fp32")  # --precision resolved for the run's devices by validate()
    p.add_argument("--max-steps", type=int, default=50_000_000,
                   help="stop when the global agent-step count (all workers, resumed runs included) reaches "
                        "this; 0 = no limit but --lr-anneal-steps's (default: %(default)s, i.e. 200M frames)")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this many seconds; 0 = no limit")
    p.add_argument("--target-score", type=float, default=None,
                   help="stop when the monitor's mean over the last --score-window games reaches this")
    p.add_argument("--score-window", type=int, default=10,
                   help="games in the monitor's mean, at most 1,000,000 (default: %(default)s)")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip each update's gradient to this L2 norm; 0 = off, upstream (default: %(default)s)")
    p.add_argument("--ema-steps", type=int, default=0, metavar="N",
                   help="the monitor plays, and <env>.dat holds, an exponential moving average of the weights with a "
                        "time constant of N global agent steps (updated after every optimizer step; training goes "
                        "on with the latest weights); 0 = the latest weights, upstream (default: %(default)s)")
    p.add_argument("--test-every-steps", type=int, default=20000,
                   help="the monitor starts a test game every this many global steps; 0 = no step cadence (with "
                        "--test-every-seconds 0 too: one game after another) (default: %(default)s)")
    p.add_argument("--test-every-seconds", type=float, default=0,
                   help="... or this many seconds after the last one ended, whichever comes first; 0 = off")
    p.add_argument("--confirm-every-steps", type=int, default=5000, metavar="N",
                   help="with --target-score: while one of the monitor's last --score-window games scored at least "
                        "the target, it starts a game every N global steps instead (when that is sooner), so that a "
                        "run that plays at its target is seen there, and stops, sooner; 0 = off "
                        "(default: %(default)s)")
    p.add_argument("--status-every-seconds", type=float, default=60,
                   help="log a status line (steps/s, smoothed losses) this often (default: %(default)s)")
    p.add_argument("--checkpoint-every-seconds", type=float, default=120,
                   help="write the full checkpoint this often, and at the end (default: %(default)s)")
    add_ga3c_flags(p)
    add_ray_flags(p)
    return p


def add_ray_flags(p: argparse.ArgumentParser) -> None:
    """Several machines (``--ray-address``): hogwild nodes joined through a parameter server on Ray."""
    g = p.add_argument_group("several machines (--ray-address; pip install -r requirements-ray.txt)")
    g.add_argument("--ray-address", default=None,
                   help="run --nodes hogwild nodes on Ray: auto (the cluster of `ray start`), HOST:PORT (its head), "
                        "or local (a one-machine cluster started by the run); default: one machine, no Ray")
    g.add_argument("--nodes", type=int, default=1,
                   help="hogwild nodes, each --workers worker processes with its own shared model and optimizer "
                        "statistics, on any machine of the cluster (default: %(default)s)")
    g.add_argument("--sync-seconds", type=float, default=5.0,
                   help="each node sends its weight change and takes the global weights this often "
                        "(default: %(default)s)")
    g.add_argument("--merge", default="sum", choices=["sum", "average"],
                   help="the parameter server adds each node's change (sum: every update counts once, as between "
                        "the workers of one machine) or 1/nodes of it (average) (default: %(default)s)")


# GA3C's policy lag grows with (env slots) / --train-batch: each slot holds one open segment, and a frame's segment
# waits for the others ahead of it to be trained, --train-batch an update. At a ratio of 4 (16 slots, batch 4; 128
# slots, batch 32; 32 slots, batch 8) the lag measured 2.7-3.5 updates and runs learned; at 48 (192 slots, batch 4)
# it measured about 30 and Breakout collapsed within 2,000 updates, on a CPU and on a GPU (docs/results.md,
# "Policy lag"); at 8 (192 slots, batch 24) it measured 3.1-4.8.
LAG_SLOTS_PER_SEGMENT = 4
MIN_TRAIN_BATCH = 4
LAG_WARN = 8  # slots per --train-batch segment above which main.py warns


def default_train_batch(slots: int) -> int:
    """``--train-batch``'s default for ``slots`` env slots (with ``--dynamic``, the most it may reach): ``slots / 4``
    rounded up, at least 4."""
    return max(MIN_TRAIN_BATCH, math.ceil(slots / LAG_SLOTS_PER_SEGMENT))


def most_agents(args: argparse.Namespace) -> int:
    """The most agent processes a GA3C run may have: ``--agents``, or with ``--dynamic`` its bound."""
    return max(args.agents, args.dynamic_max[2]) if args.dynamic and args.dynamic_max else args.agents


SYNC_WARN = 8  # --sync-every above this gets a line: the predictors' weights that many updates old at worst


def policy_lag_warnings(args: argparse.Namespace) -> list[str]:
    """The lines to print before a GA3C run whose ``--sync-every`` is above ``SYNC_WARN``, or whose
    ``--train-batch`` leaves more than ``LAG_WARN`` env slots per segment of an update (with ``--dynamic``, at its
    most agents); none in A3G mode."""
    if args.mode != "ga3c":
        return []
    lines = []
    if args.sync_every > SYNC_WARN:
        lines.append(f"--sync-every {args.sync_every}: the predictors act with weights up to {args.sync_every} "
                     f"updates old, which adds about {(args.sync_every - 1) / 2:g} updates to the policy lag on "
                     f"average (a lag of about 30 collapsed a Breakout run: docs/results.md, Policy lag); the "
                     f"default, 1, copies them after every update")
    agents = most_agents(args)
    slots = agents * args.envs_per_agent
    if slots <= LAG_WARN * args.train_batch:
        return lines
    counted = f"--agents {agents}" if agents == args.agents else f"up to {agents} agents with --dynamic"
    return lines + [f"--train-batch {args.train_batch} for {slots} env slots ({counted} x --envs-per-agent "
            f"{args.envs_per_agent}): "
            f"{round(slots / args.train_batch, 1):g} slots per segment of an update, and the policy lag grows with that "
            f"ratio (at 48 it measured about 30 updates and Breakout collapsed within 2,000 updates: "
            f"docs/results.md, Policy lag); the default for these slots, --train-batch {default_train_batch(slots)}, "
            f"keeps the ratio at {LAG_SLOTS_PER_SEGMENT} or under"]


def add_ga3c_flags(p: argparse.ArgumentParser) -> None:
    """GA3C mode (``--mode ga3c``): batched predictors and trainers next to one model, serving many agents.
    Each flag names the GA3C ``Config.py`` key it replaces; the A3C flags above (``--num-steps`` = TIME_MAX,
    ``--lr``, ``--gamma``, ...) apply to both modes."""
    g = p.add_argument_group("GA3C mode (--mode ga3c)")
    g.add_argument("--mode", choices=["a3g", "ga3c"],
                   help="ga3c: agents that only step environments, batched predictors and trainers next to one "
                        "model; a3g: hogwild workers, each with its own model copy (default: ga3c; a3g when "
                        "--workers, --distributed-step-size or --ray-address is given)")
    g.add_argument("--agents", type=int, default=None,
                   help="agent processes, which only step environments (GA3C AGENTS; default: the CPU cores this "
                        "process may use)")
    g.add_argument("--envs-per-agent", type=int, default=8,
                   help="environments stepped by each agent process (default: %(default)s)")
    g.add_argument("--predictors", type=int, default=1,
                   help="predictor threads: batched forward for every waiting observation (GA3C PREDICTORS; "
                        "default: %(default)s)")
    g.add_argument("--trainers", type=int, default=2,
                   help="trainer threads: batched update over segments (GA3C TRAINERS; default: %(default)s, "
                        "upstream's, the fastest measured on 2 cores)")
    g.add_argument("--predict-batch", type=int, default=128,
                   help="most observations in one forward (GA3C PREDICTION_BATCH_SIZE; default: %(default)s)")
    g.add_argument("--train-batch", type=int, default=None,
                   help="segments of --num-steps transitions per update (GA3C TRAINING_MIN_BATCH_SIZE counts "
                        f"transitions; default: the env slots (--agents x --envs-per-agent; with --dynamic, at its most "
                        f"agents) / {LAG_SLOTS_PER_SEGMENT}, "
                        f"at least {MIN_TRAIN_BATCH}, which keeps the policy lag near 3 updates: 4 on 2 cores, 32 for 8 "
                        "agents x 16)")
    g.add_argument("--queue-size", type=int, default=8,
                   help="finished segments waiting for a trainer; a full queue holds the agents back, bounding the "
                        "memory of saved activations (about 0.9 MB a frame) and, with the env slots' open segments "
                        "and over --train-batch, the policy lag (GA3C MAX_QUEUE_SIZE, 100 segments of 5 steps; "
                        "default: %(default)s)")
    g.add_argument("--replay-activations", action=BoolFlag, default=False,
                   help="predictors save the conv activations, and a trainer replays those of the frames its own "
                        "weights acted on instead of running the convolutions again; frames acted on by older weights "
                        "(policy lag, most of them) run again, so the gradient is always the one at the trainer's "
                        "weights; off: every frame runs again and nothing is saved, as GA3C (default: off)")
    g.add_argument("--is-clip", type=float, default=0.0,
                   help="weight each policy-gradient term by min(pi/mu, IS_CLIP), mu the acting policy's "
                        "probability (policy-lag correction); 0 = off, as GA3C (default: %(default)s)")
    g.add_argument("--train-passes", type=int, metavar="K",
                   help="optimizer steps on each batch; above 1 every pass's policy term is PPO's clipped surrogate "
                        "against the acting policy (--pass-clip), so that the batch is learned from K times without "
                        "one action's probability moving far from the one that acted; 1 = plain A3C (default: 2)")
    g.add_argument("--pass-clip", type=float, default=0.2, metavar="EPS",
                   help="with --train-passes above 1, the clipped surrogate's epsilon: a step's ratio pi/mu gives no "
                        "gradient beyond 1 +- EPS in the direction of its advantage (default: %(default)s, PPO's)")
    g.add_argument("--later-passes", choices=LATER_PASSES, default="full",
                   help="with --train-passes above 1, what the passes after the first train: full = the whole model, "
                        "its convolutions run again with the moved weights; lstm = the LSTM and the heads only, on "
                        "the first pass's conv features, so the conv weights take one step per batch and a later "
                        "pass costs about a twentieth of the first (default: %(default)s)")
    g.add_argument("--dynamic", action=BoolFlag, default=False,
                   help="adjust the numbers of trainers, predictors and agents by measured training throughput "
                        "(GA3C DYNAMIC_SETTINGS), within --dynamic-max (default: off)")
    g.add_argument("--dynamic-max", type=int, nargs=3, default=None, metavar=("NT", "NP", "NA"),
                   help="upper bounds for --dynamic (lower bounds are 1); default: twice the starting (at most 1,024) "
                        "--trainers, --predictors and --agents")
    g.add_argument("--dynamic-seconds", type=float, default=20.0,
                   help="--dynamic measures each setting this long (GA3C: 20 s) (default: %(default)s)")
    g.add_argument("--sync-every", type=int, default=1,
                   help="predictors copy the trained weights every this many updates (with two or more GPUs the "
                        "first half trains and the second half predicts) (default: %(default)s)")
    g.add_argument("--short-game-slots", type=int, default=0, metavar="K",
                   help="env slots 0 to K-1 play games cut (truncated) at --short-game-length agent steps, so "
                        "that the learners meet a game's opening more often; their games are not counted as "
                        "learner games; the monitor is unchanged (default: %(default)s, none)")
    g.add_argument("--greedy-slots", type=int, default=0, metavar="G",
                   help="the G env slots after the --short-game-slots act greedily (the argmax action, as the "
                        "monitor does), so that the learners meet the states where the greedy policy goes wrong; "
                        "their policy-gradient terms are weighted by pi(a) (the importance weight of a "
                        "deterministic behaviour policy, mu = 1); their games are not counted as learner games "
                        "(default: %(default)s, none)")
    g.add_argument("--short-game-length", type=int, default=150, metavar="STEPS",
                   help="the time limit of the --short-game-slots, in agent steps, the reset's FIRE and action 2 "
                        "included; at least 3 (default: %(default)s)")
    g.add_argument("--short-games-after-score", type=float, default=None, metavar="SCORE",
                   help="the --short-game-slots play whole games (not counted as learner games either) until "
                        "the monitor's mean over its last --score-window games first reaches SCORE, and games cut "
                        "at --short-game-length from their next game on: the openings practised once the rest is "
                        "learned; kept in the checkpoint (default: none, cut from the start)")


def validate_common(args: argparse.Namespace) -> list[str]:
    """Problems with the env and model flags shared by training and evaluation."""
    errors = []
    args.env_config = resolve_env_config(args.env_config)
    if args.log_dir is None:
        args.log_dir = str(Path("logs") / safe_name(args.env))
    try:
        resolve_env_id(args.env)
    except EnvIdError as e:
        errors.append(str(e))
    if not args.env_config.strip():
        errors.append("--env-config is empty: give the crop table's path (default: the repository's config.json)")
    elif Path(args.env_config).is_dir():
        errors.append(f"env config '{args.env_config}' is a folder, not the crop table (use --env-config PATH to "
                      f"its file)")
    elif not Path(args.env_config).is_file():
        errors.append(f"env config '{args.env_config}' does not exist (use --env-config PATH to the crop table)")
    else:
        try:
            load_env_config(args.env_config, args.env)
        except (ValueError, OSError) as e:
            errors.append(f"env config '{args.env_config}' is not valid: {e}")
    if not 0 <= args.seed < SEED_LIMIT:
        errors.append(f"--seed must be between 0 and {SEED_LIMIT - 1}, got {args.seed}")
    # a game's first agent steps are the reset's FIRE and action 2 (where the game has FIRE): a time limit of 1 or 2
    # ends every game before the agent acts, and every score is 0 (as --short-game-length's bound)
    for name, low in (("max_episode_length", 3), ("skip_rate", 1), ("hidden_size", 1)):
        if getattr(args, name) < low:
            errors.append(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    errors += size_problems(args, ("hidden_size",))
    return errors


def size_problems(args: argparse.Namespace, names) -> list[str]:
    """One line for each of ``names`` above its ``SIZE_LIMITS`` bound."""
    return [f"--{name.replace('_', '-')} must be at most {SIZE_LIMITS[name]:,}, got {value:,}"
            for name in names if (value := getattr(args, name, None)) is not None and value > SIZE_LIMITS[name]]


def empty_path_problems(args: argparse.Namespace, names) -> list[str]:
    """One line for each folder flag of ``names`` given as an empty (or blank) string, which would mean the
    current folder."""
    return [f"--{name.replace('_', '-')} is empty: give a folder (use . for the current one)"
            for name in names if isinstance(getattr(args, name, None), str) and not getattr(args, name).strip()]


def validate_gpu_ids(gpu_ids: list[int], flag: str = "--gpu-ids", machine: bool = True) -> list[str]:
    """Problems with ``gpu_ids``: -1 given more than once or beside GPU ids; with ``machine``, GPU ids that this
    machine does not have."""
    if all(g < 0 for g in gpu_ids):
        if len(gpu_ids) > 1:
            return [f"{flag}: give -1 once for the CPU"]
        return []
    if any(g < 0 for g in gpu_ids):
        return [f"{flag}: do not mix -1 (CPU) with GPU ids {gpu_ids}"]
    if not machine:
        return []
    if not torch.cuda.is_available():
        return [f"{flag} {' '.join(map(str, gpu_ids))}: CUDA is not available on this machine "
                f"(torch {torch.__version__}); use {flag} -1 to train on the CPU"]
    n = torch.cuda.device_count()
    bad = [g for g in gpu_ids if g >= n]
    if bad:
        return [f"{flag}: GPU {bad[0]} does not exist; this machine has {n} GPU(s), ids 0..{n - 1}"]
    return []


def run_folder_name(args: argparse.Namespace) -> str:
    """A training run's default folder name, under ``runs/`` and ``logs/``: the env id (``/`` written as ``_``),
    with ``-ga3c`` in GA3C mode and ``-ray`` on Ray, so that a new run of one mode never finds another mode's model
    in its folder (which would refuse it)."""
    suffix = "-ray" if args.ray_address is not None else "-ga3c" if args.mode == "ga3c" else ""
    return safe_name(args.env) + suffix


def load_folder(args: argparse.Namespace) -> str:
    """Where ``--load`` looks: ``--load-model-dir``, else ``--save-model-dir``, else the run's default folder."""
    return args.load_model_dir or args.save_model_dir or str(Path("runs") / run_folder_name(args))


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with the training configuration, each as one line (empty when all is well)."""
    if args.log_dir is None:  # before validate_common, whose default (evaluation's) has no mode in it
        args.log_dir = str(Path("logs") / run_folder_name(args))
    empty = empty_path_problems(args, ("save_model_dir", "log_dir", "load_model_dir"))
    if empty:  # Path('') is the current folder: every check below would pass on it
        return empty
    errors = validate_common(args)
    if args.save_model_dir is None:
        args.save_model_dir = str(Path("runs") / run_folder_name(args))
    if args.load_model_dir is None:
        args.load_model_dir = load_folder(args)
    elif args.load and Path(args.load_model_dir).is_file():
        errors.append(f"--load-model-dir '{args.load_model_dir}' is a file, not a folder: give the folder that holds "
                      f"<env>.ckpt or <env>.dat")
    elif not args.load and Path(args.load_model_dir).resolve() != Path(args.save_model_dir).resolve():
        errors.append(f"--load-model-dir {args.load_model_dir} is where --load looks for the run to resume or the "
                      f"model to start from, and --load is not given: add --load, or leave --load-model-dir out")
    # nan compares false with every bound below and inf passes some: one line for each, this one, not theirs
    not_finite = [name for name, value in vars(args).items() if isinstance(value, float) and not math.isfinite(value)]
    errors += [f"--{name.replace('_', '-')} must be a finite number, got {getattr(args, name)}" for name in not_finite]
    skip = tuple(f"--{name.replace('_', '-')} " for name in not_finite)
    checks = [
        (args.lr > 0, f"--lr must be > 0, got {args.lr}"),
        (args.optimizer_eps is None or args.optimizer_eps > 0,
         f"--optimizer-eps must be > 0, got {args.optimizer_eps}"),
        (0 < args.gamma <= 1, f"--gamma must be in (0, 1], got {args.gamma}"),
        (0 <= args.tau <= 1, f"--tau must be in [0, 1], got {args.tau}"),
        (args.entropy_coef >= 0, f"--entropy-coef must be >= 0, got {args.entropy_coef}"),
        (args.value_coef >= 0, f"--value-coef must be >= 0, got {args.value_coef}"),
        (args.workers >= 1, f"--workers must be >= 1, got {args.workers}"),
        (args.num_steps >= 1, f"--num-steps must be >= 1, got {args.num_steps}"),
        (args.max_steps >= 0, f"--max-steps must be >= 0 (0 = no limit), got {args.max_steps}"),
        (args.lr_anneal_steps >= 0,
         f"--lr-anneal-steps must be >= 0 (0 = a constant --lr), got {args.lr_anneal_steps}"),
        (args.entropy_anneal_steps >= 0,
         f"--entropy-anneal-steps must be >= 0 (0 = a constant --entropy-coef), got {args.entropy_anneal_steps}"),
        (args.max_seconds >= 0, f"--max-seconds must be >= 0 (0 = no limit), got {args.max_seconds}"),
        (args.score_window >= 1, f"--score-window must be >= 1, got {args.score_window}"),
        (args.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (0 = off), got {args.max_grad_norm}"),
        (args.ema_steps >= 0, f"--ema-steps must be >= 0 (0 = off), got {args.ema_steps}"),
        (args.test_every_steps >= 0, f"--test-every-steps must be >= 0, got {args.test_every_steps}"),
        (args.test_every_seconds >= 0, f"--test-every-seconds must be >= 0, got {args.test_every_seconds}"),
        (args.confirm_every_steps >= 0,
         f"--confirm-every-steps must be >= 0 (0 = off), got {args.confirm_every_steps}"),
        (args.status_every_seconds > 0, f"--status-every-seconds must be > 0, got {args.status_every_seconds}"),
        (args.checkpoint_every_seconds > 0,
         f"--checkpoint-every-seconds must be > 0, got {args.checkpoint_every_seconds}"),
    ]
    errors += [msg for ok, msg in checks if not ok and not (skip and msg.startswith(skip))]
    errors += size_problems(args, ("score_window", "workers", "agents", "envs_per_agent", "predictors", "trainers"))
    errors += confirm_problems(args)
    if args.optimizer == "RMSprop" and args.amsgrad and "amsgrad" in getattr(args, "_given", ()):
        errors.append("--amsgrad is Adam's variant and RMSprop has none, so it would change nothing: leave it out, or "
                      "use --optimizer Adam")
    errors += [f"--{name.replace('_', '-')} must be < 2**63 (a step count the checkpoint holds), got {value}"
               for name in STEP_COUNT_FLAGS if (value := getattr(args, name)) >= STEP_COUNT_LIMIT]
    cut_to_schedule(args)
    if args.distributed_step_size is not None and any(n < 1 for n in args.distributed_step_size):
        errors.append(f"--distributed-step-size values must be >= 1, got {args.distributed_step_size}")
    dss = args.distributed_step_size
    if dss and isinstance(args.workers, int) and len(dss) > args.workers >= 1:  # worker r takes value r % len
        errors.append(f"--distributed-step-size gives {len(dss)} values for {args.workers} worker(s): worker r takes "
                      f"value r, so only the first {args.workers} would be used: give at most {args.workers}, or "
                      f"more --workers")
    if dss and "num_steps" in getattr(args, "_given", ()) and args.num_steps >= 1 and min(dss) >= 1:  # else: own line
        errors.append("--num-steps changes nothing with --distributed-step-size, which gives every worker its rollout "
                      "length: leave one of them out")
    errors += validate_ga3c(args)
    if not errors:  # every size below is valid
        errors += memory_problems(args)
    errors += validate_train_envs(args)
    errors += frame_flag_problems(args)
    errors += other_mode_flags(args)
    errors += validate_ray(args)
    # on a Ray cluster the GPUs are the nodes' (checked against the cluster's); a ``local`` cluster's are this
    # machine's
    errors += validate_gpu_ids(args.gpu_ids, machine=args.ray_address in (None, "local"))
    errors += validate_dir(args.save_model_dir, "--save-model-dir")
    log_dir_errors = validate_dir(args.log_dir, "--log-dir")
    errors += log_dir_errors or log_file_problems(args)  # the files in it, where the folder itself will do
    if not any("--gpu-ids" in e for e in errors):
        errors += validate_precision(args)
    return errors


def memory_problems(args: argparse.Namespace, memory: int | None = None) -> list[str]:
    """One line where the run's rollouts, updates and queue alone would need more memory than this machine has
    (``memory``, default ``machine_memory()``), so that it is refused at the start instead of killed for memory
    later: an A3G worker holds a rollout of up to ``--num-steps`` frames (``--distributed-step-size``'s), a GA3C
    trainer an update of ``--train-batch`` segments of as many frames, at ``UPDATE_BYTES_PER_FRAME`` (fp32's, the
    larger), and GA3C's queue ``--queue-size`` segments; a rollout or segment ends with its game, so never more
    than ``--max-episode-length`` frames. Not on Ray, whose nodes' memory is theirs, nor on a GPU, whose memory
    holds the updates (not estimated)."""
    if args.ray_address is not None or (args.gpu_ids and args.gpu_ids[0] >= 0):
        return []
    memory = machine_memory() if memory is None else memory
    if not memory:
        return []
    cap = args.max_episode_length
    given = getattr(args, "_given", ())
    if args.mode == "ga3c":
        trainers = args.dynamic_max[0] if args.dynamic else args.trainers
        frames = min(args.num_steps, cap)
        per_queued = SEGMENT_BYTES_PER_FRAME + (REPLAY_BYTES_PER_FRAME if args.replay_activations else 0)
        updates = trainers * args.train_batch * frames * UPDATE_BYTES_PER_FRAME
        queue = args.queue_size * frames * per_queued
        need = updates + queue
        cut = f", cut at --max-episode-length {cap:,}" if args.num_steps > cap else ""
        count = f"--dynamic-max {trainers:,}" if args.dynamic else f"--trainers {trainers:,}"
        batch = (f"--train-batch {args.train_batch:,}" if "train_batch" in given else
                 f"--train-batch {args.train_batch:,}, from --agents x --envs-per-agent")
        what = (f"{trainers:,} trainer(s) ({count}) with updates of {args.train_batch:,} segments ({batch}) of up to "
                f"{frames:,} frames (--num-steps {args.num_steps:,}{cut}), {updates / 2**30:,.1f} GiB at 2.2 MiB a "
                f"frame, and a queue of {args.queue_size:,} segment(s) (--queue-size), {queue / 2**30:,.1f} GiB,")
        fix = ("use a smaller --num-steps (default 20), --train-batch or --queue-size, or fewer trainers "
               f"({'--dynamic-max' if args.dynamic else '--trainers'})")
    else:
        steps = args.distributed_step_size or [args.num_steps]
        lengths = [min(rollout_length(args, r), cap) for r in range(args.workers)]
        need = sum(lengths) * UPDATE_BYTES_PER_FRAME
        flag = ("--distributed-step-size " + " ".join(map(str, args.distributed_step_size))
                if args.distributed_step_size else f"--num-steps {args.num_steps:,}")
        cut = f", cut at --max-episode-length {cap:,}" if max(steps) > cap else ""
        what = (f"{args.workers:,} worker(s) with rollouts of up to {max(lengths):,} frames ({flag}{cut}), at 2.2 MiB "
                f"a frame of an update,")
        fix = (("use smaller --distributed-step-size values" if args.distributed_step_size else
                "use a smaller --num-steps (default 20)") + (" or fewer --workers" if args.workers > 1 else ""))
    if need <= memory:
        return []
    return [f"{what} would hold about {need / 2**30:,.1f} GiB, more than the {memory / 2**30:,.1f} GiB this machine "
            f"has: {fix}"]


def frame_flag_problems(args: argparse.Namespace) -> list[str]:
    """A training run's ``--skip-rate`` (other than 4) where no id it plays (``--env``, ``--train-envs``) is a
    NoFrameskip one, whose skip it sets, or ``--see-skipped-frames`` where every id is: either would change nothing
    (an unknown id is refused elsewhere)."""
    from environment import EnvIdError, resolve_env_id
    try:
        by_us = {e: resolve_env_id(e).frameskip_by_us for e in [args.env, *(args.train_envs or [])]}
    except EnvIdError:
        return []
    errors = []
    if args.skip_rate != 4 and not any(by_us.values()):
        errors.append(f"--skip-rate {args.skip_rate} changes nothing here: it sets the skip of NoFrameskip ids, and "
                      f"{', '.join(by_us)} skip{'s' if len(by_us) == 1 else ''} frames in the emulator; leave it out")
    if args.see_skipped_frames and all(by_us.values()):
        errors.append(f"--see-skipped-frames changes nothing here: NoFrameskip ids ({', '.join(by_us)}) show the max "
                      f"over the skipped frames already; leave it out")
    return errors


def confirm_problems(args: argparse.Namespace) -> list[str]:
    """A ``--confirm-every-steps`` given where it would change nothing: without ``--target-score`` (it confirms a
    target), or not sooner than a step cadence ``--test-every-steps`` that is on."""
    if "confirm_every_steps" not in getattr(args, "_given", ()) or args.confirm_every_steps == 0:
        return []
    if args.target_score is None:
        return [f"--confirm-every-steps {args.confirm_every_steps}: the monitor confirms --target-score this often "
                f"once a game reaches it, and no --target-score is given: add one, or leave the flag out"]
    if args.test_every_steps == 0 and args.test_every_seconds == 0:
        return [f"--confirm-every-steps {args.confirm_every_steps}: with --test-every-steps 0 and "
                f"--test-every-seconds 0 the monitor plays its games back to back, so it would change nothing: "
                f"leave it out"]
    if 0 < args.test_every_steps <= args.confirm_every_steps:
        return [f"--confirm-every-steps {args.confirm_every_steps} is not sooner than --test-every-steps "
                f"{args.test_every_steps}, so it would change nothing: give a smaller one, or leave it out"]
    return []


def results_txt(args: argparse.Namespace) -> Path | None:
    """GA3C's ``results.txt`` (upstream's file of learner games, one per ``--log-dir``: its lines do not name the
    env) where this run writes one, GA3C mode on one machine; None otherwise."""
    return Path(args.log_dir) / "results.txt" if args.mode == "ga3c" and args.ray_address is None else None


def log_file_problems(args: argparse.Namespace) -> list[str]:
    """A folder where the run writes one of its log files in ``--log-dir`` (the train log, upstream's game log,
    the monitor CSV, and in GA3C mode results.txt): every write there would fail after the run started."""
    from test import csv_path, log_path, train_log_path  # here: test imports config
    folder = Path(args.log_dir)
    files = [train_log_path(folder, args.env), log_path(folder, args.env), csv_path(folder, args.env)]
    if results_txt(args) is not None:
        files.append(results_txt(args))
    return [f"{path} is a folder where this run writes its log file: move it away, or pass --log-dir DIR with "
            f"another folder" for path in files if path.is_dir()][:1]


def learner_envs(args: argparse.Namespace) -> tuple[int, str]:
    """How many learner environments the run starts with (on Ray, on each node), and which flags say so."""
    if args.mode == "ga3c":
        return args.agents * args.envs_per_agent, f"--agents {args.agents} x --envs-per-agent {args.envs_per_agent}"
    return args.workers, f"--workers {args.workers}" + (" on each node" if args.ray_address is not None else "")


def validate_train_envs(args: argparse.Namespace) -> list[str]:
    """``--train-envs``: every id known, of ``--env``'s game (hence its action set) with its crop rows, and no more
    ids than learner environments (an id past them would never be played); with ``--dynamic``, whose agents may
    drop to one, no more than one agent's envs."""
    if not args.train_envs:
        return []
    errors = []
    try:
        game = resolve_env_id(args.env).game
        crop = load_env_config(args.env_config, args.env)
    except (EnvIdError, ValueError, OSError):
        game = crop = None  # reported for --env or --env-config; the ids are still checked
    for env_id in args.train_envs:
        try:
            other = resolve_env_id(env_id).game
        except EnvIdError as e:
            errors.append(f"--train-envs: {e}")
            continue
        if game is not None and other != game:
            errors.append(f"--train-envs: {env_id} is {other}, not {game}: every learner env must be --env's game "
                          f"({args.env}), in any of its versions (e.g. ALE/{game}-v5, {game}NoFrameskip-v4)")
        elif crop is not None:
            try:
                other_crop = load_env_config(args.env_config, env_id)
            except ValueError as e:
                errors.append(f"--train-envs: env config '{args.env_config}' is not valid for {env_id}: {e}")
                continue
            if other_crop != crop:
                errors.append(f"--train-envs: {args.env_config} crops {env_id} otherwise than {args.env}; give both "
                              f"ids the same entry")
    counts = (args.agents, args.envs_per_agent) if args.mode == "ga3c" else (args.workers,)
    if all(isinstance(c, int) and c > 0 for c in counts):  # bad counts are reported for their own flags
        n, flags = learner_envs(args)
        if args.mode == "ga3c" and args.dynamic and args.envs_per_agent < len(args.train_envs):
            errors.append(f"--train-envs gives {len(args.train_envs)} ids and --dynamic may leave one agent, whose "
                          f"--envs-per-agent {args.envs_per_agent} envs play only the first {args.envs_per_agent}; "
                          f"give at most {args.envs_per_agent} ids, or more --envs-per-agent")
        elif n < len(args.train_envs):
            errors.append(f"--train-envs gives {len(args.train_envs)} ids for {n} learner envs ({flags}): the ids past "
                          f"the first {n} would never be played; give at most {n}, or more learner envs")
    return errors


def train_env_id(args: argparse.Namespace, index: int) -> str:
    """The env id that learner ``index`` (an A3G worker's rank, a GA3C env slot) plays."""
    ids = getattr(args, "train_envs", None)
    return ids[index % len(ids)] if ids else args.env


def train_envs_line(args: argparse.Namespace) -> str | None:
    """What the learners play when ``--train-envs`` is given, e.g. ``learners play ALE/Pong-v5 (8 envs),
    PongNoFrameskip-v4 (8 envs); the monitor plays ALE/Pong-v5``; None without it."""
    if not args.train_envs:
        return None
    n, _ = learner_envs(args)
    counts = collections.Counter(train_env_id(args, i) for i in range(n))  # in the order of first appearance
    kind = "envs" if args.mode == "ga3c" else "workers"
    parts = ", ".join(f"{env_id} ({c} {kind if c > 1 else kind[:-1]})" for env_id, c in counts.items())
    return (f"learners play {parts}{' on each node' if args.ray_address is not None else ''}"
            f"{' (at the start: --dynamic changes the agents)' if args.mode == 'ga3c' and args.dynamic else ''}; "
            f"the monitor plays {args.env}")


def other_mode_flags(args: argparse.Namespace) -> list[str]:
    """One line when the command line gives flags that only the mode it does not run has (the parser records the
    given ones in ``args._given``): they would be ignored."""
    given = getattr(args, "_given", ())
    names = ", ".join
    if args.mode == "a3g":
        wrong = [f"--{d.replace('_', '-')}" for d in GA3C_ONLY_DESTS if d in given]
        if wrong:
            return [f"{names(wrong)}: only GA3C mode has {'them' if len(wrong) > 1 else 'it'}, and this command runs "
                    f"A3G mode (--mode a3g, or --workers, --distributed-step-size or --ray-address given); leave "
                    f"{'them' if len(wrong) > 1 else 'it'} out, or run GA3C mode with --mode ga3c"]
    else:
        wrong = [f"--{d.replace('_', '-')}" for d in A3G_ONLY_DESTS if d in given]
        if wrong:
            return [f"{names(wrong)}: only A3G mode has {'them' if len(wrong) > 1 else 'it'}, and this command runs "
                    f"GA3C mode (--mode ga3c); leave {'them' if len(wrong) > 1 else 'it'} out (GA3C mode's "
                    f"processes are --agents, --predictors and --trainers), or run A3G mode with --mode a3g"]
    return []


def compute_devices(args: argparse.Namespace) -> list[torch.device]:
    """The devices a run computes on: the CPU, or the GPUs of ``--gpu-ids`` (on Ray, the nodes' GPUs are not
    this machine's: ``auto`` is then resolved on the driver's CPU)."""
    if not args.gpu_ids or args.gpu_ids[0] < 0 or getattr(args, "ray_address", None) is not None:
        return [torch.device("cpu")]
    return [torch.device("cuda", g) for g in sorted(set(args.gpu_ids))]


def validate_precision(args: argparse.Namespace) -> list[str]:
    """Resolves ``--precision`` for the run's devices into ``args.compute_precision`` (``fp32`` or ``bf16``);
    returns the problems (bf16 asked for on a GPU without it)."""
    args.compute_precision, errors, _ = precision.resolve(args.precision, compute_devices(args))
    return errors


def precision_warnings(args: argparse.Namespace) -> list[str]:
    """The lines to print before a run whose ``--precision`` was validated (bf16 on a CPU without native bf16)."""
    return precision.resolve(args.precision, compute_devices(args))[2]


def validate_ga3c(args: argparse.Namespace) -> list[str]:
    """Problems with the GA3C flags (checked in either mode, so a typo never waits for ``--mode ga3c``); fills in
    the derived defaults of ``--agents``, ``--train-batch`` and ``--dynamic-max``."""
    if args.agents is None:
        args.agents = usable_cores()
    if args.dynamic_max is None:
        args.dynamic_max = [min(2 * max(1, getattr(args, name)), SIZE_LIMITS[name])
                            for name in ("trainers", "predictors", "agents")]
    if args.train_batch is None:
        args.train_batch = default_train_batch(max(1, most_agents(args)) * max(1, args.envs_per_agent))
    errors = [f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
              for name in ("agents", "envs_per_agent", "predictors", "trainers", "predict_batch", "train_batch",
                           "queue_size", "sync_every") if getattr(args, name) < 1]
    if args.is_clip < 0:
        errors.append(f"--is-clip must be > 0 (or 0 = off), got {args.is_clip:g}")
    errors += train_passes_problems(args)
    if args.mode == "ga3c":
        from ga3c.buffers import ordering_problem
        problem = ordering_problem()
        if problem:
            errors.append(problem)
    if args.dynamic_seconds <= 0:
        errors.append(f"--dynamic-seconds must be > 0, got {args.dynamic_seconds:g}")
    errors += short_game_problems(args) + unused_ga3c_flags(args)
    if args.dynamic_max is not None:
        for name, bound, start in zip(("trainers", "predictors", "agents"), args.dynamic_max,
                                      (args.trainers, args.predictors, args.agents)):
            if bound < start:
                errors.append(f"--dynamic-max: the bound for {name} ({bound}) is below --{name} {start}")
            elif bound > SIZE_LIMITS[name]:  # it sizes the run's shared state as --agents etc. do
                errors.append(f"--dynamic-max: the bound for {name} must be at most {SIZE_LIMITS[name]:,}, got "
                              f"{bound:,}")
    return errors


def unused_ga3c_flags(args: argparse.Namespace) -> list[str]:
    """One line for each GA3C flag given where it would change nothing (``args._given``): ``--pass-clip`` or
    ``--later-passes`` with one pass, ``--short-game-length`` or ``--short-games-after-score`` without short-game
    slots, ``--dynamic-seconds`` or ``--dynamic-max`` without ``--dynamic``. In A3G mode the other-mode line names
    them all."""
    given = getattr(args, "_given", ())
    if args.mode != "ga3c":
        return []
    used = {"pass_clip": args.train_passes > 1, "later_passes": args.train_passes > 1,
            "short_game_length": args.short_game_slots > 0, "dynamic_seconds": args.dynamic,
            "dynamic_max": args.dynamic, "short_games_after_score": args.short_game_slots > 0}
    after = args.short_games_after_score
    valid = {"pass_clip": 0 < args.pass_clip < 1, "short_game_length": args.short_game_length >= 3,  # else: its own
             "dynamic_seconds": 0 < args.dynamic_seconds < math.inf, "dynamic_max": True,           # line, only
             "later_passes": True, "short_games_after_score": after is not None and math.isfinite(after)}
    unused = [(flag, why) for flag, dest, why in (
        ("--pass-clip", "pass_clip", "it clips the surrogate of --train-passes 2 or more; give those too"),
        ("--later-passes", "later_passes", "it says what the passes after the first of --train-passes 2 or more "
                                           "train; give those too"),
        ("--short-game-length", "short_game_length", "it is the cut of --short-game-slots K; give that too"),
        ("--short-games-after-score", "short_games_after_score",
         "it says when the cut of --short-game-slots K starts; give that too"),
        ("--dynamic-seconds", "dynamic_seconds", "it is --dynamic's measuring window; give --dynamic too"),
        ("--dynamic-max", "dynamic_max", "it bounds what --dynamic tries; give --dynamic too"),
    ) if dest in given and valid[dest] and not used[dest]]
    return [f"{flag} changes nothing here: {why}, or leave it out" for flag, why in unused]


def cut_to_schedule(args: argparse.Namespace) -> None:
    """``--max-steps`` as the run uses it: the value asked for (kept in ``args._max_steps_asked`` the first time),
    cut to the end of ``--lr-anneal-steps`` where that comes first or ``--max-steps`` is 0: the learning rate is 0
    from there on, so the run stops there."""
    if not hasattr(args, "_max_steps_asked"):
        args._max_steps_asked = args.max_steps
    asked = args._max_steps_asked
    anneal = args.lr_anneal_steps
    args.max_steps = anneal if anneal > 0 and (asked == 0 or asked > anneal) else asked


def max_steps_cut_line(args: argparse.Namespace) -> str | None:
    """The start-up line for a ``--max-steps`` given on the command line and cut to the end of
    ``--lr-anneal-steps`` (``cut_to_schedule``); None otherwise."""
    asked = getattr(args, "_max_steps_asked", args.max_steps)
    if "max_steps" not in getattr(args, "_given", ()) or asked in (0, args.max_steps):  # 0: the start line says
        return None
    return (f"--max-steps {asked:,} is cut to {args.max_steps:,}, the end of --lr-anneal-steps (the learning rate is 0 "
            f"from there): give --lr-anneal-steps {asked:,} to anneal over the whole run, or 0 for a constant --lr")


def train_passes_problems(args: argparse.Namespace) -> list[str]:
    """``--train-passes K`` (K >= 1) and ``--pass-clip EPS`` (0 < EPS < 1); K > 1 is not combined with
    ``--is-clip`` or ``--greedy-slots`` (their importance weights and the clipped surrogate are two different
    policy terms)."""
    errors = []
    if args.train_passes < 1:
        errors.append(f"--train-passes must be >= 1 (1 = one optimizer step per batch), got {args.train_passes}")
    if math.isfinite(args.pass_clip) and not 0 < args.pass_clip < 1:  # not finite: validate's own line
        errors.append(f"--pass-clip must be between 0 and 1 (exclusive), got {args.pass_clip:g}")
    if args.train_passes > 1:
        both = [flag for flag, on in (("--is-clip", 0 < args.is_clip < math.inf),  # inf: validate's own line
                                      ("--greedy-slots", getattr(args, "greedy_slots", 0) > 0)) if on]
        default = "train_passes" not in getattr(args, "_given", ("train_passes",))
        if both:
            errors.append(f"--train-passes {args.train_passes}{' (GA3C mode default)' if default else ''} trains "
                          f"with the clipped surrogate, which is not combined with {' or '.join(both)}; leave "
                          f"{'it' if len(both) == 1 else 'them'} out, or {'add' if default else 'use'} "
                          f"--train-passes 1")
    return errors


def short_game_problems(args: argparse.Namespace) -> list[str]:
    """``--short-game-slots K``, ``--short-game-length L`` and ``--greedy-slots G``: K, G >= 0 and L >= 3 (the
    reset's FIRE and action 2 count in it), checked in either mode; in GA3C mode also L below
    ``--max-episode-length`` when K > 0 (else the cut changes nothing), and sampled whole games left after the K
    short and the G greedy slots: at least one env slot, and one for each ``--train-envs`` id (with ``--dynamic``,
    within one agent's slots, since its agents may drop to one)."""
    errors = []
    k, length = args.short_game_slots, args.short_game_length
    g = getattr(args, "greedy_slots", 0)
    if k < 0:
        errors.append(f"--short-game-slots must be >= 0 (0 = none), got {k}")
    if g < 0:
        errors.append(f"--greedy-slots must be >= 0 (0 = none), got {g}")
    if length < 3:
        errors.append(f"--short-game-length must be >= 3 (the reset's FIRE and action 2 count in it), got {length}")
    if args.mode != "ga3c" or k < 0 or g < 0 or k + g == 0:
        return errors
    if (k > 0 and length >= 3 and isinstance(args.max_episode_length, int) and args.max_episode_length >= 3
            and length >= args.max_episode_length):  # a max below 3: its own line
        errors.append(f"--short-game-length {length} must be below --max-episode-length {args.max_episode_length}, "
                      f"or the short games are not shorter")
    if args.agents < 1 or args.envs_per_agent < 1:
        return errors
    slots, flags = ((args.envs_per_agent, f"--envs-per-agent {args.envs_per_agent} (--dynamic may leave one "
                                          f"agent)") if args.dynamic else
                    (args.agents * args.envs_per_agent,
                     f"--agents {args.agents} x --envs-per-agent {args.envs_per_agent}"))
    if g == 0:  # the wording users of --short-game-slots alone have seen
        if k >= slots:
            errors.append(f"--short-game-slots {k} leaves none of the {slots} env slots of {flags} for whole games; "
                          f"give at most {slots - 1}")
        elif args.train_envs:
            whole = {train_env_id(args, s) for s in range(k, slots)}
            cut_only = list(dict.fromkeys(i for i in args.train_envs if i not in whole))
            if cut_only:
                errors.append(f"--short-game-slots {k}: {', '.join(cut_only)} (--train-envs) would play only cut games "
                              f"in the {slots} env slots of {flags}; give fewer short slots, or list "
                              f"{'it' if len(cut_only) == 1 else 'them'} again in --train-envs")
        return errors
    taken = f"--greedy-slots {g}" + (f" and --short-game-slots {k}" if k else "")
    if k + g >= slots:
        errors.append(f"{taken} leave none of the {slots} env slots of {flags} for sampled whole games; give at "
                      f"most {slots - 1} in all")
    elif args.train_envs:
        sampled = {train_env_id(args, s) for s in range(k + g, slots)}
        missing = list(dict.fromkeys(i for i in args.train_envs if i not in sampled))
        if missing:
            errors.append(f"{taken}: {', '.join(missing)} (--train-envs) would have no sampled whole games in the "
                          f"{slots} env slots of {flags}; give fewer, or list {'it' if len(missing) == 1 else 'them'} "
                          f"again in --train-envs")
    return errors


def greedy_slots_line(args: argparse.Namespace) -> str | None:
    """The start-up line for ``--greedy-slots``; None without it."""
    g = args.greedy_slots
    if args.mode != "ga3c" or g <= 0:
        return None
    first, n = max(args.short_game_slots, 0), args.agents * args.envs_per_agent
    which = f"env slot {first} of {n} acts" if g == 1 else f"env slots {first}-{first + g - 1} of {n} act"
    return (f"{which} greedily, as the monitor does (--greedy-slots): policy-gradient terms weighted by pi(a), "
            f"games not counted as learner games")


def short_games_line(args: argparse.Namespace, started: float | None = None) -> str | None:
    """The start-up line for ``--short-game-slots``; None without it. ``started``: the
    ``--short-games-after-score`` that the checkpoint's run reached, where this run goes on cutting from the start
    (``ga3c.run.short_games_go_on``)."""
    k = args.short_game_slots
    if args.mode != "ga3c" or k <= 0:
        return None
    n = args.agents * args.envs_per_agent
    which = f"env slot 0 of {n} plays" if k == 1 else f"env slots 0-{k - 1} of {n} play"
    after = getattr(args, "short_games_after_score", None)
    when = ("" if after is None else
            f", from the start: the checkpoint's run reached its --short-games-after-score "
            f"{started:g}" if started is not None else
            f", once the monitor's mean over its last {args.score_window} games reaches {after:g} "
            f"(--short-games-after-score; whole games until then)")
    return (f"{which} games cut at {args.short_game_length} agent steps (--short-game-slots){when}, not counted "
            f"as learner games")


MAX_SYNC_SECONDS = 86_400


def validate_ray(args: argparse.Namespace) -> list[str]:
    """Problems with the multi-node flags (before anything connects to Ray)."""
    errors = []
    if args.nodes < 1:
        errors.append(f"--nodes must be >= 1, got {args.nodes}")
    if args.sync_seconds <= 0:
        errors.append(f"--sync-seconds must be > 0, got {args.sync_seconds:g}")
    elif args.sync_seconds > MAX_SYNC_SECONDS:  # a node's wait on it overflows beyond threading.TIMEOUT_MAX
        errors.append(f"--sync-seconds must be at most {MAX_SYNC_SECONDS:,} (a day), got {args.sync_seconds:g}")
    if args.ray_address is None:
        if args.nodes > 1:
            errors.append(f"--nodes {args.nodes} needs --ray-address (auto, HOST:PORT, or local for one machine)")
        unused = [f"--{d.replace('_', '-')}" for d in ("sync_seconds", "merge") if d in getattr(args, "_given", ())]
        if unused:
            errors.append(f"{', '.join(unused)}: only runs with --ray-address use {'them' if len(unused) > 1 else 'it'}"
                          f" (a node's sync with the parameter server): add --ray-address, or leave "
                          f"{'them' if len(unused) > 1 else 'it'} out")
        return errors
    if not args.ray_address.strip():
        errors.append("--ray-address is empty: give auto, HOST:PORT or local")
    for flag in ("--lr-anneal-steps", "--entropy-anneal-steps"):
        dest = flag[2:].replace("-", "_")
        ga3c_default = (dest == "lr_anneal_steps" and args.mode == "ga3c"
                        and dest not in getattr(args, "_given", (dest,)))
        if getattr(args, dest) and not ga3c_default:  # --mode ga3c's own line says to leave out one of the two
            errors.append(f"{flag} needs the global step count in every worker, which Ray nodes do not have: "
                          f"drop {flag} or --ray-address")
    if args.ema_steps:
        errors.append("--ema-steps averages the weights where the optimizer steps, which on Ray is the parameter "
                      "server, not built for it: drop --ema-steps or --ray-address")
    if all(g < 0 for g in args.gpu_ids) and len(args.gpu_ids) > 1:
        errors.append("--gpu-ids: give -1 once for the CPU")
    elif any(g < 0 for g in args.gpu_ids) and any(g >= 0 for g in args.gpu_ids):
        errors.append(f"--gpu-ids: do not mix -1 (CPU) with GPU ids {args.gpu_ids}")
    return errors


def rollout_length(args: argparse.Namespace, rank: int) -> int:
    """Worker ``rank``'s rollout length: ``dss[rank % len]`` when given, else ``--num-steps``."""
    if args.distributed_step_size:
        return args.distributed_step_size[rank % len(args.distributed_step_size)]
    return args.num_steps


def config_dict(args: argparse.Namespace) -> dict:
    """The resolved configuration as plain values (saved in the log and in every checkpoint); not the parser's own
    records (names that start with ``_``)."""
    out = {}
    for k, v in sorted(vars(args).items()):
        if k.startswith("_"):
            continue
        out[k] = list(v) if isinstance(v, (list, tuple)) else v
    return out

"""How far GA3C's replayed-activations gradient is from a self-consistent one when the weights moved since acting.

    python benchmarks/replay_lag.py --json replay_lag.json

A predictor acts on real Atari frames with the shared weights W_v (model version v) and saves each frame's conv
activations (``--replay-activations``). Before a trainer uses those segments, k real optimizer updates land
(``Trainer.update`` on other segments acted on at the same moment), so the trainer holds W_{v+k}. Three gradients
of the same batch's loss are compared:

- *mixed*: every frame's saved activations replayed (``assemble(..., version=None)``) under the LSTM, heads and
  conv weights of W_{v+k}: what a trainer computed before it compared versions;
- *current*: everything at W_{v+k}, the conv encoder run again (the ``--no-replay-activations`` path);
- *acting*: everything at W_v, the weights that acted.

and the trainer's own (``assemble(..., version=<its version>)``, which replays only the frames acted on by the
weights it holds) against *current*. For each lag k in ``--lags`` and each of ``--batches`` rounds: act, then
apply the updates one by one, measuring at each lag on the way (the rounds follow one another, so later rounds
start from weights trained by the earlier ones). Reported: the relative L2 error ``|g - ref| / |ref|`` and the
cosine similarity, of the whole gradient and per parameter group (conv1-4, the LSTM, the actor and critic heads),
the mean over the rounds.

Every segment measured is acted on entirely by W_v (the open segments are dropped before each round's acting),
and the updates between acting and training run with the encoder again on their own segments, so the weight path
does not depend on the replay. Nothing is written but ``--json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ga3c.agent import AgentStepper, AtariEnvFactory, EnvRunner  # noqa: E402
from ga3c.buffers import EnvSlots  # noqa: E402
from ga3c.predictor import Predictor, SlotStates  # noqa: E402
from ga3c.segment import Segment  # noqa: E402
from ga3c.settings import Ga3cSettings  # noqa: E402
from ga3c.stats import Ga3cCounters  # noqa: E402
from ga3c.trainer import Trainer, assemble, batch_loss  # noqa: E402
from model import A3Clstm  # noqa: E402
from player_util import sync_weights  # noqa: E402
from shared_optim import make_optimizer  # noqa: E402

GROUPS = {"all": ("",), "conv": ("conv",), "lstm": ("lstm.",), "heads": ("actor_linear.", "critic_linear.")}
COMPARISONS = {  # name: (gradient, reference)
    "mixed_vs_current": ("mixed", "current"),
    "mixed_vs_acting": ("mixed", "acting"),
    "current_vs_acting": ("current", "acting"),
    "trainer_vs_current": ("trainer", "current"),
}


class Actors:
    """One predictor (a private channels-last copy of ``shared``, saving conv activations) and one agent's env
    runners on real ALE, stepped in turn in this thread, as GA3C's server and agent processes step them."""

    def __init__(self, shared: A3Clstm, counters: Ga3cCounters, *, env: str, envs: int, num_steps: int,
                 seed: int):
        factory = AtariEnvFactory(env, str(ROOT / "config.json"), seed=seed)
        self.envs = [factory(s) for s in range(envs)]
        buffers = EnvSlots(envs)
        private = A3Clstm(1, shared.num_actions, shared.hidden_size).channels_last().eval()
        self.closed: list[Segment] = []
        self.predictor = Predictor(private, buffers, range(envs), SlotStates(envs, shared.hidden_size),
                                   num_steps=num_steps, predict_batch=envs, counters=counters,
                                   sink=self.closed.append, source=shared, seed=seed, save_activations=True)
        self.stepper = AgentStepper(0, [EnvRunner(s, self.envs[s], buffers, seed + s) for s in range(envs)],
                                    buffers, counters)
        self.stepper.begin()

    def collect(self, n: int, max_steps: int = 100_000) -> list[Segment]:
        """``n`` segments acted on entirely by the shared weights of now (the open ones are dropped first)."""
        self.predictor.open.clear()
        self.closed.clear()
        for _ in range(max_steps):
            self.predictor.step()
            self.stepper.poll()
            if len(self.closed) >= n:
                return self.closed[:n]
        raise RuntimeError(f"the predictor closed {len(self.closed)} of {n} segments in {max_steps} steps")

    def close(self) -> None:
        for env in self.envs:
            env.close()


def without_activations(segments: list[Segment]) -> list[Segment]:
    return [dataclasses.replace(s, acts=None) for s in segments]


def gradient(model: A3Clstm, segments: list[Segment], settings: Ga3cSettings,
             version: int | None) -> dict[str, torch.Tensor]:
    """The gradient of the batch's summed A3C loss at ``model``'s weights, by parameter name (``version``: which
    frames' saved activations are replayed, see ``ga3c.trainer.assemble``)."""
    model.zero_grad(set_to_none=True)
    loss, _ = batch_loss(model, assemble(segments, version=version), settings)
    loss.total.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def compare(g: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per parameter group: ``rel`` = |g - ref| / |ref| and ``cos`` = <g, ref> / (|g| |ref|) (float64)."""
    out = {}
    for group, prefixes in GROUPS.items():
        names = [k for k in ref if k.startswith(prefixes)]
        a = torch.cat([g[k].double().flatten() for k in names])
        b = torch.cat([ref[k].double().flatten() for k in names])
        out[group] = {"rel": float((a - b).norm() / b.norm()), "cos": float(a @ b / (a.norm() * b.norm()))}
    return out


def measure(opts: argparse.Namespace) -> dict:
    torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    env = AtariEnvFactory(opts.env, str(ROOT / "config.json"))(0)
    n_actions = env.action_space.n
    env.close()
    shared = A3Clstm(1, n_actions, opts.hidden_size)
    if opts.model_file:
        from checkpoint import read_weights, state_dict_of
        shared.load_state_dict(state_dict_of(read_weights(opts.model_file), opts.model_file))
    shared.share_memory()
    counters = Ga3cCounters(1, 1, 1)
    settings = Ga3cSettings(num_steps=opts.num_steps, train_batch=opts.train_batch, predict_batch=opts.envs,
                            is_clip=opts.is_clip or None)
    trainer = Trainer(shared, make_optimizer(opts.optimizer, shared.parameters(), opts.lr), settings,
                      counters=counters)
    work = A3Clstm(1, n_actions, opts.hidden_size).channels_last().train()
    acting = A3Clstm(1, n_actions, opts.hidden_size).channels_last().train()
    actors = Actors(shared, counters, env=opts.env, envs=opts.envs, num_steps=opts.num_steps, seed=opts.seed)
    b, lags = opts.train_batch, sorted(set(opts.lags))
    rounds = []
    t0 = time.perf_counter()
    try:
        for _ in range(opts.warmup_updates):
            trainer.update(without_activations(actors.collect(b)))
        for _ in range(opts.batches):
            segments = actors.collect(b * (1 + lags[-1]))
            measured, movers = segments[:b], segments[b:]
            v = counters.version
            assert all(bool((s.versions == v).all()) for s in segments)
            sync_weights(acting, shared)
            grads = {"acting": gradient(acting, without_activations(measured), settings, None)}
            row, done = {}, 0
            for k in lags:
                while done < k:  # a real update on other segments acted on by W_v
                    trainer.update(without_activations(movers[done * b: (done + 1) * b]))
                    done += 1
                sync_weights(work, shared)
                version = counters.version
                grads["current"] = gradient(work, without_activations(measured), settings, None)
                grads["mixed"] = gradient(work, measured, settings, None)
                grads["trainer"] = gradient(work, measured, settings, version)
                row[k] = {"lag": version - v, **{name: compare(grads[a], grads[r])
                                                 for name, (a, r) in COMPARISONS.items()}}
            rounds.append(row)
    finally:
        actors.close()
    mean = {k: {name: {group: {m: statistics.mean(r[k][name][group][m] for r in rounds) for m in ("rel", "cos")}
                       for group in GROUPS} for name in COMPARISONS} for k in lags}
    return {"env": opts.env, "envs": opts.envs, "train_batch": b, "num_steps": opts.num_steps,
            "hidden_size": opts.hidden_size, "optimizer": opts.optimizer, "lr": opts.lr, "is_clip": opts.is_clip,
            "warmup_updates": opts.warmup_updates, "model_file": opts.model_file, "seed": opts.seed,
            "torch": torch.__version__, "seconds": time.perf_counter() - t0, "lags": lags,
            "rounds": [{str(k): r[k] for k in r} for r in rounds], "mean": {str(k): mean[k] for k in lags}}


def report(res: dict) -> None:
    print(f"{res['env']}: {res['train_batch']} segments x {res['num_steps']} steps per batch, hidden "
          f"{res['hidden_size']}, {res['optimizer']} lr {res['lr']:g}, {res['warmup_updates']} warm-up updates"
          f"{', ' + res['model_file'] if res['model_file'] else ''}; mean over {len(res['rounds'])} batch(es) per "
          f"lag ({res['seconds']:.0f} s)")
    titles = {"mixed_vs_current": "replayed activations (mixed) vs the gradient at the current weights",
              "mixed_vs_acting": "replayed activations (mixed) vs the gradient at the acting weights",
              "current_vs_acting": "current vs acting weights (how far the two references are apart)",
              "trainer_vs_current": "the trainer's gradient (replays only frames of its own version) vs current"}
    groups = list(GROUPS)
    for name, title in titles.items():
        print(f"\n{title}")
        print(f"  {'lag':>3s}  " + "".join(f"{'rel ' + g:>11s}" for g in groups) + "  "
              + "".join(f"{'cos ' + g:>11s}" for g in groups))
        for k in res["lags"]:
            m = res["mean"][str(k)][name]
            print(f"  {k:3d}  " + "".join(f"{m[g]['rel']:11.2e}" for g in groups) + "  "
                  + "".join(f"{m[g]['cos']:11.6f}" for g in groups))


def lag_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--envs", type=int, default=8, help="env slots the predictor acts for")
    p.add_argument("--train-batch", type=int, default=4, help="segments per batch (measured and per update)")
    p.add_argument("--num-steps", type=int, default=20, help="steps per segment")
    p.add_argument("--hidden-size", type=int, default=512, help="LSTM hidden size")
    p.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 4, 8],
                   help="updates between acting and training to measure at")
    p.add_argument("--batches", type=int, default=3, help="rounds (measured batches) per lag")
    p.add_argument("--optimizer", default="Adam", choices=["Adam", "RMSprop"])
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of the updates (default: 1e-4, A3G mode's; GA3C mode's in main.py is 2e-4)")
    p.add_argument("--is-clip", type=float, default=0.0, help="as main.py's --is-clip; 0 = off")
    p.add_argument("--warmup-updates", type=int, default=0, help="updates before the first round")
    p.add_argument("--model-file", help="start from this .dat or .ckpt instead of a fresh initialisation")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", help="also write the results here")
    return p


def main(argv=None) -> int:
    opts = lag_parser().parse_args(argv)
    problems = [f"--{name.replace('_', '-')} must be >= 1" for name in
                ("envs", "train_batch", "num_steps", "hidden_size", "batches", "threads") if getattr(opts, name) < 1]
    problems += ["--lags must be >= 0"] if min(opts.lags) < 0 else []
    problems += ["--warmup-updates must be >= 0"] if opts.warmup_updates < 0 else []
    problems += ["--lr must be > 0"] if opts.lr <= 0 else []
    problems += ["--is-clip must be >= 0"] if opts.is_clip < 0 else []
    from cli import validate_file
    from environment import EnvIdError, resolve_env_id
    try:
        resolve_env_id(opts.env)
    except EnvIdError as e:
        problems.append(f"--env: {e}")
    if opts.json:
        problems += validate_file(opts.json, "--json")
    for msg in problems:
        print(f"replay_lag.py: error: {msg}", file=sys.stderr)
    if problems:
        return 2
    res = measure(opts)
    report(res)
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

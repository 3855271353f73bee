"""A training worker: act, replay the rollout with gradients, hand the gradients to the shared model, step the
shared optimizer; repeat until told to stop (a3g.md section 6, with upstream's defects fixed)."""
from __future__ import annotations

from argparse import Namespace

import torch

from config import rollout_length, train_env_id
from environment import atari_env, load_env_config, normalizer
from losses import A3CLoss
from model import A3Clstm
from player_util import Agent, GradientHandoff, Rollout, rollout_loss, sync_weights
from precision import compute_dtype
from run_state import RunState
from averaging import update_average
from schedules import linear_anneal
from shared_optim import make_optimizer, set_lr
from utils import describe_failure, end_child_process, setup_child_process, use_device, worker_device


def update(model: A3Clstm, rollout: Rollout, handoff: GradientHandoff, optimizer: torch.optim.Optimizer,
           args: Namespace, entropy_coef: float | None = None) -> tuple[A3CLoss, float]:
    """One A3C update from ``rollout``, exactly as every worker makes it: replay the rollout through the local
    ``model`` (which acted it), backward, clip to ``--max-grad-norm`` when set, hand the gradients to the shared
    model and step ``optimizer`` on it. ``entropy_coef``: the entropy bonus weight (default ``--entropy-coef``).
    Returns the loss terms and the gradient's L2 norm before clipping."""
    if entropy_coef is None:
        entropy_coef = args.entropy_coef
    loss = rollout_loss(model, rollout, gamma=args.gamma, tau=args.tau, entropy_coef=entropy_coef,
                        value_coef=args.value_coef)
    params = [p for p, _ in handoff.pairs]
    model.zero_grad(set_to_none=True)
    loss.total.backward()
    if args.max_grad_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
    else:
        grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    handoff()
    optimizer.step()
    return loss, grad_norm


def run_worker(rank: int, args: Namespace, shared_model: A3Clstm, optimizer: torch.optim.Optimizer | None,
               run: RunState, device: torch.device, max_updates: int | None = None,
               average_model: A3Clstm | None = None) -> int:
    """The worker loop; returns the number of updates made. Runs in-process too (tests, one-process debugging).

    ``optimizer`` is the shared optimizer, or None for a private one (``--no-shared-optimizer``).
    ``average_model`` (``--ema-steps``): blended with the shared weights after every step (``averaging``).
    Stops when ``run.stop`` is set, when the global step count reaches ``--max-steps``, or after ``max_updates``.
    """
    torch.manual_seed(args.seed + rank)
    env_id = train_env_id(args, rank)
    env = atari_env(env_id, load_env_config(args.env_config, env_id), max_episode_length=args.max_episode_length,
                    skip_rate=args.skip_rate, episodic_life=True, see_skipped=args.see_skipped_frames)
    env.action_space.seed(args.seed + rank)
    mean, std, count = run.norm_stats[rank].tolist()
    if count > 0:
        normalizer(env).set_stats(mean, std, int(count))
    if optimizer is None:
        optimizer = make_optimizer(args.optimizer, shared_model.parameters(), args.lr, args.amsgrad, shared=False,
                                   eps=args.optimizer_eps)
    model = A3Clstm(1, env.action_space.n, args.hidden_size).channels_last().to(device)
    model.set_precision(compute_dtype(args.compute_precision))
    model.train()
    agent = Agent(model, env, device, seed=args.seed + rank)
    handoff = GradientHandoff(model, shared_model)
    num_steps = rollout_length(args, rank)
    updates = 0
    run.mark_ready(rank)
    while not run.stop.is_set():
        if args.max_steps and run.global_steps.value >= args.max_steps:
            break
        if max_updates is not None and updates >= max_updates:
            break
        sync_weights(model, shared_model)
        rollout = agent.rollout(num_steps)
        steps_now = run.global_steps.value
        if args.lr_anneal_steps:
            set_lr(optimizer, linear_anneal(args.lr, steps_now, args.lr_anneal_steps))
        entropy_coef = linear_anneal(args.entropy_coef, steps_now, args.entropy_anneal_steps)
        loss, grad_norm = update(model, rollout, handoff, optimizer, args, entropy_coef)
        updates += 1
        steps = rollout.actions.shape[0]
        if average_model is not None:
            update_average(average_model, shared_model, steps, args.ema_steps)
        run.add_steps(rank, steps)
        run.record_update(rank, steps, loss.policy.item() / steps, loss.value.item() / steps,
                          loss.entropy.item() / steps, grad_norm)
        m, s, n = normalizer(env).get_stats()
        run.norm_stats[rank] = torch.tensor([m, s, float(n)], dtype=torch.float64)
    return updates


def train(rank: int, args: Namespace, shared_model: A3Clstm, optimizer: torch.optim.Optimizer | None,
          run: RunState, average_model: A3Clstm | None = None) -> None:
    """Process entry point of worker ``rank``: set the process up, run the loop, report any error."""
    setup_child_process(f"worker {rank}")
    device = worker_device(args.gpu_ids, rank)
    try:
        use_device(device)
        run_worker(rank, args, shared_model, optimizer, run, device, average_model=average_model)
    except BaseException as e:  # report (never blocks), then exit non-zero: the main process stops the run
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            run.errors.report(rank, f"worker {rank}", describe_failure(e))
        end_child_process(1)
    end_child_process(0)

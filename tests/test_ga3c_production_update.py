"""GA3C mode's whole update, as ``main.py --mode ga3c`` builds it and its server makes it, equals a slow,
obviously-correct reference step for step, for every parameter and every optimizer option.

Production path: the shared model and optimizer built as in ``main.py`` (the shared one from ``make_optimizer``,
or the server's private one for ``--no-shared-optimizer``); ``Ga3cRun``'s env slots and counters; the server
``server_process`` starts (``build_server``: its channels-last private predictor model,
the predictor saving conv activations for the trainer with ``--replay-activations``, its trainer with the
channels-last working copy, ``GradientHandoff`` and the step lock); the agent's ``EnvRunner``s on real Pong.
The predictor and the agent are stepped in this thread instead of their own (same calls, deterministic order).

Reference: a contiguous model with the reference weights; for each segment, upstream's batch-1
``A3Clstm.forward`` from the segment's initial LSTM state at every step, then ``segment_loss`` (the repo's
``losses.a3c_loss``, with the importance-weighted policy term for ``--is-clip``); the gradients summed over the
batch's segments, optionally clipped, then ``torch.optim`` with ``foreach=False`` (the plain per-tensor loop).

The batches are made with no policy lag (the segments open when an update lands are dropped), so the frames' conv
activations saved at acting time are exactly those of the current weights; the lag itself is covered in
test_ga3c_trainer.py. With no lag every importance weight of ``--is-clip`` is about 1, so the ``--is-clip`` cases
make the behaviour probabilities differ from the current policy: their recorded ``mu`` is scaled by factors
between 0.5 and 2, and without ``--replay-activations`` (where the trainer runs the convolutions again) the
segments open at an update are kept, so later batches hold steps acted by older weights as well. There the
weights must be far from 1, the trainer's mean weight the reference's, and the handed-off gradient the
reference's weighted one, far from the unweighted one. With ``--greedy-slots 1`` env slot 0 takes the argmax
with mu = 1, and its segments' policy terms are weighted by pi(a) in the trainer and in the reference alike
(again far from the unweighted gradient). With ``--train-passes K`` the reference makes K optimizer steps on each
batch, each on the clipped surrogate's gradient (``segment_loss`` with ``pass_clip``) at the weights the previous
one left, with ``mu`` scaled by 0.15 to 2 so that the clip and the dual clip (ratios past 3) matter (far from the
unweighted gradient); with ``--later-passes lstm`` each pass after the first is the reference's gradient of a model
whose convolutions are the weights the batch's first pass started from and whose LSTM and heads are the current
ones, handed to the optimizer for the LSTM and heads only (the conv gradients None, so ``torch.optim`` leaves the
conv weights, their statistics and their step counts alone: the optimizer states' ``step`` then differ between
the convs and the rest, and are compared). This test fails when the fused Adam is handed the working
copy's channels-last conv gradients unconverted (conv2-conv4 off by about lr after one step). With ``--ema-steps``
the moving average the trainer keeps (``main.start_average``'s, as ``Ga3cRun`` hands it to the server) is, after
every update, the previous one blended toward the new shared weights by ``1 - exp(-steps / N)``. After every
update each tensor's handed-off gradient is compared with the reference's (relative 1e-3), then the weights. The
reference takes gamma, tau, the coefficients and the clips from the flags, not from ``Ga3cSettings`` as the
server does, the optimizers' eps from ``--optimizer-eps``, and each step's learning rate from GA3C mode's default
schedule (``--lr-anneal-steps 1500000``) at the run's global steps: a few hundred steps into it, the rate differs
from ``--lr`` by about 2e-4 of itself, which moves the weights by less than the tolerance but, through max-pool
near-ties and the clip's edges, moves later gradients by more (test_schedules.py tests the schedule itself). The
cases run GA3C mode's default of two passes per batch unless they give ``--train-passes``.
"""
import dataclasses
import math

import pytest
import torch

from conftest import assert_same_optimizer_state, collect_batch, relative_difference, segments_reference_backward
from config import build_parser, validate_ga3c
from ga3c.agent import AgentStepper, AtariEnvFactory, EnvRunner
from ga3c.run import Ga3cRun
from ga3c.server import build_server
from ga3c.settings import Ga3cSettings
from main import start_average
from model import A3Clstm
from schedules import linear_anneal
from shared_optim import make_optimizer

UPDATES = 3


@torch.no_grad()
def reference_importance_weights(model, segments, is_clip):
    """``min(pi(a)/mu(a), is_clip)`` of every step, ``pi`` from upstream's batch-1 forward of ``model``."""
    weights = []
    for s in segments:
        hx, cx = s.state
        for i in range(len(s)):
            _, logits, (hx, cx) = model(s.frames[i: i + 1], (hx, cx))
            pi = torch.softmax(logits, 1)[0, s.actions[i]]
            weights.append(torch.clamp(pi / s.mu[i], max=is_clip))
    return torch.stack(weights)


def reference_optimizer(name, params, lr, amsgrad, eps=None):
    """``torch.optim``'s plain loop with SharedAdam's and the private Adam's settings (betas (0.9, 0.999)) or
    RMSprop's (alpha 0.99), and upstream's eps unless ``--optimizer-eps`` gives one."""
    if name == "Adam":
        return torch.optim.Adam(params, lr=lr, eps=1e-3 if eps is None else eps, amsgrad=amsgrad, foreach=False)
    return torch.optim.RMSprop(params, lr=lr, alpha=0.99, eps=0.1 if eps is None else eps, foreach=False)


R = "--replay-activations"
P1 = ["--train-passes", "1"]  # one optimizer step per batch, the plain A3C loss (the default is two passes)
CASES = [  # (optimizer, amsgrad, shared, extra flags); every case with GA3C mode's learning-rate schedule
    ("Adam", False, True, [R]), ("Adam", True, True, [R]), ("RMSprop", False, True, [R]),
    ("Adam", False, False, [R, *P1]), ("Adam", True, False, [R, *P1]), ("RMSprop", False, False, [R, *P1]),
    ("Adam", False, True, [R, *P1, "--max-grad-norm", "0.5"]),
    ("Adam", True, True, [R, *P1, "--is-clip", "1.0"]),
    ("Adam", False, True, [*P1, "--ema-steps", "50"]),  # every frame's convolutions run again, averaged
    ("RMSprop", False, True, [*P1, "--max-grad-norm", "0.5", "--is-clip", "10", "--tau", "0.92", "--gamma", "0.95"]),
    # slot 0 acts greedily: its policy terms weighted by pi(a). Seed 3: with seeds 1 and 2 one conv4 max-pool window
    # (of 16,384) comes within 3e-7 of a tie at the third update, which the contiguous and the channels-last kernels
    # break differently, so the conv gradients differ by up to 7e-3: another valid subgradient, not a defect.
    ("Adam", False, True, [*P1, "--greedy-slots", "1", "--seed", "3"]),
    # three optimizer steps per batch, each on the clipped surrogate's gradient at the weights the last one left;
    # the first pass replays the saved activations, the later ones (the weights moved) run the convolutions again
    ("Adam", False, True, [R, "--train-passes", "3"]),
    # seed 3: with seed 1 a max-pool window comes near a tie at the second update (the heads' gradients agree to
    # 4e-6, conv1's differ by 3e-3), as with the greedy case above
    ("RMSprop", False, False, ["--train-passes", "2", "--pass-clip", "0.1", "--seed", "3"]),
    # the average blends once per batch; seed 3, as above (seed 1 meets a max-pool near-tie in the second batch)
    ("Adam", False, True, ["--train-passes", "3", "--ema-steps", "50", "--seed", "3"]),
    # the loss's other coefficients and the optimizer's eps, shared and in the server's private optimizer
    ("Adam", False, True, [R, *P1, "--value-coef", "0.25", "--entropy-coef", "0.05", "--optimizer-eps", "1e-5"]),
    ("Adam", False, False, [*P1, "--optimizer-eps", "1e-5", "--hidden-size", "64"]),
    ("RMSprop", False, True, [R, *P1, "--optimizer-eps", "0.01", "--value-coef", "1.0"]),
    # every pass's gradient clipped
    ("Adam", False, True, [R, "--train-passes", "2", "--max-grad-norm", "0.5", "--seed", "3"]),
    # the later passes on the LSTM and heads only, from the first pass's conv features (replayed ones here, run
    # again in the next case), every gradient clipped in the second; the convs' optimizer steps are one per batch
    ("Adam", False, True, [R, "--train-passes", "3", "--later-passes", "lstm"]),
    ("RMSprop", False, False, ["--later-passes", "lstm", "--max-grad-norm", "0.5", "--seed", "3"]),
    ("Adam", True, True, ["--later-passes", "lstm", "--ema-steps", "50", "--seed", "3"]),
]


@pytest.mark.parametrize("name,amsgrad,shared,extra", CASES,
                         ids=["-".join([n + ("-amsgrad" if a else ""), "shared" if s else "private"] +
                                       [x.lstrip("-") for x in e]) for n, a, s, e in CASES])
def test_server_update_equals_the_reference_for_every_parameter(tmp_path, name, amsgrad, shared, extra):
    flags = ["--mode", "ga3c", "--optimizer", name, "--lr", "1e-3", "--agents", "1", "--envs-per-agent", "3",
             "--train-batch", "2", "--num-steps", "8", "--trainers", "1", "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path),
             *extra]
    if amsgrad:
        flags.append("--amsgrad")
    if not shared:
        flags.append("--no-shared-optimizer")
    args = build_parser().parse_args(flags)
    assert validate_ga3c(args) == []
    settings = Ga3cSettings.from_args(args)
    assert settings.replay_activations == (R in extra)
    assert args.lr_anneal_steps == 1_500_000 and settings.lr_anneal_steps == 1_500_000  # GA3C mode's default

    # main.py
    factory = AtariEnvFactory(args.env, args.env_config, args.max_episode_length, args.skip_rate, seed=args.seed)
    envs = [factory(s) for s in range(args.envs_per_agent)]
    n = envs[0].action_space.n
    torch.manual_seed(args.seed)
    shared_model = A3Clstm(1, n, args.hidden_size)
    shared_model.share_memory()
    optimizer = (make_optimizer(args.optimizer, shared_model.parameters(), args.lr, args.amsgrad, shared=True,
                                eps=args.optimizer_eps) if args.shared_optimizer else None)
    run = Ga3cRun(args, shared_model, optimizer, log=None)
    run.average_model = start_average(args, shared_model, None, None, log=None)
    assert (run.average_model is not None) == (args.ema_steps > 0)
    try:
        # server_process
        server = build_server(args, shared_model, optimizer, run.buffers, run.counters, run.run.stop,
                              run.average_model)
        (predictor,), (trainer,) = server.predictors, server.trainers
        assert trainer.model.conv3.weight.is_contiguous(memory_format=torch.channels_last)
        assert not trainer.model.conv3.weight.is_contiguous() and shared_model.conv3.weight.is_contiguous()
        assert predictor.save_activations == settings.replay_activations
        # agent_process
        stepper = AgentStepper(0, [EnvRunner(s, envs[s], run.buffers, args.seed + s) for s in range(len(envs))],
                               run.buffers, run.counters)
        stepper.begin()

        ref_model = A3Clstm(1, n, args.hidden_size)
        ref_model.load_state_dict(shared_model.state_dict())
        ref_params = list(ref_model.parameters())
        ref_opt = reference_optimizer(name, ref_params, args.lr, args.amsgrad, args.optimizer_eps)
        names = [k for k, _ in shared_model.named_parameters()]
        initial = A3Clstm(1, n, args.hidden_size)
        initial.load_state_dict(shared_model.state_dict())

        average = None if run.average_model is None else [p.double().clone() for p in run.average_model.parameters()]
        g = torch.Generator().manual_seed(11)
        passes, pass_clip = args.train_passes, (args.pass_clip if args.train_passes > 1 else None)
        lstm_only = passes > 1 and args.later_passes == "lstm"
        assert settings.later_passes == args.later_passes
        off_policy = settings.is_clip is not None or pass_clip is not None  # mu scaled off the current policy
        lagged = off_policy and not settings.replay_activations
        greedy_seen = 0
        for u in range(UPDATES):
            batch = collect_batch(predictor, stepper, server.segments, settings.train_batch)
            for seg in batch:
                assert seg.greedy == (seg.slot in settings.greedy_slot_ids())
                assert bool((seg.mu == 1).all()) if seg.greedy else bool((seg.mu < 1).all())
            greedy_seen += sum(seg.greedy for seg in batch)
            weighted = off_policy or any(seg.greedy for seg in batch)
            assert all(seg.acts is not None for seg in batch) == settings.replay_activations
            if off_policy:  # behaviour probabilities off the current policy (see the docstring)
                low = 0.5 if pass_clip is None else 0.15  # the passes: some ratios past the dual clip's 3 too
                for seg in batch:
                    factors = low + (2.0 - low) * torch.rand(len(seg), generator=g)
                    if pass_clip is not None:
                        factors[0] = 0.2  # a ratio of about 5 in every segment
                    seg.mu = (seg.mu * factors).clamp(max=1.0)
                if pass_clip is not None:
                    assert bool((reference_importance_weights(ref_model, batch, math.inf) > 3).any())
                weights = reference_importance_weights(ref_model, batch, settings.is_clip or math.inf)
                assert (weights - 1).abs().max() > 0.2, f"update {u}: every importance weight is about 1"
            result = trainer.update(batch)
            assert result.steps == sum(len(seg) for seg in batch)
            if average is not None:  # the shared weights blended in by the update's agent steps (averaging.py)
                w = 1 - math.exp(-result.steps / args.ema_steps)
                average = [a + w * (p.detach().double() - a) for a, p in zip(average, shared_model.parameters())]
                for key, p, a in zip(names, run.average_model.parameters(), average):
                    assert (p.double() - a).abs().max() <= 1e-6, f"update {u}: the average's {key} is not the blend"
            assert result.lag_max >= 1 if (lagged and u > 0) or passes > 1 else result.lag_max == 0
            if settings.is_clip is not None:
                assert result.weight_mean == pytest.approx(weights.mean().item(), rel=1e-4)
            if not lagged:  # no policy lag in the next batch: drop what was acted on with the old weights
                server.open_segments.clear()
                while not server.segments.empty():
                    server.segments.get_nowait()

            first_convs = {k: v.clone() for k, v in ref_model.state_dict().items() if k.startswith("conv")}
            for k in range(passes):  # the flags as given, not Ga3cSettings (production's reading of them)
                if lstm_only and k > 0:  # the first pass's convolutions, the current LSTM and heads
                    hybrid = A3Clstm(1, n, args.hidden_size)
                    hybrid.load_state_dict({**ref_model.state_dict(), **first_convs})
                    segments_reference_backward(hybrid, batch, is_clip=args.is_clip or None, gamma=args.gamma,
                                                tau=args.tau, entropy_coef=args.entropy_coef,
                                                value_coef=args.value_coef, pass_clip=pass_clip)
                    for key, rp, hp in zip(names, ref_params, hybrid.parameters()):
                        rp.grad = None if key.startswith("conv") else hp.grad
                else:
                    segments_reference_backward(ref_model, batch, is_clip=args.is_clip or None, gamma=args.gamma,
                                                tau=args.tau, entropy_coef=args.entropy_coef,
                                                value_coef=args.value_coef, pass_clip=pass_clip)
                if weighted:  # the weights change the gradient by far more than float rounding
                    unweighted = A3Clstm(1, n, args.hidden_size)
                    unweighted.load_state_dict({**ref_model.state_dict(), **(first_convs if lstm_only and k else {})})
                    segments_reference_backward(unweighted, [dataclasses.replace(seg, greedy=False) for seg in batch],
                                                is_clip=None, gamma=args.gamma, tau=args.tau,
                                                entropy_coef=args.entropy_coef, value_coef=args.value_coef)
                    change = max(relative_difference(p.grad, q.grad)
                                 for p, q in zip(unweighted.parameters(), ref_params) if q.grad is not None)
                    assert change > 0.05, f"update {u}: the importance weights change the gradient by {change:.2g}"
                if args.max_grad_norm > 0:  # over the gradients there are (clip_grad_norm_ skips None)
                    norm = torch.nn.utils.clip_grad_norm_(ref_params, args.max_grad_norm)
                    assert norm > args.max_grad_norm, f"update {u}: the gradient (norm {norm:.3g}) is not clipped"
                for group in ref_opt.param_groups:  # the schedule at the run's global steps (no agent steps between)
                    group["lr"] = linear_anneal(args.lr, int(run.counters.agent_steps.sum()), args.lr_anneal_steps)
                ref_opt.step()

            for key, sp, rp in zip(names, shared_model.parameters(), ref_params):
                if lstm_only and key.startswith("conv"):  # the last pass handed no conv gradient
                    assert sp.grad is None and rp.grad is None, f"update {u}: {key} has a gradient in a later pass"
                    diff = (sp.detach() - rp.detach()).abs().max().item()
                    assert diff <= 1e-2 * args.lr, f"update {u}: {key} differs from the reference by {diff:.3g}"
                    continue
                assert sp.grad is not None and sp.grad.stride() == sp.stride(), f"update {u}: {key} grad layout"
                # the handed-off gradient is the reference's (weighted where it is): a small term of the loss (the
                # entropy bonus) moves the weights by less than the tolerance below, its gradient by more than 1e-3
                diff = relative_difference(sp.grad, rp.grad)
                assert diff <= 1e-3, f"update {u}: {key}'s gradient differs from the reference's by {diff:.2g}"
                diff = (sp.detach() - rp.detach()).abs().max().item()
                # float32 rounding of two different gradient computations: ~1e-6; a wrong update: ~lr
                assert diff <= 1e-2 * args.lr, f"update {u}: {key} differs from the reference by {diff:.3g}"
        assert run.counters.version == UPDATES * passes
        assert (greedy_seen > 0) == (settings.greedy_slots > 0), greedy_seen
        assert_same_optimizer_state(trainer.optimizer, list(shared_model.parameters()), ref_opt, ref_params, names)
        for key, p, q in zip(names, shared_model.parameters(), initial.parameters()):
            assert (p.detach() - q.detach()).abs().max() > 0, f"{key} never moved"
    finally:
        for env in envs:
            env.close()
        run.release()

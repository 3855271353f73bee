"""``--lr-anneal-steps`` and ``--entropy-anneal-steps``: the learning rate and the entropy bonus weight fall
linearly from ``--lr`` and ``--entropy-coef`` to 0 at that many global agent steps.

The schedule is a pure function tested against hand-computed values; then the production paths: the A3G worker
loop (``train.run_worker``) and GA3C's server-built trainer (``build_server``), each with its optimizer's ``step``
wrapped so that every step is checked against ``torch.optim`` (``foreach=False``) stepped by hand on the same
gradient with the schedule's learning rate at the global step count of that moment, and with the loss function they
call wrapped to record the entropy weight it is given; then the flags' validation, and ``main.py`` end to end in
GA3C mode, resumed with a longer schedule and with another ``--lr``.
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import collect_batch
from config import build_parser, validate, validate_ray
from ga3c.agent import AgentStepper, AtariEnvFactory, EnvRunner
from ga3c.run import Ga3cRun
from ga3c.server import build_server
from model import A3Clstm
from run_state import RunState
from schedules import linear_anneal
from shared_optim import SharedAdam, make_optimizer, set_lr
from train import run_worker

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def test_linear_anneal_by_hand():  # the learning rate's and the entropy bonus's schedule
    assert linear_anneal(1e-4, 0, 1000) == pytest.approx(1e-4)
    assert linear_anneal(1e-4, 250, 1000) == pytest.approx(7.5e-5)
    assert linear_anneal(1e-4, 999, 1000) == pytest.approx(1e-7)
    assert linear_anneal(1e-4, 1000, 1000) == 0.0
    assert linear_anneal(1e-4, 5000, 1000) == 0.0  # never negative
    assert linear_anneal(1e-4, 10**9, 0) == 1e-4  # 0: no schedule


def test_set_lr_sets_every_group():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([{"params": [a]}, {"params": [b]}], lr=1e-3)
    set_lr(opt, 2.5e-4)
    assert [g["lr"] for g in opt.param_groups] == [2.5e-4, 2.5e-4]


def reference_optimizer(name, params, lr, amsgrad):
    """``torch.optim``'s plain loop with the settings ``make_optimizer`` gives (upstream A3G's eps and alpha)."""
    if name == "Adam":
        return torch.optim.Adam(params, lr=lr, eps=1e-3, amsgrad=amsgrad, foreach=False)
    return torch.optim.RMSprop(params, lr=lr, alpha=0.99, eps=0.1, foreach=False)


class CheckedStep:
    """Wraps ``optimizer.step``: before each step, steps the reference optimizer (``torch.optim``, ``foreach=False``)
    on copies of the parameters with their gradients at ``linear_anneal(lr, steps(), anneal)``; after it, the
    parameters must equal the copies. Records the learning rates."""

    def __init__(self, optimizer, params, lr, anneal, steps, name="Adam", amsgrad=False):
        self.optimizer, self.params, self.lr, self.anneal, self.steps = optimizer, list(params), lr, anneal, steps
        self.copies = [p.detach().clone().requires_grad_(True) for p in self.params]
        self.reference = reference_optimizer(name, self.copies, lr, amsgrad)
        self.real_step = optimizer.step
        self.lrs: list[float] = []
        optimizer.step = self

    def __call__(self, *a, **k):
        expected = linear_anneal(self.lr, self.steps(), self.anneal)
        for c, p in zip(self.copies, self.params):
            assert p.grad is not None
            c.grad = p.grad.detach().clone()
            with torch.no_grad():
                c.copy_(p)
        for g in self.reference.param_groups:
            g["lr"] = expected
        self.reference.step()
        out = self.real_step(*a, **k)
        self.lrs.append(expected)
        for c, p in zip(self.copies, self.params):
            diff = (c.detach() - p.detach()).abs().max().item()
            # float32 rounding of two step implementations: ~1e-8; a step at another lr: a sizeable part of lr
            assert diff <= 1e-2 * self.lr, f"step {len(self.lrs)}: off the annealed step by {diff:.3g}"
        return out


@pytest.mark.parametrize("name,amsgrad", [("Adam", False), ("Adam", True), ("RMSprop", False)],
                         ids=["Adam", "AMSGrad", "RMSprop"])
@pytest.mark.parametrize("shared_optimizer", [True, False], ids=["shared", "private"])
def test_a3g_worker_steps_with_the_annealed_lr(tmp_path, monkeypatch, shared_optimizer, name, amsgrad):
    """The real worker loop, resumed at 50 global steps of a 200-step schedule: its four 20-step updates step at
    lr x (1 - 50/200), (1 - 70/200), ...; for every optimizer, shared (``make_optimizer`` as ``main.py`` calls it)
    or the private one ``run_worker`` builds. Then it goes on to the schedule's end, where the learning rate
    reaches 0, and stops there."""
    import train
    flags = ["--workers", "1", "--hidden-size", "32", "--lr", "1e-3", "--lr-anneal-steps", "200", "--log-dir",
             str(tmp_path), "--save-model-dir", str(tmp_path), "--optimizer", name]
    flags += ["--amsgrad"] if amsgrad else []
    args = build_parser().parse_args(flags + ([] if shared_optimizer else ["--no-shared-optimizer"]))
    assert validate(args) == [] and args.max_steps == 200
    torch.manual_seed(0)
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    run = RunState(1)
    run.global_steps.value = 50
    checks = []

    def checked(opt):
        checks.append(CheckedStep(opt, shared.parameters(), args.lr, args.lr_anneal_steps,
                                  lambda: run.global_steps.value, name, amsgrad))
        return opt

    opt = (checked(make_optimizer(name, shared.parameters(), args.lr, amsgrad, shared=True)) if shared_optimizer
           else None)
    if not shared_optimizer:  # the one run_worker builds for itself
        real = train.make_optimizer
        monkeypatch.setattr(train, "make_optimizer", lambda *a, **k: checked(real(*a, **k)))
    assert run_worker(0, args, shared, opt, run, CPU, max_updates=4) == 4
    assert len(checks) == 1 and checks[0].lrs == pytest.approx([7.5e-4, 6.5e-4, 5.5e-4, 4.5e-4])
    assert run_worker(0, args, shared, opt, run, CPU) >= 1
    assert 200 <= run.global_steps.value < 200 + args.num_steps
    lrs = [lr for c in checks for lr in c.lrs]
    assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 0


def test_a3g_worker_without_a_schedule_keeps_the_lr(tmp_path):
    args = build_parser().parse_args(["--workers", "1", "--hidden-size", "32", "--lr", "1e-3", "--max-steps", "0",
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    assert validate(args) == [] and args.lr_anneal_steps == 0 and args.max_steps == 0
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    opt = SharedAdam(shared.parameters(), lr=args.lr)
    run = RunState(1)
    run.global_steps.value = 10**6
    check = CheckedStep(opt, shared.parameters(), args.lr, 0, lambda: run.global_steps.value)
    run_worker(0, args, shared, opt, run, CPU, max_updates=2)
    assert check.lrs == [1e-3, 1e-3]


@pytest.mark.parametrize("name,amsgrad", [("Adam", False), ("Adam", True), ("RMSprop", False)],
                         ids=["Adam", "AMSGrad", "RMSprop"])
@pytest.mark.parametrize("shared_optimizer", [True, False], ids=["shared", "private"])
def test_ga3c_trainer_steps_with_the_linear_anneal(tmp_path, shared_optimizer, name, amsgrad):
    """The server's trainer, as ``server_process`` builds it, for every optimizer, with the run's counters resumed
    at 300 steps of a 1,000-step schedule: each update steps at the schedule's lr for the global step count when it
    steps (the agent's steps counted meanwhile included)."""
    flags = ["--mode", "ga3c", "--lr", "1e-3", "--lr-anneal-steps", "1000", "--agents", "1", "--envs-per-agent",
             "3", "--train-batch", "2", "--num-steps", "8", "--trainers", "1", "--hidden-size", "32",
             "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path), "--optimizer", name]
    flags += ["--amsgrad"] if amsgrad else []
    args = build_parser().parse_args(flags + ([] if shared_optimizer else ["--no-shared-optimizer"]))
    assert validate(args) == [] and args.max_steps == 1000
    factory = AtariEnvFactory(args.env, args.env_config, args.max_episode_length, args.skip_rate, seed=args.seed)
    envs = [factory(s) for s in range(args.envs_per_agent)]
    torch.manual_seed(args.seed)
    shared = A3Clstm(1, envs[0].action_space.n, args.hidden_size)
    shared.share_memory()
    optimizer = (make_optimizer(args.optimizer, shared.parameters(), args.lr, args.amsgrad, shared=True)
                 if args.shared_optimizer else None)
    run = Ga3cRun(args, shared, optimizer, log=None)
    try:
        run.counters.restore(300, 0)
        server = build_server(args, shared, optimizer, run.buffers, run.counters, run.run.stop)
        (predictor,), (trainer,) = server.predictors, server.trainers
        assert trainer.settings.lr == 1e-3 and trainer.settings.lr_anneal_steps == 1000
        stepper = AgentStepper(0, [EnvRunner(s, envs[s], run.buffers, args.seed + s) for s in range(len(envs))],
                               run.buffers, run.counters)
        stepper.begin()
        steps = lambda: int(run.counters.agent_steps.sum())  # noqa: E731
        check = CheckedStep(trainer.optimizer, shared.parameters(), args.lr, 1000, steps, name, amsgrad)
        for _ in range(3):
            trainer.update(collect_batch(predictor, stepper, server.segments, 2))
        passes = args.train_passes  # GA3C mode's default: two optimizer steps per batch, each at the schedule's lr
        # for the global steps when it steps (the same for both here: no agent steps between them)
        assert passes == 2 and len(check.lrs) == 3 * passes and all(a >= b for a, b in zip(check.lrs, check.lrs[1:]))
        assert all(check.lrs[k] == check.lrs[k + 1] for k in range(0, len(check.lrs), passes))
        assert 0 < check.lrs[-1] < check.lrs[0] <= 0.7 * args.lr - 1e-3 * 16 / 1000  # 300 + at least 16 steps
        assert trainer.optimizer.param_groups[0]["lr"] == check.lrs[-1]
    finally:
        for env in envs:
            env.close()
        run.release()


def test_the_flag_is_validated(tmp_path):
    def check(*flags):
        args = build_parser().parse_args(["--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path), *flags])
        return args, validate(args)

    args, errors = check("--lr-anneal-steps", "-5")
    assert errors == ["--lr-anneal-steps must be >= 0 (0 = a constant --lr), got -5"]
    args, errors = check("--lr-anneal-steps", "3000000")
    assert errors == [] and args.max_steps == 3_000_000  # the default 50M is cut to the schedule's end
    args, errors = check("--lr-anneal-steps", "3000000", "--max-steps", "1000000")
    assert errors == [] and args.max_steps == 1_000_000  # a smaller budget stays
    args, errors = check("--lr-anneal-steps", "3000000", "--max-steps", "0")
    assert errors == [] and args.max_steps == 3_000_000
    args = build_parser().parse_args(["--ray-address", "local", "--lr-anneal-steps", "1000"])
    assert any(e.startswith("--lr-anneal-steps needs the global step count") for e in validate_ray(args))


def run_main(tmp_path, *flags):
    cmd = [sys.executable, "main.py", "--env", "PongNoFrameskip-v4", "--mode", "ga3c", "--agents", "1",
           "--envs-per-agent", "2", "--train-batch", "2", "--num-steps", "10", "--hidden-size", "32",
           "--lr", "0.001", "--test-every-steps", "1000000000", "--max-episode-length", "50", "--save-model-dir", str(tmp_path / "m"),
           "--log-dir", str(tmp_path / "l"), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_main_anneals_stops_at_the_end_and_resumes_with_the_schedule(tmp_path):
    out = run_main(tmp_path, "--lr-anneal-steps", "100", "--entropy-anneal-steps", "60", "--max-steps", "5000")
    assert "stop at 100 steps" in out
    assert ("--max-steps 5,000 is cut to 100, the end of --lr-anneal-steps (the learning rate is 0 from there): give "
            "--lr-anneal-steps 5,000 to anneal over the whole run, or 0 for a constant --lr") in out
    assert "stopped: reached the end of --lr-anneal-steps 100 (the learning rate is 0)" in out
    assert "resume with:" not in out
    assert "entropy bonus 0.01 annealed linearly to 0 at 60 global steps (now 0.01)" in out
    status = [line for line in out.splitlines() if " | updates " in line]
    assert status and re.search(r"\| lr [\d.e-]+ \| entropy-coef [\d.e-]+ \| (?:fp32|bf16)$", status[-1]), status
    assert "learning rate 0.001 annealed linearly to 0 at 100 global steps (now 0.001)" in out
    ckpt = torch.load(tmp_path / "m" / "PongNoFrameskip-v4.ckpt", weights_only=False)
    steps = ckpt["global_steps"]
    # The stop line above says the budget (the schedule's end, 100) stopped it. How far past 100 the agents got is
    # not bounded: main reads the step counter every 0.2 s while they step on, faster on an idle machine.
    assert steps >= 100
    # the trainers anneal their process's copy of the optimizer's settings; the checkpoint's is main's: --lr
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == 0.001 and ckpt["optimizer"]["state"]
    # the stop line's command, run as printed: the schedule over twice the steps, from where the run stopped
    from main import longer_schedule
    longer = longer_schedule(100, steps)  # 200, or past where the run stopped if it went that far
    advice = re.search(r"to train on with the learning rate annealed over about twice the steps \(it goes on at "
                       rf"([\d.e-]+), then falls to 0 at {longer:,}\): (python .+ --load); or give --lr-anneal-steps "
                       r"0 instead for a constant --lr 0.001$", out, re.M)
    assert advice and float(advice.group(1)) == pytest.approx(linear_anneal(0.001, steps, longer), rel=1e-2), \
        out[-2000:]
    argv = shlex.split(advice.group(2))
    assert argv[:2] == ["python", "main.py"] and argv[-3:] == ["--lr-anneal-steps", str(longer), "--load"]
    assert "--max-steps" not in argv  # it would cut the longer schedule again
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    now = float(re.search(rf"annealed linearly to 0 at {longer:,} global steps \(now ([\d.e-]+)\)", out).group(1))
    assert now == pytest.approx(linear_anneal(0.001, steps, longer), rel=1e-2) and now > 0
    assert f"stopped: reached the end of --lr-anneal-steps {longer:,} (the learning rate is 0)" in out
    ckpt = torch.load(tmp_path / "m" / "PongNoFrameskip-v4.ckpt", weights_only=False)
    assert ckpt["global_steps"] >= longer and ckpt["config"]["lr_anneal_steps"] == longer
    steps = ckpt["global_steps"]
    # a longer schedule goes on from the checkpoint's steps (--max-steps below its end stops the run early), from
    # the command line's --lr; the checkpoint kept the unannealed 0.001, so the log names that as the change
    out = run_main(tmp_path, "--lr-anneal-steps", "1000", "--lr", "0.002", "--max-steps", str(steps + 100), "--load",
                   "--optimizer-eps", "1e-05", "--gamma", "0.95")
    now = float(re.search(r"annealed linearly to 0 at 1,000 global steps \(now ([\d.e-]+)\)", out).group(1))
    assert now == pytest.approx(linear_anneal(0.002, steps, 1000), rel=1e-2)
    assert "the command line changes the checkpoint's lr 0.001 -> 0.002, eps 0.001 -> 1e-05" in out
    assert torch.load(tmp_path / "m" / "PongNoFrameskip-v4.ckpt", weights_only=False)["optimizer"]["param_groups"][0][
        "eps"] == 1e-05  # the trainers stepped the optimizer main.py built with --optimizer-eps
    assert (f"the command line changes the checkpoint's schedule: --lr-anneal-steps {longer:,} -> 1,000, "
            "--entropy-anneal-steps 60 -> 0") in out
    assert f"stopped: reached --max-steps {steps + 100:,}" in out
    # every other training flag the command line changes is named (before: --gamma went to 0.95 without a word)
    assert ("the command line changes the checkpoint's --gamma 0.99 -> 0.95 (pass the checkpoint's values to keep "
            "them: the resume line its run printed has them)") in out


def test_a3g_worker_anneals_the_entropy_bonus(tmp_path, monkeypatch):
    """The real worker loop at 100 global steps of a 400-step entropy schedule: its updates' losses get
    0.01 x (1 - 100/400), (1 - 120/400), ...; the run does not stop at the schedule's end."""
    import train
    args = build_parser().parse_args(["--workers", "1", "--hidden-size", "32", "--entropy-anneal-steps", "400",
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    assert validate(args) == [] and args.max_steps == 50_000_000
    seen = []
    real = train.rollout_loss
    monkeypatch.setattr(train, "rollout_loss", lambda *a, **k: seen.append(k["entropy_coef"]) or real(*a, **k))
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    run = RunState(1)
    run.global_steps.value = 100
    assert run_worker(0, args, shared, SharedAdam(shared.parameters(), lr=1e-4), run, CPU, max_updates=3) == 3
    assert seen == pytest.approx([0.0075, 0.007, 0.0065])
    run.global_steps.value = 400
    run_worker(0, args, shared, SharedAdam(shared.parameters(), lr=1e-4), run, CPU, max_updates=1)
    assert seen[-1] == 0.0


def test_ga3c_trainer_anneals_the_entropy_bonus(tmp_path, monkeypatch):
    """The server-built trainer at 500 steps of a 1,000-step entropy schedule: the batched loss gets the
    schedule's weight for the global step count when the update starts."""
    import ga3c.trainer
    flags = ["--mode", "ga3c", "--entropy-anneal-steps", "1000", "--agents", "1", "--envs-per-agent", "2",
             "--train-batch", "2", "--num-steps", "8", "--trainers", "1", "--hidden-size", "32",
             "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)]
    args = build_parser().parse_args(flags)
    assert validate(args) == []
    seen = []
    real = ga3c.trainer.batched_a3c_loss
    monkeypatch.setattr(ga3c.trainer, "batched_a3c_loss",
                        lambda *a, **k: seen.append((k["entropy_coef"], int(run.counters.agent_steps.sum())))
                        or real(*a, **k))
    factory = AtariEnvFactory(args.env, args.env_config, args.max_episode_length, args.skip_rate, seed=args.seed)
    envs = [factory(s) for s in range(args.envs_per_agent)]
    shared = A3Clstm(1, envs[0].action_space.n, args.hidden_size)
    shared.share_memory()
    optimizer = make_optimizer(args.optimizer, shared.parameters(), args.lr, args.amsgrad, shared=True)
    run = Ga3cRun(args, shared, optimizer, log=None)
    try:
        run.counters.restore(500, 0)
        server = build_server(args, shared, optimizer, run.buffers, run.counters, run.run.stop)
        (predictor,), (trainer,) = server.predictors, server.trainers
        stepper = AgentStepper(0, [EnvRunner(s, envs[s], run.buffers, args.seed + s) for s in range(len(envs))],
                               run.buffers, run.counters)
        stepper.begin()
        for _ in range(2):
            trainer.update(collect_batch(predictor, stepper, server.segments, 2))
        assert args.train_passes == 2 and len(seen) == 2 * 2  # each pass at the weight for the steps then
        # (the same for an update's two passes here: the agent does not step between them)
        for coef, steps in seen:
            assert steps > 500 and coef == pytest.approx(0.01 * (1 - steps / 1000))
        assert seen[0] == seen[1] and seen[2] == seen[3] and seen[2][0] < seen[0][0] < 0.005
    finally:
        for env in envs:
            env.close()
        run.release()


def test_the_entropy_flag_is_validated(tmp_path):
    args = build_parser().parse_args(["--entropy-anneal-steps", "-1", "--log-dir", str(tmp_path),
                                      "--save-model-dir", str(tmp_path)])
    assert validate(args) == ["--entropy-anneal-steps must be >= 0 (0 = a constant --entropy-coef), got -1"]
    args = build_parser().parse_args(["--ray-address", "local", "--entropy-anneal-steps", "1000"])
    assert any(e.startswith("--entropy-anneal-steps needs the global step count") for e in validate_ray(args))

"""The shared optimizers equal torch.optim step for step, keep their state in shared memory, and share it across
real processes."""
import multiprocessing as mp
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from shared_optim import SharedAdam, SharedRMSprop, make_optimizer


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


def run_pair(ours_cls, ours_kw, ref_cls, ref_kw, steps=25):
    a, b = make_params(), make_params()
    opt_a, opt_b = ours_cls(a, **ours_kw), ref_cls(b, **ref_kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt_a.step()
        opt_b.step()
        for p, q in zip(a, b):
            assert torch.allclose(p, q, atol=1e-6, rtol=0), (p - q).abs().max()
    return opt_a


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_shared_adam_matches_torch(amsgrad, wd):
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-3, weight_decay=wd, amsgrad=amsgrad)
    opt = run_pair(SharedAdam, kw, torch.optim.Adam, kw)
    for state in opt.state.values():
        assert state["step"].item() == 25
        assert all(v.is_shared() for v in state.values())
        assert ("max_exp_avg_sq" in state) == amsgrad


@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("momentum,centered", [(0.0, False), (0.9, True)])
def test_shared_rmsprop_matches_torch(wd, momentum, centered):
    kw = dict(lr=1e-2, alpha=0.99, eps=0.1, weight_decay=wd, momentum=momentum, centered=centered)
    opt = run_pair(SharedRMSprop, kw, torch.optim.RMSprop, kw)
    for state in opt.state.values():
        assert all(v.is_shared() for v in state.values())


def test_defaults_are_upstream():
    adam = SharedAdam(make_params())
    assert adam.defaults["eps"] == 1e-3 and adam.defaults["betas"] == (0.9, 0.999)
    rms = SharedRMSprop(make_params())
    assert rms.defaults["eps"] == 0.1 and rms.defaults["alpha"] == 0.99


def test_load_state_dict_keeps_state_shared_and_continues_identically():
    kw = dict(lr=1e-2, amsgrad=True)
    src = run_pair(SharedAdam, kw, torch.optim.Adam, dict(kw, eps=1e-3), steps=5)
    params = [torch.nn.Parameter(p.detach().clone()) for g in src.param_groups for p in g["params"]]
    dst = SharedAdam(params, **kw)
    before = [id(v) for s in dst.state.values() for v in s.values()]
    dst.load_state_dict(src.state_dict())
    assert [id(v) for s in dst.state.values() for v in s.values()] == before  # same shared tensors, filled in place
    for s_src, s_dst in zip(src.state.values(), dst.state.values()):
        for k in s_src:
            assert torch.equal(s_src[k], s_dst[k]) and s_dst[k].is_shared()
    # and steps on as the optimizer it was loaded from: the same weights after 5 more steps on the same gradients
    src_params = [p for g in src.param_groups for p in g["params"]]
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        for p, q in zip(src_params, params):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        src.step()
        dst.step()
    assert all(torch.equal(p, q) for p, q in zip(src_params, params))


@pytest.mark.parametrize("cls", [SharedAdam, SharedRMSprop])
def test_a_refused_state_changes_no_statistic(cls):
    """A state whose last parameter's statistics have another shape is refused before anything is copied: the
    statistics of the parameters before it stay as they were (a Ray node that refuses a join's state starts
    afresh, so it must be left whole)."""
    src = run_pair(cls, {}, cls, {}, steps=3)
    saved = src.state_dict()
    last = saved["param_groups"][0]["params"][-1]
    saved["state"][last] = {k: (v if v.dim() == 0 else torch.zeros(v.numel() + 1)) for k, v in
                            saved["state"][last].items()}
    dst = cls(make_params())
    before = [v.clone() for s in dst.state.values() for v in s.values()]
    with pytest.raises(ValueError, match="has shape"):
        dst.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, (v for s in dst.state.values() for v in s.values())))


@pytest.mark.parametrize("cls,kw", [(SharedAdam, {}), (SharedRMSprop, {})])
def test_load_state_dict_keeps_the_constructors_hyperparameters(cls, kw):
    src = cls(make_params(), lr=1e-3, **kw)
    for p in src.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    src.step()
    dst = cls(make_params(), lr=5e-5, **kw)
    dst.load_state_dict(src.state_dict())
    assert dst.param_groups[0]["lr"] == 5e-5  # the command line's rate, not the saved one
    assert cls.saved_hyperparameters(src.state_dict())[0]["lr"] == 1e-3
    assert all(s["step"].item() == 1 for s in dst.state.values())  # the statistics did come over


@pytest.mark.parametrize("src_cls, dst_cls", [(SharedRMSprop, SharedAdam), (SharedAdam, SharedRMSprop)])
def test_another_optimizers_statistics_are_refused(src_cls, dst_cls):
    src = src_cls(make_params(), lr=1e-2)
    for p in src.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    src.step()
    dst = dst_cls(make_params(), lr=1e-2)
    with pytest.raises(ValueError, match="another optimizer's statistics"):
        dst.load_state_dict(src.state_dict())


def test_resuming_plain_adam_statistics_with_amsgrad_on_steps():
    src = SharedAdam(make_params(), lr=1e-2)
    for p in src.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    src.step()
    params = make_params()
    dst = SharedAdam(params, lr=1e-2, amsgrad=True)
    dst.load_state_dict(src.state_dict())
    assert dst.param_groups[0]["amsgrad"] is True
    for p in params:
        p.grad = torch.ones_like(p)
    dst.step()  # the AMSGrad maximum starts from the loaded second moments
    for p in params:
        assert float(dst.state[p]["step"]) == 2  # the loaded step, then this one
        v = 0.999 * 0.001 + 0.001  # the second moment after two gradients of ones (beta2 0.999)
        assert torch.allclose(dst.state[p]["exp_avg_sq"], torch.full_like(p, v), rtol=1e-6, atol=0)
        assert torch.equal(dst.state[p]["max_exp_avg_sq"], dst.state[p]["exp_avg_sq"])


def test_make_optimizer_private():
    opt = make_optimizer("RMSprop", make_params(), 1e-3, shared=False)
    assert isinstance(opt, torch.optim.RMSprop) and not isinstance(opt, SharedRMSprop) and opt.defaults["eps"] == 0.1
    with pytest.raises(ValueError):
        make_optimizer("SGD", make_params(), 1e-3)


@pytest.mark.parametrize("name,ref_cls,ref_kw", [
    ("Adam", torch.optim.Adam, {}), ("RMSprop", torch.optim.RMSprop, {"alpha": 0.99})])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_make_optimizer_applies_optimizer_eps(name, ref_cls, ref_kw, shared):
    """``--optimizer-eps`` reaches the step: the same updates as torch.optim's with that eps, not upstream's
    (1e-3 / 0.1 would give other values with these gradients of about 1e-4)."""
    a, b = make_params(), make_params()
    opt = make_optimizer(name, a, 1e-2, shared=shared, eps=1e-8)
    ref = ref_cls(b, lr=1e-2, eps=1e-8, foreach=False, **ref_kw)
    assert opt.defaults["eps"] == 1e-8 and isinstance(opt, SharedAdam if name == "Adam" and shared else torch.optim.Optimizer)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        grads = [1e-4 * torch.randn(p.shape, generator=g) for p in a]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        ref.step()
    for p, q, p0 in zip(a, b, make_params()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0) and (p - p0).abs().max() > 1e-3
    assert make_optimizer(name, make_params(), 1e-2, shared=shared).defaults["eps"] == {"Adam": 1e-3, "RMSprop": 0.1}[name]


def _child_steps(params, opt, n, done):
    for _ in range(n):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    done.set()


def test_state_is_shared_across_processes():
    ctx = mp.get_context("spawn")
    params = [torch.nn.Parameter(torch.zeros(4)).share_memory_()]
    opt = SharedAdam(params, lr=0.1)
    done = ctx.Event()
    p = ctx.Process(target=_child_steps, args=(params, opt, 3, done))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and done.is_set()
    state = opt.state[params[0]]
    assert state["step"].item() == 3  # the child's steps are visible here
    assert state["exp_avg"].abs().sum() > 0
    assert params[0].abs().sum() > 0  # and so are its parameter updates


@pytest.mark.parametrize("name,amsgrad", [("Adam", False), ("Adam", True), ("RMSprop", False)])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_a_channels_last_gradient_is_applied_in_its_parameters_layout(name, amsgrad, shared):
    """torch's fused CPU Adam reads a gradient's storage with its parameter's strides; every optimizer
    ``make_optimizer`` builds must apply a channels-last gradient of a contiguous weight as the same values."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 32, 5, 5, generator=g)
    ours, ref = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt = make_optimizer(name, [ours], 1e-2, amsgrad, shared=shared)
    if name == "Adam":
        ref_opt = torch.optim.Adam([ref], lr=1e-2, eps=1e-3, amsgrad=amsgrad, foreach=False)
    else:
        ref_opt = torch.optim.RMSprop([ref], lr=1e-2, alpha=0.99, eps=0.1, foreach=False)
    for _ in range(3):
        grad = torch.randn(32, 32, 5, 5, generator=g)
        ours.grad = grad.contiguous(memory_format=torch.channels_last)
        ref.grad = grad.clone()
        opt.step()
        ref_opt.step()
        assert torch.allclose(ours, ref, atol=1e-6, rtol=0), (ours - ref).abs().max()



COMPILER_FREE_WORKER = """
import sys, torch
from config import build_parser
from model import A3Clstm
from run_state import RunState
from shared_optim import make_optimizer
from train import run_worker
args = build_parser().parse_args(["--workers", "1", "--hidden-size", "32", "--max-steps", "0",
                                  "--log-dir", sys.argv[1], "--save-model-dir", sys.argv[1]])
model = A3Clstm(1, 6, 32)  # main.py's objects and a worker's two updates, as in test_production_update.py
model.share_memory()
before = model.lstm.weight_hh.clone()
opt = make_optimizer(args.optimizer, model.parameters(), args.lr, shared=True)
assert run_worker(0, args, model, opt, RunState(1), torch.device("cpu"), max_updates=2) == 2
assert not torch.equal(before, model.lstm.weight_hh)
for name in ("Adam", "RMSprop"):
    for shared in (True, False):
        p = torch.nn.Parameter(torch.ones(3))
        o = make_optimizer(name, [p], 0.1, amsgrad=name == "Adam", shared=shared)
        p.grad = torch.ones(3)
        o.step()
        assert float(p.detach()[0]) < 1.0, (name, shared)
        o.zero_grad()
        o.load_state_dict(o.state_dict())  # what a checkpoint and a resume do
print("compiler modules:", sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_building_stepping_and_saving_an_optimizer_never_imports_the_compiler(tmp_path):
    """torch.optim's compile guards import ``torch._dynamo`` (about 2 s of CPU) in every process that builds, steps
    or saves an optimizer; the main process and each worker run the undecorated methods instead."""
    out = subprocess.run([sys.executable, "-c", COMPILER_FREE_WORKER, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "compiler modules: []"


def test_an_a3g_workers_private_optimizer_takes_optimizer_eps(tmp_path, monkeypatch):
    """--no-shared-optimizer: each A3G worker (and a Ray node's, which runs the same worker) builds its own
    optimizer in ``train.run_worker``; it must have --optimizer-eps, not upstream's 1e-3."""
    import train
    from config import build_parser, validate
    from environment import num_actions
    from model import A3Clstm
    from run_state import RunState
    args = build_parser().parse_args(["--mode", "a3g", "--workers", "1", "--no-shared-optimizer", "--optimizer-eps", "1e-5",
                                      "--hidden-size", "32", "--save-model-dir", str(tmp_path / "m"),
                                      "--log-dir", str(tmp_path / "l")])
    assert validate(args) == []
    built = []

    def spy(*a, **kw):
        built.append(make_optimizer(*a, **kw))
        return built[-1]

    monkeypatch.setattr(train, "make_optimizer", spy)
    shared = A3Clstm(1, num_actions(args.env), 32)
    train.run_worker(0, args, shared, None, RunState(1, args.score_window), torch.device("cpu"), max_updates=0)
    assert len(built) == 1 and built[0].param_groups[0]["eps"] == 1e-5

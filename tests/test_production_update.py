"""The whole production update, as ``main.py`` builds it and a worker makes it, equals a slow, obviously-correct
reference step for step, for every parameter and every optimizer option.

Production path: the shared model built and shared as in ``main.py``; the optimizer from ``make_optimizer``
(shared, or the worker's private one for ``--no-shared-optimizer``); a channels-last worker model that acts with
the ``ActivationCache``; ``train.update`` (replay, backward, optional clipping, ``GradientHandoff``, step).
Reference: a contiguous model with the reference weights, the gradient of upstream's batch-1 forward at every
step (``stepwise_rollout_loss``), and ``torch.optim`` with ``foreach=False`` (the plain per-tensor loop).

This is the test that failed when the fused Adam applied the workers' channels-last conv gradients as a
permutation of themselves (conv2-conv4 off by about 2 x lr after one step).
"""

import pytest
import torch

from conftest import assert_same_optimizer_state
from config import build_parser
from environment import atari_env, load_env_config
from model import A3Clstm
from player_util import Agent, GradientHandoff, stepwise_rollout_loss, sync_weights
from shared_optim import make_optimizer
from train import update

CPU = torch.device("cpu")
UPDATES = 4


def reference_optimizer(name, params, lr, amsgrad):
    if name == "Adam":  # SharedAdam's and the private Adam's settings: eps 1e-3, betas (0.9, 0.999)
        return torch.optim.Adam(params, lr=lr, eps=1e-3, amsgrad=amsgrad, foreach=False)
    return torch.optim.RMSprop(params, lr=lr, alpha=0.99, eps=0.1, foreach=False)


@pytest.mark.parametrize("name,amsgrad", [("Adam", False), ("Adam", True), ("RMSprop", False)])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5], ids=["noclip", "clip"])
def test_worker_update_equals_the_reference_for_every_parameter(tmp_path, name, amsgrad, shared, max_grad_norm):
    flags = ["--optimizer", name, "--lr", "1e-3", "--max-grad-norm", str(max_grad_norm), "--workers", "1",
             "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)]
    if amsgrad:
        flags.append("--amsgrad")
    if not shared:
        flags.append("--no-shared-optimizer")
    args = build_parser().parse_args(flags)
    env = atari_env(args.env, load_env_config("config.json", args.env), episodic_life=True)
    n = env.action_space.n

    # main.py
    torch.manual_seed(args.seed)
    shared_model = A3Clstm(1, n, args.hidden_size)
    shared_model.share_memory()
    optimizer = make_optimizer(name, shared_model.parameters(), args.lr, args.amsgrad, shared=True) if shared else None
    # train.run_worker
    if optimizer is None:
        optimizer = make_optimizer(name, shared_model.parameters(), args.lr, args.amsgrad, shared=False)
    model = A3Clstm(1, n, args.hidden_size).channels_last()
    model.train()
    agent = Agent(model, env, CPU, seed=args.seed)
    handoff = GradientHandoff(model, shared_model)
    assert model.conv3.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.conv3.weight.is_contiguous() and shared_model.conv3.weight.is_contiguous()

    ref_model = A3Clstm(1, n, args.hidden_size)
    ref_model.load_state_dict(shared_model.state_dict())
    ref_params = list(ref_model.parameters())
    ref_opt = reference_optimizer(name, ref_params, args.lr, args.amsgrad)
    names = [k for k, _ in shared_model.named_parameters()]
    before = [p.detach().clone() for p in shared_model.parameters()]

    for u in range(UPDATES):
        sync_weights(model, shared_model)
        rollout = agent.rollout(args.num_steps)
        update(model, rollout, handoff, optimizer, args)

        ref_model.zero_grad(set_to_none=True)
        stepwise_rollout_loss(ref_model, rollout, gamma=args.gamma, tau=args.tau, entropy_coef=args.entropy_coef,
                              value_coef=args.value_coef).total.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
        ref_opt.step()

        for key, sp, rp in zip(names, shared_model.parameters(), ref_params):
            assert sp.grad is not None and sp.grad.stride() == sp.stride(), f"update {u}: {key} grad layout"
            diff = (sp.detach() - rp.detach()).abs().max().item()
            # float32 rounding of two different gradient computations: ~1e-6; a wrong update: ~lr
            assert diff <= 1e-2 * args.lr, f"update {u}: {key} differs from the reference by {diff:.3g} (lr {args.lr})"
    assert_same_optimizer_state(optimizer, list(shared_model.parameters()), ref_opt, ref_params, names)
    # every weight moved from where it started (the reference comparison above would pass if neither moved)
    for key, p, q in zip(names, shared_model.parameters(), before):
        assert (p.detach() - q).abs().max().item() > 0, f"{key} never moved"

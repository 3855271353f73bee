"""The A3C math against hand-computed answers and against upstream's loop."""
import math

import pytest
import torch

from losses import (a3c_loss, bootstrap_value, discounted_returns, entropy, gae_advantages, policy_loss,
                    value_loss)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_returns_one_terminal_reward():
    # r = [0, 0, 1], terminal: R = [gamma^2, gamma, 1]
    R = discounted_returns(t(0, 0, 1), bootstrap=0.0, gamma=0.9)
    assert torch.allclose(R, t(0.81, 0.9, 1.0))


def test_returns_bootstrap():
    # r = [1, 1], V(s_T) = 10, gamma 0.5: R1 = 1 + 5 = 6, R0 = 1 + 3 = 4
    assert torch.allclose(discounted_returns(t(1, 1), bootstrap=10.0, gamma=0.5), t(4, 6))


def test_bootstrap_value_terminated_vs_truncated():
    assert bootstrap_value(True, torch.tensor(3.0)) == 0.0
    assert bootstrap_value(False, torch.tensor(3.0)) == 3.0


def test_gae_lambda_one_is_n_step_return_minus_value():
    r, v = t(0.5, -1, 2, 0), t(0.1, 0.2, -0.3, 0.4)
    adv = gae_advantages(r, v, bootstrap=1.5, gamma=0.97, tau=1.0)
    assert torch.allclose(adv, discounted_returns(r, 1.5, 0.97) - v, atol=1e-6)


def test_gae_lambda_zero_is_td_error():
    r, v = t(1, 2, 3), t(0.5, 0.25, 1.0)
    adv = gae_advantages(r, v, bootstrap=2.0, gamma=0.5, tau=0.0)
    assert torch.allclose(adv, t(1 + 0.5 * 0.25 - 0.5, 2 + 0.5 * 1.0 - 0.25, 3 + 0.5 * 2.0 - 1.0))


def test_gae_hand_computed():
    # gamma 0.9, tau 0.5, r = [1, 0], V = [0.5, 1.0], bootstrap 2
    # delta1 = 0 + 0.9*2 - 1 = 0.8 ; delta0 = 1 + 0.9*1 - 0.5 = 1.4
    # A1 = 0.8 ; A0 = 1.4 + 0.45*0.8 = 1.76
    adv = gae_advantages(t(1, 0), t(0.5, 1.0), bootstrap=2.0, gamma=0.9, tau=0.5)
    assert torch.allclose(adv, t(1.76, 0.8))


def test_constant_values_terminal():
    # all values c, terminal, no reward: delta_{T-1} = -c, others gamma c - c
    c, g = 2.0, 0.9
    adv = gae_advantages(t(0, 0), t(c, c), bootstrap=0.0, gamma=g, tau=1.0)
    assert torch.allclose(adv, t(-c, -c))  # n-step return is 0, minus V = c


def test_truncated_differs_from_terminated():
    r, v = t(0, 0), t(1, 1)
    term = gae_advantages(r, v, bootstrap_value(True, 5.0), 0.99, 1.0)
    trunc = gae_advantages(r, v, bootstrap_value(False, 5.0), 0.99, 1.0)
    assert torch.allclose(trunc - term, t(0.99 ** 2 * 5, 0.99 * 5))


def test_loss_terms():
    values = t(1.0, 2.0).requires_grad_()
    assert value_loss(values, t(2.0, 0.0)).item() == pytest.approx(0.5 * (1 + 4))
    logp = torch.log(t(0.5, 0.25)).requires_grad_()
    assert policy_loss(logp, t(2.0, -1.0)).item() == pytest.approx(-(math.log(0.5) * 2 - math.log(0.25)))
    uniform = torch.zeros(1, 4)
    assert entropy(uniform).item() == pytest.approx(math.log(4))
    assert entropy(torch.tensor([[100.0, 0, 0]])).item() == pytest.approx(0.0, abs=1e-6)


def upstream_loss(logits, values, actions, rewards, R, gamma, tau, entropy_coef):
    """Upstream A3G's loop, transcribed from its description (a3g.md section 6)."""
    values = list(values) + [torch.tensor(R)]
    log_probs = torch.log_softmax(logits, 1)
    probs = torch.softmax(logits, 1)
    ents = -(log_probs * probs).sum(1)
    policy_loss_, value_loss_ = 0, 0
    gae = torch.zeros(())
    R = torch.tensor(R)
    for i in reversed(range(len(rewards))):
        R = gamma * R + rewards[i]
        advantage = R - values[i]
        value_loss_ = value_loss_ + 0.5 * advantage.pow(2)
        delta_t = rewards[i] + gamma * values[i + 1].detach() - values[i].detach()
        gae = gae * gamma * tau + delta_t
        policy_loss_ = policy_loss_ - log_probs[i, actions[i]] * gae - entropy_coef * ents[i]
    return policy_loss_ + 0.5 * value_loss_


@pytest.mark.parametrize("tau,R", [(1.0, 0.0), (0.92, 1.3)])
def test_a3c_loss_equals_upstream_loop_and_gradient(tau, R):
    torch.manual_seed(0)
    T, A = 7, 6
    logits = torch.randn(T, A, requires_grad=True)
    values = torch.randn(T, requires_grad=True)
    actions = torch.randint(0, A, (T,))
    rewards = torch.randint(-1, 2, (T,)).float()
    ours = a3c_loss(logits, values, actions, rewards, R, gamma=0.99, tau=tau, entropy_coef=0.01, value_coef=0.5)
    ref = upstream_loss(logits, values, actions, rewards, R, 0.99, tau, 0.01)
    assert ours.total.item() == pytest.approx(ref.item(), rel=1e-5)
    g1 = torch.autograd.grad(ours.total, (logits, values))
    g2 = torch.autograd.grad(ref, (logits, values))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5)


def test_value_coef_and_entropy_coef_are_honoured():
    torch.manual_seed(1)
    logits, values = torch.randn(3, 4), torch.randn(3)
    actions, rewards = torch.tensor([0, 1, 2]), t(1, 0, -1)
    kw = dict(gamma=0.99, tau=1.0)
    base = a3c_loss(logits, values, actions, rewards, 0.0, entropy_coef=0.0, value_coef=0.0, **kw)
    assert base.total.item() == pytest.approx(base.policy.item())
    v = a3c_loss(logits, values, actions, rewards, 0.0, entropy_coef=0.0, value_coef=2.0, **kw)
    assert v.total.item() == pytest.approx(base.policy.item() + 2.0 * base.value.item())
    e = a3c_loss(logits, values, actions, rewards, 0.0, entropy_coef=0.1, value_coef=0.0, **kw)
    assert e.total.item() == pytest.approx(base.policy.item() - 0.1 * base.entropy.item())


def test_advantages_are_constants_of_the_policy_and_value_terms():
    """The docstrings' promise, checked on each function by itself (every caller also passes detached values): GAE
    treats the values as constants, and the policy term passes no gradient to its advantages."""
    values = torch.tensor([0.5, -0.2, 0.1], requires_grad=True)
    adv = gae_advantages(torch.tensor([0.0, 1.0, -1.0]), values, 0.3, 0.99, 0.95)
    assert not adv.requires_grad
    advantages = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    log_probs = torch.tensor([-0.1, -1.2, -0.7], requires_grad=True)
    policy_loss(log_probs, advantages).backward()
    assert advantages.grad is None and torch.equal(log_probs.grad, torch.tensor([-1.0, 2.0, -0.5]))

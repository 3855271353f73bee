"""The A3C math as pure tensor functions: n-step returns, GAE, and the loss terms.

Conventions for one rollout of length T of one agent:
- ``rewards (T,)``: clipped rewards r_0..r_{T-1}.
- ``values (T,)``: V(s_0)..V(s_{T-1}) from the critic (with gradient).
- ``bootstrap``: a scalar, V(s_T) when the rollout was cut by ``num_steps`` or by a *truncation* (time limit),
  0 when it ended by *termination* (game over or, for learners, a lost life). The caller decides, see
  ``bootstrap_value``.

Upstream (A3G, a3g.md section 6) sums the terms over the rollout, it does not average them; so do we.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


def bootstrap_value(terminated: bool, next_value: torch.Tensor | float) -> float:
    """R_T: 0 after a termination, else the critic's V(s_T) (detached). Truncation is not termination."""
    if terminated:
        return 0.0
    return float(next_value)


def discounted_returns(rewards: torch.Tensor, bootstrap: float, gamma: float) -> torch.Tensor:
    """n-step returns ``R_i = r_i + gamma R_{i+1}``, ``R_T = bootstrap``. ``(T,) -> (T,)``."""
    returns = torch.empty_like(rewards)
    running = torch.as_tensor(bootstrap, dtype=rewards.dtype)
    for i in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[i] + gamma * running
        returns[i] = running
    return returns


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, bootstrap: float, gamma: float,
                   tau: float) -> torch.Tensor:
    """Generalised advantage estimates (Schulman et al. 2016, eq. 16), ``lambda = tau``. ``(T,) -> (T,)``.

    ``delta_i = r_i + gamma V_{i+1} - V_i`` with ``V_T = bootstrap``; ``A_i = delta_i + gamma tau A_{i+1}``.
    With ``tau = 1`` this is the n-step return minus ``V_i``. ``values`` are treated as constants.
    """
    values = values.detach()
    next_values = torch.cat([values[1:], torch.as_tensor([bootstrap], dtype=values.dtype)])
    deltas = rewards + gamma * next_values - values
    adv = torch.empty_like(deltas)
    running = torch.zeros((), dtype=deltas.dtype)
    for i in range(deltas.shape[0] - 1, -1, -1):
        running = deltas[i] + gamma * tau * running
        adv[i] = running
    return adv


def value_loss(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """``sum_i 0.5 (R_i - V_i)^2`` (scalar); gradient flows into ``values`` only."""
    return 0.5 * (returns.detach() - values).pow(2).sum()


def policy_loss(log_probs_taken: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """``-sum_i log pi(a_i|s_i) A_i`` (scalar); advantages are constants."""
    return -(log_probs_taken * advantages.detach()).sum()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-step policy entropy ``H_i = -sum_a pi log pi``. ``(T, A) -> (T,)``."""
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


class A3CLoss(NamedTuple):
    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor


def a3c_loss(logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor,
             bootstrap: float, *, gamma: float, tau: float, entropy_coef: float, value_coef: float) -> A3CLoss:
    """The A3C objective of one rollout.

    ``logits (T, A)``, ``values (T,)``, ``actions (T,)`` int64, ``rewards (T,)``.
    ``total = policy - entropy_coef * sum H + value_coef * value``; with ``value_coef = 0.5`` this is exactly
    upstream's ``policy_loss + 0.5 * value_loss`` (whose value_loss already carries the 0.5 of the square).
    """
    rewards = rewards.to(values.dtype)
    returns = discounted_returns(rewards.detach().cpu(), bootstrap, gamma).to(values.device)
    adv = gae_advantages(rewards.detach().cpu(), values.detach().cpu(), bootstrap, gamma, tau).to(values.device)
    log_p = torch.log_softmax(logits, dim=-1)
    taken = log_p.gather(1, actions.view(-1, 1)).squeeze(1)
    ent = entropy(logits).sum()
    p_loss = policy_loss(taken, adv)
    v_loss = value_loss(values, returns)
    total = p_loss - entropy_coef * ent + value_coef * v_loss
    return A3CLoss(total, p_loss, v_loss, ent)

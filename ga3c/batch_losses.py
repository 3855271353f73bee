"""The A3C loss of a batch of segments at once, optionally with truncated importance weights. Pure tensor math.

A batch holds B segments of lengths ``L_b <= T`` (a segment is shorter when its episode ended inside it). The
per-step tensors are *flat* and segment-major, ``(S,)`` with ``S = sum L_b``: segment 0's steps, then segment
1's, ... ; ``padded``/``flat_index`` convert to ``(B, T)`` with zeros after each segment's end (the masked steps
contribute exactly nothing).

The loss of the batch is the *sum* of each segment's A3C loss (``losses.a3c_loss``: sums over steps, not means),
so the gradient of one batched step equals the sum of the per-segment gradients (tested). Returns and GAE run
per segment (``R_L`` = its bootstrap: 0 after a termination, V(s_L) after a cut or a truncation).

Policy lag (GA3C): a segment may be trained by weights several updates newer than those that acted. With
``is_clip`` the policy-gradient term of each step is weighted by ``w = min(pi(a)/mu(a), is_clip)`` (detached),
``mu`` the behaviour probability recorded when acting (tensorpack's truncated importance sampling, clip 10 there;
the value and entropy terms are unweighted). ``is_clip=None`` is plain GA3C and exactly the repo's A3C loss.

Greedy slots (``--greedy-slots``): their steps took the argmax action and recorded ``mu = 1``, so their
policy-gradient terms are weighted by ``w = min(pi(a)/mu(a), max(is_clip, 1))`` = ``pi(a)`` whether or not
``is_clip`` is set: the truncated importance weight of a deterministic behaviour policy. ``greedy`` marks them.

Several passes over one batch (``--train-passes K``, K > 1): every pass's policy term is PPO's clipped surrogate
(Schulman et al. 2017) with the recorded ``mu`` as the old policy, ``-sum_i min(r_i A_i, clip(r_i, 1 - eps, 1 + eps)
A_i)``, ``r_i = pi(a_i)/mu(a_i)`` with gradient (``pass_clip`` = eps): a step whose ratio has already moved past
``1 +- eps`` in the direction its advantage pushes gives no gradient of its own, so the later passes do not push
that step's probability further (the other steps' gradients, through the shared weights, and the optimizer's
momentum still move it). Where ``r = 1`` its gradient is the plain term's. ``mu`` is floored at ``MU_FLOOR``.
For a negative advantage the term is also bounded below by ``DUAL_CLIP A`` (dual-clip PPO, Ye et al. 2020): PPO's
``min`` alone keeps ``r A`` there however large ``r`` is, so a step whose acting probability was tiny (a rare
action, weights several updates older) gives a gradient that grows with ``r``, up to ``1 / MU_FLOOR``. Past
``r = DUAL_CLIP`` such a step gives no gradient of its own. Returns, GAE, value and entropy terms are the plain ones, from each pass's own forward.
"""
from __future__ import annotations

import torch

from losses import A3CLoss, a3c_loss, discounted_returns, entropy, gae_advantages, policy_loss, value_loss


MU_FLOOR = 1e-8  # the least behaviour probability the clipped surrogate divides by
DUAL_CLIP = 3.0  # the clipped surrogate of a negative advantage A is at least DUAL_CLIP * A (dual-clip PPO)


def flat_index(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch_index, time_index)``, each ``(S,)``: where each flat step sits in the ``(B, T)`` padding."""
    lengths = lengths.to(torch.int64).cpu()
    b = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    t = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets, lengths)
    return b, t


def padded(flat: torch.Tensor, lengths: torch.Tensor, index=None) -> torch.Tensor:
    """``(S, ...) -> (B, T, ...)``, zeros after each segment's end; differentiable."""
    b, t = flat_index(lengths) if index is None else index
    out = flat.new_zeros((lengths.numel(), int(lengths.max()), *flat.shape[1:]))
    return out.index_put((b.to(flat.device), t.to(flat.device)), flat)


def batched_returns_advantages(rewards: torch.Tensor, values: torch.Tensor, bootstrap: torch.Tensor,
                               lengths: torch.Tensor, gamma: float, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """n-step returns and GAE of each segment: ``(B, T)`` padded inputs and outputs, ``bootstrap (B,)``.

    The same recursions as ``losses.discounted_returns`` and ``losses.gae_advantages`` (same float operations in
    the same order), run over the B segments at once; padded steps are 0. ``values`` are constants.
    """
    values = values.detach()
    rewards = rewards.detach().to(values.dtype)
    bootstrap = bootstrap.to(values.dtype)
    lengths = lengths.to(values.device)
    n_seg, steps = rewards.shape
    returns = torch.zeros_like(rewards)
    adv = torch.zeros_like(rewards)
    run_r = torch.zeros(n_seg, dtype=values.dtype, device=values.device)
    run_a = torch.zeros_like(run_r)
    zero = torch.zeros_like(run_r)
    for t in range(steps - 1, -1, -1):
        valid = t < lengths
        last = t == lengths - 1
        next_r = torch.where(last, bootstrap, run_r)
        next_v = torch.where(last, bootstrap, values[:, t + 1] if t + 1 < steps else bootstrap)
        r = rewards[:, t] + gamma * next_r
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * tau * torch.where(last, zero, run_a)
        run_r = torch.where(valid, r, zero)
        run_a = torch.where(valid, a, zero)
        returns[:, t] = run_r
        adv[:, t] = run_a
    return returns, adv


def importance_weights(log_probs_taken: torch.Tensor, mu: torch.Tensor, is_clip: float) -> torch.Tensor:
    """``min(pi(a)/mu(a), is_clip)``, detached; ``(S,) -> (S,)``. A behaviour probability of 0 gives ``is_clip``."""
    ratio = torch.exp(log_probs_taken.detach() - torch.log(mu.to(log_probs_taken.dtype)))
    return ratio.clamp(max=is_clip)


def clipped_surrogate_loss(log_probs_taken: torch.Tensor, mu: torch.Tensor, advantages: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy loss ``-sum_i min(r_i A_i, clip(r_i, 1 - eps, 1 + eps) A_i)``, each term of a negative
    advantage at least ``DUAL_CLIP A_i``, with ``r_i = exp(log pi(a_i) - log mu(a_i))`` (gradient through
    ``log_probs_taken`` only; advantages and ``mu`` are constants), and the ratios ``r`` detached.
    ``(S,) -> ((), (S,))``. ``mu`` is floored at ``MU_FLOOR``: a behaviour probability that underflowed to 0
    gives a large finite ratio, not inf and a NaN gradient."""
    ratio = torch.exp(log_probs_taken - torch.log(mu.to(log_probs_taken.dtype).clamp(min=MU_FLOOR)))
    adv = advantages.detach()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps, 1.0 + eps) * adv)
    floor = DUAL_CLIP * adv
    surrogate = torch.where((adv < 0) & (surrogate < floor), floor, surrogate)  # at r = 3 exactly: r A's gradient
    return -surrogate.sum(), ratio.detach()


def greedy_clip(is_clip: float | None) -> float:
    """The clip of a greedy step's importance weight: ``is_clip``, but at least 1 (``pi/1`` is never above 1)."""
    return 1.0 if is_clip is None else max(is_clip, 1.0)


def segment_loss(logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor,
                 bootstrap: float, *, mu: torch.Tensor | None = None, is_clip: float | None = None, gamma: float,
                 tau: float, entropy_coef: float, value_coef: float, greedy: bool = False,
                 pass_clip: float | None = None) -> A3CLoss:
    """One segment's loss, the reference the batched loss is tested against.

    ``is_clip=None``, not ``greedy`` and ``pass_clip=None``: exactly ``losses.a3c_loss``. With ``pass_clip`` the
    policy term is ``clipped_surrogate_loss``'s (dual clip included) against ``mu`` (``is_clip`` and ``greedy`` are
    not combined with it).
    Otherwise the same terms with the policy-gradient term of step i weighted by ``importance_weights``:
    ``-sum_i w_i log pi(a_i) A_i``, clipped at ``is_clip``, or at ``greedy_clip(is_clip)`` for a greedy slot's
    segment.
    """
    if pass_clip is not None and (is_clip is not None or greedy):
        raise ValueError("pass_clip is not combined with is_clip or greedy slots")
    if is_clip is None and not greedy and pass_clip is None:
        return a3c_loss(logits, values, actions, rewards, bootstrap, gamma=gamma, tau=tau,
                        entropy_coef=entropy_coef, value_coef=value_coef)
    rewards = rewards.to(values.dtype)
    returns = discounted_returns(rewards.detach().cpu(), bootstrap, gamma).to(values.device)
    adv = gae_advantages(rewards.detach().cpu(), values.detach().cpu(), bootstrap, gamma, tau).to(values.device)
    taken = torch.log_softmax(logits, dim=-1).gather(1, actions.view(-1, 1)).squeeze(1)
    # written out here, not through importance_weights / clipped_surrogate_loss, which the batched loss uses: the
    # reference must not share the code it checks
    ratio = torch.exp(taken - torch.log(mu.to(values.device, values.dtype).clamp(min=MU_FLOOR)))  # pi(a) / mu(a)
    if pass_clip is not None:
        unclipped, clipped = ratio * adv, ratio.clamp(1.0 - pass_clip, 1.0 + pass_clip) * adv
        term = torch.where(unclipped < clipped, unclipped, clipped)
        floor = DUAL_CLIP * adv  # a negative advantage's term is never below it
        p_loss = -torch.where((adv < 0) & (term < floor), floor, term).sum()
    else:
        w = torch.clamp(ratio.detach(), max=greedy_clip(is_clip) if greedy else is_clip)
        p_loss = -(taken * (adv * w)).sum()
    ent = entropy(logits).sum()
    v_loss = value_loss(values, returns)
    return A3CLoss(p_loss - entropy_coef * ent + value_coef * v_loss, p_loss, v_loss, ent)


def batched_a3c_loss(logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor,
                     bootstrap: torch.Tensor, lengths: torch.Tensor, *, mu: torch.Tensor | None = None,
                     is_clip: float | None = None, gamma: float, tau: float, entropy_coef: float,
                     value_coef: float, greedy: torch.Tensor | None = None,
                     pass_clip: float | None = None) -> tuple[A3CLoss, torch.Tensor | None]:
    """The sum over segments of ``segment_loss``, computed at once.

    Flat segment-major ``logits (S, A)``, ``values (S,)``, ``actions (S,)``, ``rewards (S,)``, ``mu (S,)``,
    ``greedy (S,)`` bool (the steps of greedy slots' segments; None: none); per segment ``bootstrap (B,)`` and
    ``lengths (B,)``. Returns the loss terms (each summed over all steps of all segments) and the importance
    weights ``(S,)`` (None when ``is_clip`` is None and no step is greedy; then 1 for the steps not greedy).
    """
    index = flat_index(lengths)
    b, t = index
    ret_pad, adv_pad = batched_returns_advantages(padded(rewards.to(values.dtype), lengths, index),
                                                  padded(values.detach(), lengths, index),
                                                  bootstrap.to(values.device), lengths, gamma, tau)
    dev_b, dev_t = b.to(values.device), t.to(values.device)
    returns, adv = ret_pad[dev_b, dev_t], adv_pad[dev_b, dev_t]
    taken = torch.log_softmax(logits, dim=-1).gather(1, actions.view(-1, 1)).squeeze(1)
    w = None
    if greedy is not None and not bool(greedy.any()):
        greedy = None
    if pass_clip is not None:
        if is_clip is not None or greedy is not None:
            raise ValueError("pass_clip is not combined with is_clip or greedy slots")
        p_loss, w = clipped_surrogate_loss(taken, mu.to(values.device), adv, pass_clip)
    elif is_clip is not None or greedy is not None:
        mu = mu.to(values.device)
        w = (importance_weights(taken, mu, is_clip) if is_clip is not None
             else torch.ones_like(taken).detach())
        if greedy is not None:
            w = torch.where(greedy.to(values.device), importance_weights(taken, mu, greedy_clip(is_clip)), w)
        adv = adv * w
    if pass_clip is None:
        p_loss = policy_loss(taken, adv)
    ent = entropy(logits).sum()
    v_loss = value_loss(values, returns)
    return A3CLoss(p_loss - entropy_coef * ent + value_coef * v_loss, p_loss, v_loss, ent), w

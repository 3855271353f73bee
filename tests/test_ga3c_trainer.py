"""GA3C's batched training step against the repo's A3C, one segment at a time: the batched returns and GAE equal
``losses``' per segment; the gradient of one batched step over segments of different lengths (a terminated one
bootstrapped with 0, a truncated one with V) equals the sum of the per-segment gradients of ``A3Clstm.forward``
+ ``losses.a3c_loss``, with and without importance weights; the whole update through a channels-last working copy
and the shared fused Adam equals torch's Adam on that summed gradient; the policy lag is measured."""
import dataclasses
import math

import pytest
import torch

from conftest import segments_reference_backward
from ga3c.batch_losses import (batched_a3c_loss, batched_returns_advantages, clipped_surrogate_loss, flat_index,
                               importance_weights, padded, segment_loss)
from ga3c.segment import ACT_FIELDS, Segment, activation_rows, cat_rows
from ga3c.settings import Ga3cSettings
from ga3c.stats import Ga3cCounters
from ga3c.trainer import Trainer, assemble, batch_loss, batched_unroll
from losses import a3c_loss, discounted_returns, gae_advantages
from model import A3Clstm, ActivationCache
from shared_optim import make_optimizer

KW = dict(gamma=0.99, tau=0.92, entropy_coef=0.01, value_coef=0.5)
H, A = 32, 6


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def close(a, b, rel=1e-4):
    """Equal to float32 rounding: summing in another order (batched vs one segment at a time, channels-last vs
    contiguous convolutions) moves each entry by about 1e-5 of the tensor's largest entry."""
    return bool((a - b).abs().max() <= rel * b.abs().max() + 1e-7)


def test_flat_index_and_padding():
    lengths = torch.tensor([3, 1, 2])
    b, tt = flat_index(lengths)
    assert b.tolist() == [0, 0, 0, 1, 2, 2] and tt.tolist() == [0, 1, 2, 0, 0, 1]
    p = padded(t(1, 2, 3, 4, 5, 6), lengths)
    assert p.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]


def test_batched_returns_and_gae_equal_the_per_segment_functions():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 5, 2])
    boots = t(0.0, 1.5, -0.7, 2.0, 0.0)
    rewards = [torch.randn(int(n), generator=g) for n in lengths]
    values = [torch.randn(int(n), generator=g) for n in lengths]
    for gamma, tau in ((0.99, 1.0), (0.9, 0.5), (0.97, 0.0)):
        ret, adv = batched_returns_advantages(padded(torch.cat(rewards), lengths), padded(torch.cat(values), lengths),
                                              boots, lengths, gamma, tau)
        for i, n in enumerate(lengths.tolist()):
            # the same float operations in the same order: bit for bit
            assert torch.equal(ret[i, :n], discounted_returns(rewards[i], float(boots[i]), gamma))
            assert torch.equal(adv[i, :n], gae_advantages(rewards[i], values[i], float(boots[i]), gamma, tau))
            assert not ret[i, n:].any() and not adv[i, n:].any()


def test_batched_returns_hand_computed_terminated_and_truncated():
    # segment 0 terminated after 2 steps with reward 1 on the terminal step: R = [gamma, 1]
    # segment 1 truncated after 3 steps, no reward, V(s_3) = 5: R = [gamma^3 5, gamma^2 5, gamma 5]
    lengths = torch.tensor([2, 3])
    rewards = padded(t(0, 1, 0, 0, 0), lengths)
    values = torch.zeros(2, 3)
    ret, adv = batched_returns_advantages(rewards, values, t(0.0, 5.0), lengths, 0.9, 1.0)
    assert torch.allclose(ret, torch.tensor([[0.9, 1.0, 0.0], [0.9 ** 3 * 5, 0.9 ** 2 * 5, 0.9 * 5]]))
    assert torch.allclose(adv, ret)  # V = 0 and lambda = 1: advantage = return


def test_segment_loss_without_weights_is_the_repos_a3c_loss_and_weights_clip():
    g = torch.Generator().manual_seed(1)
    logits, values = torch.randn(4, A, generator=g), torch.randn(4, generator=g)
    actions, rewards = torch.tensor([0, 3, 5, 1]), t(0, 1, -1, 0)
    ref = a3c_loss(logits, values, actions, rewards, 0.5, **KW)
    assert all(torch.equal(a, b) for a, b in zip(segment_loss(logits, values, actions, rewards, 0.5, **KW), ref))
    pi = torch.softmax(logits, 1).gather(1, actions.view(-1, 1)).squeeze(1)
    on_policy = segment_loss(logits, values, actions, rewards, 0.5, mu=pi, is_clip=10.0, **KW)
    assert on_policy.total.item() == pytest.approx(ref.total.item(), rel=1e-5)  # mu = pi: every weight is 1
    log_pi = torch.log(t(0.5, 0.2, 0.9))
    w = importance_weights(log_pi, t(0.25, 0.4, 0.0), is_clip=1.5)
    assert torch.allclose(w, t(1.5, 0.5, 1.5))  # 2 clipped to 1.5, 0.5 kept, mu = 0 gives the clip


def test_a_greedy_segments_policy_term_is_weighted_by_pi_of_its_actions():
    """--greedy-slots: mu = 1 recorded, so the policy-gradient term is -sum_i pi(a_i) log pi(a_i) A_i (pi
    detached), with or without is_clip (pi/1 never exceeds a clip of 1 or more; a clip below 1 is raised to 1);
    the value and entropy terms are the unweighted ones."""
    g = torch.Generator().manual_seed(2)
    logits, values = torch.randn(4, A, generator=g), torch.randn(4, generator=g)
    actions, rewards = torch.tensor([0, 3, 5, 1]), t(0, 1, -1, 0)
    ref = a3c_loss(logits, values, actions, rewards, 0.5, **KW)
    log_pi = torch.log_softmax(logits, 1).gather(1, actions.view(-1, 1)).squeeze(1)
    adv = gae_advantages(rewards, values, 0.5, KW["gamma"], KW["tau"])
    want = -(log_pi.exp() * log_pi * adv).sum()
    for is_clip in (None, 0.5, 10.0):
        got = segment_loss(logits, values, actions, rewards, 0.5, mu=torch.ones(4), is_clip=is_clip, greedy=True,
                           **KW)
        assert got.policy.item() == pytest.approx(want.item(), rel=1e-5), is_clip
        assert got.value.item() == pytest.approx(ref.value.item()) and got.entropy.item() == pytest.approx(
            ref.entropy.item())
        assert got.policy.item() != pytest.approx(ref.policy.item(), rel=1e-2)  # the weights matter here


def test_clipped_surrogate_hand_computed():
    """PPO's clip, eps 0.2, six steps: (r, A) = (2, 1) clipped at 1.2, no gradient; (0.5, 1) kept; (1, -2) and
    (1, 3) kept; (0.5, -1) clipped at 0.8, no gradient; (2, -1) kept. Loss -(1.2 + 0.5 - 2 + 3 - 0.8 - 2) = 0.1;
    d loss / d log pi(a_i) = -r_i A_i where kept, else 0."""
    pi, mu = t(0.5, 0.2, 0.3, 0.1, 0.1, 0.4), t(0.25, 0.4, 0.3, 0.1, 0.2, 0.2)
    adv = t(1, 1, -2, 3, -1, -1)
    log_pi = torch.log(pi).requires_grad_()
    loss, ratio = clipped_surrogate_loss(log_pi, mu, adv, 0.2)
    assert loss.item() == pytest.approx(0.1, abs=1e-6)
    assert torch.allclose(ratio, t(2, 0.5, 1, 1, 0.5, 2)) and not ratio.requires_grad
    loss.backward()
    assert torch.allclose(log_pi.grad, t(0, -0.5, 2, -3, 0, 2), atol=1e-6)
    # a behaviour probability that underflowed to 0: a finite ratio (pi / MU_FLOOR), not inf and NaN; its negative
    # advantage's term is the dual clip's 3 A = -3, with no gradient (before, -5e7 and a gradient of 5e7)
    log_pi = torch.log(t(0.5, 0.5)).requires_grad_()
    loss, ratio = clipped_surrogate_loss(log_pi, t(0.0, 0.5), t(-1, 1), 0.2)
    loss.backward()
    assert ratio[0].item() == pytest.approx(5e7) and loss.item() == pytest.approx(3.0 - 1.0)
    assert torch.allclose(log_pi.grad, t(0, -1), atol=1e-6)
    # the dual clip, three steps of A = -1: r = 2 kept (-2, gradient 2), r = 3 at the bound (-3), r = 4 bounded
    # (-3, no gradient); a positive advantage is not bounded by it (r = 4, A = 1: PPO's 1.2)
    log_pi = torch.log(t(0.4, 0.6, 0.8, 0.8)).requires_grad_()
    loss, ratio = clipped_surrogate_loss(log_pi, t(0.2, 0.2, 0.2, 0.2), t(-1, -1, -1, 1), 0.2)
    assert torch.allclose(ratio, t(2, 3, 4, 4)) and loss.item() == pytest.approx(2 + 3 + 3 - 1.2, abs=1e-5)
    loss.backward()
    assert log_pi.grad[0].item() == pytest.approx(2.0) and log_pi.grad[2].item() == 0 and log_pi.grad[3].item() == 0
    # the reference (segment_loss) bounds the same terms: step by step against the formula, with ratios past 3
    logits, values = torch.randn(6, A, generator=torch.Generator().manual_seed(9)), t(0.5, 0.4, -0.3, 0.2, 0.9, 0.1)
    actions, rewards = torch.tensor([0, 1, 2, 3, 4, 5]), t(0, -1, 0, 1, -1, 0)
    pi = torch.softmax(logits, 1).gather(1, actions.view(-1, 1)).squeeze(1)
    mu = pi * t(0.1, 0.2, 1.0, 0.5, 0.1, 3.0)  # ratios 10, 5, 1, 2, 10, 1/3
    adv = gae_advantages(rewards, values, 0.5, KW["gamma"], KW["tau"])
    want = 0.0
    for r, a in zip((pi / mu).tolist(), adv.tolist()):
        term = min(r * a, min(max(r, 0.8), 1.2) * a)
        want -= max(term, 3.0 * a) if a < 0 else term
    got = segment_loss(logits, values, actions, rewards, 0.5, mu=mu, pass_clip=0.2, **KW)
    assert bool(((pi / mu > 3) & (adv < 0)).any()) and got.policy.item() == pytest.approx(want, rel=1e-5)
    # mu = pi: every ratio 1, so the policy term is -sum A (not -sum log pi A) but its gradient is the plain term's
    # (the first pass of a batch with no policy lag); the value and entropy terms are the plain ones
    logits, values = torch.randn(4, A, generator=torch.Generator().manual_seed(5)), t(0.1, -0.2, 0.3, 0.0)
    actions, rewards = torch.tensor([0, 3, 5, 1]), t(0, 1, -1, 0)
    on = torch.softmax(logits, 1).gather(1, actions.view(-1, 1)).squeeze(1).detach()
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = a3c_loss(a, values, actions, rewards, 0.5, **KW)
    got = segment_loss(b, values, actions, rewards, 0.5, mu=on, pass_clip=0.2, **KW)
    adv = gae_advantages(rewards, values, 0.5, KW["gamma"], KW["tau"])
    assert got.policy.item() == pytest.approx(-adv.sum().item(), rel=1e-5)
    assert got.value.item() == ref.value.item() and got.entropy.item() == pytest.approx(ref.entropy.item())
    ref.total.backward()
    got.total.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    with pytest.raises(ValueError, match="pass_clip"):
        segment_loss(logits, values, actions, rewards, 0.5, mu=on, is_clip=1.0, pass_clip=0.2, **KW)


def test_importance_weighted_policy_gradient_hand_computed():
    """--is-clip and greedy slots: the policy term is -sum_i w_i log pi(a_i) A_i with w_i = min(pi(a_i) / mu_i, c)
    a constant, so (no entropy bonus, constant values) d loss / d logits_i = -w_i A_i (onehot(a_i) - pi_i), in the
    reference and in the batched loss. A weight that carried a gradient would add -w_i A_i log pi(a_i) times the
    same vector."""
    logits = torch.randn(4, A, generator=torch.Generator().manual_seed(9))
    values, actions, rewards = t(0.1, -0.2, 0.3, 0.0), torch.tensor([0, 3, 5, 1]), t(0, 1, -1, 0)
    mu, kw = t(0.5, 0.05, 0.3, 0.2), dict(gamma=0.99, tau=0.92, entropy_coef=0.0, value_coef=0.5)
    pi = torch.softmax(logits, 1)
    taken = pi.gather(1, actions.view(-1, 1)).squeeze(1)
    adv = gae_advantages(rewards, values, 0.5, kw["gamma"], kw["tau"])
    onehot = torch.nn.functional.one_hot(actions, A).to(pi.dtype)
    for is_clip, greedy, w in ((1.0, False, (taken / mu).clamp(max=1.0)), (10.0, False, taken / mu),
                               (None, True, taken)):
        expected = -(w * adv)[:, None] * (onehot - pi)
        assert (w < 1).any() and (w != 1).any()  # the weights matter here
        one, flat = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        segment_loss(one, values, actions, rewards, 0.5, mu=torch.ones(4) if greedy else mu, is_clip=is_clip,
                     greedy=greedy, **kw).total.backward()
        assert torch.allclose(one.grad, expected, atol=1e-6), (is_clip, greedy)
        loss, _ = batched_a3c_loss(flat, values, actions, rewards, t(0.5), torch.tensor([4]),
                                   mu=torch.ones(4) if greedy else mu, is_clip=is_clip,
                                   greedy=torch.full((4,), greedy), **kw)
        loss.total.backward()
        assert torch.allclose(flat.grad, expected, atol=1e-6), (is_clip, greedy)


def random_segments(lengths, ends, seed=0, greedy=()):
    """Segments with random frames, non-zero initial states, behaviour probabilities and versions; ``ends``:
    'cut' (bootstrap V), 'term' (bootstrap 0), 'trunc' (bootstrap V); the segments at the indices in ``greedy``
    are greedy slots' (mu = 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, end) in enumerate(zip(lengths, ends)):
        seg = Segment(
            slot=i, frames=torch.randn(n, 1, 80, 80, generator=g),  # normalised frames
            actions=torch.randint(0, A, (n,), generator=g), rewards=torch.randint(-1, 2, (n,), generator=g).float(),
            mu=torch.rand(n, generator=g) * 0.3 + 0.02, versions=torch.randint(0, 4, (n,), generator=g),
            state=(torch.randn(1, H, generator=g) * 0.3, torch.randn(1, H, generator=g) * 0.3),
            terminated=end == "term", truncated=end == "trunc",
            bootstrap=0.0 if end == "term" else float(torch.randn(1, generator=g)))
        out.append(dataclasses.replace(seg, mu=torch.ones(n), greedy=True) if i in greedy else seg)
    return out


LENGTHS, ENDS = [5, 2, 5, 3], ["cut", "term", "cut", "trunc"]


def per_segment_reference(model, segments, is_clip, pass_clip=None):
    """The repo's A3C one segment at a time (``conftest.segments_reference_backward``): the summed loss and the
    summed gradients."""
    total = segments_reference_backward(model, segments, is_clip=is_clip, pass_clip=pass_clip, **KW)
    return total, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("is_clip,greedy,passes", [(None, (), 1), (1.2, (), 1), (None, (1, 3), 1), (1.2, (0, 2), 1),
                                                  (None, (), 2)])
def test_batched_gradient_equals_sum_of_per_segment_gradients(is_clip, greedy, passes):
    torch.manual_seed(0)
    ref = A3Clstm(1, A, H)
    segments = random_segments(LENGTHS, ENDS, greedy=greedy)
    settings = Ga3cSettings(is_clip=is_clip, train_passes=passes, pass_clip=0.2, **KW)
    if passes > 1:  # mu about pi, so that some ratios fall inside 1 +- 0.2 and some outside
        with torch.no_grad():
            _, logits = batched_unroll(ref, assemble(segments, version=None))
        pi = torch.softmax(logits, 1).gather(1, assemble(segments, version=None).actions.view(-1, 1)).squeeze(1)
        scale = 0.6 + 0.8 * torch.rand(pi.shape, generator=torch.Generator().manual_seed(4))
        for seg, part in zip(segments, torch.split(pi * scale, LENGTHS)):
            seg.mu = part.clone()
    ref_total, ref_grads = per_segment_reference(ref, segments, is_clip, 0.2 if passes > 1 else None)
    if passes > 1:  # the clip matters: the plain gradient is another one
        plain = A3Clstm(1, A, H)
        plain.load_state_dict(ref.state_dict())
        _, plain_grads = per_segment_reference(plain, segments, None)
        assert max(((p - g).abs().max() / g.abs().max()).item() for p, g in zip(plain_grads, ref_grads)) > 0.05
    fast = A3Clstm(1, A, H).channels_last()
    fast.load_state_dict(ref.state_dict())
    batch = assemble(segments, version=None)
    assert batch.lengths.tolist() == LENGTHS and batch.bootstrap[1] == 0.0 and batch.num_steps == sum(LENGTHS)
    loss, w = batch_loss(fast, batch, settings)
    loss.total.backward()
    assert loss.total.item() == pytest.approx(ref_total, rel=1e-4)
    if passes > 1:  # the ratios pi/mu, some beyond the clip on either side
        assert w is not None and bool((w > 1.2).any()) and bool((w < 0.8).any()) and bool(((w - 1).abs() < 0.2).any())
    elif is_clip is not None:
        assert (w == is_clip).any() and (w < is_clip).any()  # some weights clipped, some not
    if greedy:  # pi(a) on the greedy steps, 1 (or the clipped ratio) on the others
        g_steps = batch.greedy
        assert g_steps is not None and int(g_steps.sum()) == sum(LENGTHS[i] for i in greedy)
        with torch.no_grad():
            _, logits = batched_unroll(fast, batch)
        pi = torch.softmax(logits, 1).gather(1, batch.actions.view(-1, 1)).squeeze(1)
        assert torch.allclose(w[g_steps], pi[g_steps], rtol=1e-5) and bool((w[g_steps] < 1).all())
        if is_clip is None:
            assert bool((w[~g_steps] == 1).all())
    else:
        assert batch.greedy is None and (w is None) == (is_clip is None and passes == 1)
    for (name, p), g in zip(fast.named_parameters(), ref_grads):
        assert close(p.grad, g), name


@pytest.mark.parametrize("is_clip", [None, 1.2])
def test_replayed_activations_give_the_fresh_gradient_when_the_weights_did_not_move(is_clip, monkeypatch):
    """--replay-activations: the conv activations saved by a predictor's batched forward, split into rows and
    reassembled per segment, give the same loss and gradients as running the convolutions again (no policy lag);
    the convolutions do not run forward in the update."""
    torch.manual_seed(0)
    ref = A3Clstm(1, A, H)
    segments = random_segments(LENGTHS, ENDS)
    ref_total, ref_grads = per_segment_reference(ref, segments, is_clip)
    fast = A3Clstm(1, A, H).channels_last()
    fast.load_state_dict(ref.state_dict())
    frames = torch.cat([s.frames for s in segments])
    cache = ActivationCache()
    with torch.no_grad():
        fast.features(frames, cache)  # one batched forward over every frame, as a predictor's
    rows = [activation_rows(cache, j) for j in range(frames.shape[0])]
    k = 0
    for s in segments:
        s.acts = [cat_rows([r[i] for r in rows[k: k + len(s)]]) for i in range(len(ACT_FIELDS))]
        s.versions.fill_(3)  # acted on by version 3, the one that trains
        k += len(s)
    batch = assemble(segments, version=3)
    assert batch.acts is not None and batch.acts[0].shape[0] == sum(LENGTHS) and bool(batch.replay.all())
    for conv in fast.convs():
        monkeypatch.setattr(conv, "forward", lambda *a: pytest.fail("a convolution ran forward in the update"))
    loss, _ = batch_loss(fast, batch, Ga3cSettings(is_clip=is_clip, **KW))
    loss.total.backward()
    assert loss.total.item() == pytest.approx(ref_total, rel=1e-4)
    for (name, p), g in zip(fast.named_parameters(), ref_grads):
        assert close(p.grad, g), name


def saved_activations(model, segments):
    """Each frame's conv activations from one batched forward of ``model`` over every frame (a predictor's), as
    per-frame ``ACT_FIELDS`` rows in flat order."""
    frames = torch.cat([s.frames for s in segments])
    cache = ActivationCache()
    with torch.no_grad():
        model.features(frames, cache)
    return [activation_rows(cache, j) for j in range(frames.shape[0])]


def test_only_the_frames_acted_on_by_the_trainers_version_replay_their_activations(monkeypatch):
    """The trainer holds version 5. Frames of version 5 carry the activations of its weights; the others those of
    other weights (a lagging predictor's). The update replays exactly the version-5 frames (whole segments and the
    newest steps of others), runs the encoder once on the 6 others, puts both back in flat order, and its gradient
    equals the per-segment reference at the trainer's weights. Replaying every frame is far off."""
    torch.manual_seed(0)
    ref = A3Clstm(1, A, H)
    segments = random_segments(LENGTHS, ENDS)  # 5, 2, 5, 3 steps
    for s, v in zip(segments, ([5] * 5, [4, 4], [3, 4, 5, 5, 5], [4, 4, 5])):
        s.versions = torch.tensor(v)
    ref_total, ref_grads = per_segment_reference(ref, segments, None)
    shared = A3Clstm(1, A, H)
    shared.load_state_dict(ref.state_dict())
    acting = A3Clstm(1, A, H).channels_last()  # the weights of versions 3 and 4
    now = A3Clstm(1, A, H).channels_last()
    now.load_state_dict(ref.state_dict())
    old_rows, now_rows = saved_activations(acting, segments), saved_activations(now, segments)
    k = 0
    for s in segments:
        rows = [(now_rows if int(v) == 5 else old_rows)[k + i] for i, v in enumerate(s.versions)]
        s.acts = [cat_rows([r[i] for r in rows]) for i in range(len(ACT_FIELDS))]
        k += len(s)
    counters = Ga3cCounters(1, 1, 1)
    counters.updates[1] = 5  # the base slot: version 5
    trainer = Trainer(shared, torch.optim.SGD(shared.parameters(), lr=0.0), Ga3cSettings(**KW), counters=counters)
    encoded = []
    features = trainer.model.features
    monkeypatch.setattr(trainer.model, "features", lambda x, cache=None: encoded.append(x.shape[0]) or features(x))
    result = trainer.update(segments)
    assert encoded == [6] and result.lag_max == 2
    assert result.loss.total.item() == pytest.approx(ref_total, rel=1e-4)
    for (name, p), g in zip(trainer.model.named_parameters(), ref_grads):
        assert close(p.grad, g), name
    mixed = A3Clstm(1, A, H).channels_last()
    mixed.load_state_dict(ref.state_dict())
    batch_loss(mixed, assemble(segments, version=None), Ga3cSettings(**KW))[0].total.backward()
    assert not close(mixed.conv2.weight.grad, ref_grads[2], rel=1e-2)


def test_bf16_activations_of_lagging_segments_are_not_replayed():
    """--precision bf16: segments acted on with bf16 convolutions and saving bf16 activations, then two real Adam
    updates; the trainer's gradient on them is the one of a second bf16 forward at its weights (the same
    computation: equal to float32 rounding), not the replay of the bf16 activations (about 1% off here)."""
    torch.manual_seed(3)
    shared = A3Clstm(1, A, H)
    shared.share_memory()
    settings = Ga3cSettings(compute_precision="bf16", **KW)
    counters = Ga3cCounters(1, 1, 1)
    trainer = Trainer(shared, make_optimizer("Adam", shared.parameters(), 1e-3), settings, counters=counters)
    acting = A3Clstm(1, A, H).channels_last().set_precision(torch.bfloat16)
    acting.load_state_dict(shared.state_dict())
    segments = random_segments(LENGTHS, ENDS, seed=4)
    rows, k = saved_activations(acting, segments), 0
    for s in segments:
        s.acts = [cat_rows([r[i] for r in rows[k: k + len(s)]]) for i in range(len(ACT_FIELDS))]
        s.versions.fill_(0)
        k += len(s)
    assert segments[0].acts[ACT_FIELDS.index("output2")].dtype == torch.bfloat16
    for u in range(2):
        trainer.update(random_segments(LENGTHS, ENDS, seed=20 + u))
    current = A3Clstm(1, A, H).channels_last().set_precision(torch.bfloat16)
    current.load_state_dict(shared.state_dict())
    result = trainer.update(segments)
    assert result.lag_max == 2 and result.lag_mean == 2
    fresh = [dataclasses.replace(s, acts=None) for s in segments]
    batch_loss(current, assemble(fresh, version=None), settings)[0].total.backward()
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), current.named_parameters()):
        assert close(p.grad, q.grad, rel=1e-6), name
    mixed = A3Clstm(1, A, H).channels_last().set_precision(torch.bfloat16)
    mixed.load_state_dict(current.state_dict())
    batch_loss(mixed, assemble(segments, version=None), settings)[0].total.backward()
    assert not close(mixed.conv2.weight.grad, current.conv2.weight.grad, rel=1e-3)


def test_batched_unroll_equals_stepwise_forward():
    torch.manual_seed(1)
    model = A3Clstm(1, A, H)
    segments = random_segments([4, 1, 3], ["cut", "term", "trunc"], seed=3)
    values, logits = batched_unroll(model, assemble(segments, version=None))
    k = 0
    with torch.no_grad():
        for s in segments:
            hx, cx = s.state
            for i in range(len(s)):
                v, lg, (hx, cx) = model(s.frames[i: i + 1], (hx, cx))
                assert torch.allclose(values[k], v.view(()), atol=1e-5)
                assert torch.allclose(logits[k], lg[0], atol=1e-5)
                k += 1


def shared_and_reference(seed, lr):
    """A shared model with the shared fused Adam (``make_optimizer``), a contiguous reference copy with torch's own
    Adam (the same eps), and a channels-last model for the reference gradients."""
    torch.manual_seed(seed)
    shared = A3Clstm(1, A, H)
    shared.share_memory()
    ref = A3Clstm(1, A, H)
    ref.load_state_dict(shared.state_dict())
    opt = make_optimizer("Adam", shared.parameters(), lr)  # SharedAdam, fused
    ref_opt = torch.optim.Adam(ref.parameters(), lr=lr, eps=1e-3, foreach=False)
    return shared, ref, A3Clstm(1, A, H).channels_last(), opt, ref_opt


def test_trainer_update_equals_torch_adam_on_the_summed_gradient():
    """The trainer's working copy is channels-last and the shared model contiguous: the hand-off must give the
    fused Adam gradients in its parameters' layout (``shared_optim.match_grad_layout``), on every update. The
    reference sums the per-segment gradients on a channels-last copy too (channels-last and contiguous
    convolutions round differently, and a near-tie in a max-pool then picks another input), then applies torch's
    own Adam to them in the contiguous layout."""
    lr = 1e-3
    shared, ref, ref_grad_model, opt, ref_opt = shared_and_reference(2, lr)
    counters = Ga3cCounters(1, 1, 1)
    trainer = Trainer(shared, opt, Ga3cSettings(**KW), counters=counters)
    assert trainer.model.conv2.weight.is_contiguous(memory_format=torch.channels_last)
    assert shared.conv2.weight.is_contiguous()
    for u in range(3):
        segments = random_segments(LENGTHS, ENDS, seed=10 + u)
        ref_grad_model.load_state_dict(ref.state_dict())
        _, grads = per_segment_reference(ref_grad_model, segments, None)
        for q, g in zip(ref.parameters(), grads):
            q.grad = g.contiguous()
        ref_opt.step()
        result = trainer.update(segments)
        assert result.steps == sum(LENGTHS) and result.segments == len(LENGTHS)
        for (name, p), q in zip(shared.named_parameters(), ref.parameters()):
            # Adam moves every entry by about lr (a misapplied, permuted conv gradient is off by that much);
            # the two agree to float rounding, ~1e-7
            assert torch.allclose(p, q, atol=lr * 1e-3, rtol=0), f"update {u}: {name}"
    assert counters.version == 3 and trainer.updates == 3


def test_several_passes_step_the_reference_once_per_pass():
    """--train-passes 3: three Adam steps on one batch, each on the per-segment clipped-surrogate gradient at the
    weights the previous step left (mu: the acting policy's probabilities, recorded once); the version moves by 3,
    the batch's transitions and segments are counted once, and the result is the last pass's."""
    lr = 1e-2  # large, so that the later passes' ratios leave 1 +- eps
    shared, ref, ref_grad_model, opt, ref_opt = shared_and_reference(3, lr)
    counters = Ga3cCounters(1, 1, 1)
    settings = Ga3cSettings(train_passes=3, pass_clip=0.2, **KW)
    trainer = Trainer(shared, opt, settings, counters=counters)
    segments = random_segments(LENGTHS, ENDS, seed=20)
    with torch.no_grad():  # mu: the policy of the weights that acted (these)
        batch = assemble(segments, version=None)
        _, logits = batched_unroll(ref, batch)
        pi = torch.softmax(logits, 1).gather(1, batch.actions.view(-1, 1)).squeeze(1)
    for seg, part in zip(segments, torch.split(pi, LENGTHS)):
        seg.mu, seg.versions = part.clone(), torch.zeros(len(seg), dtype=torch.int64)
    for _ in range(3):
        ref_grad_model.load_state_dict(ref.state_dict())
        _, grads = per_segment_reference(ref_grad_model, segments, None, pass_clip=0.2)
        for q, g in zip(ref.parameters(), grads):
            q.grad = g.contiguous()
        ref_opt.step()
    result = trainer.update(segments)
    for (name, p), q in zip(shared.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=lr * 1e-3, rtol=0), name
    assert counters.version == 3 and trainer.updates == 3
    assert result.lag_max == 2 and result.weight_mean is not None  # the last pass: two updates after acting
    assert (result.weight_mean - 1) != pytest.approx(0, abs=1e-3)  # the weights moved away from mu
    row = dict(zip(("steps", "segments"), counters.trainer_stats[0, :2].tolist()))
    assert row == {"steps": sum(LENGTHS), "segments": len(LENGTHS)}
    assert int(counters.lag_hist.sum()) == 3 * sum(LENGTHS)  # every pass's lag, per transition


def test_policy_lag_is_measured_per_batch():
    shared = A3Clstm(1, A, H)
    counters = Ga3cCounters(1, 1, 2)
    counters.updates[1] = 7  # another trainer has made 7 updates: the model's version is 7
    opt = torch.optim.SGD(shared.parameters(), lr=0.0)
    trainer = Trainer(shared, opt, Ga3cSettings(**KW), index=0, counters=counters)
    segments = random_segments([2, 3], ["cut", "term"])
    segments[0].versions = torch.tensor([7, 6])
    segments[1].versions = torch.tensor([3, 3, 4])
    r = trainer.update(segments)
    assert r.lag_max == 4 and r.lag_mean == pytest.approx((0 + 1 + 4 + 4 + 3) / 5)
    row = dict(zip(("steps", "segments", "lag_mean", "lag_max"), counters.trainer_stats[0, :4].tolist()))
    assert row == {"steps": 5, "segments": 2, "lag_mean": pytest.approx(2.4), "lag_max": 4}
    assert counters.version == 8 and int(counters.updates[0]) == 1
    assert math.isfinite(counters.trainer_stats[0, 4].item())

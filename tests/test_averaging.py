"""``--ema-steps``: the moving average of the weights (``averaging.py``) by hand, in an A3G worker's loop, in the
files a checkpoint holds and in what gym_eval.py plays. GA3C's trainer is covered on its production path in
test_ga3c_production_update.py, and whole runs resuming an average in test_ga3c_main.py."""
import math

import pytest
import torch

from averaging import ema_weight, make_average, update_average
from checkpoint import CHECKPOINT_FORMAT, ModelFileError, check_checkpoint, played_state_dict
from model import A3Clstm
from test_player import CPU, shared_worker_state, worker_args
from train import run_worker


def test_the_blend_weight_by_hand():
    assert ema_weight(0, 20000) == 0.0
    assert ema_weight(20000, 20000) == pytest.approx(1 - 1 / math.e, rel=1e-15)  # 0.6321205588...
    # 1 - exp(-0.004) = 0.004 - 0.004**2/2 + 0.004**3/6 - 0.004**4/24 + ...
    assert ema_weight(80, 20000) == pytest.approx(0.004 - 8e-6 + 1.0666667e-8 - 1.0667e-11, rel=1e-10)
    assert ema_weight(10 ** 9, 1) == 1.0
    with pytest.raises(ValueError, match="horizon must be > 0"):
        ema_weight(20, 0)


def test_updates_compose_into_one_time_constant_in_steps():
    """Four updates of 20 steps blend a constant target in as far as one update of 80 (A3G's and GA3C's update sizes
    give the same average for the same steps)."""
    torch.manual_seed(0)
    start, target = A3Clstm(1, 6, 16), A3Clstm(1, 6, 16)
    a, b = make_average(start), make_average(start)
    for _ in range(4):
        update_average(a, target, 20, 100)
    update_average(b, target, 80, 100)
    for pa, pb, ps, pt in zip(a.parameters(), b.parameters(), start.parameters(), target.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)
        # and both are the target plus exp(-80/100) of the way back to the start
        want = pt.double() + math.exp(-0.8) * (ps.double() - pt.double())
        torch.testing.assert_close(pa.double(), want, rtol=0, atol=1e-6)


def test_the_average_is_a_shared_float32_copy_of_its_own():
    model = A3Clstm(1, 6, 16).channels_last()  # a worker's layout: the copy is contiguous whatever the source's
    average = make_average(model)
    for (k, p), q in zip(model.named_parameters(), average.parameters()):
        assert torch.equal(p, q) and q.is_shared() and q.is_contiguous() and q.dtype == torch.float32, k
        assert not q.requires_grad and q.data_ptr() != p.data_ptr(), k
    with torch.no_grad():
        model.conv1.weight.add_(1.0)
    assert not torch.equal(model.conv1.weight, average.conv1.weight)


def test_an_a3g_worker_blends_the_shared_weights_in_after_every_step(tmp_path):
    """``train.run_worker`` with an average: after each update the average is the previous one blended toward the
    shared weights that update left, by the weight of the update's agent steps (checked one update at a time)."""
    horizon = 50
    args = worker_args(tmp_path, ema_steps=horizon)
    shared, opt, run = shared_worker_state()
    average = make_average(shared)
    expected = [p.detach().double().clone() for p in average.parameters()]
    for u in range(3):
        steps_before = run.global_steps.value
        assert run_worker(0, args, shared, opt, run, CPU, max_updates=1, average_model=average) == 1
        steps = run.global_steps.value - steps_before
        assert steps > 0
        w = 1 - math.exp(-steps / horizon)
        expected = [e + w * (p.detach().double() - e) for e, p in zip(expected, shared.parameters())]
        for (k, p), e, s in zip(average.named_parameters(), expected, shared.parameters()):
            assert (p.double() - e).abs().max() <= 1e-6, f"update {u}: {k} is not the blend"  # float32: ~1e-7
            assert not torch.equal(p, s), f"update {u}: {k} is the shared weights, not their average"


def test_a_checkpoint_plays_its_average_and_a_broken_one_is_refused(tmp_path):
    model, average = A3Clstm(1, 6, 16), A3Clstm(1, 6, 16)
    ckpt = {"format": CHECKPOINT_FORMAT, "model": model.state_dict(), "average_model": average.state_dict()}
    played = played_state_dict(ckpt, tmp_path / "x.ckpt")
    assert all(torch.equal(played[k], v) for k, v in average.state_dict().items())
    ckpt_plain = {"format": CHECKPOINT_FORMAT, "model": model.state_dict()}
    assert played_state_dict(ckpt_plain, tmp_path / "x.ckpt") is ckpt_plain["model"]
    dat = model.state_dict()
    assert played_state_dict(dat, tmp_path / "x.dat") is dat
    check_checkpoint(ckpt, tmp_path / "x.ckpt")
    with pytest.raises(ModelFileError, match="'average_model' is not a state_dict of tensors"):
        check_checkpoint({**ckpt, "average_model": [1, 2]}, tmp_path / "x.ckpt")
    # gym_eval.py plays a .ckpt through played_state_dict without check_checkpoint: the same one line, no traceback
    for broken in ([1, 2], {"format": CHECKPOINT_FORMAT, "model": model.state_dict()}, {"w": 1}):
        with pytest.raises(ModelFileError, match="'average_model' is not a state_dict of tensors"):
            played_state_dict({**ckpt, "average_model": broken}, tmp_path / "x.ckpt")
    with pytest.raises(ModelFileError, match="'config.ema_steps' is not a step count"):
        check_checkpoint({**ckpt, "config": {"ema_steps": -5}}, tmp_path / "x.ckpt")

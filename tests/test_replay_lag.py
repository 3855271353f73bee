"""GA3C's update on segments that lag: with ``--replay-activations`` a trainer whose weights moved
since the predictor acted (k >= 1 real optimizer updates in between, on real Pong segments) computes the gradient
at the weights it holds, equal to upstream's step-by-step forward with those weights; the lag benchmark
(``benchmarks/replay_lag.py``) runs with tiny sizes and says how far the replayed (mixed) gradient would be."""
import json

import pytest
import torch

from benchmarks.replay_lag import Actors
from conftest import run_entry, segments_reference_backward
from ga3c.settings import Ga3cSettings
from ga3c.stats import Ga3cCounters
from ga3c.trainer import Trainer
from model import A3Clstm
from shared_optim import make_optimizer

H = 32
SETTINGS = Ga3cSettings(num_steps=5, train_batch=2, predict_batch=2, gamma=0.99, tau=0.92, entropy_coef=0.01,
                        value_coef=0.5)


def close(a, b, rel=1e-4):
    """Equal to float32 rounding (see test_ga3c_trainer.close)."""
    return bool((a - b).abs().max() <= rel * b.abs().max() + 1e-7)


@pytest.mark.parametrize("k", [1, 3])
def test_an_update_on_lagged_pong_segments_is_the_gradient_at_the_trainers_weights(k):
    """Segments acted on by W_v, with their conv activations saved; k real Adam updates (lr 1e-3, on other
    segments acted on at the same moment) move the shared weights to W_{v+k}; the trainer's update on the
    segments then has the gradient of upstream's step-by-step forward at W_{v+k}. Replaying the activations
    saved at W_v instead gives a gradient about 100% off here (benchmarks/replay_lag.py's mixed gradient)."""
    torch.manual_seed(0)
    shared = A3Clstm(1, 6, H)
    shared.share_memory()
    counters = Ga3cCounters(1, 1, 1)
    trainer = Trainer(shared, make_optimizer("Adam", shared.parameters(), 1e-3), SETTINGS, counters=counters)
    actors = Actors(shared, counters, env="PongNoFrameskip-v4", envs=2, num_steps=5, seed=1)
    try:
        trainer.update(actors.collect(2))  # the acting weights are not the initial ones
        segments = actors.collect(2 * (k + 1))
    finally:
        actors.close()
    measured, movers = segments[:2], segments[2:]
    assert all(s.acts is not None and bool((s.versions == 1).all()) for s in segments)
    for u in range(k):
        trainer.update(movers[2 * u: 2 * u + 2])
    current = A3Clstm(1, 6, H).channels_last()  # channels-last as the trainer's copy: the same conv rounding
    current.load_state_dict(shared.state_dict())
    result = trainer.update(measured)
    assert result.lag_max == k and result.lag_mean == k
    segments_reference_backward(current, measured, is_clip=None, gamma=SETTINGS.gamma, tau=SETTINGS.tau,
                                entropy_coef=SETTINGS.entropy_coef, value_coef=SETTINGS.value_coef)
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), current.named_parameters()):
        assert close(p.grad, q.grad), f"{name}: {(p.grad - q.grad).norm() / q.grad.norm():.3g} off"


def test_the_lag_benchmark_runs_with_tiny_sizes(tmp_path):
    out = tmp_path / "lag.json"
    proc = run_entry("benchmarks/replay_lag.py", "--envs", "2", "--train-batch", "2", "--num-steps", "5",
                     "--hidden-size", "32", "--lags", "0", "2", "--batches", "1", "--lr", "1e-3", "--json", str(out),
                     cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lag.json"]
    res = json.loads(out.read_text())
    assert res["lags"] == [0, 2] and len(res["rounds"]) == 1
    (row,) = res["rounds"]
    assert row["0"]["lag"] == 0 and row["2"]["lag"] == 2
    zero, two = res["mean"]["0"], res["mean"]["2"]
    for name in ("mixed_vs_current", "mixed_vs_acting", "current_vs_acting", "trainer_vs_current"):
        assert set(zero[name]) == {"all", "conv", "lstm", "heads"}
        assert zero[name]["all"]["rel"] < 1e-4 and zero[name]["all"]["cos"] > 0.9999  # no lag: all agree
    assert two["trainer_vs_current"]["all"]["rel"] < 1e-6  # the same computation
    assert two["current_vs_acting"]["all"]["rel"] > 1e-3  # the weights moved
    assert two["mixed_vs_current"]["all"]["rel"] > 1e-3 and two["mixed_vs_acting"]["all"]["rel"] > 1e-3
    assert "vs the gradient at the current weights" in proc.stdout and "rel conv" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--envs", "0"], "--envs must be >= 1"), (["--lags", "-1"], "--lags must be >= 0"),
    (["--env", "PongNoFrameskip-v5"], "--env: "), (["--json", "/proc/nowhere/lag.json"], "--json '/proc/nowhere/lag.json'"),
])
def test_the_lag_benchmark_rejects_bad_input_before_measuring(tmp_path, flags, message):
    proc = run_entry("benchmarks/replay_lag.py", *flags, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "replay_lag.py: error: --" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1

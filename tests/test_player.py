"""The worker's pieces: the batched replay gives upstream's gradient, bootstrapping follows terminated vs
truncated, the LSTM state is zeroed at episode ends and detached between rollouts, and one seeded worker is
deterministic."""
import multiprocessing as mp

import gymnasium
import pytest
import torch

from config import build_parser
from conftest import always_noop_model
from environment import atari_env, load_env_config
from model import A3Clstm
from player_util import (Agent, GradientHandoff, play_game, rollout_loss, stepwise_rollout_loss,
                         sync_weights)
from run_state import RunState
from shared_optim import SharedAdam
from train import run_worker

CPU = torch.device("cpu")
KW = dict(gamma=0.99, tau=0.92, entropy_coef=0.01, value_coef=0.5)


def make_agent(max_episode_length=10000, episodic_life=True, hidden=64, seed=0, env_id="PongNoFrameskip-v4"):
    torch.manual_seed(seed)
    env = atari_env(env_id, load_env_config("config.json", env_id), max_episode_length=max_episode_length,
                    episodic_life=episodic_life)
    model = A3Clstm(1, env.action_space.n, hidden)
    return Agent(model, env, CPU, seed=seed)


def test_batched_replay_gradient_equals_stepwise_gradient():
    agent = make_agent()
    agent.rollout(5)  # a non-zero LSTM state at the next rollout's start
    rollout = agent.rollout(20)
    assert rollout.state[0].abs().sum() > 0
    fast = A3Clstm(1, 6, 64).channels_last()
    fast.load_state_dict(agent.model.state_dict())
    grads = []
    for model, fn in ((agent.model, stepwise_rollout_loss), (fast, rollout_loss)):
        model.zero_grad(set_to_none=True)
        loss = fn(model, rollout, **KW)
        loss.total.backward()
        grads.append((loss.total.item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-4)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-3)


def test_bootstrap_on_truncation_not_on_termination():
    agent = make_agent(max_episode_length=12, episodic_life=False)
    r = agent.rollout(50)  # Pong's FIRE reset takes 2 of the 12 steps
    assert r.truncated and not r.terminated and r.actions.shape[0] == 10
    assert r.bootstrap != 0.0  # V(s_T) of the truncated state
    agent = make_agent(episodic_life=True, env_id="BreakoutNoFrameskip-v4")
    for _ in range(200):
        r = agent.rollout(20)
        if r.terminated:
            break
    assert r.terminated and r.bootstrap == 0.0


def test_lstm_state_zeroed_at_episode_end_and_detached_between_rollouts():
    agent = make_agent(max_episode_length=30, episodic_life=False)
    r1 = agent.rollout(20)
    assert not r1.state[0].requires_grad
    assert torch.count_nonzero(r1.state[0]) == 0  # fresh episode
    r2 = agent.rollout(20)
    assert r2.truncated and torch.count_nonzero(r2.state[0]) > 0  # carried over
    assert not r2.state[0].requires_grad and not agent.hx.requires_grad
    r3 = agent.rollout(20)  # a new episode after the time limit
    assert torch.count_nonzero(r3.state[0]) == 0 and torch.count_nonzero(r3.state[1]) == 0


def test_a_rollout_replays_the_same_after_the_next_rollout_reset_the_agent():
    """An episode that ends after a rollout: the next rollout's reset must not change what the first one's cache
    holds (its last LSTM state), so that the first replays to the step-by-step gradient whenever it is updated."""
    agent = make_agent(max_episode_length=12, episodic_life=False, hidden=32)
    first = agent.rollout(50)  # truncated after 10 steps: the next rollout resets
    assert first.truncated

    def replayed():
        agent.model.zero_grad(set_to_none=True)
        loss = rollout_loss(agent.model, first, **KW)
        loss.total.backward()
        return loss.total.item(), [p.grad.clone() for p in agent.model.parameters()]
    before = replayed()
    agent.rollout(5)
    after = replayed()
    agent.model.zero_grad(set_to_none=True)
    reference = stepwise_rollout_loss(agent.model, first, **KW)
    reference.total.backward()
    assert after[0] == pytest.approx(before[0], rel=1e-6) == pytest.approx(reference.total.item(), rel=1e-4)
    for a, b in zip(after[1], before[1]):
        assert torch.equal(a, b)


def test_gradient_handoff_assigns_every_update():
    local, shared = A3Clstm(1, 6, 16), A3Clstm(1, 6, 16)
    handoff = GradientHandoff(local, shared)
    for scale in (1.0, 3.0):
        local.zero_grad(set_to_none=True)
        v, lg = local.unroll(torch.randn(2, 1, 80, 80), local.initial_state())
        (scale * (v.sum() + lg.sum())).backward()
        handoff()
        for lp, sp in zip(local.parameters(), shared.parameters()):
            assert torch.equal(sp.grad, lp.grad)
    sync_weights(local, shared)
    for lp, sp in zip(local.parameters(), shared.parameters()):
        assert torch.equal(lp, sp)


def worker_args(tmp_path, **over):
    args = build_parser().parse_args(["--workers", "1", "--hidden-size", "32", "--max-steps", "0",
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def shared_worker_state():
    """What main.py hands one A3G worker: a shared 32-unit model (seeded 0), its SharedAdam and a RunState."""
    torch.manual_seed(0)
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    return shared, SharedAdam(shared.parameters(), lr=1e-3), RunState(1)


def train_once(tmp_path, updates=6, seed=1):
    args = worker_args(tmp_path, seed=seed)
    shared, opt, run = shared_worker_state()
    n = run_worker(0, args, shared, opt, run, CPU, max_updates=updates)
    return n, run, {k: v.clone() for k, v in shared.state_dict().items()}


def test_one_seeded_worker_is_deterministic(tmp_path):
    n1, run1, w1 = train_once(tmp_path)
    n2, run2, w2 = train_once(tmp_path)
    assert n1 == n2 == 6 and run1.global_steps.value == run2.global_steps.value > 0
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    _, _, w3 = train_once(tmp_path, seed=2)
    assert any(not torch.equal(w1[k], w3[k]) for k in w1)


def test_worker_stops_at_max_steps_and_on_stop_event(tmp_path):
    args = worker_args(tmp_path, max_steps=50)
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    run = RunState(1)
    run_worker(0, args, shared, None, run, CPU)  # private optimizer (--no-shared-optimizer)
    assert 50 <= run.global_steps.value < 50 + args.num_steps
    assert run.update_stats[0, 0] >= 3 and run.norm_stats[0, 2] > 0
    run.stop.set()
    assert run_worker(0, args, shared, None, run, CPU) == 0


def test_a_worker_started_after_a_restore_normalises_from_its_saved_statistics(tmp_path):
    before = RunState(2)  # the run that wrote the checkpoint: rows worker 0, worker 1, monitor
    before.norm_stats.copy_(torch.tensor([[1000.0, 500.0, 5000], [2000.0, 700.0, 7000], [50.0, 20.0, 300]],
                                         dtype=torch.float64))
    torch.save(before.snapshot(), tmp_path / "ckpt.pt")
    run = RunState(2)
    run.restore(torch.load(tmp_path / "ckpt.pt", weights_only=True))  # what main.py does on --load
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    assert run_worker(1, worker_args(tmp_path, workers=2), shared, None, run, CPU, max_updates=1) == 1
    mean, std, count = run.norm_stats[1].tolist()  # worker 1's normaliser after its first rollout
    assert count == 7000 + 1 + run.global_steps.value  # the saved count, then the reset frame and each step's
    # (a fresh normaliser would be near 0.2% of a Pong frame's mean and std after 21 frames)
    assert mean == pytest.approx(2000.0, rel=0.01) and std == pytest.approx(700.0, rel=0.01)
    assert run.norm_stats[0].tolist() == [1000.0, 500.0, 5000]  # worker 0's row is worker 0's


def test_a_failing_worker_reports_its_traceback(tmp_path):
    from train import train
    ctx = mp.get_context("spawn")
    args = worker_args(tmp_path)
    args.env = "NoSuchGameNoFrameskip-v4"  # passes no validation: the worker itself fails
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    run = RunState(1)
    p = ctx.Process(target=train, args=(0, args, shared, None, run))
    p.start()
    role, text = run.errors.get(timeout=120)
    p.join(30)
    assert p.exitcode == 1 and role == "worker 0"
    assert "Traceback" in text and "unknown environment id 'NoSuchGameNoFrameskip-v4'" in text


class RecordingSGD(torch.optim.SGD):
    """SGD that records the norm of the gradient it is asked to apply."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.norms = []

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        return super().step(closure)


@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_max_grad_norm_clips_what_the_shared_optimizer_applies(tmp_path, max_norm):
    args = worker_args(tmp_path, max_grad_norm=max_norm)
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    opt = RecordingSGD(shared.parameters())
    run = RunState(1)
    run_worker(0, args, shared, opt, run, CPU, max_updates=4)
    assert len(opt.norms) == 4
    if max_norm:
        assert max(opt.norms) <= max_norm + 1e-5
    else:
        assert max(opt.norms) > 0.5  # unclipped gradients of this model are larger


class _Spy(torch.nn.Module):
    """Records the LSTM state each forward receives."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.hx_norms = []

    def initial_state(self, *a):
        return self.model.initial_state(*a)

    def forward(self, x, state):
        self.hx_norms.append(float(state[0].abs().sum()))
        return self.model(x, state)


class _ActionLog(gymnasium.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.actions, self.lives = [], []

    def step(self, action):
        self.actions.append(int(action))
        out = self.env.step(action)
        self.lives.append(self.env.unwrapped.ale.lives())
        return out



def test_a_lost_life_restarts_as_in_training_so_breakout_does_not_stall():
    env = _ActionLog(atari_env("BreakoutNoFrameskip-v4", load_env_config("config.json", "BreakoutNoFrameskip-v4"),
                               max_episode_length=5000, episodic_life=False))
    spy = _Spy(always_noop_model(env.action_space.n))
    score, length, finished = play_game(spy, env, CPU, seed=0)
    assert finished and env.unwrapped.ale.lives() == 0  # game over, not the time limit
    assert length == len(env.actions) < 5000
    restarts = [i for i in range(1, len(env.lives) - 1) if env.lives[i] < env.lives[i - 1]]
    assert len(restarts) == 4  # 5 lives: 4 restarts, then game over (the last life lost on the game's last step)
    for i in restarts:
        assert env.actions[i + 1: i + 4] == [0, 1, 2]  # NOOP, FIRE, 2 after the life was lost
    # the policy never presses FIRE itself: every 1 and 2 is a restart's
    assert env.actions.count(1) == env.actions.count(2) == 4
    # the LSTM state is fresh after each restart: zero at the game's start and at the 4 restarts, only there
    assert spy.hx_norms[0] == 0 and sum(n == 0 for n in spy.hx_norms) == 5
    assert all(spy.hx_norms[i] > 0 for i in (1, 2))


def test_a_last_life_played_at_lives_0_is_restarted_too():
    """BankHeist's counter shows the reserve, so its last life is played at lives() == 0: holding action 11 from
    seed 0 loses lives at steps 450, 576, 693 and 819 (1 -> 0) and ends the game at 936. The 1 -> 0 loss restarts
    as the others do (NOOP, FIRE, 2 and a fresh LSTM state), as a learner's episode starts there."""
    env = _ActionLog(atari_env("BankHeistNoFrameskip-v4", load_env_config("config.json", "BankHeistNoFrameskip-v4"),
                               max_episode_length=5000, episodic_life=False))
    spy = _Spy(always_noop_model(env.action_space.n, action=11))
    _, length, finished = play_game(spy, env, CPU, seed=0)
    assert finished and length == len(env.actions) < 5000 and env.unwrapped.ale.lives() == 0
    restarts = [i for i in range(1, len(env.lives) - 1) if env.lives[i] < env.lives[i - 1]]
    assert [env.lives[i] for i in restarts] == [3, 2, 1, 0]
    assert restarts[-1] < len(env.actions) - 20  # the game went on at lives 0
    for i in restarts:
        assert env.actions[i + 1: i + 4] == [0, 1, 2]
    assert sum(n == 0 for n in spy.hx_norms) == 5  # the game's start and the 4 restarts


def test_pong_games_have_no_restarts():
    env = _ActionLog(atari_env("PongNoFrameskip-v4", load_env_config("config.json", "PongNoFrameskip-v4"),
                               max_episode_length=300, episodic_life=False))
    spy = _Spy(always_noop_model(env.action_space.n))
    _, length, finished = play_game(spy, env, CPU, seed=0)
    assert finished and length == 300 - 2  # the time limit (the FIRE reset took 2 steps); no lives in Pong
    assert set(env.actions) == {0} and sum(n == 0 for n in spy.hx_norms) == 1


def test_play_game_records_the_step_and_reward_of_every_point():
    env = _ActionLog(atari_env("PongNoFrameskip-v4", load_env_config("config.json", "PongNoFrameskip-v4"),
                               max_episode_length=800, episodic_life=False))
    rewards = []
    env.step = (lambda step: lambda a: (lambda out: (rewards.append(float(out[1])), out)[1])(step(a)))(env.step)
    points: list = []
    score, length, _ = play_game(_Spy(always_noop_model(env.action_space.n)), env, CPU, seed=0, points=points)
    expected = [(i + 1, r) for i, r in enumerate(rewards) if r]
    assert len(expected) >= 3 and score == sum(r for _, r in expected) < 0  # a paddle that never moves loses
    assert points == expected and len(rewards) == length


def test_the_learners_lstm_state_is_zeroed_after_a_lost_life_and_the_game_goes_on():
    torch.manual_seed(0)
    env = atari_env("BreakoutNoFrameskip-v4", load_env_config("config.json", "BreakoutNoFrameskip-v4"),
                    episodic_life=True)
    agent = Agent(always_noop_model(env.action_space.n), env, CPU, seed=0)  # NOOP (mostly): the ball is lost
    ale = env.unwrapped.ale
    rollouts = []
    for _ in range(100):
        rollouts.append(agent.rollout(10))
        if rollouts[-1].terminated:
            break
    assert rollouts[-1].terminated and ale.lives() == 4 and len(rollouts) >= 2
    assert torch.count_nonzero(rollouts[-1].state[0]) > 0  # within a life the state is carried across rollouts
    frame = ale.getEpisodeFrameNumber()
    after = agent.rollout(10)
    assert ale.lives() == 4 and ale.getEpisodeFrameNumber() > frame  # the same game goes on: no real reset
    assert torch.count_nonzero(after.state[0]) == 0 and torch.count_nonzero(after.state[1]) == 0


def test_a_worker_records_per_step_losses_for_the_status_line(tmp_path, monkeypatch):
    """Issue 12, 6d: the status line says "per step", so a worker records each loss term divided by its rollout's
    step count (not the rollout's sum, which would be ~num_steps times larger): checked against the loss terms
    that the real update returned, over two updates (the first sets the average, the second is smoothed in)."""
    import math

    import train
    from a3g.run import status_line
    from run_state import EMA

    seen = []
    real_update = train.update

    def recording_update(model, rollout, handoff, optimizer, args, entropy_coef=None):
        loss, grad_norm = real_update(model, rollout, handoff, optimizer, args, entropy_coef)
        seen.append((rollout.actions.shape[0], loss.policy.item(), loss.value.item(), loss.entropy.item(), grad_norm))
        return loss, grad_norm

    monkeypatch.setattr(train, "update", recording_update)
    args = worker_args(tmp_path, num_steps=20)
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    run = RunState(1)
    assert train.run_worker(0, args, shared, None, run, CPU, max_updates=2) == 2
    assert len(seen) == 2 and all(s[0] > 1 for s in seen)  # a one-step rollout could not tell sum from mean
    per_step = [[p / n, v / n, e / n, g] for n, p, v, e, g in seen]
    expected = [EMA * a + (1 - EMA) * b for a, b in zip(*per_step)]
    row = run.update_stats[0].tolist()
    assert row[:2] == [2, sum(s[0] for s in seen)]  # updates, steps
    assert row[2:] == pytest.approx(expected, rel=1e-9, abs=1e-12), (row, seen)
    assert 0 < row[4] <= math.log(6) + 1e-6  # a per-step entropy of 6 actions; a rollout's sum is far above
    line = status_line(run, 0.0)
    assert f"per step: policy {expected[0]:.4f} value {expected[1]:.4f} entropy {expected[2]:.3f}" in line, line


def test_the_monitors_copy_waits_for_the_step_in_progress_and_gives_up_when_the_run_stops():
    """``sync_between_steps``: while a trainer is inside a step (a thread in the gate), the copy is of after the
    step; where the step never ends (a server killed inside it), it returns False once the run stops, without
    copying; without a gate (A3G mode) it copies at once."""
    import threading
    import time

    from ga3c.gate import StepGate
    from player_util import sync_between_steps
    shared, local = A3Clstm(1, 6, 32), A3Clstm(1, 6, 32)
    gate, inside = StepGate(), threading.Event()

    def step():
        with gate.writing():
            inside.set()
            time.sleep(0.3)
            with torch.no_grad():
                shared.critic_linear.bias.fill_(5.0)

    trainer = threading.Thread(target=step)
    trainer.start()
    inside.wait()
    with torch.no_grad():
        assert sync_between_steps(local, shared, gate, stopped=lambda: False)
    trainer.join()
    assert float(local.critic_linear.bias.detach()[0]) == 5.0
    with torch.no_grad():
        shared.critic_linear.bias.fill_(6.0)
        gate.state[0] += 1  # a step that never ends
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        assert not sync_between_steps(local, shared, gate, stopped=stop.is_set)
        assert float(local.critic_linear.bias.detach()[0]) == 5.0
        assert sync_between_steps(local, shared, None, stopped=lambda: True)
    assert float(local.critic_linear.bias.detach()[0]) == 6.0

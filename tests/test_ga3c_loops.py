"""GA3C's loops on real ALE Pong with tiny budgets (hidden 32): every loop ends on the stop flag, idle or busy;
the agent, predictor and trainer loops train the shared model in threads and with a spawned agent process next to
the server's threads, with exact counts; one process stepping all three in turn is deterministic; an agent that
fails reports its traceback."""
import multiprocessing as mp
import queue
import threading
import time

import torch

from ga3c.agent import AgentStepper, AtariEnvFactory, EnvRunner, agent_process, run_agent
from ga3c.buffers import EnvSlots
from ga3c.predictor import Predictor, SlotStates, queue_sink
from ga3c.server import Server
from ga3c.settings import Ga3cSettings
from ga3c.stats import EpisodeLog, Ga3cCounters
from ga3c.trainer import Trainer
from model import A3Clstm
from run_state import ErrorBoard, Flag
from shared_optim import make_optimizer

ENV = "PongNoFrameskip-v4"
H = 32
SETTINGS = Ga3cSettings(num_steps=5, train_batch=2, predict_batch=8, queue_size=8)


def shared_model(seed=0):
    torch.manual_seed(seed)
    model = A3Clstm(1, 6, H)
    model.share_memory()
    return model


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _stopped_later(seconds=0.3):
    stop = Flag()
    threading.Timer(seconds, stop.set).start()
    return stop


def test_every_loop_ends_on_the_stop_flag_even_when_idle():
    buffers = EnvSlots(2)
    pred = Predictor(A3Clstm(1, 6, 16), buffers, range(2), SlotStates(2, 16), num_steps=5, predict_batch=2)
    trainer = Trainer(A3Clstm(1, 6, 16), torch.optim.SGD(A3Clstm(1, 6, 16).parameters(), lr=0.0), SETTINGS)
    for loop in (lambda stop: pred.run(stop),  # no agent ever asks
                 lambda stop: trainer.run(queue.Queue(), stop),  # no segment ever comes
                 lambda stop: run_agent(0, [0, 1], EnvSlots(2), _StillEnvFactory(), stop)):  # no answer comes
        t0 = time.monotonic()
        assert loop(_stopped_later()) == 0
        assert 0.25 < time.monotonic() - t0 < 3


class _StillEnvFactory:
    def __call__(self, slot):
        return _StillEnv()


class _StillEnv:
    def reset(self, seed=None):
        return torch.zeros(1, 80, 80).numpy(), {}

    def close(self):
        pass


def test_agent_predictor_and_trainer_loops_train_in_threads(env_config):
    model, stop = shared_model(), Flag()
    before = weights(model)
    buffers, counters, episodes = EnvSlots(2), Ga3cCounters(1, 1, 1), EpisodeLog(1)
    segments = queue.Queue(maxsize=SETTINGS.queue_size)
    pred = Predictor(model, buffers, range(2), SlotStates(2, H), num_steps=SETTINGS.num_steps,
                     predict_batch=SETTINGS.predict_batch, counters=counters, sink=queue_sink(segments, stop))
    trainer = Trainer(model, make_optimizer("Adam", model.parameters(), 1e-3), SETTINGS, counters=counters)
    results = {}
    threads = [
        threading.Thread(target=lambda: results.update(agent=run_agent(
            0, [0, 1], buffers, AtariEnvFactory(ENV, env_config, seed=1), stop, counters=counters,
            episodes=episodes, seed=1))),
        threading.Thread(target=lambda: results.update(pred=pred.run(stop))),
    ]
    for th in threads:
        th.start()
    try:
        assert trainer.run(segments, stop, max_updates=3) == 3
    finally:
        stop.set()
        for th in threads:
            th.join(10)
    assert not any(th.is_alive() for th in threads)
    assert counters.version == 3 and results["agent"] == counters.steps >= 3 * 2 * SETTINGS.num_steps
    assert results["pred"] == counters.total_predictions
    assert counters.steps <= counters.total_predictions <= counters.steps + 2  # Pong: no episode ended here
    assert int(counters.trainer_stats[0, 1]) == 3 * SETTINGS.train_batch
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (buffers.norm_stats[:, 2] > 0).all()  # each env's normaliser statistics, for checkpoints


def one_process_run(env_config, seed, iterations=30):
    """Agent, predictor and trainer stepped in turn in one thread (a debugging mode)."""
    model = shared_model(seed)
    buffers, counters = EnvSlots(2), Ga3cCounters(1, 1, 1)
    segments = []
    pred = Predictor(model, buffers, range(2), SlotStates(2, H), num_steps=SETTINGS.num_steps,
                     predict_batch=SETTINGS.predict_batch, counters=counters, sink=segments.append, seed=seed)
    trainer = Trainer(model, make_optimizer("Adam", model.parameters(), 1e-3), SETTINGS, counters=counters)
    factory = AtariEnvFactory(ENV, env_config, seed=seed)
    stepper = AgentStepper(0, [EnvRunner(s, factory(s), buffers, factory.seed_for(s)) for s in range(2)], buffers,
                           counters)
    stepper.begin()
    lags = []
    for _ in range(iterations):
        pred.step()
        stepper.poll()
        while len(segments) >= SETTINGS.train_batch:
            lags.append(trainer.update(segments[: SETTINGS.train_batch]).lag_max)
            del segments[: SETTINGS.train_batch]
    stepper.close()
    return weights(model), counters, lags


def test_one_process_is_deterministic_and_measures_the_lag(env_config):
    w1, c1, lags = one_process_run(env_config, seed=3)
    w2, c2, _ = one_process_run(env_config, seed=3)
    assert c1.version == c2.version >= 4 and c1.steps == c2.steps
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    # segments of 2 envs close together: the second update of a pair trains data acted one update earlier
    assert lags[0] == 0 and max(lags) >= 1


def test_a_spawned_agent_feeds_the_servers_threads(env_config):
    ctx = mp.get_context("spawn")
    model, stop = shared_model(), Flag()
    before = weights(model)
    n_envs = 3
    buffers, counters, episodes, errors = EnvSlots(n_envs), Ga3cCounters(1, 2, 2), EpisodeLog(1), ErrorBoard(1)
    optimizer = make_optimizer("Adam", model.parameters(), 1e-3)
    server = Server(model, optimizer, buffers, counters, SETTINGS, stop, num_predictors=2, num_trainers=2)
    p = ctx.Process(target=agent_process, args=(0, list(range(n_envs)), buffers,
                                                AtariEnvFactory(ENV, env_config, seed=1), stop, counters, episodes,
                                                1, errors, 0))
    try:
        server.start()
        p.start()
        # until both predictors served too: the agent steps whichever envs are answered, so predictor 0's slots
        # alone can make the 4 updates while predictor 1's thread has not yet had the CPU
        deadline = time.monotonic() + 90
        while (counters.version < 4 or not all(int(counters.predictions[i]) > 0 for i in range(2))) \
                and not stop.is_set():
            assert time.monotonic() < deadline and p.is_alive(), (counters.predictions.tolist(), errors.read_all())
            time.sleep(0.05)
        stop.set()
        assert server.join(10)
        p.join(10)
        assert p.exitcode == 0
    finally:
        stop.set()
        server.join(5)
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert server.failures == [] and errors.read_all() == []
    assert counters.version >= 4
    assert all(int(counters.predictions[i]) > 0 for i in range(2))  # both predictors served their slots
    steps, preds = counters.steps, counters.total_predictions
    assert steps <= preds <= steps + n_envs  # each answer is one agent step, a few still in flight
    assert int(counters.trainer_stats[:, 0].sum()) <= steps
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (buffers.norm_stats[:, 2] > 0).all()  # written by the agent process on its way out


def test_an_agent_that_fails_reports_its_traceback(env_config):
    ctx = mp.get_context("spawn")
    errors, stop = ErrorBoard(1), Flag()
    p = ctx.Process(target=agent_process, args=(0, [0], EnvSlots(1), AtariEnvFactory("NoSuchGameNoFrameskip-v4",
                                                                                        env_config), stop,
                                                None, None, None, errors, 0))
    p.start()
    try:
        role, text = errors.get(timeout=60)
        p.join(30)
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert p.exitcode == 1 and role == "ga3c agent 0"
    assert "Traceback" in text and "unknown environment id 'NoSuchGameNoFrameskip-v4'" in text


def test_short_game_slots_cut_their_games_and_leave_them_out_of_the_learner_games(env_config):
    """``--short-game-slots 1 --short-game-length 7`` on the objects a run builds (the parsed flags, the agents'
    factory, an agent's runners): slot 0's games are cut at 7 agent steps (segments truncated there, each game a
    fresh reset) and not recorded as learner games; slot 1 plays on with the run's time limit."""
    from config import build_parser, validate
    from ga3c.agent import make_runners

    args = build_parser().parse_args(["--env", ENV, "--agents", "1", "--envs-per-agent", "2", "--short-game-slots",
                                      "1", "--short-game-length", "7", "--seed", "4", "--env-config", env_config])
    assert validate(args) == []
    factory = AtariEnvFactory.for_args(args)
    model = shared_model(0)
    buffers, counters, episodes = EnvSlots(2), Ga3cCounters(1, 1, 1), EpisodeLog(1)
    segments = []
    pred = Predictor(model, buffers, range(2), SlotStates(2, H), num_steps=5, predict_batch=8, counters=counters,
                     sink=segments.append, seed=0)
    stepper = AgentStepper(0, make_runners([0, 1], buffers, factory, args.seed), buffers, counters, episodes)
    limits = []
    for r in stepper.runners:
        e = r.env
        while not hasattr(e, "_max_episode_steps"):
            e = e.env
        limits.append(e._max_episode_steps)
    assert limits == [7, 10000]
    stepper.begin()
    for _ in range(60):
        pred.step()
        stepper.poll()
    frames = [r.env.unwrapped.ale.getEpisodeFrameNumber() for r in stepper.runners]
    stepper.close()
    assert frames[0] <= 30 + 7 * 4 < 200 <= frames[1]  # slot 0 is in a fresh game (no-op starts + 7 steps at most)
    short = [seg for seg in segments if seg.slot == 0]
    whole = [seg for seg in segments if seg.slot == 1]
    ends = [seg for seg in short if seg.truncated]
    # the reset's FIRE and action 2 count in the limit too: 5 learner steps a game, one segment of --num-steps 5
    assert len(ends) == len(short) >= 5 and all(len(seg.actions) == 5 for seg in ends)
    assert not any(seg.truncated or seg.terminated for seg in whole) and sum(len(s.actions) for s in whole) >= 50
    assert stepper.games == 0 and episodes.read_new() == []


def test_short_games_after_score_cut_the_short_slot_from_its_first_game_after_the_switch(env_config):
    """``--short-game-slots 1 --short-game-length 7 --short-games-after-score 19`` with whole games cut at 40 agent
    steps, on the objects a run builds: the agents' factory with the run's ``short_games`` flag
    (``Ga3cRun._start_agent``), handed to a spawned agent process. Slot 0 plays whole games (38 learner steps
    after the reset's FIRE and action 2) until the flag is set from this process in the middle of its second
    game; that game runs to 38 and every later one is cut at 5. Slot 1 plays 38-step games throughout."""
    from config import build_parser, validate
    from run_state import RunState

    args = build_parser().parse_args(["--env", ENV, "--agents", "1", "--envs-per-agent", "2", "--short-game-slots",
                                      "1", "--short-game-length", "7", "--short-games-after-score", "19",
                                      "--max-episode-length", "40", "--seed", "4", "--env-config", env_config])
    assert validate(args) == []
    run = RunState(3, norm_rows=2)
    factory = AtariEnvFactory.for_args(args, run.short_games)
    assert factory.short_switch is run.short_games and factory.max_length_of(0) == 40
    buffers, counters, errors = EnvSlots(2), Ga3cCounters(1, 1, 1), ErrorBoard(1)
    segments = []
    pred = Predictor(shared_model(0), buffers, range(2), SlotStates(2, H), num_steps=5, predict_batch=8,
                     counters=counters, sink=segments.append, seed=0)
    p = mp.get_context("spawn").Process(target=agent_process, args=(0, [0, 1], buffers, factory, run.stop, counters,
                                                                     None, args.seed, errors, 0))
    p.start()

    def games(slot):  # learner steps of each finished game of ``slot``, and of the one under way
        done, now = [], 0
        for seg in (s for s in segments if s.slot == slot):
            now += len(seg.actions)
            if seg.truncated or seg.terminated:
                done.append(now)
                now = 0
        return done, now

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not run.short_games.is_set():
            pred.step()
            done, now = games(0)
            if len(done) == 1 and now >= 10:  # the second game is past the short cut: it must not be cut
                run.short_games.set()
        while time.monotonic() < deadline and len(games(0)[0]) < 6:
            pred.step()
    finally:
        run.stop.set()
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert errors.read_all() == [] and p.exitcode == 0
    done = games(0)[0]
    assert done[:2] == [38, 38] and len(done) >= 6 and set(done[2:]) == {5}, done
    assert set(games(1)[0]) == {38} and len(games(1)[0]) >= 2

"""``--dynamic``: the adjuster's rule and bounds (pure), the policy-lag histogram, and a server that changes its
numbers of trainer and predictor threads while agents run, losing no env slot's episode."""
import queue
import random
import threading
import time

import numpy as np
import pytest
import torch

from ga3c.agent import AtariEnvFactory, run_agent
from ga3c.buffers import EnvSlots
from ga3c.dynamic import DynamicAdjuster, random_step
from ga3c.server import Server, ga3c_devices
from ga3c.settings import Ga3cSettings
from ga3c.stats import LAG_BINS, EpisodeLog, Ga3cCounters
from model import A3Clstm
from run_state import Flag
from shared_optim import make_optimizer


def test_random_steps_move_by_one_and_stay_within_the_bounds():
    rng = random.Random(0)
    lower, upper = (1, 1, 1), (2, 3, 4)
    for _ in range(500):
        current = tuple(rng.randint(lo, hi) for lo, hi in zip(lower, upper))
        step = random_step(current, lower, upper, rng)
        assert step != current
        assert all(lo <= s <= hi and abs(s - c) <= 1 for s, c, lo, hi in zip(step, current, lower, upper))
    assert random_step((1, 1, 1), (1, 1, 1), (1, 1, 1), rng) == (1, 1, 1)  # nothing can move


def run_adjuster(rates, window=10.0, start=(1, 1, 2), upper=(2, 2, 4)):
    """Drive an adjuster with a throughput per setting (``rates(counts) -> trained steps/s``); returns
    ``(setting run, best setting)`` at the start of each window, and the adjuster."""
    adj = DynamicAdjuster(start, (1, 1, 1), upper, window, seed=1)
    t, trained, ran = 0.0, 0, []
    assert adj.observe(t, trained) is None  # starts the first window
    for _ in range(40):
        ran.append((adj.current, adj.best))
        t += window
        trained += int(rates(adj.current) * window)
        adj.observe(t, trained)
        assert all(1 <= c <= u for c, u in zip(adj.current, upper))
    return ran, adj


def test_the_adjuster_keeps_what_is_faster_and_goes_back_from_what_is_slower():
    # more agents are faster up to 3, more trainers or predictors are slower
    def rates(c):
        return 100 * min(c[2], 3) - 10 * (c[0] - 1) - 10 * (c[1] - 1)

    ran, adj = run_adjuster(rates)
    assert adj.best == (1, 1, 3)  # (current may be a trial in progress)
    assert ran[0] == ((1, 1, 2), (1, 1, 2))
    assert any(e.startswith("keep NT 1 NP 1 NA 3") for e in adj.events)
    assert any(e.startswith("back to NT 1 NP 1 NA 3") for e in adj.events)
    # a trial that lost is followed by a window of the best setting (re-measured), then by a new trial
    for (cur, best), (nxt, best_after) in zip(ran, ran[1:]):
        if cur != best and best_after == best:
            assert nxt == best
        if cur == best:
            assert nxt != cur  # the next trial


def test_the_adjuster_never_leaves_a_setting_that_cannot_move():
    ran, adj = run_adjuster(lambda c: 50.0, start=(1, 1, 1), upper=(1, 1, 1))
    assert {cur for cur, _ in ran} == {(1, 1, 1)} and adj.best_rate == pytest.approx(50.0)


def test_the_adjuster_rejects_a_start_outside_its_bounds():
    with pytest.raises(ValueError):
        DynamicAdjuster((3, 1, 1), (1, 1, 1), (2, 2, 2), 1.0)


def test_the_lag_histogram_gives_exact_means_and_maxima_over_any_stretch():
    c = Ga3cCounters(1, 1, 2)
    c.record_update(0, steps=4, segments=1, lag_mean=0, lag_max=0, policy=0, value=0, entropy=0, grad_norm=0,
                    lags=torch.tensor([0, 1, 1, 2]))
    since = c.lag_hist.sum(0).clone()
    c.record_update(1, steps=3, segments=1, lag_mean=0, lag_max=0, policy=0, value=0, entropy=0, grad_norm=0,
                    lags=torch.tensor([3, 5, 1000]))
    assert c.lag_summary() == (pytest.approx((0 + 1 + 1 + 2 + 3 + 5 + LAG_BINS - 1) / 7), LAG_BINS - 1, 7)
    assert c.lag_summary(since) == (pytest.approx((3 + 5 + LAG_BINS - 1) / 3), LAG_BINS - 1, 3)
    assert c.lag_summary(c.lag_hist.sum(0).clone()) == (0.0, 0, 0)


def test_ga3c_devices_split_gpus_as_tensorpack():
    cpu = torch.device("cpu")
    assert ga3c_devices([-1]) == ([cpu], [cpu])
    gpu = [torch.device("cuda", i) for i in range(4)]
    assert ga3c_devices([0]) == ([gpu[0]], [gpu[0]])
    assert ga3c_devices([0, 1]) == ([gpu[0]], [gpu[1]])
    assert ga3c_devices([0, 1, 2, 3]) == (gpu[:2], gpu[2:])
    assert ga3c_devices([0, 1, 2]) == ([gpu[0]], gpu[1:3])


def test_the_server_changes_its_thread_counts_while_agents_run(env_config):
    torch.manual_seed(0)
    model = A3Clstm(1, 6, 32)
    model.share_memory()
    settings = Ga3cSettings(num_steps=5, train_batch=2, predict_batch=8, queue_size=4)
    n_envs = 4
    buffers, counters, episodes, stop = EnvSlots(n_envs), Ga3cCounters(1, 3, 3), EpisodeLog(1), Flag()
    server = Server(model, make_optimizer("Adam", model.parameters(), 1e-3), buffers, counters, settings, stop,
                    num_predictors=1, num_trainers=1).start()
    agent = threading.Thread(target=run_agent, args=(0, list(range(n_envs)), buffers,
                                                     AtariEnvFactory("PongNoFrameskip-v4", env_config, seed=1),
                                                     stop), kwargs={"counters": counters, "episodes": episodes})
    agent.start()

    def progress(updates_more, predictions_more, serving=0, timeout=120):
        """Until ``updates_more`` updates, ``predictions_more`` predictions, and a prediction by each of the first
        ``serving`` predictors: the agent steps whichever envs are answered, so the others' slots alone can make
        the counts while one predictor's thread has not yet had the CPU."""
        v0, p0, before = counters.version, counters.total_predictions, counters.predictions.clone()
        deadline = time.monotonic() + timeout
        while counters.version < v0 + updates_more or counters.total_predictions < p0 + predictions_more \
                or not ((counters.predictions - before)[:serving] > 0).all():
            assert time.monotonic() < deadline and not server.failures, (
                server.failures, (counters.predictions - before)[:serving].tolist())
            time.sleep(0.05)

    try:
        progress(2, 20)
        for nt, np_ in ((2, 3), (3, 1), (1, 2)):
            server.set_counts(nt, np_)
            assert server.counts == (nt, np_) and counters.active[:2].tolist() == [nt, np_]
            predictions = counters.predictions.clone()
            progress(2, 20, serving=np_)
            served = (counters.predictions - predictions)[:np_]
            assert (served > 0).all(), served  # every predictor of the new set serves its slots
        # no slot starves and no slot's LSTM state went back to zero without an episode start (Pong: no lost life)
        assert torch.count_nonzero(server.states.hx.abs().sum(1)) == n_envs
    finally:
        stop.set()
        assert server.join(10)
        agent.join(10)
    assert not agent.is_alive() and server.failures == []
    steps, preds = counters.steps, counters.total_predictions
    assert steps <= preds <= steps + n_envs


class CountingEnv:
    """One endless episode whose frames carry the step count t, and whose reward for the action at t is
    ``reward_at(t)``: a segment's rewards must line up with its frames."""

    def reset(self, seed=None):
        self.t = 0
        return self._obs(), {}

    def _obs(self):
        obs = np.zeros((1, 80, 80), np.float32)
        obs[0, 0, 0] = self.t
        return obs

    def step(self, action):
        reward = reward_at(self.t)
        self.t += 1
        return self._obs(), reward, False, False, {}

    def close(self):
        pass


def reward_at(t: int) -> float:
    return (t % 7 - 3) / 4


def wait_until(condition, what: str, timeout: float = 60.0, hold: float = 0.0) -> None:
    """Poll until ``condition()`` has held for ``hold`` seconds in a row."""
    deadline, since = time.monotonic() + timeout, None
    while True:
        now = time.monotonic()
        if not condition():
            since = None
        elif since is None:
            since = now
        if since is not None and now - since >= hold:
            return
        assert now < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.01)


def test_a_predictor_retired_while_the_segment_queue_is_full_hands_its_slots_over_cleanly():
    """``set_counts`` retires the predictors while the one serving slot 0 waits on a full segment queue (the
    trainers are behind). It must end its step (its closed segment may be dropped) before a new predictor takes
    the slot's open segment over: two predictors recording into one open segment put steps in twice, out of
    order, and rewards on other steps than the ones that earned them."""
    torch.manual_seed(0)
    model = A3Clstm(1, 6, 32)
    model.share_memory()
    settings = Ga3cSettings(num_steps=3, train_batch=1, predict_batch=1, queue_size=1)
    buffers, counters, stop = EnvSlots(1), Ga3cCounters(1, 2, 1), Flag()
    server = Server(model, torch.optim.SGD(model.parameters(), lr=0.0), buffers, counters, settings, stop,
                    num_predictors=1, num_trainers=0).start()  # no trainer: the test reads the queue itself
    agent = threading.Thread(target=run_agent, args=(0, [0], buffers, lambda slot: CountingEnv(), stop),
                             kwargs={"counters": counters})
    agent.start()
    segments = []
    try:
        # the queue is full and slot 0's request waits: its predictor is stuck putting a closed segment
        wait_until(lambda: server.segments.full() and buffers.waiting(torch.tensor([0])).numel() == 1,
                   "predictor waiting on the full queue", hold=0.3)
        # the retired predictor must end its step while the queue stays full: with no trainer, one that waited for
        # room would never end; the default timeout only leaves a busy machine time to run its thread
        server.set_counts(0, 2)
        assert not server.failures, server.failures
        # the new predictor of slot 0 serves two requests while the queue is still full
        wait_until(lambda: server.predictors[0].predictions >= 2, "new predictor serving slot 0")
        while len(segments) < 8:
            try:
                segments.append(server.segments.get(timeout=10))
            except queue.Empty:
                pytest.fail(f"no segment for 10 s after {len(segments)}; failures: {server.failures}")
    finally:
        stop.set()
        assert server.join(10)
        agent.join(10)
    assert not agent.is_alive() and server.failures == []
    seen = set()
    for seg in segments:
        ts = seg.frames[:, 0, 0, 0].long().tolist()
        assert len(ts) <= settings.num_steps and ts == list(range(ts[0], ts[0] + len(ts))), ts
        assert seg.rewards.tolist() == [reward_at(t) for t in ts], (ts, seg.rewards.tolist())
        assert not seen & set(ts), f"steps {sorted(seen & set(ts))} in two segments"
        seen |= set(ts)


def test_a_predictor_that_does_not_end_when_retired_halts_the_server_instead_of_getting_company():
    """A retired predictor still running after the timeout (a step stuck somewhere) would share its slots with its
    replacement: the server records the failure and halts, and starts no new predictor."""
    model = A3Clstm(1, 6, 32)
    buffers, counters, stop, release = EnvSlots(2), Ga3cCounters(1, 2, 1), Flag(), threading.Event()
    server = Server(model, torch.optim.SGD(model.parameters(), lr=0.0), buffers, counters, Ga3cSettings(), stop,
                    num_predictors=1, num_trainers=0)
    old = server.predictors
    old[0].run = lambda flag: release.wait(30)  # deaf to its flag
    server.start()
    try:
        server.set_counts(0, 2, timeout=0.2)
        assert server.halt.is_set() and server.predictors == old and server.counts == (0, 1)
        assert [role for role, _ in server.failures] == ["predictor 0"], server.failures
        assert "still running 0.2 s after being retired" in server.failures[0][1]
    finally:
        release.set()
        stop.set()
        assert server.join(10)


def test_a_trainer_that_does_not_end_when_retired_halts_the_server_instead_of_getting_a_second_thread():
    """A retired trainer still inside an update after the timeout: starting trainers again would run a second thread
    on the same ``Trainer`` (its one working copy of the weights); the server records the failure and halts."""
    model = A3Clstm(1, 6, 32)
    buffers, counters, stop, release = EnvSlots(2), Ga3cCounters(1, 1, 1), Flag(), threading.Event()
    server = Server(model, torch.optim.SGD(model.parameters(), lr=0.0), buffers, counters, Ga3cSettings(), stop,
                    num_predictors=0, num_trainers=1)
    server.trainers[0].run = lambda source, flag: release.wait(30)  # deaf to its flag
    server.start()
    try:
        server.set_counts(0, 0, timeout=0.2)
        assert server.halt.is_set() and server.counts == (0, 0)
        assert [role for role, _ in server.failures] == ["trainer 0"], server.failures
        assert "still running 0.2 s after being retired" in server.failures[0][1]
        server.set_counts(1, 0)  # what the server process would ask next, were it not halting
        alive = [th for th in server.threads if th.is_alive() and th.name == "ga3c trainer 0"]
        assert len(alive) <= 1, "two threads on one trainer"
    finally:
        release.set()
        stop.set()
        assert server.join(10)


def test_predictors_built_again_by_dynamic_do_not_draw_the_first_sets_random_numbers_again():
    """Each set of predictors that ``set_counts`` builds samples with seeds no earlier set used (the first set keeps
    ``seed + p``, so a run without ``--dynamic`` samples as before)."""
    model = A3Clstm(1, 6, 32)
    buffers, counters, stop = EnvSlots(4), Ga3cCounters(1, 2, 1), Flag()
    server = Server(model, torch.optim.SGD(model.parameters(), lr=0.0), buffers, counters, Ga3cSettings(), stop,
                    num_predictors=2, num_trainers=0, seed=7)
    seeds = [[p.generator.initial_seed() for p in server.predictors]]
    server.start()
    try:
        for n in (1, 2, 1):
            server.set_counts(0, n)
            seeds.append([p.generator.initial_seed() for p in server.predictors])
    finally:
        stop.set()
        assert server.join(10)
    assert seeds[0] == [7, 8]
    every = [s for built in seeds for s in built]
    assert len(every) == len(set(every)) == 6, seeds


def test_an_agent_that_dynamic_starts_again_gets_seeds_its_slots_have_not_had(tmp_path):
    """Agent a's slots are seeded with ``--seed + s`` at its first start, and with seeds no slot had before at each
    restart (the restarted agent's first games would otherwise replay the run's first games exactly)."""
    from config import build_parser
    from ga3c.run import Ga3cRun

    args = build_parser().parse_args(["--mode", "ga3c", "--agents", "2", "--envs-per-agent", "3", "--seed", "5",
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    run = Ga3cRun(args, A3Clstm(1, 6, 32), None, log=None)
    started = []

    class NotStarted:
        pid = None

        def is_alive(self):
            return False

    def record(role, target, target_args):
        slots, factory, seed = target_args[1], target_args[3], target_args[7]
        started.append((role, [seed + s for s in slots], [factory.seed_for(s) for s in slots]))
        return NotStarted()

    run._start = record
    try:
        for a in (0, 1, 0, 0, 1):
            run._start_agent(a)
    finally:
        run.release()
    assert started[0] == ("ga3c agent 0", [5, 6, 7], [5, 6, 7]) and started[1][1] == [8, 9, 10]
    every = [s for _, seeds, _ in started for s in seeds]
    assert len(every) == len(set(every)) == 15, started
    assert all(env_seeds == seeds for _, seeds, env_seeds in started)  # the action spaces' seeds move with them


def test_dynamic_never_blocks_the_main_loop_on_a_retired_agent_that_has_not_exited(tmp_path):
    """``--dynamic`` retires agent 1 and wants two agents again before agent 1's process has exited: the start
    waits for that exit in later ticks (the main loop goes on, so budgets and Ctrl-C are seen), is never made while
    the old process holds its env slots, and a start cancelled by a later retirement is never made."""
    from config import build_parser
    from ga3c.run import Ga3cRun

    args = build_parser().parse_args(["--mode", "ga3c", "--agents", "2", "--envs-per-agent", "2", "--dynamic",
                                      "--dynamic-max", "2", "2", "2",
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    run = Ga3cRun(args, A3Clstm(1, 6, 32), None, log=None)

    class Process:
        def __init__(self, pid):
            self.pid, self.alive = pid, True

        def is_alive(self):
            return self.alive

        def join(self, timeout=None):
            raise AssertionError("the main loop waited on an agent")

    started = []

    def record(role, target, target_args):
        started.append(role)
        return Process(len(started))

    run._start, run._ctx = record, object()
    try:
        run.apply_counts((1, 1, 2))
        assert started == ["ga3c agent 0", "ga3c agent 1"]
        first_1 = run.agents[1]
        run.apply_counts((1, 1, 1))  # retires agent 1, which goes on finishing its step
        run.apply_counts((1, 1, 2))
        assert started == ["ga3c agent 0", "ga3c agent 1"] and sorted(run.agents) == [0]
        run.tick(time.time())
        assert len(started) == 2
        first_1.alive = False  # it has let go of its slots
        run.tick(time.time())
        assert started[2:] == ["ga3c agent 1"] and sorted(run.agents) == [0, 1] and run.agents[1] is not first_1
        assert int(run.counters.active[2]) == 2
        second_1 = run.agents[1]
        run.apply_counts((1, 1, 1))
        run.apply_counts((1, 1, 2))  # pending again, then cancelled before its old process exits
        run.apply_counts((1, 1, 1))
        second_1.alive = False
        run.tick(time.time())
        assert len(started) == 3 and sorted(run.agents) == [0] and int(run.counters.active[2]) == 1
    finally:
        run.release()


def test_close_returns_only_between_optimizer_steps():
    """A trainer thread still running when the server closes may be inside an optimizer step: ``close`` then takes
    the step lock (waiting for the step to end) and keeps it, so the process exits between steps; a step that does
    not end in time is a False return."""
    model = A3Clstm(1, 6, 32)
    buffers, counters, stop, release = EnvSlots(2), Ga3cCounters(1, 1, 1), Flag(), threading.Event()
    server = Server(model, torch.optim.SGD(model.parameters(), lr=0.0), buffers, counters, Ga3cSettings(), stop,
                    num_predictors=0, num_trainers=1)
    in_step, stepped = threading.Event(), []

    def stuck_in_a_step(source, flag):
        with server.step_lock:
            in_step.set()
            release.wait(30)
            stepped.append(True)  # the step's last write

    server.trainers[0].run = stuck_in_a_step
    server.start()
    assert in_step.wait(10)
    assert server.close(0.1, step_timeout=0.2) is False  # the step is still going on
    threading.Timer(0.3, release.set).start()
    assert server.close(0.1, step_timeout=10) is True and stepped == [True]  # returned after the step ended
    assert server.step_lock.locked()  # and keeps the lock: no other step can begin before the process exits
    assert server.join(10)


def test_a_server_process_that_fails_while_running_closes_its_server_before_it_exits(monkeypatch):
    """An error in the server process while its threads run (here --dynamic's set_counts failing to build a
    trainer) is reported, and the server is closed (its threads halted, the step lock taken) before the process
    exits with 1, so that it never exits inside another trainer's optimizer step."""
    import multiprocessing as mp
    from argparse import Namespace
    import ga3c.server as srv
    ctx = mp.get_context("fork")
    closed, reported = ctx.Event(), ctx.Event()

    class FailingServer:
        halt, counts, failures = threading.Event(), (1, 1), []

        def start(self):
            return self

        def set_counts(self, nt, np_):
            raise MemoryError("no room for another trainer")

        def close(self, timeout, step_timeout):
            assert reported.is_set()  # the error goes to the main process first
            closed.set()
            return True

    class Errors:
        def report(self, slot, role, text):
            assert "no room for another trainer" in text
            reported.set()

    class Run:
        stop, errors = threading.Event(), Errors()

        def mark_ready(self, slot):
            pass

    class Counters:
        targets = torch.tensor([2, 1, 2])

    monkeypatch.setattr(srv, "build_server", lambda *a, **k: FailingServer())
    args = Namespace(gpu_ids=[-1], seed=1, dynamic=True)
    child = ctx.Process(target=srv.server_process, args=(0, args, None, None, None, Counters(), Run()))
    child.start()
    child.join(30)
    assert child.exitcode == 1 and reported.is_set() and closed.is_set()


def stop_after_each_pass(trainer, stop):
    """Make ``trainer`` set ``stop`` right after each of its optimizer steps; returns its own ``_step``."""
    step = trainer._step

    def step_then_stop(*a, **kw):
        result = step(*a, **kw)
        stop.set()
        return result

    trainer._step = step_then_stop
    return step


@pytest.mark.parametrize("later", ["full", "lstm"])
def test_a_stopped_trainer_ends_between_its_passes(later):
    """--train-passes 3 with the stop flag set after the first pass: the trainer makes that pass, not the other two.
    With ``--later-passes lstm`` the same, and the passes it does make after the first reuse that pass's batch and
    conv features (passed as ``reuse``), the first pass never."""
    from ga3c.segment import Segment
    from ga3c.trainer import Trainer
    model = A3Clstm(1, 6, 32)
    counters, stop = Ga3cCounters(1, 1, 1), Flag()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                      Ga3cSettings(train_passes=3, later_passes=later), counters=counters)
    n = 4
    seg = Segment(slot=0, frames=torch.zeros(n, 1, 80, 80), actions=torch.zeros(n, dtype=torch.int64),
                  rewards=torch.zeros(n), mu=torch.full((n,), 1 / 6), versions=torch.zeros(n, dtype=torch.int64),
                  state=(torch.zeros(1, 32), torch.zeros(1, 32)), terminated=False, truncated=False, bootstrap=0.0)
    step = stop_after_each_pass(trainer, stop)
    reused = []  # per optimizer step: whether it was handed the first pass's batch and conv features
    first = []  # the batch and features the last first pass trained on

    def recording(inner):
        def call(*a, **kw):
            reuse = kw.get("reuse")
            reused.append(reuse is not None)
            if reuse is not None:  # that very batch, and its features cut from the first pass's graph
                assert reuse[0] is first[-1][0] and not reuse[1].requires_grad
                assert torch.equal(reuse[1], first[-1][1])
            out = inner(*a, **kw)
            if reuse is None:
                first.append((out[1], out[2].detach()))
            return out
        return call

    trainer._step = recording(trainer._step)
    trainer.update([seg], stop)
    assert trainer.updates == 1 and counters.version == 1 and reused == [False]
    stop.clear()
    trainer._step = recording(step)
    trainer.update([seg], stop)
    assert trainer.updates == 4 and counters.version == 4  # without the flag, all three
    assert reused == [False, False] + [later == "lstm"] * 2


def test_a_trainer_stopped_between_passes_blends_the_average_once():
    """--train-passes 3 with --ema-steps, the stop flag set after the first pass: the applied pass goes into the
    moving average once (before, the average was blended only after the K-th pass, so it missed the batch)."""
    from averaging import ema_weight, make_average
    from ga3c.segment import Segment
    from ga3c.trainer import Trainer
    torch.manual_seed(0)
    model = A3Clstm(1, 6, 32)
    average = make_average(model)
    start = [p.detach().clone() for p in average.parameters()]
    stop = Flag()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                      Ga3cSettings(train_passes=3, ema_steps=10), average_model=average)
    n = 4
    seg = Segment(slot=0, frames=torch.randn(n, 1, 80, 80), actions=torch.tensor([0, 1, 2, 3]),
                  rewards=torch.tensor([0.0, 1.0, -1.0, 1.0]), mu=torch.full((n,), 1 / 6),
                  versions=torch.zeros(n, dtype=torch.int64), state=(torch.zeros(1, 32), torch.zeros(1, 32)),
                  terminated=True, truncated=False, bootstrap=0.0)
    stop_after_each_pass(trainer, stop)
    trainer.update([seg], stop)
    assert trainer.updates == 1
    w = ema_weight(n, 10)
    moved = 0
    for (name, a), s0, p in zip(average.named_parameters(), start, model.parameters()):
        assert torch.allclose(a, s0.lerp(p.detach(), w), atol=1e-6, rtol=0), name
        moved += int(not torch.equal(a, s0))
    assert moved > 0  # the pass moved the weights, and the average with them


def test_a_retired_trainers_partial_batch_goes_back_on_the_queue():
    """A trainer stopped (retired by --dynamic) with 2 of its 3 segments taken puts them back for the next trainer
    rather than losing steps the agents counted."""
    from ga3c.segment import Segment
    from ga3c.trainer import Trainer
    model = A3Clstm(1, 6, 32)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), Ga3cSettings(train_batch=3))
    source, retire = queue.Queue(maxsize=8), Flag()
    segs = [Segment(slot=s, frames=torch.zeros(2, 1, 80, 80), actions=torch.zeros(2, dtype=torch.int64),
                    rewards=torch.zeros(2), mu=torch.full((2,), 1 / 6), versions=torch.zeros(2, dtype=torch.int64),
                    state=(torch.zeros(1, 32), torch.zeros(1, 32)), terminated=False, truncated=False, bootstrap=0.0)
            for s in range(2)]
    for seg in segs:
        source.put(seg)
    th = threading.Thread(target=lambda: trainer.run(source, retire, poll=0.01))
    th.start()
    deadline = time.monotonic() + 10
    while not source.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    retire.set()
    th.join(10)
    assert not th.is_alive() and trainer.updates == 0
    assert [source.get_nowait().slot for _ in range(source.qsize())] == [0, 1]


def test_a_held_window_measures_nothing_of_the_start_up():
    """``hold`` while the setting starts (nothing trained yet): the window opens at the last hold, so the first
    rate is 1,000 transitions over the 10 s after it, not over the 15 s since the first observation."""
    adj = DynamicAdjuster((2, 1, 2), (1, 1, 1), (4, 2, 4), window=10.0, seed=0)
    assert adj.observe(0.0, 0) is None
    adj.hold(5.0, 0)
    assert adj.observe(14.0, 900) is None and adj.best_rate is None  # 9 s since the hold
    adj.observe(15.0, 1000)
    assert adj.best_rate == pytest.approx(100.0)


def test_dynamic_measures_a_setting_only_once_it_is_all_running(tmp_path):
    """The main process holds the adjuster's window until this run's first update is in (a resumed run's too),
    the server's counts are at their targets and every agent is ready."""
    from config import build_parser
    from ga3c.run import Ga3cRun

    args = build_parser().parse_args(["--mode", "ga3c", "--agents", "2", "--envs-per-agent", "2", "--dynamic",
                                      "--dynamic-max", "4", "2", "4",
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    run = Ga3cRun(args, A3Clstm(1, 6, 32), None, log=None)
    try:
        c = run.counters
        run.agents = {0: None, 1: None}
        c.targets[0], c.targets[1] = args.trainers, args.predictors  # as launch() sets them
        c.active[0], c.active[1] = args.trainers, args.predictors
        run.run.ready[0] = run.run.ready[1] = 1
        assert not run._settled()  # no update yet
        c.restore(500_000, 1234)
        assert c.version == 1234 and not run._settled()  # resumed: the checkpoint's updates are not this run's
        c.updates[0] = 1
        assert run._settled()
        run.run.ready[1] = 0
        assert not run._settled()  # agent 1 still building its environments
        run.run.ready[1] = 1
        c.targets[0] = args.trainers + 1
        assert not run._settled()  # the server has not started the new trainer yet
        c.active[0] = args.trainers + 1
        assert run._settled()
        run._pending_agents.append(1)
        assert not run._settled()
    finally:
        run.release()

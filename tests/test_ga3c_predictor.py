"""GA3C's predictor: one batched step over many env slots equals stepping each env alone with ``A3Clstm.forward``
(per-slot LSTM states, reset at episode starts, kept for slots not in the batch); the batch cap serves slots in
turn; the segments it assembles from an agent's steps match a batch-1 replay (terminal transition and reward
kept, bootstrap 0 after a termination and V after a truncation or a cut); a restarted agent's unfinished segment
is dropped; after a lost life on real Breakout the slot's state starts from zero."""
import pytest
import torch
import torch.nn.functional as F

from conftest import always_noop_model
from ga3c.agent import AgentStepper, EnvRunner
from ga3c.buffers import EnvSlots
from ga3c.predictor import Predictor, SlotStates
from ga3c.stats import Ga3cCounters
from model import A3Clstm, ActivationCache

H, A = 32, 6


def close(a, b):
    return torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def make(model, n, *, num_steps=5, predict_batch=None, greedy=False, save_activations=False, greedy_slots=()):
    buffers = EnvSlots(n)
    states = SlotStates(n, model.hidden_size)
    segments = []
    counters = Ga3cCounters(1, 1, 1)
    pred = Predictor(model, buffers, range(n), states, num_steps=num_steps, predict_batch=predict_batch or n,
                     counters=counters, sink=segments.append, greedy=greedy, save_activations=save_activations,
                     greedy_slots=greedy_slots)
    return buffers, states, pred, segments, counters


def test_greedy_slots_take_the_argmax_with_mu_1_and_the_others_sample():
    """--greedy-slots 2 after 1 short slot: slots 1 and 2 answer the argmax of their logits with mu = 1, and their
    segments say greedy; the other slots sample (over 30 rounds they take other actions than the argmax) with mu
    their action's probability."""
    torch.manual_seed(3)
    model = A3Clstm(1, A, H)
    n = 5
    buffers, _, pred, segments, _ = make(model, n, num_steps=3, greedy_slots=range(1, 3))
    g = torch.Generator().manual_seed(4)
    not_argmax = 0
    for r in range(30):
        for s in range(n):
            buffers.submit(s, torch.randn(1, 80, 80, generator=g), episode_start=r == 0, reward=0.0)
        out = pred.step()
        for j, s in enumerate(out.slots.tolist()):
            a, best = int(out.actions[j]), int(out.logits[j].argmax())
            p = F.softmax(out.logits[j], 0)[a].item()
            if s in (1, 2):
                assert a == best and buffers.mu[s].item() == 1.0, (r, s)
            else:
                assert buffers.mu[s].item() == pytest.approx(p, rel=1e-4)
                not_argmax += a != best
    assert not_argmax > 10  # a near-uniform policy: the sampled slots mostly leave the argmax
    assert segments and all(seg.greedy == (seg.slot in (1, 2)) for seg in segments)
    assert all(bool((seg.mu == 1.0).all()) for seg in segments if seg.greedy)


def test_a_batched_step_equals_stepping_each_env_alone():
    torch.manual_seed(0)
    model = A3Clstm(1, A, H)
    n = 6
    buffers, states, pred, _, counters = make(model, n)
    ref = {s: model.initial_state() for s in range(n)}
    g = torch.Generator().manual_seed(1)
    # (slots that post a request, slots among them starting an episode), round by round
    rounds = [(range(6), range(6)), ([0, 2, 3, 5], []), ([1, 2, 5], []), ([0, 1, 2, 3, 4, 5], [3]),
              ([4], []), ([0, 3, 4], [0]), ([1, 2, 3, 4, 5], [5]), ([0, 1, 2, 3, 4, 5], [])]
    for r, (posting, starting) in enumerate(rounds):
        counters.updates[0] = r  # the model version stamped on the answers
        obs = {}
        for s in posting:
            obs[s] = torch.randn(1, 80, 80, generator=g)
            # a start after round 0 follows a termination (a lost life for learners)
            buffers.submit(s, obs[s], episode_start=s in starting, terminated=r > 0 and s in starting, reward=1.0)
        out = pred.step()
        assert sorted(out.slots.tolist()) == sorted(posting)
        with torch.no_grad():
            for j, s in enumerate(out.slots.tolist()):
                if s in starting:
                    ref[s] = model.initial_state()
                v, lg, ref[s] = model(obs[s].unsqueeze(0), ref[s])  # batch 1
                assert close(out.values[j], v.view(())) and close(out.logits[j], lg[0])
                a = int(out.actions[j])
                assert int(buffers.action[s]) == a and int(buffers.version[s]) == r
                assert buffers.mu[s].item() == pytest.approx(F.softmax(lg, 1)[0, a].item(), rel=1e-4)
                assert int(buffers.resp_seq[s]) == int(buffers.req_seq[s])
        for s in range(n):  # served or not, every slot's state is its own env's
            assert close(states.hx[s], ref[s][0][0]) and close(states.cx[s], ref[s][1][0]), (r, s)
    assert pred.step() is None  # nothing waiting
    assert counters.total_predictions == sum(len(p) for p, _ in rounds)


def test_a_private_model_follows_the_shared_one_when_the_version_moves():
    torch.manual_seed(5)
    shared, private = A3Clstm(1, A, 16), A3Clstm(1, A, 16).channels_last()
    buffers, states = EnvSlots(1), SlotStates(1, 16)
    counters = Ga3cCounters(1, 1, 1)
    pred = Predictor(private, buffers, [0], states, num_steps=5, predict_batch=1, counters=counters, source=shared)
    frame = torch.randn(1, 80, 80)
    for version in (0, 1):
        with torch.no_grad():
            for p in shared.parameters():
                p.add_(0.01)  # a trainer's update
        counters.updates[0] = version
        buffers.submit(0, frame, episode_start=True)
        out = pred.step()
        assert out.version == version and all(torch.equal(p, q) for p, q in zip(private.parameters(),
                                                                                 shared.parameters()))
        with torch.no_grad():
            v, _, _ = shared(frame.unsqueeze(0), shared.initial_state())
        assert close(out.values[0], v.view(()))


def test_the_servers_predictor_reads_the_version_and_copies_the_weights_under_the_step_lock(tmp_path, monkeypatch):
    """The trainers step the optimizer and move the version under the server's step lock; a predictor that read
    the version, then copied weights a step had changed meanwhile, would stamp newer weights with an older
    version (and those frames would be replayed as the trainer's own)."""
    import ga3c.predictor
    from config import build_parser, validate
    from ga3c.run import Ga3cRun
    from ga3c.server import build_server
    from shared_optim import make_optimizer

    args = build_parser().parse_args(["--mode", "ga3c", "--agents", "1", "--envs-per-agent", "1", "--hidden-size",
                                      "16", "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    assert validate(args) == []
    shared = A3Clstm(1, A, 16)
    shared.share_memory()
    optimizer = make_optimizer("Adam", shared.parameters(), 1e-3, False, shared=True)
    run = Ga3cRun(args, shared, optimizer, log=None)
    try:
        server = build_server(args, shared, optimizer, run.buffers, run.counters, run.run.stop)
        (pred,) = server.predictors
        held = []
        real_sync = ga3c.predictor.sync_weights
        monkeypatch.setattr(ga3c.predictor, "sync_weights",
                            lambda local, source: (held.append(server.step_lock.locked()), real_sync(local, source)))
        run.buffers.submit(0, torch.randn(1, 80, 80), episode_start=True)
        assert pred.step() is not None
        assert held == [True]
    finally:
        run.release()


@pytest.mark.parametrize("sync_every", [1, 3])
def test_every_action_is_stamped_with_the_version_of_the_weights_that_acted(sync_every):
    """A private copy synced every ``sync_every`` updates acts with weights up to ``sync_every - 1`` updates older
    than the shared model: the answer, the segment and so the trainer's lag histogram must name the copy's
    version (the last sync's), not the current one, or the lag is under-counted where it is largest."""
    from ga3c.settings import Ga3cSettings
    from ga3c.trainer import Trainer

    torch.manual_seed(6)
    shared, private = A3Clstm(1, A, 16), A3Clstm(1, A, 16).channels_last()
    buffers, states = EnvSlots(1), SlotStates(1, 16)
    counters = Ga3cCounters(1, 1, 1)
    segments = []
    pred = Predictor(private, buffers, [0], states, num_steps=4, predict_batch=1, counters=counters, source=shared,
                     sync_every=sync_every, sink=segments.append)
    weights = {}  # version -> the shared weights at that version
    g = torch.Generator().manual_seed(7)
    for version in range(8):
        with torch.no_grad():
            for p in shared.parameters():
                p.add_(0.01)  # a trainer's update
        counters.updates[0] = version
        weights[version] = [p.detach().clone() for p in shared.parameters()]
        buffers.submit(0, torch.randn(1, 80, 80, generator=g), episode_start=version == 0, reward=0.5)
        out = pred.step()
        synced = version - version % sync_every  # copied at versions 0, sync_every, 2 sync_every, ...
        assert out.version == int(buffers.version[0]) == synced, (version, out.version)
        assert all(torch.equal(p, q) for p, q in zip(private.parameters(), weights[synced]))  # those acted
    (seg,) = segments  # steps at versions 0-3, closed by the outcome in the request at version 4
    stamped = [v - v % sync_every for v in range(4)]
    assert seg.versions.tolist() == stamped
    trainer = Trainer(shared, torch.optim.SGD(shared.parameters(), lr=0.0), Ga3cSettings(num_steps=4, train_batch=1),
                      counters=counters)
    result = trainer.update(segments)  # at version 7
    lags = [7 - v for v in stamped]
    assert (result.lag_mean, result.lag_max) == (pytest.approx(sum(lags) / 4), max(lags))
    assert counters.lag_summary() == (pytest.approx(sum(lags) / 4), max(lags), 4)


def test_the_batch_cap_serves_waiting_slots_in_turn():
    model = A3Clstm(1, A, 16)
    buffers, _, pred, _, _ = make(model, 5, predict_batch=2)
    frame = torch.zeros(1, 80, 80)
    for s in range(5):
        buffers.submit(s, frame, episode_start=True)
    served = []
    for _ in range(4):  # every answered slot asks again at once: slot 4 must not starve
        out = pred.step()
        served.append(out.slots.tolist())
        for s in out.slots.tolist():
            buffers.submit(s, frame)
    assert served == [[0, 1], [2, 3], [4, 0], [1, 2]]


class ScriptEnv:
    """Episodes of scripted lengths and ends (``term`` or ``trunc``), then one endless episode. Observations are a
    function of (slot, episode, t); the reward 2.0 every 3rd step checks clipping. Records what it returned."""

    def __init__(self, slot, script):
        self.slot, self.script = slot, list(script)
        self.episodes = []

    def _obs(self):
        g = torch.Generator().manual_seed(1000 * self.slot + 37 * len(self.episodes) + self.t)
        return torch.randn(1, 80, 80, generator=g).numpy()

    def reset(self, seed=None):
        self.t = 0
        obs = self._obs()
        self.episodes.append({"obs": [obs], "actions": [], "rewards": [], "end": None})
        return obs, {}

    def step(self, action):
        ep = self.episodes[-1]
        self.t += 1
        length, kind = self.script[len(self.episodes) - 1] if len(self.episodes) <= len(self.script) else (0, None)
        reward = 2.0 if self.t % 3 == 0 else (-0.5 if self.t % 2 else 0.0)
        obs = self._obs()
        ep["obs"].append(obs)
        ep["actions"].append(int(action))
        ep["rewards"].append(reward)
        terminated, truncated = self.t == length and kind == "term", self.t == length and kind == "trunc"
        if terminated or truncated:
            ep["end"] = kind
        return obs, reward, terminated, truncated, {}

    def close(self):
        pass


@torch.no_grad()
def expected_segments(model, env, num_steps):
    """What the predictor must emit for ``env``'s finished episodes, from a batch-1 replay of each episode."""
    out = []
    for ep in env.episodes:
        if ep["end"] is None:
            break
        obs = [torch.from_numpy(o).unsqueeze(0) for o in ep["obs"]]
        n = len(ep["actions"])
        state = model.initial_state()
        states, values, probs = [], [], []
        for i in range(n + 1):
            states.append(state)
            v, lg, state = model(obs[i], state)
            values.append(float(v))
            probs.append(F.softmax(lg, 1)[0])
        for k in range(0, n, num_steps):
            end = min(k + num_steps, n)
            last = end == n
            out.append({
                "frames": torch.cat(obs[k:end]), "actions": ep["actions"][k:end],
                "rewards": [max(-1.0, min(1.0, r)) for r in ep["rewards"][k:end]],
                "mu": torch.stack([probs[i][ep["actions"][i]] for i in range(k, end)]), "state": states[k],
                "terminated": last and ep["end"] == "term", "truncated": last and ep["end"] == "trunc",
                "bootstrap": 0.0 if last and ep["end"] == "term" else values[end]})
    return out


@pytest.mark.parametrize("save_activations", [False, True])
def test_segments_match_a_batch_1_replay_of_each_episode(save_activations):
    torch.manual_seed(3)
    model = A3Clstm(1, A, H).channels_last() if save_activations else A3Clstm(1, A, H)
    scripts = [[(7, "term"), (4, "trunc"), (5, "term"), (10, "trunc")], [(3, "trunc"), (12, "term"), (1, "term")],
               []]
    buffers, _, pred, segments, counters = make(model, 3, num_steps=5, save_activations=save_activations)
    envs = [ScriptEnv(s, scripts[s]) for s in range(3)]
    stepper = AgentStepper(0, [EnvRunner(s, envs[s], buffers) for s in range(3)], buffers, counters)
    stepper.begin()
    answered = {}  # (slot, frame) -> the model version when the predictor answered it
    for it in range(45):
        counters.updates[0] = it // 4
        out = pred.step()
        for s in out.slots.tolist():
            assert int(buffers.version[s]) == it // 4
            answered[s, buffers.obs[s].numpy().tobytes()] = it // 4
        stepper.poll()
    for s, env in enumerate(envs):
        got = [seg for seg in segments if seg.slot == s]
        want = expected_segments(model, env, 5)
        assert len(want) == {0: 6, 1: 5, 2: 0}[s]  # 2+1+1+2 chunks; 1+3+1; no episode ended
        assert len(got) >= len(want)  # plus the cuts of the endless episode
        for seg, w in zip(got, want):
            assert torch.equal(seg.frames, w["frames"]) and seg.actions.tolist() == w["actions"]
            assert seg.rewards.tolist() == w["rewards"]  # the terminal step and its reward are kept
            assert (seg.terminated, seg.truncated) == (w["terminated"], w["truncated"])
            assert seg.bootstrap == pytest.approx(w["bootstrap"], abs=1e-5)
            assert close(seg.mu, w["mu"])
            assert close(seg.state[0], w["state"][0]) and close(seg.state[1], w["state"][1])
            # each step names the version that answered it (the model acting is the counted one here)
            assert seg.versions.tolist() == [answered[s, f.numpy().tobytes()] for f in seg.frames]
            if save_activations:  # each frame's conv activations, as a batched forward of the segment computes them
                cache = ActivationCache()
                with torch.no_grad():
                    model.features(seg.frames, cache)
                (step,) = cache.steps
                want_acts = [step[0][0]] + [t for _, indices, output in step for t in (indices, output)]
                assert [a.shape for a in seg.acts] == [a.shape for a in want_acts]
                assert all(close(a.float(), b.float()) for a, b in zip(seg.acts, want_acts))
                assert seg.acts[2].is_contiguous(memory_format=torch.channels_last)
            else:
                assert seg.acts is None
        assert all(seg.bootstrap == 0.0 for seg in got if seg.terminated)
    steps = sum(len(ep["actions"]) for env in envs for ep in env.episodes)
    assert stepper.steps == counters.steps == steps  # every agent step counted once
    finals = sum(ep["end"] == "trunc" for env in envs for ep in env.episodes)
    # every answer was used, by a step or by the reset after a final request; 3 requests are still in flight
    assert counters.total_predictions == steps + finals
    assert int(buffers.req_seq.sum()) == steps + finals + 3


def test_a_restarted_agent_drops_the_unfinished_segment():
    torch.manual_seed(4)
    model = A3Clstm(1, A, H)
    buffers, states, pred, segments, _ = make(model, 1, num_steps=5)
    old = EnvRunner(0, ScriptEnv(0, []), buffers)
    old.begin()
    for _ in range(8):  # one segment of 5 closed, 3 steps pending
        pred.step()
        assert old.answered()
        old.on_response()
    assert len(segments) == 1 and float(states.hx.abs().sum()) > 0
    new_env = ScriptEnv(0, [(2, "term")])  # the old agent died; a new one takes the slot over
    new = EnvRunner(0, new_env, buffers)
    new.begin()
    for _ in range(3):
        pred.step()
        new.on_response()
    assert len(segments) == 2
    seg = segments[1]
    assert seg.terminated and len(seg) == 2 and seg.bootstrap == 0.0
    assert torch.count_nonzero(seg.state[0]) == 0 and torch.count_nonzero(seg.state[1]) == 0
    assert torch.equal(seg.frames[0, 0], torch.from_numpy(new_env.episodes[0]["obs"][0][0]))



def test_an_agent_taking_a_slot_over_writes_it_only_once_the_last_request_is_answered():
    """A new agent does not write a slot while the old agent's last request is unanswered (the predictor may be
    copying it): it posts its first request after the answer, or after its timeout when nothing answers."""
    import threading
    buffers = EnvSlots(1)
    old = EnvRunner(0, ScriptEnv(0, []), buffers)
    old.begin()
    obs_before = buffers.obs[0].clone()
    new = EnvRunner(0, ScriptEnv(1, []), buffers)
    taking_over = threading.Thread(target=new.begin, kwargs={"timeout": 60.0})
    taking_over.start()
    taking_over.join(0.3)
    assert taking_over.is_alive()
    assert int(buffers.req_seq[0]) == 1 and torch.equal(buffers.obs[0], obs_before)  # nothing written
    buffers.respond(torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), torch.tensor([0.5]), 0)
    taking_over.join(60)
    assert not taking_over.is_alive()
    assert new.seq == int(buffers.req_seq[0]) == 2 and int(buffers.episode_start[0]) == 1
    assert not torch.equal(buffers.obs[0], obs_before)
    unanswered = EnvRunner(0, ScriptEnv(2, []), buffers)  # request 2 is never answered: no predictor
    unanswered.begin(timeout=0.2)
    assert unanswered.seq == int(buffers.req_seq[0]) == 3


def test_an_agent_fences_after_each_answer_it_sees_before_it_writes_its_slot_again(monkeypatch):
    """On a weakly ordered CPU the agent's next writes to a slot must come after the predictor's copy of the last
    request: an acquire fence once the answer is seen, before every request but the very first, on every path
    (a step's answer, the answer to a ``final`` request, which reads no action, and a slot taken over)."""
    import ga3c.agent
    import ga3c.buffers
    torch.manual_seed(5)
    buffers, _, pred, _, _ = make(A3Clstm(1, A, H), 1, num_steps=5)
    orders, agent_side = [], [False]

    def record(order):
        if agent_side[0]:
            orders.append(order)
    monkeypatch.setattr(ga3c.agent, "fence", record, raising=False)
    monkeypatch.setattr(ga3c.buffers, "fence", record)
    env = ScriptEnv(0, [(2, "trunc"), (3, "term")])
    stepper = AgentStepper(0, [EnvRunner(0, env, buffers)], buffers)
    agent_side[0] = True
    stepper.begin()
    agent_side[0] = False
    for _ in range(8):
        pred.step()
        agent_side[0] = True
        assert stepper.poll() == 1
        agent_side[0] = False
    assert len(env.episodes) == 3 and env.episodes[0]["end"] == "trunc"  # a final request was answered
    releases = [i for i, o in enumerate(orders) if o == ga3c.buffers.RELEASE]
    assert len(releases) == 9  # begin's request and one per answer
    for start, end in zip([-1] + releases, releases):
        assert ga3c.buffers.ACQUIRE in orders[start + 1:end], (start, end, orders)
    taken_over = EnvRunner(0, ScriptEnv(1, []), buffers)  # its slot's last request is answered
    pred.step()
    orders.clear()
    agent_side[0] = True
    taken_over.begin()
    assert orders == [ga3c.buffers.ACQUIRE, ga3c.buffers.RELEASE]
    pred.step()
    orders.clear()
    assert taken_over.answered() and orders == [ga3c.buffers.ACQUIRE]


def test_a_lost_life_starts_the_slots_state_from_zero_and_the_game_goes_on(env_config):
    from environment import atari_env, load_env_config
    env = atari_env("BreakoutNoFrameskip-v4", load_env_config(env_config, "BreakoutNoFrameskip-v4"),
                    max_episode_length=5000, episodic_life=True)
    model = always_noop_model(env.action_space.n)
    buffers, states, pred, segments, _ = make(model, 1, num_steps=20, greedy=True)
    runner = EnvRunner(0, env, buffers, seed=0)
    runner.begin()
    ale = env.unwrapped.ale
    for _ in range(2000):
        before = states.hx.clone()
        out = pred.step()
        if segments and segments[-1].terminated:
            break
        runner.on_response()
    last = segments[-1]
    assert last.terminated and last.bootstrap == 0.0 and ale.lives() == 4  # a life lost, the game goes on
    assert bool(buffers.episode_start[0]) and bool(buffers.terminated[0])  # the request just served
    assert float(before.abs().sum()) > 0  # the state had been carried through the life
    hx, cx = model.initial_state(1)
    with torch.no_grad():  # the first observation of the next life, from a zeroed state
        v, _, (hx, cx) = model(buffers.obs[:1], (hx, cx))
    assert close(states.hx[0], hx[0]) and close(out.values[0], v.view(()))
    runner.on_response()
    for _ in range(20):
        pred.step()
        runner.on_response()
    nxt = segments[-1]
    assert not nxt.terminated and torch.count_nonzero(nxt.state[0]) == 0  # started at the new life, from zero

"""``--train-envs``: the learners play a mix of one game's env ids (sticky and non-sticky, say) while the monitor and
the saved files stay ``--env``'s. Checked on the objects the run builds: the factory a GA3C agent process gets and
the env an A3G worker makes, on real ALE, and main.py as a subprocess."""
import time

import pytest
import torch

import train
from config import build_parser, train_env_id, train_envs_line, validate
from conftest import ROOT, run_entry
from ga3c.run import Ga3cRun
from model import A3Clstm
from run_state import RunState
from test_faults import check_end, launch, load_saved, models_dir, wait_for_steps  # noqa: F401 - launch: fixture
from test_ga3c_main import ga3c_fault_args

CPU = torch.device("cpu")
MIX = ["ALE/Pong-v5", "PongNoFrameskip-v4", "Pong-v0"]
# what each id is built as: the emulator's id, its sticky-action probability, and whether we skip frames ourselves
BUILT = {"ALE/Pong-v5": ("ALE/Pong-v5", 0.25, False), "PongNoFrameskip-v4": ("PongNoFrameskip-v4", 0.0, True),
         "Pong-v0": ("Pong-v0", 0.25, False)}


def parse(tmp_path, *flags):
    args = build_parser().parse_args(["--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path), *flags])
    return args, validate(args)


def built_as(env):
    """(emulator id, sticky-action probability, our own frame skip) of a learner env stack, read from the env."""
    from environment import MaxAndSkip
    e, ours = env, False
    while hasattr(e, "env"):
        ours |= isinstance(e, MaxAndSkip)
        e = e.env
    return env.unwrapped.spec.id, round(env.unwrapped.ale.getFloat("repeat_action_probability"), 6), ours


def test_learner_i_plays_id_i_mod_len(tmp_path):
    args, errors = parse(tmp_path, "--agents", "2", "--envs-per-agent", "4", "--train-envs", *MIX)
    assert errors == [] and args.mode == "ga3c"
    assert [train_env_id(args, i) for i in range(8)] == MIX * 2 + MIX[:2]
    assert train_envs_line(args) == ("learners play ALE/Pong-v5 (3 envs), PongNoFrameskip-v4 (3 envs), Pong-v0 "
                                     "(2 envs); the monitor plays PongNoFrameskip-v4")
    args, errors = parse(tmp_path, "--workers", "3", "--train-envs", "ALE/Pong-v5", "ALE/Pong-v5", "Pong-v0")
    assert errors == [] and [train_env_id(args, i) for i in range(3)] == ["ALE/Pong-v5", "ALE/Pong-v5", "Pong-v0"]
    assert train_envs_line(args) == ("learners play ALE/Pong-v5 (2 workers), Pong-v0 (1 worker); the monitor plays "
                                     "PongNoFrameskip-v4")
    args, errors = parse(tmp_path, "--workers", "2")
    assert errors == [] and args.train_envs is None and train_envs_line(args) is None
    assert [train_env_id(args, i) for i in range(2)] == ["PongNoFrameskip-v4"] * 2


@pytest.mark.parametrize("flags,error", [
    (["--train-envs", "Pongg-v5"], "--train-envs: unknown environment id 'Pongg-v5'; did you mean "),
    (["--train-envs", "PongNoFrameskip-v4", "ALE/Breakout-v5"],
     "--train-envs: ALE/Breakout-v5 is Breakout, not Pong: every learner env must be --env's game "
     "(PongNoFrameskip-v4), in any of its versions (e.g. ALE/Pong-v5, PongNoFrameskip-v4)"),
    (["--workers", "2", "--train-envs", *MIX],
     "--train-envs gives 3 ids for 2 learner envs (--workers 2): the ids past the first 2 would never be played; "
     "give at most 2, or more learner envs"),
    (["--agents", "1", "--envs-per-agent", "2", "--train-envs", *MIX],
     "--train-envs gives 3 ids for 2 learner envs (--agents 1 x --envs-per-agent 2): the ids past the first 2 "
     "would never be played; give at most 2, or more learner envs"),
    (["--workers", "2", "--ray-address", "local", "--train-envs", *MIX],
     "--train-envs gives 3 ids for 2 learner envs (--workers 2 on each node): the ids past the first 2 would never "
     "be played"),
    (["--agents", "2", "--envs-per-agent", "2", "--dynamic", "--train-envs", *MIX],
     "--train-envs gives 3 ids and --dynamic may leave one agent, whose --envs-per-agent 2 envs play only the first "
     "2; give at most 2 ids, or more --envs-per-agent"),
], ids=["unknown", "other-game", "a3g-too-many", "ga3c-too-many", "ray-too-many", "dynamic-too-many"])
def test_bad_train_envs_are_refused_in_one_line(tmp_path, flags, error):
    _, errors = parse(tmp_path, *flags)
    assert len(errors) == 1 and errors[0].startswith(error), errors


def test_dynamic_and_ray_runs_take_a_mix_that_every_agent_or_node_plays(tmp_path):
    args, errors = parse(tmp_path, "--agents", "2", "--envs-per-agent", "3", "--dynamic", "--train-envs", *MIX)
    assert errors == [] and train_envs_line(args).endswith(
        "Pong-v0 (2 envs) (at the start: --dynamic changes the agents); the monitor plays PongNoFrameskip-v4")
    args, errors = parse(tmp_path, "--workers", "3", "--ray-address", "local", "--train-envs", *MIX)
    assert errors == [] and train_envs_line(args) == (
        "learners play ALE/Pong-v5 (1 worker), PongNoFrameskip-v4 (1 worker), Pong-v0 (1 worker) on each node; "
        "the monitor plays PongNoFrameskip-v4")


def test_an_id_that_the_crop_table_crops_otherwise_is_refused(tmp_path):
    table = tmp_path / "crops.json"
    table.write_text('{"Default": {"crop1": 34, "crop2": 34}, "Pong-v0": {"crop1": 30, "crop2": 30}}')
    _, errors = parse(tmp_path, "--env-config", str(table), "--train-envs", "ALE/Pong-v5", "Pong-v0")
    assert errors == [f"--train-envs: {table} crops Pong-v0 otherwise than PongNoFrameskip-v4; give both ids the "
                      f"same entry"]


@pytest.mark.parametrize("saved,argv,line", [
    ({"env": "ALE/Pong-v5", "train_envs": None}, ["--env", "ALE/Pong-v5"], ""),
    ({"env": "ALE/Pong-v5", "train_envs": None}, ["--env", "ALE/Pong-v5", "--train-envs", "ALE/Pong-v5"], ""),
    ({"env": "ALE/Pong-v5"}, ["--env", "ALE/Pong-v5", "--train-envs", "ALE/Pong-v5", "Pong-v0"],
     "the checkpoint's learners played ALE/Pong-v5; this run's play ALE/Pong-v5 Pong-v0 (--train-envs; the frame "
     "statistics carry over by env slot or worker)"),
    ({"env": "ALE/Pong-v5", "train_envs": ["ALE/Pong-v5", "Pong-v0"]}, ["--env", "ALE/Pong-v5"],
     "the checkpoint's learners played ALE/Pong-v5 Pong-v0; this run's play ALE/Pong-v5 (--train-envs; the frame "
     "statistics carry over by env slot or worker)"),
])
def test_a_resume_with_other_train_envs_is_named(tmp_path, saved, argv, line):
    from main import train_envs_change_line
    args, errors = parse(tmp_path, *argv)
    assert errors == [] and train_envs_change_line(saved, args) == line


def test_ga3c_agents_get_a_factory_that_builds_each_slot_from_its_id(tmp_path, monkeypatch):
    """The run's own ``_start_agent``: the factory handed to each agent process builds slot s from MIX[s % 3]."""
    args, errors = parse(tmp_path, "--agents", "2", "--envs-per-agent", "2", "--hidden-size", "32",
                         "--train-envs", *MIX)
    assert errors == []
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    run = Ga3cRun(args, shared, None, log=None)
    started = []
    monkeypatch.setattr(run, "_start", lambda role, target, target_args: started.append(target_args))
    try:
        for a in range(args.agents):
            run._start_agent(a)
        assert len(started) == 2
        seen = {}
        for agent_id, slots, _buffers, factory, *_ in started:
            for s in slots:
                env = factory(s)
                try:
                    seen[s] = built_as(env)
                finally:
                    env.close()
        assert seen == {s: BUILT[MIX[s % 3]] for s in range(4)}
    finally:
        run.release()


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, line):
        self.lines.append(line)


class _FinishingRunner:
    """Stands in for an agent's env runner whose answer has arrived and whose game ends with ``score``."""

    counts_games = True  # a whole-game slot (not --short-game-slots)

    def __init__(self, slot, score):
        self.slot, self.seq, self.score = slot, 1, score

    def on_response(self):
        return 1, (self.score, 100)


@pytest.mark.parametrize("train_envs", [["PongNoFrameskip-v4", "ALE/Pong-v5"], None,
                                        ["PongNoFrameskip-v4", "PongNoFrameskip-v4"]])
def test_the_status_line_gives_each_ids_learner_games(tmp_path, train_envs):
    """The run's own pieces: an ``AgentStepper`` records each finished game with its env slot in the run's
    ``EpisodeLog``, ``tick`` attributes it to the slot's id, and ``status`` prints each id's mean (and TensorBoard
    gets it). Slots 0 and 2 play the first id, 1 and 3 the second. With one id (or none) nothing is added."""
    from ga3c.agent import AgentStepper
    args, errors = parse(tmp_path, "--agents", "2", "--envs-per-agent", "2", "--hidden-size", "32",
                         *(["--train-envs", *train_envs] if train_envs else []))
    assert errors == []
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    run = Ga3cRun(args, shared, None, log=_Log())
    try:
        scores = {0: 3.0, 1: -20.0, 2: 5.0, 3: -18.0}
        for agent in (0, 1):
            runners = [_FinishingRunner(s, scores[s]) for s in (2 * agent, 2 * agent + 1)]
            for r in runners:
                run.buffers.resp_seq[r.slot] = r.seq
            stepper = AgentStepper(agent, runners, run.buffers, run.counters, run.episodes)
            assert stepper.poll() == 2
        run.tick(time.time())
        assert len(run.log.lines) == 4  # upstream's console line, one per game, unchanged
        line, scalars = run.status(100.0, 1.0)
        if train_envs is None or len(set(train_envs)) == 1:
            assert "learner games" not in line and not any("learner_score" in k for k in scalars)
        else:
            assert line.endswith(" | learner games (last 100 of each): PongNoFrameskip-v4 4.00 (2 games), "
                                 "ALE/Pong-v5 -19.00 (2 games)"), line
            assert scalars["charts/learner_score_PongNoFrameskip-v4"] == 4.0
            assert scalars["charts/learner_score_ALE_Pong-v5"] == -19.0
    finally:
        run.release()


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_an_a3g_worker_plays_the_id_of_its_rank(tmp_path, monkeypatch, rank):
    """``train.run_worker`` as a worker process runs it, one update: the env it builds and steps is MIX[rank]."""
    args, errors = parse(tmp_path, "--workers", "3", "--hidden-size", "32", "--num-steps", "5",
                         "--train-envs", *MIX)
    assert errors == []
    built = []
    real = train.atari_env
    monkeypatch.setattr(train, "atari_env", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    run = RunState(3)
    assert train.run_worker(rank, args, shared, None, run, CPU, max_updates=1) == 1
    assert len(built) == 1 and built_as(built[0]) == BUILT[MIX[rank]]
    assert run.global_steps.value == 5


def test_main_trains_on_the_mix_and_says_so(tmp_path):
    common = ["--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models"),
              "--env-config", str(ROOT / "config.json"), "--hidden-size", "32"]
    r = run_entry("main.py", *common, "--workers", "2", "--train-envs", *MIX, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("main.py: error: --train-envs gives 3 ids for 2 learner envs (--workers 2): the ids "
                                "past the first 2 would never be played; give at most 2, or more learner envs")
    assert not (tmp_path / "logs").exists() and not (tmp_path / "models").exists()
    r = run_entry("main.py", *common, "--env", "ALE/Pong-v5", "--agents", "1", "--envs-per-agent", "3",
                  "--train-batch", "2", "--num-steps", "5", "--max-steps", "150", "--precision", "fp32",
                  "--train-envs", *MIX, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert ("learners play ALE/Pong-v5 (1 env), PongNoFrameskip-v4 (1 env), Pong-v0 (1 env); the monitor plays "
            "ALE/Pong-v5") in r.stdout
    ckpt = torch.load(tmp_path / "models" / "ALE_Pong-v5.ckpt", weights_only=True)
    assert ckpt["config"]["train_envs"] == MIX and ckpt["global_steps"] >= 150


@pytest.mark.parametrize("flags", [[], pytest.param(["--see-skipped-frames"], marks=pytest.mark.slow)])
def test_a_killed_agent_of_a_mixed_run_ends_it_and_its_checkpoint_loads(launch, tmp_path, flags):  # noqa: F811
    """kill -9 of the agent whose slots play the other ids (with ``--see-skipped-frames``, stepped one frame at a
    time): the run ends with nothing left running (the fixture asserts so at teardown), and the last checkpoint
    loads and names the mix and the flag."""
    run = launch(ga3c_fault_args(tmp_path, "--agents", "2", "--train-envs", "PongNoFrameskip-v4", "PongNoFrameskip-v4",
                                 "ALE/Pong-v5", "Pong-v0", *flags))
    victim = run.role("ga3c agent 1")  # slots 2 and 3: ALE/Pong-v5 and Pong-v0
    wait_for_steps(run, tmp_path, minimum=20)
    t = time.monotonic()
    victim.kill()
    check_end(run, t, {1})
    assert "ga3c agent 1 exited unexpectedly" in run.stdout(), run.tail()
    ckpt = load_saved(models_dir(tmp_path))["PongNoFrameskip-v4.ckpt"]
    assert ckpt["global_steps"] >= 20
    assert ckpt["config"]["train_envs"] == ["PongNoFrameskip-v4", "PongNoFrameskip-v4", "ALE/Pong-v5", "Pong-v0"]
    assert ckpt["config"]["see_skipped_frames"] is bool(flags)


class _Built(Exception):
    """Raised by a stand-in ``atari_env`` once it has recorded what it was asked to build."""


def test_see_skipped_frames_reaches_every_env_a_run_and_an_evaluation_build(tmp_path, monkeypatch):
    """``--see-skipped-frames`` on main.py's parser: the GA3C factory's learner envs, an A3G worker's env and the
    monitor's env are all built with ``see_skipped=True`` (``MaxAndSkip`` over ``Pong-v0``'s random skip); without
    the flag, none is."""
    import test as monitor_module
    from environment import MaxAndSkip
    from ga3c.agent import AtariEnvFactory
    real = train.atari_env
    for flag, expected in (([], False), (["--see-skipped-frames"], True)):
        args, errors = parse(tmp_path, "--env", "Pong-v0", "--hidden-size", "32", "--num-steps", "5", *flag)
        assert errors == [] and args.see_skipped_frames is expected
        env = AtariEnvFactory.for_args(args)(0)
        try:
            assert built_as(env) == ("Pong-v0", 0.25, expected)
        finally:
            env.close()
        built = []
        monkeypatch.setattr(train, "atari_env", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
        shared = A3Clstm(1, 6, 32)
        shared.share_memory()
        assert train.run_worker(0, args, shared, None, RunState(1), CPU, max_updates=1) == 1
        assert len(built) == 1 and built_as(built[0]) == ("Pong-v0", 0.25, expected)
        asked = []

        def record(*a, **k):
            asked.append(k.get("see_skipped", False))
            raise _Built

        monkeypatch.setattr(monitor_module, "atari_env", record)
        with pytest.raises(_Built):
            monitor_module.run_monitor(args, shared, RunState(1), CPU)
        assert asked == [expected]
        assert any(isinstance(e, MaxAndSkip) for e in _all_layers(built[0])) is expected


def _all_layers(env):
    while hasattr(env, "env"):
        yield env
        env = env.env
    yield env


@pytest.mark.parametrize("saved,flag,line", [
    ({}, [], ""), ({"see_skipped_frames": True}, ["--see-skipped-frames"], ""),
    ({}, ["--see-skipped-frames"], "the checkpoint was trained on the emulator's last frame of each step; this "
     "run's games show the max over each step's last frames (up to 3) (--see-skipped-frames, for ids whose "
     "emulator skips frames)"),
    ({"see_skipped_frames": True}, [], "the checkpoint was trained on the max over each step's last frames (up to "
     "3); this run's games show the emulator's last frame of each step (--see-skipped-frames, for ids whose "
     "emulator skips frames)")])
def test_a_resume_that_changes_what_the_games_show_says_so(tmp_path, saved, flag, line):
    from main import see_skipped_change_line, see_skipped_line
    args, errors = parse(tmp_path, "--env", "Pong-v0", *flag)
    assert errors == [] and see_skipped_change_line({"env": "Pong-v0", **saved}, args) == line
    # a run that plays NoFrameskip ids only: the flag changes nothing there, so it is refused, and no line says
    # that a checkpoint's setting changes
    args, errors = parse(tmp_path, "--env", "PongNoFrameskip-v4", "--train-envs", "PongNoFrameskip-v4",
                         "PongNoFrameskip-v0", *flag)
    assert errors == ([] if not flag else [
        "--see-skipped-frames changes nothing here: NoFrameskip ids (PongNoFrameskip-v4, "
        "PongNoFrameskip-v0) show the max over the skipped frames already; leave it out"])
    assert see_skipped_change_line({"env": "PongNoFrameskip-v4", **saved}, args) == ""
    assert see_skipped_line(args) == ""
    args, errors = parse(tmp_path, "--env", "PongNoFrameskip-v4", "--train-envs", "PongNoFrameskip-v4", "Pong-v0",
                         *flag)
    assert errors == [] and (see_skipped_line(args) != "") is bool(flag)


@pytest.mark.slow  # 15 s; the flag's wrapper is tested on real ALE in test_environment.py, its line above
def test_main_trains_with_see_skipped_frames_and_keeps_it_in_the_checkpoint(tmp_path):
    common = ["--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models"),
              "--env-config", str(ROOT / "config.json"), "--hidden-size", "32", "--env", "Pong-v0", "--agents", "1",
              "--envs-per-agent", "2", "--train-batch", "2", "--num-steps", "5", "--precision", "fp32"]
    r = run_entry("main.py", *common, "--max-steps", "100", "--see-skipped-frames", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "every game shows the max over each step's last frames, up to 3 (--see-skipped-frames" in r.stdout
    ckpt = torch.load(tmp_path / "models" / "Pong-v0.ckpt", weights_only=True)
    assert ckpt["config"]["see_skipped_frames"] is True and ckpt["global_steps"] >= 100
    r = run_entry("main.py", *common, "--max-steps", "200", "--load", "--load-model-dir", str(tmp_path / "models"),
                  cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "this run's games show the emulator's last frame of each step" in r.stdout
    assert "every game shows the max" not in r.stdout
    # a bare .dat: its card (when it describes this very file) says what the model was trained on
    import hashlib
    import json
    import shutil
    dat = tmp_path / "dat" / "Pong-v0.dat"
    dat.parent.mkdir()
    shutil.copy(tmp_path / "models" / "Pong-v0.dat", dat)
    card = {"model_file": "Pong-v0.dat", "sha256": hashlib.sha256(dat.read_bytes()).hexdigest(),
            "see_skipped_frames": True}
    dat.with_suffix(".json").write_text(json.dumps(card))
    more = ["--max-steps", "50", "--load", "--load-model-dir", str(dat.parent), "--save-model-dir",
            str(tmp_path / "models2")]
    r = run_entry("main.py", *common[:2], *common[4:], *more, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert (f"{dat.with_suffix('.json')} says the model was trained on the max over each step's last frames (up to "
            f"3); this run's games show the emulator's last frame of each step") in r.stdout
    dat.with_suffix(".json").write_text(json.dumps({**card, "sha256": "0" * 64}))  # a card of another file
    shutil.rmtree(tmp_path / "models2")
    r = run_entry("main.py", *common[:2], *common[4:], *more, cwd=tmp_path)
    assert r.returncode == 0 and "says the model was trained" not in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]

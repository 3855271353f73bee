"""Flags: upstream names and defaults, real boolean switches, and validation that reports every problem."""
from pathlib import Path

import pytest
import torch

from config import build_parser, rollout_length, validate


def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_upstream_defaults_in_a3g_mode():
    a = parse("--mode", "a3g")
    assert (a.lr, a.entropy_coef, a.value_coef, a.gamma, a.tau, a.seed, a.num_steps) == (1e-4, 0.01, 0.5, 0.99, 1.0, 1, 20)
    assert a.env == "PongNoFrameskip-v4" and a.max_episode_length == 10000 and a.hidden_size == 512
    assert a.optimizer == "Adam" and a.gpu_ids == [-1] and a.shared_optimizer is True and a.amsgrad is False
    assert a.precision == "fp32"
    # the folders are this run's, resolved by validate (--load resumes from --save-model-dir)
    assert a.load_model_dir is None and a.save_model_dir is None and a.log_dir is None
    assert validate(a) == []
    assert a.load_model_dir == a.save_model_dir == "runs/PongNoFrameskip-v4"
    assert a.log_dir == "logs/PongNoFrameskip-v4"


def test_a_plain_command_runs_ga3c_mode_with_its_measured_defaults():
    a = parse()
    assert (a.mode, a.lr, a.precision) == ("ga3c", 2e-4, "auto")
    assert (a.entropy_coef, a.value_coef, a.gamma, a.tau, a.num_steps) == (0.01, 0.5, 0.99, 1.0, 20)
    assert validate(a) == []
    assert a.save_model_dir == "runs/PongNoFrameskip-v4-ga3c" and a.log_dir == "logs/PongNoFrameskip-v4-ga3c"
    assert a.compute_precision in ("fp32", "bf16")


@pytest.mark.parametrize("argv,mode", [
    ([], "ga3c"), (["--mode", "a3g"], "a3g"), (["--mode=a3g"], "a3g"), (["--workers", "2"], "a3g"), (["-w", "2"], "a3g"),
    (["-w2"], "a3g"), (["--workers=2"], "a3g"), (["-dss", "5", "10"], "a3g"),
    (["--ray-address", "local"], "a3g"), (["-ds", "5", "10"], "a3g"), (["-w+3"], "a3g"),  # -ds, -w+3: argparse's
    (["--mode", "ga3c", "--workers", "2"], "ga3c"), (["--agents", "2", "--seed", "3"], "ga3c"),
    (["--log-dir", "w"], "ga3c"), (["--mode", "ga3c", "--mode", "a3g"], "a3g"), (["--mode", "a3g", "--mode=ga3c"], "ga3c")])
def test_the_mode_and_its_defaults_follow_the_command_line(argv, mode):
    a = parse(*argv)
    assert a.mode == mode
    assert (a.lr, a.precision) == ((2e-4, "auto") if mode == "ga3c" else (1e-4, "fp32"))
    b = parse(*argv, "--lr", "0.003", "--precision", "bf16")  # given values win in either mode
    assert (b.mode, b.lr, b.precision) == (mode, 0.003, "bf16")


@pytest.mark.parametrize("argv,value", [([], False), (["--amsgrad"], True), (["-a", "True"], True),
                                        (["--amsgrad", "false"], False), (["--no-amsgrad"], False)])
def test_boolean_switches(argv, value):
    assert parse(*argv).amsgrad is value


def test_shared_optimizer_can_be_turned_off():
    assert parse("--no-shared-optimizer").shared_optimizer is False
    assert parse("-so", "False").shared_optimizer is False
    with pytest.raises(SystemExit):
        parse("--amsgrad", "maybe")


def test_short_flags():
    a = parse("-l", "0.001", "-ec", "0.02", "-vc", "1", "-g", "0.9", "-t", "0.92", "-w", "3", "-ns", "5",
              "-mel", "100", "-ev", "ALE/Pong-v5", "-o", "RMSprop", "-gp", "-1", "-hs", "64", "-dss", "5", "10")
    assert (a.lr, a.entropy_coef, a.value_coef, a.gamma, a.tau, a.workers, a.num_steps) == (0.001, 0.02, 1, 0.9, 0.92, 3, 5)
    assert a.env == "ALE/Pong-v5" and a.optimizer == "RMSprop" and a.hidden_size == 64
    assert [rollout_length(a, r) for r in range(3)] == [5, 10, 5]


def test_validation_reports_everything_at_once():
    errors = validate(parse("--lr", "0", "--tau", "2", "--workers", "0", "--num-steps", "0", "--env", "Nope-v4",
                            "--max-steps", "-1", "-dss", "0"))
    assert len(errors) == 7
    assert any("unknown environment id 'Nope-v4'" in e for e in errors)
    assert validate(parse()) == [] and validate(parse("--mode", "a3g")) == []


def test_optimizer_eps_defaults_to_upstreams_and_must_be_positive():
    assert parse().optimizer_eps is None and parse("--optimizer-eps", "1e-5").optimizer_eps == 1e-5
    assert validate(parse("--optimizer-eps", "1e-5")) == []
    for bad in ("0", "-1e-5"):
        assert validate(parse(f"--optimizer-eps={bad}")) == [f"--optimizer-eps must be > 0, got {float(bad)}"]


def test_ema_steps_is_off_by_default_a_count_and_not_for_ray():
    assert parse().ema_steps == 0 and validate(parse("--ema-steps", "20000")) == []
    assert validate(parse("--mode", "a3g", "--ema-steps", "20000")) == []
    assert validate(parse("--ema-steps", "-1")) == ["--ema-steps must be >= 0 (0 = off), got -1"]
    errors = validate(parse("--ray-address", "local", "--ema-steps", "20000"))
    assert errors == ["--ema-steps averages the weights where the optimizer steps, which on Ray is the parameter "
                      "server, not built for it: drop --ema-steps or --ray-address"]


@pytest.mark.parametrize("flag", ["--max-steps", "--lr-anneal-steps", "--entropy-anneal-steps", "--ema-steps",
                                  "--test-every-steps"])
def test_a_step_count_the_checkpoint_could_not_hold_is_refused(flag, tmp_path):
    """A run given such a count would write a checkpoint that its own resume refuses as damaged."""
    from checkpoint import CHECKPOINT_FORMAT, check_checkpoint
    from config import config_dict
    assert validate(parse(flag, str(2**63))) == [f"{flag} must be < 2**63 (a step count the checkpoint holds), "
                                                 f"got {2**63}"]
    args = parse(flag, str(2**63 - 1))
    assert validate(args) == []
    check_checkpoint({"format": CHECKPOINT_FORMAT, "model": {"w": torch.zeros(1)}, "config": config_dict(args)},
                     tmp_path / "x.ckpt")  # the largest accepted count is one the checkpoint takes


def test_usage_errors_are_one_line(tmp_path):
    from conftest import run_entry
    for script, args in (("main.py", ["--workers", "many"]), ("gym_eval.py", ["--bogus"]), ("plot.py", [])):
        r = run_entry(script, *args, cwd=tmp_path, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
        assert r.stderr.startswith(f"{script}: error: ")


def test_ga3c_mode_on_a_cpu_without_the_fences_it_needs_is_refused_in_one_line(tmp_path, monkeypatch):
    import ga3c.buffers
    from config import build_parser, validate
    monkeypatch.setattr(ga3c.buffers, "ordering_problem", lambda: "GA3C mode needs memory fences here")
    flags = ["--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)]
    assert "GA3C mode needs memory fences here" in validate(build_parser().parse_args(["--mode", "ga3c", *flags]))
    assert "GA3C mode needs memory fences here" in validate(build_parser().parse_args(flags))  # the default
    assert validate(build_parser().parse_args(["--mode", "a3g", *flags])) == []  # A3G mode does not share env slots


@pytest.mark.parametrize("agents,envs,want", [(2, 8, 4), (1, 1, 4), (1, 17, 5), (8, 16, 32), (12, 16, 48)])
def test_the_train_batch_follows_the_env_slots(agents, envs, want):
    """``--train-batch`` defaults to the env slots / 4 (at least 4): the policy lag grows with slots per segment of
    an update (about 30 updates at 192 slots and batch 4, where Breakout collapsed; about 3 at a ratio of 4)."""
    from config import policy_lag_warnings

    a = parse("--agents", str(agents), "--envs-per-agent", str(envs))
    assert validate(a) == [] and a.train_batch == want
    assert policy_lag_warnings(a) == []


def test_a_sync_every_that_leaves_a_long_policy_lag_gets_a_warning_line():
    """--sync-every 1000000 was accepted without a word: the predictors never copied the trained weights again
    (policy lag 6.1 after 15 updates against 0.5)."""
    from config import policy_lag_warnings
    for every, lines in (("8", 0), ("9", 1), ("1000000", 1)):
        a = parse("--agents", "2", "--envs-per-agent", "8", "--sync-every", every)
        assert validate(a) == [] and len(policy_lag_warnings(a)) == lines, (every, policy_lag_warnings(a))
    assert policy_lag_warnings(a) == [
        "--sync-every 1000000: the predictors act with weights up to 1000000 updates old, which adds about 500000 "
        "updates to the policy lag on average (a lag of about 30 collapsed a Breakout run: docs/results.md, Policy "
        "lag); the default, 1, copies them after every update"]


def test_a_train_batch_that_leaves_a_long_policy_lag_is_run_after_one_warning_line(tmp_path):
    from conftest import run_entry
    from config import policy_lag_warnings

    a = parse("--agents", "12", "--envs-per-agent", "16", "--train-batch", "4")
    assert validate(a) == [] and a.train_batch == 4  # given: kept
    (line,) = policy_lag_warnings(a)
    assert "192 env slots" in line and "48 slots per segment" in line and "--train-batch 48" in line
    a = parse("--agents", "2", "--envs-per-agent", "16", "--train-batch", "4")  # a ratio of 8: no line
    assert validate(a) == [] and policy_lag_warnings(a) == []
    a = parse("--workers", "2", "--agents", "12", "--envs-per-agent", "16", "--train-batch", "1")  # A3G mode
    assert a.mode == "a3g" and policy_lag_warnings(a) == []  # (and validate refuses the GA3C flags)
    # main.py prints it before anything starts (here the resume then fails: nothing to load, exit 2)
    r = run_entry("main.py", "--mode", "ga3c", "--agents", "1", "--envs-per-agent", "9", "--train-batch", "1",
                  "--load", "--load-model-dir", str(tmp_path / "none"), "--save-model-dir", str(tmp_path / "m"),
                  "--log-dir", str(tmp_path / "l"), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 2 and r.stderr.startswith("main.py: --train-batch 1 for 9 env slots"), r.stderr


@pytest.mark.parametrize("argv,flags", [
    (["--mode", "a3g", "--agents", "2"], "--agents: only GA3C mode has it"),
    (["--workers", "2", "--envs-per-agent", "4", "--no-dynamic"], "--envs-per-agent, --dynamic: only GA3C mode has them"),
    (["-w", "2", "--train-batch", "8"], "--train-batch: only GA3C mode has it"),
    (["--mode", "ga3c", "--workers", "2"], "--workers: only A3G mode has it"),
    (["--mode", "ga3c", "-dss", "5", "10"], "--distributed-step-size: only A3G mode has it")])
def test_a_flag_of_the_mode_the_command_does_not_run_is_refused(argv, flags):
    """Given, in any spelling, even at its default value: it would be ignored."""
    errors = validate(parse(*argv))
    assert [e for e in errors if "only" in e] == [next(e for e in errors if e.startswith(flags))], errors


@pytest.mark.parametrize("argv", [[], ["--agents", "3", "--envs-per-agent", "8", "--is-clip", "1"], ["--workers", "2"],
                                  ["--mode", "a3g", "--num-steps", "10"], ["--mode", "ga3c", "--seed", "2"]])
def test_the_flags_of_the_mode_that_runs_and_the_shared_flags_pass(argv):
    assert not any("only" in e for e in validate(parse(*argv)))
    assert "_given" not in __import__("config").config_dict(parse(*argv))  # the parser's record is not configuration


def test_main_refuses_a_flag_of_the_other_mode_in_one_line_before_anything_is_written(tmp_path):
    from conftest import run_entry

    r = run_entry("main.py", "--mode", "a3g", "--agents", "2", "--save-model-dir", str(tmp_path / "m"),
                  "--log-dir", str(tmp_path / "l"), cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "main.py: error: --agents: only GA3C mode" in r.stderr
    assert not (tmp_path / "m").exists() and not (tmp_path / "l").exists()


def test_with_dynamic_the_train_batch_and_the_warning_count_the_most_agents_it_may_reach():
    from config import policy_lag_warnings

    a = parse("--dynamic", "--agents", "2", "--envs-per-agent", "8")  # up to 4 agents: 32 slots
    assert validate(a) == [] and a.train_batch == 8 and policy_lag_warnings(a) == []
    a = parse("--dynamic", "--agents", "1", "--envs-per-agent", "16", "--train-batch", "2", "--dynamic-max", "4", "4", "8")
    assert validate(a) == []
    (line,) = policy_lag_warnings(a)
    assert "128 env slots (up to 8 agents with --dynamic" in line and "64 slots per segment" in line
    a = parse("--agents", "1", "--envs-per-agent", "17", "--train-batch", "2")  # over 8, not rounded down to it
    assert "8.5 slots per segment" in policy_lag_warnings(a)[0] if not validate(a) else False


@pytest.mark.parametrize("argv,want", [
    (["--short-game-slots", "-1"], ["--short-game-slots must be >= 0 (0 = none), got -1"]),
    (["--short-game-slots", "2", "--short-game-length", "2"],
     ["--short-game-length must be >= 3 (the reset's FIRE and action 2 count in it), got 2"]),
    (["--train-envs", "PongNoFrameskip-v4", "ALE/Pong-v5", "--agents", "1", "--envs-per-agent", "3",
      "--short-game-slots", "2"],
     ["--short-game-slots 2: ALE/Pong-v5 (--train-envs) would play only cut games in the 3 env slots of --agents 1 x "
      "--envs-per-agent 3; give fewer short slots, or list it again in --train-envs"]),
    (["--train-envs", "PongNoFrameskip-v4", "ALE/Pong-v5", "--agents", "1", "--envs-per-agent", "4",
      "--short-game-slots", "2"], []),
    (["--mode", "a3g", "--max-episode-length", "100", "--short-game-slots", "100"],
     ["--short-game-slots: only GA3C mode has it"]),  # the GA3C-only relations are not checked as well
    (["--short-game-slots", "2", "--short-game-length", "400", "--max-episode-length", "400"],
     ["--short-game-length 400 must be below --max-episode-length 400, or the short games are not shorter"]),
    (["--agents", "2", "--envs-per-agent", "4", "--short-game-slots", "8"],
     ["--short-game-slots 8 leaves none of the 8 env slots of --agents 2 x --envs-per-agent 4 for whole games; "
      "give at most 7"]),
    (["--agents", "2", "--envs-per-agent", "4", "--short-game-slots", "4", "--dynamic"],
     ["--short-game-slots 4 leaves none of the 4 env slots of --envs-per-agent 4 (--dynamic may leave one agent) "
      "for whole games; give at most 3"]),
    (["--agents", "2", "--envs-per-agent", "4", "--short-game-slots", "7"], []),
    (["--agents", "2", "--envs-per-agent", "4", "--short-game-slots", "3", "--dynamic"], []),
    (["--short-game-length", "0"], ["--short-game-length must be >= 3 (the reset's FIRE and action 2 count in it), "
                                    "got 0"]),
    (["--mode", "a3g", "--short-game-slots", "1"], ["--short-game-slots: only GA3C mode has it"]),
    (["--short-games-after-score", "19"], ["--short-games-after-score changes nothing here: it says when the cut of "
                                           "--short-game-slots K starts; give that too, or leave it out"]),
    (["--short-game-slots", "2", "--short-games-after-score", "19"], []),
    (["--short-game-slots", "2", "--short-games-after-score", "-21.5"], []),
    (["--short-game-slots", "2", "--short-games-after-score", "nan"],
     ["--short-games-after-score must be a finite number, got nan"]),
    (["--short-games-after-score", "inf"], ["--short-games-after-score must be a finite number, got inf"]),
    (["--mode", "a3g", "--short-games-after-score", "19"], ["--short-games-after-score: only GA3C mode has it"])])
def test_short_game_flags_are_checked(argv, want):
    errors = validate(parse(*argv))
    assert [e.split(", and this command")[0] if "only GA3C" in e else e for e in errors] == want, errors


@pytest.mark.parametrize("argv, want", [
    (["--agents", "2", "--envs-per-agent", "4", "--greedy-slots", "7"], []),
    (["--agents", "2", "--envs-per-agent", "4", "--greedy-slots", "8"],
     ["--greedy-slots 8 leave none of the 8 env slots of --agents 2 x --envs-per-agent 4 for sampled whole games; "
      "give at most 7 in all"]),
    (["--agents", "2", "--envs-per-agent", "4", "--greedy-slots", "2", "--short-game-slots", "6"],
     ["--greedy-slots 2 and --short-game-slots 6 leave none of the 8 env slots of --agents 2 x --envs-per-agent 4 "
      "for sampled whole games; give at most 7 in all"]),
    (["--agents", "2", "--envs-per-agent", "4", "--greedy-slots", "2", "--dynamic", "--short-game-slots", "2"],
     ["--greedy-slots 2 and --short-game-slots 2 leave none of the 4 env slots of --envs-per-agent 4 (--dynamic may "
      "leave one agent) for sampled whole games; give at most 3 in all"]),
    (["--greedy-slots=-1"], ["--greedy-slots must be >= 0 (0 = none), got -1"]),
    (["--agents", "1", "--envs-per-agent", "4", "--greedy-slots", "1", "--train-envs", "PongNoFrameskip-v4",
      "ALE/Pong-v5"], []),  # slot 0 plays v4 greedily, slot 2 plays it sampled
    (["--agents", "1", "--envs-per-agent", "2", "--greedy-slots", "1", "--train-envs", "PongNoFrameskip-v4",
      "ALE/Pong-v5"],
     ["--greedy-slots 1: PongNoFrameskip-v4 (--train-envs) would have no sampled whole games in the 2 env slots of "
      "--agents 1 x --envs-per-agent 2; give fewer, or list it again in --train-envs"]),
    (["--mode", "a3g", "--greedy-slots", "1"], ["--greedy-slots: only GA3C mode has it"])])
def test_greedy_slots_are_checked(argv, want):
    """With one pass per batch: more than one is not combined with greedy slots (below)."""
    errors = validate(parse(*argv, *([] if "a3g" in argv else ["--train-passes", "1"])))
    assert [e.split(", and this command")[0] if "only GA3C" in e else e for e in errors] == want, errors


@pytest.mark.parametrize("argv, want", [
    (["--train-passes", "3", "--pass-clip", "0.1"], []),
    (["--train-passes", "0"], ["--train-passes must be >= 1 (1 = one optimizer step per batch), got 0"]),
    (["--pass-clip", "1"], ["--pass-clip must be between 0 and 1 (exclusive), got 1"]),
    (["--pass-clip", "0"], ["--pass-clip must be between 0 and 1 (exclusive), got 0"]),
    (["--pass-clip", "nan"], ["--pass-clip must be a finite number, got nan"]),
    (["--train-passes", "1", "--is-clip", "2", "--greedy-slots", "1"], []),
    (["--train-passes", "2", "--is-clip", "2"],
     ["--train-passes 2 trains with the clipped surrogate, which is not combined with --is-clip; leave it out, or "
      "use --train-passes 1"]),
    (["--is-clip", "2"],  # GA3C mode's default of two passes: the line says so
     ["--train-passes 2 (GA3C mode default) trains with the clipped surrogate, which is not combined with --is-clip; "
      "leave it out, or add --train-passes 1"]),
    (["--greedy-slots", "1"],
     ["--train-passes 2 (GA3C mode default) trains with the clipped surrogate, which is not combined with "
      "--greedy-slots; leave it out, or add --train-passes 1"]),
    (["--is-clip", "2", "--mode", "a3g", "--workers", "2"], ["--is-clip: only GA3C mode has it"]),
    (["--train-passes", "2", "--is-clip", "2", "--greedy-slots", "1"],
     ["--train-passes 2 trains with the clipped surrogate, which is not combined with --is-clip or --greedy-slots; "
      "leave them out, or use --train-passes 1"]),
    (["--mode", "a3g", "--train-passes", "2"], ["--train-passes: only GA3C mode has it"]),
    (["--mode", "a3g", "--later-passes", "lstm"], ["--later-passes: only GA3C mode has it"]),
    (["--train-passes", "3", "--later-passes", "lstm"], [])])
def test_train_passes_are_checked(argv, want):
    from ga3c.settings import Ga3cSettings

    args = parse(*argv)
    errors = validate(args)
    assert [e.split(", and this command")[0] if "only GA3C" in e else e for e in errors] == want, errors
    if not errors:  # what passes here passes the settings' own check
        assert Ga3cSettings.from_args(args).problems() == []


@pytest.mark.parametrize("argv, want", [
    (["--mode", "a3g", "--workers", "2", "--distributed-step-size", "5", "9", "13"],
     ["--distributed-step-size gives 3 values for 2 worker(s): worker r takes value r, so only the first 2 would be "
      "used: give at most 2, or more --workers"]),
    (["--mode", "a3g", "--workers", "2", "--distributed-step-size", "5", "9", "--num-steps", "7"],
     ["--num-steps changes nothing with --distributed-step-size, which gives every worker its rollout length: leave "
      "one of them out"]),
    (["--mode", "a3g", "--workers", "3", "--distributed-step-size", "5", "9"], []),
    (["--max-episode-length", "2"], ["--max-episode-length must be >= 3, got 2"]),
    (["--max-episode-length", "3"], [])])
def test_rollout_and_game_lengths_that_would_not_do_what_they_say_are_refused(argv, want):
    """Values past the workers of --distributed-step-size, and --num-steps beside it, were accepted and never used;
    a time limit of 1 or 2 agent steps ended every game before the agent acted (the reset's FIRE and action 2)."""
    assert validate(parse(*argv)) == want


@pytest.mark.parametrize("argv, want", [
    (["--pass-clip", "0.3", "--train-passes", "1"],
     ["--pass-clip changes nothing here: it clips the surrogate of --train-passes 2 or more; give those too, or "
      "leave it out"]),
    (["--pass-clip", "0.3"], []),  # GA3C mode's default is two passes
    (["--later-passes", "lstm", "--train-passes", "1"],
     ["--later-passes changes nothing here: it says what the passes after the first of --train-passes 2 or more "
      "train; give those too, or leave it out"]),
    (["--later-passes", "lstm"], []),
    (["--later-passes", "full", "--train-passes", "3"], []),
    (["--short-game-length", "50"], ["--short-game-length changes nothing here: it is the cut of --short-game-slots "
                                     "K; give that too, or leave it out"]),
    (["--dynamic-seconds", "5"], ["--dynamic-seconds changes nothing here: it is --dynamic's measuring window; give "
                                  "--dynamic too, or leave it out"]),
    (["--dynamic-max", "4", "4", "4"], ["--dynamic-max changes nothing here: it bounds what --dynamic tries; give "
                                        "--dynamic too, or leave it out"]),
    (["--pass-clip", "0.3", "--train-passes", "2"], []),
    (["--short-game-length", "50", "--short-game-slots", "1"], []),
    (["--dynamic-seconds", "5", "--dynamic-max", "4", "4", "4", "--dynamic"], []),
    (["--pass-clip", "0.2", "--short-game-length", "150", "--train-passes", "1"],  # spelled out: nothing changes
     ["--pass-clip changes nothing here: it clips the surrogate of --train-passes 2 or more; give those too, or "
      "leave it out", "--short-game-length changes nothing here: it is the cut of --short-game-slots K; give that "
      "too, or leave it out"]),
    # a value that is wrong in itself gets its own line only
    (["--dynamic-seconds", "0"], ["--dynamic-seconds must be > 0, got 0"]),
    (["--short-game-slots", "1", "--max-episode-length", "0"], ["--max-episode-length must be >= 3, got 0"]),
    (["--train-passes", "2", "--is-clip", "inf"], ["--is-clip must be a finite number, got inf"]),
    (["--mode", "a3g", "--pass-clip", "0.3"], ["--pass-clip: only GA3C mode has it"])])
def test_a_ga3c_flag_that_would_change_nothing_is_refused(argv, want):
    """As ``--confirm-every-steps`` without ``--target-score``: a flag given where it is never read is a command
    that does not do what it says."""
    errors = validate(parse(*argv))
    assert [e.split(", and this command")[0] if "only GA3C" in e else e for e in errors] == want, errors


def test_the_start_up_line_names_the_greedy_slots_and_the_factory_leaves_their_games_out():
    from config import greedy_slots_line
    from ga3c.agent import AtariEnvFactory

    assert greedy_slots_line(parse()) is None
    a = parse("--agents", "2", "--envs-per-agent", "8", "--short-game-slots", "2", "--greedy-slots", "2",
              "--train-passes", "1")
    assert validate(a) == [] and greedy_slots_line(a) == (
        "env slots 2-3 of 16 act greedily, as the monitor does (--greedy-slots): policy-gradient terms weighted by "
        "pi(a), games not counted as learner games")
    f = AtariEnvFactory.for_args(a)
    assert [f.counts_games(s) for s in range(6)] == [False, False, False, False, True, True]
    assert [f.max_length_of(s) for s in range(5)] == [150, 150, 10000, 10000, 10000]
    from ga3c.settings import Ga3cSettings
    assert list(Ga3cSettings.from_args(a).greedy_slot_ids()) == [2, 3]


@pytest.mark.parametrize("argv, want", [
    ([], ", 2 passes per batch (clipped surrogate, eps 0.2), on CPU"),
    (["--later-passes", "lstm"],
     ", 2 passes per batch (clipped surrogate, eps 0.2; the later ones on the LSTM and heads), on CPU"),
    (["--train-passes", "3", "--pass-clip", "0.1", "--later-passes", "lstm"],
     ", 3 passes per batch (clipped surrogate, eps 0.1; the later ones on the LSTM and heads), on CPU"),
    (["--train-passes", "1"], "4 segments of 20 steps per update, on CPU")])
def test_the_start_up_line_names_the_passes_and_which_parameters_the_later_ones_train(argv, want):
    """GA3C mode's start-up line (``Ga3cRun.describe``, which reads only the run's arguments)."""
    from types import SimpleNamespace

    from ga3c.run import Ga3cRun

    a = parse("--gpu-ids", "-1", *argv)
    assert validate(a) == []
    line = Ga3cRun.describe(SimpleNamespace(args=a))
    assert line.startswith("in GA3C mode: 2 agents x 8 envs") and line.endswith(want), line


def test_the_start_up_line_names_the_short_game_slots():
    from config import short_games_line

    assert short_games_line(parse()) is None
    a = parse("--agents", "2", "--envs-per-agent", "8", "--short-game-slots", "2")
    assert validate(a) == [] and short_games_line(a) == ("env slots 0-1 of 16 play games cut at 150 agent steps "
                                                         "(--short-game-slots), not counted as learner games")
    a = parse("--agents", "1", "--envs-per-agent", "4", "--short-game-slots", "1", "--short-game-length", "90")
    assert validate(a) == [] and short_games_line(a).startswith("env slot 0 of 4 plays games cut at 90 agent steps")
    a = parse("--agents", "2", "--envs-per-agent", "8", "--short-game-slots", "2", "--short-games-after-score", "19")
    assert validate(a) == [] and short_games_line(a) == (
        "env slots 0-1 of 16 play games cut at 150 agent steps (--short-game-slots), once the monitor's mean over "
        "its last 10 games reaches 19 (--short-games-after-score; whole games until then), not counted as learner "
        "games")
    assert short_games_line(a, started=19.5) == (
        "env slots 0-1 of 16 play games cut at 150 agent steps (--short-game-slots), from the start: the "
        "checkpoint's run reached its --short-games-after-score 19.5, not counted as learner games")


@pytest.mark.parametrize("flag, limit, extra", [
    ("--hidden-size", 8192, []), ("--score-window", 1_000_000, []), ("--workers", 1024, []),
    ("--agents", 1024, ["--mode", "ga3c"]), ("--envs-per-agent", 1024, ["--mode", "ga3c"]),
    ("--predictors", 1024, ["--mode", "ga3c"]), ("--trainers", 1024, ["--mode", "ga3c"])])
def test_a_size_beyond_any_useful_run_is_one_line_and_its_bound_is_not(flag, limit, extra, tmp_path):
    """Sizes that would fail to allocate (a traceback after the locks were taken) or spawn processes until the
    machine runs out of memory are refused before anything starts; the bound itself is allowed."""
    where = ["--save-model-dir", str(tmp_path / "m"), "--log-dir", str(tmp_path / "l")]
    line = f"{flag} must be at most {limit:,}, got {limit + 1:,}"
    assert line in validate(parse(*extra, flag, str(limit + 1), *where))
    assert [e for e in validate(parse(*extra, flag, str(limit), *where)) if "at most" in e] == []


def test_updates_that_would_not_fit_in_memory_are_one_line_naming_what_holds_it():
    """``memory_problems`` against a machine of 8 GiB: a frame of an update 2.2 MiB, a queued one 25 kB,
    rollouts and segments cut at the game's end (--max-episode-length); the bound itself and the defaults pass.
    GA3C cases give --agents and --train-batch, whose defaults follow this machine's cores."""
    from config import UPDATE_BYTES_PER_FRAME, memory_problems
    gib = 2**30
    ga3c = ["--mode", "ga3c", "--agents", "2", "--train-batch", "4"]

    def problems(*flags):
        args = parse(*flags)
        assert [e for e in validate(args) if "GiB" not in e] == []
        return memory_problems(args, memory=8 * gib)
    assert problems("--mode", "a3g") == [] and problems(*ga3c) == []
    assert problems("--mode", "a3g", "--workers", "2", "--num-steps", "100000") == [
        "2 worker(s) with rollouts of up to 10,000 frames (--num-steps 100,000, cut at --max-episode-length 10,000), "
        "at 2.2 MiB a frame of an update, would hold about 43.0 GiB, more than the 8.0 GiB this machine has: use a "
        "smaller --num-steps (default 20) or fewer --workers"]
    fits = 8 * gib // UPDATE_BYTES_PER_FRAME  # 3,723 frames: one worker's rollout of that many fits, one more not
    assert problems("--mode", "a3g", "--workers", "1", "--num-steps", str(fits)) == []
    assert problems("--mode", "a3g", "--workers", "1", "--num-steps", str(fits + 1))[0].endswith(
        "use a smaller --num-steps (default 20)")
    assert problems("--mode", "a3g", "--workers", "1", "--num-steps", "100000", "--max-episode-length", "3000") == []
    # worker r's rollout is the r-th length, round-robin: 20 + 3,000 frames fit, 2 x (20 + 3,000) do not
    assert problems("--mode", "a3g", "--workers", "3", "--distributed-step-size", "20", "3000") == []
    assert problems("--mode", "a3g", "--workers", "4", "--distributed-step-size", "20", "3000") == [
        "4 worker(s) with rollouts of up to 3,000 frames (--distributed-step-size 20 3000), at 2.2 MiB a frame of an "
        "update, would hold about 13.0 GiB, more than the 8.0 GiB this machine has: use smaller "
        "--distributed-step-size values or fewer --workers"]
    assert problems(*ga3c, "--trainers", "2", "--train-batch", "100") == [
        "2 trainer(s) (--trainers 2) with updates of 100 segments (--train-batch 100) of up to 20 frames (--num-steps "
        "20), 8.6 GiB at 2.2 MiB a frame, and a queue of 8 segment(s) (--queue-size), 0.0 GiB, would hold about 8.6 "
        "GiB, more than the 8.0 GiB this machine has: use a smaller --num-steps (default 20), --train-batch or "
        "--queue-size, or fewer trainers (--trainers)"]
    # queued segments hold their frames (25 kB each): 10,000 x 20 of them 4.8 GiB, 20,000 x 20 9.5 GiB; with the
    # acting activations (--replay-activations, 0.9 MiB a frame) 10,000 segments do not fit either
    assert problems(*ga3c, "--queue-size", "10000") == []
    assert "a queue of 20,000 segment(s) (--queue-size), 9.5 GiB, would hold about 9.9 GiB" in problems(
        *ga3c, "--queue-size", "20000")[0]
    assert "would hold about 180.9 GiB" in problems(*ga3c, "--queue-size", "10000", "--replay-activations")[0]
    # --dynamic may start up to its bound of trainers; a --train-batch not given is --agents x --envs-per-agent's
    line, = problems("--mode", "ga3c", "--agents", "2", "--dynamic", "--dynamic-max", "64", "2", "4")
    assert line.startswith("64 trainer(s) (--dynamic-max 64) with updates of 8 segments (--train-batch 8, from "
                           "--agents x --envs-per-agent) of up to 20 frames") and line.endswith("(--dynamic-max)")
    assert problems(*ga3c, "--train-batch", "100", "--gpu-ids", "-1") != []
    # on a GPU the updates are in its memory, which is not estimated
    args = parse(*ga3c, "--train-batch", "100")
    args.gpu_ids = [0]
    assert memory_problems(args, memory=8 * gib) == []


@pytest.mark.parametrize("flag", ["--save-model-dir", "--log-dir", "--load-model-dir"])
def test_an_empty_folder_flag_is_refused_not_taken_for_the_current_folder(flag):
    extra = ["--load"] if flag == "--load-model-dir" else []
    for value in ("", "  "):
        assert validate(parse(flag, value, *extra)) == [
            f"{flag} is empty: give a folder (use . for the current one)"]


def test_a_load_model_dir_without_load_is_refused_unless_it_is_the_save_folder(tmp_path):
    models = str(tmp_path / "models")
    line = (f"--load-model-dir trained_models/ is where --load looks for the run to resume or the model to start "
            f"from, and --load is not given: add --load, or leave --load-model-dir out")
    assert line in validate(parse("--load-model-dir", "trained_models/", "--save-model-dir", models))
    assert validate(parse("--load-model-dir", "trained_models/", "--save-model-dir", models, "--load")) == []
    assert validate(parse("--load-model-dir", models, "--save-model-dir", models)) == []  # the default's folder


def test_a_confirm_cadence_that_would_change_nothing_is_refused_and_the_default_never_is():
    line = ("--confirm-every-steps 2000: the monitor confirms --target-score this often once a game reaches it, and "
            "no --target-score is given: add one, or leave the flag out")
    assert line in validate(parse("--confirm-every-steps", "2000"))
    assert validate(parse("--confirm-every-steps", "2000", "--target-score", "20")) == []
    assert validate(parse("--confirm-every-steps", "0")) == []  # off: nothing to refuse
    assert ("--confirm-every-steps 20000 is not sooner than --test-every-steps 20000, so it would change nothing: "
            "give a smaller one, or leave it out") in validate(
        parse("--confirm-every-steps", "20000", "--target-score", "20"))
    assert validate(parse("--confirm-every-steps", "20000", "--target-score", "20", "--test-every-steps", "0",
                          "--test-every-seconds", "60")) == []
    assert validate(parse("--confirm-every-steps", "20000", "--target-score", "20", "--test-every-steps", "0")) == [
        "--confirm-every-steps 20000: with --test-every-steps 0 and --test-every-seconds 0 the monitor plays its games "
        "back to back, so it would change nothing: leave it out"]  # before, accepted
    for argv in ([], ["--test-every-steps", "4000"], ["--target-score", "20", "--test-every-steps", "4000"]):
        assert validate(parse(*argv)) == []  # the default (5000) is never refused


@pytest.mark.parametrize("name, mode", [("PongNoFrameskip-v4_train.log", "ga3c"), ("PongNoFrameskip-v4_log", "a3g"),
                                        ("PongNoFrameskip-v4_monitor.csv", "ga3c"), ("results.txt", "ga3c")])
def test_a_folder_where_the_run_writes_a_log_file_is_refused(name, mode, tmp_path):
    (tmp_path / name).mkdir()
    line = (f"{tmp_path / name} is a folder where this run writes its log file: move it away, or pass --log-dir "
            f"DIR with another folder")
    assert line in validate(parse("--mode", mode, "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path / "m")))
    if name == "results.txt":  # A3G mode writes none
        assert validate(parse("--mode", "a3g", "--log-dir", str(tmp_path), "--save-model-dir",
                              str(tmp_path / "m"))) == []


def test_a_folder_for_the_crop_table_and_a_file_for_the_load_folder_are_named_as_they_are(tmp_path):
    assert f"env config '{tmp_path}' is a folder, not the crop table (use --env-config PATH to its file)" in validate(
        parse("--env-config", str(tmp_path)))
    (tmp_path / "model.dat").write_bytes(b"x")
    assert (f"--load-model-dir '{tmp_path / 'model.dat'}' is a file, not a folder: give the folder that holds "
            f"<env>.ckpt or <env>.dat") in validate(parse("--load", "--load-model-dir", str(tmp_path / "model.dat")))


def test_amsgrad_with_rmsprop_is_refused_and_either_alone_is_not():
    """RMSprop has no AMSGrad variant (``make_optimizer`` drops the flag there): given with it, one line."""
    assert validate(parse("--optimizer", "RMSprop", "--amsgrad")) == [
        "--amsgrad is Adam's variant and RMSprop has none, so it would change nothing: leave it out, or use "
        "--optimizer Adam"]
    assert validate(parse("--optimizer", "RMSprop")) == validate(parse("--amsgrad")) == []


def test_dynamic_max_has_the_size_limits_of_the_counts_it_bounds():
    """--dynamic-max sizes the shared state (and the default --train-batch) as --agents etc. do; before, 100,000,000
    agents passed and the run died of memory after taking its locks."""
    assert validate(parse("--mode", "ga3c", "--dynamic", "--dynamic-max", "2", "2", "100000000")) == [
        "--dynamic-max: the bound for agents must be at most 1,024, got 100,000,000"]
    # the bounds themselves pass the size limits (a machine's memory may still refuse so many trainers:
    # memory_problems, tested above)
    assert [e for e in validate(parse("--mode", "ga3c", "--dynamic", "--dynamic-max", "1024", "4", "1024"))
            if "this machine has" not in e] == []


def test_the_default_worker_and_agent_counts_are_the_cores_this_process_may_use(monkeypatch):
    """A run under ``taskset -c 0`` (or a container's cpuset) gets one worker, not one per core of the machine."""
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    args = parse("--mode", "ga3c")
    assert validate(args) == [] and args.agents == 1
    args = parse("--mode", "a3g")
    assert validate(args) == [] and args.workers == 1


def test_frame_flags_that_change_nothing_for_the_ids_played_are_refused():
    """--skip-rate sets the skip of NoFrameskip ids only, --see-skipped-frames matters only for ids whose emulator
    skips frames; given where no id played is of that kind, each was accepted and did nothing."""
    assert validate(parse("--env", "ALE/Pong-v5", "--skip-rate", "2")) == [
        "--skip-rate 2 changes nothing here: it sets the skip of NoFrameskip ids, and ALE/Pong-v5 skips frames in "
        "the emulator; leave it out"]
    assert validate(parse("--see-skipped-frames")) == [
        "--see-skipped-frames changes nothing here: NoFrameskip ids (PongNoFrameskip-v4) show the max over the "
        "skipped frames already; leave it out"]
    # where one id played is of the kind the flag is for, it is kept; the default skip is never refused
    assert validate(parse("--env", "ALE/Pong-v5", "--train-envs", "PongNoFrameskip-v4", "ALE/Pong-v5",
                          "--skip-rate", "2")) == []
    assert validate(parse("--env", "Pong-v0", "--see-skipped-frames")) == []
    assert validate(parse("--env", "PongNoFrameskip-v4", "--train-envs", "Pong-v0", "PongNoFrameskip-v4",
                          "--see-skipped-frames")) == []
    assert validate(parse("--env", "ALE/Pong-v5", "--skip-rate", "4")) == []


def test_an_empty_env_config_is_named_as_empty_not_as_a_folder():
    """``Path('')`` is the current folder: ``--env-config ''`` was reported as "is a folder"."""
    assert validate(parse("--env-config", "")) == [
        "--env-config is empty: give the crop table's path (default: the repository's config.json)"]


def test_ray_with_ga3c_mode_is_one_line_however_the_schedule_came():
    """GA3C mode's default --lr-anneal-steps is no second line beside "--ray-address: only A3G mode has it"; a
    schedule the command line gives still gets its own line."""
    from config import validate_ray
    assert validate_ray(parse("--mode", "ga3c", "--ray-address", "local")) == []
    for flag in ("--lr-anneal-steps", "--entropy-anneal-steps"):
        assert validate_ray(parse("--mode", "ga3c", "--ray-address", "local", flag, "100")) == [
            f"{flag} needs the global step count in every worker, which Ray nodes do not have: drop {flag} or "
            f"--ray-address"]


def test_a_later_passes_value_that_is_not_a_choice_is_one_usage_line(tmp_path):
    """``--later-passes conv`` is argparse's usage error: the choices named, exit status 2, nothing written."""
    import subprocess
    import sys
    main = Path(__file__).resolve().parents[1] / "main.py"
    out = subprocess.run([sys.executable, str(main), "--later-passes", "conv", "--log-dir", str(tmp_path / "logs"),
                          "--save-model-dir", str(tmp_path / "models")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = [x for x in out.stderr.splitlines() if "error" in x]
    assert "argument --later-passes: invalid choice: 'conv'" in line and "full" in line and "lstm" in line
    assert not (tmp_path / "logs").exists() and not (tmp_path / "models").exists()

"""``--precision``: its resolution, and the bf16 update on the production path of both modes.

Production path: the objects ``main.py`` builds (the shared float32 model and the shared optimizer from
``make_optimizer``), an A3G worker's channels-last model in the run's precision acting with its
``ActivationCache`` and updating with ``train.update``; GA3C's ``build_server`` (its predictor and trainer in the
run's precision; with ``--replay-activations`` the predictor saving bf16 conv activations that the trainer replays,
without it the trainer running the encoder again in bf16) on real Pong.

Two references for every update, both loaded with the weights that acted:
- the slow bf16 reference: a model whose convolutions run in bf16 too (``set_precision``), upstream's batch-1
  forward at every step and autograd's backward. It computes the same function as the production path. Its
  weights are stored channels-last like the production models', so that both run the same bf16 convolution
  kernel: on a CPU without native bf16 (an AVX2 EPYC) oneDNN's contiguous and channels-last bf16 convolutions
  round differently, 0.7% of the features one bf16 step apart, which puts the head gradients 5e-5 apart.
  The LSTM and head gradients are computed from the same bf16 conv features on both sides and in float32 after
  them, so they agree to float32 rounding: measured at most 4e-6 relative (L2, per tensor) on real Pong rollouts
  with initial and with trained weights (1.3e-6 on the AVX2 EPYC). Tolerance 3e-5. A bf16 rounding after the
  features on the production side fails it: the LSTM cell state rounded to bf16 at each step, 6e-4 (also on the
  AVX2 EPYC); GA3C's advantages computed in bf16, 3e-2 (actor) and 2e-4 (LSTM); both made once on purpose. A bf16 piece in code both sides share (the heads,
  ``losses``) turns the outputs' dtype to bf16, and the loss terms, the LSTM state and every gradient and
  optimizer statistic are asserted float32.
  The conv gradients differ by where the bf16 roundings happen (the replay rounds each conv weight gradient
  summed over the rollout to bf16 once, autograd each frame's): measured at most 1.1% per tensor. Tolerance 3%.
- the float32 reference (the same forward, all in float32): bf16 convolutions by themselves put the gradient
  1.8-10% away from it (relative L2 error of the whole gradient, cosine similarity >= 0.992; the bf16 reference
  is as far). Tolerance: 25% and a cosine of 0.97, which a gradient computed from the wrong weights or with a
  term missing does not reach.

The shared weights, the gradients handed to them and the optimizer statistics stay float32 (asserted).
"""
import pytest
import torch

from config import build_parser, validate
import precision
from environment import atari_env, load_env_config
from model import A3Clstm
from player_util import Agent, GradientHandoff, stepwise_rollout_loss, sync_weights
from precision import compute_dtype
from shared_optim import make_optimizer
from train import update

CPU = torch.device("cpu")
CONV_TOL, AFTER_FEATURES_TOL = 0.03, 3e-5  # per tensor, against the slow bf16 reference (module docstring)
FP32_WHOLE, FP32_COSINE = 0.25, 0.97  # against the float32 reference


def assert_matches_references(shared_model, acted: dict, update_index: int, backward, grads=None,
                              convs: bool = True) -> None:
    """The gradients handed to ``shared_model`` (or ``grads``, one per parameter, as handed to it for one step)
    against both references (module docstring), each a fresh model with the ``acted`` weights on which
    ``backward(model)`` computes the reference gradient; ``convs=False``: the LSTM's and the heads' only (a later
    pass of ``--later-passes lstm``, which hands no conv gradient: checked None)."""
    n, hidden = shared_model.num_actions, shared_model.hidden_size
    grads = [p.grad for p in shared_model.parameters()] if grads is None else grads
    for dtype in (torch.bfloat16, torch.float32):
        ref = A3Clstm(1, n, hidden).channels_last().set_precision(dtype)
        ref.load_state_dict(acted)
        backward(ref)
        pairs = [(k, g, q.grad) for (k, _), g, q in zip(shared_model.named_parameters(), grads, ref.parameters())]
        if not convs:
            assert all(g is None for k, g, _ in pairs if k.startswith("conv")), "a conv gradient in a later pass"
            pairs = [(k, g, w) for k, g, w in pairs if not k.startswith("conv")]
        if dtype == torch.bfloat16:
            for key, got, want in pairs:
                err = float((got - want).norm() / want.norm())
                tol = CONV_TOL if key.startswith("conv") else AFTER_FEATURES_TOL
                assert err <= tol, f"update {update_index}: {key} is {err:.2e} from the bf16 reference's (tol {tol})"
        else:
            got = torch.cat([g.flatten() for _, g, _ in pairs])
            want = torch.cat([w.flatten() for _, _, w in pairs])
            whole = float((got - want).norm() / want.norm())
            cosine = float(torch.nn.functional.cosine_similarity(got, want, 0))
            assert whole <= FP32_WHOLE and cosine >= FP32_COSINE, \
                f"update {update_index}: {whole:.3%} from the float32 reference's, cosine {cosine:.4f}"


def assert_float32_state(shared_model, optimizer, convs: bool = True):
    """The shared weights, their gradients (``convs=False``: the convs' None, as a later pass of ``--later-passes
    lstm`` leaves them) and every floating optimizer statistic are float32 (or float64)."""
    for k, p in shared_model.named_parameters():
        if not convs and k.startswith("conv"):
            assert p.dtype == torch.float32 and p.grad is None, k
            continue
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, k
    for p in shared_model.parameters():
        for key, v in optimizer.state[p].items():
            if torch.is_tensor(v) and v.is_floating_point():
                assert v.dtype in (torch.float32, torch.float64), f"optimizer state {key} is {v.dtype}"


# ---- resolution -------------------------------------------------------------------------------------------------

def test_cpu_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    with_bf16 = tmp_path / "with"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n")
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    without = tmp_path / "without"
    without.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert precision.cpu_has_native_bf16(with_bf16) and precision.cpu_has_native_bf16(amx)
    assert not precision.cpu_has_native_bf16(without)
    assert not precision.cpu_has_native_bf16(tmp_path / "missing")


@pytest.mark.parametrize("native,requested,expected", [
    (True, "auto", ("bf16", [], [])), (False, "auto", ("fp32", [], [])),
    (True, "fp32", ("fp32", [], [])), (False, "fp32", ("fp32", [], [])), (True, "bf16", ("bf16", [], [])),
])
def test_resolve_on_the_cpu(monkeypatch, native, requested, expected):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda *a: native)
    assert precision.resolve(requested, [CPU]) == expected


def test_bf16_on_a_cpu_without_it_runs_with_one_warning(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda *a: False)
    resolved, errors, warnings = precision.resolve("bf16", [CPU])
    assert resolved == "bf16" and errors == [] and len(warnings) == 1 and "slower" in warnings[0]


def test_bf16_on_a_gpu_without_it_is_refused_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(precision, "_cuda_bf16", lambda index: index == 0)  # GPU 0 Ampere, GPU 1 older
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    resolved, errors, _ = precision.resolve("bf16", gpus)
    assert len(errors) == 1 and "GPU 1" in errors[0] and "--precision fp32" in errors[0]
    assert precision.resolve("auto", gpus)[0] == "fp32"
    assert precision.resolve("auto", gpus[:1])[0] == "bf16"


def test_validate_sets_the_resolved_precision(tmp_path, monkeypatch):
    flags = ["--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)]
    args = build_parser().parse_args(["--mode", "a3g", *flags])
    assert args.precision == "fp32" and validate(args) == [] and args.compute_precision == "fp32"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda *a: True)
    args = build_parser().parse_args(flags)  # GA3C mode, whose default is auto
    assert args.precision == "auto" and validate(args) == [] and args.compute_precision == "bf16"
    args = build_parser().parse_args(flags + ["--precision", "auto"])
    assert validate(args) == [] and args.compute_precision == "bf16"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda *a: False)
    args = build_parser().parse_args(flags + ["--precision", "auto"])
    assert validate(args) == [] and args.compute_precision == "fp32"


# ---- the model ----------------------------------------------------------------------------------------------------

def test_bf16_encoder_keeps_float32_weights_state_and_outputs():
    torch.manual_seed(0)
    model = A3Clstm(1, 6).channels_last().set_precision(torch.bfloat16)
    keys = {k: (v.dtype, v.shape) for k, v in A3Clstm(1, 6).state_dict().items()}
    assert {k: (v.dtype, v.shape) for k, v in model.state_dict().items()} == keys
    from model import ActivationCache
    cache = ActivationCache()
    with torch.no_grad():
        value, logits, (hx, cx) = model(torch.rand(2, 1, 80, 80), model.initial_state(2), cache)
    assert {t.dtype for t in (value, logits, hx, cx)} == {torch.float32}
    block_input, _, out = cache.steps[0][1]
    assert block_input.dtype == out.dtype == torch.bfloat16
    assert cache.steps[0][0][0].dtype == torch.bfloat16  # the frame itself, as the first conv saw it


def test_the_first_conv_blocks_gradient_is_summed_over_its_pieces_in_float32():
    """The replayed first conv block runs backward in pieces of ``FIRST_BLOCK_CHUNK`` frames, each in the encoder's
    bf16; the weight and bias gradients are the float32 sum of the pieces. A bf16 sum would round every partial sum
    to bf16, so each entry would be a bf16 number; the float32 sum of 3 pieces mostly is not (within 0.2% either
    way, under the update tests' tolerance)."""
    from model import FIRST_BLOCK_CHUNK, ActivationCache
    torch.manual_seed(0)
    model = A3Clstm(1, 6, 32).channels_last().set_precision(torch.bfloat16)
    frames = torch.rand(3 * FIRST_BLOCK_CHUNK, 1, 80, 80)
    cache, state = ActivationCache(), model.initial_state(1)
    with torch.no_grad():
        for t in range(frames.shape[0]):  # acting, one frame a step, as a worker does
            _, _, state = model(frames[t: t + 1], state, cache)
    values, logits = model.unroll(frames, model.initial_state(1), cache)
    (values.sum() + logits.logsumexp(1).sum()).backward()
    for grad in (model.conv1.weight.grad, model.conv1.bias.grad, model.conv2.weight.grad):
        assert grad.dtype == torch.float32
    for grad in (model.conv1.weight.grad, model.conv1.bias.grad):
        in_bf16 = torch.eq(grad, grad.bfloat16().float()).float().mean().item()
        assert in_bf16 < 0.5, f"{in_bf16:.0%} of the entries are bf16 numbers: the pieces were summed in bf16"


@pytest.mark.parametrize("capability, index, expected", [
    ((7, 5), 0, False), ((8, 0), 0, True), ((8, 9), 1, True), ((9, 0), 0, True), ((9, 0), 2, False)])
def test_a_cuda_device_has_native_bf16_from_compute_capability_8(monkeypatch, capability, index, expected):
    """Turing (7.5) and older: no; Ampere (8.x), Ada, Hopper (9.0): yes; a device index the machine lacks: no."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability)
    assert precision.device_has_native_bf16(torch.device("cuda", index)) is expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision.device_has_native_bf16(torch.device("cuda", 0)) is False


# ---- the production update ----------------------------------------------------------------------------------------

def a3g_case(tmp_path, extra):
    args = build_parser().parse_args(["--workers", "1", "--precision", "bf16", "--lr", "1e-3", "--log-dir",
                                      str(tmp_path), "--save-model-dir", str(tmp_path), *extra])
    assert validate(args) == [] and args.compute_precision == "bf16"
    return args


# Adam, the default, in the default suite; the other optimizers' arithmetic does not depend on the encoder's
# precision (they get float32 gradients, checked here) and is tested step for step in test_production_update.py
@pytest.mark.parametrize("name,amsgrad", [("Adam", False), pytest.param("Adam", True, marks=pytest.mark.slow),
                                          pytest.param("RMSprop", False, marks=pytest.mark.slow)])
def test_a3g_bf16_update_matches_the_references(tmp_path, name, amsgrad):
    args = a3g_case(tmp_path, ["--optimizer", name] + (["--amsgrad"] if amsgrad else []))
    env = atari_env(args.env, load_env_config("config.json", args.env), episodic_life=True)
    n = env.action_space.n
    # main.py
    torch.manual_seed(args.seed)
    shared_model = A3Clstm(1, n, args.hidden_size)
    shared_model.share_memory()
    optimizer = make_optimizer(name, shared_model.parameters(), args.lr, args.amsgrad, shared=True)
    # train.run_worker
    model = A3Clstm(1, n, args.hidden_size).channels_last().to(CPU)
    model.set_precision(compute_dtype(args.compute_precision))
    model.train()
    agent = Agent(model, env, CPU, seed=args.seed)
    handoff = GradientHandoff(model, shared_model)
    kw = dict(gamma=args.gamma, tau=args.tau, entropy_coef=args.entropy_coef, value_coef=args.value_coef)
    try:
        for u in range(4):
            sync_weights(model, shared_model)
            acted = {k: v.clone() for k, v in shared_model.state_dict().items()}
            rollout = agent.rollout(args.num_steps)
            assert agent.hx.dtype == agent.cx.dtype == torch.float32
            loss, _ = update(model, rollout, handoff, optimizer, args)
            assert {t.dtype for t in loss} == {torch.float32}
            assert_float32_state(shared_model, optimizer)
            assert_matches_references(shared_model, acted, u,
                                      lambda ref: stepwise_rollout_loss(ref, rollout, **kw).total.backward())
            moved = max(float((p.detach() - acted[k]).abs().max()) for k, p in shared_model.named_parameters())
            assert moved > 0, f"update {u} did not change the shared weights"
    finally:
        env.close()


@pytest.mark.parametrize("replay, passes, later", [(False, None, None), (True, None, None), (False, 1, None),
                                                  (True, None, "lstm")],
                         ids=["default", "replay-activations", "train-passes-1", "later-passes-lstm"])
def test_ga3c_bf16_update_matches_the_references(tmp_path, replay, passes, later):
    """Every optimizer step of the server's trainer in bf16 (GA3C mode's default of two per batch, the second on the
    clipped surrogate at the weights the first left; or one) hands over the gradient of both references at the
    weights it stepped from. With ``--later-passes lstm`` the second step hands over the LSTM's and the heads'
    gradients only, those of the references with the conv weights the first step started from (whose bf16
    features it reuses) and the LSTM and heads it steps from."""
    from conftest import collect_batch, segments_reference_backward
    from ga3c.agent import AgentStepper, AtariEnvFactory, EnvRunner
    from ga3c.run import Ga3cRun
    from ga3c.server import build_server
    from ga3c.settings import Ga3cSettings

    args = build_parser().parse_args([
        "--mode", "ga3c", "--precision", "bf16", "--lr", "1e-3", "--agents", "1", "--envs-per-agent", "3",
        "--train-batch", "2", "--num-steps", "8", "--trainers", "1", "--log-dir", str(tmp_path),
        "--save-model-dir", str(tmp_path)] + (["--replay-activations"] if replay else [])
        + (["--train-passes", str(passes)] if passes else []) + (["--later-passes", later] if later else []))
    assert validate(args) == [] and args.compute_precision == "bf16" and args.replay_activations == replay
    settings = Ga3cSettings.from_args(args)
    assert settings.compute_precision == "bf16" and settings.train_passes == (passes or 2)
    clip = settings.train_passes > 1 and settings.pass_clip
    factory = AtariEnvFactory(args.env, args.env_config, args.max_episode_length, args.skip_rate, seed=args.seed)
    envs = [factory(s) for s in range(args.envs_per_agent)]
    n = envs[0].action_space.n
    torch.manual_seed(args.seed)
    shared_model = A3Clstm(1, n, args.hidden_size)
    shared_model.share_memory()
    optimizer = make_optimizer(args.optimizer, shared_model.parameters(), args.lr, args.amsgrad, shared=True)
    run = Ga3cRun(args, shared_model, optimizer, log=None)
    kw = dict(is_clip=settings.is_clip, gamma=settings.gamma, tau=settings.tau, entropy_coef=settings.entropy_coef,
              value_coef=settings.value_coef)
    try:
        server = build_server(args, shared_model, optimizer, run.buffers, run.counters, run.run.stop)
        (predictor,), (trainer,) = server.predictors, server.trainers
        assert predictor.model.compute_dtype == trainer.model.compute_dtype == torch.bfloat16
        assert server.states.hx.dtype == server.states.cx.dtype == torch.float32
        stepper = AgentStepper(0, [EnvRunner(s, envs[s], run.buffers, args.seed + s) for s in range(len(envs))],
                               run.buffers, run.counters)
        stepper.begin()
        stepped = []  # each optimizer step's weights before it and the gradients handed to it
        real_step = trainer.optimizer.step

        def recording_step(*a, **k):
            stepped.append(({k: v.clone() for k, v in shared_model.state_dict().items()},
                            [None if p.grad is None else p.grad.clone() for p in shared_model.parameters()]))
            return real_step(*a, **k)

        trainer.optimizer.step = recording_step
        for u in range(3):
            stepped.clear()
            batch = collect_batch(predictor, stepper, server.segments, settings.train_batch)
            if replay:  # the predictor saved bf16 activations, which the trainer replays
                assert all(seg.acts is not None and seg.acts[0].dtype == torch.bfloat16 for seg in batch)
            else:
                assert all(seg.acts is None for seg in batch)
            result = trainer.update(batch)
            assert result.lag_max == settings.train_passes - 1  # a later pass steps from weights moved since acting
            assert {t.dtype for t in result.loss} == {torch.float32}
            assert_float32_state(shared_model, optimizer, convs=later != "lstm")
            server.open_segments.clear()  # no policy lag in the next batch
            while not server.segments.empty():
                server.segments.get_nowait()
            assert len(stepped) == settings.train_passes
            first_convs = {key: v for key, v in stepped[0][0].items() if key.startswith("conv")}
            for k, (weights, grads) in enumerate(stepped):
                reused = later == "lstm" and k > 0  # the first step's conv weights, this one's LSTM and heads
                assert_matches_references(shared_model, {**weights, **first_convs} if reused else weights,
                                          f"{u} pass {k}", grads=grads, convs=not reused, backward=lambda ref: (
                                              segments_reference_backward(ref, batch, **kw, pass_clip=clip or None)))
    finally:
        for env in envs:
            env.close()
        run.release()


def test_the_real_worker_loop_acts_and_updates_in_the_runs_precision(tmp_path, monkeypatch):
    """``train.run_worker`` itself (in-process): its model runs the encoder in the resolved precision."""
    import train
    from run_state import RunState
    from shared_optim import SharedAdam

    seen = []

    class Recording(A3Clstm):
        def features(self, x, cache=None):
            seen.append(self.compute_dtype)
            return super().features(x, cache)

    monkeypatch.setattr(train, "A3Clstm", Recording)
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        args = build_parser().parse_args(["--workers", "1", "--hidden-size", "32", "--precision", name, "--log-dir",
                                          str(tmp_path), "--save-model-dir", str(tmp_path)])
        assert validate(args) == []
        shared = A3Clstm(1, 6, 32)
        shared.share_memory()
        seen.clear()
        assert train.run_worker(0, args, shared, SharedAdam(shared.parameters(), lr=1e-3), RunState(1), CPU,
                                max_updates=2) == 2
        assert seen and set(seen) == {dtype}


# ---- entry points ---------------------------------------------------------------------------------------------------

def test_gym_eval_plays_in_bf16_when_told_and_says_so(tmp_path):
    import json

    from conftest import ROOT, run_entry
    r = run_entry("gym_eval.py", "--env", "PongNoFrameskip-v4", "--model-file",
                  str(ROOT / "trained_models" / "PongNoFrameskip-v4.dat"), "--num-episodes", "1", "--seed", "1",
                  "--precision", "bf16", "--max-episode-length", "700", "--log-dir", str(tmp_path / "logs"),
                  "--json", str(tmp_path / "s.json"), cwd=tmp_path, timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["precision"] == "bf16" and "model in bf16" in r.stdout
    # the shipped model still wins with a bf16 encoder: in fp32 it takes a point every 75-130 steps and loses none
    # (5-0 after the first 700 steps of seed 1; a whole game is 1,600-2,800 steps), so in bf16 it must lead by 3
    assert summary["lengths"][0] <= 700 and summary["scores"][0] >= 3, summary


def test_a_bf16_run_says_so_saves_float32_files_and_resumes_in_fp32_in_the_other_mode(tmp_path):
    """GA3C mode (the default) in bf16, resumed in A3G mode in fp32: each run's start and status lines and its
    checkpoint name the precision; the files stay float32 (they load into an fp32 model unchanged). An A3G worker's
    loop in bf16 is test_the_real_worker_loop_acts_and_updates_in_the_runs_precision."""
    from conftest import ROOT, run_entry
    from model import A3Clstm
    common = ["--hidden-size", "32", "--test-every-steps", "100000", "--max-episode-length", "100",
              "--env-config", str(ROOT / "config.json"),
              "--status-every-seconds", "1", "--log-dir", str(tmp_path / "logs"),
              "--save-model-dir", str(tmp_path / "models")]
    ckpt_path = tmp_path / "models" / "PongNoFrameskip-v4.ckpt"
    runs = [(["--mode", "ga3c", "--agents", "1", "--envs-per-agent", "2", "--num-steps", "5", "--train-batch", "2",
              "--trainers", "1", "--precision", "bf16", "--max-steps", "20"], "bf16", None),
            (["--workers", "1", "--precision", "fp32", "--load"], "fp32", "bf16")]
    steps = 0
    for flags, precision_name, was in runs:
        if "--load" in flags:  # 20 steps more than the first run made, however far past its 20 it got
            flags = [*flags, "--max-steps", str(steps + 20)]
        r = run_entry("main.py", *flags, *common, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert f"in {precision_name}; stop at" in r.stdout
        if was is not None:
            assert f"the checkpoint was trained in {was}; this run goes on in {precision_name}" in r.stdout
        status = [line for line in r.stdout.splitlines() if " steps/s" in line and "[monitor]" not in line
                  and line.rstrip().endswith(f"| {precision_name}")]
        assert status, r.stdout[-2000:]
        ckpt = torch.load(ckpt_path, weights_only=True)
        assert ckpt["config"]["compute_precision"] == precision_name and ckpt["global_steps"] > steps
        steps = ckpt["global_steps"]
        assert {v.dtype for v in ckpt["model"].values()} == {torch.float32}
        m = A3Clstm(1, 6, 32)
        m.load_state_dict(torch.load(tmp_path / "models" / "PongNoFrameskip-v4.dat", weights_only=True))

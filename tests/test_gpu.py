"""A3G and GA3C modes on CUDA (skipped without a GPU): workers, trainers and predictors on the GPU, the shared model
and optimizer state on the CPU. The device-parametrised tests also run their checks on the CPU."""
import pytest
import torch

from config import build_parser
from conftest import ROOT, run_entry
from shared_optim import SharedAdam
from utils import use_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def tf32_flags():
    """The tests call ``utils.use_device`` as the processes they stand for do; the flags it sets are put back."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


class RecordingSharedAdam(SharedAdam):
    """The shared Adam, recording at every step the gradient it is handed and the weights it leaves."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.applied, self.after = [], []

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        assert all(p.grad is not None for p in params), "a shared parameter was handed no gradient"
        self.applied.append([(p.grad.clone(), p.grad.device, p.grad.stride() == p.stride()) for p in params])
        out = super().step(closure)
        self.after.append([p.detach().clone() for p in params])
        return out


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda), "cpu"])  # cpu: the same checks run anywhere
def test_every_update_applies_the_workers_gradient_to_the_cpu_shared_model_and_syncs_back(tmp_path, monkeypatch,
                                                                                          device):
    """A3G: the worker's model acts and computes gradients on its device; the shared model and the shared
    optimizer stay on the CPU, in shared memory. On every update the optimizer must apply exactly this update's
    gradient of the worker, for every parameter, as a CPU tensor laid out as its parameter; and the worker must
    act with the weights that step produced."""
    import train
    from model import A3Clstm
    from player_util import GradientHandoff
    from run_state import RunState

    class SpyHandoff(GradientHandoff):
        """The worker's hand-off, recording the local model's device, gradients and weights at each call."""

        def __init__(self, local, shared):
            super().__init__(local, shared)
            self.devices, self.grads, self.weights = [], [], []
            spies.append(self)

        def __call__(self):
            self.devices.append({t.device for lp, _ in self.pairs for t in (lp, lp.grad)})
            self.grads.append([lp.grad.to("cpu", copy=True) for lp, _ in self.pairs])
            self.weights.append([lp.detach().to("cpu", copy=True) for lp, _ in self.pairs])
            super().__call__()

    spies = []
    monkeypatch.setattr(train, "GradientHandoff", SpyHandoff)
    gpu_ids = "0" if device == "cuda" else "-1"
    args = build_parser().parse_args(["--workers", "1", "--max-steps", "0", "--gpu-ids", gpu_ids,
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    args.env_config = str(ROOT / "config.json")
    shared = A3Clstm(1, 6)
    shared.share_memory()
    initial = [p.detach().clone() for p in shared.parameters()]
    opt = RecordingSharedAdam(shared.parameters(), lr=1e-3)
    run = RunState(1)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    updates = 3
    assert train.run_worker(0, args, shared, opt, run, dev, max_updates=updates) == updates
    (spy,) = spies
    assert len(spy.grads) == len(opt.applied) == updates
    for u in range(updates):
        assert spy.devices[u] == {dev}, f"update {u}: the worker's model or gradients are on {spy.devices[u]}"
        for i, (lg, (applied, where, same_layout)) in enumerate(zip(spy.grads[u], opt.applied[u])):
            assert where.type == "cpu" and same_layout, f"update {u}, parameter {i}: {where}, layout {same_layout}"
            assert torch.equal(applied, lg), f"update {u}, parameter {i}: not the worker's gradient of this update"
        # the worker acted with the shared weights of that moment: the initial ones, then each step's result
        synced = initial if u == 0 else opt.after[u - 1]
        assert all(torch.equal(w, s) for w, s in zip(spy.weights[u], synced)), f"update {u}: weights not synced"
        assert any(not torch.equal(a, s) for a, s in zip(opt.after[u], synced)), f"update {u}: no step"
    assert any(not torch.equal(a, b) for a, b in zip(spy.grads[0], spy.grads[1]))  # fresh gradients each update
    assert all(p.device.type == "cpu" and p.is_shared() for p in shared.parameters())
    state = [v for s in opt.state.values() for v in s.values()]
    assert all(v.device.type == "cpu" and v.is_shared() for v in state)
    assert all(s["step"].item() == updates for s in opt.state.values())


@cuda
def test_main_in_a3g_mode(tmp_path):
    r = run_entry("main.py", "--workers", "2", "--gpu-ids", "0", "--max-steps", "400", "--test-every-steps", "200",
                  "--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    sd = torch.load(tmp_path / "models/PongNoFrameskip-v4.dat", weights_only=True)
    assert all(v.device.type == "cpu" for v in sd.values())
    ckpt = torch.load(tmp_path / "models/PongNoFrameskip-v4.ckpt", weights_only=True)
    assert ckpt["global_steps"] >= 400
    state = [v for s in ckpt["optimizer"]["state"].values() for v in s.values()]
    assert state and all(v.device.type == "cpu" for v in state)  # loadable on a machine without a GPU


def test_gpu_request_without_cuda_is_a_clear_error():
    from config import validate_gpu_ids
    if torch.cuda.is_available():
        (msg,) = validate_gpu_ids([torch.cuda.device_count()])
        assert "does not exist" in msg
    else:
        (msg,) = validate_gpu_ids([0])
        assert "CUDA is not available" in msg and "--gpu-ids -1" in msg
    assert validate_gpu_ids([-1]) == []
    assert validate_gpu_ids([-1, 0])


# ---------------------------------------------------------------------------------------------- GA3C mode
def close(a, b, device):
    """Equal up to the rounding of another device: the summation order differs (channels-last against contiguous,
    cuDNN's algorithms against the CPU's); on CUDA in float32, with TF32 off as ``utils.use_device`` sets it
    (with it on, a trainer's conv1 gradient was 4% off on an H200)."""
    rel = 1e-4 if torch.device(device).type == "cpu" else 1e-3
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return bool((a - b).abs().max() <= rel * b.abs().max() + 1e-6)


def with_activations(model, segments):
    """The segments, each carrying the conv activations ``model`` computes for its frames (what a predictor saves
    with ``--replay-activations``)."""
    from ga3c.segment import ACT_FIELDS, activation_rows, cat_rows
    from model import ActivationCache

    for s in segments:
        cache = ActivationCache()
        with torch.no_grad():
            model.features(s.frames, cache)
        rows = [activation_rows(cache, j) for j in range(len(s))]
        s.acts = [cat_rows([r[i] for r in rows]) for i in range(len(ACT_FIELDS))]
    return segments


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("replay", [False, True], ids=["conv-forward", "replayed-activations"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda), "cpu"])
def test_a_ga3c_trainer_on_its_device_updates_the_cpu_shared_model_as_on_the_cpu(device, replay, precision):
    """GA3C: a trainer on ``device`` copies the CPU shared weights, computes the batch's gradient there and hands
    it to the CPU shared Adam; the gradient it hands over at each update is a CPU trainer's on the same batches
    (up to the device's rounding), and the shared weights stay as close to the CPU run's as Adam allows.
    ``replay``: before each update the batch gets, stamped with the trainer's version, the conv activations of
    the weights it holds (what a predictor with no policy lag saves: the default path), which the batch takes to
    the trainer's device; every frame is then replayed, and every update hands over the gradient of running the
    convolutions again. On the CPU without replay both runs are the same code: that case checks only where the
    weights and gradients live (the gradient itself is tested against a reference in
    test_ga3c_production_update.py). ``precision`` bf16: the device trainer (and the acting model whose
    activations it replays) runs the encoder in bf16, as ``--precision auto`` does on an H100 or H200, and each
    update's whole gradient is held to test_precision.py's bound against the float32 CPU trainer's (25% relative
    L2, cosine 0.97); the shared weights, the gradients handed over and Adam's statistics stay float32."""
    import dataclasses

    from ga3c.settings import Ga3cSettings
    from ga3c.trainer import Trainer, assemble
    from model import A3Clstm
    from test_ga3c_trainer import random_segments

    torch.manual_seed(0)
    weights = A3Clstm(1, 6, 32).state_dict()
    batches = [random_segments([5, 3], ["cut", "term"], seed=seed) for seed in range(3)]

    def train(dev, replay, prec="fp32"):
        use_device(torch.device(dev))  # as the GA3C server process does before it builds its trainers
        shared = A3Clstm(1, 6, 32)
        shared.load_state_dict(weights)
        shared.share_memory()
        opt = RecordingSharedAdam(shared.parameters(), lr=1e-3)
        trainer = Trainer(shared, opt, Ga3cSettings(num_steps=5, train_batch=2, compute_precision=prec), device=dev)
        acting = A3Clstm(1, 6, 32).channels_last()
        if prec == "bf16":
            acting.set_precision(torch.bfloat16)  # a bf16 predictor's activations
        for segments in batches:
            version = trainer.version()
            segments = [dataclasses.replace(s, versions=torch.full_like(s.versions, version), acts=None)
                        for s in segments]
            if replay:
                acting.load_state_dict(shared.state_dict())
                segments = with_activations(acting, segments)
                assert bool(assemble(segments, version=version).replay.all())
            trainer.update(segments)
        assert all(p.device.type == "cpu" and p.is_shared() and p.dtype == torch.float32 for p in shared.parameters())
        assert all(d.type == "cpu" and same_layout for step in opt.applied for _, d, same_layout in step)
        assert all(g.dtype == torch.float32 for step in opt.applied for g, _, _ in step)
        assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.is_floating_point() and v.numel() > 1)
        return opt

    if precision == "bf16":
        from test_precision import FP32_COSINE, FP32_WHOLE

        def near(got_step, want_step):
            got = torch.cat([g.flatten().cpu() for g, _, _ in got_step])
            want = torch.cat([g.flatten().cpu() for g, _, _ in want_step])
            whole = float((got - want).norm() / want.norm())
            return whole <= FP32_WHOLE and float(torch.nn.functional.cosine_similarity(got, want, 0)) >= FP32_COSINE

        cpu, dev = train("cpu", replay), train(device, replay, "bf16")
        assert len(dev.applied) == len(cpu.applied) == len(batches)
        lr = cpu.param_groups[0]["lr"]
        for u, (cpu_step, dev_step) in enumerate(zip(cpu.applied, dev.applied)):
            assert near(dev_step, cpu_step), f"update {u}: the bf16 trainer's gradient is not the fp32 trainer's"
            assert max(float((a - b).abs().max()) for a, b in zip(cpu.after[u], dev.after[u])) <= 2 * lr * (u + 1)
        return
    cpu, dev = train("cpu", replay), train(device, replay)
    # one applied gradient and one set of weights per batch, for every parameter (zip below stops at the shorter)
    n_params = len(weights)
    for opt in (cpu, dev):
        assert len(opt.after) == len(opt.applied) == len(batches)
        assert all(len(step) == n_params for step in (*opt.after, *opt.applied))
    # the gradient handed over at each update is the CPU trainer's, up to the device's rounding; the weights then
    # stay within Adam's reach of the CPU's: Adam moves a weight by about lr a step whatever its gradient's size,
    # so an entry whose gradient is near 0 can step the other way when rounding (TF32 on CUDA) flips its sign
    lr = cpu.param_groups[0]["lr"]
    for u, (cpu_step, dev_step) in enumerate(zip(cpu.applied, dev.applied)):
        for i, ((g_cpu, _, _), (g_dev, _, _)) in enumerate(zip(cpu_step, dev_step)):
            assert close(g_dev, g_cpu, device), f"update {u}, parameter {i}: not the CPU trainer's gradient"
        for i, (a, b) in enumerate(zip(cpu.after[u], dev.after[u])):
            reach = 1e-5 if torch.device(device).type == "cpu" else 2 * lr * (u + 1)
            assert float((a - b).abs().max()) <= reach, f"update {u}, parameter {i}: weights apart"
    if replay:
        fresh = train("cpu", False)
        for u, (replayed_step, fresh_step) in enumerate(zip(dev.applied, fresh.applied)):
            for i, ((replayed, _, _), (ran, _, _)) in enumerate(zip(replayed_step, fresh_step)):
                assert close(replayed, ran, device), f"update {u}, parameter {i}: not the fresh forward's gradient"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda), "cpu"])
def test_a_ga3c_predictor_on_its_device_acts_and_saves_activations_as_the_cpu_model(device):
    """A predictor on ``device`` with a private channels-last copy (as the server builds it) answers as the shared
    model stepping each slot alone on the CPU; with ``save_activations`` (``--replay-activations``)
    its segments carry, on its device, each frame's conv activations: the block inputs and outputs that model
    computes, and max-pool indices that pick a maximum of each window."""
    import torch.nn.functional as F

    from ga3c.buffers import EnvSlots
    from ga3c.predictor import Predictor, SlotStates
    from ga3c.segment import conv_blocks
    from model import A3Clstm, ActivationCache

    use_device(torch.device(device))  # as the GA3C server process does before it builds its predictors
    torch.manual_seed(0)
    shared = A3Clstm(1, 6, 32)
    n, num_steps = 3, 4
    buffers, segments = EnvSlots(n), []
    private = A3Clstm(1, 6, 32).channels_last().to(device).eval()
    pred = Predictor(private, buffers, range(n), SlotStates(n, 32, device), num_steps=num_steps, predict_batch=n,
                     device=device, source=shared, greedy=True, sink=segments.append, save_activations=True)
    g = torch.Generator().manual_seed(1)
    ref = {s: shared.initial_state() for s in range(n)}
    for t in range(num_steps + 1):  # the last requests carry the outcomes that close the segments
        frames = {s: torch.rand(1, 80, 80, generator=g) for s in range(n)}  # random: no ties in the max-pools
        for s in range(n):
            buffers.submit(s, frames[s], episode_start=t == 0, reward=0.25 * s)
        batch = pred.step()
        assert batch.slots.tolist() == list(range(n))
        for j, s in enumerate(batch.slots.tolist()):
            with torch.no_grad():
                v, lg, ref[s] = shared(frames[s].unsqueeze(0), ref[s])
            assert close(batch.values[j], v.view(()), device) and close(batch.logits[j], lg[0], device)
            action = int(buffers.action[s])
            assert lg[0, action] >= lg.max() - 1e-2 * lg.abs().max()  # greedy (up to a near-tie)
    assert sorted(seg.slot for seg in segments) == list(range(n))
    convs = shared.convs()
    for seg in segments:
        assert len(seg) == num_steps and seg.acts is not None
        assert all(a.device.type == torch.device(device).type for a in seg.acts)
        assert torch.equal(seg.acts[0].cpu(), seg.frames)  # the first block's input is the frame
        cache = ActivationCache()
        with torch.no_grad():
            shared.features(seg.frames, cache)
        (want,) = cache.steps
        for k, ((x, indices, out), (_, _, want_out)) in enumerate(zip(conv_blocks(seg.acts), want)):
            assert close(out, want_out, device), f"block {k}: output"
            with torch.no_grad():
                pre = convs[k](x.float().cpu())  # the block's conv output on the CPU, from the saved input
            picked = pre.flatten(2).gather(2, indices.cpu().flatten(2)).view_as(out)
            assert close(F.relu(picked), F.relu(F.max_pool2d(pre, 2, 2)), device), f"block {k}: max-pool indices"
            assert close(F.relu(picked), out, device), f"block {k}: output and indices disagree"


@cuda
def test_main_in_ga3c_mode(tmp_path):
    gpus = ["0", "1"] if torch.cuda.device_count() > 1 else ["0"]
    r = run_entry("main.py", "--mode", "ga3c", "--agents", "2", "--envs-per-agent", "4", "--gpu-ids", *gpus,
                  "--max-steps", "600", "--test-every-steps", "300", "--log-dir", str(tmp_path / "logs"),
                  "--save-model-dir", str(tmp_path / "models"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = torch.load(tmp_path / "models/PongNoFrameskip-v4.ckpt", weights_only=True)
    assert ckpt["global_steps"] >= 600 and ckpt["ga3c_updates"] > 0
    assert all(v.device.type == "cpu" for v in ckpt["model"].values())


@cuda
def test_main_on_a_local_ray_cluster_with_a_gpu(tmp_path):
    """``--ray-address local --gpu-ids 0``: the cluster gets the GPUs Ray finds on this machine, the node trains on
    its GPU, the driver's monitor plays on the CPU; the run ends at its budget with its files written."""
    pytest.importorskip("ray", reason="needs Ray: pip install -r requirements-ray.txt")
    r = run_entry("main.py", "--ray-address", "local", "--nodes", "1", "--workers", "1", "--gpu-ids", "0",
                  "--sync-seconds", "1", "--max-steps", "300", "--test-every-steps", "150",
                  "--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models"), cwd=tmp_path,
                  timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = torch.load(tmp_path / "models/PongNoFrameskip-v4.ckpt", weights_only=True)
    assert ckpt["global_steps"] >= 300
    assert all(v.device.type == "cpu" for v in ckpt["model"].values())

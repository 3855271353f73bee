"""A3G mode on CUDA (skipped without a GPU): workers on the GPU, the shared model and optimizer state on the CPU."""
import multiprocessing as mp

import pytest
import torch

from conftest import run_entry, ROOT

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_worker_on_gpu_updates_cpu_shared_model(tmp_path):
    from config import build_parser
    from model import A3Clstm
    from run_state import RunState
    from shared_optim import SharedAdam
    from train import run_worker

    args = build_parser().parse_args(["--workers", "1", "--max-steps", "0", "--gpu-ids", "0",
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    args.env_config = str(ROOT / "config.json")
    shared = A3Clstm(1, 6)
    shared.share_memory()
    before = [p.detach().clone() for p in shared.parameters()]
    opt = SharedAdam(shared.parameters(), lr=1e-3)
    run = RunState(mp.get_context("spawn"), 1)
    assert run_worker(0, args, shared, opt, run, torch.device("cuda", 0), max_updates=3) == 3
    assert all(p.device.type == "cpu" and p.is_shared() for p in shared.parameters())
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, shared.parameters()))


@cuda
def test_main_in_a3g_mode(tmp_path):
    r = run_entry("main.py", "--workers", "2", "--gpu-ids", "0", "--max-steps", "400", "--test-every-steps", "200",
                  "--log-dir", str(tmp_path / "logs"), "--save-model-dir", str(tmp_path / "models"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    sd = torch.load(tmp_path / "models/PongNoFrameskip-v4.dat", weights_only=True)
    assert all(v.device.type == "cpu" for v in sd.values())


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

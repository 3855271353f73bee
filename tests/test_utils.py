"""Process-level helpers in utils.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A worker's cycle: act 20 steps saving the conv activations, then the update's backward; 10 cycles to warm up,
# then prints the page faults of the next 10.
_PROBE = """
import resource, sys, torch
from model import A3Clstm, ActivationCache
from utils import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.set_num_threads(1)
torch.manual_seed(0)
model = A3Clstm(1, 6).channels_last()
frames = torch.randn(20, 1, 80, 80)
state = model.initial_state()
def cycle():
    cache = ActivationCache()
    with torch.no_grad():
        hx, cx = state
        for t in range(20):
            _, _, (hx, cx) = model(frames[t: t + 1], (hx, cx), cache)
    values, logits = model.unroll(frames, state, cache)
    model.zero_grad(set_to_none=True)
    (values.sum() + logits.sum()).backward()
for _ in range(10):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    """The probe's page faults, with glibc's mmap threshold fixed at its default 128 KiB.

    glibc's own default is no fixed baseline: its threshold is dynamic (after the first mapped block is freed,
    blocks up to that size come from the heap), and whether the heap's top is then trimmed, and faulted in again
    the next cycle, depends on the heap's layout, which address-space randomisation changes from one process to
    the next: 3 to 49,000 faults over the 10 cycles here (glibc 2.36), so a bound on it failed now and then. Set
    in the environment, the threshold is static: every large block is mapped and unmapped each cycle. In "keep"
    mode ``keep_freed_memory``'s own settings replace it, as they replace the dynamic one in a worker."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], env=env)
    return int(out.stdout.strip())


@pytest.mark.slow  # 6 s of page-fault counting; the settings themselves are tested above in the default suite
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc setting")
def test_keep_freed_memory_reuses_large_blocks_instead_of_faulting_them_in_again():
    default, kept = _page_faults("default"), _page_faults("keep")
    assert default > 10 * 2000, default  # each cycle maps its large blocks afresh and faults them in
    assert kept < default / 10, (default, kept)


def test_use_device_makes_float32_work_on_cuda_run_in_float32():
    """cuDNN allows TF32 in convolutions and LSTMs by default; every process that computes on a device calls
    ``use_device`` first, which turns TF32 off (the flags only act on CUDA, so a CPU device sets them too)."""
    import torch

    from utils import use_device

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        use_device(torch.device("cpu"))
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_use_device_sets_an_indexed_cuda_device_and_takes_plain_cuda_as_the_current_one(monkeypatch):
    """``torch.cuda.set_device(torch.device("cuda"))`` raises ValueError (no index), which made the GA3C GPU tests
    that pass ``"cuda"`` fail on a real GPU while their CPU cases passed; an indexed device is made current."""
    import torch

    from utils import use_device
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        use_device(torch.device("cuda"))
        use_device(torch.device("cuda", 1))
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    assert calls == [torch.device("cuda", 1)]


def test_compact_json_writes_flat_lists_on_one_line_and_loads_back_the_same():
    from utils import compact_json
    obj = {"scores": [21.0, -3.5, None], "points": [[1, 2], []], "protocol": {"frameskip": [2, 5], "sticky": 0.25},
           "games": [{"seed": 1}], "empty": {}, "name": "ALE/Pong-v5", "ok": True}
    assert compact_json(obj) == (
        '{\n'
        '  "scores": [21.0, -3.5, null],\n'
        '  "points": [\n'
        '    [1, 2],\n'
        '    []\n'
        '  ],\n'
        '  "protocol": {\n'
        '    "frameskip": [2, 5],\n'
        '    "sticky": 0.25\n'
        '  },\n'
        '  "games": [\n'
        '    {\n'
        '      "seed": 1\n'
        '    }\n'
        '  ],\n'
        '  "empty": {},\n'
        '  "name": "ALE/Pong-v5",\n'
        '  "ok": true\n'
        '}')
    assert json.loads(compact_json(obj)) == json.loads(json.dumps(obj))
    with pytest.raises(TypeError):
        compact_json({1: "a key that is not a string"})


def test_every_evaluation_json_reads_the_same_written_compactly():
    """Every evaluation kept in results/ is in the format gym_eval.py writes, and that format loads back the data."""
    from utils import compact_json
    paths = sorted((Path(__file__).resolve().parents[1] / "results").glob("*eval*.json"))
    assert len(paths) >= 40
    for path in paths:
        data = json.loads(path.read_text())
        assert data and json.loads(compact_json(data)) == data, path.name
        assert path.read_text() == compact_json(data) + "\n", f"{path.name} is not in gym_eval.py's format"

"""Shared fixtures: the repository root, a fast A3C flag set, and helpers to run entry points as subprocesses."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

torch.set_num_threads(1)


def run_entry(script: str, *args: str, cwd: Path, timeout: float = 240, env_extra: dict | None = None,
              ) -> subprocess.CompletedProcess:
    """Run ``python <repo>/<script> args...`` in ``cwd`` and return the completed process (text output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def deny_below(monkeypatch, folder: Path) -> None:
    """Every ``stat`` of a path below ``folder`` fails with EACCES, as for a user who may not enter ``folder`` (the
    tests run as root, whom the kernel never refuses). ``Path.exists``/``is_dir``/``is_file`` raise it on 3.11."""
    real = Path.stat

    def stat(self, *a, **k):
        if Path(os.path.abspath(self)).is_relative_to(folder) and Path(os.path.abspath(self)) != folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "stat", stat)


def relative_difference(a, b) -> float:
    """``max |a - b| / max |b|``."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def whole_gradient_difference(params, ref_params) -> float:
    """``|g - g_ref| / |g_ref|`` over all the parameters' gradients as one vector."""
    g = torch.cat([p.grad.flatten() for p in params])
    r = torch.cat([p.grad.flatten() for p in ref_params])
    return ((g - r).norm() / r.norm().clamp(min=1e-30)).item()


def always_noop_model(n_actions: int, hidden: int = 16, action: int = 0):
    """Greedy ``action`` (by default 0, NOOP, which never relaunches Breakout's ball) and an LSTM state that grows
    from zero."""
    from model import A3Clstm
    m = A3Clstm(1, n_actions, hidden)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.lstm.bias_ih[2 * hidden: 3 * hidden] = 1.0  # g = tanh(1): the cell state, hence hx, becomes non-zero
        m.actor_linear.bias[action] = 5.0
    return m


@pytest.fixture(autouse=True)
def no_main_pid_left_behind():
    """A test that builds part of a run in this process (a Ray ``HogwildNode``, ``benchmark.run``) marks pytest as
    the main process of what it starts (``lifeline.mark_children`` sets ``A3G_MAIN_PID``). Left set, every process
    a later test starts would take pytest for its main process (and main.py would bind to it), so it is put back
    as it was after each test."""
    before = os.environ.get("A3G_MAIN_PID")
    yield
    if before is None:
        os.environ.pop("A3G_MAIN_PID", None)
    else:
        os.environ["A3G_MAIN_PID"] = before


@pytest.fixture
def env_config() -> str:
    return str(ROOT / "config.json")


@pytest.fixture(scope="session")
def shipped_pong_game(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """One game of the shipped Pong model through ``gym_eval.py`` (seed 1, fp32, ``--json``): the finished process
    and its JSON summary, read by every test that needs a real game of it."""
    import json
    d = tmp_path_factory.mktemp("shipped_pong")
    shipped = ROOT / "trained_models" / "PongNoFrameskip-v4.dat"
    r = run_entry("gym_eval.py", "--env", "PongNoFrameskip-v4", "--model-file", str(shipped), "--num-episodes", "1",
                  "--seed", "1", "--log-dir", str(d / "logs"), "--json", str(d / "s.json"), cwd=d, timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    return r, json.loads((d / "s.json").read_text())


def assert_same_optimizer_state(optimizer: torch.optim.Optimizer, params, reference: torch.optim.Optimizer,
                                ref_params, names) -> None:
    """Every statistic the optimizer keeps (Adam's moments and AMSGrad's running maximum, RMSprop's square
    average, the step count) equals the reference ``torch.optim`` one's, parameter by parameter: after a few
    steps AMSGrad moves the weights exactly as Adam does, so only its state tells them apart."""
    for name, p, q in zip(names, params, ref_params):
        mine, ref = optimizer.state[p], reference.state[q]
        assert sorted(mine) == sorted(ref), f"{name}: optimizer state {sorted(mine)}, reference {sorted(ref)}"
        for key in ref:
            a, b = mine[key].float(), ref[key].float()
            # float32 rounding of two gradient computations: ~1e-5 of the largest entry
            assert (a - b).abs().max() <= 1e-3 * b.abs().max() + 1e-12, f"{name}: {key} differs from the reference"


def segments_reference_backward(model, segments, *, is_clip, gamma, tau, entropy_coef, value_coef,
                                pass_clip=None) -> float:
    """GA3C's reference gradient: the repo's A3C one segment at a time (upstream's batch-1 ``A3Clstm.forward`` at
    every step from the segment's initial LSTM state, then ``ga3c.batch_losses.segment_loss``: ``losses.a3c_loss``,
    with the importance-weighted policy term for ``is_clip``, the clipped surrogate for ``pass_clip``); the
    gradients accumulate over the segments in ``model``'s ``.grad`` (zeroed first). Returns the summed loss."""
    from ga3c.batch_losses import segment_loss
    model.zero_grad(set_to_none=True)
    total = 0.0
    for s in segments:
        hx, cx = s.state
        values, logits = [], []
        for i in range(len(s)):
            v, lg, (hx, cx) = model(s.frames[i: i + 1], (hx, cx))
            values.append(v.view(1))
            logits.append(lg)
        loss = segment_loss(torch.cat(logits), torch.cat(values), s.actions, s.rewards, s.bootstrap, mu=s.mu,
                            is_clip=is_clip, gamma=gamma, tau=tau, entropy_coef=entropy_coef, value_coef=value_coef,
                            greedy=s.greedy, pass_clip=pass_clip)
        loss.total.backward()
        total += loss.total.item()
    return total


def collect_batch(predictor, stepper, segments, size: int, tries: int = 500) -> list:
    """Step the predictor and the agent in this thread (the same calls as their loops, in a fixed order) until
    ``size`` closed segments are taken from the ``segments`` queue; asserts they came."""
    batch = []
    for _ in range(tries):
        predictor.step()
        stepper.poll()
        while not segments.empty() and len(batch) < size:
            batch.append(segments.get_nowait())
        if len(batch) == size:
            break
    assert len(batch) == size, "the predictor closed no segments"
    return batch


def processes_left(sid: int, seconds: float = 10.0) -> list:
    """The processes of session ``sid`` still alive after waiting up to ``seconds`` for them to end
    (multiprocessing's resource tracker ends on its own, shortly after the last process holding its pipe)."""
    deadline = time.time() + seconds
    while session_processes(sid) and time.time() < deadline:
        time.sleep(0.2)
    return session_processes(sid)


def kill_session(proc) -> None:
    """SIGKILL to the process group of ``proc`` (started with ``start_new_session=True``), then reap it."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def session_processes(sid: int) -> list:
    """The live processes of session ``sid`` (zombies, already ended, are left out)."""
    import psutil
    out = []
    for q in psutil.process_iter(["status"]):
        try:
            if os.getsid(q.pid) == sid and q.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(q)
        except (ProcessLookupError, PermissionError):
            pass
    return out

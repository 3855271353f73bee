"""Shared fixtures: the repository root, a fast A3C flag set, and helpers to run entry points as subprocesses."""
from __future__ import annotations

import os
import subprocess
import sys
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


def always_noop_model(n_actions: int, hidden: int = 16):
    """Greedy action 0 (NOOP, which never relaunches Breakout's ball) and an LSTM state that grows from zero."""
    from model import A3Clstm
    m = A3Clstm(1, n_actions, hidden)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.lstm.bias_ih[2 * hidden: 3 * hidden] = 1.0  # g = tanh(1): the cell state, hence hx, becomes non-zero
        m.actor_linear.bias[0] = 5.0
    return m


@pytest.fixture
def env_config() -> str:
    return str(ROOT / "config.json")

"""Eager against ``torch.compile`` on the batch-1 acting forward of ``A3Clstm`` (no gradient, one thread).

The two are timed in alternated rounds in one process, and the medians are compared, so that the noise of a
shared machine hits both alike. Prints the compile time, the largest logit difference, and the two step costs.

    python benchmarks/compile_forward.py                       # inductor, default mode
    python benchmarks/compile_forward.py --mode max-autotune-no-cudagraphs
    python benchmarks/compile_forward.py --freezing            # weights baked in as constants (a fixed model only)

Needs a C++ compiler for inductor's CPU kernels.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import A3Clstm  # noqa: E402


def step_ms(forward, x: torch.Tensor, state, steps: int) -> float:
    hx, cx = state
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(steps):
            _, _, (hx, cx) = forward(x, (hx, cx))
        return (time.perf_counter() - start) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's default)")
    p.add_argument("--freezing", action="store_true", help="inductor freezing: weights become constants")
    p.add_argument("--steps", type=int, default=200, help="forwards per timed round")
    p.add_argument("--rounds", type=int, default=7, help="alternated rounds (median reported)")
    p.add_argument("--hidden-size", type=int, default=512)
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if opts.freezing:
        import torch._inductor.config as inductor_config
        inductor_config.freezing = True
    model = A3Clstm(1, 6, opts.hidden_size).channels_last().eval()
    x = torch.randn(1, 1, 80, 80)
    state = model.initial_state(1, torch.device("cpu"))
    start = time.perf_counter()
    compiled = torch.compile(model, mode=opts.mode)
    with torch.no_grad():
        for _ in range(3):
            compiled(x, state)
        compile_s = time.perf_counter() - start
        diff = (compiled(x, state)[1] - model(x, state)[1]).abs().max().item()
    eager, comp = [], []
    for _ in range(opts.rounds):
        eager.append(step_ms(model, x, state, opts.steps))
        comp.append(step_ms(compiled, x, state, opts.steps))
    e, c = statistics.median(eager), statistics.median(comp)
    print(f"torch {torch.__version__}, mode {opts.mode or 'default'}, freezing {opts.freezing}: "
          f"compile {compile_s:.1f} s, max |logit difference| {diff:.2e}")
    print(f"acting forward per step: eager {e:.3f} ms, compiled {c:.3f} ms, eager/compiled {e / c:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

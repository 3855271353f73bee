"""The hogwild plumbing across a real spawned process: on every update, the gradient the shared optimizer applies
is the worker's fresh gradient of that update (upstream's torch 2.x defect re-applied the first one forever)."""
import multiprocessing as mp

import torch

from model import A3Clstm
from player_util import GradientHandoff, sync_weights


def _worker(shared, updates, queue, go, ready):
    torch.manual_seed(123)
    torch.set_num_threads(1)
    local = A3Clstm(1, 6, 32).channels_last()
    handoff = GradientHandoff(local, shared)
    opt = torch.optim.SGD(shared.parameters(), lr=1.0)  # the step is exactly -grad
    for u in range(updates):
        go.wait()
        go.clear()
        sync_weights(local, shared)
        x = torch.randn(3, 1, 80, 80)
        values, logits = local.unroll(x, local.initial_state())
        loss = values.pow(2).sum() + logits.logsumexp(1).sum() * (u + 1)
        local.zero_grad(set_to_none=True)
        loss.backward()
        handoff()
        same = all(sp.grad is not None and torch.equal(sp.grad, lp.grad)
                   for lp, sp in zip(local.parameters(), shared.parameters()))
        queue.put((u, same, [lp.grad.numpy().copy() for lp in local.parameters()]))  # by value
        opt.step()
        ready.set()


def test_every_update_applies_the_fresh_gradient():
    ctx = mp.get_context("spawn")
    shared = A3Clstm(1, 6, 32)
    shared.share_memory()
    queue, go, ready = ctx.Queue(), ctx.Event(), ctx.Event()
    updates = 4
    p = ctx.Process(target=_worker, args=(shared, updates, queue, go, ready))
    p.start()
    try:
        previous_grads = None
        for u in range(updates):
            before = [q.detach().clone() for q in shared.parameters()]
            ready.clear()
            go.set()
            n, same, grads = queue.get(timeout=120)
            grads = [torch.from_numpy(g) for g in grads]
            assert ready.wait(120)
            assert n == u and same, f"update {u}: the shared gradient is not the worker's gradient"
            for q, b, g in zip(shared.parameters(), before, grads):
                # the parent's shared weights moved by exactly this update's gradient
                assert torch.allclose(q.detach() - b, -g, atol=1e-5), f"update {u} applied another gradient"
            if previous_grads is not None:
                assert any(not torch.allclose(g, h) for g, h in zip(grads, previous_grads))
            previous_grads = grads
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0

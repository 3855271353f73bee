"""The arithmetic of a multi-node run, as pure functions over state dicts (name -> tensor).

A node keeps ``base``, the global weights it last received. Every ``--sync-seconds`` it:

1. takes ``sent = live`` (a copy of its shared model now) and ``change = sent - base``: the sum of every update
   its workers made since the last sync;
2. sends ``change``; the parameter server applies ``global += scale * change`` and answers with ``global``
   (``--merge sum``: scale 1, every update counts once, as the updates of the workers of one machine do in
   hogwild; ``--merge average``: scale 1/nodes, so that nodes that all sync from the same global weights end at
   the average of their models);
3. moves its live weights by ``global - sent``, in place: the updates its workers made while the message was on
   its way stay, on top of the new global weights;
4. sets ``base = global``.

So what crosses the network per sync and node is one change up and one set of weights down, each the size of the
model (13.0 MB in fp32 for the Atari model); ``sync_traffic`` and ``scale_row`` turn that into bandwidth.
"""
from __future__ import annotations

import math

import torch

MERGE_MODES = ("sum", "average")


def merge_scale(mode: str, nodes: int) -> float:
    """The factor by which the parameter server applies a node's change."""
    if mode == "sum":
        return 1.0
    if mode == "average":
        return 1.0 / nodes
    raise ValueError(f"unknown merge mode {mode!r}; expected one of {MERGE_MODES}")


def clone_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in weights.items()}


def weight_change(live: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``live - base`` per tensor (a new dict; neither input changes)."""
    if live.keys() != base.keys():
        raise ValueError(f"the weights do not match: {sorted(set(live) ^ set(base))}")
    return {k: live[k].detach() - base[k] for k in live}


def apply_change(global_weights: dict[str, torch.Tensor], change: dict[str, torch.Tensor], scale: float) -> None:
    """``global += scale * change``, in place."""
    for k, g in global_weights.items():
        g.add_(change[k].to(g.dtype), alpha=scale)


def rebase(live: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> None:
    """``live += received - sent``, in place: ``live`` becomes ``received`` plus whatever ``live`` gained since
    ``sent`` was taken from it."""
    for k, v in live.items():
        v.add_(received[k].to(v.dtype) - sent[k].to(v.dtype))


def weight_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def sync_traffic(model_bytes: int, sync_seconds: float) -> float:
    """Bytes per second one node sends plus receives: a change up and the weights down every sync."""
    return 2 * model_bytes / sync_seconds


def scale_row(nodes: int, node_rate: float, model_bytes: int, sync_seconds: float, ps_bytes_per_s: float,
              ps_seconds_per_sync: float) -> dict:
    """What ``nodes`` nodes of ``node_rate`` steps/s give, on paper.

    The parameter server is one actor: it serves one sync at a time, each costing ``ps_seconds_per_sync`` of its
    time (measured), and its network link carries ``ps_bytes_per_s``. Its load is the larger of the two
    utilisations; below 1 every node syncs on time and the steps/s add up. Above 1 the syncs queue: each node's
    effective sync period stretches by the load factor (the steps/s still add up, the nodes' models drift further
    apart between syncs), which is where to lengthen ``--sync-seconds``, shard the parameter server, or compress
    the change.
    """
    net = nodes * sync_traffic(model_bytes, sync_seconds)
    net_load = net / ps_bytes_per_s
    cpu_load = nodes * ps_seconds_per_sync / sync_seconds
    load = max(net_load, cpu_load)
    return {
        "nodes": nodes,
        "steps_per_s": nodes * node_rate,
        "ps_traffic_bytes_per_s": net,
        "ps_net_load": net_load,
        "ps_cpu_load": cpu_load,
        "effective_sync_seconds": sync_seconds * max(1.0, load),
        "saturated": load >= 1.0,
    }


def max_nodes(model_bytes: int, sync_seconds: float, ps_bytes_per_s: float, ps_seconds_per_sync: float) -> int:
    """The most nodes one parameter server serves without a queue (load < 1)."""
    per_node = max(sync_traffic(model_bytes, sync_seconds) / ps_bytes_per_s, ps_seconds_per_sync / sync_seconds)
    return max(0, math.ceil(1.0 / per_node) - 1)

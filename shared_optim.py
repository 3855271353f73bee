"""Optimizers whose statistics live in shared memory, for hogwild training.

``SharedAdam`` and ``SharedRMSprop`` are ``torch.optim.Adam`` and ``torch.optim.RMSprop`` whose per-parameter state
(``step`` counts included) is created eagerly and moved to shared memory before the workers start. Every worker
process steps the same statistics without locks (A3C's "shared RMSProp", Mnih et al. 2016, section 4). Because
the update arithmetic is torch's own, a shared optimizer equals ``torch.optim`` step for step, up to float
rounding (a fused kernel against ``foreach=False``: about 1e-7; tested).

The defaults are upstream A3G's: Adam eps 1e-3, RMSprop alpha 0.99 and eps 0.1.
"""
from __future__ import annotations

import inspect
from typing import Iterable

import torch


def match_grad_layout(params) -> int:
    """Give every gradient its parameter's memory layout; returns how many had to be copied.

    torch's fused CPU Adam (2.13) reads a gradient's storage as if it had its parameter's strides: a channels-last
    gradient of a contiguous conv weight is applied as a fixed permutation of itself. Workers keep their model
    channels-last and the shared model is contiguous, so without this every conv2-conv4 update was wrong. The
    hand-off already delivers matching layouts (``GradientHandoff``); this guard makes the optimizers correct for
    any caller, at the cost of a stride comparison per parameter.
    """
    copied = 0
    for p in params:
        g = p.grad
        if g is not None and g.stride() != p.stride():
            p.grad = torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)
            copied += 1
    return copied


class _Eager:
    """``torch.optim``'s methods without their ``torch.compile`` guards.

    In torch 2.13, ``Optimizer.step`` and ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict``
    import ``torch._dynamo`` at their first call, to tell the compiler to leave them alone. That import takes about
    2 s of CPU, as long as importing torch itself, in every process that builds, steps or saves an optimizer: the
    main process and each worker or trainer, at every start. Nothing in this project compiles an optimizer, so these
    call the undecorated methods; a step runs with autograd off, as the guard would (``differentiable`` is never
    set here)."""

    def add_param_group(self, param_group: dict) -> None:
        inspect.unwrap(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        inspect.unwrap(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict:
        return inspect.unwrap(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict) -> None:
        inspect.unwrap(torch.optim.Optimizer.load_state_dict)(self, state_dict)

    def step(self, closure=None):
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return inspect.unwrap(super().step.__func__)(self, closure)


class _LayoutSafeStep:
    """``step()`` first gives every gradient its parameter's layout (``match_grad_layout``)."""

    def step(self, closure=None):
        match_grad_layout(p for g in self.param_groups for p in g["params"])
        return super().step(closure)


class _SharedStateMixin:
    """Create every state tensor up front and put it in shared memory; load checkpoints in place."""

    def _make_shared_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key, value in self._initial_state(group, p).items():
                    state[key] = value
        self.share_memory()

    def share_memory(self) -> "_SharedStateMixin":
        for state in self.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.share_memory_()
        return self

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a saved state's statistics into the existing shared tensors (the base class would replace them
        with private ones, silently un-sharing the statistics).

        The hyperparameters (``lr``, ``betas``, ``eps``, ``amsgrad``, ...) stay the ones this optimizer was built
        with, i.e. the command line's: resuming with ``--lr 5e-5`` trains at 5e-5. (``torch.optim`` would restore the
        saved ones, so a changed flag would be silently ignored, and a changed ``amsgrad`` would step without its
        statistics.) ``saved_hyperparameters`` tells what the checkpoint had. The statistics of another optimizer
        (no key but ``step`` in common, e.g. RMSprop's loaded into Adam) raise ``ValueError``: copying only their
        step count would start Adam's moments at 0 without its bias correction."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("optimizer state has a different number of parameter groups")
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in saved_groups for i in g["params"]]
        if len(saved_ids) != len(params):
            raise ValueError("optimizer state has a different number of parameters")
        copies = []  # every parameter is checked before any statistic is copied: a refused state changes nothing
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            own = set(self.state[p]) - {"step"}
            if set(saved) - {"step"} and own and not (set(saved) - {"step"}) & own:
                raise ValueError(f"optimizer state holds another optimizer's statistics "
                                 f"({', '.join(sorted(set(saved) - {'step'}))}; this one keeps "
                                 f"{', '.join(sorted(own))})")
            for key, value in saved.items():
                if key not in self.state[p]:
                    continue
                target = self.state[p][key]
                if target.shape != value.shape:
                    raise ValueError(f"optimizer state '{key}' has shape {tuple(value.shape)}, "
                                     f"expected {tuple(target.shape)}")
                copies.append((target, value))
        with torch.no_grad():
            for target, value in copies:
                target.copy_(value)

    @staticmethod
    def saved_hyperparameters(state_dict: dict) -> list[dict]:
        """Each saved parameter group's hyperparameters (everything but the parameter ids)."""
        return [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]


class SharedAdam(_LayoutSafeStep, _SharedStateMixin, _Eager, torch.optim.Adam):
    """Adam (optionally AMSGrad) with shared ``step``, ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-4, betas=(0.9, 0.999),
                 eps: float = 1e-3, weight_decay: float = 0.0, amsgrad: bool = False):
        # fused: one vectorised kernel over all parameters, ~5x faster than the per-tensor loop on CPU
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=True)
        self._make_shared_state()

    @staticmethod
    def _initial_state(group: dict, p: torch.Tensor) -> dict:
        state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p)
        return state


class SharedRMSprop(_LayoutSafeStep, _SharedStateMixin, _Eager, torch.optim.RMSprop):
    """RMSprop with shared ``step`` and ``square_avg`` (and ``momentum_buffer`` / ``grad_avg`` when used)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 7e-4, alpha: float = 0.99,
                 eps: float = 0.1, weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False):
        # foreach: multi-tensor kernels, ~3x faster than the per-tensor loop (RMSprop has no fused kernel)
        super().__init__(params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                         centered=centered, foreach=True)
        self._make_shared_state()

    @staticmethod
    def _initial_state(group: dict, p: torch.Tensor) -> dict:
        state = {"step": torch.tensor(0.0), "square_avg": torch.zeros_like(p)}
        if group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros_like(p)
        if group["centered"]:
            state["grad_avg"] = torch.zeros_like(p)
        return state


class Adam(_LayoutSafeStep, _Eager, torch.optim.Adam):
    """``torch.optim.Adam`` (fused) whose step first gives every gradient its parameter's layout."""


class RMSprop(_LayoutSafeStep, _Eager, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` (foreach) whose step first gives every gradient its parameter's layout."""


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Give every parameter group of ``optimizer`` the learning rate ``lr``. The groups are per process: a worker or
    trainer sets its own copy's before each step; the statistics stay shared, and the main process's copy (the one
    checkpoints save) keeps ``--lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


DEFAULT_EPS = {"Adam": 1e-3, "RMSprop": 0.1}  # upstream A3G's


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, amsgrad: bool = False,
                   shared: bool = True, eps: float | None = None) -> torch.optim.Optimizer:
    """``SharedAdam``/``SharedRMSprop`` when ``shared``, else a private ``torch.optim`` one with the same settings
    (each worker keeps its own statistics, upstream's ``--shared-optimizer False``). ``eps`` is the term added to
    the root of the second moment (``--optimizer-eps``); None gives upstream's, ``DEFAULT_EPS``."""
    if name not in DEFAULT_EPS:
        raise ValueError(f"unknown optimizer '{name}' (use Adam or RMSprop)")
    eps = DEFAULT_EPS[name] if eps is None else eps
    if name == "Adam":
        if shared:
            return SharedAdam(params, lr=lr, eps=eps, amsgrad=amsgrad)
        return Adam(params, lr=lr, eps=eps, amsgrad=amsgrad, fused=True)
    if shared:
        return SharedRMSprop(params, lr=lr, eps=eps)
    return RMSprop(params, lr=lr, alpha=0.99, eps=eps, foreach=True)

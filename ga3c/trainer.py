"""The trainer: batches of segments from many env slots, one batched forward/backward, one optimizer step.

``assemble`` concatenates B segments (lengths ``L_b <= num_steps``, shorter where an episode ended inside one)
into flat segment-major tensors: no frame is padded, so the conv stack runs once, batched over exactly the
``sum L_b`` real frames. ``batched_unroll`` then scatters the conv features into a zero-padded ``(B, T, 1024)``
and runs the LSTM over T as one sequence op (``torch.lstm``, as ``A3Clstm.unroll`` does) from each segment's own
initial state; outputs after a segment's end are never read, so they receive no gradient and the padding changes
nothing (the LSTM is causal). The heads run on the ``sum L_b`` real steps, and ``batch_losses.batched_a3c_loss``
gives the sum of the per-segment A3C losses. Its gradient equals the sum of the per-segment gradients of
``A3Clstm`` + ``losses.a3c_loss`` (tested, with and without importance weights).

``Trainer`` keeps a private working copy of the model (channels-last on request: faster convolutions), copies the
shared weights into it before each batch, and hands its gradients to the shared model explicitly on every update
(``player_util.GradientHandoff``: it assigns or copies them in the shared parameter's layout, which the fused Adam
needs; see ``shared_optim.match_grad_layout``). Why a copy and not the shared model itself: several trainers
(threads) update one model; a shared parameter modified in place by another trainer's step between this one's
forward and backward would break autograd, and ``.grad`` of a shared parameter is one attribute per process.
So the forward and backward run in parallel on private copies, and only the hand-off and the optimizer step
(milliseconds) hold ``step_lock``, an in-process ``threading.Lock`` (a thread that fails releases it; no
cross-process lock is involved).

Policy lag: each update records, per batch, the mean and max over steps of ``version now - version that acted``.
"""
from __future__ import annotations

import contextlib
import queue
from dataclasses import dataclass

import torch

from ga3c.batch_losses import batched_a3c_loss, flat_index, padded
from ga3c.segment import ACT_FIELDS, Segment, cat_rows, conv_blocks
from ga3c.settings import Ga3cSettings
from losses import A3CLoss
from model import A3Clstm, _Replay
from precision import compute_dtype
from player_util import GradientHandoff, sync_weights


@dataclass
class Batch:
    """B segments, flat and segment-major: ``frames (S, 1, 80, 80)``, ``actions``, ``rewards``, ``mu``,
    ``versions (S,)``; per segment ``lengths``, ``bootstrap (B,)`` and the initial LSTM state ``hx, cx (B, H)``."""

    frames: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    mu: torch.Tensor
    versions: torch.Tensor
    lengths: torch.Tensor
    bootstrap: torch.Tensor
    hx: torch.Tensor
    cx: torch.Tensor
    acts: list[torch.Tensor] | None = None  # the saved conv activations (segment.ACT_FIELDS), when every segment has them

    @property
    def num_segments(self) -> int:
        return int(self.lengths.numel())

    @property
    def num_steps(self) -> int:
        return int(self.actions.numel())


def assemble(segments: list[Segment], device: torch.device | str = "cpu") -> Batch:
    """Concatenate ``segments`` into a ``Batch`` on ``device``."""
    if not segments:
        raise ValueError("cannot assemble an empty batch")

    def cat(name):
        return torch.cat([getattr(s, name) for s in segments]).to(device)

    return Batch(
        frames=cat("frames"), actions=cat("actions"), rewards=cat("rewards"), mu=cat("mu"),
        versions=cat("versions"),
        lengths=torch.tensor([len(s) for s in segments], dtype=torch.int64),
        bootstrap=torch.tensor([s.bootstrap for s in segments], dtype=torch.float32, device=device),
        hx=torch.cat([s.state[0] for s in segments]).to(device),
        cx=torch.cat([s.state[1] for s in segments]).to(device),
        acts=([cat_rows([s.acts[i] for s in segments]).to(device) for i in range(len(ACT_FIELDS))]
              if all(s.acts is not None for s in segments) else None),
    )


def batched_unroll(model: A3Clstm, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``values (S,)``, ``logits (S, A)`` of every step of every segment (see the module docstring); equal to
    stepping each segment through ``A3Clstm.forward`` from its initial state, gradients included (tested).

    With ``batch.acts`` (``--replay-activations``) the convolutions do not run again: the features are the ones
    the predictor computed, and the conv gradients come from its saved activations (``model._Replay``, as an
    A3G worker's update). They are then the gradients at the weights that acted on each frame, up to the policy
    lag; with no lag, exactly those of a fresh forward (tested)."""
    index = flat_index(batch.lengths)
    if batch.acts is None:
        feats = model.features(batch.frames)
    else:  # the conv features the predictor computed; backward runs the conv blocks' backward from its activations
        convs = model.convs()
        feats = _Replay.apply(conv_blocks(batch.acts), convs, *[p for c in convs for p in (c.weight, c.bias)])
    x = padded(feats, batch.lengths, index)  # (B, T, 1024)
    lstm = model.lstm
    out, _, _ = torch.lstm(x, (batch.hx.unsqueeze(0), batch.cx.unsqueeze(0)),
                           [lstm.weight_ih, lstm.weight_hh, lstm.bias_ih, lstm.bias_hh],
                           True, 1, 0.0, model.training, False, True)  # batch_first
    b, t = index
    hs = out[b.to(out.device), t.to(out.device)]
    value, logits = model.heads(hs)
    return value.squeeze(1), logits


def batch_loss(model: A3Clstm, batch: Batch, settings: Ga3cSettings) -> tuple[A3CLoss, torch.Tensor | None]:
    """The batch's summed A3C loss (and importance weights when ``settings.is_clip`` is set)."""
    values, logits = batched_unroll(model, batch)
    return batched_a3c_loss(logits, values, batch.actions, batch.rewards, batch.bootstrap, batch.lengths,
                            mu=batch.mu, is_clip=settings.is_clip, gamma=settings.gamma, tau=settings.tau,
                            entropy_coef=settings.entropy_coef, value_coef=settings.value_coef)


@dataclass
class UpdateResult:
    loss: A3CLoss
    grad_norm: float
    steps: int
    segments: int
    lag_mean: float
    lag_max: int
    weight_mean: float | None  # mean importance weight (None without is_clip)


class Trainer:
    """Updates ``shared_model`` with ``optimizer`` (built on its parameters, e.g. ``shared_optim.make_optimizer``)
    from batches of ``settings.train_batch`` segments (see the module docstring).

    ``index`` is this trainer's slot in ``counters`` (``Ga3cCounters``; its ``version`` is the model version).
    """

    def __init__(self, shared_model: A3Clstm, optimizer: torch.optim.Optimizer, settings: Ga3cSettings, *,
                 index: int = 0, counters=None, device: torch.device | str = "cpu", step_lock=None,
                 channels_last: bool = True):
        self.shared = shared_model
        self.optimizer = optimizer
        self.settings = settings
        self.index = index
        self.counters = counters
        self.device = torch.device(device)
        self.step_lock = step_lock if step_lock is not None else contextlib.nullcontext()
        model = A3Clstm(shared_model.conv1.in_channels, shared_model.num_actions, shared_model.hidden_size)
        if channels_last:
            model = model.channels_last()
        self.model = model.to(self.device).set_precision(compute_dtype(settings.compute_precision))
        self.model.train()
        sync_weights(self.model, shared_model)
        self.handoff = GradientHandoff(self.model, shared_model)
        self.updates = 0

    def version(self) -> int:
        return self.counters.version if self.counters is not None else self.updates

    def update(self, segments: list[Segment]) -> UpdateResult:
        """One optimizer step on the shared model from ``segments``."""
        version = self.version()
        sync_weights(self.model, self.shared)
        batch = assemble(segments, self.device)
        loss, w = batch_loss(self.model, batch, self.settings)
        params = [p for p, _ in self.handoff.pairs]
        self.model.zero_grad(set_to_none=True)
        loss.total.backward()
        if self.settings.max_grad_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.settings.max_grad_norm))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        with self.step_lock:
            self.handoff()
            self.optimizer.step()
        self.updates += 1
        lag = (version - batch.versions).to(torch.float64)
        result = UpdateResult(loss, grad_norm, batch.num_steps, batch.num_segments, float(lag.mean()),
                              int(lag.max()), None if w is None else float(w.mean()))
        if self.counters is not None:
            n = result.steps
            self.counters.record_update(self.index, steps=n, segments=result.segments, lag_mean=result.lag_mean,
                                        lag_max=result.lag_max, policy=loss.policy.item() / n,
                                        value=loss.value.item() / n, entropy=loss.entropy.item() / n,
                                        grad_norm=grad_norm, lags=version - batch.versions)
        return result

    def run(self, source: "queue.Queue[Segment]", stop, max_updates: int | None = None,
            poll: float = 0.05) -> int:
        """Take segments from ``source`` and update every ``train_batch`` of them, until ``stop.is_set()`` (or
        ``max_updates``); a partial batch at the stop is dropped. Returns the number of updates made."""
        pending: list[Segment] = []
        done = 0
        while not stop.is_set() and (max_updates is None or done < max_updates):
            try:
                pending.append(source.get(timeout=poll))
            except queue.Empty:
                continue
            if len(pending) >= self.settings.train_batch:
                self.update(pending)
                pending = []
                done += 1
        return done

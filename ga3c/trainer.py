"""The trainer: batches of segments from many env slots, one batched forward/backward, one optimizer step
(``--train-passes K``: K of each per batch; ``--later-passes lstm``: the later ones on the LSTM and heads only).

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
cross-process lock is involved). Inside it each step is marked in the counters' ``StepGate`` (``ga3c.gate``), so
that the main process (a checkpoint) and the monitor (a game's weights) copy the weights, the optimizer
statistics, the moving average and the version of one moment between two steps.

Several passes (``--train-passes K``): ``update`` makes K optimizer steps on one batch, each a fresh copy of the
shared weights, forward and backward (the clipped surrogate, ``batch_losses``). What the passes after the first
train is ``settings.later_passes``:

- ``full``: the whole model. The weights have moved since the first pass, so every frame's convolutions run again
  (forward and backward): each pass costs what the first one does.
- ``lstm``: the LSTM and the two heads only, on the first pass's conv features (detached: computed with the conv
  weights the first pass copied, before its step). Nothing of the conv stack runs again, and the conv parameters
  get no gradient in those passes, so the optimizer leaves them, and their statistics and step counts, alone
  (``torch.optim`` skips a parameter whose ``.grad`` is None): the conv weights take one step per batch, the LSTM
  and the heads K. What runs again is the LSTM, the heads and the loss over the batch's ``sum L_b`` steps, about
  a twentieth of a full pass's FLOPs.

Policy lag: each update records, per batch, the mean and max over steps of ``version now - version that acted``.

Saved activations (``--replay-activations``): the gradient of an update is always the one at the weights the
trainer copied (model version v). A frame acted on by version v has conv activations of these weights (equal up
to float rounding to a second forward, which may batch the frames differently), so its features come from them
and its conv gradients from their replay (``model._Replay``); a frame acted on by any other version has its
features computed again with the weights that train (the ``--no-replay-activations`` path), because replaying
its activations would mix the acting convolutions with the current LSTM, heads and conv weights
(``benchmarks/replay_lag.py`` measures how far that mix is from either gradient). The choice is per frame: a frame's conv features depend on that frame and the conv weights only.
The version is read and the weights copied under ``step_lock``, and the version moves under it with the
optimizer step, so with several trainers the version a trainer compares with is the one of the weights it holds.
"""
from __future__ import annotations

import contextlib
import queue
from dataclasses import dataclass

import torch

from averaging import update_average
from ga3c.batch_losses import batched_a3c_loss, flat_index, padded
from ga3c.gate import NO_GATE
from ga3c.segment import ACT_FIELDS, Segment, cat_rows, conv_blocks
from ga3c.settings import Ga3cSettings
from losses import A3CLoss
from model import A3Clstm, _Replay
from precision import compute_dtype
from player_util import GradientHandoff, sync_weights
from schedules import linear_anneal
from shared_optim import set_lr


@dataclass
class Batch:
    """B segments, flat and segment-major: ``frames (S, 1, 80, 80)``, ``actions``, ``rewards``, ``mu``,
    ``versions (S,)``; per segment ``lengths``, ``bootstrap (B,)`` and the initial LSTM state ``hx, cx (B, H)``;
    ``replay (S,)`` bool: the frames whose saved conv activations are replayed, and ``acts`` those frames' rows
    (``segment.ACT_FIELDS``, in flat order), None when no frame is replayed."""

    frames: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    mu: torch.Tensor
    versions: torch.Tensor
    lengths: torch.Tensor
    bootstrap: torch.Tensor
    hx: torch.Tensor
    cx: torch.Tensor
    replay: torch.Tensor
    acts: list[torch.Tensor] | None = None
    greedy: torch.Tensor | None = None  # (S,) bool: the steps of --greedy-slots segments; None when there are none

    @property
    def num_segments(self) -> int:
        return int(self.lengths.numel())

    @property
    def num_steps(self) -> int:
        return int(self.actions.numel())


def assemble(segments: list[Segment], device: torch.device | str = "cpu", *, version: int | None) -> Batch:
    """Concatenate ``segments`` into a ``Batch`` on ``device``.

    The frames replayed (``Batch.replay``) are those of segments that carry saved activations and, with
    ``version``, were acted on by that model version: the trainer passes the version of the weights it trains, so
    every other frame has its conv features computed again with those weights. ``version=None`` replays every
    saved frame whatever weights acted on it, which is the gradient at the current weights only when they are
    the acting ones (used to measure the mixed gradient, ``benchmarks/replay_lag.py``)."""
    if not segments:
        raise ValueError("cannot assemble an empty batch")

    def cat(name):
        return torch.cat([getattr(s, name) for s in segments]).to(device)

    # per segment, which of its frames are replayed (None: it saved no activations)
    keep = [None if s.acts is None else torch.ones(len(s), dtype=torch.bool) if version is None
            else s.versions == version for s in segments]
    replay = torch.cat([torch.zeros(len(s), dtype=torch.bool) if k is None else k for s, k in zip(segments, keep)])
    acts = None
    if bool(replay.any()):
        rows = [(s.acts, k) for s, k in zip(segments, keep) if k is not None and bool(k.any())]
        acts = [cat_rows([a[i] if bool(k.all()) else a[i][k] for a, k in rows]).to(device)
                for i in range(len(ACT_FIELDS))]
    return Batch(
        frames=cat("frames"), actions=cat("actions"), rewards=cat("rewards"), mu=cat("mu"),
        versions=cat("versions"),
        lengths=torch.tensor([len(s) for s in segments], dtype=torch.int64),
        bootstrap=torch.tensor([s.bootstrap for s in segments], dtype=torch.float32, device=device),
        hx=torch.cat([s.state[0] for s in segments]).to(device),
        cx=torch.cat([s.state[1] for s in segments]).to(device),
        replay=replay.to(device), acts=acts,
        greedy=(torch.cat([torch.full((len(s),), s.greedy, dtype=torch.bool) for s in segments]).to(device)
                if any(s.greedy for s in segments) else None),
    )


def conv_features(model: A3Clstm, batch: Batch) -> torch.Tensor:
    """The conv features ``(S, 1024)`` of every frame, in flat order: from the saved activations for the frames in
    ``batch.replay`` (``model._Replay``: nothing runs forward, backward runs the conv blocks' backward from
    them), from a forward of the encoder (``model.features``, with gradient) for the others."""
    if batch.acts is None:
        return model.features(batch.frames)
    convs = model.convs()
    replayed = _Replay.apply(conv_blocks(batch.acts), convs, *[p for c in convs for p in (c.weight, c.bias)])
    if bool(batch.replay.all()):
        return replayed
    fresh = model.features(batch.frames[~batch.replay])
    # flat position -> row of cat([replayed, fresh]): the k-th replayed frame is row k, the k-th other n_replayed + k
    n = replayed.shape[0]
    rows = torch.where(batch.replay, batch.replay.cumsum(0) - 1, n + (~batch.replay).cumsum(0) - 1)
    return torch.cat([replayed, fresh]).index_select(0, rows)


def batched_unroll(model: A3Clstm, batch: Batch,
                   feats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``values (S,)``, ``logits (S, A)`` of every step of every segment (see the module docstring); equal to
    stepping each segment through ``A3Clstm.forward`` from its initial state, gradients included (tested).

    The conv features come from ``conv_features``: the replayed frames' (``batch.replay``) from the activations
    the predictor saved, the others' from the encoder run again; or they are ``feats`` as given (``(S, 1024)``
    in flat order, e.g. another pass's, detached: then no gradient reaches ``model``'s convs). The LSTM and the
    heads always run with ``model``'s weights. When every replayed frame was acted on by ``model``'s weights
    (``assemble`` with the trainer's version) this is the gradient at ``model``'s weights (tested, with and without
    policy lag)."""
    index = flat_index(batch.lengths)
    if feats is None:
        feats = conv_features(model, batch)
    x = padded(feats, batch.lengths, index)  # (B, T, 1024)
    lstm = model.lstm
    out, _, _ = torch.lstm(x, (batch.hx.unsqueeze(0), batch.cx.unsqueeze(0)),
                           [lstm.weight_ih, lstm.weight_hh, lstm.bias_ih, lstm.bias_hh],
                           True, 1, 0.0, model.training, False, True)  # batch_first
    b, t = index
    hs = out[b.to(out.device), t.to(out.device)]
    value, logits = model.heads(hs)
    return value.squeeze(1), logits


def batch_loss(model: A3Clstm, batch: Batch, settings: Ga3cSettings, entropy_coef: float | None = None,
               feats: torch.Tensor | None = None) -> tuple[A3CLoss, torch.Tensor | None]:
    """The batch's summed A3C loss (and importance weights when ``settings.is_clip`` is set or a segment is a
    greedy slot's; the ratios pi/mu with ``settings.train_passes > 1``); ``entropy_coef``: the entropy bonus
    weight (default ``settings.entropy_coef``); ``feats``: the conv features to use (``batched_unroll``)."""
    values, logits = batched_unroll(model, batch, feats)
    return batched_a3c_loss(logits, values, batch.actions, batch.rewards, batch.bootstrap, batch.lengths,
                            mu=batch.mu, is_clip=settings.is_clip, gamma=settings.gamma, tau=settings.tau,
                            entropy_coef=settings.entropy_coef if entropy_coef is None else entropy_coef,
                            value_coef=settings.value_coef, greedy=batch.greedy,
                            pass_clip=settings.surrogate_clip())


@dataclass
class UpdateResult:
    loss: A3CLoss
    grad_norm: float
    steps: int
    segments: int
    lag_mean: float
    lag_max: int
    weight_mean: float | None  # mean importance weight, or ratio pi/mu with train_passes > 1 (None without any)


class Trainer:
    """Updates ``shared_model`` with ``optimizer`` (built on its parameters, e.g. ``shared_optim.make_optimizer``)
    from batches of ``settings.train_batch`` segments (see the module docstring).

    ``index`` is this trainer's slot in ``counters`` (``Ga3cCounters``; its ``version`` is the model version).
    ``average_model`` (``--ema-steps``): blended with the shared weights once per batch, after its last step (with
    ``--train-passes`` K > 1, after the K-th), under ``step_lock`` (``averaging``).
    """

    def __init__(self, shared_model: A3Clstm, optimizer: torch.optim.Optimizer, settings: Ga3cSettings, *,
                 index: int = 0, counters=None, device: torch.device | str = "cpu", step_lock=None,
                 channels_last: bool = True, average_model: A3Clstm | None = None):
        self.shared = shared_model
        self.optimizer = optimizer
        self.settings = settings
        self.index = index
        self.counters = counters
        # other processes' copies of the shared weights wait for the end of a step (``ga3c.gate``)
        self.gate = counters.gate if counters is not None else NO_GATE
        self.device = torch.device(device)
        self.step_lock = step_lock if step_lock is not None else contextlib.nullcontext()
        model = A3Clstm(shared_model.conv1.in_channels, shared_model.num_actions, shared_model.hidden_size)
        if channels_last:
            model = model.channels_last()
        self.model = model.to(self.device).set_precision(compute_dtype(settings.compute_precision))
        self.model.train()
        sync_weights(self.model, shared_model)
        self.handoff = GradientHandoff(self.model, shared_model)
        self.average = average_model
        if average_model is not None and settings.ema_steps <= 0:
            raise ValueError("an average model needs settings.ema_steps > 0")
        self.updates = 0

    def version(self) -> int:
        return self.counters.version if self.counters is not None else self.updates

    def global_steps(self) -> int:
        """The run's global agent steps (``counters``' slots, the resumed base included; 0 without counters): where
        the ``--lr-anneal-steps`` and ``--entropy-anneal-steps`` schedules stand."""
        return int(self.counters.agent_steps.sum()) if self.counters is not None else 0

    def update(self, segments: list[Segment], stop=None) -> UpdateResult:
        """``settings.train_passes`` optimizer steps on the shared model from ``segments`` (one by default); returns
        the last pass's result. Each pass: the gradient at the shared weights copied at its start (saved
        activations replayed only for the frames those weights acted on, see the module docstring), handed over
        and stepped under ``step_lock``, where the version then moves (and the moving average, with
        ``average_model``, takes the new weights in). With several passes every pass's policy term is the clipped
        surrogate (``batch_losses``); the batch's transitions and segments are counted once, on the first pass,
        the moving average takes the weights in once, after the last pass, and every pass's policy lag goes into
        the counters' histogram. ``stop`` (with ``is_set()``): checked between passes, so that a stopped or
        retired trainer ends after the step it is in, not K steps later; the passes made stay applied, and the
        moving average then takes the weights in once at the break (under ``step_lock``, after any step another
        trainer made in between). With ``settings.later_passes == "lstm"`` the passes after the first train on the
        first one's batch and detached conv features (the module docstring)."""
        result = None
        passes = self.settings.train_passes
        reuse = None  # the first pass's batch and conv features, for --later-passes lstm
        for p in range(passes):
            if p > 0 and stop is not None and stop.is_set():
                if self.average is not None:  # the passes made are applied: the average takes them in once
                    self.gate.wait_for_holds()
                    with self.step_lock, self.gate.writing():
                        update_average(self.average, self.shared, result.steps, self.settings.ema_steps)
                break
            result, batch, feats = self._step(segments, first=p == 0, last=p == passes - 1, reuse=reuse)
            if p == 0 and passes > 1 and self.settings.later_passes == "lstm":
                reuse = (batch, feats.detach())
        return result

    def _step(self, segments: list[Segment], *, first: bool, last: bool,
              reuse: tuple[Batch, torch.Tensor] | None = None) -> tuple[UpdateResult, Batch, torch.Tensor]:
        """One optimizer step (see ``update``); returns its result, and the batch and conv features it trained on.
        ``reuse``: a batch and detached conv features to train on instead of assembling ``segments`` and running
        the convolutions (the LSTM and the heads get gradients, the conv parameters none)."""
        with self.step_lock:  # no other trainer's step between reading the version and copying its weights
            version = self.version()
            sync_weights(self.model, self.shared)
        if reuse is None:
            batch = assemble(segments, self.device, version=version)
            feats = conv_features(self.model, batch)
        else:
            batch, feats = reuse
        entropy_coef = linear_anneal(self.settings.entropy_coef, self.global_steps(),
                                     self.settings.entropy_anneal_steps)
        loss, w = batch_loss(self.model, batch, self.settings, entropy_coef, feats)
        params = [p for p, _ in self.handoff.pairs]
        self.model.zero_grad(set_to_none=True)
        loss.total.backward()
        if self.settings.max_grad_norm > 0:  # over the parameters with a gradient (not the convs' with reuse)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.settings.max_grad_norm))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params
                                                                    if p.grad is not None])))
        lags = version - batch.versions
        lag = lags.to(torch.float64)
        result = UpdateResult(loss, grad_norm, batch.num_steps, batch.num_segments, float(lag.mean()),
                              int(lag.max()), None if w is None else float(w.mean()))
        n = result.steps
        per_step = dict(policy=loss.policy.item() / n, value=loss.value.item() / n, entropy=loss.entropy.item() / n)
        self.gate.wait_for_holds()  # a copy of the weights under way in another process ends first
        with self.step_lock, self.gate.writing():
            self.handoff()
            if self.settings.lr_anneal_steps:
                lr = linear_anneal(self.settings.lr, self.global_steps(), self.settings.lr_anneal_steps)
                set_lr(self.optimizer, lr)
            self.optimizer.step()
            if self.average is not None and last:  # once per batch: its agent steps are counted once
                update_average(self.average, self.shared, n, self.settings.ema_steps)
            self.updates += 1
            if self.counters is not None:  # the version moves with the weights (see the module docstring)
                self.counters.record_update(self.index, steps=n if first else 0,
                                            segments=result.segments if first else 0,
                                            lag_mean=result.lag_mean, lag_max=result.lag_max, grad_norm=grad_norm,
                                            lags=lags, **per_step)
        return result, batch, feats

    def run(self, source: "queue.Queue[Segment]", stop, max_updates: int | None = None,
            poll: float = 0.05) -> int:
        """Take segments from ``source`` and update every ``train_batch`` of them, until ``stop.is_set()`` (or
        ``max_updates`` batches); a partial batch at the stop goes back on ``source`` for another trainer (a
        retired one's, under ``--dynamic``), as far as it has room. Returns the number of batches trained (each
        ``settings.train_passes`` optimizer steps)."""
        pending: list[Segment] = []
        done = 0
        while not stop.is_set() and (max_updates is None or done < max_updates):
            try:
                pending.append(source.get(timeout=poll))
            except queue.Empty:
                continue
            if len(pending) >= self.settings.train_batch:
                self.update(pending, stop)
                pending = []
                done += 1
        for seg in pending:
            try:
                source.put_nowait(seg)
            except queue.Full:
                break
        return done

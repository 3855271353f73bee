"""The settings GA3C's pieces share, in one typed place, with the A3C flags they reuse."""
from __future__ import annotations

from dataclasses import dataclass, fields

from precision import DTYPES

LATER_PASSES = ("full", "lstm")  # --later-passes: the whole model, or the LSTM and heads on pass 1's conv features


@dataclass(frozen=True)
class Ga3cSettings:
    """Hyperparameters of the GA3C predictors and trainers (the loss ones are the A3C worker's flags)."""

    num_steps: int = 20  # transitions per segment (A3C's --num-steps; GA3C's TIME_MAX is 5)
    predict_batch: int = 128  # most observations in one prediction batch (GA3C PREDICTION_BATCH_SIZE)
    train_batch: int = 4  # segments per update (GA3C: 0 = one segment; authors recommend 20-40 transitions)
    queue_size: int = 8  # closed segments waiting for a trainer (GA3C MAX_QUEUE_SIZE); full = back-pressure
    gamma: float = 0.99
    tau: float = 1.0  # GAE lambda
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    is_clip: float | None = None  # truncated importance weight min(pi/mu, is_clip); None = plain GA3C
    max_grad_norm: float = 0.0  # 0 = no clipping (upstream A3G)
    replay_activations: bool = False  # trainers reuse the predictors' conv activations of frames at their version
    compute_precision: str = "fp32"  # the conv encoder's, in predictors and trainers (precision.py)
    lr: float = 1e-4  # the start of the learning-rate schedule (the optimizer is built with it)
    lr_anneal_steps: int = 0  # lr falls linearly to 0 at this many global agent steps; 0 = constant lr
    entropy_anneal_steps: int = 0  # entropy_coef falls linearly to 0 at this many global steps; 0 = constant
    short_game_slots: int = 0  # env slots 0..K-1 play cut games (the agents' business; here to place the next)
    greedy_slots: int = 0  # env slots K..K+G-1 act greedily (argmax, mu = 1); see batch_losses
    train_passes: int = 1  # optimizer steps per batch; above 1 the policy term is PPO's clipped surrogate
    pass_clip: float = 0.2  # its epsilon (used only when train_passes > 1)
    later_passes: str = "full"  # what passes 2..K train: "full" (the whole model) or "lstm" (LSTM and heads only)
    ema_steps: int = 0  # the time constant of the weights' moving average in agent steps (averaging.py); 0 = none

    def surrogate_clip(self) -> float | None:
        """The clipped surrogate's epsilon when several passes train each batch, else None (the plain loss)."""
        return self.pass_clip if self.train_passes > 1 else None

    def greedy_slot_ids(self) -> range:
        """The env slots that act greedily: the ``greedy_slots`` after the ``short_game_slots``."""
        return range(self.short_game_slots, self.short_game_slots + self.greedy_slots)

    @classmethod
    def from_args(cls, args) -> "Ga3cSettings":
        """From a parsed namespace: each field its attribute of the same name when present, else the default."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if not values.get("is_clip"):  # the flag's 0 means off
            values["is_clip"] = None
        return cls(**values)

    def problems(self) -> list[str]:
        """Every invalid value, one line each (empty when all is well)."""
        checks = [
            (self.num_steps >= 1, f"num_steps must be >= 1, got {self.num_steps}"),
            (self.predict_batch >= 1, f"predict_batch must be >= 1, got {self.predict_batch}"),
            (self.train_batch >= 1, f"train_batch must be >= 1, got {self.train_batch}"),
            (self.queue_size >= 1, f"queue_size must be >= 1, got {self.queue_size}"),
            (self.is_clip is None or self.is_clip > 0, f"is_clip must be > 0 (or None = off), got {self.is_clip}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.lr_anneal_steps >= 0, f"lr_anneal_steps must be >= 0, got {self.lr_anneal_steps}"),
            (self.entropy_anneal_steps >= 0, f"entropy_anneal_steps must be >= 0, got {self.entropy_anneal_steps}"),
            (self.short_game_slots >= 0, f"short_game_slots must be >= 0, got {self.short_game_slots}"),
            (self.greedy_slots >= 0, f"greedy_slots must be >= 0, got {self.greedy_slots}"),
            (self.train_passes >= 1, f"train_passes must be >= 1, got {self.train_passes}"),
            (0 < self.pass_clip < 1, f"pass_clip must be between 0 and 1, got {self.pass_clip}"),
            (self.later_passes in LATER_PASSES, f"later_passes must be one of {', '.join(LATER_PASSES)}, got "
                                                f"{self.later_passes!r}"),
            (self.train_passes == 1 or (self.is_clip is None and self.greedy_slots == 0),
             "train_passes > 1 is not combined with is_clip or greedy_slots"),
            (self.ema_steps >= 0, f"ema_steps must be >= 0, got {self.ema_steps}"),
            (self.max_grad_norm >= 0, f"max_grad_norm must be >= 0, got {self.max_grad_norm}"),
            (self.compute_precision in DTYPES, f"compute_precision must be one of {', '.join(DTYPES)}, got "
                                               f"{self.compute_precision!r}"),
        ]
        return [msg for ok, msg in checks if not ok]

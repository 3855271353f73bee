"""Predictors and trainers as threads next to the one model (GA3C's server), stopped by the run's stop flag.

Threads, as in GA3C: the model, the per-slot LSTM states and the queue of closed segments stay in one process
(and on one device), and torch releases the GIL inside its kernels, so a trainer's backward and a predictor's
forward run at the same time. The segment queue is an in-process ``queue.Queue``: nothing crosses a process
boundary there, and a thread that fails takes no lock with it; the agents, the only other processes, talk
through ``buffers.EnvSlots``.

Predictor p of NP owns env slots ``p, p + NP, ...`` (each slot's LSTM state has one writer) and acts with a
private, channels-last copy of the model refreshed whenever the version moves (``private_predictor_models``),
or with the shared model itself. A thread that raises records its traceback in ``failures`` and sets the stop
flag, so everything ends and the caller can report it.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback

import torch

from ga3c.buffers import EnvSlots
from ga3c.predictor import Predictor, SlotStates, queue_sink
from ga3c.settings import Ga3cSettings
from ga3c.trainer import Trainer
from model import A3Clstm


class Server:
    """``num_predictors`` predictor threads and ``num_trainers`` trainer threads over ``shared_model``."""

    def __init__(self, shared_model: A3Clstm, optimizer: torch.optim.Optimizer, buffers: EnvSlots, counters,
                 settings: Ga3cSettings, stop, *, num_predictors: int = 1, num_trainers: int = 1,
                 device: torch.device | str = "cpu", private_predictor_models: bool = True, seed: int = 0):
        self.stop = stop
        self.segments: queue.Queue = queue.Queue(maxsize=settings.queue_size)
        self.states = SlotStates(buffers.num_slots, shared_model.hidden_size, device)
        self.failures: list[tuple[str, str]] = []
        self.threads: list[threading.Thread] = []
        sink = queue_sink(self.segments, stop)
        self.predictors = []
        for p in range(num_predictors):
            model, source = shared_model, None
            if private_predictor_models:
                model = A3Clstm(shared_model.conv1.in_channels, shared_model.num_actions,
                                shared_model.hidden_size).channels_last().to(device).eval()
                source = shared_model
            self.predictors.append(Predictor(
                model, buffers, range(p, buffers.num_slots, num_predictors), self.states,
                num_steps=settings.num_steps, predict_batch=settings.predict_batch, counters=counters, index=p,
                sink=sink, device=device, source=source, seed=seed + p))
        step_lock = threading.Lock()  # hand-off + optimizer step only (see trainer.py)
        self.trainers = [Trainer(shared_model, optimizer, settings, index=t, counters=counters, device=device,
                                 step_lock=step_lock) for t in range(num_trainers)]

    def _guard(self, role: str, fn) -> None:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - recorded and turned into a stop of the whole run
            self.failures.append((role, traceback.format_exc()))
            self.stop.set()

    def start(self) -> "Server":
        for i, p in enumerate(self.predictors):
            self._start(f"predictor {i}", lambda p=p: p.run(self.stop))
        for i, t in enumerate(self.trainers):
            self._start(f"trainer {i}", lambda t=t: t.run(self.segments, self.stop))
        return self

    def _start(self, role: str, fn) -> None:
        th = threading.Thread(target=self._guard, args=(role, fn), name=f"ga3c {role}", daemon=True)
        th.start()
        self.threads.append(th)

    def join(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout`` seconds in all) for the threads to end after ``stop``; True if all did."""
        deadline = time.monotonic() + timeout
        for th in self.threads:
            th.join(max(0.0, deadline - time.monotonic()))
        return not any(th.is_alive() for th in self.threads)

"""Predictors and trainers as threads next to the one model (GA3C's server), and the process that runs them.

Threads, as in GA3C: the model, the per-slot LSTM states and the queue of closed segments stay in one process
(and on one device), and torch releases the GIL inside its kernels, so a trainer's backward and a predictor's
forward run at the same time. The segment queue is an in-process ``queue.Queue``: nothing crosses a process
boundary there, and a thread that fails takes no lock with it; the agents, the only other processes, talk
through ``buffers.EnvSlots``.

Predictor p of NP owns env slots ``p, p + NP, ...`` (each slot's LSTM state has one writer) and acts with a
private, channels-last copy of the model refreshed every ``sync_every`` updates, under the trainers'
``step_lock`` (never with the shared model itself, which the trainers step while it would act). A thread that
raises records its traceback in ``failures`` and halts this server (not the run: the server process reports the
failure and exits non-zero, and the main process stops the run when it sees that).

Devices (``ga3c_devices``): the CPU by default; with one GPU, trainers and predictors both use it; with two or
more, the first half of ``--gpu-ids`` trains and the second half predicts (tensorpack's split), trainer t on the
t-th training GPU round-robin, predictor p likewise. The shared model and the optimizer stay in CPU shared memory
(the monitor and the checkpoints read them there); trainers hand their gradients to it and step the optimizer
on the CPU, as A3G workers do, and predictors copy the weights to their device.

``set_counts(trainers, predictors)`` (``--dynamic``) starts or retires trainer threads, and replaces the
predictor threads by a new set when their number changes (the new ones take over the open segments and the
per-slot LSTM states, so no env slot loses its episode). The new set starts only once every old predictor has
ended: two predictors recording one slot's steps into its open segment would put steps in twice and rewards on
the wrong steps. So a retiring predictor never waits on a full segment queue (its sink, ``segment_sink``, drops
what does not fit then), and one that still has not ended after the timeout halts the server.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from argparse import Namespace

import torch

from ga3c.buffers import EnvSlots
from ga3c.predictor import Predictor, SlotStates, queue_sink
from ga3c.settings import Ga3cSettings
from ga3c.trainer import Trainer
from model import A3Clstm
from precision import compute_dtype
from run_state import AnyOf


def segment_sink(q: "queue.Queue", flag):
    """A predictor's ``sink``: puts each closed segment on ``q``, waiting while it is full (back-pressure from
    the trainers) but never once ``flag`` is set (the run's stop, the server's halt or this predictor's
    retirement): then a segment that does not fit at once is dropped, so that the predictor ends its step."""
    wait = queue_sink(q, flag)

    def put(segment) -> None:
        try:
            q.put_nowait(segment)
        except queue.Full:
            wait(segment)

    return put


def ga3c_devices(gpu_ids: list[int]) -> tuple[list[torch.device], list[torch.device]]:
    """``(trainer devices, predictor devices)`` from ``--gpu-ids`` (see the module docstring)."""
    if not gpu_ids or gpu_ids[0] < 0:
        return [torch.device("cpu")], [torch.device("cpu")]
    gpus = [torch.device("cuda", g) for g in gpu_ids]
    if len(gpus) == 1:
        return gpus, gpus
    half = len(gpus) // 2
    return gpus[:half], gpus[half:]


class Server:
    """``num_predictors`` predictor threads and ``num_trainers`` trainer threads over ``shared_model``, until
    ``stop`` (the run's flag) or ``halt`` (this server's, set by a failed thread or by ``close``)."""

    def __init__(self, shared_model: A3Clstm, optimizer: torch.optim.Optimizer, buffers: EnvSlots, counters,
                 settings: Ga3cSettings, stop, *, num_predictors: int = 1, num_trainers: int = 1,
                 device: torch.device | str = "cpu", trainer_devices: list | None = None,
                 predictor_devices: list | None = None, sync_every: int = 1, seed: int = 0,
                 average_model: A3Clstm | None = None):
        self.shared_model = shared_model
        self.average_model = average_model
        self.optimizer = optimizer
        self.buffers = buffers
        self.counters = counters
        self.settings = settings
        self.stop = stop
        self.halt = threading.Event()
        self.trainer_devices = [torch.device(d) for d in (trainer_devices or [device])]
        self.predictor_devices = [torch.device(d) for d in (predictor_devices or [device])]
        self.sync_every = sync_every
        self.seed = seed
        self.segments: queue.Queue = queue.Queue(maxsize=settings.queue_size)
        one_device = len(set(self.predictor_devices)) == 1
        self.states = SlotStates(buffers.num_slots, shared_model.hidden_size,
                                 self.predictor_devices[0] if one_device else "cpu")
        self.open_segments: dict = {}
        self.failures: list[tuple[str, str]] = []
        self.threads: list[threading.Thread] = []
        self.step_lock = threading.Lock()  # hand-off + optimizer step only (see trainer.py)
        self._private_models: dict[int, A3Clstm] = {}
        self.predictors: list[Predictor] = []
        self._predictor_builds = 0  # how many sets of predictors were built (``--dynamic`` builds a new set)
        self._predictor_threads: list[tuple[threading.Event, threading.Thread]] = []
        self.trainers: list[Trainer] = []
        self._trainer_threads: list[tuple[threading.Event, threading.Thread]] = []
        self._build_predictors(num_predictors)
        for _ in range(num_trainers):
            self._add_trainer()

    # ---- construction -----------------------------------------------------------------------------------------
    def _predictor_model(self, p: int, device: torch.device):
        dtype = compute_dtype(self.settings.compute_precision)
        if p not in self._private_models:
            m = self.shared_model
            self._private_models[p] = A3Clstm(m.conv1.in_channels, m.num_actions,
                                              m.hidden_size).channels_last().to(device).eval().set_precision(dtype)
        return self._private_models[p], self.shared_model

    def _build_predictors(self, n: int) -> None:
        """Build ``n`` predictors over the env slots. Predictor p of the b-th set (b from 0) samples its actions
        with the seed ``seed + p + b * (the most predictors)``: a set that ``--dynamic`` builds again does not
        draw the first set's random numbers again."""
        self.predictors, self._predictor_retire = [], []
        span = max(n, int(self.counters.predictions.numel()) if self.counters is not None else 0)
        first_seed = self.seed + self._predictor_builds * span
        self._predictor_builds += 1
        for p in range(n):
            device = self.predictor_devices[p % len(self.predictor_devices)]
            model, source = self._predictor_model(p, device)
            retire = threading.Event()  # the thread's own flag (``_start``), which its sink obeys as well
            sink = segment_sink(self.segments, AnyOf(self.stop, self.halt, retire))
            self.predictors.append(Predictor(
                model, self.buffers, range(p, self.buffers.num_slots, n), self.states,
                num_steps=self.settings.num_steps, predict_batch=self.settings.predict_batch,
                counters=self.counters, index=p, sink=sink, device=device, source=source, seed=first_seed + p,
                open_segments=self.open_segments, sync_every=self.sync_every,
                save_activations=self.settings.replay_activations, step_lock=self.step_lock,
                greedy_slots=self.settings.greedy_slot_ids()))
            self._predictor_retire.append(retire)

    def _add_trainer(self) -> Trainer:
        t = len(self.trainers)
        trainer = Trainer(self.shared_model, self.optimizer, self.settings, index=t, counters=self.counters,
                          device=self.trainer_devices[t % len(self.trainer_devices)], step_lock=self.step_lock,
                          average_model=self.average_model)
        self.trainers.append(trainer)
        return trainer

    # ---- threads ----------------------------------------------------------------------------------------------
    def _guard(self, role: str, fn) -> None:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - recorded; the server halts and its process reports it
            self.failures.append((role, traceback.format_exc()))
            self.halt.set()

    def _start(self, role: str, fn, retire: threading.Event | None = None
               ) -> tuple[threading.Event, threading.Thread]:
        retire = threading.Event() if retire is None else retire
        th = threading.Thread(target=self._guard, args=(role, lambda: fn(AnyOf(self.stop, self.halt, retire))),
                              name=f"ga3c {role}", daemon=True)
        th.start()
        self.threads.append(th)
        return retire, th

    def _start_predictors(self) -> None:
        self._predictor_threads = [self._start(f"predictor {i}", lambda s, p=p: p.run(s), retire)
                                   for i, (p, retire) in enumerate(zip(self.predictors, self._predictor_retire))]

    def _start_trainer(self, i: int) -> None:
        t = self.trainers[i]
        self._trainer_threads.append(self._start(f"trainer {i}", lambda s, t=t: t.run(self.segments, s)))

    def start(self) -> "Server":
        self._start_predictors()
        for i in range(len(self.trainers)):
            self._start_trainer(i)
        self._publish()
        return self

    def _publish(self) -> None:
        if self.counters is not None:
            self.counters.active[0] = len(self._trainer_threads)
            self.counters.active[1] = len(self._predictor_threads)

    @property
    def counts(self) -> tuple[int, int]:
        """Running (trainers, predictors)."""
        return len(self._trainer_threads), len(self._predictor_threads)

    def set_counts(self, trainers: int, predictors: int, timeout: float = 10.0) -> None:
        """Run ``trainers`` trainer and ``predictors`` predictor threads from now on (see the module docstring).

        A retired trainer or predictor that has not ended within ``timeout`` seconds is a failure: the server halts
        rather than start another thread on the same trainer, or a new set of predictors beside it; a halted server
        starts nothing."""
        if self.halt.is_set():
            return
        while len(self._trainer_threads) > trainers:  # retire the newest; its partial batch goes back on the queue
            retire, th = self._trainer_threads.pop()
            retire.set()
            th.join(timeout)
            if th.is_alive():  # a later start on the same Trainer would run two threads on one working copy
                self.failures.append((th.name.removeprefix("ga3c "), f"{th.name}: still running {timeout:g} s after "
                                      f"being retired (--dynamic); no trainer was started in its place\n"))
                self.halt.set()
                return
        while len(self._trainer_threads) < trainers:
            i = len(self._trainer_threads)
            if i >= len(self.trainers):
                self._add_trainer()
            self._start_trainer(i)
        if predictors != len(self._predictor_threads):
            for retire, _ in self._predictor_threads:
                retire.set()
            deadline = time.monotonic() + timeout
            for _, th in self._predictor_threads:
                th.join(max(0.0, deadline - time.monotonic()))
            stuck = [th.name for _, th in self._predictor_threads if th.is_alive()]
            if stuck:
                self.failures.append((stuck[0].removeprefix("ga3c "),
                                      f"{', '.join(stuck)}: still running {timeout:g} s after being retired "
                                      f"(--dynamic); no new predictors were started beside it\n"))
                self.halt.set()
                return
            self._build_predictors(predictors)
            self._start_predictors()
        self._publish()

    def join(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout`` seconds in all) for the threads to end after ``stop``/``halt``; True if all
        did."""
        deadline = time.monotonic() + timeout
        for th in self.threads:
            th.join(max(0.0, deadline - time.monotonic()))
        return not any(th.is_alive() for th in self.threads)

    def close(self, timeout: float = 10.0, step_timeout: float = 60.0) -> bool:
        """Halt every thread and wait up to ``timeout`` seconds for them. Where one still runs, it may be inside an
        optimizer step (the shared weights and statistics half written): take ``step_lock``, waiting up to
        ``step_timeout`` seconds, and keep it, so that the process then exits between steps, never inside one.
        True when every thread ended or the lock is held."""
        self.halt.set()
        if self.join(timeout):
            return True
        return self.step_lock.acquire(timeout=step_timeout)


def build_server(args: Namespace, shared_model: A3Clstm, optimizer, buffers: EnvSlots, counters, stop,
                 average_model: A3Clstm | None = None) -> Server:
    """The server of a run with ``args`` (not started): on the devices of ``--gpu-ids``, with the run's shared
    ``optimizer``, or a private one built here when it is None (``--no-shared-optimizer``); its trainers update
    ``average_model`` (``--ema-steps``) once per batch, after its last step."""
    from shared_optim import make_optimizer
    trainer_devices, predictor_devices = ga3c_devices(args.gpu_ids)
    if optimizer is None:
        optimizer = make_optimizer(args.optimizer, shared_model.parameters(), args.lr, args.amsgrad, shared=False,
                                   eps=args.optimizer_eps)
    return Server(shared_model, optimizer, buffers, counters, Ga3cSettings.from_args(args), stop,
                  num_predictors=args.predictors, num_trainers=args.trainers, trainer_devices=trainer_devices,
                  predictor_devices=predictor_devices, sync_every=args.sync_every, seed=args.seed,
                  average_model=average_model)


def server_process(slot: int, args: Namespace, shared_model: A3Clstm, optimizer, buffers: EnvSlots, counters,
                   run, average_model: A3Clstm | None = None) -> None:
    """Process entry point of GA3C's server: predictors and trainers over ``shared_model`` until ``run.stop``.

    ``optimizer`` is the run's shared optimizer, or None for a private one (``--no-shared-optimizer``). With
    ``--dynamic`` it follows the main process's wanted counts in ``counters.targets``. A failed thread (or any
    error here) is reported in ``run.errors[slot]`` and the process exits with code 1.
    """
    from utils import describe_failure, end_child_process, setup_child_process, use_device
    # One torch thread for each predictor and trainer thread, on purpose, also on a many-core CPU: GA3C's
    # parallelism is its threads and processes. The --agents processes (one per core by default) and the
    # --predictors and --trainers threads here already ask for every core; an intra-op pool on top would give
    # each of these threads its own team of one thread per core (OpenMP starts a team for every thread that
    # enters a parallel region), oversubscribing the cores that the agents step on. More cores are used by more
    # agents, predictors and trainers (--dynamic searches those numbers), not by wider ops. On a GPU the work is
    # the device's and these threads only launch it. (Not measured on a many-core machine.)
    setup_child_process("ga3c server")
    server = None  # while set, an error here closes it before the exit (below)
    try:
        use_device(ga3c_devices(args.gpu_ids)[0][0])
        torch.manual_seed(args.seed)
        server = build_server(args, shared_model, optimizer, buffers, counters, run.stop, average_model).start()
        run.mark_ready(slot)
        while not run.stop.is_set() and not server.halt.is_set():
            if args.dynamic:
                nt, np_ = (int(v) for v in counters.targets[:2].tolist())
                if nt > 0 and np_ > 0 and (nt, np_) != server.counts:
                    server.set_counts(nt, np_)
            time.sleep(0.05)
        ending, server = server, None
        # within main.py's 8 s (a3g.run.JOIN_SECONDS) before it terminates this process
        if not ending.close(5.0, step_timeout=2.0):
            raise RuntimeError("a predictor or trainer thread still held the step lock 7 s after the stop (were it "
                               "inside an optimizer step, the final checkpoint is not written over the last one)")
        if ending.failures:
            role, text = ending.failures[0]
            raise RuntimeError(f"the {role} thread failed:\n{text}")
    except BaseException as e:  # report (never blocks), then exit non-zero: the main process stops the run
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            run.errors.report(slot, "ga3c server", describe_failure(e))
        if server is not None:  # it failed while its threads ran: exit between optimizer steps, as a stop does
            with contextlib.suppress(BaseException):
                server.close(5.0, step_timeout=2.0)
        end_child_process(1)
    end_child_process(0)

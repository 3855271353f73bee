"""GA3C mode of ``main.py``: the processes of a run, what the main process reports, and ``--dynamic``.

Processes (all spawned by the main process, bound to it by ``lifeline``, stopped through ``run.stop``):

- ``ga3c server``: predictor and trainer threads over the shared model (``server.server_process``);
- ``ga3c agent a`` for a < NA: steps env slots ``a*K .. a*K+K-1`` (K = ``--envs-per-agent``);
- ``monitor``: the same greedy test games as A3G mode (``test.test``), on the same shared model (or its moving
  average, ``--ema-steps``, which the server's trainers update).

Shared state is ``run_state.RunState`` (flags, global steps, the monitor's statistics, errors, normalisation
rows: one per env slot, the monitor's last), with process slots agent a -> a, server -> ``max_agents``, monitor
-> ``max_agents + 2`` (``max_agents + 1`` is unused); plus GA3C's ``EnvSlots``, ``Ga3cCounters`` (whose
agent-step slots *are* the run's global-step slots) and ``EpisodeLog``. Checkpoints are the A3G ones plus
``ga3c_updates`` (the model version), so either mode resumes the other's; each is copied between two optimizer
steps (``consistent``: the counters' ``StepGate``, ``ga3c.gate``), as the monitor copies each game's weights.

The main process calls ``tick()`` about 5 times a second: it prints GA3C's console line for every finished agent
game (and appends it to ``<log-dir>/results.txt``) and drives ``--dynamic``. The console line's RScore averages
over every learner game; where ``--train-envs`` names several ids, the status line also gives each id's mean over
its last 100 learner games (from the env slot each game was played in).
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from argparse import Namespace

import lifeline
from config import results_txt
from ga3c.agent import AtariEnvFactory, agent_process
from ga3c.buffers import ACQUIRE, EnvSlots, fence
from ga3c.dynamic import DynamicAdjuster
from ga3c.gate import MAIN
from ga3c.server import ga3c_devices, server_process
from ga3c.stats import TRAINER_FIELDS, ConsoleStats, EpisodeLog, Ga3cCounters, ResultsWriter, ScoresById
from model import A3Clstm
from modes import Mode
from run_state import Flag, RunState

STEP_WAIT_SECONDS = 10.0  # a periodic checkpoint waits this long at most for a moment between two optimizer steps


def short_games_go_on(ckpt: dict, args: Namespace) -> bool:
    """Whether a resumed run's short-game slots cut from the start: its checkpoint's run reached its
    ``--short-games-after-score`` (``short_games_started``), and this run's is no higher (a higher one waits for
    the monitor's mean again)."""
    saved = (ckpt.get("config") or {}).get("short_games_after_score")
    now = getattr(args, "short_games_after_score", None)
    return bool(ckpt.get("short_games_started")) and saved is not None and now is not None and now <= saved


class Ga3cRun(Mode):
    """One GA3C run's shared state and processes (see the module docstring); ``main.run_training`` drives it
    through ``modes.Mode``, whose defaults it keeps for ``errors`` and ``release``."""

    name = "ga3c"

    def __init__(self, args: Namespace, shared_model: A3Clstm, optimizer, log, console_window: int = 1000):
        self.args = args
        self.shared_model = shared_model
        self.optimizer = optimizer
        self.log = log
        self.max_agents = args.dynamic_max[2] if args.dynamic else args.agents
        max_trainers = args.dynamic_max[0] if args.dynamic else args.trainers
        max_predictors = args.dynamic_max[1] if args.dynamic else args.predictors
        self.k = args.envs_per_agent
        n_slots = self.max_agents * self.k
        self.run = RunState(self.max_agents + 2, args.score_window, norm_rows=n_slots)
        self.server_slot = self.max_agents
        self.buffers = EnvSlots(n_slots, norm_stats=self.run.norm_stats[:n_slots])
        self.counters = Ga3cCounters(self.max_agents, max_predictors, max_trainers,
                                     agent_steps=self.run.global_steps.slots)
        self.episodes = EpisodeLog(self.max_agents)
        self.retire = [Flag() for _ in range(self.max_agents)]
        self.procs: list[tuple[str, mp.Process]] = []
        self.agents: dict[int, mp.Process] = {}  # running agents by index
        self._agent_processes: dict[int, mp.Process] = {}  # the latest process of each index
        self._agent_starts: dict[int, int] = {}  # how many times each index was started (seeds, ``_start_agent``)
        self.retired: set[int] = set()  # pids of agents that --dynamic stopped (they exit 0 on purpose)
        self._pending_agents: list[int] = []  # indices --dynamic starts once their retired process has exited
        self.console = ConsoleStats(time.time(), window=console_window)
        # --train-envs with several ids: each one's learner games, since the console line averages over all
        self.scores_by_id = ScoresById() if len(set(getattr(args, "train_envs", None) or ())) > 1 else None
        self._slot_env = AtariEnvFactory.for_args(args)  # which id each slot plays (env_id_of), as the agents do
        self.results = None
        self.adjuster = None
        if args.dynamic:
            self.adjuster = DynamicAdjuster((args.trainers, args.predictors, args.agents), (1, 1, 1),
                                            tuple(args.dynamic_max), args.dynamic_seconds, seed=args.seed)
        self._ctx = None
        self._status_hist = None
        self._status_updates = 0
        self._status_trained = 0

    # ---- set-up -----------------------------------------------------------------------------------------------
    def describe(self) -> str:
        trainer_devices, predictor_devices = ga3c_devices(self.args.gpu_ids)
        where = ("CPU" if trainer_devices[0].type == "cpu" else
                 f"trainers on {', '.join(map(str, trainer_devices))}, predictors on "
                 f"{', '.join(map(str, predictor_devices))}")
        a = self.args
        return (f"in GA3C mode: {a.agents} agents x {a.envs_per_agent} envs, {a.predictors} predictor(s), "
                f"{a.trainers} trainer(s), {a.train_batch} segments of {a.num_steps} steps per update"
                + (f", importance weights clipped at {a.is_clip:g}" if a.is_clip else "")
                + (f", {a.train_passes} passes per batch (clipped surrogate, eps {a.pass_clip:g}"
                   + ("; the later ones on the LSTM and heads" if a.later_passes == "lstm" else "") + ")"
                   if a.train_passes > 1 else "")
                + (", --dynamic" if a.dynamic else "") + f", on {where}")

    def restore(self, ckpt: dict) -> None:
        self.run.restore(ckpt)
        if short_games_go_on(ckpt, self.args):
            self.run.short_games.set()
        self.counters.restore(self.run.global_steps.value, int(ckpt.get("ga3c_updates", 0)))
        self._status_updates = self.counters.version  # the status line's updates/s counts this run's updates
        self.console.resume(self.run.global_steps.value, self.counters.version, int(ckpt.get("ga3c_episodes", 0)))

    def snapshot(self) -> dict:
        return {"ga3c_updates": self.counters.version, "ga3c_episodes": self.console.episodes,
                "short_games_started": self.run.short_games.is_set()}

    def consistent(self, copy, final: bool):
        """``copy()`` made between two optimizer steps (``StepGate.read``), waiting up to ``STEP_WAIT_SECONDS``
        and while the server is alive; None, with a line in the log, where there was no such moment.
        The final copy does not wait: every process has stopped, a stopped server between two steps; but where the
        server ended inside one (killed), the shared weights hold that step half applied, and nothing is copied,
        so that the last complete checkpoint stays."""
        gate = self.counters.gate
        if final:
            if gate.in_step():
                self.log.info("the final checkpoint is not written: the ga3c server ended inside an optimizer step, "
                              "so the shared weights hold that step half applied; the last complete checkpoint "
                              "stays")
                return None
            return copy()
        server = next((p for role, p in self.procs if role == "ga3c server"), None)
        result = gate.read(copy, MAIN, alive=lambda: server is not None and server.is_alive(),
                           timeout=STEP_WAIT_SECONDS)
        if result is None:
            self.log.info(f"checkpoint skipped: no moment between two optimizer steps within {STEP_WAIT_SECONDS:g} s, "
                          f"or the ga3c server ended inside one; the last complete checkpoint stays")
        return result

    def slot_of(self, role: str) -> int:
        if role == "monitor":
            return self.run.monitor_slot
        if role == "ga3c server":
            return self.server_slot
        return int(role.rsplit(" ", 1)[1])

    # ---- processes ----------------------------------------------------------------------------------------------
    def launch(self, ctx, elapsed_offset: float = 0.0) -> list[tuple[str, mp.Process]]:
        from test import test
        self._ctx = ctx
        self.results = ResultsWriter(results_txt(self.args))
        self.console.restart_clock(time.time())
        lifeline.mark_children()
        self._start("ga3c server", server_process, (self.server_slot, self.args, self.shared_model, self.optimizer,
                                                     self.buffers, self.counters, self.run, self.average_model))
        for a in range(self.args.agents):
            self._start_agent(a)
        self._start("monitor", test, (self.args, self.played_model, self.run, elapsed_offset,
                                         self.counters.gate))
        self.counters.targets[0], self.counters.targets[1] = self.args.trainers, self.args.predictors
        return self.procs

    def _start(self, role: str, target, target_args) -> mp.Process:
        p = self._ctx.Process(target=target, args=target_args, name=role)
        lifeline.start_child(p)
        self.procs.append((role, p))
        return p

    def _start_agent(self, a: int) -> None:
        """Start agent ``a`` on its env slots. Slot s is seeded with ``--seed + s`` at the agent's first start and
        with ``--seed + s + n * (the env slots)`` at its n-th restart (``--dynamic``): a restarted agent does not
        play its slots' first games again (the same no-op starts and sticky-action draws)."""
        a_args = self.args
        starts = self._agent_starts.get(a, 0)
        self._agent_starts[a] = starts + 1
        seed = a_args.seed + starts * self.max_agents * self.k
        factory = dataclasses.replace(AtariEnvFactory.for_args(a_args, self.run.short_games), seed=seed)
        assert not self._holds_slots(a), f"agent {a} started while its retired process holds its slots"
        self.retire[a].clear()
        self.run.ready[a] = 0
        slots = list(range(a * self.k, (a + 1) * self.k))
        self.agents[a] = self._agent_processes[a] = self._start(f"ga3c agent {a}", agent_process, (
            a, slots, self.buffers, factory, self.run.stop, self.counters, self.episodes, seed,
            self.run.errors, a, self.retire[a], self.run.ready))
        self.counters.active[2] = len(self.agents)

    def _retire_agent(self, a: int) -> None:
        p = self.agents.pop(a)
        self.retired.add(p.pid)
        self.retire[a].set()  # it finishes its current step and exits 0
        self.counters.active[2] = len(self.agents)

    def expected_exit(self, role: str, process: mp.Process, budget_reached: bool) -> bool:
        """An agent that ``--dynamic`` retired ends on purpose."""
        return process.exitcode == 0 and process.pid in self.retired

    # ---- what the main process does while the run goes on --------------------------------------------------------
    def tick(self, now: float) -> None:
        lost_before = self.episodes.lost
        new = self.episodes.read_new()
        self.console.episodes += self.episodes.lost - lost_before  # games not read were played: counted, and saved
        for episode in new:
            self.console.add(episode)
            if self.scores_by_id is not None and episode.slot >= 0:
                self.scores_by_id.add(self._slot_env.env_id_of(episode.slot), episode.score)
            nt, np_, na = (int(v) for v in self.counters.active.tolist())
            self.log.info(self.console.line(now, self.run.global_steps.value, self.counters.version, nt, np_, na))
        if self.episodes.lost > lost_before:
            self.log.info(f"{self.episodes.lost - lost_before} learner games ended faster than they were read and "
                          f"are missing from this log and results.txt ({self.episodes.lost} in all)")
        if self.results is not None:  # after the counting and the log: a line that fails leaves no game uncounted
            for episode in new:
                self.results.write(episode)
        if self.adjuster is not None and self._ctx is not None and not self.run.stop.is_set():
            self._start_pending_agents()
            trained = self.trained_steps()
            counts = None
            if self._settled():
                counts = self.adjuster.observe(now, trained)
            else:  # a window opens only once the setting is all running
                self.adjuster.hold(now, trained)
            for event in self.adjuster.events:
                self.log.info(f"[dynamic] {event}")
            self.adjuster.events.clear()
            if counts is not None:
                self.apply_counts(counts)

    def _settled(self) -> bool:
        """Whether the setting ``--dynamic`` last asked for is all running: a first update made by this run (a
        resumed run's version counts the checkpoint's updates too), the server's trainer and predictor counts at
        their targets, no agent waiting to start, and every agent ready (its environments built)."""
        c = self.counters
        return (int(c.updates[:-1].sum()) > 0 and not self._pending_agents
                and int(c.active[0]) == int(c.targets[0]) and int(c.active[1]) == int(c.targets[1])
                and all(bool(self.run.ready[a]) for a in self.agents))

    def apply_counts(self, counts) -> None:
        """Set the server's targets and the number of agents to ``counts``. An agent is started on an index whose
        last process has exited; where every free index's retired process is still finishing its step, the start
        waits (``_pending_agents``) and a later ``tick`` makes it, so the main loop never blocks on an exit."""
        nt, np_, na = counts
        self.counters.targets[0], self.counters.targets[1] = nt, np_
        while len(self.agents) + len(self._pending_agents) > na:
            if self._pending_agents:
                self._pending_agents.pop()
            else:
                self._retire_agent(max(self.agents))
        while len(self.agents) + len(self._pending_agents) < na:
            free = sorted(set(range(self.max_agents)) - set(self.agents) - set(self._pending_agents))
            exited = [a for a in free if not self._holds_slots(a)]
            if exited:
                self._start_agent(exited[0])
            else:
                self._pending_agents.append(free[0])
        self._start_pending_agents()

    def _holds_slots(self, a: int) -> bool:
        old = self._agent_processes.get(a)
        return old is not None and old.is_alive()

    def _start_pending_agents(self) -> None:
        for a in [a for a in self._pending_agents if not self._holds_slots(a)]:
            self._pending_agents.remove(a)
            self._start_agent(a)

    def trained_steps(self) -> int:
        return int(self.counters.trainer_stats[:, TRAINER_FIELDS.index("steps")].sum())

    def status(self, rate: float, span: float) -> tuple[str, dict]:
        """The status line and its TensorBoard scalars, for the stretch since the last call."""
        hist = self.counters.lag_snapshot()  # read once: the end of this stretch and the start of the next
        lag_mean, lag_max, _ = self.counters.lag_summary(self._status_hist, hist)
        self._status_hist = hist
        updates = self.counters.version
        fence(ACQUIRE)  # the trainers' statistics are read after the update counts (record_update's release fence)
        trained = self.trained_steps()
        ups = (updates - self._status_updates) / max(span, 1e-9)
        tps = (trained - self._status_trained) / max(span, 1e-9)
        self._status_updates, self._status_trained = updates, trained
        stats = self.counters.trainer_stats
        done = self.counters.updates[:-1] > 0
        nt, np_, na = (int(v) for v in self.counters.active.tolist())
        line = f"steps {self.run.global_steps.value:,} ({rate:.0f} steps/s) | updates {updates:,} ({ups:.1f}/s)"
        scalars = {"charts/train_steps_per_s": rate, "charts/updates_per_s": ups, "charts/trained_steps_per_s": tps}
        if bool(done.any()):
            f = dict(zip(TRAINER_FIELDS, stats[done].mean(0).tolist()))
            line += (f" | policy lag mean {lag_mean:.2f} max {lag_max} | per step: policy {f['policy_loss']:.4f} "
                     f"value {f['value_loss']:.4f} entropy {f['entropy']:.3f} | grad-norm {f['grad_norm']:.2f}")
            scalars.update({"charts/policy_lag_mean": lag_mean, "charts/policy_lag_max": lag_max,
                            "losses/policy_loss": f["policy_loss"], "losses/value_loss": f["value_loss"],
                            "losses/entropy": f["entropy"], "losses/grad_norm": f["grad_norm"]})
        line += f" | NT {nt} NP {np_} NA {na}"
        if self.scores_by_id is not None and self.scores_by_id.recent:
            line += f" | {self.scores_by_id.text()}"
            scalars.update({f"charts/learner_score_{env_id.replace('/', '_')}": mean
                            for env_id, (mean, _) in self.scores_by_id.means().items()})
        return line, scalars

    def close(self) -> None:
        try:
            self.tick(time.time())  # the games that ended during the shutdown
        finally:  # also where results.txt still cannot be written (tick raised CheckpointWriteError)
            if self.results is not None:
                self.results.close()
                self.results = None

"""The monitor: plays greedy whole games with the latest shared weights (or, with ``--ema-steps``, their moving
average, which is then the model it is given), logs them, and saves the model it played.

Cadence: a game starts ``--test-every-steps`` global agent steps after the start of the last one (or
``--test-every-seconds`` after its end, whichever comes first), so on a small machine it costs a few percent of the
workers' time instead of a core. With ``--target-score``, while one of the last ``--score-window`` games scored at
least the target, the step cadence is ``--confirm-every-steps`` where that is sooner (``game_interval``): the
window of a run that plays at its target fills, and the run stops, sooner.

Per game it writes the upstream line to ``<log-dir>/<env>_log`` (appended), one row to
``<log-dir>/<env>_monitor.csv``, a console line with global steps and steps/s, and, with
``--tensorboard-logger``, scalars under ``charts/``. It writes ``<save-model-dir>/<env>.dat`` after every game
(with ``--save-max`` only when the score is >= the best so far, best starting at 0 as upstream). A resumed run's
best so far is the best of its checkpoint's and of every game in the CSV: a run killed between a new best game
and its next checkpoint saved that game's model, which a lower score must not replace.
"""
from __future__ import annotations

import csv
import math
import time
from argparse import Namespace
from pathlib import Path

import torch

from checkpoint import CheckpointWriteError, atomic_save, cpu_state_dict, model_path, refuse_non_finite, write_errors
from config import config_dict
from environment import atari_env, load_env_config, normalizer
from model import A3Clstm
from player_util import play_game, sync_between_steps
from precision import compute_dtype
from run_state import RunState
from utils import (close_quietly, describe_failure, end_child_process, ends_mid_line, format_duration,
                   safe_name, setup_child_process, setup_logger, use_device, worker_device)

CSV_FIELDS = ["wall_time", "elapsed_s", "global_steps", "score", "length", "steps_per_s", "reward_mean",
              "window_mean"]


def csv_path(log_dir: str | Path, env_id: str) -> Path:
    return Path(log_dir) / f"{safe_name(env_id)}_monitor.csv"


def log_path(log_dir: str | Path, env_id: str) -> Path:
    return Path(log_dir) / f"{safe_name(env_id)}_log"


def train_log_path(log_dir: str | Path, env_id: str) -> Path:
    """main.py's own log of a run (its console lines)."""
    return Path(log_dir) / f"{safe_name(env_id)}_train.log"


def logged_scores(path: Path) -> list[float]:
    """The scores of the games in the monitor CSV at ``path``, in order (rows that do not parse, such as one cut
    short by a kill, are skipped); [] without a file."""
    scores = []
    try:
        with open(path, newline="", errors="replace") as f:
            for row in csv.DictReader(f):
                try:
                    score = float(row.get("score") or "nan")
                except (TypeError, ValueError):
                    continue
                if math.isfinite(score):
                    scores.append(score)
    except (OSError, csv.Error):
        pass
    return scores


def best_logged_score(path: Path) -> float | None:
    """The highest score in the monitor CSV at ``path`` (``logged_scores``); None without a game. A row is written
    before its game's model is saved, so every saved model's score is there."""
    return max(logged_scores(path), default=None)


def open_csv(path: Path):
    """Open the per-game CSV for appending; write the header only to a new file. A file whose last row was cut
    short (a run killed while writing it) gets that line ended first, so that the next row starts a line of its
    own (``plot.py`` leaves the cut row out). Raises ``CheckpointWriteError`` (one line) when it cannot be
    written (a full disk), the file closed."""
    new = not path.exists() or path.stat().st_size == 0
    ended = not ends_mid_line(path)
    f = open(path, "a", newline="")
    writer = csv.writer(f)
    try:
        with write_errors(path):
            if new:
                writer.writerow(CSV_FIELDS)
                f.flush()
            elif not ended:
                f.write("\r\n")
                f.flush()
    except CheckpointWriteError:
        close_quietly(f)
        raise
    return f, writer


def game_interval(args: Namespace, recent: list[float]) -> int:
    """Global steps from the start of one monitor game to the start of the next: ``--confirm-every-steps`` when
    ``--target-score`` is given, one of ``recent`` (the window's known scores) is at least it, and that cadence is
    on (> 0) and sooner than ``--test-every-steps`` (0 there: no step cadence); else ``--test-every-steps``. With
    ``--test-every-steps 0`` and ``--test-every-seconds 0`` games are played back to back: 0, always."""
    every, confirm = args.test_every_steps, args.confirm_every_steps
    if every == 0 and args.test_every_seconds == 0:
        return 0
    near = args.target_score is not None and any(s >= args.target_score for s in recent)
    return confirm if near and confirm > 0 and (every == 0 or confirm < every) else every


def run_monitor(args: Namespace, shared_model: A3Clstm, run: RunState, device: torch.device,
                elapsed_offset: float = 0.0, gate=None) -> None:
    """The monitor loop (see module docstring); returns when ``run.stop`` is set. Each game's weights are copied
    between two optimizer steps where there is a ``gate`` (GA3C: ``player_util.sync_between_steps``)."""
    env = atari_env(args.env, load_env_config(args.env_config, args.env), max_episode_length=args.max_episode_length,
                    skip_rate=args.skip_rate, episodic_life=False, see_skipped=args.see_skipped_frames)
    mean, std, count = run.norm_stats[run.monitor_norm].tolist()
    if count > 0:
        normalizer(env).set_stats(mean, std, int(count))
    model = A3Clstm(1, env.action_space.n, args.hidden_size).channels_last().to(device).eval()
    model.set_precision(compute_dtype(args.compute_precision))  # the run's precision: the games are its curve
    log = setup_logger(f"monitor.{safe_name(args.env)}", log_path(args.log_dir, args.env))
    console = setup_logger("monitor.console", None, console=True)
    for k, v in config_dict(args).items():
        log.info(f"{k}: {v}")
    logged_best = best_logged_score(csv_path(args.log_dir, args.env))
    f, writer = open_csv(csv_path(args.log_dir, args.env))
    tb = None
    if args.tensorboard_logger:
        from torch.utils.tensorboard import SummaryWriter
        tb = SummaryWriter(str(Path(args.log_dir) / "runs" / f"{safe_name(args.env)}_training"))
    start = time.time()
    # a resumed run's best, so that a model saved after its last checkpoint is not replaced by a worse one; where
    # the save folder holds no model (a resume into another --save-model-dir), upstream's start, 0
    best_saved = (max(0.0, run.monitor[2].item(), -math.inf if logged_best is None else logged_best)
                  if model_path(args.save_model_dir, args.env).exists() else 0.0)
    last_t, last_steps = start, run.global_steps.value
    # the first game's seed follows the learners' first ones: an A3G worker r plays seed + r, a GA3C env slot s
    # seed + s (its row of norm_stats, as the monitor's row is the last), so the monitor's opening is no learner's
    seed = args.seed + run.monitor_norm
    interval = args.test_every_steps
    run.mark_ready(run.monitor_slot)
    try:
        while not run.stop.is_set():
            steps_at_start = run.global_steps.value
            if not sync_between_steps(model, shared_model, gate, run.stop.is_set):
                break
            # weights gone NaN: no game on them, and no .dat of them (below)
            refuse_non_finite(model_path(args.save_model_dir, args.env), model=model.state_dict())
            score, length, finished = play_game(model, env, device, seed=seed, should_stop=run.stop.is_set)
            seed = None
            if not finished:
                break
            now, steps = time.time(), run.global_steps.value
            rate = (steps - last_steps) / max(now - last_t, 1e-9)
            last_t, last_steps = now, steps
            window_mean = run.record_game(score)
            games, total = run.monitor[0].item(), run.monitor[1].item()
            reward_mean = total / games
            elapsed = elapsed_offset + now - start
            log.info(f"Time {format_duration(elapsed)}, episode reward {score}, episode length {length}, "
                     f"reward mean {reward_mean:.4f}")
            console.info(f"[monitor] steps {steps:,} ({rate:.0f} steps/s) | game {int(games)}: score {score:.10g}, "
                         f"length {length}, mean {reward_mean:.2f}"
                         + (f", last {run.recent.numel()} mean {window_mean:.2f}" if window_mean is not None else ""))
            with write_errors(csv_path(args.log_dir, args.env)):  # a full disk: one line, not a traceback
                writer.writerow([f"{now:.3f}", f"{elapsed:.1f}", steps, score, length, f"{rate:.1f}",
                                 f"{reward_mean:.4f}", "" if window_mean is None else f"{window_mean:.4f}"])
                f.flush()
            if tb is not None:
                tb.add_scalar("charts/episode_reward", score, steps)
                tb.add_scalar("charts/episode_length", length, steps)
                tb.add_scalar("charts/steps_per_s", rate, steps)
                tb.flush()
            if not args.save_max or score >= best_saved:
                best_saved = max(best_saved, score)
                atomic_save(cpu_state_dict(model), model_path(args.save_model_dir, args.env))  # checked finite
            m, s, n = normalizer(env).get_stats()
            run.norm_stats[run.monitor_norm] = torch.tensor([m, s, float(n)], dtype=torch.float64)
            after = getattr(args, "short_games_after_score", None)
            if (after is not None and getattr(args, "short_game_slots", 0) > 0 and window_mean is not None
                    and window_mean >= after and not run.short_games.is_set()):
                k = args.short_game_slots
                console.info(f"[monitor] --short-games-after-score {after:g} reached at {steps:,} steps: mean "
                             f"{window_mean:.2f} over the last {run.recent.numel()} games; env slot"
                             f"{' 0 plays' if k == 1 else f's 0-{k - 1} play'} games cut at "
                             f"{args.short_game_length} agent steps from their next game on")
                run.short_games.set()
            if args.target_score is not None and window_mean is not None and window_mean >= args.target_score:
                console.info(f"[monitor] target score {args.target_score:g} reached: mean {window_mean:.2f} over "
                             f"the last {run.recent.numel()} games")
                run.target_reached.set()
            # wait for the next game: by global steps and/or seconds
            if (now_every := game_interval(args, run.recent_scores())) != interval:
                interval = now_every
                console.info(f"[monitor] a game of the last {run.recent.numel()} scored at least "
                             f"{args.target_score:g}: a game every {interval:,} global steps until none does"
                             if interval != args.test_every_steps else
                             f"[monitor] none of the last {run.recent.numel()} games scored at least "
                             f"{args.target_score:g}: back to --test-every-steps {interval}")
            t0 = time.time()
            while not run.stop.is_set():
                by_steps = interval > 0 and run.global_steps.value - steps_at_start >= interval
                by_time = args.test_every_seconds > 0 and time.time() - t0 >= args.test_every_seconds
                if by_steps or by_time or (args.test_every_steps == 0 and args.test_every_seconds == 0):
                    break
                time.sleep(0.2)
    finally:
        close_quietly(f)
        if tb is not None:
            tb.close()


def test(args: Namespace, shared_model: A3Clstm, run: RunState, elapsed_offset: float = 0.0,
         gate=None) -> None:
    """Process entry point of the monitor; it uses the last of ``--gpu-ids`` (or the CPU). ``gate``: GA3C's
    ``ga3c.gate.StepGate``, through which each game's weights are copied between two optimizer steps; None in A3G
    mode."""
    setup_child_process("monitor")
    device = worker_device(args.gpu_ids, len(args.gpu_ids) - 1)
    try:
        use_device(device)
        run_monitor(args, shared_model, run, device, elapsed_offset, gate)
    except BaseException as e:  # report (never blocks), then exit non-zero: the main process stops the run
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            run.errors.report(run.monitor_slot, "monitor", describe_failure(e))
        end_child_process(1)
    end_child_process(0)

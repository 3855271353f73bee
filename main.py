"""Train A3C-LSTM on Atari: batched GA3C mode by default, hogwild workers in A3G mode.

    python main.py --env PongNoFrameskip-v4                               # GA3C mode, lr 0.0002, precision auto
    python main.py --env PongNoFrameskip-v4 --workers 16 --gpu-ids 0      # A3G mode (--workers selects it)

The main process validates the configuration, builds the shared model and optimizer in shared memory, picks the
mode and drives it through ``modes.Mode``: GA3C (the default, ``ga3c/run.py``), A3G (``--mode a3g``, or any of
``--workers`` and ``--distributed-step-size``: ``a3g/run.py``, ``--workers`` training processes and one monitor) or
Ray (``--ray-address``, ``multinode/run.py``). It starts the mode's
processes, then watches them: it stops the run at ``--max-steps``, ``--max-seconds`` or ``--target-score``, on
Ctrl-C or SIGTERM, or when a process dies; it writes the full checkpoint every ``--checkpoint-every-seconds`` and
at the end.

By default a run writes its models to ``runs/<env>-ga3c/`` and its logs to ``logs/<env>-ga3c/`` (``runs/<env>/``
in A3G mode, ``runs/<env>-ray/`` on Ray); the same command with ``--load`` resumes it, and every stop prints that
command. Two runs never write into the same folder at once (a lock), and a new run never overwrites a model it did
not start from.

Exit codes: 0 a stop condition was reached; 1 a worker or the monitor failed, or a checkpoint could not be written
(the error is printed); 2 bad input (nothing started, nothing written); 130 Ctrl-C; 143 SIGTERM.
"""
from __future__ import annotations

# Before any heavy import: a child spawned from this file binds itself to the main process here, and the main
# process takes Ctrl-C / SIGTERM from this moment on (see lifeline.py).
import lifeline

if __name__ == "__mp_main__":
    lifeline.bind_to_parent()
elif __name__ == "__main__":
    STOP = lifeline.StopSignals("main.py").install()  # armed by main() once it has something to stop

import logging  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from argparse import Namespace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from a3g.run import A3gRun, shutdown  # noqa: E402
from averaging import average_line, make_average  # noqa: E402
from checkpoint import (CheckpointWriteError, ModelFileError, RunLock, RunLockedError, card_of_this_file,  # noqa: E402
                        check_checkpoint, check_state_dict, checkpoint_path, file_sha256, is_checkpoint, is_count,
                        model_path, read_weights, remove_stale_temp_files, state_dict_of, write_errors)
from config import (build_parser, policy_lag_warnings, precision_warnings, results_txt, run_folder_name,  # noqa: E402
                    cut_to_schedule, greedy_slots_line, load_folder, max_steps_cut_line, short_games_line,
                    train_envs_line, validate)
from environment import num_actions  # noqa: E402
from ga3c.settings import LATER_PASSES  # noqa: E402
from model import A3Clstm  # noqa: E402
from modes import Mode  # noqa: E402
from run_state import StartError  # noqa: E402
from schedules import linear_anneal  # noqa: E402
from shared_optim import make_optimizer  # noqa: E402
from test import csv_path, logged_scores, train_log_path  # noqa: E402
from utils import safe_name, setup_logger  # noqa: E402


def find_resume_file(args: Namespace) -> Path | None:
    """``--load``: the full checkpoint when there is one, else the drop-in ``.dat``."""
    for path in (checkpoint_path(args.load_model_dir, args.env), model_path(args.load_model_dir, args.env)):
        if path.is_file():
            return path
    return None


def checkpoint_config(args: Namespace) -> dict | None:
    """The saved configuration of the checkpoint ``--load`` would resume, read ahead of the checks; None where
    there is none or it cannot be read (the checks after it say why, in one line)."""
    try:
        path = checkpoint_path(load_folder(args), args.env)
        obj = read_weights(path) if path.is_file() else None
    except Exception:  # noqa: BLE001 - any file or flag it cannot read is reported by check_before_start
        return None
    config = obj.get("config") if obj is not None and is_checkpoint(obj) else None
    return config if isinstance(config, dict) else {} if obj is not None and is_checkpoint(obj) else None


def fail(errors: list[str]) -> None:
    """Each of ``errors`` in one line, then exit 2; nothing when there are none."""
    if not errors:
        return
    for e in errors:
        print(f"main.py: error: {e}", file=sys.stderr)
    sys.exit(2)


def folders_to_make(path: Path) -> list[Path]:
    """The folders ``path.mkdir(parents=True)`` would create, deepest first."""
    out = []
    path = path.absolute()
    while not path.exists():
        out.append(path)
        path = path.parent
    return out


def results_lines(path: Path) -> int:
    """The lines in GA3C's ``results.txt`` at ``path`` (``config.results_txt``; 0 where there is none, or it is a
    folder: refused elsewhere)."""
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except (FileNotFoundError, IsADirectoryError):
        return 0


def take_locks(args: Namespace) -> list[RunLock]:
    """This run's locks: ``--save-model-dir``'s (``.lock``, one run per folder) and ``--log-dir``'s for this env
    (``.<env>.lock``: runs of other envs may share a log folder, as upstream's ``logs/``; in GA3C mode also
    ``.results.lock``, since ``results.txt`` is one per folder), the folders made as needed. Where another run holds either, raises ``RunLockedError``, and where a folder or lock file cannot be
    made or written (a full disk), ``CheckpointWriteError``, either with nothing of this attempt left on disk (the
    folders and lock files it made are removed)."""
    wanted = [(Path(args.save_model_dir), "--save-model-dir", ".lock"),
              (Path(args.log_dir), "--log-dir", f".{safe_name(args.env)}.lock")]
    if results_txt(args) is not None:
        wanted.append((Path(args.log_dir), "--log-dir", ".results.lock"))
    made, locks = [], []
    try:
        for folder, flag, name in wanted:
            with write_errors(folder):
                for path in reversed(folders_to_make(folder)):
                    try:
                        path.mkdir()
                    except FileExistsError:  # another run made it meanwhile: its folder, not this attempt's
                        continue
                    made.append(path)
            locks.append(RunLock(folder, flag, name))
    except BaseException:  # another run's lock, a full disk, or a second Ctrl-C: leave nothing of this attempt
        for lock in locks:  # only lock files this attempt made, removed while it holds them
            if lock.created:
                lock.remove()
            else:
                lock.release()
        for folder in sorted(set(made), key=lambda p: len(p.parts), reverse=True):
            try:
                folder.rmdir()
            except OSError:
                pass
        raise
    return locks


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed (Python's MemoryError, or torch's allocator error)."""
    return isinstance(e, MemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e)


def shared_memory_full(e: BaseException) -> bool:
    """Whether ``e`` is torch failing to make a shared-memory file (``/dev/shm/torch_<pid>_...``) for the weights
    and statistics the processes share: a full or small ``/dev/shm`` (Docker's default is 64 MB)."""
    return isinstance(e, RuntimeError) and "</torch_" in str(e)


def first_line(e: BaseException) -> str:
    """The gist of ``e`` in one line, without the ``[enforce fail at ...] err == 0.`` that starts torch's allocator
    error."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[enforce fail[^\]]*\]\s*(err == 0\.\s*)?", "", text)


def checkpoint_games(ckpt: dict) -> tuple[int, float]:
    """The checkpoint's monitor games and the sum of their scores (none in a checkpoint without them)."""
    monitor = ckpt.get("monitor")
    return (0, 0.0) if monitor is None else (int(monitor[0].item()), float(monitor[1].item()))


def monitor_csv_is_the_checkpoints(scores: list[float], ckpt: dict, log_dir: str) -> bool:
    """Whether the monitor CSV in ``log_dir``, whose games scored ``scores``, can be the one of the run that wrote
    ``ckpt``: it is in the log folder that run used, or its first games are the checkpoint's (as many, with the
    same sum of scores; games after the checkpoint's are those of a run killed before its next one)."""
    saved = (ckpt.get("config") or {}).get("log_dir")
    if isinstance(saved, str) and saved and Path(saved).resolve() == Path(log_dir).resolve():
        return True
    count, total = checkpoint_games(ckpt)
    return len(scores) >= count and math.isclose(sum(scores[:count]), total, rel_tol=1e-9, abs_tol=1e-6)


def resume_problems(ckpt: dict, path: Path, args: Namespace, n_actions: int) -> list[str]:
    """Why the checkpoint at ``path`` cannot be resumed with these flags, found before anything is written: it was
    trained on another game than ``--env``'s (another id of the same game is a resume like any), or its optimizer
    statistics, where this run would load them, do not fit the model."""
    errors = []
    saved_env = ckpt.get("env") or (ckpt.get("config") or {}).get("env")
    if isinstance(saved_env, str) and saved_env != args.env:
        from environment import EnvIdError, resolve_env_id
        try:
            was, now = resolve_env_id(saved_env).game, resolve_env_id(args.env).game
        except EnvIdError:
            was = now = None
        if was is not None and was != now:  # its weights, Adam's statistics, steps and monitor games are another game's
            errors.append(f"--load: {path} was trained on {saved_env} ({was}), and --env {args.env} is {now}: pass "
                          f"--env {saved_env} to go on with it, or --load-model-dir with a {now} run's folder")
    opt_state = ckpt.get("optimizer")
    if args.shared_optimizer and opt_state is not None and ckpt.get("optimizer_name") == args.optimizer:
        probe = make_optimizer(args.optimizer, A3Clstm(1, n_actions, args.hidden_size).parameters(), args.lr,
                               args.amsgrad, shared=True, eps=args.optimizer_eps)  # the class the run loads them into
        try:
            probe.load_state_dict(opt_state)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, IndexError) as e:
            errors.append(f"--load: {path}: its optimizer statistics do not fit this model ({str(e)[:160]}): the "
                          f"checkpoint is damaged, or pass --optimizer with another optimizer to start its "
                          f"statistics afresh")
    return errors


def target_met_line(ckpt: dict, args: Namespace) -> str:
    """A line for a resumed run whose checkpoint's last ``--score-window`` monitor games already meet
    ``--target-score`` (it will stop after its first game); else ''."""
    recent = [float(x) for x in ckpt.get("recent_scores", [])][-args.score_window:]
    if args.target_score is None or len(recent) < args.score_window or sum(recent) / len(recent) < args.target_score:
        return ""
    return (f"the checkpoint's last {len(recent)} monitor games already average {sum(recent) / len(recent):.2f}, at "
            f"--target-score {args.target_score:g}: this run stops after its first monitor game if the mean stays "
            f"there (to train on, resume with a higher --target-score, or none)")


BOOL_WORDS = {"true", "false", "yes", "no", "y", "n", "1", "0", "on", "off"}


def longer_schedule(anneal_steps: int, steps: int) -> int:
    """The ``--lr-anneal-steps`` that the command printed at a schedule's end gives: twice the schedule, or, where
    the run stopped at or past that (a batch past a small schedule's end), those global steps plus the schedule,
    so that it ends after them."""
    return 2 * anneal_steps if steps < 2 * anneal_steps else steps + anneal_steps


def resume_command(argv: list[str], args: Namespace, reason: str, steps: int = 0) -> str:
    """The command that continues this run: its own flags without any ``--load``/``--load-model-dir`` (so it
    resumes from its own ``--save-model-dir``), plus ``--load``; after ``--max-steps`` was reached, with a budget
    of twice that or of ``steps`` (the global steps it stopped at, a little past it) plus that, whichever is more
    (twice a small budget can be below where the run stopped, which ``--load`` refuses); after ``--target-score``
    was reached, without it (the restored games already meet it) and without ``--confirm-every-steps``, which is
    refused without a target; after the end of ``--lr-anneal-steps``, with a schedule about twice as long
    (``longer_schedule``) and without ``--max-steps``."""
    reached = reason.startswith("reached --max-steps")
    target = reason.startswith("reached --target-score")
    annealed = reason.startswith("reached the end of --lr-anneal-steps")
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name, has_value = a.split("=", 1)[0], "=" in a
        if name in ("--load", "-ld", "--no-load"):
            i += 2 if not has_value and i + 1 < len(argv) and argv[i + 1].lower() in BOOL_WORDS else 1
            continue
        if name in ("--load-model-dir", "-lmd") or (reached and name == "--max-steps") or (
                target and name in ("--target-score", "--confirm-every-steps")) or (
                annealed and name in ("--max-steps", "--lr-anneal-steps")):
            i += 1 if has_value else 2
            continue
        out.append(a)
        i += 1
    if reached:
        out += ["--max-steps", str(max(2 * args.max_steps, steps + args.max_steps))]
    if annealed:  # a --max-steps of its own would cut the longer schedule again
        out += ["--lr-anneal-steps", str(longer_schedule(args.lr_anneal_steps, steps))]
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith("main.py") else "main.py"
    return shlex.join(["python", script, *out, "--load"])


def report_status(log, tb, mode: Mode, steps: int, rate: float, span: float, args: Namespace) -> None:
    """One status line in the training log (ending with the scheduled learning rate and entropy weight where
    annealed, and the run's precision) and, with --tensorboard-logger, the same numbers in TensorBoard."""
    line, scalars = mode.status(rate, span)
    if args.lr_anneal_steps:
        scalars["charts/learning_rate"] = linear_anneal(args.lr, steps, args.lr_anneal_steps)
        line += f" | lr {scalars['charts/learning_rate']:.3g}"
    if args.entropy_anneal_steps:
        scalars["charts/entropy_coef"] = linear_anneal(args.entropy_coef, steps, args.entropy_anneal_steps)
        line += f" | entropy-coef {scalars['charts/entropy_coef']:.3g}"
    log.info(f"{line} | {args.compute_precision}")
    if tb is None:
        return
    for name, value in scalars.items():
        tb.add_scalar(name, value, steps)
    tb.flush()


def main_failure_line(e: Exception, log) -> str:
    """One line for a failure of the main process itself: a file it could not write (``CheckpointWriteError``), or
    else the exception's first line, its traceback logged."""
    if isinstance(e, CheckpointWriteError):
        return str(e)
    log.info("the main process failed:\n" + "".join(traceback.format_exception(e)).rstrip())
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"the main process failed: {type(e).__name__}" + (f": {first}" if first else "")


def attempt(step, log) -> str:
    """``step()``; '' when it returned, else the one line that says why it failed (``main_failure_line``)."""
    try:
        step()
    except Exception as e:
        return main_failure_line(e, log)
    return ""


def exited_unexpectedly(procs: list[tuple[str, mp.Process]], mode: Mode,
                        budget_reached: bool) -> tuple[str, int] | None:
    """The first process that ended on its own, unless its mode expected it (a worker that stopped at the step
    budget, an agent that ``--dynamic`` retired)."""
    for role, p in procs:
        if p.is_alive() or mode.expected_exit(role, p, budget_reached):
            continue
        return role, p.exitcode
    return None


def mode_change_line(saved_config: dict, args: Namespace) -> str:
    """The line that says a resumed checkpoint (its saved ``config``) was trained in another mode than this run's,
    and, where this run is GA3C mode by default, how to go on in the checkpoint's; "" when the modes are the same."""
    names = {"a3g": "A3G mode", "ga3c": "GA3C mode", "ray": "A3G mode on Ray"}
    was_mode = "ray" if saved_config.get("ray_address") else saved_config.get("mode", "a3g")
    now_mode = "ray" if args.ray_address is not None else args.mode
    if was_mode == now_mode or was_mode not in names:
        return ""
    how = {"a3g": " (--mode a3g goes on in A3G mode)", "ray": " (--ray-address ADDRESS goes on on Ray)"}
    return (f"the checkpoint was trained in {names[was_mode]}; this run goes on in {names[now_mode]}"
            + (how.get(was_mode, "") if now_mode == "ga3c" else ""))


# the update's and the games' settings a resume takes from its command line like any run (the defaults where not
# given), said in one line where they are not the checkpoint's; the lines above say the others (the mode, the
# learning rate and Adam's, the schedules, GA3C's batch, passes and slots, the envs, the frames, the precision)
# (not --env-config: a path, which names the same table from another folder or clone)
TRAINING_FLAGS = ("num_steps", "gamma", "tau", "entropy_coef", "value_coef", "max_grad_norm", "is_clip",
                  "max_episode_length", "skip_rate", "distributed_step_size", "replay_activations", "sync_every",
                  "ema_steps", "score_window")


def training_flags_change_line(saved_config: dict, args: Namespace) -> str:
    """The line that names each of ``TRAINING_FLAGS`` whose value differs from the resumed checkpoint's saved
    ``config`` (a flag it has no record of is not named); "" when none does. Before, a resume without the first
    command's flags went back to the defaults without a word (--max-grad-norm 40 -> 0 turned clipping off)."""
    def show(v):
        return "none" if v is None or v == [] else " ".join(map(str, v)) if isinstance(v, list) else f"{v}"

    changed = []
    for k in TRAINING_FLAGS:
        if k not in saved_config:
            continue
        was, now = saved_config[k], getattr(args, k)
        now = list(now) if isinstance(now, tuple) else now
        if was != now:
            changed.append(f"--{k.replace('_', '-')} {show(was)} -> {show(now)}")
    if not changed:
        return ""
    return ("the command line changes the checkpoint's " + ", ".join(changed)
            + " (pass the checkpoint's values to keep them: the resume line its run printed has them)")


def train_envs_change_line(saved_config: dict, args: Namespace) -> str:
    """The line that says a resumed checkpoint's learners played other env ids than this run's (each env slot's or
    worker's frame statistics carry over by position); "" when they are the same."""
    was = saved_config.get("train_envs") or [saved_config.get("env", args.env)]
    now = args.train_envs or [args.env]
    if list(was) == list(now):
        return ""
    return (f"the checkpoint's learners played {' '.join(was)}; this run's play {' '.join(now)} (--train-envs; the "
            f"frame statistics carry over by env slot or worker)")


def see_skipped_change_line(saved_config: dict, args: Namespace, source: str = "the checkpoint") -> str:
    """The line that says a resumed checkpoint (or the model whose card is ``source``) saw other observations than
    this run's learners will (``--see-skipped-frames`` given to one and not the other); "" when they are the
    same."""
    was, now = bool(saved_config.get("see_skipped_frames", False)), bool(args.see_skipped_frames)
    if was == now or not plays_emulator_skips(args):
        return ""
    words = {False: "the emulator's last frame of each step", True: "the max over each step's last frames (up to 3)"}
    trained = "the checkpoint was" if source == "the checkpoint" else f"{source} says the model was"
    return (f"{trained} trained on {words[was]}; this run's games show {words[now]} (--see-skipped-frames, "
            f"for ids whose emulator skips frames)")


def plays_emulator_skips(args: Namespace) -> bool:
    """Whether ``--env`` or an id of ``--train-envs`` skips frames in the emulator (what ``--see-skipped-frames``
    changes; ``NoFrameskip`` ids show the max over the skipped frames either way)."""
    from environment import resolve_env_id
    return any(not resolve_env_id(e).frameskip_by_us for e in [args.env, *(args.train_envs or [])])


def see_skipped_line(args: Namespace) -> str:
    """The start-up line of a run with ``--see-skipped-frames`` that plays an id whose emulator skips frames; ""
    otherwise."""
    if not args.see_skipped_frames or not plays_emulator_skips(args):
        return ""
    return ("every game shows the max over each step's last frames, up to 3 (--see-skipped-frames: ids whose "
            "emulator skips frames are stepped one frame at a time, with their own skip)")


def optimizer_not_resumed_line(ckpt: dict, args: Namespace) -> str:
    """Why a resumed run starts with fresh optimizer statistics."""
    saved_name = ckpt.get("optimizer_name")
    if not args.shared_optimizer:
        why = "--no-shared-optimizer gives " + ("the GA3C server" if args.mode == "ga3c" else "each worker") + \
              " a fresh optimizer of its own"
        if ckpt.get("optimizer") is not None:
            why += "; the checkpoint's shared statistics stay unused"
    elif ckpt.get("optimizer") is None:
        why = "the checkpoint has none (its run used --no-shared-optimizer)"
    else:
        why = f"the checkpoint's are {saved_name}'s and this run uses {args.optimizer}"
    return f"optimizer statistics not resumed: {why}"


def train_batch_change_line(saved_config: dict, args: Namespace) -> str:
    """The line that says a resumed GA3C checkpoint was trained with another ``--train-batch`` than this GA3C run's
    (its default follows the env slots); "" otherwise."""
    was = saved_config.get("train_batch")
    if args.mode != "ga3c" or saved_config.get("mode") != "ga3c" or was in (None, args.train_batch):
        return ""
    return f"the checkpoint was trained with --train-batch {was}; this run goes on with --train-batch {args.train_batch}"


def keep_checkpoint_schedule(saved_config: dict, args: Namespace) -> str:
    """On a resume, ``--lr-anneal-steps`` and (GA3C checkpoint into GA3C mode) ``--train-passes`` and
    ``--later-passes`` that the command line does not give are the checkpoint's (before those flags: 0, 1 and
    full), not the defaults, and ``--max-steps`` is cut again to that schedule: a run goes on as it was started.
    Returns the line that says which values were kept where they differ from the defaults, or ""."""
    given = getattr(args, "_given", ("lr_anneal_steps", "train_passes", "later_passes"))  # not parsed: all given
    kept = []
    def count(value, least):  # a damaged value is not kept: check_checkpoint refuses the file in one line
        return is_count(value) and value >= least

    if "lr_anneal_steps" not in given and args.ray_address is None:  # Ray mode has no schedule (validate_ray)
        was = saved_config.get("lr_anneal_steps", 0)
        if count(was, 0) and was != args.lr_anneal_steps:
            kept.append(("lr_anneal_steps", was, args.lr_anneal_steps))
            args.lr_anneal_steps = was
            cut_to_schedule(args)
    if "train_passes" not in given and args.mode == "ga3c" and saved_config.get("mode") == "ga3c":
        was = saved_config.get("train_passes", 1)
        if count(was, 1) and was != args.train_passes:
            kept.append(("train_passes", was, args.train_passes))
            args.train_passes = was
    if ("later_passes" not in given and args.mode == "ga3c" and saved_config.get("mode") == "ga3c"
            and args.train_passes > 1):  # with one pass it changes nothing
        was = saved_config.get("later_passes", "full")
        if was in LATER_PASSES and was != args.later_passes:  # another value: check_checkpoint refuses the file
            kept.append(("later_passes", was, args.later_passes))
            args.later_passes = was
    if not kept:
        return ""

    def show(value):
        return f"{value:,}" if isinstance(value, int) else value

    return ("kept the checkpoint's " + " and ".join(f"--{k.replace('_', '-')} {show(was)}" for k, was, _ in kept)
            + f" ({args.mode.upper()} mode's default" + ("s are " if len(kept) > 1 else " is ")
            + " and ".join(show(default) for _, _, default in kept)
            + ("; give the flags to change them)" if len(kept) > 1 else "; give the flag to change it)"))


def train_passes_change_line(saved_config: dict, args: Namespace) -> str:
    """The line that says a resumed GA3C checkpoint was trained with other ``--train-passes`` (or, with several,
    another ``--pass-clip`` or ``--later-passes``) than this GA3C run; "" otherwise (checkpoints from before the
    flags: one pass; full later passes)."""
    if args.mode != "ga3c" or saved_config.get("mode") != "ga3c":
        return ""

    def passes(cfg):
        k = cfg.get("train_passes", 1)
        later = cfg.get("later_passes", "full")
        return f"--train-passes {k}" + (f" --pass-clip {cfg.get('pass_clip', 0.2):g}" if k > 1 else "") + (
            f" --later-passes {later}" if k > 1 and later != "full" else "")

    was, now = passes(saved_config), passes(vars(args))
    return "" if was == now else f"the checkpoint was trained with {was}; this run goes on with {now}"


def slots_change_line(saved_config: dict, args: Namespace) -> str:
    """The line that says a resumed GA3C checkpoint was trained with other ``--short-game-slots`` (and, with some,
    ``--short-game-length``) or ``--greedy-slots`` than this GA3C run; "" otherwise (checkpoints from before the
    flags: none)."""
    if args.mode != "ga3c" or saved_config.get("mode") != "ga3c":
        return ""

    def slots(cfg):
        k, g = cfg.get("short_game_slots", 0), cfg.get("greedy_slots", 0)
        if k == 0 and g == 0:
            return "no short-game or greedy slots"
        after = cfg.get("short_games_after_score")
        return " ".join(([f"--short-game-slots {k} --short-game-length {cfg.get('short_game_length', 150)}"]
                         + ([f"--short-games-after-score {after:g}"] if after is not None else [])
                         if k else []) + ([f"--greedy-slots {g}"] if g else []))

    was, now = slots(saved_config), slots(vars(args))
    return "" if was == now else f"the checkpoint was trained with {was}; this run goes on with {now}"


def started_short_games(resume_ckpt: dict | None, run) -> float | None:
    """The ``--short-games-after-score`` that the resumed checkpoint's run reached, where this run's short-game slots
    cut from the start (the switch restored: ``ga3c.run.short_games_go_on``); None otherwise."""
    if resume_ckpt is None or not run.short_games.is_set():
        return None
    return (resume_ckpt.get("config") or {}).get("short_games_after_score")


def start_average(args: Namespace, shared_model: A3Clstm, resume_ckpt: dict | None, resume_path: Path | None,
                  log) -> A3Clstm | None:
    """The moving average of the weights (``--ema-steps``; None without it), in shared memory: a resumed
    checkpoint's own, else the weights the run starts from. Logs which, and that a checkpoint's average goes unused
    without the flag."""
    saved = resume_ckpt.get("average_model") if resume_ckpt is not None else None
    if not args.ema_steps:
        if saved is not None:
            log.info("the checkpoint's moving average of the weights is not resumed (no --ema-steps): the monitor "
                     "plays, and the .dat holds, the latest weights")
        return None
    average = make_average(shared_model)
    if saved is not None:
        average.load_state_dict(saved, strict=True)
        was = (resume_ckpt.get("config") or {}).get("ema_steps")
        log.info("resumed the moving average of the weights"
                 + (f" (the command line changes --ema-steps {was:,} -> {args.ema_steps:,})"
                    if was and was != args.ema_steps else ""))
    elif resume_path is not None:
        log.info(f"the moving average of the weights starts at {resume_path}'s weights")
    return average


def check_before_start(args: Namespace) -> tuple[int, dict | None, dict | None, Path | None]:
    """Every check made before anything is written (the flags, the file to resume, the folders to write in);
    exits 2 with one line per problem. Returns the env's action count and, with ``--load``, the checkpoint (or
    None for a bare ``.dat``), its weights and its path. The checkpoint's schedule and passes are kept
    (``keep_checkpoint_schedule``) before the flags are checked, so that the checks see the values the run uses."""
    saved = checkpoint_config(args) if args.load else None
    args._kept_line = keep_checkpoint_schedule(saved, args) if saved is not None else ""
    errors = validate(args)
    if errors:
        fail(errors)
    for line in precision_warnings(args) + policy_lag_warnings(args):
        print(f"main.py: {line}", file=sys.stderr, flush=True)
    n_actions = num_actions(args.env)

    resume_ckpt, resume_sd, resume_path = None, None, None
    if args.load:
        resume_path = find_resume_file(args)
        folders = [p for p in (checkpoint_path(args.load_model_dir, args.env), model_path(args.load_model_dir, args.env))
                   if p.is_dir()]
        if resume_path is None and folders:
            fail([f"--load: {folders[0]} is a folder, not a model file: move it away, or pass --load-model-dir DIR "
                  f"with the run's files"])
        if resume_path is None:
            a3g_dir = Path("runs") / safe_name(args.env)  # A3G mode's default folder
            hint = (" (a shipped model is in trained_models/: --load-model-dir trained_models/)"
                    if model_path("trained_models", args.env).is_file() else "")
            ga3c_dir = Path("runs") / f"{safe_name(args.env)}-ga3c"  # GA3C mode's default folder
            if (args.mode == "ga3c" and args.ray_address is None
                    and Path(args.load_model_dir) == Path("runs") / run_folder_name(args)
                    and checkpoint_path(a3g_dir, args.env).is_file()):
                hint = f" (an A3G-mode run is in {a3g_dir}: add --mode a3g to resume it in A3G mode)"
            elif (args.mode == "a3g" and args.ray_address is None
                    and Path(args.load_model_dir) == Path("runs") / run_folder_name(args)
                    and checkpoint_path(ga3c_dir, args.env).is_file()):
                hint = (f" (a GA3C-mode run is in {ga3c_dir}: leave out --mode a3g, --workers and "
                        f"--distributed-step-size to resume it in GA3C mode)")
            fail([f"--load: neither {checkpoint_path(args.load_model_dir, args.env)} nor "
                  f"{model_path(args.load_model_dir, args.env)} exists, nothing to resume (check --save-model-dir, "
                  f"--load-model-dir and --env){hint}"])
        try:
            obj = read_weights(resume_path)
            resume_sd = state_dict_of(obj, resume_path)
            check_state_dict(resume_sd, n_actions, args.hidden_size, resume_path, args.env)
            if is_checkpoint(obj):
                check_checkpoint(obj, resume_path)
                if obj.get("average_model") is not None:
                    check_state_dict(obj["average_model"], n_actions, args.hidden_size, resume_path, args.env)
        except ModelFileError as e:
            fail([str(e)])
        resume_ckpt = obj if is_checkpoint(obj) else None
        done = int(resume_ckpt.get("global_steps", 0)) if resume_ckpt is not None else 0
        if args.max_steps and done >= args.max_steps:
            limit = (f"the end of --lr-anneal-steps {args.lr_anneal_steps:,}" if args.max_steps == args.lr_anneal_steps
                     else f"--max-steps {args.max_steps:,}")
            more = ("--lr-anneal-steps (and --max-steps, where given: a run stops at the end of its schedule), or "
                    "--lr-anneal-steps 0 for a constant --lr," if "anneal" in limit else "--max-steps (0: no limit)")
            fail([f"--load: {resume_path} is at {done:,} global steps, already at {limit}: pass a larger {more} to "
                  f"train on"])
        if resume_ckpt is not None:
            fail(resume_problems(resume_ckpt, resume_path, args, n_actions))
    same_dir = Path(args.load_model_dir).resolve() == Path(args.save_model_dir).resolve()
    problems = []
    games = logged_scores(csv_path(args.log_dir, args.env))
    if args.load and same_dir and resume_ckpt is not None and games and not monitor_csv_is_the_checkpoints(
            games, resume_ckpt, args.log_dir):
        problems.append(f"{csv_path(args.log_dir, args.env)} holds {len(games)} monitor game(s) that are not "
                        f"{resume_path}'s first {checkpoint_games(resume_ckpt)[0]:,} (another run's), and this run "
                        f"would add its own to them: pass --log-dir DIR with this run's log folder, or another one")
    elif args.load and same_dir and resume_ckpt is None and games:
        problems.append(f"{csv_path(args.log_dir, args.env)} holds {len(games)} monitor game(s), and {resume_path} is "
                        f"a bare model file, without the step count, time and games a checkpoint keeps (a run killed "
                        f"before its first checkpoint): this run would count from 0 in that file: pass --log-dir DIR "
                        f"with another folder (or move the file away)")
    elif not (args.load and same_dir) and games:
        how = ("pass --log-dir DIR with another folder, since this run resumes from --load-model-dir "
               f"{args.load_model_dir} into another --save-model-dir" if args.load else
               "to continue that run, pass --load (with its --save-model-dir); to start afresh, pass --log-dir DIR "
               "with another folder")
        problems.append(f"{csv_path(args.log_dir, args.env)} holds {len(games)} monitor game(s) of an earlier run, "
                        f"and this run would add its own to them: {how} (or move the file away)")
    results = results_txt(args)
    results_games = results_lines(results) if results is not None else 0
    if results_games and not (args.load and same_dir):
        how = (f"this run resumes from --load-model-dir {args.load_model_dir} into another --save-model-dir, so pass "
               f"--log-dir DIR with another folder" if args.load else
               "to continue that run, pass --load (with its --save-model-dir); to start afresh, pass --log-dir DIR "
               "with another folder")
        problems.append(f"{results} holds {results_games} game(s) of an earlier GA3C run (of this env or another), "
                        f"and this run would add its own to them: {how} (or move the file away)")
    existing = [p for p in (model_path(args.save_model_dir, args.env), checkpoint_path(args.save_model_dir, args.env))
                if p.exists()]
    folders = [p for p in existing if p.is_dir()]
    if folders:  # a resume into the same folder too: every write there would fail after training
        problems.append(f"{folders[0]} is a folder where this run would write its model file: move it away, or "
                        f"pass --save-model-dir DIR with another folder")
    elif not (args.load and same_dir):
        if existing and args.load:  # from --load-model-dir into a --save-model-dir that holds another model
            problems.append(f"{existing[0]} exists and this run, which resumes from --load-model-dir "
                            f"{args.load_model_dir}, would overwrite it: leave out --load-model-dir to go on with the "
                            f"run in --save-model-dir {args.save_model_dir}, or pass --save-model-dir DIR with another "
                            f"folder")
        elif existing:
            problems.append(f"{existing[0]} exists and this run would overwrite it: to continue training from it, pass "
                            f"--load (it resumes from --save-model-dir {args.save_model_dir}); to start afresh, pass "
                            f"--save-model-dir DIR with another folder")
    fail(problems)
    return n_actions, resume_ckpt, resume_sd, resume_path


def main(argv: list[str] | None = None) -> int:
    stop = globals().get("STOP") or lifeline.StopSignals().install()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        n_actions, resume_ckpt, resume_sd, resume_path = check_before_start(args)
    except PermissionError as e:  # a folder on the way that this user cannot enter (Path.exists raises EACCES)
        fail([f"'{e.filename}' cannot be read ({e.strerror}): pick folders this user can read and write"])
    if stop.signal is not None:  # before anything is written
        print(f"main.py: {stop.reason} before training started; nothing written", file=sys.stderr)
        return stop.exit_code
    stop.arm()  # from here on a second stop signal raises KeyboardInterrupt, to stop what was started

    ray_module = None
    if args.ray_address is not None:  # an address that does not answer, or a cluster too small: bad input
        from multinode.run import RayConnectError, RayStopped, connect
        try:
            ray_module = connect(args, stop)  # Ray installs a SIGTERM handler of its own; ``stop`` comes back after
        except RayConnectError as e:
            fail([str(e)])
        except RayStopped as e:
            stop.signal = stop.signal or e.signum
        except KeyboardInterrupt:  # a second stop signal while connecting
            stop.signal = stop.signal or signal.SIGINT
        if stop.signal is not None:
            from multinode.run import shutdown_quietly
            clean = shutdown_quietly(args.ray_address == "local")
            print(f"main.py: {stop.reason} before training started; nothing written", file=sys.stderr)
            if not clean:
                sys.stderr.flush()
                os._exit(stop.exit_code)
            return stop.exit_code
    locks: list[RunLock] = []
    try:
        try:
            locks = take_locks(args)
        except (RunLockedError, CheckpointWriteError) as e:
            if ray_module is not None:
                ray_module.shutdown()
            fail([str(e)])
        code = run_training(args, argv, stop, n_actions, resume_ckpt, resume_sd, resume_path, ray_module)
    except KeyboardInterrupt:  # a second stop signal before run_training's own handling began: nothing started
        why = stop.reason if stop.signal is not None else "interrupted (Ctrl-C)"
        print(f"main.py: {why} before training started; no process was started", file=sys.stderr)
        code = stop.exit_code or 130
        if ray_module is not None:
            from multinode.run import shutdown_quietly
            shutdown_quietly(args.ray_address == "local")  # shutdown_hung() below says whether it finished
    finally:
        for lock in locks:
            lock.release()
    if ray_module is not None:
        from multinode.run import shutdown_hung
        if shutdown_hung():  # Ray's shutdown waits on processes a stop signal killed: its exit handler would too
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def run_training(args: Namespace, argv: list[str], stop: lifeline.StopSignals, n_actions: int, resume_ckpt,
                 resume_sd, resume_path, ray_module=None) -> int:
    """The run proper, with this run's lock on ``--save-model-dir`` held."""
    stale = remove_stale_temp_files(args.save_model_dir)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    log = setup_logger(f"main.{safe_name(args.env)}", train_log_path(args.log_dir, args.env), console=True)
    for path in stale:
        log.info(f"removed {path}, a partial write of a run that died while saving")

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    try:  # the shared model, optimizer and run state: a size too large for this machine is one line
        torch.manual_seed(args.seed)
        shared_model = A3Clstm(1, n_actions, args.hidden_size)
        if resume_sd is not None:
            shared_model.load_state_dict(resume_sd, strict=True)
        shared_model.share_memory()
        optimizer = None
        if args.shared_optimizer:
            optimizer = make_optimizer(args.optimizer, shared_model.parameters(), args.lr, args.amsgrad, shared=True,
                                       eps=args.optimizer_eps)
        mode: Mode
        if args.ray_address is not None:
            from multinode.run import RayRun
            mode = RayRun(args, shared_model, optimizer, log, ray_module, stop)
        elif args.mode == "ga3c":
            from ga3c.run import Ga3cRun
            mode = Ga3cRun(args, shared_model, optimizer, log)
        else:
            mode = A3gRun(args, shared_model, optimizer, log)
        run = mode.run
        mode.average_model = start_average(args, shared_model, resume_ckpt, resume_path, log)
    except (MemoryError, RuntimeError) as e:
        if shared_memory_full(e):
            log.info(f"main.py: error: the shared memory is full ({first_line(e)}): free space in /dev/shm (in a "
                     f"container, give it more: docker run --shm-size 2g), or use a smaller --hidden-size or fewer "
                     f"processes or env slots")
            return 2
        if not out_of_memory(e):
            raise
        log.info(f"main.py: error: not enough memory on this machine for the run ({first_line(e)}): use a "
                 f"smaller --hidden-size or --score-window, or fewer processes or env slots")
        return 2
    elapsed_offset = 0.0
    if resume_ckpt is not None:
        mode.restore(resume_ckpt)
        elapsed_offset = float(resume_ckpt.get("elapsed_seconds", 0.0))
        opt_state = resume_ckpt.get("optimizer")
        if optimizer is not None and opt_state is not None and resume_ckpt.get("optimizer_name") == args.optimizer:
            try:
                optimizer.load_state_dict(opt_state)
            except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
                log.info(f"main.py: error: {resume_path}: the optimizer state does not fit this model ({e})")
                return 2
            log.info(f"resumed the {args.optimizer} statistics")
            saved = optimizer.saved_hyperparameters(opt_state)[0]
            changed = [f"{k} {saved[k]} -> {v}" for k, v in optimizer.param_groups[0].items()
                       if k in ("lr", "amsgrad", "eps") and k in saved and saved[k] != v]
            if changed:
                log.info("the command line changes the checkpoint's " + ", ".join(changed))
        else:
            log.info(optimizer_not_resumed_line(resume_ckpt, args))
    if resume_path is not None:
        log.info(f"loaded {resume_path}" + (f" at {run.global_steps.value:,} global steps" if resume_ckpt else
                                            " (a bare model file: its steps count from 0, and so does --lr-anneal-steps)"
                                            if args.lr_anneal_steps else ""))

    if resume_path is not None and resume_ckpt is None:  # a bare .dat: its card, where it describes this file
        card = card_of_this_file(resume_path, file_sha256(resume_path))
        line = see_skipped_change_line({"see_skipped_frames": card.get("see_skipped_frames") is True}, args,
                                       str(resume_path.with_suffix(".json"))) if card is not None else ""
        if line:
            log.info(line)
    if resume_ckpt is not None:
        saved_config = resume_ckpt.get("config") or {}
        changed = [f"--{k.replace('_', '-')} {saved_config.get(k, 0):,} -> {getattr(args, k):,}"
                   for k in ("lr_anneal_steps", "entropy_anneal_steps") if saved_config.get(k, 0) != getattr(args, k)]
        if changed:
            log.info("the command line changes the checkpoint's schedule: " + ", ".join(changed))
        for line in (getattr(args, "_kept_line", ""), mode_change_line(saved_config, args),
                     train_batch_change_line(saved_config, args),
                     train_passes_change_line(saved_config, args), slots_change_line(saved_config, args),
                     train_envs_change_line(saved_config, args), see_skipped_change_line(saved_config, args),
                     training_flags_change_line(saved_config, args), target_met_line(resume_ckpt, args)):
            if line:
                log.info(line)
        was = saved_config.get("compute_precision", "fp32")
        if was != args.compute_precision:
            log.info(f"the checkpoint was trained in {was}; this run goes on in {args.compute_precision} (the files "
                     f"are float32 in either)")
    log.info(f"training {args.env} ({n_actions} actions) {mode.describe()} in {args.compute_precision}; stop at "
             + ", ".join(s for s in [
                 f"{args.max_steps:,} steps" if args.max_steps else "",
                 f"{args.max_seconds:g} s" if args.max_seconds else "",
                 f"mean score {args.target_score:g}" if args.target_score is not None else "",
                 "Ctrl-C"] if s))
    for line in (max_steps_cut_line(args), train_envs_line(args),
                 short_games_line(args, started_short_games(resume_ckpt, run)), greedy_slots_line(args),
                 see_skipped_line(args), average_line(args)):
        if line:
            log.info(line)
    for what, start, anneal in (("learning rate", args.lr, args.lr_anneal_steps),
                                ("entropy bonus", args.entropy_coef, args.entropy_anneal_steps)):
        if anneal:
            log.info(f"{what} {start:g} annealed linearly to 0 at {anneal:,} global steps "
                     f"(now {linear_anneal(start, run.global_steps.value, anneal):.3g})")
    log.info(f"models: {args.save_model_dir} | logs: {args.log_dir}"
             + (f" | tensorboard --logdir {Path(args.log_dir) / 'runs'}" if args.tensorboard_logger else ""))

    procs: list[tuple[str, mp.Process]] = []
    code, reason = 0, ""
    tb = None
    start = last_status = time.time()
    status_steps = run.global_steps.value
    try:
        if stop.signal is None:
            try:
                procs = mode.launch(ctx, elapsed_offset)
            except (StartError, CheckpointWriteError) as e:  # one line; the finally below cleans up
                code, reason = (stop.exit_code, stop.reason) if stop.signal is not None else (1, str(e))
        if args.tensorboard_logger and stop.signal is None:
            from torch.utils.tensorboard import SummaryWriter
            tb = SummaryWriter(str(Path(args.log_dir) / "runs" / f"{safe_name(args.env)}_training"))
        last_ckpt = last_status = time.time()
        status_steps = run.global_steps.value
        while not reason:
            if stop.signal is not None:
                code, reason = stop.exit_code, stop.reason
                break
            # Which processes ended is read before the counters: a worker that exits at the step budget has
            # counted its last steps before it exits, so the budget check below sees them. A process that died is
            # reported before any stop condition met in the same tick, so that a failure never ends a run with 0.
            ended = [(role, p) for role, p in procs if not p.is_alive()]
            now = time.time()
            steps = run.global_steps.value
            budget_reached = bool(args.max_steps) and steps >= args.max_steps
            dead = exited_unexpectedly(ended, mode, budget_reached)
            if dead:
                code, reason = 1, f"{dead[0]} exited unexpectedly (exit code {dead[1]})"
                break
            if budget_reached:
                reason = (f"reached the end of --lr-anneal-steps {args.lr_anneal_steps:,} (the learning rate is 0)"
                          if args.lr_anneal_steps == args.max_steps else f"reached --max-steps {args.max_steps:,}")
                break
            if args.max_seconds and now - start >= args.max_seconds:
                reason = f"reached --max-seconds {args.max_seconds:g}"
                break
            if run.target_reached.is_set():
                reason = f"reached --target-score {args.target_score:g}"
                break
            mode.tick(now)  # raises CheckpointWriteError where GA3C's results.txt cannot be written (below)
            if mode.failed:
                code, reason = 1, mode.failed
                break
            if now - last_ckpt >= args.checkpoint_every_seconds:
                try:
                    mode.save(elapsed_offset + now - start)
                except CheckpointWriteError as e:
                    code, reason = 1, str(e)
                    break
                last_ckpt = now
            if now - last_status >= args.status_every_seconds:
                report_status(log, tb, mode, steps, (steps - status_steps) / (now - last_status), now - last_status,
                              args)
                last_status, status_steps = now, steps
            time.sleep(0.2)
    except KeyboardInterrupt:
        code, reason = 130, "interrupted (Ctrl-C)"
    except Exception as e:  # the main process's own failure: the run ends as when a process fails
        code, reason = 1, main_failure_line(e, log)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the shutdown below is bounded; let it finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # the processes started so far, also where a second Ctrl-C interrupted the launch before it returned
        procs = procs or list(mode.procs)
        shutdown(procs, run, slot_of=mode.slot_of)
        # Each step below is attempted whatever the one before it raised, so that the final checkpoint is always
        # tried: a failure is one more line, and the exit code 1.
        def failed(line: str) -> None:
            nonlocal code
            if line:
                code = 1
                if line != reason:
                    log.info(f"main.py: error: {line}")

        failed(attempt(mode.close, log))
        if procs:  # the last stretch's losses and speed, so that even a short run logs them once
            span = max(time.time() - last_status, 1e-9)
            failed(attempt(lambda: report_status(log, tb, mode, run.global_steps.value,
                                                 (run.global_steps.value - status_steps) / span, span, args), log))
        for role, text in run.errors.read_all() + mode.errors():
            code = 1
            log.info(f"{role} failed:\n{text.rstrip()}")
        elapsed = time.time() - start
        ckpt_note = "no checkpoint written (no process was started; the run's log is in --log-dir)"
        try:
            if procs:
                ckpt = mode.save(elapsed_offset + elapsed, final=True)
                last = checkpoint_path(args.save_model_dir, args.env)
                ckpt_note = (f"checkpoint {ckpt}" if ckpt is not None else
                             f"the final checkpoint is not written; the last complete one is {last}" if last.exists()
                             else "no checkpoint written")
        except CheckpointWriteError as e:
            code = 1
            if str(e) != reason:
                log.info(f"main.py: error: {e}")
            ckpt_note = "the final checkpoint could not be written; the last complete one is kept"
        mode.release()
        rate = (run.global_steps.value - (resume_ckpt or {}).get("global_steps", 0)) / max(elapsed, 1e-9)
        log.info(f"stopped: {reason}; {run.global_steps.value:,} global steps, {rate:.0f} steps/s over "
                 f"{elapsed:.0f} s; {ckpt_note}")
        if reason.startswith("reached the end of --lr-anneal-steps"):
            if checkpoint_path(args.save_model_dir, args.env).is_file():
                longer = longer_schedule(args.lr_anneal_steps, run.global_steps.value)
                log.info(f"to train on with the learning rate annealed over about twice the steps (it goes on at "
                         f"{linear_anneal(args.lr, run.global_steps.value, longer):.3g}, then falls to 0 at "
                         f"{longer:,}): {resume_command(argv, args, reason, run.global_steps.value)}; or give "
                         f"--lr-anneal-steps 0 instead for a constant --lr {args.lr:g}")
        elif checkpoint_path(args.save_model_dir, args.env).is_file():
            log.info(f"resume with: {resume_command(argv, args, reason, run.global_steps.value)}")
        if tb is not None:
            failed(attempt(tb.close, log))
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # a second stop signal outside the run's own handling; what was started is stopped
        print(f"main.py: {STOP.reason if STOP.signal is not None else 'interrupted (Ctrl-C)'}", file=sys.stderr)
        sys.exit(STOP.exit_code or 130)

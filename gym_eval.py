"""Evaluate a trained model for N whole games, watch it play, or record videos.

    python gym_eval.py --env PongNoFrameskip-v4 --num-episodes 100
    python gym_eval.py --env PongNoFrameskip-v0 --model-file PongNoFrameskip-v4 --workers 2 --json pong_sticky.json
    python gym_eval.py --env BreakoutNoFrameskip-v4 --num-episodes 3 --record runs/videos
    python gym_eval.py --env SpaceInvadersNoFrameskip-v4 --random-actions --workers 2   # chance, same protocol

A game is a whole game over all lives. It is played greedily (argmax of the policy) and scored unclipped, with a
time limit of ``--max-episode-length`` agent steps. Game i is seeded with ``--seed + i`` and starts from fresh
normalisation statistics, so a seed gives the same scores with any number of ``--workers``. ``--random-actions``
plays the same games with uniformly random actions instead of a model (seeded per game as well): what chance
scores under exactly this protocol. A model whose card says ``"see_skipped_frames": true`` (trained with
``main.py --see-skipped-frames``; the card's sha256 that of the file), or a ``.ckpt`` whose configuration does,
plays with that flag on unless ``--no-see-skipped-frames`` is given.

Outputs: the upstream line per game in ``<log-dir>/<env>_mon_log`` (appended); a final summary line (games,
mean ± std, min, max, median, and the protocol); where the model file has a card (``<stem>.json`` beside it, as
every file in trained_models/ has), a ``card:`` line with the card's evaluation on this env next to this run's;
a JSON summary (``--json``, by default ``<log-dir>/<env>_eval.json``; ``--log-dir`` defaults to ``logs/<env>``),
with ``model_sha256``, the sha256 of the model file played (read twice around the load: a file that changed in
between is refused).
With ``--random-actions`` every default name gets ``_random`` (``<env>_random_mon_log``,
``<env>_random_eval.json``, ``<env>_random_game000.mp4``), so chance never lands in a model's files.

Exit codes: 0 done; 1 the games could not be finished or their summary not written (an evaluation process
died, a full disk): one line says which; 2 bad input; 130 Ctrl-C.
"""
from __future__ import annotations

import lifeline

if __name__ == "__mp_main__":  # an evaluation process: die with the main one (see lifeline.py)
    lifeline.bind_to_parent()
if __name__ == "__main__":  # a Ctrl-C during the imports: one line, exit 130 (main() handles the later ones)
    lifeline.quit_on_interrupt("gym_eval.py")

import argparse
import csv
import json
import math
import multiprocessing as mp
import os
import queue as queue_module
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from checkpoint import (ModelFileError, card_of_this_file, check_state_dict, file_sha256, is_checkpoint, model_path,
                        played_state_dict, read_card, read_weights)
from cli import Parser
from config import SEED_LIMIT, add_model_env_flags, validate_common, validate_dir, validate_file, validate_gpu_ids
from environment import EnvIdError, atari_env, load_env_config, num_actions, protocol, resolve_env_id
from model import A3Clstm
import precision
from precision import PRECISIONS
from utils import compact_json, format_duration, keep_freed_memory, safe_name, setup_logger, use_device, worker_device

PROG = "gym_eval.py"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Evaluate, watch or record a trained A3C-LSTM model.")
    add_model_env_flags(p, log_dir_short="-lgd", seed_help="random seed; game i is seeded with seed + i",
                        log_dir_help="folder for the game log and the summary JSON (default: logs/<env>)",
                        see_skipped_default="as the model's card or a .ckpt's configuration says, else the "
                                            "emulator's last frame")
    p.add_argument("--num-episodes", "-ne", type=int, default=100, help="games to play (default: %(default)s)")
    p.add_argument("--load-model-dir", "-lmd", default="trained_models/",
                   help="where <env>.dat is looked for, or else a model whose card names <env> under default_for "
                        "(default: %(default)s)")
    p.add_argument("--model-file", "-mf", default=None,
                   help="a model file to evaluate instead of <load-model-dir>/<env>.dat: a path, or a name in "
                        "--load-model-dir (with or without .dat); .dat and .ckpt files both work")
    p.add_argument("--render", "-r", action="store_true", help="show the games in a window (needs a display)")
    p.add_argument("--render-freq", "-rf", type=int, default=1,
                   help="render or record every k-th game (default: %(default)s)")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="write an H.264 mp4 of every --render-freq-th game to DIR")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write one CSV per game to DIR: for every step the policy chose, the action, reward, the "
                        "critic's value and the policy's probabilities")
    p.add_argument("--new-gym-eval", "-nge", action="store_true",
                   help="removed (it used gym's Monitor); use --record DIR")
    p.add_argument("--gpu-id", "-gid", type=int, default=-1, help="GPU for the model; -1 = CPU (default)")
    p.add_argument("--workers", "-w", type=int, default=1, help="evaluation processes (default: %(default)s)")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="the conv encoder's precision while playing: fp32 keeps scores comparable across machines; "
                        "bf16, or auto (bf16 where native) (default: %(default)s)")
    p.add_argument("--random-actions", action="store_true",
                   help="play uniformly random actions instead of a model, under the same protocol: the chance "
                        "level a model is compared with (no model file is read; default file names get _random)")
    p.set_defaults(see_skipped_frames=None)
    p.add_argument("--no-see-skipped-frames", dest="see_skipped_frames", action="store_false",
                   help="show the emulator's last frame of each step even where the model's card says "
                        "see_skipped_frames (--see-skipped-frames' default: as the card or a .ckpt's configuration "
                        "says, else off)")
    p.add_argument("--json", default=None, help="summary JSON path (default: <log-dir>/<env>_eval.json; with "
                                                "--random-actions <log-dir>/<env>_random_eval.json)")
    return p


def default_for_cards(load_model_dir: str | Path, env_id: str) -> list[Path]:
    """The cards in ``load_model_dir`` (``*.json`` objects, in name order) that list ``env_id`` under
    ``default_for`` and name their own ``<stem>.dat`` as ``model_file``, whether or not that file is there."""
    found = []
    for card_path in sorted(Path(load_model_dir).glob("*.json")):
        card, _ = read_card(card_path)
        if (card is not None and isinstance(card.get("default_for"), list) and env_id in card["default_for"]
                and card.get("model_file") == card_path.with_suffix(".dat").name):
            found.append(card_path)
    return found


def default_model_file(load_model_dir: str | Path, env_id: str) -> Path:
    """``<load_model_dir>/<env>.dat`` where it exists; else the model whose card (``<stem>.json`` beside it) lists
    ``env_id`` under ``default_for`` (one model trained on ``Pong-v0`` also serves ``ALE/Pong-v5``); else the
    ``<env>.dat`` path, which does not exist. Two cards whose models are there and list ``env_id`` raise
    ``ModelFileError``: which one to play is the user's to say."""
    exact = model_path(load_model_dir, env_id)
    if exact.is_file():
        return exact
    models = [c.with_suffix(".dat") for c in default_for_cards(load_model_dir, env_id)
              if c.with_suffix(".dat").is_file()]
    if len(models) > 1:
        raise ModelFileError(f"{' and '.join(str(m.with_suffix('.json')) for m in models)} all list {env_id} under "
                             f"default_for: pass --model-file with the one to play")
    return models[0] if models else exact


def model_candidates(args: argparse.Namespace) -> list[Path]:
    """Where ``--model-file`` is looked for, in order: as given, in ``--load-model-dir``, and there with ``.dat``."""
    given = Path(args.model_file)
    return [given, Path(args.load_model_dir) / given, Path(args.load_model_dir) / f"{safe_name(str(given))}.dat"]


def resolve_model_file(args: argparse.Namespace) -> Path:
    if args.model_file is None:
        return default_model_file(args.load_model_dir, args.env)
    return next((c for c in model_candidates(args) if c.is_file()), Path(args.model_file))


def game_of(env_id: str) -> str | None:
    """The game an env id plays (``PongNoFrameskip-v0`` -> ``Pong``), or None for an id not known."""
    try:
        return resolve_env_id(env_id).game
    except EnvIdError:
        return None


def same_game_models(load_model_dir: str | Path, env_id: str) -> list[tuple[str, str]]:
    """The models in ``load_model_dir`` of ``env_id``'s game but for ``<env>.dat`` itself, in name order, as
    ``(name for --model-file, the id it was trained on)``: each ``<stem>.dat`` file with the id its card gives
    (``env``, where the card's ``model_file`` names it), else the id its name spells (``ALE_Pong-v5`` ->
    ``ALE/Pong-v5``). Names and ids that do not print on one line are left out."""
    game = game_of(env_id)
    found = []
    for model in sorted(Path(load_model_dir).glob("*.dat")) if game is not None else []:
        if model.stem == safe_name(env_id) or not model.is_file():
            continue
        card, _ = read_card(model)
        trained_on = (card["env"] if card is not None and card.get("model_file") == model.name
                      and isinstance(card.get("env"), str) else model.stem.replace("ALE_", "ALE/", 1))
        if model.stem.isprintable() and trained_on.isprintable() and game_of(trained_on) == game:
            found.append((model.stem, trained_on))
    return found


SHOWN_MODELS = 8  # at most this many of the same game's models in a missing model's line


def missing_model_hint(args: argparse.Namespace) -> str:
    """What a "does not exist" error adds: where ``--model-file`` was looked for, or the cards that list ``--env``
    under ``default_for`` but whose model file is not there, and the models of the same game there
    (``same_game_models``, the first ``SHOWN_MODELS``), and how to go on."""
    if args.model_file is not None:
        tried = list(dict.fromkeys(str(c) for c in model_candidates(args)))
        return f" (looked for {', '.join(tried)}; pass a path or a name in --load-model-dir)"
    gone = default_for_cards(args.load_model_dir, args.env)
    named = (f"; {', '.join(str(c) for c in gone)} list{'s' if len(gone) == 1 else ''} {args.env} under default_for "
             f"but {'its' if len(gone) == 1 else 'their'} model file is not there") if gone else ""
    others = same_game_models(args.load_model_dir, args.env)
    if others:
        more = len(others) - SHOWN_MODELS
        named += (f"; {args.load_model_dir} has {game_of(args.env)} models, for --model-file (the id each was trained "
                  "on): " + ", ".join(f"{stem} ({trained_on})" for stem, trained_on in others[:SHOWN_MODELS])
                  + (f" and {more} more" if more > 0 else ""))
    return f" (train one with main.py, or pass --model-file / --load-model-dir{named})"


def trained_with(model: Path, sha256: str | None, obj) -> tuple[dict, str] | None:
    """What says how the model was trained, and its name: a ``.ckpt``'s saved configuration, or the card beside
    ``model`` (``<stem>.json`` whose ``model_file`` names it and whose ``sha256`` is the file's); None for a bare
    ``.dat`` without such a card (or a checkpoint without a configuration)."""
    if isinstance(obj, dict) and is_checkpoint(obj):
        config = obj.get("config")
        return (config, "the checkpoint's configuration") if isinstance(config, dict) else None
    card = card_of_this_file(model, sha256)
    return (card, str(model.with_suffix(".json"))) if card is not None else None


def trained_seeing_skipped_frames(model: Path, sha256: str | None, obj) -> str | None:
    """What says the model was trained with ``--see-skipped-frames`` (``trained_with``: ``"see_skipped_frames":
    true`` in a card, or a ``.ckpt``'s flag), or None."""
    said = trained_with(model, sha256, obj)
    return said[1] if said is not None and said[0].get("see_skipped_frames") is True else None


def trained_on_another_game(model: Path, sha256: str | None, obj, env_id: str) -> str | None:
    """The line that says the model was trained on another game than ``env_id``'s, as ``trained_with`` names it;
    None where it names the same game in any version (another protocol of the same game is an evaluation of its
    own), or names nothing."""
    said = trained_with(model, sha256, obj)
    trained = said[0].get("env") if said is not None else None
    if not isinstance(trained, str):
        return None
    try:
        if resolve_env_id(trained).game == resolve_env_id(env_id).game:
            return None
    except EnvIdError:
        return None
    return (f"warning: {said[1]} says the model was trained on {trained}, another game than {env_id}'s (the same "
            f"number of actions): its scores here say little")


def validate(args: argparse.Namespace) -> list[str]:
    errors = validate_common(args)
    if args.new_gym_eval:
        errors.append("--new-gym-eval used gym's Monitor, which gymnasium removed: record videos with --record DIR "
                      "(see README, 'Watch and record')")
    if args.num_episodes < 1:
        errors.append(f"--num-episodes must be >= 1, got {args.num_episodes}")
    if args.render_freq < 1:
        errors.append(f"--render-freq must be >= 1, got {args.render_freq}")
    if args.workers < 1:
        errors.append(f"--workers must be >= 1, got {args.workers}")
    if args.render and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        errors.append("--render needs a display, and none is set (DISPLAY is empty); use --record DIR to write "
                      "videos instead")
    if args.render and args.workers > 1:
        errors.append("--render shows games one at a time: use it with --workers 1")
    if args.render and args.record:
        errors.append("--render shows the games in a window and --record writes them to files: use one of them")
    if 0 <= args.seed < SEED_LIMIT and args.num_episodes >= 1 and args.seed + args.num_episodes > SEED_LIMIT:
        errors.append(f"--seed {args.seed} + --num-episodes {args.num_episodes}: game i is seeded with seed + i, "
                      f"which must stay below {SEED_LIMIT}: pass a smaller --seed")
    for flag, folder in (("--log-dir", args.log_dir), ("--record", args.record), ("--trace", args.trace)):
        if folder is not None:
            errors += validate_dir(folder, flag)
    if args.json is not None:
        errors += validate_file(args.json, "--json")
    elif not validate_dir(args.log_dir, "--log-dir") and json_path(args).is_dir():
        errors.append(f"'{json_path(args)}' is a folder, where the summary JSON would be written: move it away, or "
                      "pass --json PATH")
    if not validate_dir(args.log_dir, "--log-dir") and mon_log_path(args).is_dir():
        errors.append(f"'{mon_log_path(args)}' is a folder, where the games would be logged: move it away, or pass "
                      "--log-dir DIR")
    if not errors and args.num_episodes >= 1 and args.render_freq >= 1:
        errors += output_problems(args)
    if args.random_actions and args.model_file is not None:
        errors.append("--random-actions plays without a model: drop --model-file (or drop --random-actions to "
                      "evaluate the model)")
    if args.random_actions and args.trace:
        errors.append("--trace writes the critic's values and the policy's probabilities, which random actions do "
                      "not have: drop --trace or --random-actions")
    if args.random_actions and args.precision != "fp32":
        errors.append(f"--precision {args.precision} sets the model's precision, and --random-actions plays without "
                      "a model: drop --precision")
    parser = build_parser()
    for flag, dest in (("--load-model-dir", "load_model_dir"), ("--hidden-size", "hidden_size")):
        if args.random_actions and getattr(args, dest) != parser.get_default(dest):
            errors.append(f"{flag} describes the model, and --random-actions plays without a model: drop {flag}")
    if args.random_actions and args.gpu_id != -1:
        errors.append(f"--gpu-id {args.gpu_id} sets where the model runs, and --random-actions plays without a model: "
                      "drop --gpu-id")
        return errors
    gpu_errors = validate_gpu_ids([args.gpu_id], "--gpu-id")
    errors += gpu_errors
    if not gpu_errors:
        device = torch.device("cpu") if args.gpu_id < 0 else torch.device("cuda", args.gpu_id)
        args.compute_precision, precision_errors, args.precision_warnings = precision.resolve(args.precision, [device])
        errors += precision_errors
    return errors


def partial_video(path: Path) -> Path:
    """Where the video for ``path`` is written until its game ends (``.<stem>.partial.mp4`` beside it)."""
    return path.with_name(f".{path.stem}.partial{path.suffix}")


class VideoWriter:
    """One H.264 mp4 (yuv420p, plays in browsers and presentation software) from full-colour RGB frames. It is
    written to ``partial_video(path)`` and renamed to ``path`` by ``close(finished=True)`` once its game has
    ended: a game cut short (Ctrl-C, a failure) never leaves a video, or replaces one, under the final name."""

    def __init__(self, path: Path, fps: float):
        self.path, self.fps = path, fps
        self.writer = None
        self.frames = 0

    def __call__(self, env) -> None:
        frame = env.render()
        if self.writer is None:
            import imageio_ffmpeg
            h, w = frame.shape[:2]
            # ffmpeg shares our stderr: at "error" it said "Invalid buffer size" where the process feeding it was
            # killed mid-frame (a Ctrl-C, another process's failure), a second line beside ours; a real failure
            # still reaches us, as the writer's exception
            self.writer = imageio_ffmpeg.write_frames(str(partial_video(self.path)), (w, h), fps=self.fps, codec="libx264",
                                                      pix_fmt_out="yuv420p", macro_block_size=2, quality=None,
                                                      output_params=["-crf", "18"], ffmpeg_log_level="fatal")
            self.writer.send(None)
        self.writer.send(frame.tobytes())
        self.frames += 1

    def close(self, finished: bool = False) -> None:
        """End the video: renamed into place when ``finished``, else removed."""
        partial = partial_video(self.path)
        try:
            if self.writer is not None:
                self.writer.close()
                self.writer = None
            if finished and self.frames:
                os.replace(partial, self.path)
        finally:
            partial.unlink(missing_ok=True)


def frameskip_words(skip) -> str:
    """A protocol's ``frameskip`` in words: ``4``, or ``2-4 (random)`` for ALE's range ``(2, 5)`` (its upper bound
    excluded)."""
    if isinstance(skip, (tuple, list)):
        return f"{skip[0]}-{skip[1] - 1} (random)"
    return str(skip)


def shown_words(max_over_frames: int) -> str:
    """What each observation shows, in words: ``max over the step's last 3 frames``, or ``the emulator's last
    frame`` (an id whose emulator skips frames, played without ``--see-skipped-frames``)."""
    return f"max over the step's last {max_over_frames} frames" if max_over_frames > 1 else "the emulator's last frame"


def real_time_fps(args: argparse.Namespace) -> float:
    """Video frames per second for real-time playback: the Atari runs at 60 frames/s and each video frame is one
    agent step of ``frameskip`` frames (the mean for stochastic frameskips such as ``(2, 5)``)."""
    skip = protocol(args.env, max_episode_length=args.max_episode_length, skip_rate=args.skip_rate,
                    episodic_life=False, see_skipped=args.see_skipped_frames)["frameskip"]
    if isinstance(skip, (tuple, list)):
        skip = (skip[0] + skip[1] - 1) / 2
    return 60.0 / skip


class UniformRandomPolicy:
    """Stands in for the model in ``play_game``: every call picks one of ``n_actions`` uniformly at random from its
    own generator, seeded with ``seed`` (so a game's actions do not depend on which process plays it), as the
    argmax of a one-hot row of logits. Its value is 0 and its state a dummy."""

    def __init__(self, n_actions: int, seed: int):
        self.n_actions = n_actions
        self.generator = torch.Generator().manual_seed(seed)

    def initial_state(self, batch: int = 1, device: torch.device | str = "cpu"):
        z = torch.zeros(batch, 1, device=device)
        return z, z.clone()

    def __call__(self, x: torch.Tensor, state):
        action = int(torch.randint(self.n_actions, (1,), generator=self.generator))
        logits = torch.zeros(x.shape[0], self.n_actions, device=x.device)
        logits[:, action] = 1.0
        return torch.zeros(x.shape[0], 1, device=x.device), logits, state


def file_stem(args: argparse.Namespace) -> str:
    """The start of every file name this evaluation writes by default: ``<env>``, or ``<env>_random`` with
    ``--random-actions``."""
    return f"{safe_name(args.env)}{'_random' if args.random_actions else ''}"


def json_path(args: argparse.Namespace) -> Path:
    """Where the summary JSON goes: ``--json``, else ``<log-dir>/<stem>_eval.json``."""
    return Path(args.json) if args.json else Path(args.log_dir) / f"{file_stem(args)}_eval.json"


def mon_log_path(args: argparse.Namespace) -> Path:
    """The per-game log, appended to: ``<log-dir>/<stem>_mon_log``."""
    return Path(args.log_dir) / f"{file_stem(args)}_mon_log"


def video_path(args: argparse.Namespace, game: int) -> Path:
    """Game ``game``'s video with ``--record``: ``<record>/<stem>_gameNNN.mp4``."""
    return Path(args.record) / f"{file_stem(args)}_game{game:03d}.mp4"


def trace_path(args: argparse.Namespace, game: int) -> Path:
    """Game ``game``'s trace with ``--trace``: ``<trace>/<env>_gameNNN.csv``."""
    return Path(args.trace) / f"{safe_name(args.env)}_game{game:03d}.csv"


def output_problems(args: argparse.Namespace) -> list[str]:
    """The per-game outputs a folder stands where a file would go, or an earlier evaluation's file that would be
    replaced (the videos of the games ``--record`` writes, every game's ``--trace`` CSV), and a ``--json`` that
    names the model file, its card or the game log, or an existing file that is not an earlier summary, which it
    would replace: one line each (checked before the first game)."""
    errors = []
    for flag, paths in (("--record", [video_path(args, i) for i in range(0, args.num_episodes, args.render_freq)]
                         if args.record else []),
                        ("--trace", [trace_path(args, i) for i in range(args.num_episodes)] if args.trace else [])):
        folders = [p for p in paths if p.is_dir()]
        if folders:
            more = f" (and {len(folders) - 1} more)" if len(folders) > 1 else ""
            errors.append(f"'{folders[0]}'{more} is a folder, where {flag} would write a game's file: move it away, "
                          f"or pass another {flag} DIR")
            continue
        files = [p for p in paths if p.is_file()]
        if files:
            more = f" (and {len(files) - 1} more)" if len(files) > 1 else ""
            errors.append(f"'{files[0]}'{more} exists, an earlier evaluation's, and this one would replace it: move "
                          f"it away, or pass another {flag} DIR")
    if args.json is not None:
        kept = [mon_log_path(args)]
        if not args.random_actions:
            try:
                model = resolve_model_file(args)
                kept += [model, model.with_suffix(".json")]
            except ModelFileError:
                pass  # reported where the model is loaded
        target = os.path.realpath(args.json)
        hit = next((k for k in kept if os.path.realpath(k) == target), None)
        if hit is not None:
            errors.append(f"--json {args.json} is {hit}, which the summary would replace: pass another --json PATH")
        elif os.path.isfile(target) and not is_summary(Path(target)):
            errors.append(f"--json {args.json} exists and is not a gym_eval.py summary, which this one would "
                          f"replace: pass another --json PATH, or move that file away")
    return errors


SUMMARY_KEYS = ("env", "episodes", "scores", "lengths", "protocol")  # what every gym_eval.py summary holds
SUMMARY_MAX_BYTES = 256 * 2**20


def is_summary(path: Path) -> bool:
    """``path`` holds a summary an earlier gym_eval.py run wrote (a JSON object with ``SUMMARY_KEYS``), which a new
    one may replace: nothing else is written over (a model card, a results file it cites, a config)."""
    try:
        if path.stat().st_size > SUMMARY_MAX_BYTES:
            return False
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and all(k in obj for k in SUMMARY_KEYS)


def write_json_atomically(path: Path, text: str) -> None:
    """``text`` in ``path``, written whole to a temporary file beside it, flushed to disk, then renamed into place:
    an existing file is replaced only by a complete one (a symbolic link's target, which stays linked). The
    temporary file is removed when the write fails."""
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def play_games(args: argparse.Namespace, state_dict: dict | None, games: list[int], device: torch.device,
               results) -> None:
    """Play the games with these indices and put ``(index, score, length, frames_recorded, points, cut)`` on
    ``results``; ``points``: ``[agent step, reward]`` of every step with a non-zero reward; ``cut``: whether the
    time limit (or the emulator's frame cap) ended the game. With
    ``args.random_actions`` (``state_dict`` None) game i plays ``UniformRandomPolicy(seed=args.seed + i)``."""
    from player_util import play_game

    use_device(device)
    conf = load_env_config(args.env_config, args.env)
    model = None
    for i in games:
        render = (args.render or args.record) and i % args.render_freq == 0
        mode = ("human" if args.render else "rgb_array") if render else None
        env = atari_env(args.env, conf, max_episode_length=args.max_episode_length, skip_rate=args.skip_rate,
                        episodic_life=False, render_mode=mode, see_skipped=args.see_skipped_frames)
        if args.random_actions:
            model = UniformRandomPolicy(env.action_space.n, args.seed + i)
        elif model is None:
            model = A3Clstm(1, env.action_space.n, args.hidden_size).channels_last().to(device).eval()
            model.load_state_dict(state_dict)
            model.set_precision(precision.compute_dtype(args.compute_precision))
        torch.manual_seed(args.seed + i)
        recorder = None
        if render and args.record:
            fps = real_time_fps(args)
            recorder = VideoWriter(video_path(args, i), fps)
        try:
            frames_hook = (lambda e, r=recorder: r(e)) if recorder else None
            points: list = []
            trace = [] if args.trace else None
            cut: list = []
            score, length, _ = play_game(model, env, device, seed=args.seed + i, on_frame=frames_hook,
                                         points=points, trace=trace, cut=cut)
            if trace is not None:
                write_trace(trace_path(args, i), trace,
                            env.unwrapped.get_action_meanings())
            if recorder is not None:
                recorder.close(finished=True)
        finally:
            if recorder is not None:
                recorder.close()  # a game cut short: its partial video is removed
            env.close()
        results.put((i, score, length, recorder.frames if recorder else 0, [list(p) for p in points], any(cut)))


def write_trace(path: Path, trace: list, action_names: list[str]) -> None:
    """``play_game``'s ``trace`` as CSV: ``step,action,reward,value`` and one probability column per action
    (``p_NOOP``, ``p_FIRE``, ...), one row per step the policy chose; written whole, then renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "action", "reward", "value", *(f"p_{a}" for a in action_names)])
            for step, action, reward, value, probs in trace:
                w.writerow([step, action, f"{reward:g}", f"{value:.5f}", *(f"{p:.5f}" for p in probs)])
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _worker(args, state_dict, games, results) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    keep_freed_memory()
    try:
        import setproctitle
        setproctitle.setproctitle("a3g eval")
    except ImportError:  # pragma: no cover
        pass
    try:
        play_games(args, state_dict, games, worker_device([args.gpu_id], 0), results)
    except BaseException as e:  # pragma: no cover - reported to the parent
        results.put(("error", repr(e), 0, 0, []))


class EvaluationFailed(Exception):
    """The games could not all be played: a process died or failed."""


def summarize(scores: list[float]) -> dict:
    return {"mean": statistics.fmean(scores), "std": statistics.pstdev(scores), "min": min(scores),
            "max": max(scores), "median": statistics.median(scores)}


def points_lost(points: list[list]) -> dict | None:
    """Where the games gave points away: ``points`` holds each game's ``[agent step, reward]`` pairs (non-zero
    rewards, in order; a reward is an agent step's, summed over its frames, so a point lost and one won within the
    same step cancel: never in Pong, possible in games that score both ways in a frame or two). None when no reward
    was negative; else ``{"points", "games", "first_point",
    "first_point_steps"}``: the negative rewards' total, the games with any, the games whose first non-zero
    reward was negative (in Pong, the opening serve lost), and the agent steps at which those came."""
    lost = [sum(-r for _, r in game if r < 0) for game in points]
    if not any(lost):
        return None
    first = [game[0][0] for game in points if game and game[0][1] < 0]
    return {"points": sum(lost), "games": sum(1 for x in lost if x), "first_point": len(first),
            "first_point_steps": first}


def points_line(lost: dict, n: int) -> str:
    """One line for ``points_lost``'s dict over ``n`` games."""
    line = f"points given away: {lost['points']:.10g} in {lost['games']} of {n} games"
    if lost["first_point"]:
        steps = lost["first_point_steps"]
        line += (f"; the game's first point in {lost['first_point']} of them (agent steps {min(steps)}-"
                 f"{max(steps)})")
    return line


def as_in_card(proto: dict) -> dict:
    """A protocol as a card holds it (JSON): a tuple, ALE's frame-skip range, is a list there."""
    return json.loads(json.dumps(proto))


def card_claim(model: Path, env_id: str, sha256: str | None, proto: dict | None = None,
               compute_precision: str | None = None) -> dict | None:
    """What the model card beside ``model`` says about ``env_id``, or None where the model has no card.

    A card is ``<stem>.json`` next to the model file whose ``model_file`` names it, or whose ``sha256`` is the
    file's (a renamed copy; trained_models/ ships one card per model; docs/results.md). Returns
    ``{"path", "trained_on", "evaluation", "same_file", "see_skipped_frames"}``:
    ``evaluation`` is the card's entry for ``env_id`` (None where it has none): the first whose protocol is
    ``proto`` and whose precision is ``compute_precision`` where one is, else the first on ``env_id``;
    ``same_file`` is False where the card's sha256 is not the played file's ``sha256`` (a model replaced after its
    card was written, whose figures do not apply). A ``<stem>.json`` that is not a JSON object gives
    ``{"path", "problem"}``. A card whose ``evaluations`` is not a list of objects raises TypeError."""
    path = model.with_suffix(".json")
    card, problem = read_card(model)
    if problem is not None:
        return {"path": str(path), "problem": problem}
    if not describes(card, model, sha256):
        return None
    same_file = sha256 is not None and sha256 == card.get("sha256")
    evaluations = card.get("evaluations", [])
    if not isinstance(evaluations, list) or not all(isinstance(e, dict) for e in evaluations):
        raise TypeError("its 'evaluations' is not a list of objects")
    on_env = [e for e in evaluations if e.get("env") == env_id]
    stored = as_in_card(proto) if proto is not None else None
    matching = [e for e in on_env if stored is not None and e.get("protocol") == stored
                and e.get("precision") == compute_precision]
    evaluation = (matching or on_env or [None])[0]
    return {"path": str(path), "trained_on": card.get("env"), "evaluation": evaluation, "same_file": same_file,
            "see_skipped_frames": card.get("see_skipped_frames") is True}


def describes(card: dict | None, model: Path, sha256: str | None) -> bool:
    """Whether ``card`` is ``model``'s: its ``model_file`` names the file, or its ``sha256`` is the file's (a renamed
    copy)."""
    return card is not None and (card.get("model_file") == model.name
                                 or (sha256 is not None and card.get("sha256") == sha256))


def is_number(x) -> bool:
    """A JSON number that is a finite float (not a bool, not an integer too large for a float)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def card_shape_problems(model: Path, sha256: str | None) -> list[str]:
    """The card beside ``model`` (``card_claim``'s) where gym_eval.py could not compare its result with it: a
    ``<stem>.json`` that is not a JSON object, or one that describes this file and whose evaluations lack a field
    ``card_line`` prints, or hold it in another type. One line each, checked before the first game."""
    path = model.with_suffix(".json")
    fix = "fix the card, or move it away to evaluate without it"
    card, problem = read_card(model)
    if problem is not None:
        return [f"card {path} {problem}: {fix}"]
    if not describes(card, model, sha256):
        return []
    evaluations = card.get("evaluations", [])
    if not isinstance(evaluations, list) or not all(isinstance(e, dict) for e in evaluations):
        return [f"card {path}: its 'evaluations' is not a list of objects: {fix}"]
    checks = (("env", lambda v: isinstance(v, str), "a string"),
              ("episodes", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number >= 1"),
              ("mean", is_number, "a finite number"), ("std", is_number, "a finite number"),
              ("source", lambda v: isinstance(v, str), "a string"),
              ("protocol", lambda v: isinstance(v, dict), "an object"))
    optional = (("first_seed", lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
                ("precision", lambda v: isinstance(v, str), "a string"))
    found = []
    for i, e in enumerate(evaluations, 1):
        bad = [f"'{k}' is {'missing' if k not in e else 'not ' + what}" for k, ok, what in checks
               if k not in e or not ok(e[k])]
        bad += [f"'{k}' is not {what}" for k, ok, what in optional if e.get(k) is not None and not ok(e[k])]
        if bad:
            found.append(f"card {path}: evaluation {i}: {', '.join(bad)}: {fix}")
    return found


def card_line(claim: dict, env_id: str, n: int, s: dict, proto: dict, compute_precision: str,
              first_seed: int | None = None) -> str:
    """One line: the card's evaluation on ``env_id`` beside this run's ``n`` games (``s``: ``summarize``'s dict),
    naming the protocol settings in which this run differs from the card's, and, with ``first_seed``, the games
    (seeds) where they are not the card's."""
    if "problem" in claim:
        return (f"card: {claim['path']} {claim['problem']}: not compared, and its see_skipped_frames not read (pass "
                f"--see-skipped-frames if the model was trained with it)")
    e = claim["evaluation"]
    if not claim["same_file"]:
        unused = (": its see_skipped_frames not applied (pass --see-skipped-frames if this file was trained with it)"
                  if claim.get("see_skipped_frames") and proto.get("max_over_frames") == 1 else "")
        return f"card: {claim['path']} describes another file (its sha256 differs): not compared{unused}"
    if e is None:
        return f"card: no evaluation on {env_id} (trained on {claim['trained_on']})"
    line = (f"card: {e['env']} {e['episodes']} games {e['mean']:.2f} ± {e['std']:.2f} ({e['source']}); "
            f"this run: {n} games {s['mean']:.2f} ± {s['std']:.2f}")
    as_stored = as_in_card(proto)
    differs = [f"{k} {v} (card: {e['protocol'].get(k)})" for k, v in proto.items()
               if e["protocol"].get(k) != as_stored[k]]
    if e.get("precision") != compute_precision:
        differs.append(f"precision {compute_precision} (card: {e.get('precision')})")
    line += f"; not the card's protocol: {', '.join(differs)}" if differs else ""
    card_seed = e.get("first_seed")
    if first_seed is not None and card_seed is not None and (first_seed, n) != (card_seed, e["episodes"]):
        line += (f"; not the card's games: seeds {first_seed}-{first_seed + n - 1} (card: {card_seed}-"
                 f"{card_seed + e['episodes'] - 1})")
    return line


def check_before_start(args: argparse.Namespace) -> list[str] | tuple:
    """The checks made before any game: the problems (one line each), or the model's state_dict, its sha256, the
    object its file holds and its path (all None with ``--random-actions``)."""
    errors = validate(args)
    state_dict, model_sha256, obj, path = None, None, None, None
    if not args.random_actions:  # which model plays does not matter then, nor whether two cards claim the env
        try:
            path = resolve_model_file(args)
        except ModelFileError as e:
            errors.append(str(e))
    if not errors and not args.random_actions:
        try:
            n_actions = num_actions(args.env)
            before = file_sha256(path)
            obj = read_weights(path)
            state_dict = played_state_dict(obj, path)
            check_state_dict(state_dict, n_actions, args.hidden_size, path, args.env)
            model_sha256 = file_sha256(path)
            if model_sha256 != before:
                raise ModelFileError(f"model file {path} changed while it was read: evaluate it once nothing "
                                     "writes it")
            errors += card_shape_problems(path, model_sha256)
        except ModelFileError as e:
            msg = str(e)
            if "does not exist" in msg:
                msg += missing_model_hint(args)
            errors.append(msg)
    return errors or (state_dict, model_sha256, obj, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        checked = check_before_start(args)
    except PermissionError as e:  # a folder on the way that this user cannot enter (Path.exists raises EACCES)
        checked = [f"'{e.filename}' cannot be read ({e.strerror}): pick folders this user can read and write"]
    if isinstance(checked, list):
        for e in checked:
            print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    state_dict, model_sha256, obj, path = checked
    for line in args.precision_warnings:
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    other_game = None if args.random_actions else trained_on_another_game(path, model_sha256, obj, args.env)
    if other_game:
        print(f"{PROG}: {other_game}", file=sys.stderr, flush=True)
    if args.see_skipped_frames is None:
        said_by = None if args.random_actions else trained_seeing_skipped_frames(path, model_sha256, obj)
        args.see_skipped_frames = said_by is not None
        if said_by and not resolve_env_id(args.env).frameskip_by_us:  # NoFrameskip ids show the max either way
            print(f"{PROG}: {said_by} says the model was trained on the max over each step's last frames: "
                  f"--see-skipped-frames is on (--no-see-skipped-frames plays without it)", flush=True)

    torch.set_num_threads(1)
    keep_freed_memory()
    for flag, folder in (("--record", args.record), ("--trace", args.trace)):
        try:
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a dangling link in its place: found only when made
            print(f"{PROG}: error: cannot make the {flag} folder {folder} ({e.strerror or e}): pass another {flag} "
                  f"DIR", file=sys.stderr)
            return 2
    try:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        log = setup_logger(f"eval.{file_stem(args)}", mon_log_path(args))
    except OSError as e:  # a dangling link, a file it may not write: found only when opened
        print(f"{PROG}: error: cannot open the game log {mon_log_path(args)} ({e.strerror or e}): pass --log-dir "
              f"DIR to log elsewhere", file=sys.stderr)
        return 2
    proto = protocol(args.env, max_episode_length=args.max_episode_length, skip_rate=args.skip_rate,
                     episodic_life=False, see_skipped=args.see_skipped_frames)
    for k, v in sorted(vars(args).items()):
        log.info(f"{k}: {v}")
    log.info("policy: uniform random actions" if args.random_actions else f"model: {path}")
    if not args.random_actions:
        via = (f" ({path.with_suffix('.json')} lists {args.env} under default_for)"
               if args.model_file is None and path != model_path(args.load_model_dir, args.env) else "")
        if is_checkpoint(obj) and obj.get("average_model") is not None:
            via += " (its moving average of the weights, --ema-steps, as the run's .dat holds it)"
        print(f"{PROG}: model {path}{via}", flush=True)

    n = args.num_episodes
    start = time.time()
    scores: dict[int, float] = {}
    lengths: dict[int, int] = {}
    frames: dict[int, int] = {}
    points: dict[int, list] = {}
    cut: dict[int, bool] = {}
    from tqdm import tqdm
    bar = tqdm(total=n, unit="game", disable=not sys.stderr.isatty(), file=sys.stderr)

    class Results:
        """Receives each finished game, in this process, whichever process played it."""

        @staticmethod
        def put(item) -> None:
            i, score, length, nframes, game_points, game_cut = item
            scores[i], lengths[i], frames[i], points[i], cut[i] = score, length, nframes, game_points, game_cut
            mean = statistics.fmean(scores.values())
            log.info(f"Time {format_duration(time.time() - start)}, episode reward {score}, episode length {length}, "
                     f"reward mean {mean:.4f}")
            bar.update(1)
            bar.set_postfix(mean=f"{mean:.2f}")
            if bar.disable:
                print(f"game {i + 1}/{n}: score {score:.10g}, length {length}", flush=True)

    procs = []
    interrupted, failure = False, None
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here a Ctrl-C stops the games (below)
    try:
        if args.workers == 1:
            try:
                play_games(args, state_dict, list(range(n)), worker_device([args.gpu_id], 0), Results)
            except Exception as e:  # a write that failed (a full disk), ffmpeg: one line, as from a worker process
                raise EvaluationFailed(f"the evaluation failed: {e!r}") from e
        else:
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            lifeline.mark_children()
            for w in range(min(args.workers, n)):
                p = ctx.Process(target=_worker, args=(args, state_dict, list(range(w, n, args.workers)), queue))
                lifeline.start_child(p)
                procs.append(p)
            while len(scores) < n:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                while dead and len(scores) < n:  # first whatever it reported before it ended
                    try:
                        item = queue.get(timeout=0.1)
                    except queue_module.Empty:
                        raise EvaluationFailed(f"an evaluation process ended with exit code {dead[0].exitcode}")
                    if item[0] == "error":
                        raise EvaluationFailed(f"an evaluation process failed: {item[1]}")
                    Results.put(item)
                if len(scores) == n:
                    break
                try:
                    item = queue.get(timeout=1.0)
                except queue_module.Empty:
                    if all(p.exitcode is not None for p in procs) and queue.empty():
                        raise EvaluationFailed("the evaluation processes ended before every game was reported")
                    continue
                if item[0] == "error":
                    raise EvaluationFailed(f"an evaluation process failed: {item[1]}")
                Results.put(item)
    except KeyboardInterrupt:
        interrupted = True
    except EvaluationFailed as e:
        failure = str(e)
    finally:
        bar.close()
        # stopped at once on Ctrl-C or a failure: a game they finished now would not be counted
        if end_workers(procs, kill=interrupted or failure is not None):
            interrupted = True
    if interrupted or failure:  # what a killed worker was writing: a partial video, a trace's temporary file
        for folder, pattern in ((args.record, f".{file_stem(args)}_game*.partial.mp4"),
                                (args.trace, f"{safe_name(args.env)}_game*.csv.tmp")):
            for partial in Path(folder).glob(pattern) if folder else ():
                partial.unlink(missing_ok=True)
    if interrupted:
        print(f"{PROG}: interrupted after " + (f"all {n} games, before the summary was written" if len(scores) == n
                                               else f"{len(scores)} of {n} games"), file=sys.stderr)
        return 130
    if failure is not None:
        log.info(f"failed after {len(scores)} of {n} games: {failure}")
        print(f"{PROG}: error: {failure} after {len(scores)} of {n} games; nothing was summarised (the games "
              f"played are in {mon_log_path(args)}): run the evaluation again", file=sys.stderr)
        return 1
    try:
        return summarise_and_write(args, path, model_sha256, proto, log, start, scores, lengths, frames, points,
                                   cut)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted after all {n} games, before the summary was written", file=sys.stderr)
        return 130


def end_workers(procs: list, kill: bool) -> bool:
    """Let the evaluation processes end (``kill``: kill them at once): each is waited for up to 5 s, then killed.
    A Ctrl-C while waiting kills the rest at once; the kills and their joins run with Ctrl-C ignored, so that a
    second one cannot leave a process behind. Returns whether a Ctrl-C came."""
    ctrl_c = False
    if not kill:
        try:
            for p in procs:
                p.join(timeout=5)
        except KeyboardInterrupt:
            ctrl_c = True
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    return ctrl_c


def summarise_and_write(args: argparse.Namespace, path: Path | None, model_sha256: str | None, proto: dict, log,
                        start: float, scores: dict, lengths: dict, frames: dict, points: dict, cut: dict) -> int:
    """The summary line, the points line, the line of the games the time limit cut (where there are any), the card
    line and the JSON of the finished games; returns the exit code (1 with one line where the JSON cannot be
    written)."""
    n = args.num_episodes
    order = sorted(scores)
    score_list = [scores[i] for i in order]
    s = summarize(score_list)
    wall = time.time() - start
    who = " (uniform random actions)" if args.random_actions else ""
    summary = (f"{args.env}{who}: {n} games, mean {s['mean']:.2f} ± {s['std']:.2f}, min {s['min']:.10g}, "
               f"max {s['max']:.10g}, median {s['median']:.10g} ({wall:.0f} s; protocol: frameskip "
               f"{frameskip_words(proto['frameskip'])}, {shown_words(proto['max_over_frames'])}, sticky actions "
               f"{proto['repeat_action_probability']:g}, no-op starts up to {proto['noop_starts']}, episodic life "
               f"off (a lost life restarts as in training), time limit {proto['time_limit_agent_steps']} agent steps"
               f"{'' if args.compute_precision == 'fp32' or who else ', model in ' + args.compute_precision})")
    log.info(summary)
    print(summary, flush=True)
    point_list = [points[i] for i in order]
    lost = points_lost(point_list)
    if lost is not None:
        line = points_line(lost, n)
        log.info(line)
        print(line, flush=True)
    cut_games = [i for i in order if cut[i]]
    if cut_games:  # their scores are the points up to the cut, not whole games
        line = (f"{len(cut_games)} of {n} games were cut short by the time limit ({proto['time_limit_agent_steps']} "
                f"agent steps) or the emulator's frame cap: their scores count the points up to the cut "
                f"(games {', '.join(str(i + 1) for i in cut_games[:10])}{', ...' if len(cut_games) > 10 else ''})")
        log.info(line)
        print(line, flush=True)
    claim = None
    if not args.random_actions:
        try:  # checked before the first game (card_shape_problems); a card edited since must not cost the results
            claim = card_claim(path, args.env, model_sha256, proto, args.compute_precision)
            if claim is not None:
                claim["line"] = card_line(claim, args.env, n, s, proto, args.compute_precision, args.seed)
        except Exception as e:  # noqa: BLE001 -- any hand edit: the summary below is still written
            claim = {"path": str(path.with_suffix(".json")), "line": f"card: {path.with_suffix('.json')} is "
                                                                      f"malformed ({e}): not compared"}
    if claim is not None:
        log.info(claim["line"])
        print(claim["line"], flush=True)
    out = {"env": args.env, "model": None if args.random_actions else str(path), "model_sha256": model_sha256,
           "policy": "uniform random actions" if args.random_actions else "greedy (argmax)", "episodes": n, **s,
           "scores": score_list,
           "lengths": [lengths[i] for i in order], "cut_short": [i + 1 for i in cut_games], "points": point_list,
           "points_lost": lost,
           "seed": args.seed, "protocol": proto,
           "precision": None if args.random_actions else args.compute_precision, "card": claim,
           "wall_seconds": wall}
    if args.record:
        out["videos"] = {str(video_path(args, i)): frames[i]
                         for i in order if frames[i]}
    out_path = json_path(args)
    try:
        write_json_atomically(out_path, compact_json(out) + "\n")
    except OSError as e:
        print(f"{PROG}: error: the summary could not be written to {out_path} ({e.strerror or e}); the lines above "
              "are this run's result: free space or pass --json PATH somewhere writable, and run again",
              file=sys.stderr)
        return 1
    print(f"summary written to {out_path}")
    if args.record:
        print(f"{len(out['videos'])} video(s) written to {Path(args.record).resolve()}")
    if args.trace:
        print(f"{n} trace(s) written to {Path(args.trace).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

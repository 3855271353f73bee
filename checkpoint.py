"""Model files and checkpoints: atomic writes, strict and explained loads.

Two files per run in ``--save-model-dir``:
- ``<env>.dat``: the drop-in model, a bare state_dict of the 16 upstream keys as CPU tensors (upstream format).
- ``<env>.ckpt``: the full checkpoint, a dict with ``model``, ``optimizer`` (or None without a shared optimizer),
  ``optimizer_name``, ``env``, ``global_steps``, ``best_score``, ``norm_stats``, ``monitor`` and ``recent_scores``
  (the monitor's counters and last scores), ``elapsed_seconds``, ``config`` and ``format``/``version``, a
  mode's own fields (GA3C: ``ga3c_updates``, ``ga3c_episodes``, ``short_games_started``), and with
  ``--ema-steps`` ``average_model``, the moving average of the weights that the monitor plays and the ``.dat``
  holds (``averaging.py``).

Both are written to a temporary file in the same folder and renamed over the old one, so a crash never leaves a
half-written file in their place; a temporary file left by a process killed mid-write is removed by the next run
(``remove_stale_temp_files``). A write that fails (a full disk) raises ``CheckpointWriteError`` with one line that
says why and where, and leaves the previous file as it was. Every load uses ``torch.load(..., weights_only=True)``,
and a file that cannot be read, is not ours, does not fit the model, or holds NaN or infinite weights raises
``ModelFileError`` with one line (a damaged file that still reads as finite weights of the right shapes is not
found: torch does not check the archive's checksums). Weights or optimizer statistics that went NaN or infinite (a
run that diverged) are never written over a good file: ``refuse_non_finite`` raises ``DivergedError``.

One run at a time writes into a folder: ``RunLock`` holds an ``flock`` on ``<folder>/.lock`` for the run's life
(the kernel releases it when the process dies, however it dies).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

from ga3c.settings import LATER_PASSES
from model import expected_shapes
from utils import safe_name

CHECKPOINT_FORMAT = "a3g-checkpoint"
CHECKPOINT_VERSION = 1


class ModelFileError(ValueError):
    """A model file that cannot be used; the message names the file and what is wrong."""


class CheckpointWriteError(RuntimeError):
    """A model file or checkpoint that could not be written; the message names the file and the reason."""


class DivergedError(CheckpointWriteError):
    """Weights or optimizer statistics that hold NaN or infinite values: the file is not written, so that the last
    one written before, with finite values, stays the one ``--load`` resumes."""


def tensors_in(obj, prefix: str = ""):
    """``(name, tensor)`` for every tensor in ``obj``, through dicts, lists and tuples (an optimizer's
    ``state_dict``: ``state.3.exp_avg``)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_in(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors_in(v, f"{prefix}.{i}" if prefix else str(i))


def refuse_non_finite(path: str | Path, **parts) -> None:
    """Raise ``DivergedError`` (one line) where a floating-point tensor in one of ``parts`` (``model=state_dict``,
    ``optimizer=state_dict``, ...) holds NaN or infinite values; ``path`` is the file that is then not written."""
    bad = [f"{part} {name}" for part, obj in parts.items() if obj is not None
           for name, t in tensors_in(obj) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise DivergedError(f"the run diverged: NaN or infinite values in {', '.join(bad[:3])}"
                            f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}; {path} is not written (the "
                            f"last one written before is kept): resume from it with --load and a smaller --lr")


class RunLockedError(RuntimeError):
    """Another run holds the folder's lock."""


def model_path(folder: str | Path, env_id: str) -> Path:
    return Path(folder) / f"{safe_name(env_id)}.dat"


def checkpoint_path(folder: str | Path, env_id: str) -> Path:
    return Path(folder) / f"{safe_name(env_id)}.ckpt"


def _os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (torch.save wraps a failed write in a RuntimeError), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def write_error_message(path: Path, e: BaseException) -> str:
    os_error = _os_error_in(e)
    if os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"could not write {path}: the disk is full ({os.strerror(os_error.errno)}); free space or use another folder"
    if os_error is not None:
        return f"could not write {path}: {os_error.strerror or os_error}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"could not write {path}: {first[:200]}"


@contextlib.contextmanager
def write_errors(path: str | Path):
    """``with write_errors(path):`` an ``OSError`` inside (a full disk) is raised as ``CheckpointWriteError``, one
    line naming ``path``."""
    try:
        yield
    except OSError as e:
        raise CheckpointWriteError(write_error_message(Path(path), e)) from e


TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)$")


def atomic_save(obj, path: str | Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, rename over ``path``, then fsync the folder (so
    that the rename, too, survives a power loss).

    On any failure the temporary file is removed, ``path`` is left as it was, and ``CheckpointWriteError`` says
    why in one line."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        sync_folder(path.parent)
    except Exception as e:
        raise CheckpointWriteError(write_error_message(path, e)) from e
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


def sync_folder(folder: Path) -> None:
    """fsync ``folder`` itself: its entries (a rename into it) reach the disk. A file system that cannot sync a
    folder (EINVAL, ENOTSUP) is left as it is."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Remove the temporary files (``.<name>.tmp<pid>``) that a process killed while saving left in ``folder``;
    return what was removed. Called with the folder's ``RunLock`` held and before this run starts a process, so
    that no process writes there: each such file is a killed save's, whether or not its pid now names a living
    process (pids are reused)."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if TEMP_NAME.match(p.name) is None or not p.is_file():
            continue
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


class RunLock:
    """An exclusive ``flock`` on ``<folder>/<name>`` (``.lock``) for one run's life; the file records the holder's
    pid."""

    def __init__(self, folder: str | Path, flag: str = "--save-model-dir", name: str = ".lock"):
        """Raises ``RunLockedError`` where another run holds the lock, ``CheckpointWriteError`` (one line) where the
        lock file cannot be made or written (a full disk, a read-only folder)."""
        self.folder = Path(folder)
        self.path = self.folder / name
        self.fd = None
        self.created = False  # whether this lock made the file (``remove`` takes it away again)
        try:
            while True:
                try:
                    self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    self.created = True
                except FileExistsError:
                    try:
                        self.fd = os.open(self.path, os.O_RDWR)
                    except FileNotFoundError:  # removed since: make it
                        continue
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
                    os.close(self.fd)
                    self.fd = None
                    raise RunLockedError(f"another run (pid {holder}) is writing to {self.folder}: wait for it to "
                                         f"stop, or pass {flag} DIR with another folder") from None
                if self._holds_the_file_in_place():
                    break
                # its holder removed it (a refused start's clean-up) before letting go: a lock on it would be on a
                # file no other run can see, so lock the one in its place
                os.close(self.fd)
                self.fd, self.created = None, False
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException as e:  # the descriptor is closed whatever interrupted the locking
            if self.fd is not None and self.created:
                self.remove()
            self.release()
            if isinstance(e, OSError):
                raise CheckpointWriteError(write_error_message(self.path, e)) from e
            raise

    def _holds_the_file_in_place(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def remove(self) -> None:
        """Remove the lock file, while still holding it (a run that locks it next finds it gone and makes a new
        one), then let go."""
        if self.fd is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def cpu_state_dict(model: torch.nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """A detached CPU copy of the state_dict (never a view of the live shared weights)."""
    return OrderedDict((k, v.detach().to("cpu", copy=True).contiguous()) for k, v in model.state_dict().items())


def read_weights(path: str | Path) -> dict:
    """Load a ``.dat`` or ``.ckpt`` file with ``weights_only=True``; raise ``ModelFileError`` in plain words."""
    path = Path(path)
    if path.is_dir():
        raise ModelFileError(f"model file {path} is a folder, not a model file")
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError, OSError,
            AttributeError, TypeError, KeyError, IndexError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        reason = reason.split(". ")[0].rstrip(".")[:160]
        if isinstance(e, (KeyError, IndexError)) or reason.strip("'").isdigit():  # torch.load's legacy reader
            reason = "its bytes are neither a zip archive nor a pickle that torch.load reads"
        raise ModelFileError(f"model file {path} is corrupt or not a PyTorch weights file ({reason}): replace it "
                             f"with a good copy, or point to another file")
    if not isinstance(obj, dict):
        raise ModelFileError(f"model file {path} holds a {type(obj).__name__}, not a state_dict: point to a .dat or "
                             f".ckpt that main.py wrote, or an upstream .dat")
    return obj


def file_sha256(path: str | Path) -> str | None:
    """The sha256 of the file at ``path`` (None where it cannot be read: ``read_weights`` says why)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def read_card(model: str | Path) -> tuple[dict | None, str | None]:
    """The model card beside ``model`` (``<stem>.json``, as trained_models/ ships one per model): ``(card, None)``
    where it is a JSON object, ``(None, None)`` where there is no such file, and ``(None, why)`` where there is one
    that cannot be read or is not a JSON object. Whether the card describes this file (its ``model_file`` and
    ``sha256``) is the caller's to check."""
    path = Path(model).with_suffix(".json")
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot be read ({getattr(e, 'strerror', None) or e})"
    try:
        card = json.loads(text)
    except ValueError as e:
        return None, f"is not JSON ({e})"
    except RecursionError:
        return None, "is not JSON that can be read (nested too deeply)"
    if not isinstance(card, dict):
        return None, "is not a JSON object"
    return card, None


def card_of_this_file(model: str | Path, sha256: str | None) -> dict | None:
    """The card beside ``model`` where it describes this very file (its ``sha256`` is ``sha256``, whatever name
    its ``model_file`` gives: a renamed copy keeps its card), else None."""
    card, _ = read_card(model)
    if card is None or sha256 is None or card.get("sha256") != sha256:
        return None
    return card


def is_checkpoint(obj) -> bool:
    return isinstance(obj, dict) and obj.get("format") == CHECKPOINT_FORMAT


def state_dict_of(obj: dict, path: str | Path) -> dict:
    """The model state_dict inside a ``.dat`` (itself) or a ``.ckpt`` (its ``model``)."""
    if is_checkpoint(obj):
        if "model" not in obj:
            raise ModelFileError(f"checkpoint {path} has no model in it (the file is damaged)")
        sd = obj["model"]
    else:
        sd = obj
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise ModelFileError(f"model file {path} is not a state_dict of tensors: point to a .dat or .ckpt that main.py "
                             f"wrote, or an upstream .dat")
    return sd


def played_state_dict(obj: dict, path: str | Path) -> dict:
    """The weights a file's run played and shipped: a ``.ckpt``'s ``average_model`` where it has one (a run with
    ``--ema-steps``, whose ``.dat`` holds the same average), else its ``model``; a ``.dat`` itself."""
    if is_checkpoint(obj) and obj.get("average_model") is not None:
        average = obj["average_model"]
        if is_checkpoint(average) or not isinstance(average, dict) or not all(
                isinstance(k, str) and torch.is_tensor(v) for k, v in average.items()):
            raise ModelFileError(f"checkpoint {path} is damaged: its 'average_model' is not a state_dict of tensors")
        return average
    return state_dict_of(obj, path)


def is_count(x) -> bool:
    """A step or game count a checkpoint may hold: an int (not a bool) that fits the run's int64 counters."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2 ** 63


def check_checkpoint(ckpt: dict, path: str | Path) -> None:
    """Raise ``ModelFileError`` unless every field a resume reads has the type and shape it needs (the model
    itself is checked by ``state_dict_of`` and ``check_state_dict``)."""
    def bad(field: str, what: str):
        raise ModelFileError(f"checkpoint {path} is damaged: '{field}' {what}")

    def finite(x) -> bool:
        try:
            return math.isfinite(x)
        except OverflowError:  # an int too large for a float
            return False

    version = ckpt.get("version", CHECKPOINT_VERSION)
    if not is_count(version):
        bad("version", "is not a version number")
    if version > CHECKPOINT_VERSION:
        raise ModelFileError(f"checkpoint {path} is of format version {version}, newer than this code's "
                             f"{CHECKPOINT_VERSION}: update the repository (git pull) to resume it")
    steps = ckpt.get("global_steps", 0)
    if not is_count(steps):
        bad("global_steps", "is not a step count")
    elapsed = ckpt.get("elapsed_seconds", 0.0)
    if not isinstance(elapsed, (int, float)) or isinstance(elapsed, bool):
        bad("elapsed_seconds", "is not a number")
    norm = ckpt.get("norm_stats")
    if norm is not None and not (torch.is_tensor(norm) and norm.dim() == 2 and norm.shape[1] == 3
                                 and norm.shape[0] >= 2):
        bad("norm_stats", "is not a (processes, 3) tensor")
    if not finite(elapsed) or elapsed < 0:
        bad("elapsed_seconds", "is not a time")
    monitor = ckpt.get("monitor")
    if monitor is not None and not (torch.is_tensor(monitor) and tuple(monitor.shape) == (3,)
                                    and monitor.is_floating_point() and bool(torch.isfinite(monitor[:2]).all())
                                    and monitor[0].item() >= 0 and monitor[0].item() == int(monitor[0].item())
                                    and not math.isnan(monitor[2].item())):
        bad("monitor", "is not a (3,) tensor of games, their score sum and the best score")
    recent = ckpt.get("recent_scores", [])
    if not isinstance(recent, (list, tuple)) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                        and finite(x) for x in recent):
        bad("recent_scores", "is not a list of scores")
    config = ckpt.get("config")
    if config is not None and not (isinstance(config, dict) and all(isinstance(k, str) for k in config)):
        bad("config", "is not a dict of flags")
    config = config or {}
    for key in ("env", "mode", "compute_precision"):  # the flags a resume compares with its own
        if key in config and not isinstance(config[key], str):
            bad(f"config.{key}", "is not a name")
    train_envs = config.get("train_envs")
    if train_envs is not None and not (isinstance(train_envs, list) and all(isinstance(e, str) for e in train_envs)):
        bad("config.train_envs", "is not a list of env ids")
    for key in ("lr_anneal_steps", "entropy_anneal_steps"):
        if key in config and not is_count(config[key]):
            bad(f"config.{key}", "is not a step count")
    if config.get("train_batch") is not None and not is_count(config["train_batch"]):
        bad("config.train_batch", "is not a count")
    if "train_passes" in config and not (is_count(config["train_passes"]) and config["train_passes"] >= 1):
        bad("config.train_passes", "is not a number of passes")
    for key in ("short_game_slots", "greedy_slots", "short_game_length"):
        if key in config and not is_count(config[key]):
            bad(f"config.{key}", "is not a count")
    after = config.get("short_games_after_score")
    if after is not None and not (isinstance(after, (int, float)) and not isinstance(after, bool) and finite(after)):
        bad("config.short_games_after_score", "is not a score")
    if config.get("later_passes", "full") not in LATER_PASSES:
        bad("config.later_passes", f"is not a --later-passes value ({' or '.join(LATER_PASSES)})")
    pass_clip = config.get("pass_clip", 0.2)
    if not (isinstance(pass_clip, (int, float)) and not isinstance(pass_clip, bool) and finite(pass_clip)
            and 0 < pass_clip < 1):
        bad("config.pass_clip", "is not a clip range")
    for field in ("ga3c_updates", "ga3c_episodes"):
        if field in ckpt and not is_count(ckpt[field]):
            bad(field, "is not a count")
    if not isinstance(ckpt.get("short_games_started", False), bool):
        bad("short_games_started", "is not true or false")
    opt = ckpt.get("optimizer")
    if opt is not None and not (isinstance(opt, dict) and isinstance(opt.get("state"), dict)
                                and isinstance(opt.get("param_groups"), list)
                                and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                        for g in opt["param_groups"])):
        bad("optimizer", "is not an optimizer state_dict")
    name = ckpt.get("optimizer_name")
    if name is not None and not isinstance(name, str):
        bad("optimizer_name", "is not a name")
    if "ema_steps" in config and not is_count(config["ema_steps"]):
        bad("config.ema_steps", "is not a step count")
    average = ckpt.get("average_model")
    if average is not None and not (isinstance(average, dict) and all(
            isinstance(k, str) and torch.is_tensor(v) for k, v in average.items())):
        bad("average_model", "is not a state_dict of tensors")


def check_state_dict(sd: dict, num_actions: int, hidden_size: int, path: str | Path, env_id: str) -> None:
    """Raise ``ModelFileError`` unless ``sd`` has exactly the 16 keys with the shapes this env and
    ``--hidden-size`` need (the message names the key and both shapes), as floating-point tensors (float32, or
    float16 / bfloat16 where a file is stored in fewer bytes: ``load_state_dict`` copies them into float32), all
    finite."""
    want = expected_shapes(num_actions, hidden_size)
    missing = [k for k in want if k not in sd]
    extra = [k for k in sd if k not in want]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}{'...' if len(missing) > 4 else ''}")
        if extra:
            parts.append(f"unexpected {', '.join(extra[:4])}{'...' if len(extra) > 4 else ''}")
        raise ModelFileError(f"model file {path} is not an A3Clstm state_dict: {'; '.join(parts)}: point to a model "
                             f"of this repository's (or upstream's) A3Clstm")
    not_float = [k for k in want if not sd[k].is_floating_point()]
    if not_float:
        raise ModelFileError(f"model file {path} holds {sd[not_float[0]].dtype} tensors ({', '.join(not_float[:4])}"
                             f"{'...' if len(not_float) > 4 else ''}), not floating-point weights: it is not a model")
    for key, shape in want.items():
        got = tuple(sd[key].shape)
        if got != shape:
            hint = ""
            if key.startswith("actor_linear"):
                hint = f" ({env_id} has {num_actions} actions)"
            elif key.startswith(("lstm", "critic", "actor")):
                saved = tuple(sd["lstm.weight_hh"].shape) if "lstm.weight_hh" in sd else ()
                hint = (f" (the file's hidden size is {saved[1]}: pass --hidden-size {saved[1]}, now {hidden_size})"
                        if len(saved) == 2 and saved[0] == 4 * saved[1] else
                        f" (check --hidden-size, now {hidden_size})")
            raise ModelFileError(f"model file {path} does not fit {env_id}: {key} has shape {got} in the file, "
                                 f"the model needs {shape}{hint}")
    not_finite = [k for k in want if not bool(torch.isfinite(sd[k]).all())]
    if not_finite:
        raise ModelFileError(f"model file {path} holds NaN or infinite weights ({', '.join(not_finite[:4])}"
                             f"{'...' if len(not_finite) > 4 else ''}): a run that diverged, or a damaged file; "
                             "load an earlier checkpoint or model")

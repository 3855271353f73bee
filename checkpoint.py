"""Model files and checkpoints: atomic writes, strict and explained loads.

Two files per run in ``--save-model-dir``:
- ``<env>.dat``: the drop-in model, a bare state_dict of the 16 upstream keys as CPU tensors (upstream format).
- ``<env>.ckpt``: the full checkpoint, a dict with ``model``, ``optimizer`` (or None without a shared optimizer),
  ``global_steps``, ``best_score``, ``norm_stats``, ``elapsed_seconds``, ``config`` and ``format``/``version``.

Both are written to a temporary file in the same folder and renamed over the old one, so a crash never leaves a
half-written file. Every load uses ``torch.load(..., weights_only=True)``.
"""
from __future__ import annotations

import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

from model import expected_shapes
from utils import safe_name

CHECKPOINT_FORMAT = "a3g-checkpoint"
CHECKPOINT_VERSION = 1


class ModelFileError(ValueError):
    """A model file that cannot be used; the message names the file and what is wrong."""


def model_path(folder: str | Path, env_id: str) -> Path:
    return Path(folder) / f"{safe_name(env_id)}.dat"


def checkpoint_path(folder: str | Path, env_id: str) -> Path:
    return Path(folder) / f"{safe_name(env_id)}.ckpt"


def atomic_save(obj, path: str | Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def cpu_state_dict(model: torch.nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """A detached CPU copy of the state_dict (never a view of the live shared weights)."""
    return OrderedDict((k, v.detach().to("cpu", copy=True).contiguous()) for k, v in model.state_dict().items())


def read_weights(path: str | Path) -> dict:
    """Load a ``.dat`` or ``.ckpt`` file with ``weights_only=True``; raise ``ModelFileError`` in plain words."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError, OSError,
            AttributeError, TypeError, KeyError, IndexError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"model file {path} is corrupt or not a PyTorch weights file ({reason[:160]})")
    if not isinstance(obj, dict):
        raise ModelFileError(f"model file {path} holds a {type(obj).__name__}, not a state_dict")
    return obj


def is_checkpoint(obj: dict) -> bool:
    return obj.get("format") == CHECKPOINT_FORMAT


def state_dict_of(obj: dict, path: str | Path) -> dict:
    """The model state_dict inside a ``.dat`` (itself) or a ``.ckpt`` (its ``model``)."""
    sd = obj["model"] if is_checkpoint(obj) else obj
    if not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise ModelFileError(f"model file {path} is not a state_dict of tensors")
    return sd


def check_state_dict(sd: dict, num_actions: int, hidden_size: int, path: str | Path, env_id: str) -> None:
    """Raise ``ModelFileError`` unless ``sd`` has exactly the 16 keys with the shapes this env and
    ``--hidden-size`` need; the message names the key and both shapes."""
    want = expected_shapes(num_actions, hidden_size)
    missing = [k for k in want if k not in sd]
    extra = [k for k in sd if k not in want]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}{'...' if len(missing) > 4 else ''}")
        if extra:
            parts.append(f"unexpected {', '.join(extra[:4])}{'...' if len(extra) > 4 else ''}")
        raise ModelFileError(f"model file {path} is not an A3Clstm state_dict: {'; '.join(parts)}")
    for key, shape in want.items():
        got = tuple(sd[key].shape)
        if got != shape:
            hint = ""
            if key.startswith("actor_linear"):
                hint = f" ({env_id} has {num_actions} actions)"
            elif key.startswith(("lstm", "critic", "actor")):
                hint = f" (check --hidden-size, now {hidden_size})"
            raise ModelFileError(f"model file {path} does not fit {env_id}: {key} has shape {got} in the file, "
                                 f"the model needs {shape}{hint}")

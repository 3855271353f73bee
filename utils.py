"""Small shared helpers: file names, logging, child-process setup, device choice."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

import torch


def safe_name(env_id: str) -> str:
    """An env id as a file name (``ALE/Pong-v5`` -> ``ALE_Pong-v5``)."""
    return env_id.replace("/", "_")


def setup_logger(name: str, path: Path | None = None, *, console: bool = False, fmt: str = "%(asctime)s : %(message)s",
                 ) -> logging.Logger:
    """A logger that appends to ``path`` (never truncates) and optionally echoes to stdout; flushed per line."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    formatter = logging.Formatter(fmt)
    if path is not None:
        fh = logging.FileHandler(path, mode="a")
        fh.setFormatter(formatter)
        logger.addHandler(fh)
    if console:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(sh)
    return logger


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest value glibc accepts on 64-bit


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the kernel.

    A worker allocates and frees the same large tensors every rollout (a rollout's stacked activations, the
    16 MB max-pool gradient of the first conv block). By default glibc serves blocks that large with a fresh
    ``mmap`` and returns them on free, so every rollout pays ~10,000 page faults, zero-filling the pages again:
    about 30% of the update's time on this model. With allocations up to 32 MB taken from the heap and the heap
    never trimmed, the memory is reused: resident memory stays at its per-rollout peak, flat over a run.
    Returns False (and changes nothing) where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))  # C int max
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False


def setup_child_process(role: str, num_threads: int = 1) -> None:
    """Process hygiene for a worker or the monitor.

    Names the process (``ps``/``top``), lets only the main process react to Ctrl-C (it stops everyone through an
    event), asks the kernel to kill this process if the main process dies, sets the thread count once, and
    keeps freed memory for reuse (``keep_freed_memory``).
    """
    keep_freed_memory()
    try:
        import setproctitle
        setproctitle.setproctitle(f"a3g {role}")
    except ImportError:  # pragma: no cover - setproctitle is in requirements.txt
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:  # pragma: no cover
            pass
    torch.set_num_threads(num_threads)


def worker_device(gpu_ids: list[int], rank: int) -> torch.device:
    """Worker ``rank``'s device: ``cuda:gpu_ids[rank % n]``, or the CPU when ``gpu_ids`` is ``[-1]``."""
    if not gpu_ids or gpu_ids[0] < 0:
        return torch.device("cpu")
    return torch.device("cuda", gpu_ids[rank % len(gpu_ids)])


def use_device(device: torch.device) -> None:
    """Make ``device`` current for this process, so no CUDA context appears on other GPUs."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def format_duration(seconds: float) -> str:
    """``00h 10m 03s`` as in the upstream log line."""
    s = int(seconds)
    return f"{s // 3600:02d}h {(s // 60) % 60:02d}m {s % 60:02d}s"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    return True

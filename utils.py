"""Small shared helpers: file names, logging, child-process setup, device choice."""
from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

import torch


def safe_name(env_id: str) -> str:
    """An env id as a file name (``ALE/Pong-v5`` -> ``ALE_Pong-v5``)."""
    return env_id.replace("/", "_")


def compact_json(obj, indent: int = 2, _level: int = 0) -> str:
    """JSON as ``json.dumps(obj, indent=indent)`` writes it, except that a list holding no list or dict is written
    on one line (an evaluation's 100 scores: one line, not 100). ``json.loads`` gives back what ``json.dumps``
    would. Dict keys must be strings."""
    pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
    if isinstance(obj, dict) and obj:
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("compact_json: dict keys must be strings")
        items = (f"{inner}{json.dumps(k)}: {compact_json(v, indent, _level + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in obj):
        return "[\n" + ",\n".join(inner + compact_json(v, indent, _level + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def drop_cut_line(path: Path) -> bytes:
    """Where the file at ``path`` ends inside a line (``ends_mid_line``), cut it back to the end of its last whole
    line and return the bytes dropped (b"" otherwise): a line cut inside its last value can still parse, with a
    wrong number in it (GA3C's results.txt: a game length of 16 cut from 1654)."""
    if not ends_mid_line(path):
        return b""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        start = max(0, size - 65536)  # a line is far shorter: the last newline is in the tail
        f.seek(start)
        tail = f.read()
        keep = start + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        f.seek(keep)
        dropped = f.read()
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return dropped


def ends_mid_line(path: Path) -> bool:
    """Whether the file at ``path`` exists, is not empty and does not end with a newline: its last line was cut
    short (a run killed, or out of disk, while writing it), and an append must end that line first."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def close_quietly(f) -> None:
    """Close the file ``f``; a write it still holds that fails again (a full disk, already reported) is dropped."""
    try:
        f.close()
    except OSError:
        pass


class LogFileHandler(logging.FileHandler):
    """``logging.FileHandler`` whose failed writes (an ``OSError``: a full disk) are reported once, in one line on
    stderr, instead of a traceback per record; the lines it could not write are lost, the process goes on. Other
    errors (a record that cannot be formatted) get logging's own report."""

    def handleError(self, record: logging.LogRecord) -> None:
        e = sys.exc_info()[1]
        if not isinstance(e, OSError):  # not the file: a bad format string, say; logging's own report
            super().handleError(record)
            return
        if getattr(self, "_reported", False):
            return
        self._reported = True
        from checkpoint import write_error_message
        why = write_error_message(Path(self.baseFilename), e)
        try:
            print(f"{why} (log lines that cannot be written are dropped)", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # pragma: no cover - stderr itself is gone
            pass

    def close(self) -> None:
        """Close the file; lines still buffered that cannot be written (reported once) are dropped."""
        try:
            super().close()
        except OSError:
            self.stream = None


def setup_logger(name: str, path: Path | None = None, *, console: bool = False, fmt: str = "%(asctime)s : %(message)s",
                 ) -> logging.Logger:
    """A logger that appends to ``path`` (never truncates) and optionally echoes to stdout; flushed per line. A
    line that cannot be written to ``path`` (a full disk) is dropped; the first such failure is reported in one line
    on stderr (``LogFileHandler``)."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    formatter = logging.Formatter(fmt)
    if path is not None:
        fh = LogFileHandler(path, mode="a")
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

    Binds the process to the main process (``lifeline.bind_to_parent``: killed when main dies, SIGINT ignored so
    that only the main process reacts to Ctrl-C and stops everyone through the run's stop flag), names it
    (``ps``/``top``), sets the thread count once, and keeps freed memory for reuse (``keep_freed_memory``).
    A process that main did not start (a benchmark's, a test's) still dies with its parent and ignores SIGINT.
    """
    import lifeline
    if os.environ.get(lifeline.PARENT_ENV):
        lifeline.bind_to_parent()
    else:
        lifeline._set_parent_death_signal(signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    keep_freed_memory()
    try:
        import setproctitle
        setproctitle.setproctitle(f"a3g {role}")
    except ImportError:  # pragma: no cover - setproctitle is in requirements.txt
        pass
    torch.set_num_threads(num_threads)


def end_child_process(code: int) -> None:
    """End a training child process now, with exit status ``code``, without the interpreter's teardown.

    Freeing torch's and ALE's objects module by module takes 0.5-0.9 s of CPU per process that imported torch, at
    every stop, spent by every child at once while the main process waits for them. A training child shares only
    memory and files with the main process (``run_state.py``, ``ga3c/buffers.py``: no multiprocessing queue, pipe
    or lock whose feeder thread would have to finish), and its files are closed by then; its log handlers and
    standard streams are flushed here. Not for a process that sends on a ``multiprocessing.Queue``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(code)


def describe_failure(e: BaseException) -> str:
    """What a failed process reports: one line for a file that could not be written (a full disk), else the
    traceback."""
    from checkpoint import CheckpointWriteError
    if isinstance(e, CheckpointWriteError):
        return str(e)
    return "".join(traceback.format_exception(e))


def worker_device(gpu_ids: list[int], rank: int) -> torch.device:
    """Worker ``rank``'s device: ``cuda:gpu_ids[rank % n]``, or the CPU when ``gpu_ids`` is ``[-1]``."""
    if not gpu_ids or gpu_ids[0] < 0:
        return torch.device("cpu")
    return torch.device("cuda", gpu_ids[rank % len(gpu_ids)])


def use_device(device: torch.device) -> None:
    """Make ``device`` current for this process, so no CUDA context appears on other GPUs, and make float32 work
    on CUDA run in float32: cuDNN's convolutions and LSTMs use TF32 by default on Ampere and newer GPUs (10-bit
    mantissa; a GA3C trainer's conv1 gradient was 4% off the CPU's on an H200, 5e-6 without it), so this turns
    TF32 off for cuDNN and for matrix products. ``--precision bf16`` runs the conv encoder in bf16 explicitly
    (``model.A3Clstm.set_precision``), so the flags only keep the parts meant to be float32 in float32. Every
    process that computes on a GPU calls this first (workers, the GA3C server, the monitor, gym_eval.py)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    if device.type == "cuda" and device.index is not None:  # plain "cuda" is the current device: nothing to set
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

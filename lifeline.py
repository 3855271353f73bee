"""Tie child processes to the main process's life, and take stop signals from the first instant.

Imported before anything heavy (it needs only the standard library), because the moments it guards are the
first ones: a spawned child spends seconds importing torch before it could run any code of ours, and a main
process spends as long before it reaches ``main()``.

- ``bind_to_parent()``, in a child: ask the kernel to SIGKILL this process when its parent dies
  (``PR_SET_PDEATHSIG``), then check that the parent is still the main process that started it: if that one
  died before the request, the child has already been re-parented and must exit at once. ``main.py`` calls it
  when it is imported into a spawned child, before its own imports; ``setup_child_process`` calls it again.
- Children start with SIGINT and SIGTERM *blocked* (the main process blocks them while it starts children,
  and a blocked mask survives exec): a Ctrl-C at the terminal during their start-up stays pending.
  ``bind_to_parent`` then sets SIGINT to ignored (which discards a pending one: only the main process decides
  to stop, and tells the children through the run's stop flag), SIGTERM to its default, and unblocks both.
- ``StopSignals``, in the main process: records SIGINT/SIGTERM from the moment it is installed, so a signal
  during imports, validation or start-up is never lost.
- ``StartupWatch``, in the main process around a start-up that may block in C code (Ray's client): a stop signal
  that Python cannot handle there still ends the process, through ``signal.set_wakeup_fd``.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

PARENT_ENV = "A3G_MAIN_PID"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
        return False


def bind_to_parent() -> None:
    """In a child started by ``main.py`` (``A3G_MAIN_PID`` in its environment): die with the main process,
    and leave stopping to it (see the module docstring). Does nothing in a process that main did not start."""
    expected = os.environ.get(PARENT_ENV)
    if not expected:
        return
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(expected):  # the main process died before the request above: we are an orphan
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def mark_children() -> None:
    """In the main process, before starting children: they will bind to this process."""
    os.environ[PARENT_ENV] = str(os.getpid())


def quit_on_interrupt(prog: str) -> None:
    """Until the caller installs its own handling: a Ctrl-C (SIGINT) prints ``<prog>: interrupted`` and exits 130
    at once, for a script's seconds of imports, when it has started nothing that needs stopping."""
    def handler(signum, frame):
        sys.stderr.write(f"{prog}: interrupted\n")
        sys.stderr.flush()
        os._exit(130)

    signal.signal(signal.SIGINT, handler)


def unwind_on_interrupt() -> None:
    """From here on a Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` once, so that ``finally`` blocks stop what was
    started; later ones are ignored, so that the clean-up finishes."""
    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


class blocked_stop_signals:
    """``with blocked_stop_signals():`` SIGINT and SIGTERM stay pending in this process and in every child
    started inside the block, until the block ends here and ``bind_to_parent`` runs there."""

    def __enter__(self):
        self._old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        return self

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old)
        return False


class deferred_stop_handlers:
    """``with deferred_stop_handlers():`` (main thread only) the Python handlers of SIGINT and SIGTERM only record
    the signals; at the end of the block the handlers of before are put back and each recorded signal is raised
    again, so that they run then.

    Blocking the signals in the main thread does not keep its handlers from running: the kernel gives a signal
    sent to the process to a thread that does not block it (torch and OpenCV start such threads), and Python then
    runs the handler in the main thread at its next bytecode, whatever that thread's mask."""

    def __enter__(self):
        self.received: list[int] = []
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                if signal.getsignal(s) is None:  # a handler installed from C, which Python could not put back
                    continue
                self._old[s] = signal.signal(s, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        for s in self.received:
            signal.raise_signal(s)
        return False


def start_child(process) -> None:
    """``process.start()`` with SIGINT and SIGTERM blocked, so that the child starts with them blocked, and the
    process's handlers of them deferred to the end of the start (``deferred_stop_handlers``), so that a handler
    that exits or raises never leaves a child launched without its data (a multiprocessing traceback from the
    child, reading a closed pipe).

    multiprocessing starts its resource tracker inside the first ``start()`` and afterwards *unblocks* SIGINT
    and SIGTERM in the calling process (``resource_tracker.ensure_running``), whatever the mask was: a child
    started after that inside one long block would start unprotected. So the tracker is started first, outside
    any block, and each start gets its own block. A deferred handler that raises (``KeyboardInterrupt``) raises
    from here, after the child is killed and reaped: the caller never holds a started process it does not know
    of."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    try:
        with deferred_stop_handlers(), blocked_stop_signals():
            process.start()
    except BaseException:
        if process.pid is not None:
            process.kill()
            process.join()
        raise


class StopSignals:
    """SIGINT/SIGTERM as a stop request: the first one is recorded (``signal``), a second one raises
    ``KeyboardInterrupt`` (stop waiting politely). ``exit_code`` is 130 for SIGINT, 143 for SIGTERM.

    ``prog``: until ``arm()`` is called, a second signal ends the process at once with one line on stderr naming
    ``prog`` and exit code ``exit_code`` (for the start-up before anything is started or written: the imports, the
    checks of the flags and files, where a ``KeyboardInterrupt`` could only end in a traceback)."""

    def __init__(self, prog: str | None = None):
        self.signal: int | None = None
        self.prog = prog

    def __call__(self, signum, frame):
        if self.signal is None:
            self.signal = signum
        elif self.prog is not None:
            try:
                print(f"{self.prog}: {self.reason} during start-up; nothing written", file=sys.stderr, flush=True)
            finally:
                os._exit(self.exit_code)
        else:
            raise KeyboardInterrupt

    def arm(self) -> "StopSignals":
        """From here on a second signal raises ``KeyboardInterrupt`` (the caller has something to stop)."""
        self.prog = None
        return self

    def install(self) -> "StopSignals":
        for s in STOP_SIGNALS:
            signal.signal(s, self)
        return self

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal) if self.signal is not None else 0

    @property
    def reason(self) -> str:
        return "interrupted (Ctrl-C)" if self.signal == signal.SIGINT else "terminated (SIGTERM)"


class StartupWatch:
    """Ends the process when a stop signal arrives while its main thread is stuck in a call that does not return.

    Python runs signal handlers (``StopSignals``) only in the main thread, between bytecodes: a main thread blocked
    inside C code (seen: a Ray call of the multi-node start-up, after a SIGTERM to the process group reached the
    local cluster too) never runs them. The C-level handler still writes the signal's number to the pipe given to
    ``signal.set_wakeup_fd``: a thread reading it gives the main thread ``grace`` seconds to notice the stop by
    itself (the usual path: the ``with`` block ends and the watch with it), and otherwise calls
    ``on_stuck(signum)`` (report it; kill what the process started) and exits with 128 + the signal's number,
    whatever ``on_stuck`` raised. ``pending()`` returns a stop signal that Python already handled
    (``StopSignals.signal``: it may have come just before the watch began), or None. Use it as a context manager
    in the main thread (only the main thread may call ``set_wakeup_fd``).
    """

    def __init__(self, on_stuck, pending=lambda: None, grace: float = 10.0):
        self.on_stuck, self.pending, self.grace = on_stuck, pending, grace
        self._done = threading.Event()
        self._fds: tuple[int, int] | None = None
        self._old_fd = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "StartupWatch":
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._fds = (r, w)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="start-up watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._done.set()
        signal.set_wakeup_fd(self._old_fd)
        self._thread.join(1.0)
        for fd in self._fds:
            os.close(fd)
        return False

    def _watch(self) -> None:
        r = self._fds[0]
        while not self._done.is_set():
            stops = []
            if select.select([r], [], [], 0.2)[0]:
                stops = [b for b in os.read(r, 64) if b in (int(signal.SIGINT), int(signal.SIGTERM))]
            signum = stops[0] if stops else self.pending()
            if signum is not None and not self._done.wait(self.grace):
                self.end(int(signum))

    def end(self, signum: int) -> None:
        try:
            self.on_stuck(signum)
        finally:
            os._exit(128 + signum)

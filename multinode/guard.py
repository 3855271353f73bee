"""Nothing of a ``local`` Ray cluster outlives the driver that started it, however the driver ends (``kill -9``
included).

Ray binds the processes it starts itself (control store, raylet, dashboard, log monitor) to the driver with a
parent-death signal, and its workers end with their raylet. The raylet's own children, ``ray::DashboardAgent``
and ``ray::RuntimeEnvAgent``, do not: they notice that the raylet died, then report it through the control store,
which died too, and Ray 2.60 gives that report 60 s before they exit. No parent-death signal of the driver can reach
them (the raylet starts them; the setting is not inherited), and their titles name neither the driver nor its Ray
session.

So, before ``ray.init``, the driver starts this file as its guard (``start``): a small process (standard library
and psutil only) that notes the driver's descendants every ``POLL_SECONDS`` and waits for the pipe the driver
holds to close, which happens when the driver ends, whatever ends it. It then kills every process it noted that
still runs (psutil refuses a pid that was reused), their children, and the processes that carry the driver's Ray
session (``session_processes``), and exits. It ignores SIGINT and SIGTERM: a stop signal sent to the whole process
group leaves it to clean up after the driver.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

POLL_SECONDS = 0.5  # how often the guard notes the driver's descendants

_guard: subprocess.Popen | None = None  # the driver's guard; its stdin is the pipe whose end ends the guard


def session_processes(driver: int, since: float) -> list:
    """Live processes of the ``local`` Ray cluster started by process ``driver``, which was created at ``since``
    (psutil's ``create_time``): Ray names the cluster's session after the pid of the process that started it, and
    gives its processes ``--session-name`` (a worker whose raylet died is re-parented away from the driver, so it
    cannot be found as its descendant). A process created before the driver is another cluster's: one that
    ``ray start`` began under the same pid, which its command freed when it exited."""
    import psutil
    suffix = f"_{driver}"
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        args = p.info["cmdline"] or []
        if (any(a.startswith("--session-name=") and a.endswith(suffix) for a in args)
                and (p.info["create_time"] or 0.0) >= since):
            found.append(p)
    return found


def kill_all(procs) -> None:
    """SIGKILL each of ``procs`` (psutil processes) that still runs."""
    import psutil
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def start() -> int:
    """In the driver, before it starts a ``local`` cluster: start its guard (once per process) and return the
    guard's pid. Its stop signals are blocked until it ignores them, so a Ctrl-C at that moment does not end it."""
    global _guard
    if _guard is None or _guard.poll() is not None:
        from lifeline import blocked_stop_signals
        with blocked_stop_signals():
            _guard = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid())],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
    return _guard.pid


def guard_pid() -> int | None:
    """The pid of this process's running guard, or None."""
    return _guard.pid if _guard is not None and _guard.poll() is None else None


def watch(driver: int, pipe: int, poll: float = POLL_SECONDS) -> None:
    """The guard's loop (see the module docstring): note ``driver``'s descendants until ``pipe`` closes, then kill
    what of them is left, with their children and the processes of ``driver``'s Ray session."""
    import psutil
    me = os.getpid()
    noted: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(driver)
        since = root.create_time()
    except psutil.Error:
        root = None
    while root is not None:
        if select.select([pipe], [], [], poll)[0] and not os.read(pipe, 4096):
            break  # the driver ended: every end of the pipe is closed
        try:
            for p in root.children(recursive=True):
                noted.setdefault(p.pid, p)
        except psutil.Error:  # the driver is gone; its end of the pipe closes with it
            pass
        noted = {pid: p for pid, p in noted.items() if p.is_running()}
    left = {pid: p for pid, p in noted.items() if p.is_running()}
    for p in list(left.values()):
        try:
            left.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    left.update({p.pid: p for p in session_processes(driver, since)})
    left.pop(me, None)
    kill_all(left.values())


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: guard.py DRIVER_PID (started by multinode.guard.start, with the driver's pipe as stdin)",
              file=sys.stderr)
        return 2
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
    try:
        import setproctitle
        setproctitle.setproctitle(f"a3g ray guard of {argv[0]}")
    except ImportError:  # pragma: no cover - setproctitle is in requirements.txt
        pass
    watch(int(argv[0]), sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

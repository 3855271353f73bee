"""Fault injection for tests/test_faults.py, loaded by every Python process started with this folder first on
PYTHONPATH (spawned workers inherit the environment). Inert unless ``A3G_FAULT`` is set.

``A3G_FAULT=huge_error`` (or ``short_error``): once ``shared_optim`` is imported, every optimizer ``step()`` in the
process named ``A3G_FAULT_ROLE`` (default ``a3g worker 0``) is counted, and step number ``A3G_FAULT_AFTER``
(default 3) raises ``RuntimeError`` with a 200,000-character (or a one-line) message. Just before raising it
creates the file ``A3G_FAULT_FIRED`` (when set), so a test can tell "the fault never fired" from "the run did not
end". The hook is a global optimizer step pre-hook, so it does not depend on the optimizer's class names.

``A3G_FAULT=slow_step``: every optimizer ``step()`` in the process named ``A3G_FAULT_ROLE`` sleeps
``A3G_FAULT_SLEEP`` seconds (default 0.2) right after it has changed the weights and statistics (a step post-hook;
a GA3C trainer holds its step lock until after the version moves, below the step), and the first one creates
``A3G_FAULT_FIRED``: a state in the middle of a step that a copy without the lock would catch.

``A3G_FAULT=startup_mask``: every child of a run (a process with ``A3G_MAIN_PID`` in its environment) appends
``<pid> blocked`` or ``<pid> unblocked`` to ``A3G_FAULT_FIRED``: whether SIGINT was blocked when its interpreter
started, which is when a terminal's Ctrl-C would otherwise kill it with "Fatal Python error: init_import_site".
"""
import os
import sys

_FAULT = os.environ.get("A3G_FAULT", "")
HUGE = 200_000

if _FAULT == "startup_mask":
    if os.environ.get("A3G_MAIN_PID") and os.environ.get("A3G_FAULT_FIRED"):
        import signal
        blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        with open(os.environ["A3G_FAULT_FIRED"], "a") as f:
            f.write(f"{os.getpid()} {'blocked' if blocked else 'unblocked'}\n")
elif _FAULT:
    import importlib.abc
    import importlib.machinery

    def _role_matches() -> bool:
        want = os.environ.get("A3G_FAULT_ROLE", "a3g worker 0")
        try:
            import setproctitle
        except ImportError:  # no titles: every process qualifies
            return True
        return setproctitle.getproctitle().strip() == want

    def _install_slow_step() -> None:
        import time

        from torch.optim.optimizer import register_optimizer_step_post_hook
        pause = float(os.environ.get("A3G_FAULT_SLEEP", "0.2"))

        def hook(optimizer, args, kwargs):
            if not _role_matches():
                return
            fired = os.environ.get("A3G_FAULT_FIRED")
            if fired and not os.path.exists(fired):
                with open(fired, "a") as f:
                    f.write(f"{os.getpid()}\n")
            time.sleep(pause)

        register_optimizer_step_post_hook(hook)

    def _install() -> None:
        if _FAULT == "slow_step":
            return _install_slow_step()
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        after = int(os.environ.get("A3G_FAULT_AFTER", "3"))
        calls = [0]

        def hook(optimizer, args, kwargs):
            if not _role_matches():
                return None
            calls[0] += 1
            if calls[0] < after:
                return None
            fired = os.environ.get("A3G_FAULT_FIRED")
            if fired:
                with open(fired, "a") as f:
                    f.write(f"{os.getpid()}\n")
            if _FAULT == "huge_error":
                raise RuntimeError("injected fault: " + "x" * HUGE + " :end of injected fault")
            raise RuntimeError("injected fault: a short error")

        register_optimizer_step_pre_hook(hook)

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        """Installs the hook right after ``shared_optim`` is executed (torch is imported by then)."""

        def find_spec(self, name, path=None, target=None):
            if name != "shared_optim":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return None
            original = spec.loader.exec_module

            def exec_module(module):
                original(module)
                _install()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())

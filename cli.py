"""Command-line helpers with no heavy imports: a one-line-error parser, boolean switches, output path checks."""
from __future__ import annotations

import argparse
import os
from pathlib import Path


class HelpFormatter(argparse.HelpFormatter):
    """Shows a ``BoolFlag`` as the switches it is (``--amsgrad, --no-amsgrad``), without a value placeholder."""

    def _format_action_invocation(self, action):
        if isinstance(action, BoolFlag):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)

    def _format_usage(self, usage, actions, groups, prefix):
        return super()._format_usage(usage, actions, groups, prefix).replace(" [BOOL]", "")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``prog: error: ... (see --help)``) and exit code 2; no
    abbreviated long flags (``--save`` is not ``--save-model-dir``), so a printed command means what it says
    (argparse still completes a unique prefix of a single-dash flag: ``-ds`` is ``-dss``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def str2bool(value: str) -> bool:
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "y", "on"):
        return True
    if v in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got '{value}'")


class BoolFlag(argparse.Action):
    """A switch: ``--flag`` (true) and ``--no-flag`` (false); ``--flag true|false`` is accepted too, as upstream's
    scripts write it (``--amsgrad True``)."""

    def __init__(self, option_strings, dest, default=False, help=None, **kwargs):
        strings = list(option_strings)
        for s in option_strings:
            if s.startswith("--"):
                strings.append("--no-" + s[2:])
        super().__init__(strings, dest, nargs="?", const=None, default=default, help=help, metavar="BOOL")

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value")
            setattr(namespace, self.dest, False)
        else:
            try:
                setattr(namespace, self.dest, True if values is None else str2bool(values))
            except argparse.ArgumentTypeError as e:
                parser.error(f"{option_string}: {e}")


def _can_write_in(folder: Path) -> bool:
    """Whether a file can be created in the existing ``folder`` (tried with a temporary file, removed at once:
    permissions alone do not tell, e.g. for root in /proc)."""
    import tempfile
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def validate_dir(path: str, flag: str) -> list[str]:
    """Problems with ``path`` as a folder to write in, created if missing: it, or a folder above it, is a file, or
    the nearest existing folder cannot be written or a folder on the way cannot be entered. Nothing is created."""
    try:
        return _dir_problems(path, flag)
    except OSError as e:  # Path.exists raises where a folder above cannot be entered (EACCES)
        return [f"{flag} '{path}' cannot be reached ({e.strerror or e}): pick a folder you can write to"]


def _dir_problems(path: str, flag: str) -> list[str]:
    p = Path(path)
    if p.exists() and not p.is_dir():
        return [f"{flag} '{path}' is a file, not a folder"]
    existing = p.absolute()
    while not existing.exists():
        if existing.is_symlink():  # a link to nothing: making the folder there fails (File exists)
            return [f"{flag} '{path}': '{existing}' is a link to '{os.readlink(existing)}', which does not exist: "
                    f"make that folder, or pick another"]
        existing = existing.parent
    if not existing.is_dir():
        return [f"{flag} '{path}': '{existing}' is a file, not a folder"]
    if not _can_write_in(existing):
        where = "" if existing == p.absolute() else f" ('{existing}', where it would be created)"
        return [f"{flag} '{path}' cannot be written{where}: pick a folder you can write to"]
    return []


def validate_file(path: str, flag: str) -> list[str]:
    """Problems with ``path`` as a file to write (its folder created if missing): a folder in its place, or a
    folder for it that cannot be made or written. Nothing is created."""
    p = Path(path)
    try:
        if p.is_dir():
            return [f"{flag} '{path}' is a folder: give a file name"]
    except OSError as e:
        return [f"{flag} '{path}' cannot be reached ({e.strerror or e}): pick a folder you can write to"]
    return [e.replace(f"{flag} '{p.parent}'", f"{flag} '{path}': its folder '{p.parent}'", 1)
            for e in validate_dir(str(p.parent), flag)]

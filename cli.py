"""Command-line helpers with no heavy imports: a one-line-error parser and boolean switches."""
from __future__ import annotations

import argparse


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

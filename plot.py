"""Learning curves from the monitor's CSV: score against global steps and against running time, with a rolling mean.

    python plot.py logs/PongNoFrameskip-v4
    python plot.py logs/ --out runs/all.png
    python plot.py runs/a/logs runs/b/logs/PongNoFrameskip-v4_monitor.csv --out runs/compare.svg --window 20

Each argument is a ``*_monitor.csv`` file or a folder holding them, at any depth (one line per run), or a GA3C
``results.txt`` named as a file (the agents' training games: steps are the running sum of the games' lengths,
every game the file holds included, time counts from the first game, any pause between a run's resumed pieces
included), or the monitor CSVs of one run trained in pieces joined with ``+``
(``a_monitor.csv+b_monitor.csv``: one line, one time-to-score row). A piece resumed from the previous piece's
checkpoint (``--load``) goes on counting its steps and time, and the join keeps them; with ``--restarted-pieces``
every piece counted from 0 (each started from a bare ``.dat``, as ``--load --load-model-dir trained_models/``
does), and the join adds to each the steps and time of the previous pieces' last games, as the model cards do;
among them a piece whose first game comes after the previous piece's last (in steps and time) resumed that
piece's checkpoint and goes on from it, with a warning that names it (a card's ``"continued"`` CSV).
A curve is named after its run's folder. The image goes to ``--out`` (default ``runs/<env>_curves.png``); its
format follows the extension: PNG, SVG or PDF.

It also prints the time to each score: for every run, the global steps and the running time (the monitor's
``elapsed_s``, which goes on across resumes from where the checkpoint left it) at which the mean of the last ``--window`` games first reached each of
``--levels`` (default -10 0 10 15 19 20, Pong's), then the median over the runs of each. A run that did not reach a
level counts as slower than its last game (steps and time each), no more: where one that stopped early could still
move the median, the median row gives the range it lies in (``949k-1,074k``), or its least value (``≥1,660k``)
where the runs that did not reach the level could put it beyond every run that did. ``--no-figure`` prints the
table alone.
"""
from __future__ import annotations

import csv
import errno
import math
import os
import re
import sys
from pathlib import Path

from cli import validate_dir, validate_file

PROG = "plot.py"


def save_figure(fig, out: Path) -> str | None:
    """``fig`` written whole to ``.<stem>.tmp<pid><suffix>`` beside ``out``, then renamed over it, so that a failed
    write (a full disk) leaves an earlier figure as it was; returns the problem in one line, None when written."""
    tmp = out.with_name(f".{out.stem}.tmp{os.getpid()}{out.suffix}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"could not write {out}: the disk is full; free space or pass --out in another folder"
        return f"could not write {out}: {e.strerror or e}"
    return None


def find_csvs(items: list[str]) -> tuple[list[tuple[Path, ...]], list[str]]:
    """One tuple per run: a file, each ``*_monitor.csv`` under a folder, or the pieces of ``a+b+...``, in order."""
    paths, errors = [], []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*_monitor.csv") if f.is_file())
            if not found:
                errors.append(f"no *_monitor.csv in folder '{item}' or below it")
            paths += [(f,) for f in found]
        elif p.is_file():
            paths.append((p,))
        elif "+" in item and all(item.split("+")):
            pieces = [Path(part) for part in item.split("+")]
            bad = [f"'{part}' (in '{item}') "
                   + ("is a folder: join files, not folders" if part.is_dir() else
                      "is GA3C's results.txt: join monitor CSVs only" if part.name == "results.txt" else
                      "does not exist (a name with + in it cannot be joined: rename or link it)")
                   for part in pieces if not part.is_file() or part.name == "results.txt"]
            errors += bad
            if not bad:
                paths.append(tuple(pieces))
        else:
            errors.append(f"'{item}' does not exist")
    return paths, errors


class NoGamesYet(ValueError):
    """A monitor CSV with its header and no game: skipped with a warning when other curves can be drawn."""


def cut_warning(path: Path, lines: list[int]) -> str:
    """The warning for the lines of ``path`` left out as cut short by a run stopped while writing them."""
    many = len(lines) > 1
    return (f"{path} line{'s' if many else ''} {', '.join(map(str, lines))}: cut short (its run stopped while "
            f"writing {'them' if many else 'it'}); left out")


_RESULTS_PREFIX = re.compile(r"^[0-9: -]*(,[ 0-9.eE+-]*)?$")  # what the start of a results.txt line can hold
_RESULTS_UNENDED = re.compile(r"^[0-9: -]*(,[ 0-9.eE+-]*){0,2}$")  # a line without its newline: all but the end


def read_results(path: Path, warnings: list[str] | None = None) -> dict:
    """GA3C's ``results.txt`` (``YYYY-MM-DD HH:MM:SS, score, length`` per game) as a curve.

    A line cut short is left out, with a warning: the last line without its newline (a run killed or out of disk
    while writing it, or writing it now; the next run's writer drops it), or a line of fewer than three values,
    each what a line's start can hold (which writers before that one ended with a newline). Any other line that
    does not parse is an error naming it. A file without a game raises ``NoGamesYet``."""
    from datetime import datetime
    warnings = [] if warnings is None else warnings
    steps, score, times, cut = [], [], [], []
    total = 0
    with open(path, errors="replace") as f:  # a byte that is not UTF-8 makes its line fail below, by number
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not line.endswith("\n") and _RESULTS_UNENDED.match(line.strip()):  # the last line, still unended
                cut.append(n)
                continue
            try:
                when, value, length = (x.strip() for x in line.split(","))
                times.append(datetime.strptime(when, "%Y-%m-%d %H:%M:%S").timestamp())
                total += int(length)
                steps.append(total)
                score.append(float(value))
                if not math.isfinite(score[-1]):
                    raise ValueError
            except ValueError:
                if line.count(",") < 2 and _RESULTS_PREFIX.match(line.strip()):
                    cut.append(n)
                    continue
                raise ValueError(f"{path} line {n} is not a results.txt line (YYYY-MM-DD HH:MM:SS, score, "
                                 f"length): {line.strip()[:80]!r}") from None
    if cut:
        warnings.append(cut_warning(path, cut))
    if not steps:
        raise NoGamesYet(f"{path} has no games yet (its run has not finished a game)")
    return {"steps": steps, "score": score, "hours": [(t - times[0]) / 3600 for t in times]}


def read_curve(path: Path, warnings: list[str] | None = None) -> dict:
    """A monitor CSV (or GA3C's ``results.txt``) as ``{"steps", "score", "hours"}``, one entry per game.

    A row cut short (a run killed while writing it; the monitor of the resumed run starts a new line after it)
    is left out, with a warning; any other row that is not a row of numbers is an error naming its line. Where the
    global steps go back (a run resumed from a checkpoint older than its last games), the games at or after the
    resumed run's first game's global steps are left out, with a warning: their weights were lost with the resume.
    Games between the checkpoint and that point stay (the CSV does not record the checkpoint's steps), so the curve
    can hold a few games that the resumed monitor's own running mean does not. (A run's games are left out too
    when another run from 0 was appended to its file.) Games at equal global steps are kept: a Ray run's steps
    move only at its nodes' syncs.
    """
    warnings = [] if warnings is None else warnings
    if path.name == "results.txt":
        return read_results(path, warnings)
    if path.stat().st_size == 0:  # created, and the header never written (a kill or a full disk right then)
        raise NoGamesYet(f"{path} has no games yet (an empty file: its run stopped before writing the header)")
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = [(reader.line_num, r) for r in reader]
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path} is not a monitor CSV ({e})") from None
    cut = [line for line, r in rows if None in r.values()]
    if cut and rows[0][1].keys() >= {"global_steps", "score", "elapsed_s"}:
        warnings.append(cut_warning(path, cut))
        rows = [(line, r) for line, r in rows if None not in r.values()]
    if not rows:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if {"global_steps", "score", "elapsed_s"} <= set(header):
            raise NoGamesYet(f"{path} has no games yet (its run has not finished a monitor game)")
        raise ValueError(f"{path} is not a monitor CSV (no rows)")
    missing = {"global_steps", "score", "elapsed_s"} - set(rows[0][1].keys())
    if missing:
        raise ValueError(f"{path} is not a monitor CSV (missing {', '.join(sorted(missing))})")
    curve = {"steps": [], "score": [], "hours": []}
    superseded = 0
    for line, r in rows:
        try:
            if None in r:  # more values than columns
                raise ValueError
            game = int(r["global_steps"]), float(r["score"]), float(r["elapsed_s"]) / 3600
            if not (math.isfinite(game[1]) and math.isfinite(game[2])):
                raise ValueError
        except ValueError:
            raise ValueError(f"{path} line {line} is not a monitor CSV row (global_steps, score and elapsed_s "
                             f"as numbers, one value per column)") from None
        superseded += add_game(curve, *game)
    if superseded:
        warnings.append(f"{path}: {superseded} game(s) left out, after which the global steps go back (a run "
                        f"resumed from an earlier checkpoint, or another run appended to this file): the curve "
                        f"keeps the games of the last timeline")
    return curve


def add_game(curve: dict, steps: int, score: float, hours: float, supersede: bool = True,
             resumed: bool = False) -> int:
    """Append one game to ``curve``; with ``supersede``, first drop the games past its global steps (a resume from
    an earlier checkpoint lost them) and return how many. A game at the same steps as the last one stays, unless
    ``resumed`` says this game is a resumed run's first: its checkpoint came before these steps, so a game at them
    was played after the checkpoint and lost."""
    dropped = 0
    while supersede and curve["steps"] and (curve["steps"][-1] >= steps if resumed else curve["steps"][-1] > steps):
        curve["steps"].pop(), curve["score"].pop(), curve["hours"].pop()
        dropped += 1
    curve["steps"].append(steps), curve["score"].append(score), curve["hours"].append(hours)
    return dropped


def join_pieces(pieces: list[dict], restarted: bool) -> tuple[dict, int, list[int]]:
    """The curves of one run's pieces, in order, as one curve, how many games were left out, and which pieces (by
    index) were taken as continuing the piece before them where ``restarted`` said otherwise.

    Continued pieces (``restarted`` false) are laid end to end as rows appended to one CSV are: where a piece's
    global steps go back (it resumed an earlier checkpoint than the previous piece's last game), the games at or
    after its first game's steps are left out, as ``read_curve`` does within a file. Restarted pieces each counted
    from 0: each is moved on by the steps and hours of the joined curve's last game before it, and nothing is left
    out (a piece's first game may sit at 0 steps, and so on that last game). Among restarted pieces, one whose
    first game comes after the previous piece's last game in both its own steps and hours resumed that piece's
    checkpoint and goes on counting: it is moved on as that piece was (a model card's ``"continued"`` CSV).
    """
    out = {"steps": [], "score": [], "hours": []}
    left_out, continued = 0, []
    steps0, hours0 = 0, 0.0
    for k, piece in enumerate(pieces):
        goes_on = (restarted and k > 0 and piece["steps"][0] > pieces[k - 1]["steps"][-1]
                   and piece["hours"][0] > pieces[k - 1]["hours"][-1])
        if goes_on:
            continued.append(k)
        elif restarted and out["steps"]:
            steps0, hours0 = out["steps"][-1], out["hours"][-1]
        for i, (steps, score, hours) in enumerate(zip(piece["steps"], piece["score"], piece["hours"])):
            left_out += add_game(out, steps + steps0, score, hours + hours0, supersede=not restarted,
                                 resumed=i == 0)
    return out, left_out, continued


def read_run(pieces: tuple[Path, ...], warnings: list[str], restarted: bool = False) -> dict:
    """``read_curve`` of one file, or of a run's pieces joined by ``join_pieces`` (a piece with no game yet adds
    nothing, with a warning)."""
    if len(pieces) == 1:
        return read_curve(pieces[0], warnings)
    curves, read = [], []
    for path in pieces:
        try:
            curves.append(read_curve(path, warnings))
            read.append(path)
        except NoGamesYet as e:
            warnings.append(f"{e}; it adds nothing to its run")
    if not curves:
        raise NoGamesYet(f"{'+'.join(map(str, pieces))}: no piece has a game yet")
    curve, left_out, continued = join_pieces(curves, restarted)
    if continued:
        warnings.append(f"{'+'.join(map(str, pieces))}: " + ", ".join(
            f"{read[k]} goes on from {read[k - 1]} (its first game comes after that piece's last, in steps and "
            f"time: it resumed its checkpoint)" for k in continued) + "; joined as continuing it, the others as "
            "restarted")
    if left_out:
        first = curves[0]["steps"][0]
        hint = ("" if restarted or not any(c["steps"][0] <= first for c in curves[1:]) else
                "; a piece starts again at or below the first piece's first game: if the pieces each counted from "
                "0 (started from a .dat), give --restarted-pieces")
        warnings.append(f"{'+'.join(map(str, pieces))}: {left_out} game(s) left out where a piece's global steps go "
                        f"back (it resumed an earlier checkpoint than the last game before it){hint}")
    return curve


LINESTYLES = ("-", "--", ":", "-.")


def curve_styles(n: int) -> list[tuple[str, str]]:
    """(colour, line style) for each of ``n`` curves, no two the same.

    Up to 10 curves: matplotlib's ten "tab10" colours, solid. Up to 40: the colours again with a dashed, dotted,
    then dash-dotted line for each further ten. Beyond 40: ``n`` evenly spaced colours of the "viridis" map, solid.
    """
    from matplotlib import colormaps
    from matplotlib.colors import to_hex
    tab10 = [to_hex(c) for c in colormaps["tab10"].colors]
    if n <= len(tab10) * len(LINESTYLES):
        return [(tab10[i % len(tab10)], LINESTYLES[i // len(tab10)]) for i in range(n)]
    cmap = colormaps["viridis"]
    return [(to_hex(cmap(i / (n - 1))), "-") for i in range(n)]


def thin_games(curve: dict, every_steps: int) -> dict:
    """The games of ``curve`` that a sparser monitor would have played: the first game, then each first game that
    ended at least ``every_steps`` global steps after the last one kept. A monitor that starts one game every N
    steps (``--test-every-steps N``) plays games whose ends lie about N apart, so a run monitored more often,
    thinned to N, is compared with runs monitored every N steps (its kept games are real games of that run, at
    about the steps such a monitor would have played them)."""
    keep, last = [], None
    for i, steps in enumerate(curve["steps"]):
        if last is None or steps - last >= every_steps:
            keep.append(i)
            last = steps
    return {k: [v[i] for i in keep] for k, v in curve.items()}


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each game's last ``window`` games, NaN (not drawn) before the first full window: the curve and
    the time-to-score table read the same means (a mean of the first few games alone drew a trained run's first
    games as above a level the table said it reached much later)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / window if i + 1 >= window else math.nan)
    return out


DEFAULT_LEVELS = (-10.0, 0.0, 10.0, 15.0, 19.0, 20.0)


def first_reached(score: list[float], steps: list[int], seconds: list[float], levels, window: int) -> dict:
    """``{level: (global steps, seconds) or None}``: the first game after which the mean of the last ``window``
    games (a full window) is at least ``level``. Each window is summed exactly (``math.fsum``), so ten games of 0.1
    reach 0.1."""
    out = {level: None for level in levels}
    for i in range(window - 1, len(score)):
        mean = math.fsum(score[i + 1 - window: i + 1]) / window
        for level in levels:
            if out[level] is None and mean >= level:
                out[level] = (steps[i], seconds[i])
    return out


def median_of(values: list[float]) -> float:
    """The median of a non-empty list (the mean of the middle two for an even count); inf where the middle is inf."""
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def median_reached(reached: list[tuple[int, float] | None],
                   last_games: list[tuple[int, float]] | None = None) -> tuple[tuple[float, float], ...] | None:
    """The median over runs of ``(steps, seconds)``, each taken separately, as ``((steps_lo, steps_hi), (secs_lo,
    secs_hi))``: a range, because a run that did not reach the level (None) is only known to be slower than its
    last game (``last_games[i]``; without ``last_games``, slower than every run that did). The median lies between
    the median of the runs' lower ends (a run that did not reach the level at its last game) and of their upper ends
    (such a run at infinity); ``lo == hi`` where the runs that did not reach it cannot move it, ``hi`` is inf where
    they could put it beyond every run that did. None where it is unknown from below too (no run reached the level
    in the middle even at its lower end), or for no runs."""
    if not reached:
        return None
    out = []
    for k in (0, 1):
        lows = [r[k] if r is not None else (last_games[i][k] if last_games else math.inf)
                for i, r in enumerate(reached)]
        highs = [r[k] if r is not None else math.inf for r in reached]
        lo, hi = median_of(lows), median_of(highs)
        if math.isinf(lo):
            return None
        out.append((lo, hi))
    return tuple(out)


def format_reached(r) -> str:
    if r is None:
        return "-"
    steps, secs = r
    return f"{steps / 1e3:,.0f}k / {secs / 60:.0f} min"


def format_median(m) -> str:
    """A ``median_reached`` cell: ``949k / 27 min``, ``949k-1,074k / 78-86 min``, or ``≥1,660k / ≥45 min``."""
    if m is None:
        return "-"
    def one(lo, hi, text):
        if math.isinf(hi):
            return "≥" + text(lo)
        return text(lo) if text(lo) == text(hi) else f"{text(lo)}-{text(hi)}"
    (s_lo, s_hi), (t_lo, t_hi) = m
    return f"{one(s_lo, s_hi, lambda v: f'{v / 1e3:,.0f}k')} / {one(t_lo, t_hi, lambda v: f'{v / 60:.0f}')} min"


def time_to_score_table(named_curves: list[tuple[str, dict]], levels, window: int,
                        games: list[str] | None = None) -> str:
    """The table ``plot.py`` prints: one row per run and the median row (see the module docstring). ``games``:
    the env ids the runs are known to play (their monitor CSVs' names); of more than one, there is no median
    row, but a line that says why (a median over Pong and Breakout runs means nothing)."""
    rows = [(name, first_reached(c["score"], c["steps"], [h * 3600 for h in c["hours"]], levels, window))
            for name, c in named_curves]
    last_games = [(c["steps"][-1], c["hours"][-1] * 3600) for _, c in named_curves]
    width = max([len(f"median of {len(rows)}") + 2] + [len(name) for name, _ in rows])
    med = {level: median_reached([r[level] for _, r in rows], last_games) for level in levels}
    cell = max([22] + [len(format_median(m)) + 2 for m in med.values()]) if len(rows) > 1 else 22
    head = f"{'run':{width}s}" + "".join(f"{f'mean >= {level:g}':>{cell}s}" for level in levels)
    lines = [f"global steps / running time at which the mean of the last {window} games first reached each level "
             f"(the median row: the median of each, taken separately; a run that did not reach a level counts as "
             f"slower than its last game, so the median can be a range):", head]
    for name, r in rows:
        lines.append(f"{name:{width}s}" + "".join(f"{format_reached(r[level]):>{cell}s}" for level in levels))
    if len(rows) > 1 and len(set(games or [])) > 1:
        lines.append(f"no median row: the runs play {len(set(games))} games ({', '.join(sorted(set(games)))}); "
                     f"give one game's runs for their median")
    elif len(rows) > 1:
        lines.append(f"{f'median of {len(rows)}':{width}s}" + "".join(f"{format_median(med[level]):>{cell}s}"
                                                                     for level in levels))
    return "\n".join(lines)


ENV_NAME = re.compile(r"^(?:ALE_)?([A-Z][A-Za-z]*?)(?:NoFrameskip)?-v\d+$")  # main.py's <env>_monitor.csv names


def game_of(name: str) -> str | None:
    """The game of a monitor CSV named by main.py (``PongNoFrameskip-v4`` -> ``Pong``, ``ALE_Pong-v5`` -> ``Pong``);
    None for a name that is no env id (a copy renamed for results/, ``pong_seed1``): its game is not known."""
    m = ENV_NAME.match(name)
    return m[1] if m else None


def label_for(path: Path) -> tuple[str, str]:
    """(env id, run name): the run is the CSV's folder (``logs/<run>/<env>_monitor.csv``), or the folder above
    a ``logs`` folder (``runs/<run>/logs/<env>_monitor.csv``), by its real name (never ``.``)."""
    if path.name == "results.txt":  # GA3C's: the env is not in the name; the run's folder is
        folder = path.resolve().parent
        run = folder.parent.name if folder.name == "logs" else folder.name
        return run, f"{run} (training games)"
    env = path.name[: -len("_monitor.csv")] if path.name.endswith("_monitor.csv") else path.stem
    folder = path.resolve().parent
    run = folder.parent.name if folder.name == "logs" else folder.name
    return env, run or env


def default_out(paths: list[tuple[Path, ...]]) -> str:
    """Where the figure goes without ``--out``: ``runs/<env>_curves.png``, the alphabetically first env among the
    runs (named by their files)."""
    envs = sorted(label_for(path[0])[0] for path in paths)
    return str(Path("runs") / f"{envs[0].replace('/', '_')}_curves.png")


def main(argv: list[str] | None = None) -> int:
    from cli import Parser
    p = Parser(prog=PROG, description="Plot monitor learning curves.")
    p.add_argument("inputs", nargs="+",
                   help="monitor CSV files, folders that hold them, or one run's pieces joined with + "
                        "(a_monitor.csv+b_monitor.csv)")
    p.add_argument("--out", default=None,
                   help="output image: .png, .svg or .pdf (default: runs/<env>_curves.png)")
    p.add_argument("--window", type=int, default=10, help="rolling-mean window in games (default: %(default)s)")
    p.add_argument("--title", default=None, help="figure title (default: env and run names)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="draw each curve up to this many global agent steps, to compare runs over the same "
                        "budget (default: all games)")
    p.add_argument("--labels", nargs="+", default=None,
                   help="legend names, one per curve in input order (default: the run folders' names, or the "
                        "file names where those repeat)")
    p.add_argument("--levels", nargs="+", type=float, default=list(DEFAULT_LEVELS),
                   help="scores for the time-to-score table (default: -10 0 10 15 19 20)")
    p.add_argument("--restarted-pieces", action="store_true",
                   help="the pieces joined with + each counted their steps and time from 0 (each started from a "
                        "bare .dat): add each piece to the end of those before it; one whose first game comes after "
                        "the last game of the piece before it, in steps and time, resumed that piece's checkpoint and "
                        "goes on from it (default: pieces that resumed the previous piece's checkpoint and go on "
                        "counting)")
    p.add_argument("--every-steps", type=int, default=None, metavar="N",
                   help="keep only the games a monitor playing one game every N global steps would have played "
                        "(the first, then each first game ending N steps after the last kept), to compare a run "
                        "monitored more often with runs of --test-every-steps N (default: every game)")
    p.add_argument("--no-figure", dest="figure", action="store_false",
                   help="print the time-to-score table only; draw nothing")
    args = p.parse_args(argv)
    paths, errors = find_csvs(args.inputs)
    if args.labels is not None and len(args.labels) != len(paths) and not errors:  # a missing input: its own line
        errors.append(f"--labels names {len(args.labels)} curve(s) but the inputs hold {len(paths)}: give one "
                      f"label per run (a monitor CSV, or pieces joined with +)")
    if args.out is not None and Path(args.out).suffix.lower() not in (".png", ".svg", ".pdf"):
        errors.append(f"--out must end in .png, .svg or .pdf, got '{args.out}'")
    elif args.out is not None and args.figure:
        errors += validate_file(args.out, "--out")

    errors += [f"--levels must be finite numbers, got {level}" for level in args.levels if not math.isfinite(level)]
    if args.window < 1:
        errors.append(f"--window must be >= 1, got {args.window}")
    if args.max_steps is not None and args.max_steps < 1:
        errors.append(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.every_steps is not None and args.every_steps < 1:
        errors.append(f"--every-steps must be >= 1, got {args.every_steps}")
    curves, empty, warnings = [], [], []
    if args.restarted_pieces and not any(len(path) > 1 for path in paths):
        errors.append("--restarted-pieces is about pieces joined with + (a_monitor.csv+b_monitor.csv); no input "
                      "joins any")
    seen = set()
    for path in paths:
        key = tuple(part.resolve() for part in path)
        if key in seen:
            warnings.append(f"{'+'.join(map(str, path))} is given more than once: each counts as a run of its own "
                            f"in the median")
        seen.add(key)
    for path in paths:
        try:
            curve = read_run(path, warnings, args.restarted_pieces)
            if args.max_steps is not None and args.max_steps >= 1:
                keep = [i for i, s in enumerate(curve["steps"]) if s <= args.max_steps]
                if not keep:
                    raise ValueError(f"{'+'.join(map(str, path))} has no game at or before --max-steps "
                                     f"{args.max_steps}")
                curve = {k: [v[i] for i in keep] for k, v in curve.items()}
            if args.every_steps is not None and args.every_steps >= 1:
                curve = thin_games(curve, args.every_steps)
            curves.append((path, curve))
        except NoGamesYet as e:
            empty.append(str(e))
        except (ValueError, KeyError, OSError) as e:
            errors.append(str(e))
    if args.figure and args.out is None and curves:  # named after the curves drawn; checked before drawing
        args.out = default_out([path for path, _ in curves])
        if Path(args.out).is_dir():
            errors.append(f"'{args.out}', where the figure goes by default, is a folder: move it away or pass "
                          "--out PATH")
        else:
            errors += [f"{e}; or pass --out PATH" for e in validate_dir(str(Path(args.out).parent),
                                                                       "the figure's default folder")]
    if empty and not curves and not errors:
        errors += empty  # nothing to draw at all
    elif empty and args.labels is None:
        for e in empty:
            print(f"{PROG}: warning: {e}; skipped", file=sys.stderr)
    elif empty:
        errors.append(f"{empty[0]}: it has a label in --labels; leave it out of the inputs or wait for a game")
    if errors:
        for e in errors:
            print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"{PROG}: warning: {w}", file=sys.stderr)

    envs, runs, labels = set(), [], []
    names = [label_for(path[0]) for path, _ in curves]
    repeated = len({run for _, run in names}) < len(names)
    stems = [path[0].stem[: -len("_monitor")] if path[0].stem.endswith("_monitor") else path[0].stem
             for path, _ in curves]
    if repeated and len(set(stems)) < len(stems):  # folders and file names both repeat: the paths from where they part
        common = os.path.commonpath([str(path[0].resolve().parent) for path, _ in curves])
        stems = [str(path[0].resolve().with_suffix("").relative_to(common)) for path, _ in curves]
    for k, ((path, c), (env, run)) in enumerate(zip(curves, names)):
        if repeated:
            run = stems[k]
        envs.add(env)
        runs.append(run)
        pieces = f" ({len(path)} pieces)" if len(path) > 1 else ""
        labels.append(args.labels[k] if args.labels else (run if len(curves) > 1 else env) + pieces)
    games = [g for g in (game_of(env) for (path, _), (env, _) in zip(curves, names)
                         if path[0].name.endswith("_monitor.csv")) if g is not None]
    print(time_to_score_table(list(zip(labels, [c for _, c in curves])), args.levels, args.window, games),
          flush=True)
    if not args.figure:
        return 0

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_steps, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for (path, c), label, (color, style) in zip(curves, labels, curve_styles(len(curves))):
        smooth = rolling_mean(c["score"], args.window)
        for ax, x in ((ax_steps, [s / 1e6 for s in c["steps"]]), (ax_time, c["hours"])):
            # matplotlib leaves out of the legend a label that begins with "_": a zero-width space keeps it
            shown_label = ("\u200b" if label.startswith("_") else "") + f"{label} (mean of {args.window})"
            ax.plot(x, smooth, color=color, linestyle=style, label=shown_label)
            ax.scatter(x, c["score"], s=6, alpha=0.3, color=color)
    ax_steps.set_xlabel("global agent steps (millions)")
    ax_time.set_xlabel("running time (hours)")  # the monitor's, as the table's minutes (module docstring)
    ax_steps.set_ylabel("monitor game score")
    for ax in (ax_steps, ax_time):
        ax.grid(alpha=0.3)
    ax_steps.legend(loc="best", fontsize=8)
    run_names = [r for r in dict.fromkeys(runs) if r not in envs]
    shown = list(args.labels) if args.labels else run_names
    title = args.title or ", ".join(sorted(envs)) + (f": {', '.join(shown)}" if shown else "")
    fig.suptitle(title)
    try:
        fig.tight_layout()  # lays out (and so parses) every text: a bad one fails here, before any file is written
    except ValueError as e:
        print(f"{PROG}: error: the title or a label is not text that matplotlib can draw "
              f"({str(e).strip().splitlines()[0][:100]}); write a literal $ as \\$", file=sys.stderr)
        return 2
    problem = save_figure(fig, Path(args.out))
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({len(curves)} run{'s' if len(curves) != 1 else ''})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the table piped into a reader that stopped early (head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)

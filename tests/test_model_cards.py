"""Model cards: every model file in trained_models/ has a card (``<stem>.json`` beside it) and every card a model
file; each card holds the required fields, describes the very file (sha256, size), and its figures are those of the
JSONs and CSVs it cites in results/, and its chance levels (optional ``chance``) those of ``gym_eval.py
--random-actions`` JSONs on the protocols it was evaluated on. ``card_problems`` can be pointed at any folder, so
each kind of error is also made on purpose in a copy under tmp_path and must be reported. Last, gym_eval.py prints
the card's claim beside one game of the shipped model.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from checkpoint import model_path
from conftest import ROOT, run_entry

MODEL_SUFFIX = ".dat"  # what trained_models/ ships (upstream's format); .ckpt and temporary files are gitignored
CARD_FIELDS = ("model_file", "sha256", "bytes", "format", "env", "training", "machine", "evaluations", "limitations")
# what a card's "format" says of the file: "16 float16 tensors (A3Clstm, hidden size 512, 6 actions)"
FORMAT = re.compile(r"(\d+) (float16|float32) tensors \(A3Clstm, hidden size (\d+), (\d+) actions\)")
# a figure quoted from another JSON of results/: "449.30 ± 154.05 on SpaceInvadersNoFrameskip-v0 (results/x.json)"
# or "(19.27 ± 1.41 on ALE/Pong-v5, results/x.json)"
CITED = re.compile(r"(-?\d+\.\d\d) ± (\d+\.\d\d) on ([^\s,]+)(?: \(|, )(results/[^),;\s]+\.json)")
FIGURE = re.compile(r"(-?\d+\.\d\d) ± (\d+\.\d\d)")  # "mean ± std", as cards quote an evaluation
RESULTS_JSON = re.compile(r"results/[\w{},*.\-]+?\.json")  # one file, or several by {a,b} or *
# "mean ± std on ENV" in a card's limitations, the env a word that ends at a space, a comma, a semicolon or a stop
ON_ENV = re.compile(r"(-?\d+\.\d\d) ± (\d+\.\d\d) on ([\w/\-]+)")
# "trained_models/X.dat (21.00 ..." or "trained_models/X.dat (19.27)": another model's figure, one of its card's means
OTHER_MODEL = re.compile(r"trained_models/([\w.\-]+\.dat) \((-?\d+\.\d\d)")
TRAINING_FIELDS = ("pieces", "global_steps", "wall_time_s", "monitor_csvs")
PIECE_FIELDS = ("command", "commit")
MACHINE_FIELDS = ("cpu", "cores", "precision")
EVALUATION_FIELDS = ("env", "command", "episodes", "first_seed", "mean", "std", "min", "max", "median", "precision",
                     "protocol", "source")
CHANCE_FIELDS = ("env", "episodes", "first_seed", "mean", "std", "min", "max", "median", "source", "command")
# a card's evaluation field -> the key of gym_eval.py's JSON summary that it must equal
FROM_SUMMARY = {"env": "env", "episodes": "episodes", "first_seed": "seed", "mean": "mean", "std": "std",
                "min": "min", "max": "max", "median": "median", "protocol": "protocol"}


def _missing(d: dict, fields: tuple[str, ...], where: str) -> list[str]:
    return [f"{where}: no '{f}'" for f in fields if d.get(f) in (None, "", [])]


def _in_results(repo: Path, rel: str) -> bool:
    """``rel`` names a file in ``repo``'s results/ folder, where the project keeps what it measured."""
    return Path(rel).parts[:1] == ("results",) and ".." not in Path(rel).parts and (repo / rel).is_file()


def _last_row(path: Path) -> dict:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))[-1]


def _field_problems(card: dict, name: str) -> list[str]:
    """The required fields a card lacks, and an 'unknown' commit that no note explains."""
    training, machine = card.get("training") or {}, card.get("machine") or {}
    found = _missing(card, CARD_FIELDS, name) + _missing(training, TRAINING_FIELDS, f"{name} training")
    for i, piece in enumerate(training.get("pieces") or []):
        found += _missing(piece, PIECE_FIELDS, f"{name} training piece {i + 1}")
    if any(p.get("commit") == "unknown" for p in training.get("pieces") or []) and not training.get("commit_note"):
        found.append(f"{name}: a commit is 'unknown' and training has no 'commit_note' saying why")
    found += _missing(machine, MACHINE_FIELDS, f"{name} machine")
    for i, e in enumerate(card.get("evaluations") or []):
        found += _missing(e, EVALUATION_FIELDS, f"{name} evaluation {i + 1}")
    for i, c in enumerate(card.get("chance") or []):
        found += _missing(c, CHANCE_FIELDS, f"{name} chance {i + 1}")
    return found


def _training_problems(training: dict, repo: Path, name: str) -> list[str]:
    """The steps and running time against the monitor CSVs the card cites.

    By default they are the last row of the last CSV: a piece resumed from a ``.ckpt`` goes on counting. With
    ``"csv_counting": "restarted"`` every CSV counted from zero (each piece started from a bare ``.dat``), so the
    card's figures are the sums of every CSV's last row. A list, one ``"restarted"`` or ``"continued"`` per CSV,
    mixes the two: the figures are the sums of the last rows of the CSVs that no ``"continued"`` one follows. A CSV
    that goes on from the one before starts where it ended: its first row's steps and time are not below."""
    csvs = training["monitor_csvs"]
    not_there = [rel for rel in csvs if not _in_results(repo, rel)]
    if not_there:
        return [f"{name}: monitor_csvs {not_there} are not files in results/"]
    counting = training.get("csv_counting", "continued")
    kinds = [counting] * len(csvs) if isinstance(counting, str) else counting
    if not isinstance(kinds, list) or len(kinds) != len(csvs) or set(kinds) - {"continued", "restarted"}:
        return [f"{name}: csv_counting {counting!r} is neither 'continued' nor 'restarted', nor a list of one of "
                f"them per monitor CSV ({len(csvs)})"]
    found = []
    for before, rel, kind in zip(csvs, csvs[1:], kinds[1:]):
        with (repo / rel).open(newline="") as f:
            first = next(csv.DictReader(f))
        last = _last_row(repo / before)
        if kind == "continued" and (int(first["global_steps"]) < int(last["global_steps"])
                                    or float(first["elapsed_s"]) < float(last["elapsed_s"])):
            found.append(f"{name}: {rel} does not go on from {before}: its first row is at {first['global_steps']} "
                         f"steps, {first['elapsed_s']} s, that one's last at {last['global_steps']}, "
                         f"{last['elapsed_s']} s")
    counted = [rel for i, rel in enumerate(csvs) if i == len(csvs) - 1 or kinds[i + 1] != "continued"]
    rows = [_last_row(repo / rel) for rel in counted]
    steps, seconds = sum(int(r["global_steps"]) for r in rows), sum(float(r["elapsed_s"]) for r in rows)
    where = f"the last monitor row of {counted[0]} says" if len(counted) == 1 else f"the last rows of {counted} sum to"
    if training["global_steps"] != steps:
        found.append(f"{name}: global_steps {training['global_steps']}, {where} {steps}")
    if training["wall_time_s"] != round(seconds):
        found.append(f"{name}: wall_time_s {training['wall_time_s']}, {where} {seconds:.1f}")
    return found


def _flag(command: str, names: tuple[str, ...], default=None):
    """The value of the first of ``names`` in a shell ``command`` (``--env X`` or ``--env=X``), else ``default``:
    for main.py's commands, which may be chained with other shell commands."""
    words = shlex.split(command)
    for i, w in enumerate(words):
        for n in names:
            if w == n and i + 1 < len(words):
                return words[i + 1]
            if w.startswith(n + "="):
                return w[len(n) + 1:]
    return default


def _parsed_eval_command(cmd: str):
    """``cmd`` (``python gym_eval.py ...``) parsed by gym_eval.py's own parser, as it would run: the last of a
    repeated flag counts, short and attached forms included. None where the parser refuses it."""
    import contextlib
    import io

    from gym_eval import build_parser
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return build_parser().parse_args(shlex.split(cmd)[2:])
    except SystemExit:
        return None


def _command_problems(entry: dict, where: str, random_actions: bool, repo: Path | None = None,
                      card: dict | None = None) -> list[str]:
    """A ``gym_eval.py`` command of an evaluation or chance entry against the entry, as gym_eval.py's parser reads
    it: the env, the JSON it wrote (the ``source``), the seed, the games and the precision, and the protocol it
    plays (the card's ``see_skipped_frames`` where no flag says). With ``repo`` and ``card``, an evaluation's
    command, run from ``repo``, plays the card's own model file."""
    from environment import protocol
    from gym_eval import resolve_model_file
    cmd = entry["command"]
    args = _parsed_eval_command(cmd) if cmd.startswith("python gym_eval.py ") else None
    if args is None or args.random_actions != random_actions:
        return [f"{where}: command {cmd!r} is not a gym_eval.py run{' with' if random_actions else ' without'} "
                f"--random-actions"]
    said = {"env": args.env, "source": args.json, "first_seed": args.seed, "episodes": args.num_episodes}
    if not random_actions:
        said["precision"] = args.precision
    found = [f"{where}: its command says {k} {v!r}, the entry {entry[k]!r}" for k, v in said.items() if entry[k] != v]
    seen = args.see_skipped_frames
    if seen is None:
        seen = not random_actions and card is not None and card.get("see_skipped_frames") is True
    plays = json.loads(json.dumps(protocol(args.env, max_episode_length=args.max_episode_length,
                                           skip_rate=args.skip_rate, episodic_life=False, see_skipped=seen)))
    if "protocol" in entry and plays != entry["protocol"]:
        differ = sorted(k for k in set(plays) | set(entry["protocol"]) if plays.get(k) != entry["protocol"].get(k))
        found.append(f"{where}: its command plays another protocol than the entry's ({', '.join(differ)})")
    if repo is not None and card is not None and not random_actions:
        import contextlib
        from checkpoint import ModelFileError
        try:
            with contextlib.chdir(repo):
                played = Path(os.path.abspath(resolve_model_file(args)))
        except ModelFileError as e:
            played = f"none ({e})"
        if played != (repo / "trained_models" / card["model_file"]).absolute():
            found.append(f"{where}: its command, run from the repository, plays {played}, not "
                         f"trained_models/{card['model_file']}")
    return found


def _summary_problems(summary: dict, where: str) -> list[str]:
    """A gym_eval.py JSON's figures against its own ``scores`` (``gym_eval.summarize``)."""
    from gym_eval import summarize
    scores = summary.get("scores") or []
    if not scores:
        return [f"{where}: the source has no scores"]
    again = summarize(scores)
    return [f"{where}: the source's {k} {summary.get(k)!r} is not that of its scores ({again[k]!r})"
            for k in ("mean", "std", "min", "max", "median") if summary.get(k) != pytest.approx(again[k], abs=1e-9)]


def _slug(heading: str) -> str:
    """A markdown heading's anchor, as GitHub makes it: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _provenance_problems(card: dict, repo: Path, name: str) -> list[str]:
    """What ties the card to the code and the docs: each piece's ``commit`` is a commit of ``repo``'s history (where
    ``repo`` is a git checkout with its whole history), the last piece trained the card's ``env`` (its ``--env``,
    or main.py's default), ``machine.cores`` is a number, and ``history`` names a section of a file in ``repo``."""
    import subprocess
    found = []
    training = card["training"]
    if (repo / ".git").exists():
        shallow = subprocess.run(["git", "-C", str(repo), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True).stdout.strip()
        hashes = [p["commit"] for p in training["pieces"]]
        for p in training["pieces"]:  # one piece may list several starts' heads
            at_start = p.get("git_head_at_start") or []
            hashes += [at_start] if isinstance(at_start, str) else at_start
        for h in dict.fromkeys(h for h in hashes if h and h != "unknown"):
            known = subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{h}^{{commit}}"],
                                   capture_output=True).returncode == 0
            if not known and shallow == "false":
                found.append(f"{name}: commit {h} is not a commit of the repository's history")
    trained = _flag(training["pieces"][-1]["command"], ("--env", "-ev"), "PongNoFrameskip-v4")
    if trained != card["env"]:
        found.append(f"{name}: env {card['env']}, but the last piece's command trains {trained}")
    if not isinstance(card["machine"]["cores"], int) or card["machine"]["cores"] < 1:
        found.append(f"{name}: machine cores {card['machine']['cores']!r} is not a number of cores")
    history = card.get("history")
    if history:
        file, _, anchor = history.partition("#")
        text = (repo / file).read_text() if (repo / file).is_file() else None
        if text is None:
            found.append(f"{name}: history {history}: {file} is not a file of the repository")
        elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}:
            found.append(f"{name}: history {history}: no section of {file} has the anchor #{anchor}")
    return found


def _evaluation_problems(card: dict, model: Path, repo: Path, name: str) -> list[str]:
    """Each evaluation against the gym_eval.py JSON it cites; one with and one without sticky actions; the figures
    quoted in the limitations."""
    found = []
    model_rel = model.relative_to(repo).as_posix() if model.is_relative_to(repo) else str(model)
    sticky = set()
    for e in card["evaluations"]:
        where = f"{name} evaluation on {e['env']} ({e['source']})"
        if not _in_results(repo, e["source"]):
            found.append(f"{where}: the source is not a file in results/")
            continue
        summary = json.loads((repo / e["source"]).read_text())
        found += [f"{where}: {k} {e[k]!r}, the source says {summary.get(s)!r}"
                  for k, s in FROM_SUMMARY.items() if e[k] != summary.get(s)]
        if len(summary.get("scores", [])) != e["episodes"]:
            found.append(f"{where}: {len(summary.get('scores', []))} scores in the source, not {e['episodes']}")
        # gym_eval.py writes "precision" since --precision came in; every evaluation before that was fp32
        if e["precision"] != summary.get("precision", "fp32"):
            found.append(f"{where}: precision {e['precision']}, the source's is {summary.get('precision', 'fp32')}")
        if summary.get("model") != model_rel:
            found.append(f"{where}: the source evaluated {summary.get('model')}, not {model_rel}")
        if summary.get("model_sha256") != card["sha256"]:
            found.append(f"{where}: the source played a file of sha256 {summary.get('model_sha256')}, not the card's")
        found += _command_problems(e, where, random_actions=False, repo=repo, card=card)
        found += _summary_problems(summary, where)
        if e["episodes"] < 100:
            found.append(f"{where}: {e['episodes']} games, a card's evaluations have at least 100")
        sticky.add(e["protocol"].get("repeat_action_probability", 0) > 0)
    found += _observation_problems(card, name)
    for is_sticky, what in ((False, "the default protocol (no sticky actions)"), (True, "sticky actions")):
        if is_sticky not in sticky:
            found.append(f"{name}: no evaluation with {what}")
    if card["env"] not in [e["env"] for e in card["evaluations"]]:
        found.append(f"{name}: no evaluation on the env it was trained on, {card['env']}")
    quoted = set(re.findall(r"-?\d+\.\d\d ± \d+\.\d\d", card["limitations"]))
    measured = {f"{e['mean']:.2f} ± {e['std']:.2f}" for e in card["evaluations"] + (card.get("chance") or [])}
    found += [f"{name}: limitations quote {q}, which no evaluation measured" for q in sorted(quoted - measured)]
    return found + _quoted_figure_problems(card, model.parent, name)


def _quoted_figure_problems(card: dict, models_dir: Path, name: str) -> list[str]:
    """The limitations' figures tied to an env or to another model: ``mean ± std on ENV`` is the card's evaluation
    on ENV (an env it was evaluated on), and ``trained_models/X.dat (m`` one of X's card's means."""
    found = []
    by_env: dict[str, set] = {}
    for e in card["evaluations"] + (card.get("chance") or []):  # the model's, and uniformly random actions'
        by_env.setdefault(e["env"], set()).add((f"{e['mean']:.2f}", f"{e['std']:.2f}"))
    for mean, std, env in ON_ENV.findall(card["limitations"]):
        if env in by_env and (mean, std) not in by_env[env]:
            found.append(f"{name}: limitations quote {mean} ± {std} on {env}; the card's evaluation on {env} is "
                         f"{', '.join(' ± '.join(x) for x in sorted(by_env[env]))}")
    for other, mean in OTHER_MODEL.findall(card["limitations"]):
        path = (models_dir / other).with_suffix(".json")
        if not path.is_file():
            found.append(f"{name}: limitations name trained_models/{other}, which has no card")
            continue
        means = {f"{e['mean']:.2f}" for e in json.loads(path.read_text())["evaluations"]}
        if mean not in means:
            found.append(f"{name}: limitations give trained_models/{other} {mean}, none of its card's means "
                         f"({', '.join(sorted(means))})")
    return found


def _results_files(repo: Path, cited: str) -> list[Path]:
    """The files of results/ that ``cited`` names: one file, ``{a,b}`` alternatives, or a ``*`` pattern."""
    m = re.search(r"\{([^}]*)\}", cited)
    if m:
        return [f for part in m[1].split(",") for f in _results_files(repo, cited[:m.start()] + part + cited[m.end():])]
    return sorted(repo.glob(cited)) if "*" in cited else [repo / cited]


_FIGURES_BY_CONTENT: dict[bytes, tuple[str, str] | None] = {}  # a JSON's bytes' digest -> its (mean, std)


def _figures_of(files: list[Path]) -> set[tuple[str, str]]:
    """The ``(mean, std)`` of each gym_eval.py JSON among ``files``, to two decimals (each content parsed once per
    session: every test reads the same results/ in its own copy)."""
    pool = set()
    for f in files:
        data = f.read_bytes()
        key = hashlib.sha256(data).digest()
        if key not in _FIGURES_BY_CONTENT:
            try:
                s = json.loads(data)
            except ValueError:
                s = None
            from gym_eval import is_number
            ok = isinstance(s, dict) and is_number(s.get("mean")) and is_number(s.get("std"))
            _FIGURES_BY_CONTENT[key] = (f"{s['mean']:.2f}", f"{s['std']:.2f}") if ok else None
        if _FIGURES_BY_CONTENT[key] is not None:
            pool.add(_FIGURES_BY_CONTENT[key])
    return pool


def _stopped_problems(card: dict, repo: Path, name: str) -> list[str]:
    """Each training piece's ``stopped`` text: every ``mean ± std`` it quotes is that of a gym_eval.py JSON it
    cites in results/, or, where it cites none, of some JSON in results/."""
    found = []
    for i, piece in enumerate(card["training"]["pieces"], 1):
        text = piece.get("stopped", "")
        figures = FIGURE.findall(text)
        if not figures:
            continue
        cites = RESULTS_JSON.findall(text)
        cited = [f for c in cites for f in _results_files(repo, c)]
        missing = [f.relative_to(repo).as_posix() for f in cited if not f.is_file()]
        if missing or (cites and not cited):
            found.append(f"{name} training piece {i}: stopped cites {missing or cites}, not files in results/")
            continue
        pool = _figures_of(cited or sorted(repo.glob("results/*.json")))
        found += [f"{name} training piece {i}: stopped quotes {m} ± {sd}, which "
                  f"{'no JSON it cites' if cites else 'no JSON in results/'} measured"
                  for m, sd in figures if (m, sd) not in pool]
    return found



def _observation_problems(card: dict, name: str) -> list[str]:
    """Each evaluation showed what the model was trained on: the max over the frames ``--see-skipped-frames``
    gives where the card says ``see_skipped_frames``, the emulator's last frame where not (``max_over_frames``
    of its protocol, as ``environment.protocol`` names it for that id and flag)."""
    from environment import max_over_frames
    seen = card.get("see_skipped_frames", False)
    if seen not in (True, False):
        return [f"{name}: see_skipped_frames is {seen!r}, not true or false"]
    found = []
    for e in card["evaluations"]:
        skip = e["protocol"].get("frameskip")
        expected = max_over_frames(e["env"], skip_rate=skip if isinstance(skip, int) else 4, see_skipped=seen)
        if e["protocol"].get("max_over_frames") != expected:
            found.append(f"{name} evaluation on {e['env']} ({e['source']}): max_over_frames "
                         f"{e['protocol'].get('max_over_frames')}, the model "
                         f"{'sees' if seen else 'does not see'} skipped frames ({expected})")
    return found


def _format_problems(card: dict, model: Path, name: str) -> list[str]:
    """The card's ``format`` against the file: how many tensors, of which dtype, the hidden size and the actions."""
    import torch
    m = FORMAT.search(card["format"])
    if m is None:
        return [f"{name}: format does not say '<n> float16|float32 tensors (A3Clstm, hidden size <h>, <a> actions)'"]
    sd = torch.load(model, map_location="cpu", weights_only=True)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in sd.values()})
    found = (len(sd), dtypes, sd["lstm.weight_hh"].shape[1], sd["actor_linear.weight"].shape[0])
    said = (int(m[1]), [m[2]], int(m[3]), int(m[4]))
    return [] if found == said else [f"{name}: format says {said} (tensors, dtypes, hidden size, actions), the file "
                                     f"has {found}"]


def _storage_problems(card: dict, repo: Path, name: str) -> list[str]:
    """``storage_note`` (optional: how the file was stored, and what the weights scored before): each figure it
    quotes as ``mean ± std on ENV (results/X.json)`` is that JSON's, on that env."""
    note = card.get("storage_note", "")
    found = [f"{name} storage_note: it cites {rel} in no 'mean ± std on ENV (results/x.json)' or '..., "
             f"results/x.json)' the test can read" for rel in sorted(set(RESULTS_JSON.findall(note)))
             if rel not in {c[3] for c in CITED.findall(note)}]
    for mean, std, env, source in CITED.findall(note):
        if not _in_results(repo, source):
            found.append(f"{name} storage_note: {source} is not a file in results/")
            continue
        s = json.loads((repo / source).read_text())
        if (f"{s['mean']:.2f}", f"{s['std']:.2f}", s["env"]) != (mean, std, env):
            found.append(f"{name} storage_note: {mean} ± {std} on {env}, {source} says {s['mean']:.2f} ± "
                         f"{s['std']:.2f} on {s['env']}")
    return found


def _chance_problems(card: dict, repo: Path, name: str) -> list[str]:
    """Each ``chance`` entry (optional: what uniformly random actions score) against the ``gym_eval.py
    --random-actions`` JSON it cites, played under the protocol of the card's evaluation on that env, with its
    games and seeds; and that evaluation's mean above it."""
    found = []
    evaluations = {e["env"]: e for e in card["evaluations"]}
    for c in card.get("chance") or []:
        where = f"{name} chance on {c['env']} ({c['source']})"
        if not _in_results(repo, c["source"]):
            found.append(f"{where}: the source is not a file in results/")
            continue
        summary = json.loads((repo / c["source"]).read_text())
        if summary.get("policy") != "uniform random actions" or summary.get("model") is not None:
            found.append(f"{where}: the source is not a gym_eval.py --random-actions evaluation")
        found += [f"{where}: {k} {c[k]!r}, the source says {summary.get(FROM_SUMMARY[k])!r}"
                  for k in CHANCE_FIELDS[:-2] if c[k] != summary.get(FROM_SUMMARY[k])]
        if len(summary.get("scores", [])) != c["episodes"]:
            found.append(f"{where}: {len(summary.get('scores', []))} scores in the source, not {c['episodes']}")
        found += _command_problems(c, where, random_actions=True) + _summary_problems(summary, where)
        e = evaluations.get(c["env"])
        if e is None:
            found.append(f"{where}: the card has no evaluation on {c['env']}")
            continue
        if summary.get("protocol") != e["protocol"]:
            found.append(f"{where}: played under another protocol than the card's evaluation on {c['env']}")
        if (c["episodes"], c["first_seed"]) != (e["episodes"], e["first_seed"]):
            found.append(f"{where}: {c['episodes']} games from seed {c['first_seed']}, the evaluation played "
                         f"{e['episodes']} from seed {e['first_seed']}")
        if e["mean"] <= c["mean"]:
            found.append(f"{where}: the model's {e['mean']:.2f} is not above chance's {c['mean']:.2f}")
    return found


def _default_for_problems(card: dict, models_dir: Path, name: str, served: dict[str, str]) -> list[str]:
    """``default_for`` (optional): the env ids for which ``gym_eval.py`` picks this model when the folder has no
    ``<env>.dat``. Each must be evaluated in the card, named by no other card, and not shadowed by such a file."""
    found = []
    evaluated = {e["env"] for e in card["evaluations"]}
    for env_id in card.get("default_for", []):
        if env_id not in evaluated:
            found.append(f"{name}: default_for {env_id}, which the card has no evaluation on")
        if env_id in served:
            found.append(f"{name}: default_for {env_id}, which {served[env_id]} names too")
        served.setdefault(env_id, name)
        exact = model_path(models_dir, env_id)
        if exact.is_file() and exact.name != card["model_file"]:
            found.append(f"{name}: default_for {env_id}, but {exact.name} is that env's own model")
    return found


def card_problems(models_dir: Path, repo: Path) -> list[str]:
    """Every problem with the model cards in ``models_dir``, one line each; [] when there is none.

    Paths a card cites (``source``, ``monitor_csvs``) are relative to ``repo``, and an evaluation's ``model`` must
    be the model file's path relative to ``repo``: a card cannot cite another model's evaluation."""
    models = sorted(models_dir.glob(f"*{MODEL_SUFFIX}"))
    cards = sorted(models_dir.glob("*.json"))
    # a model in another format would have no card: only .dat files and their cards (a run's .ckpt and temporary
    # files are gitignored there)
    problems = [f"{f.name}: not a .dat model or its .json card (trained_models/ ships those only)"
                for f in sorted(models_dir.iterdir()) if f.is_file() and f.suffix not in (MODEL_SUFFIX, ".json", ".ckpt")
                and ".tmp" not in f.name and f.name != ".gitkeep"]
    problems += [f"{m.name}: no card ({m.stem}.json)" for m in models if not m.with_suffix(".json").is_file()]
    problems += [f"{c.name}: no model file ({c.stem}{MODEL_SUFFIX})" for c in cards
                 if not c.with_suffix(MODEL_SUFFIX).is_file()]
    served: dict[str, str] = {}  # env id -> the card that names it under default_for
    for card_path in cards:
        model, name = card_path.with_suffix(MODEL_SUFFIX), card_path.name
        try:
            card = json.loads(card_path.read_text())
        except ValueError as e:
            problems.append(f"{name}: not valid JSON ({e})")
            continue
        missing = _field_problems(card, name)
        if missing:
            problems += missing
            continue
        if card["model_file"] != model.name:
            problems.append(f"{name}: model_file is '{card['model_file']}', not {model.name}")
        if model.is_file():
            digest = hashlib.sha256(model.read_bytes()).hexdigest()
            if card["sha256"] != digest:
                problems.append(f"{name}: sha256 {card['sha256']} is not {model.name}'s ({digest})")
            if card["bytes"] != model.stat().st_size:
                problems.append(f"{name}: bytes {card['bytes']}, the file has {model.stat().st_size}")
            problems += _format_problems(card, model, name)
        problems += _training_problems(card["training"], repo, name)
        problems += _provenance_problems(card, repo, name)
        problems += _default_for_problems(card, models_dir, name, served)
        problems += _evaluation_problems(card, model, repo, name)
        problems += _chance_problems(card, repo, name)
        problems += _storage_problems(card, repo, name)
        problems += _stopped_problems(card, repo, name)
    return problems


def test_every_shipped_model_has_a_card_that_matches_what_it_cites():
    assert list((ROOT / "trained_models").glob(f"*{MODEL_SUFFIX}")), "no model file in trained_models/"
    assert card_problems(ROOT / "trained_models", ROOT) == []


# a README results row of a shipped model: "| Pong, shipped: `trained_models/PongNoFrameskip-v4.dat` | ... |"
README_ROW = re.compile(r"^\| [^|]*, shipped: `trained_models/([^`]+)` \|.*$", re.M)
README_STEPS = re.compile(r"\| (\d+\.\d\d)M \((\d+) min\) \|")
README_SCORE = re.compile(r"(-?\d+\.\d\d) ± (\d+\.\d\d)")
README_CHANCE = re.compile(r"random actions: (-?\d+\.\d\d)")


def readme_problems(readme: str, models_dir: Path) -> list[str]:
    """Where the README's results table disagrees with the cards, one line each; [] when it agrees.

    Every shipped model has one row; its steps and wall time are the card's (global_steps in millions to two
    decimals, wall_time_s in whole minutes), every "mean ± std" in it is one of the card's evaluations, the
    evaluation on the card's own env among them, and every "random actions: x" one of its chance means."""
    rows = {m.group(1): m.group(0) for m in README_ROW.finditer(readme)}
    problems = [f"README: no results row for {m.name}" for m in sorted(models_dir.glob(f"*{MODEL_SUFFIX}"))
                if m.name not in rows]
    for file, row in rows.items():
        card_path = (models_dir / file).with_suffix(".json")
        if not card_path.is_file():
            problems.append(f"README: a row for {file}, which has no card in {models_dir.name}/")
            continue
        card = json.loads(card_path.read_text())
        steps = README_STEPS.search(row)
        want = (f"{card['training']['global_steps'] / 1e6:.2f}", str(round(card["training"]["wall_time_s"] / 60)))
        if steps is None or steps.groups() != want:
            problems.append(f"README row {file}: steps (wall time) {steps and steps.group(0)!r}, the card's are "
                            f"{want[0]}M ({want[1]} min)")
        evals = {(f"{e['mean']:.2f}", f"{e['std']:.2f}"): e["env"] for e in card["evaluations"]}
        quoted = README_SCORE.findall(row)
        problems += [f"README row {file}: {m} ± {sd} is none of the card's evaluations" for m, sd in quoted
                     if (m, sd) not in evals]
        if card["env"] not in [evals.get(q) for q in quoted]:
            problems.append(f"README row {file}: no figure of the card's evaluation on {card['env']}")
        chance = {f"{c['mean']:.2f}" for c in card.get("chance") or []}
        problems += [f"README row {file}: random actions {c} is none of the card's chance means"
                     for c in README_CHANCE.findall(row) if c not in chance]
    return problems


def test_the_readmes_results_rows_quote_the_cards():
    assert readme_problems((ROOT / "README.md").read_text(), ROOT / "trained_models") == []


def test_a_readme_row_that_disagrees_with_its_card_is_reported(tmp_path):
    readme = (ROOT / "README.md").read_text()
    row = next(m.group(0) for m in README_ROW.finditer(readme) if "PongNoFrameskip-v4.dat" in m.group(0))
    card = json.loads((ROOT / "trained_models/PongNoFrameskip-v4.json").read_text())
    mean = f"{card['evaluations'][0]['mean']:.2f}"
    steps = README_STEPS.search(row).group(0)
    bad = {"a score": row.replace(f"{mean} ± ", "20.99 ± "), "the steps": row.replace(steps, "| 5.43M (302 min) |"),
           "no row": ""}
    for what, changed in bad.items():
        found = readme_problems(readme.replace(row, changed), ROOT / "trained_models")
        assert len(found) == (2 if what == "a score" else 1), (what, found)
    assert readme_problems(readme.replace(row, row.replace(f"{mean} ± ", "20.99 ± ")), ROOT / "trained_models")[0] \
        == "README row PongNoFrameskip-v4.dat: 20.99 ± 0.00 is none of the card's evaluations"


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    """trained_models/ (cards copied, model files linked), every JSON of results/ (a piece's stop may quote any)
    and every other file the cards cite, under tmp_path."""
    (tmp_path / "trained_models").mkdir()
    (tmp_path / "results").mkdir()
    for f in (ROOT / "results").glob("*.json"):
        shutil.copy(f, tmp_path / "results" / f.name)
    for f in (ROOT / "trained_models").iterdir():
        if f.suffix == ".json":
            shutil.copy(f, tmp_path / "trained_models" / f.name)
            card = json.loads(f.read_text())
            cited = card["evaluations"] + (card.get("chance") or [])
            stored = [source for *_, source in CITED.findall(card.get("storage_note", ""))]
            history = [card["history"].partition("#")[0]] if card.get("history") else []
            for rel in [e["source"] for e in cited] + card["training"]["monitor_csvs"] + stored + history:
                (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / rel, tmp_path / rel)
        elif f.suffix == MODEL_SUFFIX:
            (tmp_path / "trained_models" / f.name).symlink_to(f)
    return tmp_path


def _edit_card(repo: Path, edit) -> None:
    path = repo / "trained_models" / "PongNoFrameskip-v4.json"
    card = json.loads(path.read_text())
    edit(card)
    path.write_text(json.dumps(card, indent=2))


def _sticky(card: dict) -> dict:
    return next(e for e in card["evaluations"] if e["protocol"]["repeat_action_probability"] > 0)


def _default(card: dict) -> dict:
    return next(e for e in card["evaluations"] if e["protocol"]["repeat_action_probability"] == 0)


def _drop(d: dict, key: str) -> None:
    del d[key]


BREAKAGES = {
    "a mean": (lambda c: _default(c).update(mean=_default(c)["mean"] - 0.01), "mean 20.99"),
    "a std": (lambda c: _sticky(c).update(std=round(_sticky(c)["std"], 2)), "std 11.12"),
    "a min": (lambda c: _sticky(c).update(min=_sticky(c)["min"] + 1), "min -20.0"),
    "a max": (lambda c: _sticky(c).update(max=_sticky(c)["max"] + 1), "max 20.0"),
    "the games": (lambda c: _default(c).update(episodes=_default(c)["episodes"] - 1), "episodes 99"),
    "the seed": (lambda c: _default(c).update(first_seed=_default(c)["first_seed"] + 1), "first_seed 2"),
    "the env": (lambda c: _sticky(c).update(env="PongNoFrameskip-v4"), "env 'PongNoFrameskip-v4', the source says "
                                                                        "'PongNoFrameskip-v0'"),
    "a missing source": (lambda c: _default(c).update(source="results/not_there.json"),
                         "the source is not a file in results/"),
    "a source outside results/ by ..": (
        lambda c: _default(c).update(source="results/../trained_models/PongNoFrameskip-v4.json"),
        "the source is not a file in results/"),
    "the precision": (lambda c: _default(c).update(precision="bf16"), "precision bf16"),
    "a missing sticky evaluation": (lambda c: c["evaluations"].remove(_sticky(c)), "no evaluation with sticky"),
    "a missing field": (lambda c: _drop(c["machine"], "precision"), "machine: no 'precision'"),
    "a missing command": (lambda c: _drop(c["training"]["pieces"][1], "command"), "piece 2: no 'command'"),
    "an unexplained unknown commit": (lambda c: _drop(c["training"], "commit_note"), "no 'commit_note'"),
    "the steps": (lambda c: c["training"].update(global_steps=c["training"]["global_steps"] + 1), "global_steps"),
    "the wall time": (lambda c: c["training"].update(wall_time_s=c["training"]["wall_time_s"] + 60), "wall_time_s"),
    "the sha256": (lambda c: c.update(sha256="0" * 64), "sha256 0000"),
    "an unknown CSV counting": (lambda c: c["training"].update(csv_counting="both"), "csv_counting 'both'"),
    "a CSV counting per CSV of another length": (lambda c: c["training"].update(csv_counting=["restarted"]),
                                                 "csv_counting ['restarted'] is neither"),
    "a CSV counted once too often": (lambda c: c["training"].update(csv_counting=["restarted", "restarted"]),
                                     "sum to"),
    "a CSV that does not go on from the one before": (lambda c: c["training"]["monitor_csvs"].reverse(),
                                                      "results/pong_cpu_monitor.csv does not go on from"),
    "a CSV counted twice": (lambda c: c["training"].update(csv_counting="restarted"), "sum to"),
    "a missing monitor CSV": (lambda c: c["training"]["monitor_csvs"].append("logs/x_monitor.csv"),
                              "are not files in results/"),
    "a quoted figure": (lambda c: c.update(limitations=c["limitations"] + " Sticky: 1.67 ± 11.06."),
                        "limitations quote 1.67 ± 11.06"),
    "the format's dtype": (lambda c: c.update(format=c["format"].replace("float16", "float32")),
                           "format says (16, ['float32'], 512, 6)"),
    "the format's actions": (lambda c: c.update(format=c["format"].replace("6 actions", "4 actions")),
                             "format says (16, ['float16'], 512, 4)"),
    "a format in other words": (lambda c: c.update(format="a model"), "format does not say"),
    "the trained env": (lambda c: c.update(env="PongNoFrameskip-v0"),
                        "env PongNoFrameskip-v0, but the last piece's command trains PongNoFrameskip-v4"),
    "an evaluation command's seed": (lambda c: _default(c).update(command=_default(c)["command"] + " --seed 7"),
                                     "its command says first_seed 7"),
    "an evaluation command's JSON": (lambda c: _sticky(c).update(command=_sticky(c)["command"].replace(
        _sticky(c)["source"], "results/other.json")), "its command says source 'results/other.json'"),
    "an evaluation command's games": (lambda c: _default(c).update(command=_default(c)["command"] + " -ne 30"),
                                      "its command says episodes 30"),
    "a chance command that plays the model": (lambda c: c["chance"][0].update(
        command=c["chance"][0]["command"].replace(" --random-actions", "")), "is not a gym_eval.py run with "
                                                                             "--random-actions"),
    "a chance entry without its command": (lambda c: _drop(c["chance"][0], "command"), "chance 1: no 'command'"),
    "the cores in words": (lambda c: c["machine"].update(cores="many"), "machine cores 'many' is not a number"),
    "a history link to no section": (lambda c: c.update(history="docs/results.md#nowhere"),
                                     "no section of docs/results.md has the anchor #nowhere"),
    "a history link to no file": (lambda c: c.update(history="docs/nowhere.md#x"),
                                  "docs/nowhere.md is not a file of the repository"),
    "a figure the storage note cites": (
        lambda c: c.update(storage_note="Before: 20.00 ± 0.00 on PongNoFrameskip-v4 "
                                        "(results/pong_eval_default.json)."),
        "storage_note: 20.00 ± 0.00 on PongNoFrameskip-v4, results/pong_eval_default.json says 21.00 ± 0.00"),
    # the checks below came with a review that found each of these passing
    "an evaluation command that plays another model": (
        lambda c: _default(c).update(command=_default(c)["command"] + " --model-file ALE_Pong-v5"),
        "its command, run from the repository, plays "),
    "an evaluation command with another time limit": (
        lambda c: _default(c).update(command=_default(c)["command"] + " --max-episode-length 27000"),
        "its command plays another protocol than the entry's (time_limit_agent_steps)"),
    "a flag given twice, the last counting": (
        lambda c: _default(c).update(command=_default(c)["command"] + " --seed 1 --seed 7"),
        "its command says first_seed 7"),
    "a flag gym_eval.py's parser refuses": (lambda c: _default(c).update(command=_default(c)["command"] + " -ne30"),
                                            "is not a gym_eval.py run without --random-actions"),
    "a figure put on another env": (
        lambda c: c.update(limitations=c["limitations"].replace("on PongNoFrameskip-v0", "on PongNoFrameskip-v4")),
        "limitations quote 1.40 ± 11.12 on PongNoFrameskip-v4; the card's evaluation on PongNoFrameskip-v4 is"),
    "another model's figure": (
        lambda c: c.update(limitations=c["limitations"]
                           + " For sticky actions trained_models/ALE_Pong-v5.dat (18.45)."),
        "limitations give trained_models/ALE_Pong-v5.dat 18.45, none of its card's means"),
    "a figure in a piece's stop": (
        lambda c: c["training"]["pieces"][0].update(stopped=c["training"]["pieces"][0]["stopped"] + " (20.50 ± 0.50 "
                                                    "over 100 games: results/pong_eval_default.json)"),
        "training piece 1: stopped quotes 20.50 ± 0.50, which no JSON it cites measured"),
    "a storage note figure in the comma form": (
        lambda c: c.update(storage_note="Before: 21.00 ± 0.00 on PongNoFrameskip-v4, results/pong_eval_sticky.json."),
        "storage_note: 21.00 ± 0.00 on PongNoFrameskip-v4, results/pong_eval_sticky.json says 1.76 ± 11.06"),
    "a storage note citation in no form the test reads": (
        lambda c: c.update(storage_note="Before: 20.00 (results/pong_eval_default.json)."),
        "storage_note: it cites results/pong_eval_default.json in no"),
}


@pytest.mark.parametrize("what", list(BREAKAGES))
def test_a_card_that_disagrees_with_its_sources_is_reported(repo_copy, what):
    assert card_problems(repo_copy / "trained_models", repo_copy) == []  # the copy itself is clean
    edit, expected = BREAKAGES[what]
    _edit_card(repo_copy, edit)
    problems = card_problems(repo_copy / "trained_models", repo_copy)
    assert any(expected in p for p in problems), problems


def test_a_source_without_its_sha256_or_with_figures_not_of_its_scores_and_a_stray_file_are_reported(repo_copy):
    src = repo_copy / "results" / "pong_half_eval_default.json"
    summary = json.loads(src.read_text())
    summary.pop("model_sha256")
    src.write_text(json.dumps(summary))
    problems = card_problems(repo_copy / "trained_models", repo_copy)
    assert any("the source played a file of sha256 None, not the card's" in p for p in problems), problems
    summary["model_sha256"] = hashlib.sha256((ROOT / "trained_models" / "PongNoFrameskip-v4.dat").read_bytes()).hexdigest()
    summary["scores"][0] -= 1  # the mean, std and min now say other scores than the list
    src.write_text(json.dumps(summary))
    problems = card_problems(repo_copy / "trained_models", repo_copy)
    assert any("the source's mean 21.0 is not that of its scores (20.99)" in p for p in problems), problems
    assert not any("sha256" in p for p in problems), problems
    (repo_copy / "trained_models" / "Breakout-v0.pt").write_bytes(b"a model in another format")
    assert "Breakout-v0.pt: not a .dat model or its .json card (trained_models/ ships those only)" in \
        card_problems(repo_copy / "trained_models", repo_copy)


def test_a_commit_that_is_not_in_the_history_is_reported():
    card = json.loads((ROOT / "trained_models" / "MsPacmanNoFrameskip-v4.json").read_text())
    assert _provenance_problems(card, ROOT, "M.json") == []
    card["training"]["pieces"][0]["commit"] = "deadbee"
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                             text=True).stdout.strip()
    if shallow != "false":
        pytest.skip("a shallow or absent git history: commits cannot be looked up")
    assert _provenance_problems(card, ROOT, "M.json") == ["M.json: commit deadbee is not a commit of the repository's "
                                                          "history"]


def test_a_changed_source_and_another_models_evaluation_are_reported(repo_copy):
    src = repo_copy / "results" / "pong_half_eval_default.json"
    summary = json.loads(src.read_text())
    changed = dict(summary, mean=summary["mean"] - 0.5)
    src.write_text(json.dumps(changed))
    assert any("mean 21.0, the source says 20.5" in p for p in card_problems(repo_copy / "trained_models", repo_copy))
    src.write_text(json.dumps(dict(summary, model="runs/pong-fixed/models/PongNoFrameskip-v4.dat")))
    assert any("the source evaluated runs/pong-fixed" in p
               for p in card_problems(repo_copy / "trained_models", repo_copy))
    src.write_text(json.dumps(dict(summary, model_sha256="0" * 64)))  # the same path, another file played
    assert any("the source played a file of sha256 0000" in p
               for p in card_problems(repo_copy / "trained_models", repo_copy))


def test_chance_levels_are_checked_against_random_action_evaluations(repo_copy):
    """A card's ``chance`` must cite a --random-actions JSON of results/ with its figures, played under the
    protocol, games and seeds of the card's evaluation on that env, below the model's mean; its figures may then
    be quoted in the limitations."""
    models = repo_copy / "trained_models"
    default = json.loads((repo_copy / "results" / "pong_eval_default.json").read_text())
    source = repo_copy / "results" / "pong_random.json"

    def random_run(scores, **changes) -> dict:
        """Writes a --random-actions JSON of these scores; returns the card's entry for it."""
        run = dict(default, model=None, policy="uniform random actions", episodes=len(scores), scores=scores,
                   card=None, **summarize(scores))
        run.update(changes)
        source.write_text(json.dumps(run))
        return {"env": run["env"], "episodes": run["episodes"], "first_seed": run["seed"],
                **{k: run[k] for k in ("mean", "std", "min", "max", "median")}, "source": "results/pong_random.json",
                "command": f"python gym_eval.py --env {run['env']} --random-actions --seed {run['seed']} --json "
                           f"results/pong_random.json"}

    from gym_eval import summarize

    chance = [-21.0] * 60 + [-20.0] * 40
    entry = random_run(chance)
    assert (entry["mean"], round(entry["std"], 2)) == (-20.6, 0.49)
    _edit_card(repo_copy, lambda c: c.update(chance=[entry], limitations=c["limitations"] + " Chance: -20.60 ± 0.49."))
    assert card_problems(models, repo_copy) == []
    cases = [(dict(entry, mean=-20.0), "chance on PongNoFrameskip-v4 (results/pong_random.json): mean -20.0, "
                                       "the source says -20.6"),
             (dict(entry, max=-19.0), "max -19.0, the source says -20.0"),
             (dict(entry, env="PongNoFrameskip-v0"), "env 'PongNoFrameskip-v0', the source says"),
             (dict(entry, source="logs/pong_random.json"), "the source is not a file in results/"),
             ({k: v for k, v in entry.items() if k != "std"}, "chance 1: no 'std'"),
             (dict(entry, source="results/pong_eval_default.json", first_seed=default["seed"],
                   **{k: default[k] for k in ("episodes", "mean", "std", "min", "max", "median")}),
              "is not a gym_eval.py --random-actions evaluation")]
    for broken, expected in cases:
        _edit_card(repo_copy, lambda c: c.update(chance=[broken]))
        problems = card_problems(models, repo_copy)
        assert any(expected in p for p in problems), (expected, problems)
    other_protocol = dict(default["protocol"], time_limit_agent_steps=300)
    written = [(lambda: random_run(chance, protocol=other_protocol), "played under another protocol"),
               (lambda: random_run(chance, seed=2), "100 games from seed 2, the evaluation played 100 from seed 1"),
               (lambda: random_run(chance[:99]), "99 games from seed 1, the evaluation played 100 from seed 1"),
               (lambda: random_run([21.0] * 100), "the model's 21.00 is not above chance's 21.00"),
               (lambda: dict(random_run(chance[:99]), episodes=100, mean=-20.6, std=entry["std"]),
                "99 scores in the source, not 100")]
    for write, expected in written:
        broken = write()
        _edit_card(repo_copy, lambda c: c.update(chance=[broken]))
        problems = card_problems(models, repo_copy)
        assert any(expected in p for p in problems), (expected, problems)
    _edit_card(repo_copy, lambda c: c.update(chance=None))
    assert card_problems(models, repo_copy) == [  # a null chance is no chance: nothing measured -20.60 ± 0.49 then
        "PongNoFrameskip-v4.json: limitations quote -20.60 ± 0.49, which no evaluation measured"]


def test_a_model_without_a_card_and_a_card_without_a_model_are_reported(repo_copy):
    models = repo_copy / "trained_models"
    card = models / "PongNoFrameskip-v4.json"
    card.rename(models / "NotShippedNoFrameskip-v4.json")
    problems = card_problems(models, repo_copy)
    assert "PongNoFrameskip-v4.dat: no card (PongNoFrameskip-v4.json)" in problems
    assert "NotShippedNoFrameskip-v4.json: no model file (NotShippedNoFrameskip-v4.dat)" in problems


def test_default_for_problems_are_reported(repo_copy):
    models = repo_copy / "trained_models"
    _edit_card(repo_copy, lambda c: c.update(default_for=["PongNoFrameskip-v0"]))  # evaluated there, but ...
    assert ("PongNoFrameskip-v4.json: default_for PongNoFrameskip-v0, which Pong-v0.json names too"
            in card_problems(models, repo_copy))  # ... the shipped Pong-v0.json names it
    shipped = json.loads((models / "Pong-v0.json").read_text())
    (models / "Pong-v0.json").write_text(json.dumps({k: v for k, v in shipped.items() if k != "default_for"}))
    assert card_problems(models, repo_copy) == []
    assert card_problems(models, repo_copy) == []
    _edit_card(repo_copy, lambda c: c.update(default_for=["ALE/Pong-v5"]))
    assert ("PongNoFrameskip-v4.json: default_for ALE/Pong-v5, which the card has no evaluation on"
            in card_problems(models, repo_copy))
    _edit_card(repo_copy, lambda c: c.update(default_for=["PongNoFrameskip-v0"]))
    (models / "PongNoFrameskip-v0.dat").symlink_to(ROOT / "trained_models" / "PongNoFrameskip-v4.dat")
    assert ("PongNoFrameskip-v4.json: default_for PongNoFrameskip-v0, but PongNoFrameskip-v0.dat is that env's own "
            "model" in card_problems(models, repo_copy))
    (models / "PongNoFrameskip-v0.dat").unlink()
    other = json.loads((models / "PongNoFrameskip-v4.json").read_text())
    (models / "Pong-v4.json").write_text(json.dumps(dict(other, model_file="Pong-v4.dat")))
    (models / "Pong-v4.dat").symlink_to(ROOT / "trained_models" / "PongNoFrameskip-v4.dat")
    assert ("PongNoFrameskip-v4.json: default_for PongNoFrameskip-v0, which Pong-v4.json names too"
            in card_problems(models, repo_copy))  # cards are read in name order


def test_gym_eval_finds_a_model_by_its_own_name_or_by_a_cards_default_for(tmp_path):
    from gym_eval import default_model_file

    models = tmp_path / "trained_models"
    models.mkdir()
    (models / "Pong-v0.dat").write_bytes(b"model")
    card = {"model_file": "Pong-v0.dat", "default_for": ["ALE/Pong-v5"]}
    assert default_model_file(models, "ALE/Pong-v5") == models / "ALE_Pong-v5.dat"  # no card yet: the own name
    (models / "Pong-v0.json").write_text(json.dumps(card))
    (models / "notes.json").write_text("not JSON")  # skipped
    assert default_model_file(models, "ALE/Pong-v5") == models / "Pong-v0.dat"
    assert default_model_file(models, "Pong-v0") == models / "Pong-v0.dat"
    assert default_model_file(models, "BreakoutNoFrameskip-v4") == models / "BreakoutNoFrameskip-v4.dat"
    (models / "ALE_Pong-v5.dat").write_bytes(b"its own")  # an env's own file comes first
    assert default_model_file(models, "ALE/Pong-v5") == models / "ALE_Pong-v5.dat"
    (models / "ALE_Pong-v5.dat").unlink()
    (models / "Pong-v0.dat").unlink()  # a card whose model is gone names nothing
    assert default_model_file(models, "ALE/Pong-v5") == models / "ALE_Pong-v5.dat"


def test_card_claim_and_line_in_every_case(repo_copy, tmp_path):
    """gym_eval.py's helpers on the shipped card: the claim for each env, no card, a replaced model file."""
    from environment import protocol
    from gym_eval import card_claim, card_line, file_sha256

    card = json.loads((ROOT / "trained_models" / "PongNoFrameskip-v4.json").read_text())
    model = repo_copy / "trained_models" / "PongNoFrameskip-v4.dat"
    run = {"mean": 20.5, "std": 0.5}

    def line(env, **proto_args):
        proto = protocol(env, **{"max_episode_length": 10000, "skip_rate": 4, "episodic_life": False, **proto_args})
        return card_line(card_claim(model, env, file_sha256(model)), env, 2, run, proto, "fp32")

    for e in card["evaluations"]:
        assert line(e["env"]) == (f"card: {e['env']} {e['episodes']} games {e['mean']:.2f} ± {e['std']:.2f} "
                                  f"({e['source']}); this run: 2 games 20.50 ± 0.50")
    assert line("Pong-v4") == f"card: no evaluation on Pong-v4 (trained on {card['env']})"
    assert line(card["env"], max_episode_length=60).endswith(
        "; not the card's protocol: time_limit_agent_steps 60 (card: 10000)")

    alone = tmp_path / "elsewhere" / "PongNoFrameskip-v4.dat"
    alone.parent.mkdir()
    alone.symlink_to(ROOT / "trained_models" / "PongNoFrameskip-v4.dat")
    assert card_claim(alone, card["env"], file_sha256(alone)) is None  # no card: nothing is printed
    (alone.parent / "PongNoFrameskip-v4.json").write_text(json.dumps({"env": "an eval summary, not a card"}))
    assert card_claim(alone, card["env"], file_sha256(alone)) is None

    replaced = tmp_path / "replaced"
    replaced.mkdir()
    shutil.copy(repo_copy / "trained_models" / "PongNoFrameskip-v4.json", replaced)
    (replaced / "PongNoFrameskip-v4.dat").write_bytes(b"a model trained over the shipped one")
    claim = card_claim(replaced / "PongNoFrameskip-v4.dat", card["env"], file_sha256(replaced / "PongNoFrameskip-v4.dat"))
    assert card_line(claim, card["env"], 2, run, {}, "fp32").endswith("describes another file (its sha256 differs): "
                                                                      "not compared")
    shipped_sha = file_sha256(model)  # the card's sha256 is compared with the file played, not read again later
    assert card_claim(replaced / "PongNoFrameskip-v4.dat", card["env"], shipped_sha)["same_file"]
    assert not card_claim(model, card["env"], None)["same_file"]


@pytest.mark.parametrize("env", ["Pong-v0", "ALE/Pong-v5", "PongNoFrameskip-v0"])
def test_a_cards_protocol_read_back_from_json_is_the_same_protocol(env):
    """A card holds its evaluation's protocol as JSON, where ``Pong-v0``'s frame-skip range is a list: the same
    protocol is not reported as a different one, and a different one still is."""
    from environment import protocol
    from gym_eval import card_line
    proto = protocol(env, max_episode_length=10000, skip_rate=4, episodic_life=False)
    evaluation = {"env": env, "episodes": 100, "mean": 20.0, "std": 1.0, "source": "results/x.json",
                  "precision": "fp32", "protocol": json.loads(json.dumps(proto))}
    claim = {"path": "m.json", "trained_on": env, "evaluation": evaluation, "same_file": True}
    run = {"mean": 20.5, "std": 0.5}
    assert card_line(claim, env, 2, run, proto, "fp32") == (
        f"card: {env} 100 games 20.00 ± 1.00 (results/x.json); this run: 2 games 20.50 ± 0.50")
    other = protocol(env, max_episode_length=500, skip_rate=4, episodic_life=False)
    assert card_line(claim, env, 2, run, other, "fp32").endswith(
        "; not the card's protocol: time_limit_agent_steps 500 (card: 10000)")
    # the games played: the card's are seeds 1-100; another first seed or count is said (before, compared silently)
    evaluation["first_seed"] = 1
    assert card_line(claim, env, 100, run, proto, "fp32", first_seed=1).endswith("this run: 100 games 20.50 ± 0.50")
    assert card_line(claim, env, 2, run, proto, "fp32", first_seed=7).endswith(
        "this run: 2 games 20.50 ± 0.50; not the card's games: seeds 7-8 (card: 1-100)")


def test_gym_eval_prints_the_cards_claim_beside_one_game_of_the_shipped_model(shipped_pong_game):
    shipped = ROOT / "trained_models" / "PongNoFrameskip-v4.dat"
    card = json.loads(shipped.with_suffix(".json").read_text())
    assert card["env"] == "PongNoFrameskip-v4"  # the game the fixture played
    e = next(e for e in card["evaluations"] if e["env"] == card["env"])
    r, summary = shipped_pong_game
    expected = (f"card: {e['env']} {e['episodes']} games {e['mean']:.2f} ± {e['std']:.2f} ({e['source']}); "
                f"this run: 1 games {summary['mean']:.2f} ± 0.00; not the card's games: seeds 1-1 (card: "
                f"{e['first_seed']}-{e['first_seed'] + e['episodes'] - 1})")
    lines = r.stdout.splitlines()
    summary_at = next(i for i, x in enumerate(lines) if x.startswith(f"{card['env']}: 1 games, mean"))
    assert lines[summary_at + 1] == expected, r.stdout[-2000:]
    assert summary["card"] == {"path": str(shipped.with_suffix(".json")), "trained_on": card["env"], "evaluation": e,
                               "same_file": True, "see_skipped_frames": False, "line": expected}
    assert f"gym_eval.py: model {shipped}" in lines  # which file played, on the screen
    assert "protocol: frameskip 4, max over the step's last 3 frames, sticky actions 0," in lines[summary_at]


def test_two_cards_that_list_one_env_are_refused_and_a_missing_model_says_where_it_was_looked_for(tmp_path):
    """Which model plays is never decided by file names: two cards listing the env under default_for are one
    line and exit 2 (but for --random-actions, which plays no model); a model that is not there names the places looked at, and a card whose file is missing."""
    from checkpoint import ModelFileError
    from gym_eval import default_model_file
    models = tmp_path / "models"
    models.mkdir()
    for stem in ("A", "B"):
        (models / f"{stem}.dat").write_bytes(b"model")
        (models / f"{stem}.json").write_text(json.dumps({"model_file": f"{stem}.dat", "default_for": ["Pong-v0"]}))
    with pytest.raises(ModelFileError, match="A.json and .*B.json all list Pong-v0 under default_for: pass "
                                             "--model-file with the one to play"):
        default_model_file(models, "Pong-v0")
    r = run_entry("gym_eval.py", "--env", "Pong-v0", "--load-model-dir", str(models), "--log-dir", str(tmp_path / "l"),
                  cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "all list Pong-v0 under default_for" in r.stderr
    shutil.copytree(models, tmp_path / "elsewhere" / "trained_models")  # the default folder of a run from there
    r = run_entry("gym_eval.py", "--env", "Pong-v0", "--log-dir", str(tmp_path / "l"), "--random-actions",
                  "--num-episodes", "1", "--max-episode-length", "20", cwd=tmp_path / "elsewhere", timeout=120)
    assert r.returncode == 0, r.stderr  # random actions need no model, so two cards claiming the env do not matter
    (models / "A.dat").unlink()
    (models / "B.dat").unlink()
    r = run_entry("gym_eval.py", "--env", "Pong-v0", "--load-model-dir", str(models), "--log-dir", str(tmp_path / "l"),
                  cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.rstrip().endswith(f"; {models / 'A.json'}, {models / 'B.json'} list Pong-v0 under default_for "
                                      f"but their model file is not there)"), r.stderr
    r = run_entry("gym_eval.py", "--env", "Pong-v0", "--model-file", "Pong-v9", "--load-model-dir", str(models),
                  "--log-dir", str(tmp_path / "l"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"(looked for Pong-v9, {models / 'Pong-v9'}, {models / 'Pong-v9.dat'}; pass a path or a name" in r.stderr


def test_a_card_that_is_not_json_another_files_card_and_the_evaluation_that_matches(tmp_path):
    """A ``<stem>.json`` that is not a JSON object is named, not skipped; a card of another file says that its
    see_skipped_frames is not applied where the games show the emulator's last frame; of two evaluations on one
    env, the one whose protocol and precision are the run's is quoted."""
    from environment import protocol
    from gym_eval import card_claim, card_line
    model = tmp_path / "Pong-v0.dat"
    model.write_bytes(b"model")
    run = {"mean": 10.0, "std": 1.0}
    plain = protocol("Pong-v0", max_episode_length=10000, skip_rate=4, episodic_life=False)
    seeing = protocol("Pong-v0", max_episode_length=10000, skip_rate=4, episodic_life=False, see_skipped=True)
    assert plain["max_over_frames"] == 1 and seeing["max_over_frames"] == 3
    for text, why in (('{"model_file": "Pong-v0.dat",, broken', "is not JSON (Expecting"), ("[1, 2]", "is not a JSON object")):
        model.with_suffix(".json").write_text(text)
        claim = card_claim(model, "Pong-v0", "0" * 64, plain, "fp32")
        assert claim["problem"].startswith(why.split(" (")[0]) and why in f"{claim['path']} {claim['problem']}"
        assert card_line(claim, "Pong-v0", 1, run, plain, "fp32").endswith(
            ": not compared, and its see_skipped_frames not read (pass --see-skipped-frames if the model was trained "
            "with it)")
    long = {"env": "Pong-v0", "episodes": 100, "mean": 14.0, "std": 3.0, "source": "results/long.json",
            "precision": "fp32", "protocol": json.loads(json.dumps(seeing))}
    short = {**long, "mean": 1.0, "source": "results/short.json",
             "protocol": json.loads(json.dumps(protocol("Pong-v0", max_episode_length=200, skip_rate=4,
                                                        episodic_life=False, see_skipped=True)))}
    card = {"model_file": "Pong-v0.dat", "sha256": "a" * 64, "env": "Pong-v0", "see_skipped_frames": True,
            "evaluations": [long, short]}
    model.with_suffix(".json").write_text(json.dumps(card))
    assert card_line(card_claim(model, "Pong-v0", "b" * 64, plain, "fp32"), "Pong-v0", 1, run, plain, "fp32").endswith(
        "describes another file (its sha256 differs): not compared: its see_skipped_frames not applied (pass "
        "--see-skipped-frames if this file was trained with it)")
    assert card_line(card_claim(model, "Pong-v0", "b" * 64, seeing, "fp32"), "Pong-v0", 1, run, seeing, "fp32") \
        .endswith("describes another file (its sha256 differs): not compared")
    cut = protocol("Pong-v0", max_episode_length=200, skip_rate=4, episodic_life=False, see_skipped=True)
    assert card_claim(model, "Pong-v0", "a" * 64, cut, "fp32")["evaluation"] == short
    assert card_line(card_claim(model, "Pong-v0", "a" * 64, cut, "fp32"), "Pong-v0", 1, run, cut, "fp32") == \
        "card: Pong-v0 100 games 1.00 ± 3.00 (results/short.json); this run: 1 games 10.00 ± 1.00"
    assert card_claim(model, "Pong-v0", "a" * 64, cut, "bf16")["evaluation"] == long  # no match: the first
    assert card_claim(model, "Pong-v0", "a" * 64)["evaluation"] == long


def test_a_default_for_that_is_not_a_list_or_names_another_file_is_ignored(tmp_path):
    from gym_eval import default_model_file

    models = tmp_path / "trained_models"
    models.mkdir()
    (models / "Pong-v0.dat").write_bytes(b"model")
    card = models / "Pong-v0.json"
    card.write_text(json.dumps({"model_file": "Pong-v0.dat", "default_for": "ALE/Pong-v5"}))  # a string
    assert default_model_file(models, "Pong-v5") == models / "Pong-v5.dat"  # not a substring match
    assert default_model_file(models, "ALE/Pong-v5") == models / "ALE_Pong-v5.dat"
    card.write_text(json.dumps({"model_file": "Other.dat", "default_for": ["ALE/Pong-v5"]}))  # not its file
    (models / "Other.dat").write_bytes(b"model")
    assert default_model_file(models, "ALE/Pong-v5") == models / "ALE_Pong-v5.dat"
    card.write_text(json.dumps({"model_file": "Pong-v0.dat", "default_for": ["ALE/Pong-v5"]}))
    assert default_model_file(models, "ALE/Pong-v5") == models / "Pong-v0.dat"


@pytest.mark.parametrize("env_id,model", [("ALE/Pong-v5", "ALE_Pong-v5.dat"), ("Pong-v0", "Pong-v0.dat"),
                                          ("PongNoFrameskip-v4", "PongNoFrameskip-v4.dat"),
                                          ("PongNoFrameskip-v0", "Pong-v0.dat"),
                                          ("BreakoutNoFrameskip-v4", "BreakoutNoFrameskip-v4.dat"),
                                          ("BreakoutNoFrameskip-v0", "BreakoutNoFrameskip-v4.dat"),
                                          ("SpaceInvadersNoFrameskip-v4", "SpaceInvadersNoFrameskip-v4.dat"),
                                          ("SpaceInvadersNoFrameskip-v0", "SpaceInvadersNoFrameskip-v4.dat"),
                                          ("SpaceInvaders-v0", "SpaceInvadersNoFrameskip-v4.dat"),
                                          ("BeamRider-v0", "BeamRiderNoFrameskip-v4.dat"),
                                          ("MsPacmanNoFrameskip-v0", "MsPacmanNoFrameskip-v4.dat"),
                                          ("Seaquest-v0", "SeaquestNoFrameskip-v4.dat")])
def test_gym_eval_finds_the_shipped_model_for_each_protocol_without_flags(env_id, model):
    """What ``python gym_eval.py --env ENV`` loads from trained_models/ with no --model-file."""
    from gym_eval import default_model_file
    assert default_model_file(ROOT / "trained_models", env_id) == ROOT / "trained_models" / model


@pytest.mark.parametrize("value,expected", [
    (True, "ALE_Pong-v5.json evaluation on ALE/Pong-v5 (results/pong_v5_ent_half_eval_v5.json): max_over_frames 1, the "
           "model sees skipped frames (3)"),
    ("yes", "ALE_Pong-v5.json: see_skipped_frames is 'yes', not true or false")])
def test_a_card_whose_evaluations_showed_other_frames_than_it_says_is_reported(repo_copy, value, expected):
    """A card that says ``see_skipped_frames`` (gym_eval.py then turns the flag on) must cite evaluations that
    played with it: the sticky Pong card's evaluations showed the emulator's last frame."""
    path = repo_copy / "trained_models" / "ALE_Pong-v5.json"
    card = json.loads(path.read_text())
    path.write_text(json.dumps(dict(card, see_skipped_frames=value), indent=2))
    assert expected in card_problems(repo_copy / "trained_models", repo_copy)


def test_a_missing_model_names_the_models_of_the_same_game(tmp_path):
    """``gym_eval.py --env PongNoFrameskip-v0`` with no model of that id and none whose card lists it: the one
    line names the Pong models there and the ids they were trained on (a card's ``env``, else the file's name),
    not those of other games; a card that cannot tell (not JSON, an ``env`` that is not an id's string) leaves
    the file's name; at most ``SHOWN_MODELS`` are named."""
    from gym_eval import SHOWN_MODELS, same_game_models
    models = tmp_path / "models"
    models.mkdir()
    for stem in ("PongNoFrameskip-v4", "ALE_Pong-v5", "BreakoutNoFrameskip-v4", "my_pong", "mine", "PongNoFrameskip-v0x",
                 "Pong-v4", "Pong-v0", "PongDeterministic-v4\n"):  # the last: a Pong id, but not on one line
        (models / f"{stem}.dat").write_bytes(b"model")
    (models / "PongDeterministic-v0.dat").mkdir()  # not a model file
    (models / "my_pong.json").write_text(json.dumps({"model_file": "my_pong.dat", "env": "Pong-v0"}))
    # trained on the id asked for, under another name: listed
    (models / "mine.json").write_text(json.dumps({"model_file": "mine.dat", "env": "PongNoFrameskip-v0"}))
    (models / "ALE_Pong-v5.json").write_text(json.dumps({"model_file": "other.dat", "env": "Pong-v0"}))  # not its card
    (models / "Pong-v4.json").write_text(json.dumps({"model_file": "Pong-v4.dat", "env": 5}))  # not a string: the name
    (models / "Pong-v0.json").write_text("{not JSON")  # the name
    (models / "PongNoFrameskip-v0x.json").write_text(json.dumps({"model_file": "PongNoFrameskip-v0x.dat",
                                                                 "env": ["Pong-v0"]}))  # not an id: left out
    expected = [("ALE_Pong-v5", "ALE/Pong-v5"), ("Pong-v0", "Pong-v0"), ("Pong-v4", "Pong-v4"),
                ("PongNoFrameskip-v4", "PongNoFrameskip-v4"), ("mine", "PongNoFrameskip-v0"), ("my_pong", "Pong-v0")]
    assert same_game_models(models, "PongNoFrameskip-v0") == expected
    assert ("PongNoFrameskip-v4", "PongNoFrameskip-v4") not in same_game_models(models, "PongNoFrameskip-v4")
    assert same_game_models(models, "SeaquestNoFrameskip-v4") == []
    assert same_game_models(models, "NoSuchGame-v0") == []
    assert same_game_models(tmp_path / "nowhere", "Pong-v0") == []
    r = run_entry("gym_eval.py", "--env", "PongNoFrameskip-v0", "--load-model-dir", str(models), "--log-dir",
                  str(tmp_path / "l"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.rstrip().endswith(
        f"; {models} has Pong models, for --model-file (the id each was trained on): "
        + ", ".join(f"{stem} ({trained_on})" for stem, trained_on in expected) + ")"), r.stderr
    for k in range(SHOWN_MODELS):  # named after the six above: two of them shown, six not
        (models / f"p{k}.dat").write_bytes(b"model")
        (models / f"p{k}.json").write_text(json.dumps({"model_file": f"p{k}.dat", "env": "ALE/Pong-v5"}))
    r = run_entry("gym_eval.py", "--env", "PongNoFrameskip-v0", "--load-model-dir", str(models), "--log-dir",
                  str(tmp_path / "l"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.rstrip().endswith(", my_pong (Pong-v0), p0 (ALE/Pong-v5), p1 (ALE/Pong-v5) and 6 more)"), r.stderr
    r = run_entry("gym_eval.py", "--env", "SeaquestNoFrameskip-v4", "--load-model-dir", str(models), "--log-dir",
                  str(tmp_path / "l"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.rstrip().endswith("pass --model-file / --load-model-dir)"), r.stderr

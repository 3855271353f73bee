"""GA3C's counters, episode records, console line and results.txt: exact sums with a resumed base, the model
version, the episode ring read without loss (and lost entries counted), upstream's line and file formats."""
import re
from datetime import datetime

import pytest
import torch

from ga3c.settings import Ga3cSettings
from ga3c.stats import (ConsoleStats, Episode, EpisodeLog, Ga3cCounters, ResultsWriter, ScoresById, format_stats_line,
                        results_line)

LINE_RE = re.compile(r"^\[Time: +\d+\] \[Episode: +\d+ Score: +-?\d+\.\d{4}\] \[RScore: +-?\d+\.\d{4} RPPS: +\d+\] "
                     r"\[PPS: +\d+ TPS: +\d+\] \[NT: +\d+ NP: +\d+ NA: +\d+\]$")


def test_the_console_line_is_upstreams():
    line = format_stats_line(125.9, 42, -21.0, -20.5, 1234.7, 987.2, 3.9, 2, 2, 32)
    assert line == ("[Time:      125] [Episode:       42 Score:   -21.0000] [RScore:   -20.5000 RPPS:  1234] "
                    "[PPS:   987 TPS:     3] [NT:  2 NP:  2 NA: 32]")
    assert LINE_RE.match(line)


def test_results_line_and_writer_append(tmp_path):
    assert results_line(datetime(2024, 3, 5, 7, 8, 9), 21.0, 1654) == "2024-03-05 07:08:09, 21, 1654\n"
    assert results_line(datetime(2024, 3, 5, 7, 8, 9), -20.0, 800) == "2024-03-05 07:08:09, -20, 800\n"
    path = tmp_path / "run" / "results.txt"
    for score in (3.0, 5.0):  # two runs: the second appends
        with ResultsWriter(path) as w:
            w.write(Episode(1_700_000_000.0, score, 100))
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d, -?\d+, \d+$", s) for s in lines)
    assert lines[1].endswith(", 5, 100")
    with pytest.raises(ValueError):
        results_line(0.0, float("nan"), 1)


def test_console_stats_rolling_window():
    stats = ConsoleStats(start_time=1000.0, window=2)
    stats.add(Episode(1010.0, 1.0, 100))
    assert stats.line(1010.0, steps=500, updates=20, nt=1, np_=1, na=4) == format_stats_line(
        10, 1, 1.0, 1.0, 100 / 10, 50, 2, 1, 1, 4)
    stats.add(Episode(1020.0, 3.0, 300))
    stats.add(Episode(1030.0, 5.0, 500))  # the first game leaves the window; RPPS counts from its end
    line = stats.line(1040.0, steps=4000, updates=80, nt=2, np_=1, na=4)
    assert line == format_stats_line(40, 3, 5.0, 4.0, 800 / 30, 100, 2, 2, 1, 4)


def test_a_resumed_console_counts_only_its_own_steps_and_updates_and_goes_on_numbering_games():
    stats = ConsoleStats(start_time=0.0, window=10)
    stats.resume(steps=500_000, updates=6_000, episodes=300)  # the checkpoint's counts
    stats.restart_clock(1000.0)
    stats.add(Episode(1005.0, -20.0, 800))
    # 10 s after the processes started: 2,000 steps and 25 updates of this run, not 502,000 and 6,025
    assert stats.line(1010.0, steps=502_000, updates=6_025, nt=2, np_=1, na=2) == format_stats_line(
        10, 301, -20.0, -20.0, 800 / 10, 200, 2, 2, 1, 2)


class _Lines(list):
    info = list.append


def small_ga3c_run(tmp_path):
    """A ``Ga3cRun`` of 1 agent x 2 envs whose log is a list of its lines (nothing launched)."""
    from config import build_parser
    from ga3c.run import Ga3cRun
    from model import A3Clstm
    args = build_parser().parse_args(["--mode", "ga3c", "--agents", "1", "--envs-per-agent", "2",
                                      "--log-dir", str(tmp_path), "--save-model-dir", str(tmp_path)])
    return Ga3cRun(args, A3Clstm(1, 6, 32), None, log=_Lines())


def test_a_ga3c_run_resumed_from_a_checkpoint_reports_its_own_rates_and_saves_the_game_count(tmp_path):
    run = small_ga3c_run(tmp_path)
    run.restore({"global_steps": 500_000, "ga3c_updates": 6_000, "ga3c_episodes": 300})
    run.console.restart_clock(1000.0)  # what launch() does as the processes start
    run.counters.add_steps(0, 2_000)
    for _ in range(25):
        run.counters.record_update(0, steps=80, segments=4, lag_mean=1.0, lag_max=2, policy=0.0, value=0.0,
                                   entropy=1.0, grad_norm=1.0)
    run.episodes.record(0, -20.0, 800, when=1005.0)
    run.tick(1010.0)
    assert run.log == [format_stats_line(10, 301, -20.0, -20.0, 80, 200, 2, 0, 0, 0)]  # nothing launched
    assert run.snapshot() == {"ga3c_updates": 6_025, "ga3c_episodes": 301, "short_games_started": False}
    line, scalars = run.status(rate=200.0, span=10.0)  # the status line's updates/s: this run's 25 in 10 s
    assert scalars["charts/updates_per_s"] == pytest.approx(2.5) and "updates 6,025 (2.5/s)" in line, line


def test_a_ga3c_run_says_how_many_learner_games_it_could_not_read(tmp_path):
    run = small_ga3c_run(tmp_path)
    cap = run.episodes.records.shape[1]
    for k in range(cap + 6):  # between two reads: the newest cap - 1 are read, 7 are not
        run.episodes.record(0, -21.0, 800, when=1000.0 + k)
    run.tick(2000.0)
    assert len(run.log) == cap  # cap - 1 game lines and one line for the rest
    assert run.log[-1] == ("7 learner games ended faster than they were read and are missing from this log and "
                           "results.txt (7 in all)")
    run.tick(2001.0)
    assert len(run.log) == cap  # nothing new: nothing said
    # the games not read were played: the numbering goes on past them and the checkpoint counts them
    assert run.console.episodes == cap + 6 and run.snapshot()["ga3c_episodes"] == cap + 6
    assert re.search(rf"\[Episode: +{cap + 6} Score", run.log[-2]), run.log[-2]  # the last game read


def test_each_status_stretch_counts_an_update_that_lands_while_it_is_read_exactly_once(tmp_path):
    """The trainers add to the lag histogram at any moment: one landing while the status line is made is in that
    stretch or the next, never in neither (the histogram read once per stretch)."""
    run = small_ga3c_run(tmp_path)
    counters = run.counters
    real = counters.lag_summary

    def update_lands(*args, **kwargs):  # a trainer's update of 20 transitions at lag 5, while the status reads
        counters.record_update(0, steps=20, segments=1, lag_mean=5.0, lag_max=5, policy=0.0, value=0.0,
                               entropy=1.0, grad_norm=1.0, lags=torch.full((20,), 5))
        return real(*args, **kwargs)

    counters.record_update(0, steps=20, segments=1, lag_mean=1.0, lag_max=1, policy=0.0, value=0.0, entropy=1.0,
                           grad_norm=1.0, lags=torch.ones(20))
    counters.lag_summary = update_lands
    first, _ = run.status(rate=100.0, span=1.0)
    counters.lag_summary = real
    second, scalars = run.status(rate=100.0, span=1.0)
    assert "policy lag mean 1.00 max 1" in first, first  # the stretch up to its read
    assert "policy lag mean 5.00 max 5" in second and scalars["charts/policy_lag_max"] == 5, second
    third, _ = run.status(rate=100.0, span=1.0)
    assert "policy lag mean 0.00 max 0" in third, third  # nothing since


def test_the_game_log_and_the_update_counts_are_published_and_read_across_a_fence(monkeypatch):
    """A count is stored after a release fence (the game or the statistics it counts are in) and loaded before
    an acquire fence (what it counts is read after): the order a weakly ordered CPU needs. A fence that writes
    shows which stores came before it and which loads come after it."""
    import ga3c.stats as module
    log = EpisodeLog(max_agents=1, capacity=4)
    seen = []
    monkeypatch.setattr(module, "fence", lambda order: seen.append(
        (order, int(log.counts[0]), float(log.records[0, 0, 1]))))
    log.record(0, 7.0, 70, when=1.0)
    assert seen == [(module.RELEASE, 0, 7.0)]  # the record in, its count not yet

    def a_game_lands(order):  # between the reader's count load and its record loads
        seen.append(order)
        log.records[0, 0, 1] = 8.0
    seen.clear()
    monkeypatch.setattr(module, "fence", a_game_lands)
    assert [e.score for e in log.read_new()] == [8.0] and seen == [module.ACQUIRE]  # records loaded after it

    c = Ga3cCounters(max_agents=1, max_predictors=1, max_trainers=1)
    seen.clear()
    monkeypatch.setattr(module, "fence", lambda order: seen.append(
        (order, int(c.updates[0]), float(c.trainer_stats[0, 0]))))
    c.record_update(0, steps=20, segments=1, lag_mean=0.0, lag_max=0, policy=0.0, value=0.0, entropy=1.0,
                    grad_norm=1.0)
    assert seen == [(module.RELEASE, 0, 20.0)]  # the statistics in, the update not yet counted


def test_the_status_line_reads_the_trainers_statistics_after_its_acquire_fence(tmp_path, monkeypatch):
    """The status line loads the update count, then fences, then the trainers' statistics (the trained steps): a
    fence that adds 20 trained steps shows whether that load comes after it. Before, the trained steps were loaded
    before the fence, so on a weakly ordered CPU they could lag the update count they are paired with."""
    import ga3c.run as module
    run = small_ga3c_run(tmp_path)
    steps = module.TRAINER_FIELDS.index("steps")

    def a_batch_lands(order):
        run.counters.trainer_stats[0, steps] += 20
    monkeypatch.setattr(module, "fence", a_batch_lands)
    _, scalars = run.status(rate=100.0, span=1.0)
    assert scalars["charts/trained_steps_per_s"] == 20.0


def test_a_results_file_that_cannot_be_opened_is_one_line(tmp_path):
    from checkpoint import CheckpointWriteError
    (tmp_path / "results.txt").mkdir()
    with pytest.raises(CheckpointWriteError) as e:
        ResultsWriter(tmp_path / "results.txt")
    assert "results.txt" in str(e.value) and "\n" not in str(e.value)


def test_counters_are_exact_sums_and_the_version_is_the_update_count():
    c = Ga3cCounters(max_agents=3, max_predictors=2, max_trainers=2)
    c.restore(steps=1000, updates=10)  # a resumed run
    c.add_steps(0, 5)
    c.add_steps(2, 7)
    c.add_predictions(1, 12)
    for trainer in (0, 1, 1):
        c.record_update(trainer, steps=20, segments=1, lag_mean=0.5, lag_max=1, policy=0.1, value=0.2,
                        entropy=1.7, grad_norm=3.0)
    assert c.steps == 1012 and c.total_predictions == 12 and c.version == 13
    assert c.trainer_stats[1, 0].item() == 40 and c.trainer_stats[1, 6].item() == pytest.approx(1.7)
    c.set_active(2, 1, 3)
    assert c.active.tolist() == [2, 1, 3]


def test_episode_log_reads_every_game_once_in_time_order():
    log = EpisodeLog(max_agents=2, capacity=3)
    log.record(1, 2.0, 20, when=5.0)
    log.record(0, 1.0, 10, when=3.0)
    assert log.read_new() == [Episode(3.0, 1.0, 10), Episode(5.0, 2.0, 20)]
    assert log.read_new() == []
    for k in range(5):  # more than the ring holds between two reads: only the newest capacity - 1 are read (the
        log.record(0, float(k), k, when=10.0 + k)  # oldest slot is where the next game is written), 3 lost, counted
    assert [e.score for e in log.read_new()] == [3.0, 4.0] and log.lost == 3
    for k in range(3):  # exactly capacity behind: the same
        log.record(0, float(k), k, when=15.0 + k)
    assert [e.score for e in log.read_new()] == [1.0, 2.0] and log.lost == 4
    log.record(0, 9.0, 9, when=19.0)
    log.record(0, 8.0, 8, when=19.5)  # capacity - 1 behind: all read
    assert [e.score for e in log.read_new()] == [9.0, 8.0] and log.lost == 4
    log.record(1, -3.0, 30, when=20.0, slot=5)  # the env slot that played it comes back with the game
    assert log.read_new() == [Episode(20.0, -3.0, 30, 5)]


def test_scores_by_id_average_each_ids_last_games():
    by_id = ScoresById(window=3)
    assert by_id.means() == {} and by_id.text() == ""
    for env_id, score in [("Pong-v0", -21), ("ALE/Pong-v5", 10), ("Pong-v0", -19), ("Pong-v0", 5), ("Pong-v0", 8)]:
        by_id.add(env_id, score)
    # Pong-v0's last 3: -19, 5, 8 -> -2.0 (its first game, -21, left the window); ALE/Pong-v5: one game, 10
    assert by_id.means() == {"Pong-v0": (-2.0, 3), "ALE/Pong-v5": (10.0, 1)}
    assert by_id.text() == "learner games (last 3 of each): Pong-v0 -2.00, ALE/Pong-v5 10.00 (1 game)"
    by_id.add("ALE/Pong-v5", 11)
    assert by_id.text().endswith("ALE/Pong-v5 10.50 (2 games)")
    with pytest.raises(ValueError):
        ScoresById(window=0)


def test_settings_from_args_and_problems():
    from argparse import Namespace
    s = Ga3cSettings.from_args(Namespace(num_steps=7, gamma=0.9, workers=3, is_clip=None))
    assert s.num_steps == 7 and s.gamma == 0.9 and s.train_batch == Ga3cSettings().train_batch
    bad = Ga3cSettings(num_steps=0, train_batch=0, is_clip=-1.0).problems()
    assert len(bad) == 3 and any("is_clip" in b for b in bad)
    assert Ga3cSettings().problems() == []
    # a negative count would make greedy_slot_ids() count back from the last slot
    assert Ga3cSettings(short_game_slots=-1, greedy_slots=1, ema_steps=-1).problems() == [
        "short_game_slots must be >= 0, got -1", "ema_steps must be >= 0, got -1"]

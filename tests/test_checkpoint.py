"""Writing model files and checkpoints: a run that diverged never writes over a good file, the folder lock under
a refused start, and the temporary files a killed save leaves."""
import math

import pytest
import torch

from checkpoint import (DivergedError, RunLock, RunLockedError, checkpoint_path, model_path, read_weights,
                        remove_stale_temp_files)
from config import build_parser, validate
from model import A3Clstm
from modes import Mode, save_checkpoint
from run_state import RunState
from shared_optim import make_optimizer


def run_args(tmp_path, *flags):
    args = build_parser().parse_args(["--mode", "a3g", "--workers", "1", "--hidden-size", "32", "--save-model-dir",
                                      str(tmp_path / "m"), "--log-dir", str(tmp_path / "l"), *flags])
    assert validate(args) == []
    (tmp_path / "m").mkdir()
    return args


def trained(args):
    """A model and a shared Adam with statistics in it (one step taken), and the run's counters."""
    model = A3Clstm(1, 6, 32)
    opt = make_optimizer("Adam", model.parameters(), 1e-3, shared=True)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    return model, opt, RunState(1, 3)


@pytest.mark.parametrize("where", ["model", "optimizer", "average_model"])
def test_a_checkpoint_with_nan_or_inf_is_not_written_over_the_last_good_one(tmp_path, where):
    """Hogwild or a too large --lr can drive the weights (and Adam's statistics) to NaN. Before, every save wrote
    them over the only checkpoint, and --load then refused it: nothing to resume. Now the save raises
    DivergedError, one line naming the tensor, and the previous checkpoint stays byte for byte."""
    args = run_args(tmp_path)
    model, opt, run = trained(args)
    average = A3Clstm(1, 6, 32)
    path = save_checkpoint(args, model, opt, run, 1.0, average_model=average)
    good = path.read_bytes()
    with torch.no_grad():
        if where == "model":
            model.critic_linear.bias.fill_(float("inf"))
        elif where == "average_model":
            average.lstm.weight_hh.view(-1)[7] = float("nan")
        else:
            opt.state[next(iter(model.parameters()))]["exp_avg_sq"].view(-1)[3] = float("nan")
    with pytest.raises(DivergedError) as e:
        save_checkpoint(args, model, opt, run, 2.0, average_model=average)
    name = {"model": "model critic_linear.bias", "average_model": "average_model lstm.weight_hh",
            "optimizer": "optimizer state.0.exp_avg_sq"}[where]
    assert str(e.value) == (f"the run diverged: NaN or infinite values in {name}; {path} is not written (the last "
                            f"one written before is kept): resume from it with --load and a smaller --lr")
    assert path.read_bytes() == good and read_weights(path)["elapsed_seconds"] == 1.0
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["PongNoFrameskip-v4.ckpt"]  # no temporary file


def test_the_final_model_file_of_a_diverged_run_is_not_written(tmp_path):
    """``Mode.save(final=True)`` writes the .dat after the checkpoint; weights gone NaN write neither."""
    args = run_args(tmp_path)
    model, opt, run = trained(args)

    class Bare(Mode):  # Mode's own save, with the fields it reads
        describe = restore = slot_of = launch = expected_exit = status = None
    mode = Bare()
    mode.args, mode.shared_model, mode.optimizer, mode.run, mode.average_model = args, model, opt, run, None
    mode.save(1.0, final=True)
    dat = model_path(args.save_model_dir, args.env)
    good = {p: p.read_bytes() for p in (dat, checkpoint_path(args.save_model_dir, args.env))}
    with torch.no_grad():
        model.actor_linear.weight[0, 0] = float("nan")
    with pytest.raises(DivergedError, match="model actor_linear.weight;"):
        mode.save(2.0, final=True)
    assert {p: p.read_bytes() for p in good} == good


def test_the_parameter_server_does_not_write_a_diverged_checkpoint(tmp_path):
    from multinode.ps import ParameterServer
    args = run_args(tmp_path, "--ray-address", "local", "--nodes", "1")
    start = {k: v.clone() for k, v in A3Clstm(1, 6, 32).state_dict().items()}
    fields = {"best_score": -21.0, "elapsed_seconds": 3.0, "config": {}, "monitor": torch.zeros(3, dtype=torch.float64),
              "recent_scores": [], "monitor_norm_row": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}
    ps = ParameterServer(args, "run-1")
    ok, path = ps.begin(start, 100, None, dict(fields))
    good = checkpoint_path(args.save_model_dir, args.env).read_bytes()
    ps.weights["critic_linear.bias"][0] = math.nan
    ok, line = ps.save(dict(fields), write_model=True)
    assert not ok and line.startswith("the run diverged: NaN or infinite values in model critic_linear.bias;")
    assert checkpoint_path(args.save_model_dir, args.env).read_bytes() == good
    assert not model_path(args.save_model_dir, args.env).exists()


def test_a_temporary_file_of_a_pid_alive_again_is_removed_under_the_lock(tmp_path):
    """Under the folder's lock no other process writes there, so every ``.<name>.tmp<pid>`` is a killed save's,
    also where its pid now belongs to another process (pids are reused, small ones at once in a container).
    Before, a file whose pid was alive (here pid 1) stayed for ever."""
    lock = RunLock(tmp_path)
    try:
        for name in (".PongNoFrameskip-v4.ckpt.tmp1", ".PongNoFrameskip-v4.dat.tmp999999999"):
            (tmp_path / name).write_bytes(b"partial")
        (tmp_path / "keep.tmp1").write_bytes(b"not ours")
        removed = remove_stale_temp_files(tmp_path)
    finally:
        lock.release()
    assert sorted(p.name for p in removed) == [".PongNoFrameskip-v4.ckpt.tmp1", ".PongNoFrameskip-v4.dat.tmp999999999"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "keep.tmp1"]


def test_a_lock_taken_between_a_refused_runs_checks_stays_with_its_holder(tmp_path, monkeypatch):
    """Run A makes and locks ``.lock`` (and the folder) just after run B has looked for them and before B tries
    the lock. B is refused, and must leave A's files alone: before, B removed the lock file A holds (it had not
    been there when B looked), so a third run C made a new one, locked it, and ran beside A in one folder."""
    import main
    args = build_parser().parse_args(["--save-model-dir", str(tmp_path / "models"), "--log-dir", str(tmp_path / "logs")])
    real = main.RunLock
    held = []

    def a_first(folder, flag="--save-model-dir", name=".lock"):
        if not held:  # A, between B's look and B's lock
            held.append(real(folder, flag, name))
        return real(folder, flag, name)
    monkeypatch.setattr(main, "RunLock", a_first)
    with pytest.raises(RunLockedError):
        main.take_locks(args)
    try:
        assert (tmp_path / "models" / ".lock").is_file()
        with pytest.raises(RunLockedError):  # C
            RunLock(tmp_path / "models")
    finally:
        held[0].release()
    assert not (tmp_path / "logs").exists()  # B stopped at the first lock: its second folder was never made


def test_a_lock_file_removed_while_it_was_being_locked_is_made_again(tmp_path, monkeypatch):
    """B opens ``.lock``; its holder removes it and lets go before B's flock. B's lock is then on a file no longer
    in the folder, and another run could make and lock a new one: ``RunLock`` must end holding the file that is
    there."""
    import checkpoint
    import fcntl
    import os
    (tmp_path / ".lock").write_text("4242\n")
    real_flock = fcntl.flock
    calls = []

    def flock(fd, op):
        if not calls and op & fcntl.LOCK_EX:
            os.unlink(tmp_path / ".lock")  # the former holder's clean-up, between B's open and B's flock
        calls.append(op)
        return real_flock(fd, op)
    monkeypatch.setattr(checkpoint.fcntl, "flock", flock)
    lock = RunLock(tmp_path)
    try:
        assert os.fstat(lock.fd).st_ino == os.stat(tmp_path / ".lock").st_ino
        with pytest.raises(RunLockedError):
            RunLock(tmp_path)
    finally:
        lock.release()


def test_a_save_syncs_the_file_and_then_its_folder(tmp_path, monkeypatch):
    """The rename that puts a checkpoint in place reaches the disk only when the folder is synced too; before, only
    the file was, and after a power loss the folder could still name the previous checkpoint. A file system that
    cannot sync a folder (EINVAL) does not fail the save."""
    import errno
    import os

    import checkpoint
    real = os.fsync
    synced = []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    path = tmp_path / "m.dat"
    checkpoint.atomic_save({"w": torch.ones(2)}, path)
    assert len(synced) == 2 and synced[0].startswith(str(tmp_path / ".m.dat.tmp")) and synced[1] == str(tmp_path)

    def no_folder_sync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd)
    monkeypatch.setattr(checkpoint.os, "fsync", no_folder_sync)
    checkpoint.atomic_save({"w": torch.zeros(2)}, path)
    assert torch.equal(read_weights(path)["w"], torch.zeros(2))


def ga3c_mode(tmp_path):
    """A ``Ga3cRun`` as main builds it, with a trained shared model and Adam, and no process started."""
    import logging

    from ga3c.run import Ga3cRun
    args = build_parser().parse_args(["--agents", "1", "--envs-per-agent", "2", "--hidden-size", "32",
                                      "--save-model-dir", str(tmp_path / "m"), "--log-dir", str(tmp_path / "l")])
    assert validate(args) == []
    (tmp_path / "m").mkdir()
    model, opt, _ = trained(args)
    return Ga3cRun(args, model, opt, logging.getLogger("test_checkpoint"))


class Process:
    """Stands for a process of the run in ``Ga3cRun.procs``."""

    def __init__(self, alive: bool):
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


def test_a_periodic_ga3c_checkpoint_waits_for_the_step_in_progress(tmp_path):
    """While a trainer is inside a step (here: a thread in the counters' gate that finishes its "step" 0.3 s
    later), the periodic save waits and writes the weights and statistics of after the step. It waits while the
    server is alive, whatever other processes ended (--dynamic retires agents; before, one retired agent made
    every save that met a step skip)."""
    import threading
    import time
    mode = ga3c_mode(tmp_path)
    mode.procs = [("ga3c server", Process(alive=True)), ("ga3c agent 1", Process(alive=False))]
    weight = mode.shared_model.critic_linear.bias
    stat = mode.optimizer.state[weight]["exp_avg"]
    gate, inside = mode.counters.gate, threading.Event()

    def step():
        with gate.writing():
            inside.set()
            time.sleep(0.3)
            with torch.no_grad():
                weight.fill_(7.0)
                stat.fill_(3.0)

    trainer = threading.Thread(target=step)
    trainer.start()
    inside.wait()
    path = mode.save(1.0)
    trainer.join()
    ckpt = read_weights(path)
    assert float(ckpt["model"]["critic_linear.bias"][0]) == 7.0
    index = [p is weight for p in mode.shared_model.parameters()].index(True)
    assert float(ckpt["optimizer"]["state"][index]["exp_avg"][0]) == 3.0
    assert not gate.in_step() and int(gate.state[1:].max()) == 0  # the save's hold released


def test_a_ga3c_checkpoint_is_not_written_where_the_server_died_inside_a_step(tmp_path, caplog):
    """A server killed inside an optimizer step leaves the gate in the step for good: the periodic save waits
    only while every process of the run is alive, then skips (one line); the final save writes nothing either
    (the shared weights hold that step half applied), so the last complete checkpoint stays byte for byte."""
    import logging
    mode = ga3c_mode(tmp_path)
    mode.procs = [("ga3c server", Process(alive=True)), ("monitor", Process(alive=True))]
    path = mode.save(1.0)
    before = path.read_bytes()
    mode.procs[0] = ("ga3c server", Process(alive=False))
    mode.counters.gate.state[0] += 1  # a step begun and never ended
    with caplog.at_level(logging.INFO, logger="test_checkpoint"):
        assert mode.save(2.0) is None
        assert mode.save(3.0, final=True) is None
    assert path.read_bytes() == before
    assert not model_path(tmp_path / "m", "PongNoFrameskip-v4").exists()  # no final .dat of those weights either
    assert [r.getMessage() for r in caplog.records] == [
        "checkpoint skipped: no moment between two optimizer steps within 10 s, or the ga3c server ended inside "
        "one; the last complete checkpoint stays",
        "the final checkpoint is not written: the ga3c server ended inside an optimizer step, so the shared weights "
        "hold that step half applied; the last complete checkpoint stays"]
    mode.counters.gate.state[0] += 1  # a server that ended between steps: the final save writes
    mode.save(4.0, final=True)
    assert read_weights(path)["elapsed_seconds"] == 4.0 and read_weights(model_path(tmp_path / "m",
                                                                                    "PongNoFrameskip-v4"))


def test_a_ga3c_run_hands_its_step_gate_to_the_server_and_the_monitor(tmp_path, monkeypatch):
    """``Ga3cRun.launch`` gives the server the counters whose gate its trainers mark each step in, and the
    monitor that same gate, which ``consistent`` reads too."""
    import multiprocessing as mp

    import lifeline
    mode = ga3c_mode(tmp_path)
    (tmp_path / "l").mkdir()
    started = {}
    monkeypatch.setattr(lifeline, "mark_children", lambda: None)
    monkeypatch.setattr(mode, "_start", lambda role, target, target_args: started.setdefault(role, target_args))
    mode.launch(mp.get_context("spawn"))
    assert started["ga3c server"][5] is mode.counters and started["monitor"][-1] is mode.counters.gate


def test_the_short_games_switch_reaches_the_agents_and_the_monitor_and_is_kept_in_the_checkpoint(tmp_path,
                                                                                                  monkeypatch):
    """``--short-games-after-score``: ``Ga3cRun.launch`` hands every agent a factory holding the run's
    ``short_games`` flag and the monitor (which sets it) that run state; ``save`` writes whether it is set, the
    written checkpoint passes ``check_checkpoint``, and ``restore`` sets it again only where it was set and the
    resumed run's score is no higher than the one reached."""
    import logging
    import multiprocessing as mp

    import lifeline
    from checkpoint import check_checkpoint
    from ga3c.run import Ga3cRun
    args = build_parser().parse_args(["--agents", "2", "--envs-per-agent", "2", "--hidden-size", "32",
                                      "--short-game-slots", "1", "--short-games-after-score", "19",
                                      "--save-model-dir", str(tmp_path / "m"), "--log-dir", str(tmp_path / "l")])
    assert validate(args) == []
    (tmp_path / "m").mkdir()
    (tmp_path / "l").mkdir()
    model, opt, _ = trained(args)
    mode = Ga3cRun(args, model, opt, logging.getLogger("test_checkpoint"))
    started = {}
    monkeypatch.setattr(lifeline, "mark_children", lambda: None)
    monkeypatch.setattr(mode, "_start", lambda role, target, target_args: started.setdefault(role, target_args))
    mode.launch(mp.get_context("spawn"))
    for a in (0, 1):
        factory = started[f"ga3c agent {a}"][3]
        assert factory.short_switch is mode.run.short_games and factory.short_slots == 1
    assert started["monitor"][2] is mode.run
    saved = []
    for switched in (False, True):
        if switched:
            mode.run.short_games.set()
        path = mode.save(1.0, final=True)
        ckpt = read_weights(path)
        check_checkpoint(ckpt, path)
        assert ckpt["short_games_started"] is switched and ckpt["config"]["short_games_after_score"] == 19
        saved.append(ckpt)
    # resumed with the same score, a lower one, a higher one (which waits for the monitor again), or none
    for flags, goes_on in ((["--short-games-after-score", "19"], True), (["--short-games-after-score", "18.5"], True),
                           (["--short-games-after-score", "19.5"], False), ([], False)):
        again = build_parser().parse_args(["--agents", "2", "--envs-per-agent", "2", "--hidden-size", "32",
                                           "--short-game-slots", "1", *flags])
        for ckpt, switched in zip(saved, (False, True)):
            resumed = Ga3cRun(again, A3Clstm(1, 6, 32), None, log=None)
            resumed.restore(ckpt)
            assert resumed.run.short_games.is_set() is (switched and goes_on), (flags, switched)


@pytest.mark.parametrize("mode_name", ["a3g", "ga3c"])
def test_the_finiteness_check_reads_copies_not_the_live_shared_tensors(tmp_path, monkeypatch, mode_name):
    """``torch.isfinite`` reads each value twice; on the live shared Adam statistics while a trainer stepped them
    it reported NaN where there was none (51 of 3,491 checks made during fused Adam steps, a run stopped as
    diverged). ``Mode.save`` checks the checkpoint's copies: no tensor it checks shares memory with the shared
    weights, the moving average or the optimizer's statistics."""
    import modes
    if mode_name == "ga3c":
        mode = ga3c_mode(tmp_path)
        mode.procs = [("ga3c server", Process(alive=True))]
    else:
        args = run_args(tmp_path)
        model, opt, run = trained(args)

        class Bare(Mode):  # Mode's own save, with the fields it reads
            describe = restore = slot_of = launch = expected_exit = status = None
        mode = Bare()
        mode.args, mode.shared_model, mode.optimizer, mode.run = args, model, opt, run
    mode.average_model = A3Clstm(1, 6, 32)
    live = {t.untyped_storage().data_ptr() for m in (mode.shared_model, mode.average_model)
            for t in m.state_dict().values()}
    live |= {t.untyped_storage().data_ptr() for state in mode.optimizer.state.values() for t in state.values()
             if isinstance(t, torch.Tensor)}
    checked = []
    real = modes.refuse_non_finite

    def recording(path, **parts):
        from checkpoint import tensors_in
        checked.extend(t.untyped_storage().data_ptr() for obj in parts.values() if obj is not None
                       for _, t in tensors_in(obj) if t.is_floating_point())
        return real(path, **parts)
    monkeypatch.setattr(modes, "refuse_non_finite", recording)
    mode.save(1.0, final=True)
    n_stats = sum(t.is_floating_point() for state in mode.optimizer.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor))
    assert len(checked) == 2 * len(mode.shared_model.state_dict()) + n_stats and n_stats > 0
    assert not live & set(checked)

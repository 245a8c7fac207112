"""The memory tier through Trainer: a SIGKILL loses at most the step in flight, by the watcher or by the restart.

Each run is a child process (`memory_tier_worker.py`): an uninterrupted run, then runs killed after step 13 (disk
saves every 5 steps: the disk's newest is step 10) and the same command resumed with `resume_checkpoint("auto")`.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_dynamic_ckpt.cli import main as cli
from hf_dynamic_ckpt.constants import WEIGHTS_NAME
from hf_dynamic_ckpt.store import CheckpointStore
from hf_dynamic_ckpt.store.slots import slots_dir

WORKER = Path(__file__).with_name("memory_tier_worker.py")


def _run(out: Path, *args: str, killed: bool = False, fault: str = "") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_DYNAMIC_CKPT_FAULT": fault}
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=600, start_new_session=True, env=env)
    (out / "stderr.txt").write_text(proc.stderr)
    if killed:
        assert proc.returncode == -9, proc.stderr[-3000:]
        return {"losses": json.loads((out / "killed.json").read_text())}
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / ("resumed.json" if "--resume" in args else "losses.json")).read_text())


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = _run(out)
    assert not slots_dir(out / "run" / "smart_ckpt", "default").exists()  # a clean end removes the slots
    return result


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run: dict) -> dict[int, float]:
    return {int(s): loss for s, loss in uninterrupted_run["losses"]}


def test_the_training_logs_count_the_slots_written_and_skipped(uninterrupted_run: dict) -> None:
    # A slot is due every step (16): each is written or counted as skipped (a disk save or the previous slot still
    # writing), never both, so a user sees in the logs when the tier fell behind.
    m = uninterrupted_run["memory_metrics"]
    assert set(m) == {"smart_ckpt/memory_slots", "smart_ckpt/memory_slots_skipped"}, m
    assert m["smart_ckpt/memory_slots"] >= 1 and m["smart_ckpt/memory_slots"] + m["smart_ckpt/memory_slots_skipped"] \
        <= 16, m


def _steps(out: Path) -> list[int]:
    store = CheckpointStore(out / "run" / "smart_ckpt", read_only=True)
    try:
        return sorted(i.step for i in store.list(include_unhealthy=True))
    finally:
        store.close()


@pytest.mark.parametrize("group", [False, True], ids=["trainer-killed-watcher-persists", "group-killed-restart"])
def test_a_sigkill_after_step_13_resumes_from_step_12_bit_exact(tmp_path: Path, uninterrupted: dict[int, float],
                                                                 group: bool, capsys: pytest.CaptureFixture) -> None:
    _run(tmp_path, "--kill_at", "13", *(["--kill_group"] if group else []), killed=True)
    slots = slots_dir(tmp_path / "run" / "smart_ckpt", "default")
    if group:  # nothing outlived the job: the disk has step 10, host memory has step 12 (and 11, unless its slot
        # was skipped while step 10's disk save still wrote: a busy machine)
        assert _steps(tmp_path) == [5, 10]
        held = sorted(p.name for p in (slots / "default").iterdir() if p.name.startswith("step-"))
        assert held in (["step-11", "step-12"], ["step-12"]), held
        assert cli(["ls", str(tmp_path / "run" / "smart_ckpt")]) == 0  # shows them, changes nothing
        assert "in host memory" in capsys.readouterr().out and _steps(tmp_path) == [5, 10] and slots.exists()
    else:  # the watcher (the writer process) persisted the newest slot within seconds
        deadline = time.monotonic() + 60
        while _steps(tmp_path) != [5, 10, 12] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _steps(tmp_path) == [5, 10, 12]
    resumed = _run(tmp_path, "--resume")
    assert resumed["resumed_from"] == 12  # one step lost (13, the step the kill cut), not three
    # Read from host memory when the disk did not have it yet (then persisted in the background), else from disk.
    assert Path(resumed["resumed_path"]).parent.parent == (slots if group else tmp_path / "run" / "smart_ckpt")
    assert [s for s, _ in resumed["losses"]] == [13, 14, 15, 16]
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])  # bit-equal
    assert not slots.exists()  # the resumed run's slots (and the killed run's, persisted) went at its clean end
    assert 12 in _steps(tmp_path)


def test_memory_tier_off_writes_no_slot_and_resumes_from_disk(tmp_path: Path, uninterrupted: dict[int, float]) -> None:
    _run(tmp_path, "--kill_at", "13", "--memory_tier", "false", killed=True)
    assert not slots_dir(tmp_path / "run" / "smart_ckpt", "default").exists()
    resumed = _run(tmp_path, "--resume", "--memory_tier", "false")
    assert resumed["resumed_from"] == 10 and resumed["memory_metrics"] == {}
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])


def test_gc_persists_a_killed_runs_newest_slot_and_removes_the_slots(tmp_path: Path, capsys: pytest.CaptureFixture
                                                                    ) -> None:
    _run(tmp_path, "--kill_at", "13", "--kill_group", killed=True)
    root = str(tmp_path / "run" / "smart_ckpt")
    assert cli(["gc", root]) == 0
    assert "persisted step 12 from the memory slots of steps 11, 12" in capsys.readouterr().out
    assert _steps(tmp_path) == [5, 10, 12] and not slots_dir(root, "default").exists()


def test_smart_checkpointer_killed_after_step_13_resumes_from_step_13(tmp_path: Path) -> None:
    # A custom loop saves at `after_update`: the slot of step 13 is taken before the kill, and the restart (the
    # whole process group killed: no watcher) persists it and resumes with nothing recomputed.
    uninterrupted = {int(s): loss for s, loss in _run(tmp_path / "a", "--loop", "accelerate")["losses"]}
    _run(tmp_path / "b", "--loop", "accelerate", "--kill_at", "13", "--kill_group", killed=True)
    resumed = _run(tmp_path / "b", "--loop", "accelerate", "--resume")
    assert resumed["resumed_from"] == 13 and [s for s, _ in resumed["losses"]] == [14, 15, 16]
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])


def test_a_kill_during_a_slot_write_leaves_the_previous_slot_and_a_damaged_one_is_passed_over(
        tmp_path: Path, uninterrupted: dict[int, float]) -> None:
    # The writer process is killed while it writes the slot of step 12 (the library's test hook), then the whole job
    # after step 13: the slot of step 11 is whole, and the restart resumes from it.
    _run(tmp_path, "--kill_at", "13", "--kill_group", killed=True,
         fault=f"write@step=12@name={WEIGHTS_NAME}:kill")
    slots = slots_dir(tmp_path / "run" / "smart_ckpt", "default") / "default"
    assert (slots / "step-11").is_dir() and not (slots / "step-12").exists()
    resumed = _run(tmp_path, "--resume")
    assert resumed["resumed_from"] == 11
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])
    # The same kill, its slot of step 11 damaged (one byte of its weights): the restart resumes from disk.
    damaged = tmp_path / "damaged"
    _run(damaged, "--kill_at", "13", "--kill_group", killed=True, fault=f"write@step=12@name={WEIGHTS_NAME}:kill")
    slots = slots_dir(damaged / "run" / "smart_ckpt", "default") / "default"
    weights = slots / "step-11" / WEIGHTS_NAME
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    resumed = _run(damaged, "--resume")
    assert resumed["resumed_from"] == 10
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])


@pytest.mark.parametrize("seed", [3, pytest.param(11, marks=pytest.mark.slow)])
def test_a_sigkill_at_a_seeded_random_step_resumes_from_the_step_before(tmp_path: Path, uninterrupted: dict[int, float],
                                                                        seed: int) -> None:
    kill = random.Random(seed).randint(3, 15)  # the step whose end the kill cuts: its slot is not yet written
    _run(tmp_path, "--kill_at", str(kill), "--kill_group", killed=True)
    resumed = _run(tmp_path, "--resume")
    assert resumed["resumed_from"] == kill - 1, (kill, resumed["resumed_from"])
    assert [s for s, _ in resumed["losses"]] == list(range(kill, 17))
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])
    assert kill - 1 in _steps(tmp_path)  # the slot became a disk checkpoint


def test_torchrun_restarts_the_killed_worker_and_it_resumes_from_memory(tmp_path: Path,
                                                                        uninterrupted: dict[int, float]) -> None:
    # torchrun --max-restarts 1: the worker is SIGKILLed after step 13, the agent tears down its process group (the
    # writer process gets SIGTERM: it persists the newest slot) and starts the worker again, which resumes.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--max-restarts", "1",
           "--master_port", str(29400 + os.getpid() % 500), str(WORKER), "--out", str(tmp_path), "--resume",
           "--kill_at", "13", "--kill_once"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, start_new_session=True,
                          env={**os.environ, "HF_DYNAMIC_CKPT_FAULT": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["resumed_from"] == 12
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])
    slots = slots_dir(tmp_path / "run" / "smart_ckpt", "default")
    left = sorted(str(p.relative_to(slots)) for p in slots.rglob("*")) if slots.exists() else None
    assert 12 in _steps(tmp_path) and left is None, (left, proc.stderr[-3000:])


def test_shm_full_turns_the_tier_off_with_the_fix_and_training_goes_on(tmp_path: Path,
                                                                       uninterrupted: dict[int, float]) -> None:
    # The slot write of step 7 finds /dev/shm full: one WARNING names the fix, the tier is off (its slots go, room for
    # data loaders), disk saves go on, and a kill after step 13 resumes from the disk's step 10.
    _run(tmp_path, "--kill_at", "13", "--kill_group", killed=True,
         fault=f"write@step=7@name={WEIGHTS_NAME}:raise=ENOSPC")
    log = (tmp_path / "stderr.txt").read_text()
    assert log.count("memory tier off: writing a slot failed (memory slot of step 7 failed: ") == 1
    assert "No space left on device" in log and "docker run --shm-size=" in log
    assert "Free disk space" not in log  # not reported as a failed disk save
    assert not slots_dir(tmp_path / "run" / "smart_ckpt", "default").exists()
    resumed = _run(tmp_path, "--resume")
    assert resumed["resumed_from"] == 10
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])


@pytest.mark.parametrize("at", [1, 3], ids=["on-the-training-thread", "in-the-writer-process"])
def test_slots_removed_under_a_live_run_turn_the_tier_off_and_are_not_made_again(
        tmp_path: Path, uninterrupted: dict[int, float], at: int) -> None:
    # Another process (a clean-up of /dev/shm) removes the slots' directory of a live run after step 1 (while the
    # writer process starts, the slots are written on the training thread) or after step 3 (by the writer process): a
    # slot fails with one WARNING, the tier is off, the directory is not made again (a store would make it with the
    # default mode: refused by the next run), and training goes on, its losses those of the uninterrupted run.
    result = _run(tmp_path, "--remove_slots_at", str(at), *(["--no_wait_writer"] if at == 1 else []))
    log = (tmp_path / "stderr.txt").read_text()
    failed = re.findall(r"memory tier off: writing a slot failed \(memory slot of step (\d+) failed: ", log)
    # One slot fails: the next one, or one the writer process still writes when the directory goes.
    assert len(failed) == 1 and at - 1 <= int(failed[0]) <= at + 1, log[-3000:]
    # Found gone before the write, or gone under it.
    assert log.count("was removed or replaced by another process while this run used it") + log.count(
        "No such file or directory") == 1
    assert result["slots_there"] == [False] * (16 - at)
    assert all(loss == uninterrupted[int(s)] for s, loss in result["losses"])
    assert _steps(tmp_path) == [5, 10, 15, 16]


def test_the_slots_of_another_task_are_never_read(tmp_path: Path) -> None:
    # Task "a" is killed with slots in memory; task "b" in the same store starts and ends without touching them.
    _run(tmp_path, "--kill_at", "13", "--kill_group", "--task", "a", killed=True)
    a_slots = slots_dir(tmp_path / "run" / "smart_ckpt", "a") / "a"
    assert a_slots.is_dir(), (tmp_path / "stderr.txt").read_text()[-3000:]
    before = {p.name: p.stat().st_mtime_ns for p in a_slots.iterdir() if p.name.startswith("step-")}
    resumed = _run(tmp_path, "--resume", "--task", "b")
    assert resumed["resumed_from"] is None and len(resumed["losses"]) == 16
    assert {p.name: p.stat().st_mtime_ns for p in a_slots.iterdir() if p.name.startswith("step-")} == before
    assert sorted(before) == ["step-11", "step-12"]
    store = CheckpointStore(tmp_path / "run" / "smart_ckpt", task_id="a", read_only=True)
    try:
        assert sorted(i.step for i in store.list(include_unhealthy=True)) == [5, 10]  # nothing of "a" persisted
    finally:
        store.close()


def test_with_the_tier_the_librarys_interval_follows_node_failures_not_process_kills(tmp_path: Path) -> None:
    # The interval left to the library (Young/Daly) with a process failure every 2 s (`mtbf_hours`): without the tier
    # it saves to disk every few steps; with it the slots cover a process's death and the disk follows
    # `policy.node_mtbf_hours` (168 h: no disk save in 16 steps but the first, which measures the save's cost, and the
    # last).
    args = ("--base_interval", "none", "--mtbf_hours", "0.0005")
    _run(tmp_path / "off", *args, "--memory_tier", "false")
    _run(tmp_path / "on", *args)
    off, on = _steps(tmp_path / "off"), _steps(tmp_path / "on")
    assert len(off) >= 4, off
    assert on == [4, 16] and off[0] == 4, (on, off)

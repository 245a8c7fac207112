"""One writer per task, and every ordinary restart gets the lock (store level; see `hf_dynamic_ckpt.store.lock`).

What each kind of holder gets: another open writer of this process is refused (a new run of the
process closes its earlier run first), a writer dropped without closing is replaced; a holder
that is gone (killed, crashed, rebooted, pid reused) is taken over without a flag, even when a
process it forked is still running; a holder this host cannot see (another host) is waited for,
then named in `StoreLockedError`; a live holder of this host is refused at once.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import torch
from helpers import save_state
from store_helpers import tiny_state

from hf_dynamic_ckpt import SmartCkptConfig
from hf_dynamic_ckpt.errors import StoreLockedError
from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator
from hf_dynamic_ckpt.store import CheckpointStore, Lineage, SaveRequest
from hf_dynamic_ckpt.store.lock import HolderState, judge, read_holder, this_host
from hf_dynamic_ckpt.store.slots import slots_dir

HOLDER = """
import os, socket, sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[3])
from store_helpers import tiny_state
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest
mode = sys.argv[2]
if mode.startswith("host="):  # pretend to run on another host (a pod on another node)
    other = mode.removeprefix("host=")
    socket.gethostname = lambda: other
store = CheckpointStore(sys.argv[1], task_id="run", session_id="first")
store.save(tiny_state(1), SaveRequest(step=1, reason="first"))
if mode == "orphan":  # a child (a data-loader worker) inherits the open lock file, then the holder dies
    child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(f"ready {child}", flush=True)
    os._exit(0)
print("ready", flush=True)
sys.stdin.readline()  # go on when the test says so
store.save(tiny_state(2), SaveRequest(step=2, reason="first"))
store.close()
print("done", flush=True)
"""


def _holder(root: Path, mode: str) -> tuple[subprocess.Popen[str], int | None]:
    """The first writer, and (mode "orphan") the pid of the child that inherited its open lock file."""
    argv = [sys.executable, "-c", textwrap.dedent(HOLDER), str(root), mode, str(Path(__file__).parents[1])]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["ready"], line
    return proc, int(line[1]) if len(line) > 1 else None


def _finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"
    proc.wait(timeout=60)


def test_a_live_writer_of_this_host_is_refused_at_once_and_no_save_is_lost(tmp_path: Path) -> None:
    first, _ = _holder(tmp_path, "wait")
    try:
        start = time.monotonic()
        with pytest.raises(StoreLockedError) as exc:
            CheckpointStore(tmp_path, task_id="run", session_id="second", lock_wait_s=30)
        assert time.monotonic() - start < 5  # refused at once, not after lock_wait_s
        text = str(exc.value)
        assert f"pid {first.pid} on host {socket.gethostname()}, session first, since " in text
        assert "which is running" in text and "give this run its own task_id" in text
        with pytest.raises(StoreLockedError, match="takeover=True never replaces a running holder"):
            CheckpointStore(tmp_path, task_id="run", session_id="second", takeover=True)
        # Readers never take the lock: the writer process, other ranks, tools.
        for kw in ({"cleanup": False}, {"read_only": True}, {"rank": 1, "world_size": 2}):
            CheckpointStore(tmp_path, task_id="run", session_id="reader", **kw).close()  # type: ignore[arg-type]
        _finish(first)
    finally:
        first.kill()
        first.wait()
    store = CheckpointStore(tmp_path, task_id="run", session_id="second")  # the holder released it
    assert [i.step for i in store.list()] == [2, 1]
    for step in (1, 2):
        assert store.verify(step) == []
        assert torch.equal(store.load(step).weights["w"], tiny_state(step).weights["w"])
    store.close()


def test_a_killed_holder_is_taken_over_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, _ = _holder(tmp_path, "wait")
    first.send_signal(signal.SIGKILL)
    first.wait()
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt.store.lock"):
        store = CheckpointStore(tmp_path, task_id="run", session_id="next")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert f"took the writer lock over from pid {first.pid} on host {socket.gethostname()}, session first" in lines[0]
    assert lines[0].endswith("which ended without releasing it (killed or crashed)")
    assert [i.step for i in store.list()] == [1]
    store.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt.store.lock"):  # released cleanly: no warning
        CheckpointStore(tmp_path, task_id="run", session_id="after").close()
    assert caplog.records == []


def test_an_orphaned_child_of_a_dead_holder_cannot_block_the_restart(tmp_path: Path) -> None:
    """POSIX record locks are not inherited by fork(): a data-loader worker that outlives the holder holds nothing.

    (With flock, which the child's copy of the open file description keeps, this restart was refused.)"""
    first, orphan_pid = _holder(tmp_path, "orphan")
    first.wait()
    assert orphan_pid is not None
    try:
        os.kill(orphan_pid, 0)  # the orphan is alive and has the lock file open
        assert any(os.path.realpath(f"/proc/{orphan_pid}/fd/{fd}") == str(tmp_path / "run" / ".writer.lock")
                   for fd in os.listdir(f"/proc/{orphan_pid}/fd"))
        inode = (tmp_path / "run" / ".writer.lock").stat().st_ino
        start = time.monotonic()
        second = CheckpointStore(tmp_path, task_id="run", session_id="second")
        assert time.monotonic() - start < 5
        assert read_holder(tmp_path / "run")["session"] == "second"  # type: ignore[index]
        # Locked in place: the orphan held nothing, so no replacement lock file was needed.
        assert (tmp_path / "run" / ".writer.lock").stat().st_ino == inode
        second.close()
    finally:
        os.kill(orphan_pid, signal.SIGKILL)  # the child this test started, by its pid


PROBE = """
import sys
from hf_dynamic_ckpt.errors import StoreLockedError
from hf_dynamic_ckpt.store import CheckpointStore
try:
    CheckpointStore(sys.argv[1], task_id="run", session_id="other", lock_wait_s=0)
except StoreLockedError as e:
    print("refused:", e)
"""


def _refused_by_another_process(root: Path) -> str:
    probe = subprocess.run([sys.executable, "-c", PROBE, str(root)], capture_output=True, text=True, timeout=120)
    return probe.stdout


def test_a_second_writer_of_this_process_is_refused_while_the_first_is_open(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    first = CheckpointStore(tmp_path, task_id="run", session_id="first")
    save_state(first, tiny_state(1), reason="first")
    with pytest.raises(StoreLockedError) as exc:
        CheckpointStore(tmp_path, task_id="run", session_id="second")
    assert str(exc.value) == (
        f"task 'run' under {tmp_path} is being written by this process already (session first); close that writer "
        "first (RunOrchestrator.close(), or the end of its training run). A new Trainer callback or "
        "SmartCheckpointer of this process closes an earlier run on the task itself.")
    # The refused attempt changed nothing: the first writer still holds the lock and saves.
    assert read_holder(tmp_path / "run")["session"] == "first"  # type: ignore[index]
    assert save_state(first, tiny_state(2), reason="first") is not None
    # A maintenance call of the same process is refused the same way; it does not close the run.
    reader = CheckpointStore(tmp_path, task_id="run", session_id="tool", cleanup=False)
    with pytest.raises(StoreLockedError, match=r"being written by this process already \(session first\)"):
        reader.gc()
    reader.close()
    assert read_holder(tmp_path / "run")["session"] == "first"  # type: ignore[index]
    first.close()
    second = CheckpointStore(tmp_path, task_id="run", session_id="second")  # released: taken
    assert [i.step for i in second.list()] == [2, 1]
    # A writer dropped without close() (an exception unwound its owner) does not keep the lock from the next one.
    del second
    gc.collect()
    with caplog.at_level(logging.INFO, logger="hf_dynamic_ckpt.store.lock"):
        third = CheckpointStore(tmp_path, task_id="run", session_id="third")
    assert [r.levelno for r in caplog.records if r.levelno >= logging.INFO] == []
    assert read_holder(tmp_path / "run")["session"] == "third"  # type: ignore[index]
    assert "refused: task 'run' under" in _refused_by_another_process(tmp_path)
    third.close()


def test_a_new_run_of_this_process_closes_the_earlier_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    config = SmartCkptConfig(root=str(root), task_id="run", base_interval=1, engine="sync")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = RunOrchestrator(config)
    first.attach(model, optimizer=opt)
    for step in (1, 2):
        model(torch.ones(2, 4)).sum().backward()
        first.pre_update(step - 1)
        opt.step()
        opt.zero_grad()
        first.step_end(step, epoch=0.0)
    with caplog.at_level(logging.INFO, logger="hf_dynamic_ckpt.run.orchestrator"):
        second = RunOrchestrator(config)  # a notebook cell re-run after the first cell raised
    assert first.closed and not second.closed
    lines = [r.getMessage() for r in caplog.records if "this process" in r.getMessage()]
    assert lines == [f"task 'run' under {root}: this process already runs on it (session {first.session_id}); that "
                     f"run is closed first (its writes in flight commit) and session {second.session_id} takes over"]
    assert [i.step for i in second.store.list()] == [2, 1]  # the first run's writes committed before it closed
    assert read_holder(root / "run")["session"] == second.session_id  # type: ignore[index]
    refused = f"refused: task 'run' under {root} is being written by another session: pid {os.getpid()}"
    assert refused in _refused_by_another_process(root)
    second.close()
    assert RunOrchestrator(config).session_id  # released: taken without closing anything


def test_a_run_dropped_without_close_is_closed_by_the_next_run_of_this_process(tmp_path: Path) -> None:
    # The default engine (a writer process) and memory tier: the run is dropped without close() (an exception unwound
    # the loop that owned it). The next run of this process closes what the dropped one still held: its writes
    # commit, its writer process ends, its memory slots go, and the lock passes.
    import multiprocessing

    root = tmp_path / "store"
    config = SmartCkptConfig(root=str(root), task_id="run", base_interval=2)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = RunOrchestrator(config)
    first.attach(model, optimizer=opt)
    first.start_writer()
    for step in (1, 2, 3):
        model(torch.ones(2, 4)).sum().backward()
        first.pre_update(step - 1)
        opt.step()
        opt.zero_grad()
        first.step_end(step, epoch=0.0)
    session, dropped, slots = first.session_id, weakref.ref(first), slots_dir(root, "run")
    assert multiprocessing.active_children() and list(slots.glob("run/step-*"))  # its writer process, its slots
    del first
    gc.collect()
    assert dropped() is None
    second = RunOrchestrator(config)
    assert multiprocessing.active_children() == [] and not list(slots.glob("run/step-*"))  # closed, its slots gone
    assert 2 in [i.step for i in second.store.list()]  # its disk save committed
    assert read_holder(root / "run")["session"] == second.session_id != session  # type: ignore[index]
    second.close()


def test_a_holder_on_another_host_is_waited_for_then_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, _ = _holder(tmp_path, "host=gpu-node-7")
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt.store.lock"), \
                pytest.raises(StoreLockedError) as exc:
            CheckpointStore(tmp_path, task_id="run", session_id="second", lock_wait_s=1.5)
        waited = time.monotonic() - start
        assert 1.5 <= waited < 10
        text = str(exc.value)
        assert f"pid {first.pid} on host gpu-node-7, session first" in text
        assert "which this host cannot see (another host or container)" in text
        assert "pass takeover=True (CheckpointStore) to replace it now" in text and "raise runtime.lock_wait_s" in text
        progress = caplog.records[0].getMessage()
        assert "the writer lock is held by pid" in progress and "waiting up to 1.5 s" in progress
        # When the other host's run ends while we wait, the wait ends with the lock.
        assert first.stdin is not None
        first.stdin.write("go\n")
        first.stdin.flush()
        second = CheckpointStore(tmp_path, task_id="run", session_id="second", lock_wait_s=60)
        assert [i.step for i in second.list()] == [2, 1]
        second.close()
    finally:
        first.kill()
        first.wait()


def test_holder_states() -> None:
    here = {"host": "h", "boot": "b1", "pidns": "pid:[1]"}
    me = {"pid": os.getpid(), "host": "h", "boot": "b1", "pidns": "pid:[1]"}
    assert judge(me, here) is HolderState.ALIVE
    assert judge({**me, "host": "other"}, here) is HolderState.UNKNOWN
    assert judge({**me, "pidns": "pid:[2]"}, here) is HolderState.UNKNOWN
    assert judge({**me, "boot": "b0"}, here) is HolderState.GONE  # recorded before a reboot
    assert judge({**me, "start": "1"}, here) is HolderState.GONE  # the pid now belongs to another process
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert judge({**me, "pid": dead.pid}, here) is HolderState.GONE
    assert judge(None, here) is HolderState.UNKNOWN and judge({"pid": "1", "host": "h"}, here) is HolderState.UNKNOWN
    assert judge({"pid": os.getpid(), **this_host()}) is HolderState.ALIVE


def test_takeover_replaces_a_holder_of_another_host_without_waiting(tmp_path: Path) -> None:
    first, _ = _holder(tmp_path, "host=gpu-node-7")
    try:
        start = time.monotonic()
        second = CheckpointStore(tmp_path, task_id="run", session_id="second", takeover=True, lock_wait_s=60)
        assert time.monotonic() - start < 5
        assert read_holder(tmp_path / "run")["session"] == "second"  # type: ignore[index]
        second.close()
    finally:
        first.kill()
        first.wait()


def test_a_fresh_run_never_reports_another_sessions_checkpoint_as_its_save(tmp_path: Path) -> None:
    old = CheckpointStore(tmp_path, task_id="run", session_id="old")
    for step in (2, 4):
        save_state(old, tiny_state(step), reason="old run")
    old.close()
    new = CheckpointStore(tmp_path, task_id="run", session_id="new")
    state = tiny_state(1000 + 2)
    state.step = 2
    info = new.save(state, SaveRequest(step=2, reason="new run", lineage=Lineage(session="new", timeline="t-new")))
    assert info is not None and info.reason == "new run" and info.lineage == Lineage(session="new", timeline="t-new")
    assert torch.equal(new.load("step:2").weights["w"], state.weights["w"])
    new.close()


def test_lock_file_names_the_holder(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run", session_id="me")
    holder = read_holder(tmp_path / "run")  # through the held descriptor: opening the file again would drop the lock
    assert holder is not None
    assert (holder["pid"], holder["host"], holder["session"]) == (os.getpid(), socket.gethostname(), "me")
    assert holder["boot"] == this_host()["boot"] and abs(holder["since"] - time.time()) < 600
    store.close()
    released = json.loads((tmp_path / "run" / ".writer.lock").read_text())
    assert released["session"] == "me" and released["released"] >= holder["since"]

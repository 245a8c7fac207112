"""One writer per task: a second live writer is refused, naming the holder; no save is lost.

Issue 10, failure 4: a second live session only logged a warning, and a save of a step the
other session had committed was reported as this run's success: two concurrent runs
interleaved their checkpoints, and a fresh run on a used task reported saves 2-8 "ok"
while every directory belonged to the old run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from store_helpers import tiny_state

from hf_dynamic_ckpt.errors import StoreLockedError
from hf_dynamic_ckpt.store import CheckpointStore, Lineage, SaveRequest

HOLDER = """
import os, sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[3])
from store_helpers import tiny_state
from hf_dynamic_ckpt.store import CheckpointStore
store = CheckpointStore(sys.argv[1], task_id="run", session_id="first")
store.save(tiny_state(1), reason="first")
if sys.argv[2] == "orphan":  # a child inherits the locked file, then the holder dies
    child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(f"ready {child}", flush=True)
    os._exit(0)
print("ready", flush=True)
sys.stdin.readline()  # go on when the test says so
store.save(tiny_state(2), reason="first")
store.close()
print("done", flush=True)
"""


def _holder(root: Path, mode: str) -> tuple[subprocess.Popen[str], int | None]:
    """The first writer, and (mode "orphan") the pid of the child that inherited its lock."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(root), mode, str(Path(__file__).parent)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["ready"], line
    return proc, int(line[1]) if len(line) > 1 else None


def test_a_second_live_writer_is_refused_and_no_save_is_lost(tmp_path: Path) -> None:
    first, _ = _holder(tmp_path, "wait")
    try:
        with pytest.raises(StoreLockedError) as exc:
            CheckpointStore(tmp_path, task_id="run", session_id="second")
        text = str(exc.value)
        assert f"pid {first.pid} on host {socket.gethostname()}, session first, since " in text
        assert "give this run its own task_id" in text
        with pytest.raises(StoreLockedError, match="takeover=True never replaces a running holder"):
            CheckpointStore(tmp_path, task_id="run", session_id="second", takeover=True)
        # Readers never take the lock: the writer process, other ranks, tools.
        for kw in ({"cleanup": False}, {"read_only": True}, {"rank": 1, "world_size": 2}):
            CheckpointStore(tmp_path, task_id="run", session_id="reader", **kw).close()  # type: ignore[arg-type]
        assert first.stdin is not None
        first.stdin.write("go\n")
        first.stdin.flush()
        assert first.stdout is not None and first.stdout.readline().strip() == "done"
    finally:
        first.kill()
        first.wait()
    store = CheckpointStore(tmp_path, task_id="run", session_id="second")  # the holder is gone: free
    assert [i.step for i in store.list()] == [2, 1]
    for step in (1, 2):
        assert store.verify(step) == []
        assert torch.equal(store.load(step).weights["w"], tiny_state(step).weights["w"])
    store.close()


def test_a_killed_holder_frees_the_task(tmp_path: Path) -> None:
    first, _ = _holder(tmp_path, "wait")
    first.send_signal(signal.SIGKILL)
    first.wait()
    store = CheckpointStore(tmp_path, task_id="run", session_id="next")
    assert [i.step for i in store.list()] == [1]
    store.close()


def test_takeover_when_the_holder_is_gone_but_a_child_kept_the_lock(tmp_path: Path) -> None:
    first, orphan_pid = _holder(tmp_path, "orphan")
    first.wait()
    assert orphan_pid is not None
    orphan = json.loads((tmp_path / "run" / ".writer.lock").read_text())["pid"]
    assert orphan == first.pid
    try:
        with pytest.raises(StoreLockedError, match=r"that process is no longer running.*pass takeover=True once it is gone"):
            CheckpointStore(tmp_path, task_id="run", session_id="second")
        second = CheckpointStore(tmp_path, task_id="run", session_id="second", takeover=True)
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()} on host .*, session second, since"):
            CheckpointStore(tmp_path, task_id="run", session_id="third")
        second.close()
    finally:
        os.kill(orphan_pid, signal.SIGKILL)  # the child this test started, by its pid
    third = CheckpointStore(tmp_path, task_id="run", session_id="third")
    third.close()


def test_a_fresh_run_never_reports_another_sessions_checkpoint_as_its_save(tmp_path: Path) -> None:
    old = CheckpointStore(tmp_path, task_id="run", session_id="old")
    for step in (2, 4):
        old.save(tiny_state(step), reason="old run")
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
    holder = json.loads((tmp_path / "run" / ".writer.lock").read_text())
    assert (holder["pid"], holder["host"], holder["session"]) == (os.getpid(), socket.gethostname(), "me")
    assert abs(holder["since"] - time.time()) < 600
    store.close()

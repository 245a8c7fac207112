"""Helper of test_replace_commit_crash.py: SIGKILL a replace-commit at every filesystem operation.

    python tests/reliability/replace_runner.py TEMPLATE SNAPSHOTS

Builds TEMPLATE (steps 1 and 2 committed by one session), then counts the filesystem
operations (mkdir, rename, replace, unlink, rmtree, fsync: the store's ``fs`` fault point) that
another session's save of step 2 with new content performs (a replace-commit). For every k in
1..N it copies TEMPLATE to ``SNAPSHOTS/trial-<k>``, forks a child that opens the copy and
replaces step 2 with ``HF_DYNAMIC_CKPT_FAULT=fs@nth=<k>:kill``, which SIGKILLs it right before its
k-th operation. Prints one JSON line of facts. Forking a process that has only imported torch (no
threads, no open store) is safe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: store_helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from store_helpers import tiny_state

from hf_dynamic_ckpt.errors import FAULT_ENV
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest

TASK = "run"


def old_state(step: int):  # type: ignore[no-untyped-def]
    return tiny_state(step, frozen=1.0)


def new_state(step: int):  # type: ignore[no-untyped-def]
    """What the second session saves at `step`: other weights, another blob."""
    return dataclasses.replace(tiny_state(100 + step, frozen=2.0), step=step)


def _child(root: Path, kill_at: int, log: Path) -> None:
    try:
        torch.set_num_threads(1)
        store = CheckpointStore(root, task_id=TASK, session_id="new", compression_threads=1)
        os.environ[FAULT_ENV] = f"fs:log={log}" if kill_at < 0 else f"fs@nth={kill_at}:kill"
        store.save(new_state(2), SaveRequest(step=2, reason="replacing"), replace=True)
        os._exit(0)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(3)


def _run(root: Path, kill_at: int) -> tuple[bool, int | None]:
    log = Path(tempfile.mkdtemp()) / "fs.jsonl"
    pid = os.fork()
    if pid == 0:
        _child(root, kill_at, log)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if not killed and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        raise SystemExit(f"trial child failed with status {status}")
    return killed, len(log.read_text().splitlines()) if log.exists() else None


def main() -> None:
    template, snapshots = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    store = CheckpointStore(template, task_id=TASK, session_id="old", compression_threads=1)
    for step in (1, 2):
        store.save(old_state(step), SaveRequest(step=step, reason="original"))
    store.close()
    dry = snapshots / "dry"
    shutil.copytree(template, dry)
    killed, total = _run(dry, kill_at=-1)
    assert not killed and total, "the dry run must complete and count its operations"
    facts = {"operations": total, "trials": []}
    for k in range(1, total + 1):
        trial = snapshots / f"trial-{k}"
        shutil.copytree(template, trial)
        killed, _ = _run(trial, kill_at=k)
        facts["trials"].append({"k": k, "killed": killed})
    print(json.dumps(facts))


if __name__ == "__main__":
    main()

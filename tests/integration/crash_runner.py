"""Helper of test_crash_consistency.py: SIGKILL a saving process at seeded random moments.

    python tests/integration/crash_runner.py ROOT SNAPSHOTS TRIALS SEED

Imports torch once, then per trial forks a child that opens the store (cleaning up what the
previous victim left) and saves checkpoints in a loop (and deletes old ones, which
reads back), kills it with SIGKILL after a random delay (on even trials counted from
the victim's first commit, so the store surely grows), and copies the store to
``SNAPSHOTS/trial-<k>`` for the test to inspect. Prints one JSON line with per-trial facts.
Forking a process that has only imported torch (no threads, no open store) is safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, SaveRequest, frozen_record

TASK = "crash"
KEEP = 4


def expected_state(step: int) -> CheckpointState:
    """The state saved at `step`: a pure function of the step, so a test can recompute it."""
    g = torch.Generator().manual_seed(step)
    weights = {"w": torch.randn(64, 64, generator=g)}
    optimizer = {"state": {0: {"exp_avg": torch.randn(64, 64, generator=g), "step": torch.tensor(float(step))}},
                 "param_groups": [{"lr": 0.1, "params": [0]}]}
    frozen = {"frozen": frozen_record(torch.full((512,), float(step // 5)))}
    return CheckpointState(step=step, weights=weights, frozen=frozen, optimizer=optimizer,
                           scheduler={"last_epoch": step}, rng={"s": step}, sampler={"batches": step})


def _child(root: Path, ready_fd: int) -> None:
    try:
        torch.set_num_threads(1)
        store = CheckpointStore(root, task_id=TASK, compression_threads=1)
        steps = [i.step for i in store.list(include_unhealthy=True)]
        step = max(steps, default=0) + 1
        while True:
            store.save(expected_state(step), SaveRequest(step=step, reason="interval", signals={"loss": 1.0 / step}))
            if ready_fd >= 0:  # tell the parent that this victim committed something
                with contextlib.suppress(BrokenPipeError):  # odd trials do not listen
                    os.write(ready_fd, b"x")
                os.close(ready_fd)
                ready_fd = -1
            for old in [i.step for i in store.list()][KEEP:]:
                store.delete(old)
            step += 1
    except BaseException:
        traceback.print_exc()
        os._exit(3)


def main() -> None:
    root, snapshots, trials, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    import safetensors.torch  # noqa: F401
    import zstandard  # noqa: F401

    expected_state(1)  # imports what a save needs (zstandard, safetensors, xxhash) before forking
    rng = random.Random(seed)
    facts = []
    for k in range(trials):
        delay = rng.uniform(0.0, 0.3)
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child(root, write_fd)
        os.close(write_fd)
        if k % 2 == 0:  # even trials: the delay starts after the victim's first commit
            ready, _, _ = select.select([read_fd], [], [], 120.0)
            assert ready and os.read(read_fd, 1) == b"x", "the saving process never committed"
        os.close(read_fd)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        shutil.copytree(root, snapshots / f"trial-{k}")
        facts.append({"trial": k, "delay": round(delay, 4), "killed": killed,
                      "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None})
    print(json.dumps(facts))


if __name__ == "__main__":
    main()

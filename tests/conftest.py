from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Subprocesses started by tests (torchrun workers, crash runners, the demo) import the
# package of this checkout, not whichever copy an editable install points at.
_REPO = str(Path(__file__).resolve().parents[1])
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != _REPO:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # One intra-op thread keeps CPU float results reproducible across runs on any machine.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(autouse=True, scope="session")
def _memory_tier_slots_of_this_session():
    # Runs killed by a test keep their memory-tier slots in /dev/shm for a restart that some tests never make; the
    # slots this session created go with it (those that were there before it stay).
    from hf_dynamic_ckpt.store.slots import SHM_DIR, SHM_PREFIX

    base = Path(SHM_DIR) / f"{SHM_PREFIX}{os.getuid()}"
    before = set(os.listdir(base)) if base.is_dir() else set()
    yield
    import shutil

    for name in (set(os.listdir(base)) if base.is_dir() else set()) - before:
        if not _held(base / name):  # a live run's (another process: a benchmark, a second pytest) stays
            shutil.rmtree(base / name, ignore_errors=True)


def _held(slots: Path) -> bool:
    """Whether a live process holds the writer lock of a task in the slots' directory `slots`."""
    import fcntl

    from hf_dynamic_ckpt.constants import WRITER_LOCK_NAME

    for lock in slots.glob(f"*/{WRITER_LOCK_NAME}"):
        try:
            with open(lock, "rb+") as f:
                fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held
            return True
        except OSError:
            continue
    return False

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
def _memory_tier_slots_of_this_session(tmp_path_factory: pytest.TempPathFactory):
    # Runs killed by a test keep their memory-tier slots in /dev/shm for a restart that some tests never make; the
    # slots of this session's stores (under its base temporary directory) go with it, once no live process holds
    # them. Never another session's: a second pytest (or a script) may have killed a run and be about to restart it.
    from hf_dynamic_ckpt.store.slots import slots_dir

    yield
    import shutil

    for catalog in tmp_path_factory.getbasetemp().rglob("catalog.db"):
        for task in (p for p in catalog.parent.iterdir() if p.is_dir() and not p.name.startswith(".")):
            slots = slots_dir(catalog.parent, task.name)
            if slots.is_dir() and not _held(slots):
                shutil.rmtree(slots, ignore_errors=True)


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

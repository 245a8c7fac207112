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
        shutil.rmtree(base / name, ignore_errors=True)

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

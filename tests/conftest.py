from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # One intra-op thread keeps CPU float results reproducible across runs on any machine.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)

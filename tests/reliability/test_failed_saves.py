"""A failed save is visible and treated the same wherever it falls in a run.

The failure it guards: a failed save in the middle of a run only logged, while a failure of the
last save made `train()` raise. Every failed save gives one WARNING with its cause and counts in
`smart_ckpt/failed_saves`; `on_save_error` decides, for all of them alike,
whether the run continues (`warn`, the default) or stops at the next step (`raise`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_dynamic_ckpt import SaveError, SmartCkptConfig
from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.lin(x).pow(2).mean()}


def _run(tmp_path: Path, fail_steps: set[int], steps: int, **cfg: object) -> tuple[RunOrchestrator, list[int]]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = SmartCkptConfig(root=str(tmp_path / "store"), base_interval=2, engine="sync", **cfg)  # type: ignore[arg-type]
    ck = RunOrchestrator(config)
    ck.attach(model, optimizer=opt)
    real_save = ck.store.save

    def flaky_save(state, *args, **kwargs):  # type: ignore[no-untyped-def]
        if state.step in fail_steps:
            raise OSError(28, "No space left on device")
        return real_save(state, *args, **kwargs)

    ck.store.save = flaky_save  # type: ignore[method-assign]
    done = []
    for step in range(steps):
        model(torch.randn(2, 4))["loss"].backward()
        ck.pre_update(step)
        opt.step()
        opt.zero_grad()
        ck.step_end(step + 1, 0.0)
        done.append(step + 1)
    return ck, done


def test_a_failing_middle_save_is_counted_warned_and_training_continues(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt"):
        ck, done = _run(tmp_path, {4}, 8)
        ck.finish()
    assert done == list(range(1, 9))
    failed = [r.getMessage() for r in caplog.records if "save of step 4" in r.getMessage()]
    assert len(failed) == 1 and "No space left on device" in failed[0] and failed[0].startswith("save of step 4 (")
    assert ck.metrics()["smart_ckpt/failed_saves"] == 1.0
    assert [i.step for i in ck.store.list()] == [8, 6, 2]  # the others committed; 4 never appeared
    ck.close()


def test_the_last_save_failing_behaves_like_any_other(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt"):
        ck, _ = _run(tmp_path, {8}, 8)
        ck.finish()  # warn: no exception for the last save either
        ck.close()
    assert len([r for r in caplog.records if "save of step 8" in r.getMessage()]) == 1
    assert ck.metrics()["smart_ckpt/failed_saves"] == 1.0


def test_on_save_error_raise_stops_at_the_next_step(tmp_path: Path) -> None:
    with pytest.raises(SaveError, match="No space left on device"):
        _run(tmp_path, {4}, 8, on_save_error="raise")


def test_on_save_error_raise_also_raises_for_the_last_save(tmp_path: Path) -> None:
    ck, _ = _run(tmp_path, {8}, 8, on_save_error="raise")
    with pytest.raises(SaveError, match="No space left on device"):
        ck.finish()
    ck.close()

"""The Accelerate state hooks beside what users already have: plain Accelerate folders, a model without an
optimizer, Accelerate's own folder rotation (`total_limit`), and save / load pre-hooks of their own."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

from hf_dynamic_ckpt import CheckpointStore, SmartCkptConfig
from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.integrations.accelerate import POINTER_NAME, SmartStateHooks

pytestmark = pytest.mark.integration


def _linear(accelerator, *, optimizer: bool = True):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    if not optimizer:
        return accelerator.prepare(model), None
    return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))


def _step(model, optimizer) -> None:  # type: ignore[no-untyped-def]
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_folder_saved_by_plain_accelerate_loads_as_accelerate_loads_it(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = _linear(accelerator)
    _step(model, optimizer)
    accelerator.save_state(str(tmp_path / "plain"))  # before the hooks exist: Accelerate's own files
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    hooks = SmartStateHooks(accelerator, config=SmartCkptConfig(root=str(tmp_path / "store")))
    hooks.register()
    _step(model, optimizer)
    with caplog.at_level(logging.INFO, logger="hf_dynamic_ckpt"):
        accelerator.load_state(str(tmp_path / "plain"))
    hooks.close()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved_moment)
    assert hooks.last_loaded is None
    notes = [r.getMessage() for r in caplog.records if r.name.startswith("hf_dynamic_ckpt")]
    assert notes == [f"load_state({tmp_path / 'plain'}): no {POINTER_NAME} and not a store checkpoint (a folder saved "
                     "without the store's hooks): Accelerate loads it as it would without them; the store "
                     f"{tmp_path / 'store'} is not involved"]
    assert not (tmp_path / "store" / "default").exists() or not list((tmp_path / "store" / "default").glob("step-*"))


def test_a_model_prepared_without_an_optimizer_saves_what_exists_and_resumes_it(tmp_path: Path) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, _ = _linear(accelerator, optimizer=False)
    hooks = SmartStateHooks(accelerator, config=SmartCkptConfig(root=str(tmp_path / "store")))
    hooks.register()
    accelerator.save_state(str(tmp_path / "state"))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing was lost: no "weights only" warning
        accelerator.load_state(str(tmp_path / "state"))
    hooks.close()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    loaded = hooks.last_loaded
    assert loaded is not None and loaded.info.tiers == frozenset({Tier.WEIGHTS, Tier.STATE})
    assert not loaded.warnings


@pytest.mark.parametrize("keep_last", [3, None])
def test_total_limit_bounds_the_saved_states_in_the_store_too(tmp_path: Path, keep_last: int | None) -> None:
    """A user who asked Accelerate for at most 2 saved states finds 2 in the store, whatever `keep_last` says: the
    checkpoints of rotated folders are unpinned and removed by retention (`keep_last` = `total_limit`)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True,
                                   total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=project)
    model, optimizer = _linear(accelerator)
    hooks = SmartStateHooks(accelerator, config=SmartCkptConfig(root=str(tmp_path / "store"), keep_last=keep_last))
    hooks.register()
    for _ in range(4):
        _step(model, optimizer)
        accelerator.save_state()
    hooks.close()
    folders = sorted(p.name for p in (tmp_path / "project" / "checkpoints").iterdir())
    assert folders == ["checkpoint_2", "checkpoint_3"]  # Accelerate's rotation
    named = sorted(json.loads((tmp_path / "project" / "checkpoints" / f / POINTER_NAME).read_text())["step"]
                   for f in folders)
    assert named == [3, 4]
    with CheckpointStore(tmp_path / "store", read_only=True) as store:
        kept = {i.step: i.pinned for i in store.list(include_unhealthy=True, include_abandoned=True)}
    # Steps 3 and 4 stay pinned for their folders; 1 and 2 became ordinary checkpoints, and retention removed them.
    assert kept == {3: True, 4: True}
    assert sorted(p.name for p in (tmp_path / "store" / "default").glob("step-*")) == ["step-3", "step-4"]


def test_a_folder_whose_pointer_cannot_be_read_keeps_every_checkpoint_pinned(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A rotated folder's checkpoint is unpinned only when every remaining folder says which step it holds: one whose
    pointer cannot be read (edited by hand, cut by a full disk) might name any of them."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True,
                                   total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=project)
    model, optimizer = _linear(accelerator)
    hooks = SmartStateHooks(accelerator, config=SmartCkptConfig(root=str(tmp_path / "store"), keep_last=1))
    hooks.register()
    for _ in range(2):
        _step(model, optimizer)
        accelerator.save_state()
    damaged = tmp_path / "project" / "checkpoints" / "checkpoint_1" / POINTER_NAME
    damaged.write_text('{"root": ', encoding="utf-8")
    _step(model, optimizer)
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt"):
        accelerator.save_state()  # Accelerate rotates checkpoint_0 away
    hooks.close()
    with CheckpointStore(tmp_path / "store", read_only=True) as store:
        kept = {i.step: i.pinned for i in store.list(include_unhealthy=True, include_abandoned=True)}
    assert kept == {1: True, 2: True, 3: True}
    assert [r.getMessage() for r in caplog.records if r.name.startswith("hf_dynamic_ckpt")] == [
        f"save_state: {damaged} cannot be read (Expecting value: line 1 column 10 (char 9)); no checkpoint is "
        "unpinned this time"]


@pytest.mark.parametrize("registered", ["before", "after"])
def test_other_pre_hooks_see_the_full_lists_whichever_was_registered_first(tmp_path: Path, registered: str) -> None:
    """Accelerate's documented hook pattern indexes `models[0]` / `weights[0]`: the store's pair always runs last."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    _linear(accelerator)
    seen: list[tuple[str, int]] = []

    def save_hook(models, weights, output_dir):  # type: ignore[no-untyped-def]
        seen.append(("save", len(weights)))
        assert weights[0]  # what the documented pattern does: an IndexError on an emptied list

    def load_hook(models, input_dir):  # type: ignore[no-untyped-def]
        seen.append(("load", len(models)))
        assert models[0] is not None

    hooks = SmartStateHooks(accelerator, config=SmartCkptConfig(root=str(tmp_path / "store")))
    if registered == "after":
        hooks.register()
    handles = [accelerator.register_save_state_pre_hook(save_hook), accelerator.register_load_state_pre_hook(load_hook)]
    if registered == "before":
        hooks.register()
    accelerator.save_state(str(tmp_path / "state"))
    accelerator.load_state(str(tmp_path / "state"))
    assert seen == [("save", 1), ("load", 1)]
    assert hooks.last_loaded is not None and hooks.last_loaded.info.step == 0
    assert not (tmp_path / "state" / "model.safetensors").exists()  # the store's hook still ran, last
    hooks.close()
    for handle in handles:
        handle.remove()
    assert "register_load_state_pre_hook" not in vars(accelerator)  # close() leaves the accelerator as it was

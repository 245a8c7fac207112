"""Restore with fallback: every kind of damage gives its documented outcome, never wrong tensors."""

from __future__ import annotations

import gc
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import same_state, save_state
from store_helpers import file_checksum, manifest_checksum

from hf_dynamic_ckpt.config import FallbackStrategy
from hf_dynamic_ckpt.constants import (
    MANIFEST_NAME,
    OPTIMIZER_META_NAME,
    OPTIMIZER_NAME,
    SAMPLER_NAME,
    WEIGHTS_NAME,
)
from hf_dynamic_ckpt.errors import (
    FAULT_ENV,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    FormatVersionError,
    IncompatibleStateError,
)
from hf_dynamic_ckpt.run.resume import plan_resume, read_optimizer_tier
from hf_dynamic_ckpt.state import check_weights
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, LoadedCheckpoint, frozen_record

FROZEN = "embed.weight"
FROZEN_VALUE = torch.arange(64, dtype=torch.float32).reshape(8, 8)
"""A weight that does not train: recorded by checksum, not written; the model holds it."""


def _state(step: int) -> CheckpointState:
    g = torch.Generator().manual_seed(step)
    weights = {"layer.weight": torch.randn(16, 8, generator=g), "layer.bias": torch.randn(16, generator=g)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(step)
        model = torch.nn.Linear(8, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(step):
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opt.step()
        sched.step()
    return CheckpointState(step=step, weights=weights, frozen={FROZEN: frozen_record(FROZEN_VALUE)},
                           optimizer=opt.state_dict(),
                           scheduler=sched.state_dict(), rng={"python": [step]}, sampler={"batches": step})


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    s = CheckpointStore(tmp_path / "root", task_id="run")
    for step in (1, 2):
        save_state(s, _state(step), reason="interval", signals={"loss": 1.0 / step})
    yield s
    s.close()


def _resume(store: CheckpointStore, spec: str, **kwargs: Any) -> LoadedCheckpoint:
    """This process's restore point as the run's resume chooses it (`plan_resume` on one rank)."""
    plan = plan_resume(store, spec, **kwargs)
    assert plan is not None
    return plan.loaded


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


def _file(store: CheckpointStore, kind: str) -> Path:
    return store.task_dir / "step-2" / kind


def _assert_exact(loaded: Any, step: int) -> None:
    """Whatever was handed out equals what was saved at that step."""
    expected = _state(step)
    weights = dict(loaded.weights)
    assert FROZEN not in weights or torch.equal(weights.pop(FROZEN), FROZEN_VALUE)  # the model's own, checked
    assert same_state(weights, expected.weights)
    if loaded.optimizer is not None:
        assert same_state(loaded.optimizer, expected.optimizer)
    if loaded.scheduler is not None:
        assert same_state(loaded.scheduler, expected.scheduler)
    if loaded.rng is not None:
        assert loaded.rng == expected.rng and loaded.sampler == expected.sampler


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize(
    ("kind", "outcome"),
    [
        (WEIGHTS_NAME, "older"),
        (MANIFEST_NAME, "older"),
        (OPTIMIZER_NAME, "weights_only_scheduler_kept"),
        (OPTIMIZER_META_NAME, "weights_only"),
        ("rng-rank0.json", "no_state"),
        (SAMPLER_NAME, "no_state"),
    ],
)
def test_damaged_file_gives_documented_outcome(store: CheckpointStore, kind: str, outcome: str, how: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    _damage(_file(store, kind), how)
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.run.resume")
    loaded = _resume(store, "auto")
    assert loaded.warnings and [r.getMessage() for r in caplog.records] == [f"resume: {w}" for w in loaded.warnings]
    if outcome == "older":
        assert loaded.info.step == 1
        assert loaded.warnings[0].startswith("weights of step 2 cannot be loaded (")
        assert loaded.warnings[0].endswith("falling back to the next older checkpoint: using step 1 instead")
        assert loaded.optimizer is not None and loaded.rng is not None
        _assert_exact(loaded, 1)
        return
    assert loaded.info.step == 2
    _assert_exact(loaded, 2)
    if outcome.startswith("weights_only"):
        assert loaded.optimizer is None and loaded.scaler is None
        assert loaded.warnings[0].startswith("resuming from weights only: optimizer state of step 2 is lost (")
        assert loaded.warnings[0].endswith("); the learning-rate schedule continues at step 2")
        assert (loaded.scheduler is not None) == (outcome == "weights_only_scheduler_kept")
        assert loaded.rng == {"python": [2]}
    else:
        assert loaded.rng is None and loaded.sampler is None and loaded.optimizer is not None
        assert loaded.warnings[0].startswith("RNG and data-loader state of step 2 cannot be loaded (")


def test_deleted_manifest_means_no_checkpoint(store: CheckpointStore) -> None:
    (store.task_dir / "step-2" / MANIFEST_NAME).unlink()
    loaded = _resume(store, "auto")
    assert loaded.info.step == 1 and loaded.warnings == []
    _assert_exact(loaded, 1)
    assert {i.step: i.status for i in store.list(include_unhealthy=True)} == {2: "missing", 1: "ok"}
    with pytest.raises(CheckpointNotFoundError, match="step 2 has no committed checkpoint"):
        _resume(store, "step:2")


def test_explicit_step_with_broken_weights_falls_back_too(store: CheckpointStore) -> None:
    _damage(_file(store, WEIGHTS_NAME), "flip")
    loaded = _resume(store, "step:2")
    assert loaded.info.step == 1


def test_level_0_1_moves_to_older_checkpoint_with_intact_optimizer(store: CheckpointStore) -> None:
    _damage(_file(store, OPTIMIZER_NAME), "flip")
    loaded = _resume(store, "auto", fallback=FallbackStrategy.LEVEL_0_1)
    assert loaded.info.step == 1 and loaded.optimizer is not None
    _assert_exact(loaded, 1)
    assert loaded.warnings[0].startswith("optimizer state of step 2 cannot be loaded (")
    assert loaded.warnings[0].endswith("fallback_strategy=level_0_1 requires it, falling back to the next older "
                                       "checkpoint: using step 1 instead")


def test_level_0_only_skips_optimizer(store: CheckpointStore) -> None:
    loaded = _resume(store, "auto", fallback="level_0_only")
    assert loaded.info.step == 2 and loaded.optimizer is None and loaded.scheduler is None
    assert loaded.rng == {"python": [2]} and loaded.warnings == []
    _assert_exact(loaded, 2)


def test_full_fallback_when_everything_is_intact(store: CheckpointStore) -> None:
    loaded = _resume(store, "best")
    assert loaded.info.step == 2 and loaded.warnings == []
    _assert_exact(loaded, 2)
    assert loaded.optimizer is not None and loaded.scheduler is not None


def test_checkpoint_without_optimizer_tier_warns(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run")
    save_state(store, CheckpointState(step=3, weights={"w": torch.ones(2)}, rng={"a": 1}), reason="memory")
    loaded = _resume(store, "auto")
    assert loaded.warnings == ["resuming from weights only: optimizer state of step 3 is lost (the checkpoint was "
                               "saved without it); the learning-rate schedule continues at step 3"]
    store.close()


def test_newer_format_is_an_error_not_a_fallback(store: CheckpointStore) -> None:
    import json

    path = store.task_dir / "step-2" / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 3
    manifest["manifest_checksum"] = manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatVersionError, match="format_version=3 is newer"):
        _resume(store, "auto")


def test_a_model_whose_frozen_weights_differ_is_an_error_not_a_fallback(store: CheckpointStore) -> None:
    # The frozen weight is recorded, not written: the model's own must be the one the run trained with.
    expected = {**_targets(), FROZEN: FROZEN_VALUE + 1}
    with pytest.raises(IncompatibleStateError, match=rf"frozen weights differ from those step 2 was trained with "
                                                      rf"\(it records them by checksum, not their values\): {FROZEN}"):
        _resume(store, "auto", expected=expected)
    loaded = _resume(store, "auto", expected={**_targets(), FROZEN: FROZEN_VALUE.clone()})
    assert loaded.info.step == 2 and torch.equal(loaded.weights[FROZEN], FROZEN_VALUE)


def _rename_l1_tensor(store: CheckpointStore) -> str:
    """Step 2's `optimizer.json` names a tensor its intact tensor file does not hold (found out after the decode)."""
    directory = store.task_dir / "step-2"
    path = directory / OPTIMIZER_META_NAME
    text = path.read_text()
    assert text.count('"optimizer/state/0/exp_avg"') == 1
    path.write_text(text.replace('"optimizer/state/0/exp_avg"', '"optimizer/state/0/exp_avg_x"'))
    manifest_path = directory / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][OPTIMIZER_META_NAME].update(size=path.stat().st_size, checksum=file_checksum(path))
    manifest["manifest_checksum"] = manifest_checksum(manifest)
    manifest_path.write_text(json.dumps(manifest))
    return "State structure refers to tensor 'optimizer/state/0/exp_avg_x', which the tensor file does not hold"


def _new_tensors(before: set[int]) -> list[torch.Tensor]:
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and id(o) not in before]


def test_a_failed_read_frees_what_it_decoded_before_the_retry_and_the_fallback(
        store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    why = _rename_l1_tensor(store)
    info = store.resolve("step:2")
    weights = len(_state(2).weights)  # an attempt's own weights, read before its optimizer tier
    gc.collect()
    gc.disable()  # what a failed read decoded must go by reference counting, not wait for a collection
    try:
        before = {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}
        gate = tmp_path / "gate"
        gate.mkdir()
        # Held at the retry's read of the optimizer tier: the first attempt's tensors must be gone by then.
        monkeypatch.setenv(FAULT_ENV, f"read@name={OPTIMIZER_NAME}@op=read@nth=2:gate={gate}")
        errors: list[BaseException] = []

        def load() -> None:
            try:
                store.load(info, mmap=False)
            except CorruptCheckpointError as e:
                errors.append(e)

        thread = threading.Thread(target=load)
        thread.start()
        while not (gate / "read.reached").exists():
            thread.join(0.01)
        held = len(_new_tensors(before))  # the retry's own weights, read before its optimizer tier
        (gate / "read.go").touch()
        thread.join(60)
        monkeypatch.delenv(FAULT_ENV)
        assert len(errors) == 1 and why in str(errors[0])
        errors.clear()  # the exception holds the frames of the failed read
        assert held == weights and _new_tensors(before) == []
        for resume in (lambda: read_optimizer_tier(store, info, 0, None),  # the resume's background read
                       lambda: plan_resume(store, "step:2", fallback=FallbackStrategy.FULL, mmap=False)):
            outcome = resume()
            assert outcome is not None
            del outcome
            assert _new_tensors(before) == []  # store.load's retry, then theirs: nothing of a failed read stays
    finally:
        gc.enable()


def test_check_weights_message_lists_every_kind_of_mismatch() -> None:
    saved = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "extra": torch.zeros(1)}
    expected = {"a": torch.zeros(2, 4), "b": torch.zeros(4), "c": torch.zeros(1), "d": torch.zeros(1)}
    with pytest.raises(IncompatibleStateError) as exc:
        check_weights(saved, expected)
    assert str(exc.value) == (
        "saved weights do not fit the model: missing from the checkpoint (2): c, d; "
        "unexpected in the checkpoint (1): extra; shape mismatch (1): a saved [2, 3] vs model [2, 4]. "
        "Resume with the model (and adapter) configuration the checkpoint was saved from."
    )
    check_weights({"b": torch.ones(4)}, {"b": torch.zeros(4)})  # same names and shapes: fine


def test_check_weights_truncates_long_lists() -> None:
    with pytest.raises(IncompatibleStateError) as exc:
        check_weights({}, {f"k{i:02d}": torch.zeros(1) for i in range(13)})
    assert ("missing from the checkpoint (13): k00, k01, k02, k03, k04, k05, k06, k07, k08, k09, ... and 3 more."
            in str(exc.value))
    assert "unexpected" not in str(exc.value)


def _targets() -> dict[str, torch.Tensor]:
    """A model's own tensors for the trainable weights of `_state` (the frozen one is the model's already)."""
    return {"layer.weight": torch.full((16, 8), -1.0), "layer.bias": torch.full((16,), -1.0)}


def test_into_reads_the_weights_file_once_into_the_targets_as_it_verifies_it(
        store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    log = store.root / "checked.jsonl"
    monkeypatch.setenv(FAULT_ENV, f"read@op=check:log={log}")
    targets = _targets()
    memory = {k: t.data_ptr() for k, t in targets.items()}
    loaded = _resume(store, "auto", into=targets)
    hashed = [json.loads(line)["name"] for line in log.read_text().splitlines()]
    assert loaded.info.step == 2 and WEIGHTS_NAME not in hashed  # no separate checksum pass over the file
    assert all(loaded.weights[k] is targets[k] and targets[k].data_ptr() == memory[k] for k in targets)
    _assert_exact(loaded, 2)


def test_into_a_candidate_that_fails_its_checksum_falls_back_and_the_targets_hold_the_older_weights(
        store: CheckpointStore) -> None:
    _damage(_file(store, WEIGHTS_NAME), "flip")
    targets = _targets()
    loaded = _resume(store, "auto", into=targets)
    assert loaded.info.step == 1
    assert loaded.warnings[0].startswith("weights of step 2 cannot be loaded (checkpoint ")
    assert "checksum mismatch" in loaded.warnings[0]
    assert all(loaded.weights[k] is targets[k] for k in targets)
    _assert_exact(loaded, 1)
    assert {i.step: i.status for i in store.list(include_unhealthy=True)} == {2: "corrupt", 1: "ok"}


def test_into_when_no_candidate_is_usable_the_error_says_the_targets_were_overwritten(
        store: CheckpointStore) -> None:
    for step in (1, 2):
        _damage(store.task_dir / f"step-{step}" / WEIGHTS_NAME, "flip")
    with pytest.raises(CheckpointNotFoundError, match=r"\(tried steps 2, 1\): .* or start fresh\. The model's "
                       r"weights were overwritten by this resume's reads \(they hold the bytes of a checkpoint "
                       r"that failed its checksum\): build the model again before training it\.$"):
        _resume(store, "step:2", into=_targets())


def test_into_weights_that_do_not_fit_the_model_leave_the_targets_untouched(store: CheckpointStore) -> None:
    targets = {"layer.weight": torch.full((16, 9), -1.0), "layer.bias": torch.full((16,), -1.0)}
    expected = {**targets, FROZEN: FROZEN_VALUE}
    with pytest.raises(IncompatibleStateError, match="shape mismatch"):
        _resume(store, "auto", into=targets, expected=expected)
    assert all(bool((t == -1).all()) for t in targets.values())


def _expected() -> dict[str, torch.Tensor]:
    return {**_targets(), FROZEN: FROZEN_VALUE}


def test_into_a_damaged_name_in_the_weights_header_is_a_corrupt_checkpoint_not_a_model_that_does_not_fit(
        store: CheckpointStore) -> None:
    path = _file(store, WEIGHTS_NAME)
    data = path.read_bytes()
    assert data.count(b'"layer.bias"') == 1
    path.write_bytes(data.replace(b'"layer.bias"', b'"layer.biat"'))  # parses; names a key the model lacks
    targets = _targets()
    loaded = _resume(store, "auto", into=targets, expected=_expected())
    assert loaded.info.step == 1 and "checksum mismatch" in loaded.warnings[0]
    _assert_exact(loaded, 1)
    assert {i.step: i.status for i in store.list(include_unhealthy=True)} == {2: "corrupt", 1: "ok"}


def test_into_a_read_that_fails_before_writing_leaves_the_targets_and_the_error_does_not_say_otherwise(
        store: CheckpointStore) -> None:
    # A checksum of an algorithm this library cannot compute: the read stops before its first byte lands.
    for step in (1, 2):
        path = store.task_dir / f"step-{step}" / MANIFEST_NAME
        manifest = json.loads(path.read_text())
        manifest["files"][WEIGHTS_NAME]["checksum"] = "sha3_999:00"
        manifest["manifest_checksum"] = manifest_checksum(manifest)
        path.write_text(json.dumps(manifest))
    targets = _targets()
    with pytest.raises(CheckpointNotFoundError, match=r"Unknown checksum algorithm 'sha3_999'") as e:
        _resume(store, "auto", into=targets)
    assert "overwritten" not in str(e.value)
    assert all(bool((t == -1).all()) for t in targets.values())


@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged_between_rounds"])
def test_into_a_rank_that_read_a_newer_candidate_of_another_ranks_list_reads_the_chosen_one_again(
        store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, damaged: bool) -> None:
    # This process is rank 1 of 2 and resumes `step:1`; rank 0 (a stand-in) listed steps 2 and 1, so rank 1 tries 2
    # in the second round: its weights go into the targets, but its RNG file is broken (with 2 ranks: unusable).
    # Step 1, usable in the first round, is read again before the findings are shared: intact, it is chosen and
    # the targets hold its weights; damaged meanwhile, that is a finding every rank sees (no rank goes on alone).
    import hf_dynamic_ckpt.run.resume as resume

    (store.task_dir / "step-2" / "rng-rank0.json").write_text("{")
    ok = {"usable": True, "reason": None, "optimizer_lost": None, "scheduler_salvaged": False}
    rounds = [[{"step": 2, **ok}], [{"step": 2, **ok}], [{"step": 2, **ok}, {"step": 1, **ok}]]
    mine: list[dict[int, bool]] = []

    def gather(report: dict[str, Any]) -> list[dict[str, Any]]:
        mine.append({int(r["step"]): r["usable"] for r in report["results"]})
        if damaged and len(mine) == 1:
            _damage(store.task_dir / "step-1" / WEIGHTS_NAME, "flip")
        other = {"fresh": False, "candidates": [2, 1], "error": None, "results": rounds[len(mine) - 1]}
        return [other, report]

    monkeypatch.setattr(resume.dist, "all_gather_json", gather)
    targets = _targets()
    if damaged:
        with pytest.raises(DistributedError, match=r"^resume: none of the checkpoints \[2, 1\] is usable on all 2 "
                                                   r"ranks .*step 1 is not complete on every rank: rank 1: weights of "
                                                   r"step 1 cannot be loaded \(.*checksum mismatch"):
            _resume(store, "step:1", into=targets, rank=1, world_size=2)
        assert mine[:2] == [{1: True}, {1: False, 2: False}]
        return
    loaded = _resume(store, "step:1", into=targets, rank=1, world_size=2)
    assert mine == [{1: True}, {1: True, 2: False}, {1: True, 2: False}]
    assert loaded.info.step == 1 and all(loaded.weights[k] is targets[k] for k in targets)
    _assert_exact(loaded, 1)

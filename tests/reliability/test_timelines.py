"""Timelines instead of deletion: resume never deletes, abandoned checkpoints stay restorable.

The failure it guards: a resume that deletes every checkpoint newer than the restore point,
pinned ones included, where a SIGKILL during that deletion leaves half a rollback after which
`auto` resumes the abandoned run. The store's answer is `fork`: one atomic record
marks them abandoned; `auto`/`best`/`fastest` skip them; `step:N` restores them; retention
and `gc` remove them only once the new timeline has committed past them, never pinned.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import save_state
from store_helpers import read_manifest_json, tiny_state

from hf_dynamic_ckpt.constants import TIMELINES_NAME, Tier
from hf_dynamic_ckpt.errors import FAULT_ENV, SaveError
from hf_dynamic_ckpt.store import CheckpointStore, Lineage, SaveRequest

T1 = Lineage(session="s1", timeline="t1")
T2 = Lineage(session="s2", timeline="t2", parent_step=4, parent_timeline="t1")


def _save(store: CheckpointStore, step: int, lineage: Lineage, *, seed: int = 0, **kw: object) -> None:
    state = dataclasses.replace(tiny_state(seed + step, frozen=float(seed)), step=step)
    store.save(state, SaveRequest(step=step, reason=f"{lineage.timeline}", lineage=lineage,
                                  signals={"loss": 1.0 / step}, **kw))  # type: ignore[arg-type]


@pytest.fixture
def forked(tmp_path: Path) -> CheckpointStore:
    """Timeline t1 saved 2..12 (12 pinned); a run resumed from step 4 forks t2."""
    store = CheckpointStore(tmp_path, task_id="run", session_id="s1")
    for step in range(2, 13, 2):
        _save(store, step, T1, pinned=step == 12)
    store.close()
    store = CheckpointStore(tmp_path, task_id="run", session_id="s2")
    assert store.fork(timeline="t2", after_step=4, session="s2", parent=T2) == [6, 8, 10, 12]
    yield store
    store.close()


def test_fork_marks_newer_checkpoints_abandoned_and_deletes_nothing(forked: CheckpointStore) -> None:
    store = forked
    assert sorted(p.name for p in store.task_dir.glob("step-*")) == [f"step-{s}" for s in (10, 12, 2, 4, 6, 8)]
    record = json.loads((store.task_dir / TIMELINES_NAME).read_text())
    assert record["current"]["timeline"] == "t2" and record["current"]["parent_step"] == 4
    assert [e["step"] for e in record["abandoned"]] == [6, 8, 10, 12]
    assert [i.step for i in store.list()] == [4, 2]
    assert [(i.step, i.abandoned) for i in store.list(include_abandoned=True)][:2] == [(12, True), (10, True)]
    for spec in ("auto", "best", "fastest"):
        assert store.resolve(spec).step in (2, 4)
    loaded = store.load("step:10")  # still restorable by name
    assert loaded.info.abandoned and torch.equal(loaded.weights["w"], tiny_state(10).weights["w"])


def test_a_save_of_an_abandoned_or_other_timeline_step_replaces_it(forked: CheckpointStore) -> None:
    store = forked
    _save(store, 6, T2, seed=100)
    info = store.resolve("step:6")
    assert not info.abandoned and info.lineage == T2 and info.reason == "t2"
    assert read_manifest_json(store.task_dir / "step-6")["lineage"] == T2.to_dict()
    assert torch.equal(store.load("step:6").weights["w"], tiny_state(106).weights["w"])
    _save(store, 6, T2, seed=200)  # the same timeline again: already committed, not rewritten
    assert torch.equal(store.load("step:6").weights["w"], tiny_state(106).weights["w"])
    assert store.resolve("auto").step == 6
    _save(store, 4, Lineage(session="s3", timeline="t3"), seed=300)  # another timeline's step 4: replaced
    assert store.resolve("step:4").lineage.timeline == "t3"


def test_abandoned_checkpoints_go_only_after_the_new_timeline_passes_them(forked: CheckpointStore) -> None:
    store = forked
    assert store.gc().abandoned == []  # t2 committed nothing yet
    _save(store, 6, T2, seed=100)
    _save(store, 9, T2, seed=100)
    report = store.gc(dry_run=True)
    assert report.abandoned == [8] and report.dry_run and report.bytes_freed > 0
    assert (store.task_dir / "step-8").exists()
    report = store.prune([])
    assert report.abandoned == [8] and not (store.task_dir / "step-8").exists()
    assert "step 12 kept: abandoned but pinned" in report.kept
    assert "step 10 kept: abandoned, the current timeline has not passed it yet" in report.kept
    for step in (11, 13):
        _save(store, step, T2, seed=100)
    assert store.gc().abandoned == [10]  # 12 is pinned: never
    store.unpin("step:12")
    assert store.gc().abandoned == [12]
    assert [i.step for i in store.list(include_abandoned=True)] == [13, 11, 9, 6, 4, 2]


def test_a_fresh_start_abandons_every_other_timeline_and_resuming_an_abandoned_step_revives_it(
        forked: CheckpointStore) -> None:
    store = forked
    assert store.fork(timeline="t3", after_step=None, session="s2") == [2, 4]
    assert store.list() == []
    parent = Lineage(session="s2", timeline="t4", parent_step=10, parent_timeline="t1")
    assert store.fork(timeline="t4", after_step=10, session="s2", parent=parent) == []
    assert [i.step for i in store.list()] == [10]  # the checkpoint t4 resumes from is usable again
    assert store.resolve("auto").step == 10


def test_a_crash_while_forking_leaves_the_old_record_or_the_new_one(forked: CheckpointStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = forked
    before = (store.task_dir / TIMELINES_NAME).read_bytes()
    monkeypatch.setenv(FAULT_ENV, "fs@op=replace:raise=EIO")  # a power cut before the rename
    with pytest.raises(OSError, match="injected"):
        store.fork(timeline="t9", after_step=None, session="s9")
    monkeypatch.delenv(FAULT_ENV)
    assert (store.task_dir / TIMELINES_NAME).read_bytes() == before
    assert not [p for p in store.task_dir.iterdir() if ".tmp-" in p.name]
    assert [i.step for i in store.list()] == [4, 2]


def test_save_request_reaches_the_manifest_unchanged(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run", session_id="s1")
    request = SaveRequest(step=3, epoch=0.5, tiers=frozenset({Tier.WEIGHTS}), reason="loss spike at step 3",
                          kind="risk", pinned=True, healthy=False, signals={"loss": float("nan")},
                          debug_info=({"step": 3, "loss": 2.0},), lineage=T1)
    info = store.save(tiny_state(3), request)
    manifest = read_manifest_json(Path(info.path))
    assert (manifest["reason"], manifest["kind"], manifest["pinned"], manifest["healthy"]) == (
        "loss spike at step 3", "risk", True, False)
    assert manifest["signals"] == {"loss": "NaN"} and manifest["debug_info"] == [{"step": 3, "loss": 2.0}]
    assert manifest["lineage"] == T1.to_dict() and info.lineage == T1
    assert info.frozen == {} and store.list(include_unhealthy=True)[0].lineage == T1
    with pytest.raises(SaveError, match=r"SaveRequest.step=4 differs from the state's step 3"):
        store.save(tiny_state(3), SaveRequest(step=4, reason="x"))
    store.close()


def test_info_frozen_records_come_from_the_manifest_everywhere(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run", session_id="s1")
    committed = save_state(store, tiny_state(1, frozen=3.0), reason="r")
    expected = read_manifest_json(Path(committed.path))["frozen"]
    assert dict(committed.frozen) == expected and set(expected) == {"frozen"}
    assert dict(store.list()[0].frozen) == expected and dict(store.resolve("step:1").frozen) == expected
    store.close()
    reopened = CheckpointStore(tmp_path, task_id="run", read_only=True)  # rebuilt from the manifests
    assert dict(reopened.list()[0].frozen) == expected
    reopened.close()

"""Retention between saves reads manifests only where they can change what it removes."""

from __future__ import annotations

import torch
from helpers import save_state

from hf_dynamic_ckpt.constants import BLOBS_DIR
from hf_dynamic_ckpt.policy import plan_retention
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore
from hf_dynamic_ckpt.store import manifest as mf


def _save(store: CheckpointStore, step: int, frozen: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(step)
    state = CheckpointState(step=step, epoch=0.0, weights={"w": torch.randn(4, 4, generator=g), "base": frozen},
                            dedup_keys=frozenset({"base"}))
    save_state(store, state, reason="interval")


def _count_reads(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = mf.read_manifest

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(mf, "read_manifest", counting)
    return calls


def test_a_prune_with_nothing_to_remove_reads_no_manifest(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        _save(store, step, torch.ones(8))
    calls = _count_reads(monkeypatch)
    report = store.prune(plan_retention(store.list(), keep_last=5, log_spaced=False, now=1e9))
    assert report.removed == [] and report.blobs == []
    assert calls == []  # before: every manifest twice (abandoned scan, blob users)
    store.close()


def test_a_prune_that_removes_a_checkpoint_still_collects_the_blob_it_alone_used(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    _save(store, 1, torch.ones(8))  # its frozen tensor differs from the later ones': a blob only step 1 uses
    _save(store, 2, torch.zeros(8))
    _save(store, 3, torch.zeros(8))
    before = {p.name for p in (store.task_dir / BLOBS_DIR).rglob("*") if p.is_file()}
    calls = _count_reads(monkeypatch)
    report = store.prune(plan_retention(store.list(), keep_last=2, log_spaced=False, now=1e9))
    assert report.removed == [1]
    after = {p.name for p in (store.task_dir / BLOBS_DIR).rglob("*") if p.is_file()}
    assert len(before) == 2 and len(before - after) == 1 and report.blobs
    assert len(calls) == 1 + 2  # step 1 re-read before its removal, then the two remaining users of blobs
    store.close()

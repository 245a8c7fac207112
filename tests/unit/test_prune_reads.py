"""Retention between saves reads manifests only where they can change what it removes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import save_state

from hf_dynamic_ckpt.errors import FAULT_ENV
from hf_dynamic_ckpt.policy import plan_retention
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore


def _save(store: CheckpointStore, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    save_state(store, CheckpointState(step=step, epoch=0.0, weights={"w": torch.randn(4, 4, generator=g)}),
               reason="interval")


def _manifest_reads(log: Path) -> list[int]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [int(d["step"]) for d in map(json.loads, lines) if d["name"] == "manifest.json"]


@pytest.mark.parametrize(("keep_last", "removed", "reads"), [(5, [], []), (2, [1], [1])])
def test_a_prune_reads_only_the_manifests_of_what_it_removes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             keep_last: int, removed: list[int],
                                                             reads: list[int]) -> None:
    store = CheckpointStore(tmp_path / "root")
    for step in (1, 2, 3):
        _save(store, step)
    plan = plan_retention(store.list(), keep_last=keep_last, log_spaced=False, now=1e9)
    log = tmp_path / "reads.jsonl"
    monkeypatch.setenv(FAULT_ENV, f"read:log={log}")
    report = store.prune(plan)
    assert report.removed == removed
    assert _manifest_reads(log) == reads  # each removed checkpoint re-read once before it goes; nothing else
    store.close()

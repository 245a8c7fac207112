"""A step retention removed is explained where a user looks for it: `hf-dynamic-ckpt ls` and the resume error."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from helpers import save_state

from hf_dynamic_ckpt.cli import main as cli
from hf_dynamic_ckpt.errors import CheckpointNotFoundError
from hf_dynamic_ckpt.policy import plan_retention
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore


def _store_with_removals(root: Path) -> CheckpointStore:
    store = CheckpointStore(root, task_id="run", session_id="s")
    for step in (4, 8, 12, 16, 20, 24, 25):
        save_state(store, CheckpointState(step=step, weights={"w": torch.full((4,), float(step))}), reason="interval")
    report = store.prune(plan_retention(store.list(include_unhealthy=True), keep_last=3, now=1e12))
    assert report.removed == [8, 16]
    return store


def test_the_resume_error_names_the_rule_that_removed_the_step(tmp_path: Path) -> None:
    store = _store_with_removals(tmp_path)
    with pytest.raises(CheckpointNotFoundError) as exc:
        store.resolve("step:8")
    assert str(exc.value) == (
        f"step 8 has no committed checkpoint in {tmp_path / 'run'} (retention removed it: keep_last=3 and log-spaced "
        "history (keep_log_spaced): one checkpoint per power-of-two age bucket is kept, and step 8 (17 steps behind "
        "step 25) shares its bucket with the older step 4; keep_last: null and null retention_days keep every "
        "checkpoint, or pin one); available steps of task 'run': 4, 12, 20, 24, 25.")
    with pytest.raises(CheckpointNotFoundError, match=r"^step 9 has no committed checkpoint in \S+; available"):
        store.resolve("step:9")  # never saved: no retention note
    store.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "removed.jsonl").read_text().splitlines()]
    assert [(x["step"], x["tiers"]) for x in lines] == [(8, ["weights"]), (16, ["weights"])]


def test_ls_names_the_rule_of_each_removal(tmp_path: Path) -> None:
    _store_with_removals(tmp_path).close()
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["ls", str(tmp_path)]) == 0
    text = out.getvalue()
    assert "removed by retention, each with the rule that removed it:\n" in text
    assert ("  run: step 8: keep_last=3 and log-spaced history (keep_log_spaced): one checkpoint per power-of-two "
            "age bucket is kept, and step 8 (17 steps behind step 25) shares its bucket with the older step 4") in text
    assert "  run: step 16: keep_last=3" in text

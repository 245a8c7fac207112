"""The manifest is the truth: the catalog indexes, it never decides alone.

The failures it guards: a `resolve` that trusts a row's `file_path` (a row for step 5 pointing
at `step-3` resumes step 3's data as step 5); `status`/`healthy` flags filtered on but never
re-read from disk (a stale flag hides the newest checkpoint); one transient read error making a
good checkpoint look corrupt.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from helpers import save_state
from store_helpers import tiny_state

from hf_dynamic_ckpt.constants import CATALOG_NAME, PINNED_MARKER, Tier
from hf_dynamic_ckpt.errors import FAULT_ENV, CorruptCheckpointError
from hf_dynamic_ckpt.store import CheckpointStore, Removal


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    s = CheckpointStore(tmp_path, task_id="run")
    for step in (3, 5):
        save_state(s, tiny_state(step), reason="interval", signals={"loss": 1.0 / step})
    yield s
    s.close()


def _sql(root: Path, statement: str, *args: object) -> None:
    conn = sqlite3.connect(root / CATALOG_NAME)
    conn.execute(statement, args)
    conn.commit()
    conn.close()


def test_a_row_pointing_at_another_step_is_ignored(store: CheckpointStore, tmp_path: Path) -> None:
    _sql(tmp_path, "UPDATE checkpoints SET file_path='run/step-3' WHERE step=5")
    loaded = store.load("step:5")
    assert loaded.info.path == str(store.task_dir / "step-5")
    assert torch.equal(loaded.weights["w"], tiny_state(5).weights["w"])
    assert store.resolve("auto").path == str(store.task_dir / "step-5")


def test_a_directory_holding_another_steps_manifest_is_refused(store: CheckpointStore) -> None:
    store.delete("step:5")
    (store.task_dir / "step-3").rename(store.task_dir / "step-5")  # renamed by hand
    store.sync_catalog()
    with pytest.raises(CorruptCheckpointError, match=r"says task 'run' step 3, but it lives in 'run'/step-5"):
        store.load("step:5")
    assert [(i.step, i.status) for i in store.list(include_unhealthy=True)] == [(5, "corrupt"), (3, "missing")]


@pytest.mark.parametrize("flag", ["healthy=0", "status='corrupt'", "status='missing'"])
def test_a_stale_flag_does_not_hide_the_newest_checkpoint(store: CheckpointStore, tmp_path: Path, flag: str) -> None:
    _sql(tmp_path, f"UPDATE checkpoints SET {flag} WHERE step=5")
    assert store.resolve("auto").step == 5  # re-read from disk (and re-verified) before being skipped
    assert [i.step for i in store.list()] == [5, 3]
    row = {r["step"]: r for r in store.catalog.rows("run")}[5]
    assert (row["healthy"], row["status"]) == (1, "ok")  # the row was corrected


def test_a_real_corrupt_flag_stays(store: CheckpointStore) -> None:
    weights = store.task_dir / "step-5" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert store.verify("step:5") != []
    assert store.resolve("auto").step == 3
    assert store.list(include_unhealthy=True)[0].status == "corrupt"


def test_one_transient_read_error_is_retried(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    log = tmp_path / "reads.jsonl"
    monkeypatch.setenv(FAULT_ENV, f"read:log={log};read@name=weights.safetensors@nth=1:raise=EIO")
    loaded = store.load("step:5", tiers={Tier.WEIGHTS})
    assert torch.equal(loaded.weights["w"], tiny_state(5).weights["w"])
    reads = [json.loads(line)["name"] for line in log.read_text().splitlines()]
    assert reads.count("weights.safetensors") == 2  # the failed read, then the one that succeeded
    assert store.list()[0].status == "ok"


def test_open_rereads_flags_changed_on_disk(store: CheckpointStore, tmp_path: Path) -> None:
    store.close()
    (tmp_path / "run" / "step-3" / PINNED_MARKER).touch()  # pinned by hand (or by a crashed pin())
    reopened = CheckpointStore(tmp_path, task_id="run")
    assert {i.step: i.pinned for i in reopened.list()} == {5: False, 3: True}
    reopened.close()


def test_retention_rechecks_the_disk_before_deleting(store: CheckpointStore) -> None:
    plan = [Removal(i, frozenset(Tier)) for i in store.list() if i.step == 3]
    (store.task_dir / "step-3" / PINNED_MARKER).touch()  # pinned after the plan was made
    report = store.prune(plan)
    assert report.removed == [] and report.kept == ["step 3 kept: it is pinned on disk"]
    assert (store.task_dir / "step-3" / "manifest.json").exists()

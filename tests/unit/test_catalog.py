"""Catalog: WAL, index, reindex from manifests, status of vanished/corrupt rows, concurrent readers."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import torch
from helpers import save_state

from hf_dynamic_ckpt.constants import CATALOG_NAME, MANIFEST_NAME, Tier
from hf_dynamic_ckpt.store import Catalog, CheckpointInfo, CheckpointState, CheckpointStore


def _save(store: CheckpointStore, step: int, **kw: Any) -> CheckpointInfo:
    state = CheckpointState(step=step, weights={"w": torch.full((4,), float(step))},
                            optimizer={"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}, rng={"s": step})
    info = save_state(store, state, reason=kw.pop("reason", "interval"),
                      signals={"loss": 1.0 / step, "gpu_mem_percent": 40.0 + step}, **kw)
    assert info is not None
    return info


COLUMNS = ("task_id", "step", "loss", "gpu_mem_percent", "save_time", "file_path", "recovery_cost_ms", "tiers",
           "bytes", "reason", "healthy", "pinned", "status", "world_size")


def _rows(root: Path) -> list[dict[str, Any]]:
    """The rows of a catalog (the columns a reader of the file ranks and lists by), from a fresh connection."""
    conn = sqlite3.connect(root / CATALOG_NAME)
    conn.row_factory = sqlite3.Row
    rows = [{k: r[k] for k in COLUMNS} for r in conn.execute("SELECT * FROM checkpoints ORDER BY task_id, step")]
    conn.close()
    return rows


def test_wal_mode_and_task_step_index(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / CATALOG_NAME)
    conn = sqlite3.connect(tmp_path / CATALOG_NAME)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent, seen by any connection
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name='idx_checkpoints_task_step'").fetchone()
    assert "(task_id, step)" in sql
    columns = {r[1] for r in conn.execute("PRAGMA table_info(checkpoints)")}
    assert {"id", "task_id", "step", "loss", "gpu_mem_percent", "save_time", "file_path", "recovery_cost_ms", "tiers",
            "bytes", "reason", "healthy", "pinned", "status", "world_size"} <= columns
    conn.close()
    cat.close()
    cat.close()  # idempotent


def test_row_content_matches_the_save(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run")
    info = _save(store, 4, pinned=True, healthy=False, reason="loss_spike")
    (row,) = _rows(tmp_path)
    assert row == {"task_id": "run", "step": 4, "loss": 0.25, "gpu_mem_percent": 44.0, "save_time": info.save_time,
                   "file_path": "run/step-4", "recovery_cost_ms": info.recovery_cost_ms,
                   "tiers": "optimizer,state,weights", "bytes": info.bytes, "reason": "loss_spike", "healthy": 0,
                   "pinned": 1, "status": "ok", "world_size": 1}
    assert info.bytes == sum(p.stat().st_size for p in Path(info.path).iterdir() if p.name != MANIFEST_NAME)
    assert info.recovery_cost_ms is not None and info.recovery_cost_ms > 0
    store.close()


def test_reindex_after_deleting_catalog_restores_the_same_rows(tmp_path: Path) -> None:
    for task in ("a", "b"):
        store = CheckpointStore(tmp_path, task_id=task)
        for step in (1, 2, 3):
            _save(store, step, healthy=step != 2)
        store.pin("step:1")
        store.delete("step:3", tiers={Tier.OPTIMIZER})
        store.close()
    before = _rows(tmp_path)
    assert len(before) == 6
    for suffix in ("", "-wal", "-shm"):
        Path(f"{tmp_path / CATALOG_NAME}{suffix}").unlink(missing_ok=True)
    store = CheckpointStore(tmp_path, task_id="a", cleanup=False)
    assert _rows(tmp_path) == []
    assert store.reindex() == 6
    assert _rows(tmp_path) == before
    store.close()


def test_open_adds_rows_for_committed_dirs_and_marks_vanished_ones(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run")
    for step in (1, 2, 3):
        _save(store, step)
    store.catalog.remove("run", 3)  # as if killed between the rename and the catalog row
    import shutil

    shutil.rmtree(tmp_path / "run" / "step-1")  # deleted behind the catalog's back
    store.close()
    store = CheckpointStore(tmp_path, task_id="run")
    assert {r["step"]: r["status"] for r in _rows(tmp_path)} == {1: "missing", 2: "ok", 3: "ok"}
    assert [i.step for i in store.list()] == [3, 2]
    store.close()


def test_vanished_directory_is_marked_missing_on_list(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run")
    _save(store, 1)
    _save(store, 2)
    (tmp_path / "run" / "step-2" / MANIFEST_NAME).unlink()
    assert store.resolve("auto").step == 1
    assert {r["step"]: r["status"] for r in _rows(tmp_path)} == {1: "ok", 2: "missing"}
    store.close()


def test_corrupt_manifest_gets_a_corrupt_row_on_reindex(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run")
    _save(store, 1)
    _save(store, 2)
    (tmp_path / "run" / "step-2" / MANIFEST_NAME).write_text("{ not json")
    store.reindex()
    rows = {r["step"]: r for r in _rows(tmp_path)}
    assert rows[2]["status"] == "corrupt" and rows[2]["healthy"] == 0 and rows[1]["status"] == "ok"
    assert store.resolve("auto").step == 1
    store.close()


def test_reader_is_not_blocked_by_an_open_write_transaction(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run")
    _save(store, 1)
    writer = sqlite3.connect(tmp_path / CATALOG_NAME, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE checkpoints SET reason='changed' WHERE step=1")
    reader = Catalog(tmp_path / CATALOG_NAME, busy_timeout_ms=100)
    assert [r["reason"] for r in reader.rows("run")] == ["interval"]  # the committed snapshot, at once
    assert not reader.rebuilt and not list(tmp_path.glob("*.unusable-*"))  # a lock is no reason to rebuild
    writer.execute("COMMIT")
    assert [r["reason"] for r in reader.rows("run")] == ["changed"]
    writer.close()
    reader.close()
    store.close()


def test_concurrent_writer_and_readers(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run")
    errors: list[BaseException] = []
    seen: list[int] = []
    done = threading.Event()

    def read() -> None:
        cat = Catalog(tmp_path / CATALOG_NAME)
        try:
            last = 0
            while not done.is_set():
                n = len(cat.rows("run"))
                assert n >= last  # rows only ever appear
                last = n
            seen.append(last)
        except BaseException as e:
            errors.append(e)
        finally:
            cat.close()

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    for step in range(1, 21):
        _save(store, step)
    done.set()
    for t in readers:
        t.join()
    assert errors == []
    assert len(store.list()) == 20 and all(n <= 20 for n in seen)
    store.close()


def test_unusable_or_foreign_catalog_is_rebuilt_from_manifests(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, task_id="run")
    for step in (1, 2):
        _save(store, step)
    store.close()
    before = _rows(tmp_path)
    for suffix in ("-wal", "-shm"):
        Path(f"{tmp_path / CATALOG_NAME}{suffix}").unlink(missing_ok=True)
    (tmp_path / CATALOG_NAME).write_bytes(b"this is not a database" * 100)
    store = CheckpointStore(tmp_path, task_id="run")
    assert store.catalog.rebuilt and _rows(tmp_path) == before
    assert len(list(tmp_path.glob(f"{CATALOG_NAME}.unusable-*"))) == 1
    store.close()

    conn = sqlite3.connect(tmp_path / CATALOG_NAME)
    conn.execute("PRAGMA user_version=99")
    conn.close()
    store = CheckpointStore(tmp_path, task_id="run")
    assert store.catalog.rebuilt and _rows(tmp_path) == before
    conn = sqlite3.connect(tmp_path / CATALOG_NAME)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    conn.close()
    store.close()

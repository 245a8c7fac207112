"""The SQLite index of committed checkpoints (``<root>/catalog.db``, WAL): derived from the manifests, never the truth
(docs/reliability.md). A torn, foreign or other-schema file is moved aside or dropped and rebuilt."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..constants import MANIFEST_NAME, PINNED_MARKER, STEP_DIR_PREFIX, Tier
from ..jsonutil import loads_bounded
from .manifest import STATUS_CORRUPT, STATUS_MISSING, STATUS_OK, CheckpointInfo, Lineage, lstat

logger = logging.getLogger(__name__)
SCHEMA_VERSION = 2
_SCHEMA = """CREATE TABLE checkpoints (id INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL, step INTEGER
    NOT NULL, loss REAL, gpu_mem_percent REAL, save_time REAL NOT NULL, file_path TEXT NOT NULL, recovery_cost_ms REAL,
    tiers TEXT NOT NULL, bytes INTEGER NOT NULL, reason TEXT NOT NULL, healthy INTEGER NOT NULL, pinned INTEGER
    NOT NULL, status TEXT NOT NULL, world_size INTEGER NOT NULL, abandoned INTEGER NOT NULL DEFAULT 0, details TEXT,
    sig TEXT, UNIQUE (task_id, step)); CREATE INDEX idx_checkpoints_task_step ON checkpoints (task_id, step);"""
_UPSERT = f"INSERT OR REPLACE INTO checkpoints VALUES (NULL{', ?' * 17})"  # a new id, then the columns (`_values`)
_DELETE = "DELETE FROM checkpoints WHERE task_id=? AND step=?"
_SET_STATUS = "UPDATE checkpoints SET status=? WHERE task_id=? AND step=?"


def manifest_sig(directory: Path) -> str | None:
    """Identity of a checkpoint's manifest and pin marker (inode, size, mtime), without reading them."""
    st, pinned = lstat(directory / MANIFEST_NAME), lstat(directory / PINNED_MARKER) is not None
    return None if st is None else f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{int(pinned)}"


class Catalog:
    """One connection to a store's catalog (`path` `None`: in memory) shared by threads; `rebuilt`: started afresh."""

    def __init__(self, path: str | os.PathLike[str] | None, *, busy_timeout_ms: int = 30_000) -> None:
        self.path, self.busy_timeout_ms = Path(path) if path is not None else None, int(busy_timeout_ms)
        self.rebuilt, self._lock = False, threading.Lock()
        try:
            self._conn: sqlite3.Connection | None = self._connect()
        except sqlite3.DatabaseError as e:  # "file is not a database", a torn header
            if isinstance(e, sqlite3.OperationalError) or self.path is None:  # locked, unreachable: never a rebuild
                raise
            aside = self.path.with_name(f"{self.path.name}.unusable-{int(time.time())}")
            logger.warning("catalog %s is unusable (%s); moved to %s, rebuilt from the manifests", self.path, e, aside)
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            self._conn, self.rebuilt = self._connect(), True

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path or ":memory:", timeout=self.busy_timeout_ms / 1000, check_same_thread=False,
                               isolation_level=None)
        conn.row_factory = sqlite3.Row
        try:
            # Two processes opening a new file: the journal-mode switch answers "locked" without the busy handler.
            deadline = time.monotonic() + self.busy_timeout_ms / 1000
            while True:
                try:
                    mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
                    break
                except sqlite3.OperationalError as e:
                    if "locked" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            if mode != "wal" and self.path:
                logger.warning("catalog %s is not in WAL mode; readers may wait for writers", self.path)
            conn.execute("PRAGMA synchronous=NORMAL")
            if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:  # not migrated
                with conn:  # read again under the write lock: another process may have made it
                    conn.execute("BEGIN IMMEDIATE")
                    if (version := conn.execute("PRAGMA user_version").fetchone()[0]) != SCHEMA_VERSION:
                        for sql in (f"DROP TABLE IF EXISTS checkpoints; DROP TABLE IF EXISTS checkpoint_details; "
                                    f"{_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}").split(";"):
                            conn.execute(sql)  # not `executescript`: it would COMMIT the lock away first
                        self.rebuilt = self.rebuilt or version != 0
        except BaseException:
            conn.close()
            raise
        self._ident = self._identity()
        return conn

    def _identity(self) -> tuple[int, int] | None:
        return (st.st_dev, st.st_ino) if self.path and (st := lstat(self.path)) else None

    def replaced(self) -> bool:  # the file was deleted or replaced since this connection opened it
        return self.path is not None and self._conn is not None and self._identity() != self._ident

    def reopen(self) -> None:  # connect again to the file at `path` (created empty if missing: to be rebuilt)
        with self._lock:
            self._db().close()
            self._conn, self.rebuilt = self._connect(), True

    @classmethod
    def snapshot(cls, path: str | os.PathLike[str]) -> Catalog:
        """An in-memory copy of the file at `path` for a reader, opened without creating or locking anything (through a
        live writer's ``-wal`` and ``-shm``, else as immutable); a missing, torn or foreign file gives an empty copy."""
        cat, path, live = cls(None), Path(path), all(Path(f"{path}{s}").exists() for s in ("-wal", "-shm"))
        try:
            if path.is_file():
                uri = f"{path.absolute().as_uri()}?{'mode=ro' if live else 'immutable=1'}"
                with contextlib.closing(sqlite3.connect(uri, uri=True)) as src:
                    if src.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
                        src.backup(cat._db())
        except sqlite3.Error:  # the manifests are read instead
            cat.close()
            return cls(None)
        return cat

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"catalog {self.path} is closed; open a new CheckpointStore.")
        return self._conn

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            conn.close() if conn is not None else None

    def _write(self, *work: tuple[str, Iterable[Sequence[Any]]]) -> None:  # executemany each, in one transaction
        with self._lock, (db := self._db()):
            db.execute("BEGIN IMMEDIATE")
            for sql, rows in work:
                db.executemany(sql, rows)

    def upsert(self, info: CheckpointInfo, *, root: str | os.PathLike[str]) -> None:
        self._write((_UPSERT, [_values(info, root)]))

    def set_status(self, task_id: str, step: int, status: str) -> None:
        self._write((_SET_STATUS, [(status, task_id, step)]))

    def remove(self, task_id: str, step: int) -> None:
        self._write((_DELETE, [(task_id, step)]))

    def sync(self, task_id: str, *, root: str | os.PathLike[str], committed: Mapping[int, Path],
             scan: Callable[[int, Path], CheckpointInfo | None], abandoned: Collection[tuple[int, float]],
             recheck_hidden: bool = False, drop_missing: bool = False) -> None:
        """Make the rows of `task_id` agree with its directories (`committed`), reading a manifest (`scan`) where a row
        is stale or (`recheck_hidden`) hidden; vanished ones become missing (`drop_missing`: go); corrupt stands while
        the save time is unchanged."""
        rows, updates, present = {int(r["step"]): r for r in self.rows(task_id)}, [], set()
        for step, path in committed.items():
            if (row := rows.get(step)) is not None and row["sig"] == manifest_sig(path) and row["status"] != \
                    STATUS_MISSING and bool(row["abandoned"]) == ((step, float(row["save_time"])) in abandoned) \
                    and not (recheck_hidden and not (row["healthy"] and row["status"] == STATUS_OK)):
                present.add(step)
            elif (info := scan(step, path)) is not None:
                present.add(step)
                if row is not None and row["status"] == STATUS_CORRUPT and float(row["save_time"]) == info.save_time:
                    info = dataclasses.replace(info, status=STATUS_CORRUPT)
                if (values := _values(info, root)) != (row and tuple(row.values())[1:]):
                    updates.append(values)
        gone = [s for s in rows if s not in present]
        drop = [(task_id, s) for s in gone if drop_missing and s not in committed]
        miss = [(STATUS_MISSING, task_id, s) for s in gone if (task_id, s) not in drop
                and rows[s]["status"] != STATUS_MISSING]
        if updates or drop or miss:
            self._write((_UPSERT, updates), (_DELETE, drop), (_SET_STATUS, miss))

    def rebuild(self, infos: Iterable[CheckpointInfo], *, root: str | os.PathLike[str],
                task_id: str | None = None) -> int:
        """Replace every row (of `task_id`, or all) with `infos`, in one transaction; returns the rows written."""
        rows = [_values(i, root) for i in sorted(infos, key=lambda i: (i.task_id, i.step))]
        self._write(("DELETE FROM checkpoints WHERE ?1 IS NULL OR task_id=?1", [(task_id,)]), (_UPSERT, rows))
        return len(rows)

    def rows(self, task_id: str | None = None) -> list[dict[str, Any]]:  # of one task or all, newest step first
        with self._lock:
            return [dict(r) for r in self._db().execute(
                "SELECT * FROM checkpoints WHERE ?1 IS NULL OR task_id=?1 ORDER BY task_id, step DESC", (task_id,))]

    @staticmethod
    def to_info(row: Mapping[str, Any], *, root: str | os.PathLike[str], abandoned: bool) -> CheckpointInfo:
        try:
            details = loads_bounded(row["details"] or "{}")
            lineage = Lineage.from_dict(details["lineage"]) if details.get("lineage") else None
        except (ValueError, KeyError, TypeError, AttributeError):
            details, lineage = {}, None
        return CheckpointInfo(
            **{k: row[k] for k in ("task_id", "reason", "loss", "gpu_mem_percent", "recovery_cost_ms", "status")},
            step=int(row["step"]), path=os.path.join(root, row["task_id"], f"{STEP_DIR_PREFIX}{int(row['step'])}"),
            tiers=frozenset(Tier(t) for t in row["tiers"].split(",") if t), bytes=int(row["bytes"]),
            save_time=float(row["save_time"]), healthy=bool(row["healthy"]), pinned=bool(row["pinned"]),
            world_size=int(row["world_size"]), blobs=details.get("blobs") or {}, abandoned=abandoned, lineage=lineage,
            frozen=details.get("frozen") or {})


def _values(i: CheckpointInfo, root: str | os.PathLike[str]) -> tuple[Any, ...]:
    details = {"lineage": i.lineage.to_dict() if i.lineage else None, "blobs": dict(i.blobs), "frozen": dict(i.frozen)}
    return (i.task_id, int(i.step), i.loss, i.gpu_mem_percent, float(i.save_time), os.path.relpath(i.path, root),
            i.recovery_cost_ms, ",".join(sorted(t.value for t in i.tiers)), int(i.bytes), i.reason, int(i.healthy),
            int(i.pinned), i.status, int(i.world_size), int(i.abandoned), json.dumps(details, sort_keys=True),
            manifest_sig(Path(i.path)))

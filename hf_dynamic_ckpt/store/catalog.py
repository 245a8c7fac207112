"""SQLite index of committed checkpoints (``<root>/catalog.db``, WAL mode).

The catalog is only an index: the manifests are the truth and `Catalog.replace_all`
(driven by `CheckpointStore.reindex`) rebuilds it from them. WAL mode lets readers (a
resume, the CLI) query while a writer (the background save thread) commits a row; every
connection waits up to `busy_timeout_ms` for a lock instead of failing.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..constants import Tier
from .types import CheckpointInfo

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""`PRAGMA user_version` of the catalog; a database of another version is rebuilt from the manifests."""

STATUS_OK = "ok"
STATUS_MISSING = "missing"
STATUS_CORRUPT = "corrupt"
STATUSES = (STATUS_OK, STATUS_MISSING, STATUS_CORRUPT)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    loss REAL,
    gpu_mem_percent REAL,
    save_time REAL NOT NULL,
    file_path TEXT NOT NULL,
    recovery_cost_ms REAL,
    tiers TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    reason TEXT NOT NULL,
    healthy INTEGER NOT NULL,
    pinned INTEGER NOT NULL,
    status TEXT NOT NULL,
    world_size INTEGER NOT NULL,
    UNIQUE (task_id, step)
);
CREATE INDEX IF NOT EXISTS idx_checkpoints_task_step ON checkpoints (task_id, step);
"""

COLUMNS = (
    "task_id",
    "step",
    "loss",
    "gpu_mem_percent",
    "save_time",
    "file_path",
    "recovery_cost_ms",
    "tiers",
    "bytes",
    "reason",
    "healthy",
    "pinned",
    "status",
    "world_size",
)


def encode_tiers(tiers: Iterable[Tier]) -> str:
    return ",".join(sorted(Tier(t).value for t in tiers))


def decode_tiers(text: str) -> frozenset[Tier]:
    return frozenset(Tier(t) for t in text.split(",") if t)


class Catalog:
    """One connection to the catalog database of a store root.

    Thread-safe: a lock serialises the use of the connection, so a background save thread
    and the training thread may share one instance. Separate processes use separate
    instances (WAL + busy timeout make that safe).

    Args:
        path (`str` or `os.PathLike`): the database file, normally ``<root>/catalog.db``.
        busy_timeout_ms (`int`, *optional*, defaults to `30000`): how long to wait for a lock.

    Example:
        ```python
        >>> cat = Catalog(tmp / "catalog.db")
        >>> cat.journal_mode()
        'wal'
        ```
    """

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_ms: int = 30_000) -> None:
        self.path = Path(path)
        self.busy_timeout_ms = int(busy_timeout_ms)
        self.rebuilt = False
        """`True` when the database was unusable or of another schema and was started afresh:
        its rows must be rebuilt from the manifests (`CheckpointStore` then reindexes)."""
        self._lock = threading.Lock()
        try:
            self._conn: sqlite3.Connection | None = self._connect()
        except sqlite3.OperationalError:  # locked, unreachable: a real error, never a reason to rebuild
            raise
        except sqlite3.DatabaseError as e:  # "file is not a database", torn header, ...
            aside = self.path.with_name(f"{self.path.name}.unusable-{int(time.time())}")
            logger.warning("catalog %s is unusable (%s); moved to %s and rebuilt from the manifests", self.path, e, aside)
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            self._conn = self._connect()
            self.rebuilt = True

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_ms / 1000.0, check_same_thread=False,
                               isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout={self.busy_timeout_ms}")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":  # e.g. a file system without shared memory
                logger.warning("catalog %s: journal_mode is %s, not WAL; readers may wait for writers", self.path, mode)
            conn.execute("PRAGMA synchronous=NORMAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:  # new database (0), or another layout: rebuilt, not migrated
                if version != 0:
                    logger.warning("catalog %s has schema version %s (this library: %s); rebuilding it from the "
                                   "manifests", self.path, version, SCHEMA_VERSION)
                    conn.execute("DROP TABLE IF EXISTS checkpoints")
                    self.rebuilt = True
                conn.executescript(_SCHEMA)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    # -- plumbing -------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"catalog {self.path} is closed; open a new CheckpointStore.")
        return self._conn

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def journal_mode(self) -> str:
        """The database's journal mode (``"wal"`` when the catalog works as intended)."""
        with self._lock:
            return str(self._db().execute("PRAGMA journal_mode").fetchone()[0]).lower()

    # -- writes ---------------------------------------------------------------------------
    def upsert(self, info: CheckpointInfo, *, root: str | os.PathLike[str]) -> None:
        """Insert or replace the row of ``(info.task_id, info.step)``."""
        row = self._row_values(info, root)
        placeholders = ", ".join("?" for _ in COLUMNS)
        updates = ", ".join(f"{c}=excluded.{c}" for c in COLUMNS if c not in ("task_id", "step"))
        sql = (
            f"INSERT INTO checkpoints ({', '.join(COLUMNS)}) VALUES ({placeholders}) "
            f"ON CONFLICT(task_id, step) DO UPDATE SET {updates}"
        )
        with self._lock:
            self._db().execute(sql, row)

    def replace_all(self, infos: Iterable[CheckpointInfo], *, root: str | os.PathLike[str]) -> int:
        """Delete every row and insert `infos`, in one transaction (readers see old or new)."""
        rows = [self._row_values(i, root) for i in sorted(infos, key=lambda i: (i.task_id, i.step))]
        placeholders = ", ".join("?" for _ in COLUMNS)
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM checkpoints")
                db.executemany(f"INSERT INTO checkpoints ({', '.join(COLUMNS)}) VALUES ({placeholders})", rows)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return len(rows)

    def set_status(self, task_id: str, step: int, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"status={status!r} is invalid: expected one of {STATUSES}.")
        with self._lock:
            self._db().execute("UPDATE checkpoints SET status=? WHERE task_id=? AND step=?", (status, task_id, step))

    def set_pinned(self, task_id: str, step: int, pinned: bool) -> None:
        with self._lock:
            self._db().execute("UPDATE checkpoints SET pinned=? WHERE task_id=? AND step=?", (int(pinned), task_id, step))

    def remove(self, task_id: str, step: int) -> None:
        with self._lock:
            self._db().execute("DELETE FROM checkpoints WHERE task_id=? AND step=?", (task_id, step))

    # -- reads ----------------------------------------------------------------------------
    def rows(self, task_id: str | None = None) -> list[dict[str, Any]]:
        """Every row (of one task, or all), as dicts, newest step first."""
        sql = "SELECT * FROM checkpoints"
        args: tuple[Any, ...] = ()
        if task_id is not None:
            sql += " WHERE task_id=?"
            args = (task_id,)
        sql += " ORDER BY task_id, step DESC"
        with self._lock:
            cur = self._db().execute(sql, args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]

    def get(self, task_id: str, step: int) -> dict[str, Any] | None:
        with self._lock:
            cur = self._db().execute("SELECT * FROM checkpoints WHERE task_id=? AND step=?", (task_id, step))
            names = [d[0] for d in cur.description]
            row = cur.fetchone()
        return dict(zip(names, row)) if row is not None else None

    def tasks(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db().execute("SELECT DISTINCT task_id FROM checkpoints ORDER BY task_id")]

    # -- conversion -----------------------------------------------------------------------
    @staticmethod
    def _row_values(info: CheckpointInfo, root: str | os.PathLike[str]) -> tuple[Any, ...]:
        path = Path(info.path)
        try:
            rel = os.path.relpath(path, Path(root))
        except ValueError:  # another drive (Windows)
            rel = str(path)
        return (
            info.task_id,
            int(info.step),
            info.loss,
            info.gpu_mem_percent,
            float(info.save_time),
            rel,
            info.recovery_cost_ms,
            encode_tiers(info.tiers),
            int(info.bytes),
            info.reason,
            int(info.healthy),
            int(info.pinned),
            info.status,
            int(info.world_size),
        )

    @staticmethod
    def to_info(row: dict[str, Any], *, root: str | os.PathLike[str]) -> CheckpointInfo:
        """Turn a row into a `CheckpointInfo` with an absolute path under `root`."""
        return CheckpointInfo(
            task_id=row["task_id"],
            step=int(row["step"]),
            path=os.path.normpath(os.path.join(os.fspath(root), row["file_path"])),
            reason=row["reason"],
            tiers=decode_tiers(row["tiers"]),
            bytes=int(row["bytes"]),
            loss=row["loss"],
            gpu_mem_percent=row["gpu_mem_percent"],
            save_time=float(row["save_time"]),
            recovery_cost_ms=row["recovery_cost_ms"],
            healthy=bool(row["healthy"]),
            pinned=bool(row["pinned"]),
            status=row["status"],
            world_size=int(row["world_size"]),
        )

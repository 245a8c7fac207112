"""The SQLite index of committed checkpoints (``<root>/catalog.db``, WAL): derived from the manifests, never the truth.

One row per checkpoint with what `CheckpointInfo` needs to rank and list (lineage, frozen and blob records as JSON) and
the identity of the manifest it was read from (`sig`): `sync` re-reads a manifest only when that changed or a flag that
hides a checkpoint is to be re-checked. A torn, foreign or other-schema database is moved aside or dropped and rebuilt;
readers of a ``read_only`` store work on `snapshot`, an in-memory copy. Paths are derived from task and step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..constants import MANIFEST_NAME, PINNED_MARKER, STEP_DIR_PREFIX, Tier
from ..jsonutil import loads_bounded
from .manifest import STATUS_CORRUPT, STATUS_MISSING, STATUS_OK, CheckpointInfo, Lineage, lstat

logger = logging.getLogger(__name__)
SCHEMA_VERSION = 2
COLUMNS = ("task_id", "step", "loss", "gpu_mem_percent", "save_time", "file_path", "recovery_cost_ms", "tiers",
           "bytes", "reason", "healthy", "pinned", "status", "world_size", "abandoned", "details", "sig")
_TYPES = ("TEXT NOT NULL", "INTEGER NOT NULL", "REAL", "REAL", "REAL NOT NULL", "TEXT NOT NULL", "REAL",
          "TEXT NOT NULL", "INTEGER NOT NULL", "TEXT NOT NULL", "INTEGER NOT NULL", "INTEGER NOT NULL",
          "TEXT NOT NULL", "INTEGER NOT NULL", "INTEGER NOT NULL DEFAULT 0", "TEXT", "TEXT")
_SCHEMA = ("CREATE TABLE checkpoints (id INTEGER PRIMARY KEY AUTOINCREMENT, "
           + ", ".join(f"{c} {t}" for c, t in zip(COLUMNS, _TYPES)) + ", UNIQUE (task_id, step)); "
           "CREATE INDEX idx_checkpoints_task_step ON checkpoints (task_id, step);")


def manifest_sig(directory: Path) -> str | None:
    """Identity of a checkpoint's manifest and pin marker (inode, size, mtime), without reading them."""
    st = lstat(directory / MANIFEST_NAME)
    return None if st is None else \
        f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{int(lstat(directory / PINNED_MARKER) is not None)}"


class Catalog:
    """One connection to a store root's catalog (`path` `None`: in memory), shared by threads under a lock; other
    writers are waited for up to `busy_timeout_ms`."""

    def __init__(self, path: str | os.PathLike[str] | None, *, busy_timeout_ms: int = 30_000) -> None:
        self.path, self.busy_timeout_ms = Path(path) if path is not None else None, int(busy_timeout_ms)
        self.rebuilt, self._lock = False, threading.Lock()
        """`rebuilt`: the file was unusable or of another schema and started afresh (its rows are to be rebuilt)."""
        try:
            self._conn: sqlite3.Connection | None = self._connect()
        except sqlite3.OperationalError:  # locked, unreachable: a real error, never a reason to rebuild
            raise
        except sqlite3.DatabaseError as e:  # "file is not a database", a torn header
            assert self.path is not None
            aside = self.path.with_name(f"{self.path.name}.unusable-{int(time.time())}")
            logger.warning("catalog %s is unusable (%s); moved to %s and rebuilt from the manifests", self.path, e,
                           aside)
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            self._conn, self.rebuilt = self._connect(), True

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path or ":memory:", timeout=self.busy_timeout_ms / 1000, check_same_thread=False,
                               isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout={self.busy_timeout_ms}")
            if str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower() != "wal" and self.path:
                logger.warning("catalog %s is not in WAL mode; readers may wait for writers", self.path)
            conn.execute("PRAGMA synchronous=NORMAL")
            if (version := conn.execute("PRAGMA user_version").fetchone()[0]) != SCHEMA_VERSION:  # not migrated
                conn.executescript("DROP TABLE IF EXISTS checkpoints; DROP TABLE IF EXISTS checkpoint_details;"
                                   + _SCHEMA + f"PRAGMA user_version={SCHEMA_VERSION};")
                self.rebuilt = self.rebuilt or version != 0
        except BaseException:
            conn.close()
            raise
        self._ident = self._identity()
        return conn

    def _identity(self) -> tuple[int, int] | None:
        st = lstat(self.path) if self.path else None
        return None if st is None else (st.st_dev, st.st_ino)

    def replaced(self) -> bool:
        """Whether the file was deleted or replaced since this connection opened it (the root was deleted)."""
        return self.path is not None and self._conn is not None and self._identity() != self._ident

    def reopen(self) -> None:
        """Connect again to the file at `path` (created empty if missing: its rows are then to be rebuilt)."""
        with self._lock:
            self._db().close()
            self._conn, self.rebuilt = self._connect(), True

    @classmethod
    def snapshot(cls, path: str | os.PathLike[str]) -> Catalog:
        """An in-memory copy of the file at `path` for a reader, opened without creating or locking anything (through
        a live writer's ``-wal`` and ``-shm``, else as immutable); a missing, torn or foreign file gives an empty copy.
        Either way the caller syncs it with the manifests."""
        cat = cls(None)
        if not cat.copy_of(Path(path)):
            cat.close()
            cat = cls(None)
        return cat

    def copy_of(self, path: Path) -> bool:
        """Fill this in-memory catalog with the rows of the file at `path` (`snapshot`); `False` when it is torn."""
        live = all(Path(f"{path}{s}").exists() for s in ("-wal", "-shm"))
        try:
            if path.is_file():
                src = sqlite3.connect(f"{path.absolute().as_uri()}?{'mode=ro' if live else 'immutable=1'}", uri=True)
                try:
                    if src.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
                        src.backup(self._db())
                finally:
                    src.close()
            return True
        except sqlite3.Error as e:
            logger.debug("catalog %s not copied (%s); reading the manifests instead", path, e)
            return False

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"catalog {self.path} is closed; open a new CheckpointStore.")
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def journal_mode(self) -> str:
        with self._lock:
            return str(self._db().execute("PRAGMA journal_mode").fetchone()[0]).lower()

    def _write(self, work: Callable[[sqlite3.Connection], Any]) -> None:
        with self._lock:
            (db := self._db()).execute("BEGIN IMMEDIATE")
            try:
                work(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    @staticmethod
    def _upsert(db: sqlite3.Connection, infos: Iterable[CheckpointInfo], root: str | os.PathLike[str]) -> None:
        db.executemany(f"INSERT OR REPLACE INTO checkpoints ({', '.join(COLUMNS)}) VALUES "
                       f"({', '.join('?' * len(COLUMNS))})", [_values(i, root) for i in infos])

    def upsert(self, info: CheckpointInfo, *, root: str | os.PathLike[str]) -> None:
        self._write(lambda db: self._upsert(db, [info], root))

    def set_status(self, task_id: str, step: int, status: str) -> None:
        self._write(lambda db: db.execute("UPDATE checkpoints SET status=? WHERE task_id=? AND step=?",
                                          (status, task_id, step)))

    def remove(self, task_id: str, step: int) -> None:
        self._write(lambda db: db.execute("DELETE FROM checkpoints WHERE task_id=? AND step=?", (task_id, step)))

    def sync(self, task_id: str, *, root: str | os.PathLike[str], committed: Mapping[int, Path],
             scan: Callable[[int, Path], CheckpointInfo | None], abandoned: Collection[tuple[int, float]],
             recheck_hidden: bool = False, drop_missing: bool = False) -> None:
        """Make the rows of `task_id` agree with its ``step-<N>`` directories (`committed`), reading a manifest
        (`scan`) only where a row's manifest identity, status or abandoned flag is stale or (`recheck_hidden`) a flag
        hides it. Rows of vanished checkpoints are marked ``"missing"`` (`drop_missing`: deleted); a ``"corrupt"``
        finding stands while the save time is unchanged. Writes only what changed."""
        rows, updates, present = {int(r["step"]): r for r in self.rows(task_id)}, [], set()
        for step, path in committed.items():
            row = rows.get(step)
            if row is not None and row["sig"] == manifest_sig(path) and row["status"] != STATUS_MISSING \
                    and bool(row["abandoned"]) == ((step, float(row["save_time"])) in abandoned) \
                    and not (recheck_hidden and not (row["healthy"] and row["status"] == STATUS_OK)):
                present.add(step)
            elif (info := scan(step, path)) is not None:
                present.add(step)
                if row is not None and row["status"] == STATUS_CORRUPT and float(row["save_time"]) == info.save_time:
                    info = dataclasses.replace(info, status=STATUS_CORRUPT)
                if row is None or _values(info, root) != tuple(row[c] for c in COLUMNS):
                    updates.append(info)
        drop = [(task_id, s) for s in rows if s not in present and drop_missing and s not in committed]
        miss = [(task_id, s) for s, r in rows.items() if s not in present and (task_id, s) not in drop
                and r["status"] != STATUS_MISSING]
        if updates or drop or miss:
            def work(db: sqlite3.Connection) -> None:
                self._upsert(db, updates, root)
                db.executemany("DELETE FROM checkpoints WHERE task_id=? AND step=?", drop)
                db.executemany(f"UPDATE checkpoints SET status='{STATUS_MISSING}' WHERE task_id=? AND step=?", miss)
            self._write(work)

    def rebuild(self, infos: Iterable[CheckpointInfo], *, root: str | os.PathLike[str],
                task_id: str | None = None) -> int:
        """Replace every row (of `task_id`, or all) with `infos`, in one transaction; returns the rows written."""
        infos = sorted(infos, key=lambda i: (i.task_id, i.step))

        def work(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM checkpoints" + " WHERE task_id=?" * bool(task_id), (task_id,) if task_id else ())
            self._upsert(db, infos, root)

        self._write(work)
        return len(infos)

    @staticmethod
    def record_statuses(path: str | os.PathLike[str], task_id: str, statuses: Mapping[int, str], *,
                        busy_timeout_ms: int = 30_000) -> int:
        """Write `verify` findings (``{step: status}``) into the file at `path` where they differ (never creating it):
        the one write of a command that otherwise only reads. Returns the rows changed."""
        if not statuses or not Path(path).is_file():
            return 0
        conn = sqlite3.connect(path, timeout=busy_timeout_ms / 1000, isolation_level=None)
        try:
            with conn:
                return sum(conn.execute("UPDATE checkpoints SET status=? WHERE task_id=? AND step=? AND status!=?",
                                        (s, task_id, int(step), s)).rowcount for step, s in statuses.items())
        finally:
            conn.close()

    def rows(self, task_id: str | None = None) -> list[dict[str, Any]]:
        """Every row (of one task, or all) as a dict, newest step first."""
        with self._lock:
            cur = self._db().execute("SELECT * FROM checkpoints" + " WHERE task_id=?" * (task_id is not None)
                                     + " ORDER BY task_id, step DESC", (task_id,) if task_id is not None else ())
            return [dict(zip([d[0] for d in cur.description], r)) for r in cur.fetchall()]

    def get(self, task_id: str, step: int) -> dict[str, Any] | None:
        return next((r for r in self.rows(task_id) if r["step"] == step), None)

    @staticmethod
    def to_info(row: Mapping[str, Any], *, root: str | os.PathLike[str], abandoned: bool) -> CheckpointInfo:
        """A row as a `CheckpointInfo`, its path derived from task and step."""
        try:
            details = loads_bounded(row["details"] or "{}")
            lineage = Lineage.from_dict(details["lineage"]) if details.get("lineage") else None
        except (ValueError, KeyError, TypeError, AttributeError):
            details, lineage = {}, None
        return CheckpointInfo(
            task_id=row["task_id"], step=int(row["step"]), reason=row["reason"], bytes=int(row["bytes"]),
            path=os.path.join(os.fspath(root), row["task_id"], f"{STEP_DIR_PREFIX}{int(row['step'])}"),
            tiers=frozenset(Tier(t) for t in row["tiers"].split(",") if t), loss=row["loss"],
            gpu_mem_percent=row["gpu_mem_percent"], save_time=float(row["save_time"]),
            recovery_cost_ms=row["recovery_cost_ms"], healthy=bool(row["healthy"]), pinned=bool(row["pinned"]),
            status=row["status"], world_size=int(row["world_size"]), blobs=details.get("blobs") or {},
            abandoned=abandoned, lineage=lineage, frozen=details.get("frozen") or {})


def _values(i: CheckpointInfo, root: str | os.PathLike[str]) -> tuple[Any, ...]:
    details = {"lineage": i.lineage.to_dict() if i.lineage else None, "blobs": dict(i.blobs), "frozen": dict(i.frozen)}
    return (i.task_id, int(i.step), i.loss, i.gpu_mem_percent, float(i.save_time), os.path.relpath(i.path, root),
            i.recovery_cost_ms, ",".join(sorted(t.value for t in i.tiers)), int(i.bytes), i.reason, int(i.healthy),
            int(i.pinned), i.status, int(i.world_size), int(i.abandoned), json.dumps(details, sort_keys=True),
            manifest_sig(Path(i.path)))

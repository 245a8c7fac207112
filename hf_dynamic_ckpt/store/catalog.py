"""SQLite index of committed checkpoints (``<root>/catalog.db``, WAL mode), and the one place that
reconciles it with the manifests.

The catalog is only an index: the manifests are the truth. `Catalog.sync` brings a task's
rows in line with its directories (deciding staleness from each manifest's identity,
`manifest_sig`), `Catalog.rebuild` replaces them with what the manifests say; nothing else
compares rows with the disk. WAL mode lets a resume query while a writer (the background
save thread) commits a row; every connection waits up to `busy_timeout_ms` for a lock.

Only a writer changes the file. A reader works on `Catalog.snapshot`, an in-memory copy of
the file (opened without creating or locking anything), synced in memory.

Table `checkpoints` holds one row per checkpoint (the columns `CheckpointInfo` needs to
rank and list); table `checkpoint_details` holds, per row, the manifest's blob table, the
lineage and the abandoned flag as JSON/ints, so `list()` never reads a manifest. A row's
`file_path` is informative only: `CheckpointStore` derives every path from the step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..constants import MANIFEST_NAME, PINNED_MARKER, STEP_DIR_PREFIX, Tier
from ..jsonutil import loads_bounded
from .fs import lstat
from .spec import Lineage
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
_DETAILS = """
CREATE TABLE IF NOT EXISTS checkpoint_details (
    task_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    blobs TEXT NOT NULL,
    lineage TEXT,
    abandoned INTEGER NOT NULL DEFAULT 0,
    manifest_sig TEXT,
    PRIMARY KEY (task_id, step)
);
"""
DETAIL_COLUMNS = ("task_id", "step", "blobs", "lineage", "abandoned", "manifest_sig")

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


def manifest_sig(directory: Path) -> str | None:
    """Identity of a checkpoint's manifest file and pin marker (inode, size, mtime), without reading them."""
    st = lstat(directory / MANIFEST_NAME)
    if st is None:
        return None
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{int(lstat(directory / PINNED_MARKER) is not None)}"


def encode_tiers(tiers: Iterable[Tier]) -> str:
    return ",".join(sorted(Tier(t).value for t in tiers))


def decode_tiers(text: str) -> frozenset[Tier]:
    return frozenset(Tier(t) for t in text.split(",") if t)


def _differs(row: dict[str, Any], info: CheckpointInfo) -> bool:
    return (float(row["save_time"]) != info.save_time or bool(row["healthy"]) != info.healthy
            or bool(row["pinned"]) != info.pinned or row["tiers"] != encode_tiers(info.tiers)
            or int(row["bytes"]) != info.bytes or row.get("d_blobs") is None
            or bool(row.get("d_abandoned")) != info.abandoned
            or (row["status"] != info.status and not (row["status"] == STATUS_CORRUPT and info.status == STATUS_OK)))


class JSONMapping(Mapping[str, Any]):
    """A JSON object kept as text until first read (`CheckpointInfo.blobs` of a catalog row)."""

    def __init__(self, text: str | None) -> None:
        self._text = text
        self._data: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._data is None:
            try:
                value = loads_bounded(self._text) if self._text else {}
            except ValueError:
                value = {}
            self._data = value if isinstance(value, dict) else {}
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __repr__(self) -> str:
        return repr(self._load())

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self._load(),))


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

    def __init__(self, path: str | os.PathLike[str] | None, *, busy_timeout_ms: int = 30_000) -> None:
        self.memory = path is None
        self.path = Path(path) if path is not None else Path(":memory:")
        self.busy_timeout_ms = int(busy_timeout_ms)
        self.rebuilt = False
        """`True` when the database was unusable or of another schema and was started afresh:
        its rows must be rebuilt from the manifests (`CheckpointStore` then reindexes)."""
        self._lock = threading.Lock()
        self._ident: tuple[int, int] | None = None
        try:
            self._conn: sqlite3.Connection | None = self._connect()
        except sqlite3.OperationalError:  # locked, unreachable: a real error, never a reason to rebuild
            raise
        except sqlite3.DatabaseError as e:  # "file is not a database", torn header, ...
            if self.memory:  # pragma: no cover - an in-memory database is never damaged
                raise
            aside = self.path.with_name(f"{self.path.name}.unusable-{int(time.time())}")
            logger.warning("catalog %s is unusable (%s); moved to %s and rebuilt from the manifests", self.path, e,
                           aside)
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            self._conn = self._connect()
            self.rebuilt = True

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(":memory:" if self.memory else self.path, timeout=self.busy_timeout_ms / 1000.0,
                               check_same_thread=False, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout={self.busy_timeout_ms}")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal" and not self.memory:  # e.g. a file system without shared memory
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
            conn.executescript(_DETAILS)  # older catalogs get the details table here (sync fills it)
        except BaseException:
            conn.close()
            raise
        self._ident = self._identity()
        return conn

    def _identity(self) -> tuple[int, int] | None:
        if self.memory:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def replaced(self) -> bool:
        """Whether the database file was deleted or replaced since this connection opened it (the root was
        deleted mid-run): writes through this connection would go to a file nobody reads."""
        return not self.memory and self._conn is not None and self._identity() != self._ident

    def reopen(self) -> None:
        """Connect again to the file at `path` (created empty if missing; its rows are then to be rebuilt)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            self._conn = self._connect()
            self.rebuilt = True

    # -- plumbing -------------------------------------------------------------------------
    @classmethod
    def in_memory(cls) -> Catalog:
        """A catalog that lives only in this process (read-only stores: nothing is written to disk)."""
        return cls(None)

    @classmethod
    def snapshot(cls, path: str | os.PathLike[str]) -> Catalog:
        """An in-memory copy of the catalog file at `path`, for a reader: the file is never written.

        The file is opened read-only without creating anything next to it: through SQLite's
        shared memory when a writer has it open (its ``-wal`` and ``-shm`` exist, so the copy
        includes what the writer has not checkpointed yet), otherwise as an immutable file. A
        missing, unreadable or foreign file gives an empty copy; either way the copy is then
        synced with the manifests (`sync`), which are the truth.
        """
        cat = cls(None)
        if not cat.copy_of(Path(path)):
            cat.close()
            cat = cls(None)
        return cat

    def copy_of(self, path: Path) -> bool:
        """Fill this in-memory catalog with the rows of the file at `path` (`snapshot`); `False` when the file is
        torn or foreign (this copy is then unusable: start another)."""
        live = all(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm"))
        uri = f"{path.absolute().as_uri()}?{'mode=ro' if live else 'immutable=1'}"
        try:
            if not path.is_file():
                return True
            src = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout_ms / 1000.0)
            try:
                version = src.execute("PRAGMA user_version").fetchone()[0]
                if version == SCHEMA_VERSION:
                    src.backup(self._db())
            finally:
                src.close()
            self._db().executescript(_DETAILS)
        except sqlite3.Error as e:  # torn or foreign: the manifests fill an empty copy
            logger.debug("catalog %s not copied (%s); reading the manifests instead", path, e)
            return False
        return True

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
    def _transaction(self, work: Any) -> None:
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                work(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def upsert(self, info: CheckpointInfo, *, root: str | os.PathLike[str]) -> None:
        """Insert or replace the row of ``(info.task_id, info.step)`` and its details, in one transaction."""
        self.upsert_many([info], root=root)

    def upsert_many(self, infos: Iterable[CheckpointInfo], *, root: str | os.PathLike[str]) -> None:
        """`upsert` of several rows in one transaction (each row remembers its manifest's `manifest_sig`)."""
        self._transaction(lambda db: self._upsert(db, list(infos), root))

    def _upsert(self, db: sqlite3.Connection, infos: list[CheckpointInfo], root: str | os.PathLike[str]) -> None:
        updates = ", ".join(f"{c}=excluded.{c}" for c in COLUMNS if c not in ("task_id", "step"))
        db.executemany(f"INSERT INTO checkpoints ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)}) "
                       f"ON CONFLICT(task_id, step) DO UPDATE SET {updates}",
                       [self._row_values(i, root) for i in infos])
        db.executemany(f"INSERT OR REPLACE INTO checkpoint_details ({', '.join(DETAIL_COLUMNS)}) VALUES "
                       f"({', '.join('?' for _ in DETAIL_COLUMNS)})", [self._detail_values(i) for i in infos])

    def set_status(self, task_id: str, step: int, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"status={status!r} is invalid: expected one of {STATUSES}.")
        with self._lock:
            self._db().execute("UPDATE checkpoints SET status=? WHERE task_id=? AND step=?", (status, task_id, step))

    def remove(self, task_id: str, step: int) -> None:
        def work(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM checkpoints WHERE task_id=? AND step=?", (task_id, step))
            db.execute("DELETE FROM checkpoint_details WHERE task_id=? AND step=?", (task_id, step))

        self._transaction(work)

    # -- reconciliation with the manifests ------------------------------------------------------
    def sync(self, task_id: str, *, root: str | os.PathLike[str], committed: Mapping[int, Path],
             scan: Callable[[int, Path], CheckpointInfo | None], abandoned: Collection[tuple[int, float]],
             recheck_hidden: bool = False, drop_missing: bool = False) -> None:
        """Make the rows of `task_id` agree with its committed directories (the manifests are the truth).

        A row stands as it is while it was built from the very manifest file and pin marker on
        disk now (`manifest_sig`), is not marked ``"missing"`` and its abandoned flag agrees with
        the timelines record. Otherwise the manifest is read (`scan`): a row is added for a
        directory the catalog lacks (a crash between the rename and the row), rewritten when a
        flag (health, pin, tiers, identity, abandoned) differs from the disk, and marked
        ``"missing"`` when its directory or manifest is gone. A ``"corrupt"`` status (a file-level
        finding of `verify`) stands while the checkpoint's save time is unchanged. Nothing is
        written when the rows already agree.

        Args:
            committed (`Mapping[int, Path]`): the task's ``step-<N>`` directories (`Task.committed`).
            scan (`Callable`): the checkpoint a directory's manifest describes, `None` without one.
            abandoned (`Collection`): ``(step, save_time)`` of the abandoned checkpoints (timelines record).
            recheck_hidden (`bool`, *optional*, defaults to `False`): also re-read a row whose flags hide
                its checkpoint (unhealthy, corrupt), so that a stale flag never hides one.
            drop_missing (`bool`, *optional*, defaults to `False`): delete the rows of steps whose directory
                is gone instead of marking them ``"missing"`` (`gc`).
        """
        rows = {int(r["step"]): r for r in self.rows(task_id)}
        updates: list[CheckpointInfo] = []
        present: set[int] = set()
        for step, path in committed.items():
            row = rows.get(step)
            if row is not None and not self._stale(row, path, abandoned, recheck_hidden):
                present.add(step)
                continue
            info = scan(step, path)
            if info is None:
                continue
            present.add(step)
            if row is not None and row["status"] == STATUS_CORRUPT and float(row["save_time"]) == info.save_time:
                info = dataclasses.replace(info, status=STATUS_CORRUPT)
            if row is None or _differs(row, info):
                updates.append(info)
        dropped = [s for s in rows if s not in present and drop_missing and s not in committed]
        missing = [s for s, r in rows.items()
                   if s not in present and s not in dropped and r["status"] != STATUS_MISSING]
        if not (updates or dropped or missing):
            return

        def work(db: sqlite3.Connection) -> None:
            self._upsert(db, updates, root)
            for table in ("checkpoints", "checkpoint_details"):
                db.executemany(f"DELETE FROM {table} WHERE task_id=? AND step=?", [(task_id, s) for s in dropped])
            db.executemany("UPDATE checkpoints SET status=? WHERE task_id=? AND step=?",
                           [(STATUS_MISSING, task_id, s) for s in missing])

        self._transaction(work)

    @staticmethod
    def _stale(row: dict[str, Any], path: Path, abandoned: Collection[tuple[int, float]], recheck_hidden: bool) -> bool:
        hidden = not (row["healthy"] and row["status"] == STATUS_OK)
        return (row.get("d_sig") is None or row["d_sig"] != manifest_sig(path) or row["status"] == STATUS_MISSING
                or bool(row["d_abandoned"]) != ((int(row["step"]), float(row["save_time"])) in abandoned)
                or (recheck_hidden and hidden))

    @staticmethod
    def record_statuses(path: str | os.PathLike[str], task_id: str, statuses: Mapping[int, str], *,
                        busy_timeout_ms: int = 30_000) -> int:
        """Write findings of `verify` (``{step: status}``) into the catalog file at `path`, for the rows whose
        status differs; the one write of a command that otherwise only reads. Returns the rows changed.

        Nothing is created: without a file there is nothing to record into. A rebuilt or synced row
        keeps a ``"corrupt"`` status while its checkpoint is unchanged (`sync`).
        """
        for status in statuses.values():
            if status not in STATUSES:
                raise ValueError(f"status={status!r} is invalid: expected one of {STATUSES}.")
        path = Path(path)
        if not statuses or not path.is_file():
            return 0
        conn = sqlite3.connect(path, timeout=busy_timeout_ms / 1000.0, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            conn.execute("BEGIN IMMEDIATE")
            changed = sum(conn.execute("UPDATE checkpoints SET status=? WHERE task_id=? AND step=? AND status!=?",
                                       (status, task_id, int(step), status)).rowcount
                          for step, status in statuses.items())
            conn.execute("COMMIT")
            return changed
        finally:
            conn.close()

    def rebuild(self, infos: Iterable[CheckpointInfo], *, root: str | os.PathLike[str],
                task_id: str | None = None) -> int:
        """Replace every row (of `task_id`, or all) with `infos` read from the manifests, in one transaction
        (readers see the old rows or the new ones). Returns the number of rows written."""
        infos = sorted(infos, key=lambda i: (i.task_id, i.step))
        where, args = (" WHERE task_id=?", (task_id,)) if task_id is not None else ("", ())

        def work(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM checkpoints" + where, args)
            db.execute("DELETE FROM checkpoint_details" + where, args)
            self._upsert(db, infos, root)

        self._transaction(work)
        return len(infos)

    # -- reads ----------------------------------------------------------------------------
    _SELECT = ("SELECT c.*, d.blobs AS d_blobs, d.lineage AS d_lineage, d.abandoned AS d_abandoned, "
               "d.manifest_sig AS d_sig FROM checkpoints c "
               "LEFT JOIN checkpoint_details d ON d.task_id = c.task_id AND d.step = c.step")

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        with self._lock:
            cur = self._db().execute(sql, args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]

    def rows(self, task_id: str | None = None) -> list[dict[str, Any]]:
        """Every row (of one task, or all), as dicts, newest step first."""
        if task_id is None:
            return self._query(self._SELECT + " ORDER BY c.task_id, c.step DESC", ())
        return self._query(self._SELECT + " WHERE c.task_id=? ORDER BY c.step DESC", (task_id,))

    def get(self, task_id: str, step: int) -> dict[str, Any] | None:
        found = self._query(self._SELECT + " WHERE c.task_id=? AND c.step=?", (task_id, step))
        return found[0] if found else None

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
    def _detail_values(info: CheckpointInfo) -> tuple[Any, ...]:
        lineage = json.dumps(info.lineage.to_dict(), sort_keys=True) if info.lineage is not None else None
        return (info.task_id, int(info.step), json.dumps(dict(info.blobs), sort_keys=True), lineage,
                int(info.abandoned), manifest_sig(Path(info.path)))

    @staticmethod
    def to_info(row: dict[str, Any], *, root: str | os.PathLike[str], abandoned: bool | None = None) -> CheckpointInfo:
        """Turn a row into a `CheckpointInfo`; the path is derived from task and step, never read from the row.

        Args:
            abandoned (`bool`, *optional*): overrides the row's mirror of the timelines record.
        """
        lineage = None
        if row.get("d_lineage"):
            try:
                lineage = Lineage.from_dict(loads_bounded(row["d_lineage"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                lineage = None
        return CheckpointInfo(
            task_id=row["task_id"],
            step=int(row["step"]),
            path=os.path.join(os.fspath(root), row["task_id"], f"{STEP_DIR_PREFIX}{int(row['step'])}"),
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
            blobs=JSONMapping(row.get("d_blobs")),
            abandoned=bool(row.get("d_abandoned")) if abandoned is None else abandoned,
            lineage=lineage,
        )

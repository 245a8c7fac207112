"""Keeping a task's local cache and its object-store copy in step (what `commit`, `maintenance` and the store call).

Remote layout mirrors the local one, under ``<url>/<task>/``::

    step-<N>/<files>, step-<N>/manifest.json (uploaded LAST: the commit point), step-<N>/PINNED
    step-<N>.tmp-<session>/done-rank<R>.json  ranks > 0: "my files of step N are uploaded"
    blobs/<digest>.safetensors                content-addressed weights shared by checkpoints
    timelines.json                            current timeline and abandoned checkpoints
    .writer.lock                              advisory note of the last writer (not a lock)

Order of a save (rank 0): every file and blob is uploaded (retried), then the manifest;
only then is the local temp directory renamed to ``step-<N>``. So a crash or an upload
that fails for good leaves at most a ``step-<N>/`` prefix without a manifest, which no
reader counts (`pull` skips it) and the writer's next open (or `gc`) removes. Deleting
goes the other way: the manifest first, then the rest.

The local cache holds every remote manifest (pulled when a store opens, so `list`,
`resolve`, retention and the catalog work as for a local root) and the files of the
checkpoints that were saved or loaded there; `materialize` downloads the others on demand.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from ..constants import (
    BLOBS_DIR,
    KEY_SIZE,
    MANIFEST_NAME,
    PINNED_MARKER,
    RANK_DONE_TEMPLATE,
    TIMELINES_NAME,
    TMP_MARKER,
    WRITER_LOCK_NAME,
)
from ..jsonutil import loads_bounded
from .blobs import is_digest
from .remote import Remote, RemoteStorageError
from .task import Task, parse_step_dir, step_dir_name
from .types import GcReport

logger = logging.getLogger(__name__)

MANIFEST_LIMIT = 64 << 20
REMOTE_POLL_S = 0.25


def _download(task: Task, remote: Remote, key: str, dest: Path) -> None:
    """Download `key` to `dest` all-or-nothing (a ``.part`` file renamed into place)."""
    part = dest.with_name(f".{dest.name}{TMP_MARKER}{uuid.uuid4().hex[:8]}")
    task.fs.contained(part)
    try:
        remote.get(key, part)
        task.fs.replace(part, dest)
    finally:
        if task.fs.lstat(part) is not None:
            task.fs.unlink(part)


# -- saving ---------------------------------------------------------------------------------
def publish(task: Task, remote: Remote, tmp: Path, step: int, manifest: dict[str, Any]) -> None:
    """Rank 0, before the local rename: upload blobs, files (other ranks' are already there), manifest last.

    Raises:
        `RemoteStorageError`: an upload failed after its retries, or another rank's file is
            not on the object store; nothing new is committed there (what was uploaded is
            removed when the endpoint allows, else by the next open or `gc`).
    """
    try:
        _publish(task, remote, tmp, step, manifest)
    except BaseException:
        try:
            remove_step(remote, step)
        except Exception as e:  # the endpoint is failing; gc removes the partial upload later
            logger.debug("could not remove the partial upload of step %d: %s", step, e)
        raise


def _publish(task: Task, remote: Remote, tmp: Path, step: int, manifest: dict[str, Any]) -> None:
    name = step_dir_name(step)
    manifest_key = remote.key(name, MANIFEST_NAME)
    remote.invalidate()
    replacing = remote.size(manifest_key) is not None
    if replacing:  # no rename on object stores: the old copy stops being a checkpoint first
        remote.remove(manifest_key)
        remote.remove(remote.key(name, PINNED_MARKER))
    for rec in (manifest.get("blobs") or {}).values():
        local = task.blobs.path(str(rec.get("digest")))
        key = remote.key(BLOBS_DIR, local.name)
        st = task.fs.lstat(local)
        if st is not None and remote.size(key) == st.st_size:
            continue
        if st is None:
            if remote.size(key) is None:
                raise RemoteStorageError(f"blob {local.name} of step {step} is neither in {task.blobs.dir} nor on "
                                         f"{remote.spec.shown}.")
            continue
        remote.put(local, key)
    files = manifest.get("files") or {}
    for fname, entry in files.items():
        key = remote.key(name, fname)
        if task.fs.is_file(tmp / fname):
            remote.put(tmp / fname, key)
        elif remote.size(key) != int(entry.get(KEY_SIZE, -1)):
            raise RemoteStorageError(f"{fname} of step {step} (written by another rank) is not on "
                                     f"{remote.spec.shown} with {entry.get(KEY_SIZE)} bytes.")
    remote.put(tmp / MANIFEST_NAME, manifest_key)  # the commit point on the object store
    if replacing:
        keep = set(files) | {MANIFEST_NAME, PINNED_MARKER}
        for stale in remote.names(name):
            if stale not in keep:
                remote.remove_tree(name, stale) if remote.size(remote.key(name, stale)) is None \
                    else remote.remove(remote.key(name, stale))
    if task.spec.world_size > 1:
        remote.remove_tree(tmp.name)  # the other ranks' done notes


def publish_rank(task: Task, remote: Remote, tmp: Path, step: int, files: dict[str, Any]) -> None:
    """Rank > 0, after its done file is written locally: upload its files, then its done note."""
    name = step_dir_name(step)
    for fname in files:
        remote.put(tmp / fname, remote.key(name, fname))
    done = RANK_DONE_TEMPLATE.format(rank=task.spec.rank)
    remote.put(tmp / done, remote.key(tmp.name, done))
    task.fs.rmtree(tmp)  # this rank's cache keeps no copy: rank 0 commits


def fetch_done(task: Task, remote: Remote, tmp: Path, rank: int) -> bool:
    """Rank 0: copy rank `rank`'s done note from the object store into `tmp` when it is there."""
    done = RANK_DONE_TEMPLATE.format(rank=rank)
    key = remote.key(tmp.name, done)
    remote.invalidate()
    if remote.size(key) is None:
        return False
    _download(task, remote, key, tmp / done)
    return True


def fetch_rank_files(task: Task, remote: Remote, tmp: Path, step: int, files: dict[str, Any]) -> None:
    """Rank 0: download the other ranks' files so the local copy is complete (and verifiable)."""
    name = step_dir_name(step)
    for fname in files:
        if not task.fs.is_file(tmp / fname):
            _download(task, remote, remote.key(name, fname), tmp / fname)


# -- reading --------------------------------------------------------------------------------
def committed_steps(remote: Remote) -> dict[int, bytes]:
    """Manifest bytes of every committed remote checkpoint of the task (partial uploads are skipped)."""
    remote.invalidate()
    out = {}
    for n in remote.names():
        step = parse_step_dir(n)
        if step is None:
            continue
        data = remote.read(remote.key(n, MANIFEST_NAME), limit=MANIFEST_LIMIT)
        if data is not None:
            out[step] = data
    return out


def _cache_manifest(task: Task, step: int, data: bytes) -> int:
    """Put a remote manifest into the cache as ``step-<N>/manifest.json`` (1 when it changed)."""
    fs, local = task.fs, task.step_dir(step)
    current = fs.read_bytes(local / MANIFEST_NAME, limit=MANIFEST_LIMIT) if fs.is_file(local / MANIFEST_NAME) else None
    if current == data:
        return 0
    tmp = task.dir / f"{step_dir_name(step)}{TMP_MARKER}{task.spec.session_id}.pull"
    if fs.lstat(tmp) is not None:
        fs.rmtree(tmp)
    fs.mkdir(tmp)
    fs.write_atomic(tmp / MANIFEST_NAME, data, tmp_tag="pull")
    if fs.lstat(local) is not None:
        fs.rmtree(local)
    fs.rename(tmp, local)
    return 1


def refresh_step(task: Task, remote: Remote, step: int) -> None:
    """Ranks > 0 before a save: the bucket's manifest of `step` and timelines into the cache, so this
    rank decides "already committed / replace / new" from the same files as rank 0."""
    timelines = remote.read(remote.key(TIMELINES_NAME), limit=MANIFEST_LIMIT)
    if timelines is not None:
        task.fs.mkdir(task.dir)
        task.fs.write_atomic(task.dir / TIMELINES_NAME, timelines, tmp_tag=task.spec.session_id)
    data = remote.read(remote.key(step_dir_name(step), MANIFEST_NAME), limit=MANIFEST_LIMIT)
    if data is not None:
        _cache_manifest(task, step, data)
    elif task.fs.lstat(task.step_dir(step)) is not None:  # deleted from the bucket since this cache saw it
        task.fs.rmtree(task.step_dir(step))


def pull(task: Task, remote: Remote) -> int:
    """Make the cache hold exactly the remote manifests (+ pin markers, timelines); returns how many changed.

    Files are not downloaded (`materialize` does that on demand); a cached checkpoint the
    object store no longer has is removed from the cache.
    """
    fs = task.fs
    fs.mkdir(task.dir)
    timelines = remote.read(remote.key(TIMELINES_NAME), limit=MANIFEST_LIMIT)
    if timelines is not None:
        fs.write_atomic(task.dir / TIMELINES_NAME, timelines, tmp_tag=task.spec.session_id)
    remote_steps = committed_steps(remote)
    changed = 0
    for step, data in sorted(remote_steps.items()):
        name = step_dir_name(step)
        local = task.step_dir(step)
        pinned = remote.size(remote.key(name, PINNED_MARKER)) is not None
        changed += _cache_manifest(task, step, data)
        if pinned and not fs.is_file(local / PINNED_MARKER):
            fs.write_atomic(local / PINNED_MARKER, b"", tmp_tag="pull")
        elif not pinned and fs.lstat(local / PINNED_MARKER) is not None:
            fs.unlink(local / PINNED_MARKER)
    for step, path in task.committed().items():
        if step not in remote_steps:
            logger.debug("step %d is cached in %s but not on %s: removed from the cache", step, path, remote.spec.shown)
            fs.rmtree(path)
            changed += 1
    return changed


def materialize(task: Task, remote: Remote, step: int) -> None:
    """Download the files and blobs of a cached checkpoint that the cache does not hold yet."""
    path = task.step_dir(step)
    manifest = task.read_manifest(step)
    name = step_dir_name(step)
    for fname, entry in (manifest.get("files") or {}).items():
        st = task.fs.lstat(path / fname)
        if st is None or st.st_size != int(entry.get(KEY_SIZE, -1)):
            _download(task, remote, remote.key(name, fname), path / fname)
    records = (manifest.get("blobs") or {}).values()
    if records and not task.fs.is_dir(task.blobs.dir):
        task.fs.mkdir(task.blobs.dir)
    for rec in records:
        digest = str(rec.get("digest"))
        if not task.blobs.exists(digest):
            local = task.blobs.path(digest)
            _download(task, remote, remote.key(BLOBS_DIR, local.name), local)


# -- changes --------------------------------------------------------------------------------
def remove_step(remote: Remote, step: int) -> None:
    """Delete a checkpoint from the object store: the manifest first (it stops existing), then the rest."""
    name = step_dir_name(step)
    remote.remove(remote.key(name, MANIFEST_NAME))
    remote.remove_tree(name)


def mirror_step(task: Task, remote: Remote, step: int) -> None:
    """After a local delete, tier delete, pin or unpin: make the remote copy of `step` match the cache."""
    local = task.step_dir(step)
    name = step_dir_name(step)
    if not task.fs.is_file(local / MANIFEST_NAME):
        remove_step(remote, step)
        return
    manifest = task.read_manifest(step)
    files = manifest.get("files") or {}
    remote.put(local / MANIFEST_NAME, remote.key(name, MANIFEST_NAME))
    if task.fs.is_file(local / PINNED_MARKER):
        remote.put_bytes(b"", remote.key(name, PINNED_MARKER))
    else:
        remote.remove(remote.key(name, PINNED_MARKER))
    for stale in remote.names(name):
        if stale not in files and stale not in (MANIFEST_NAME, PINNED_MARKER):
            remote.remove(remote.key(name, stale))


def push_timelines(task: Task, remote: Remote) -> None:
    path = task.dir / TIMELINES_NAME
    if task.fs.is_file(path):
        remote.put(path, remote.key(TIMELINES_NAME))


def collect_blobs(task: Task, remote: Remote, report: GcReport) -> None:
    """Remove remote blobs no remote manifest references (skipped when a manifest is unreadable)."""
    used: set[str] = set()
    for step, data in committed_steps(remote).items():
        try:
            manifest = loads_bounded(data)
            used.update(str(b.get("digest")) for b in (manifest.get("blobs") or {}).values())
        except (ValueError, AttributeError):
            report.kept.append(f"remote blobs: not collected, the manifest of step {step} is unreadable")
            return
    for n in remote.names(BLOBS_DIR):
        digest = n.split(".")[0]
        if not is_digest(digest) or digest in used:
            continue
        size = remote.size(remote.key(BLOBS_DIR, n)) or 0
        report.blobs.append(f"remote:{n}")
        report.bytes_freed += size
        if not report.dry_run:
            remote.remove(remote.key(BLOBS_DIR, n))


def remove_leftovers(task: Task, remote: Remote, *, dry_run: bool, at_open: bool,
                     kept: list[str] | None = None) -> list[tuple[str, int]]:
    """Remove what interrupted saves left on the object store.

    Other sessions' ``step-<N>.tmp-*`` prefixes go, and ``step-<N>/`` prefixes without a
    manifest (partial uploads): all of them when the writer opens (nothing of its own is in
    flight), else only those at or below the newest committed step (a save in flight
    uploads a step above it).
    """
    remote.invalidate()
    names = remote.names()
    committed = [s for n in names if (s := parse_step_dir(n)) is not None
                 and remote.size(remote.key(n, MANIFEST_NAME)) is not None]
    top = max(committed, default=-1)
    own = f"{TMP_MARKER}{task.spec.session_id}"
    removed = []
    for n in names:
        step = parse_step_dir(n)
        partial = step is not None and step not in committed and (at_open or step <= top)
        leftover = parse_step_dir(n.split(TMP_MARKER)[0]) is not None and TMP_MARKER in n and own not in n
        if step is not None and step not in committed and not partial and kept is not None:
            kept.append(f"remote:{n} kept: an upload without a manifest above the newest checkpoint (a save may be in "
                        "flight); the writer's next open removes it if it was interrupted")
        if not (partial or leftover):
            continue
        removed.append((f"remote:{n}", 0))
        if not dry_run:
            logger.debug("removing leftover %s on %s", n, remote.spec.shown)
            remote.remove_tree(n)
    return removed


def note_writer(task: Task, remote: Remote) -> None:
    """Write the advisory ``.writer.lock`` note; warn when another recent session's note is there.

    Object stores offer no lock this library can rely on: the note only makes a second
    writer visible in the logs. The promise is one writer per task (see docs/storage.md).
    """
    key = remote.key(WRITER_LOCK_NAME)
    try:
        old = remote.read(key, limit=4096)
        holder = loads_bounded(old) if old else None
    except (ValueError, RemoteStorageError):
        holder = None
    if isinstance(holder, dict) and holder.get("session") != task.spec.session_id:
        logger.warning("%s/%s: session %s on %s (pid %s) wrote here last, since %s; object stores have no lock, so "
                       "make sure it has stopped: two writers on one task interleave their checkpoints",
                       remote.spec.shown, task.task_id, holder.get("session"), holder.get("host"), holder.get("pid"),
                       holder.get("since"))
    me = {"session": task.spec.session_id, "host": socket.gethostname(), "pid": os.getpid(),
          "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    remote.put_bytes(json.dumps(me).encode(), key)


def open_task(task: Task, remote: Remote, *, writer: bool) -> None:
    """When a store opens on a URL root: the writer removes interrupted uploads and notes itself,
    then the cache is made to hold exactly the remote manifests."""
    if writer:
        remove_leftovers(task, remote, dry_run=False, at_open=True)
        note_writer(task, remote)
    pull(task, remote)

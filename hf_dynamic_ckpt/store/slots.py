"""The memory tier's slots: the newest training state in host shared memory, where it outlives the process.

The slots of a task are a `CheckpointStore` (uncompressed) under ``/dev/shm/hf-dynamic-ckpt-<uid>/<key>/``, `key`
naming the disk store's root and task. The writer process fills them from the snapshot buffers; the store's commit
protocol is the slot's marker (every file checksummed in the manifest, written last, then the rename), and at most
two slots exist: the newest committed one and the one being written (`keep_newest` before each write), so a crash
during a write leaves the previous one whole. A slot is persisted by copying it into the disk store unchanged
(`CheckpointStore.adopt`): its timeline and step are the killed run's, so nothing is persisted twice.

Invariants: every directory on the way is checked after `lstat` (a real directory, owned by this user, mode 0700)
before it is used, since ``/dev/shm`` is world-writable; nothing is ever followed through a link. Reading the slots
(`open_slots(..., read_only=True)`) changes nothing. Only `keep_newest` and `remove_slots` delete, only slots.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import constants as C
from .. import sysmem
from ..errors import CorruptCheckpointError, DynamicCkptError, UnsafePathError
from .manifest import CheckpointInfo
from .store import CheckpointStore

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "hf-dynamic-ckpt-"
SHM_RESERVE_BYTES = 256 << 20
"""`/dev/shm` room left to others (data-loader workers pass batches through it, NCCL's shared-memory transport)."""
EARLY_SLOT_MAX_BYTES = 64 << 20
"""A slot at most this large may be written on the training thread, before the writer process is up."""


def slots_dir(root: str | os.PathLike[str], task_id: str, *, base: str = SHM_DIR) -> Path:
    """Where the slots of task `task_id` of the store at `root` live (nothing is created)."""
    key = hashlib.sha256(f"{os.path.realpath(root)}\0{task_id}".encode()).hexdigest()[:20]
    return Path(base) / f"{SHM_PREFIX}{os.getuid()}" / key


def _checked(path: Path, *, create: bool) -> bool:
    """Whether `path` is a usable private directory (created 0700 when `create`); `UnsafePathError` when something
    else is there: a link, a file, another user's directory, one others can write to."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory" if not stat.S_ISDIR(
            st.st_mode) else f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
        raise UnsafePathError(f"{path} is {kind}: the memory tier uses only a private directory (this user's, mode "
                              f"0700, not a link), since {SHM_DIR} is writable by everyone. Remove it, or turn the "
                              "memory tier off (runtime.memory_tier=false).")
    return True


def secure(path: Path, *, create: bool) -> bool:
    """Check (and with `create`, make) the private directories from ``/dev/shm/hf-dynamic-ckpt-<uid>`` down to
    `path`; returns whether `path` exists."""
    return _checked(path.parent, create=create) and _checked(path, create=create)


def same_dir(path: str | os.PathLike[str], opened: os.stat_result | None) -> bool:
    """Whether `path` is still the directory `opened` (`os.lstat` when the slots were opened): not removed, not
    replaced."""
    with contextlib.suppress(FileNotFoundError):
        return opened is not None and os.path.samestat(os.lstat(path), opened)
    return False


def removed(path: str | os.PathLike[str]) -> str:
    """Why a slot is not written when its directory went under a live run (`same_dir` is false)."""
    return (f"the slots' directory {path} was removed or replaced by another process while this run used it (a "
            f"clean-up of {SHM_DIR}?); it is not made again")


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors of a nested state (a checkpoint's weights and optimizer state)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    return sum(map(tensor_bytes, obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, list | tuple)
                   else ()))


def room_problem(nbytes: int, slots: CheckpointStore, margin: float, *, base: str = SHM_DIR) -> str | None:
    """Why two slots of `nbytes` do not fit, or `None`: `/dev/shm` must keep `SHM_RESERVE_BYTES` for others, the
    host (or cgroup) memory `margin` free; the slots written already count as room (they are replaced). Checked
    before the first slot of a size is written, never after: a slot that does not fit is never half written."""
    ours = sum(f.stat().st_size for f in Path(slots.root).rglob("*") if f.is_file())
    free, total = shm_room(base)
    if 2 * nbytes + SHM_RESERVE_BYTES > free + ours:
        return (f"two slots of {nbytes / 2**20:.1f} MiB do not fit in {base} ({free / 2**20:.0f} MiB free of "
                f"{total / 2**20:.0f} MiB, {SHM_RESERVE_BYTES >> 20} MiB kept for data loaders and NCCL); give it "
                "more (docker run --shm-size=..., a Kubernetes emptyDir with medium: Memory)")
    room = sysmem.headroom(sysmem.find_memory_cgroup())
    if 2 * nbytes > room.budget(margin) + ours:
        return (f"two slots of {nbytes / 2**20:.1f} MiB do not fit in the host memory left "
                f"({room.available_bytes / 2**20:.0f} MiB available, {margin:.0%} kept free)")
    return None


def shm_room(base: str = SHM_DIR) -> tuple[int, int]:
    """(free, total) bytes of the file system under `base` (``/dev/shm``); (0, 0) without one."""
    with contextlib.suppress(OSError):
        return (usage := shutil.disk_usage(base)).free, usage.total
    return 0, 0


def open_slots(disk: CheckpointStore, *, read_only: bool, base: str = SHM_DIR) -> CheckpointStore | None:
    """The slots of `disk`'s task as a store (same task, ranks and session); `None` when `read_only` and there are
    none. A writer's opening takes the slots' lock (rank 0) and removes what an interrupted write left."""
    where = slots_dir(disk.root, disk.task_id, base=base)
    if not secure(where, create=not read_only):
        return None
    return CheckpointStore(where, task_id=disk.task_id, rank=disk.rank, world_size=disk.world_size,
                           session_id=disk.session_id, compression="none", read_only=read_only,
                           cleanup=not read_only and disk.rank == 0, lock_wait_s=0.0, last_commits=True)


def keep_newest(slots: CheckpointStore, *, keep: int = 1) -> None:
    """Delete every slot but the newest `keep` (before a write: the two slots are the newest and the one being
    written; `keep=0` before a run's first slot: the slots found then are a killed run's, persisted, or another run's),
    and the parts of steps that never completed: older than the newest slot (a rank skipped its part: with several
    ranks no rank waits for another, `CheckpointStore(last_commits=True)`; every rank finished its older parts once a
    newer slot committed), or, with `keep=0`, another session's."""
    found = sorted(slots.list(include_unhealthy=True, include_abandoned=True), key=lambda i: i.step)
    for info in found[:len(found) - keep]:
        with contextlib.suppress(DynamicCkptError):
            slots.delete(f"step:{info.step}", force=True)
    for entry in slots.task_dir.glob(f"step-*{C.TMP_MARKER}*") if found or not keep else ():
        step = entry.name[len("step-"):].split(".", 1)[0]
        if (keep and step.isdigit() and int(step) < found[-1].step) or (
                not keep and not entry.name.split(C.TMP_MARKER, 1)[1].startswith(slots.session_id)):
            with contextlib.suppress(OSError):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _newer(slots: CheckpointStore, disk: CheckpointStore) -> list[CheckpointInfo]:
    """The slots that may be persisted into `disk`, newest first: newer than every checkpoint there, and of the disk
    store's current timeline (the run that wrote them started there) or the one it resumed from (a restart that
    restored a slot and was killed before the slot reached the disk). Another run's slots never count (a store
    deleted and started again: never resurrected)."""
    record = disk.timeline_record().get("current") or {}
    on_disk = max((i.step for i in disk.list(include_unhealthy=True, include_abandoned=True)), default=-1)
    found = []
    for slot in sorted(slots.list(include_unhealthy=True, include_abandoned=True), key=lambda i: -i.step):
        own = slot.lineage.timeline if slot.lineage is not None else None
        resumed_from = (own, slot.step) == (record.get("parent_timeline"), record.get("parent_step"))
        if slot.step <= on_disk or own is None or (own != record.get("timeline") and not resumed_from):
            break
        found.append(slot)
    return found


def restore_point(slots: CheckpointStore, disk: CheckpointStore) -> CheckpointInfo | None:
    """The slot `auto` restores from when it is newer than the disk store: the newest healthy one `persist_newest`
    would persist (checked as it is read, like any restore point), or `None`."""
    return next((s for s in _newer(slots, disk) if s.healthy), None)


def persist_newest(slots: CheckpointStore, disk: CheckpointStore) -> int | None:
    """Copy the newest usable slot into `disk` (see `_newer`; a slot that does not verify: the one before it); when
    that slot is unhealthy (taken inside an anomaly), the newest healthy one newer than the disk's goes too, so
    `auto` keeps its best restore point. Returns the newest step persisted, or `None`."""
    persisted = None
    for slot in _newer(slots, disk):
        try:
            disk.adopt(slots, slot.step)
        except CorruptCheckpointError as e:  # a damaged slot: the one before it
            logger.warning("memory tier: the slot of step %d is damaged (%s); trying the one before it", slot.step, e)
            continue
        persisted = slot.step if persisted is None else persisted
        if slot.healthy:
            break
    return persisted


def adopt_newer(disk: CheckpointStore, *, base: str = SHM_DIR) -> int | None:
    """At a restart (rank 0, its store just opened): persist the killed run's newest slot when it is newer than the
    disk store (the guaranteed path; a watcher may have done it already), then remove the slots, all persisted or
    older. Returns the persisted step, or `None`. Never raises: a slot that cannot be used is logged and left."""
    try:
        if (slots := open_slots(disk, read_only=True, base=base)) is None:
            return None
        with contextlib.closing(slots):
            step = persist_newest(slots, disk)
    except (OSError, DynamicCkptError) as e:
        logger.warning("memory tier: the slots of task %r could not be read or persisted (%s); resuming from the disk "
                       "store", disk.task_id, e)
        return None
    if step is not None:
        logger.info("memory tier: step %d, newer than the disk store, was persisted from host memory", step)
    remove_slots(disk.root, disk.task_id, base=base)
    return step


def remove_slots(root: str | os.PathLike[str], task_id: str, *, base: str = SHM_DIR) -> None:
    """Remove the slots of a task (a clean end of training, `close()`, after a restart persisted them)."""
    where = slots_dir(root, task_id, base=base)
    with contextlib.suppress(FileNotFoundError, UnsafePathError):
        if _checked(where.parent, create=False):  # this user's private base directory
            st = os.lstat(where)  # this user's directory, even one not private (made again by an older version)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                shutil.rmtree(where)

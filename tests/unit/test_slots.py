"""The memory tier's slots (`store.slots`): private directories, two slots, persisted only into their own run's store.

The slots' base directory is a temporary one here (``/dev/shm`` in use): the checks are the same.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS
from hf_dynamic_ckpt.errors import UnsafePathError
from hf_dynamic_ckpt.run.saver import slot_cadence
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, Lineage, SaveRequest
from hf_dynamic_ckpt.store.slots import (
    adopt_newer,
    keep_newest,
    open_slots,
    persist_newest,
    restore_point,
    room_problem,
    shm_room,
    slots_dir,
)


def _save(store: CheckpointStore, step: int, lineage: Lineage) -> None:
    torch.manual_seed(step)
    store.save(CheckpointState(step=step, weights={"w": torch.randn(4, 4)}, rng={"python": step}),
               SaveRequest(step=step, tiers=ALL_TIERS - {"optimizer"}, reason="t", lineage=lineage))


@pytest.fixture
def disk(tmp_path: Path):
    store = CheckpointStore(tmp_path / "disk")
    yield store
    store.close()


def _started(store: CheckpointStore, lineage: Lineage) -> None:
    store.fork(timeline=lineage.timeline, after_step=None, session=lineage.session)


def test_two_slots_and_the_newest_persisted_once_into_its_own_run(tmp_path: Path, disk: CheckpointStore) -> None:
    base = str(tmp_path / "shm")
    os.mkdir(base)
    run = Lineage(session=disk.session_id, timeline="t1")
    _started(disk, run)
    _save(disk, 10, run)
    slots = open_slots(disk, read_only=False, base=base)
    assert slots is not None
    for step in (11, 12, 13):
        keep_newest(slots)
        _save(slots, step, run)
    assert sorted(i.step for i in slots.list()) == [12, 13]
    where = slots_dir(disk.root, "default", base=base)
    assert oct(os.lstat(where).st_mode & 0o777) == "0o700" and oct(os.lstat(where.parent).st_mode & 0o777) == "0o700"
    assert persist_newest(slots, disk) == 13
    assert persist_newest(slots, disk) is None  # not twice
    loaded = disk.load("step:13")
    assert torch.equal(loaded.weights["w"], slots.load("step:13").weights["w"]) and loaded.rng == {"python": 13}
    assert disk.verify("step:13") == []
    slots.close()
    assert adopt_newer(disk, base=base) is None  # nothing newer: the slots go
    assert not where.exists()


def test_a_slot_of_another_run_is_never_persisted(tmp_path: Path, disk: CheckpointStore) -> None:
    base = str(tmp_path / "shm")
    os.mkdir(base)
    slots = open_slots(disk, read_only=False, base=base)
    assert slots is not None
    _save(slots, 7, Lineage(session="s", timeline="old-run"))  # the store was deleted and started again since
    _started(disk, Lineage(session=disk.session_id, timeline="new-run"))
    assert max(i.step for i in slots.list(include_unhealthy=True, include_abandoned=True)) == 7
    assert persist_newest(slots, disk) is None and disk.list() == []
    slots.close()


def test_a_slot_restored_from_is_persisted_after_the_restart_moved_on(tmp_path: Path, disk: CheckpointStore) -> None:
    # A restart restored step 12 from memory and started its own timeline, then was killed before the slot reached
    # the disk: the slot is still persisted (the new timeline continues it); the killed run's step 11 is not.
    base = str(tmp_path / "shm")
    os.mkdir(base)
    killed = Lineage(session="s1", timeline="t1")
    _started(disk, killed)
    _save(disk, 10, killed)
    slots = open_slots(disk, read_only=False, base=base)
    assert slots is not None
    for step in (11, 12):
        _save(slots, step, killed)
    restart = Lineage(session="s2", timeline="t2", parent_step=12, parent_timeline="t1")
    disk.fork(timeline="t2", after_step=12, session="s2", parent=restart)
    assert restore_point(slots, disk).step == 12  # type: ignore[union-attr]
    assert persist_newest(slots, disk) == 12 and sorted(i.step for i in disk.list()) == [10, 12]
    assert restore_point(slots, disk) is None  # on disk now: `auto` reads it there
    disk.fork(timeline="t3", after_step=10, session="s3", parent=Lineage(
        session="s3", timeline="t3", parent_step=10, parent_timeline="t1"))
    _save(slots, 13, killed)
    assert persist_newest(slots, disk) is None  # t1's step 13 is neither t3's nor its restore point
    slots.close()


def test_with_two_ranks_the_last_part_in_commits_and_an_incomplete_step_goes(tmp_path: Path) -> None:
    # Two ranks' views of one slot store (`last_commits`): no rank waits for the other; whichever writes its part last
    # commits, with rank 0's manifest fields; a step rank 1 skipped never commits and goes once a newer one commits.
    ranks = [CheckpointStore(tmp_path / "slots", rank=r, world_size=2, session_id="s", compression="none",
                             last_commits=True, cleanup=r == 0) for r in (0, 1)]
    run = Lineage(session="s", timeline="t1")

    def part(rank: int, step: int) -> object:
        state = CheckpointState(step=step, weights={"w": torch.full((2,), float(step))} if rank == 0 else None,
                                rng={"python": [rank, step]}, extra={"k": step} if rank == 0 else {})
        tiers = ALL_TIERS - {"optimizer"} if rank == 0 else {"state"}
        return ranks[rank].save(state, SaveRequest(step=step, tiers=tiers, reason="memory tier", lineage=run))

    assert part(1, 5) is None  # rank 0's part is not in yet: nothing committed, nobody waits
    info = part(0, 5)
    assert info is not None and info.step == 5  # rank 0's part came last: it committed
    assert part(0, 6) is None
    info = part(1, 6)
    assert info is not None and info.reason == "memory tier" and info.lineage == run  # by rank 1, rank 0's fields
    loaded = ranks[1].load("step:6", rank=1)
    assert loaded.rng == {"python": [1, 6]} and loaded.extra == {"k": 6}
    assert torch.equal(ranks[0].load("step:6").weights["w"], torch.full((2,), 6.0))
    assert part(0, 7) is None  # rank 1 skipped step 7: it never commits
    part(0, 8)
    part(1, 8)
    keep_newest(ranks[0])
    assert sorted(i.step for i in ranks[0].list()) == [8]
    assert sorted(p.name for p in (tmp_path / "slots" / "default").iterdir() if p.name.startswith("step-")) == [
        "step-8"]  # step 7's part went with the older slots
    for store in ranks:
        store.close()


def test_slots_refuse_a_link_or_a_directory_others_can_write(tmp_path: Path, disk: CheckpointStore) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    where = slots_dir(disk.root, "default", base=str(base))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    where.parent.symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match=r"is a symbolic link: the memory tier uses only a private directory"):
        open_slots(disk, read_only=False, base=str(base))
    assert list(elsewhere.iterdir()) == []  # nothing was created through the link
    where.parent.unlink()
    where.parent.mkdir(mode=0o777)
    os.chmod(where.parent, 0o777)
    with pytest.raises(UnsafePathError, match=r"mode 777: the memory tier uses only a private directory"):
        open_slots(disk, read_only=False, base=str(base))
    assert adopt_newer(disk, base=str(base)) is None  # a restart logs it and resumes from disk


@pytest.mark.parametrize(("blocking_ms", "write_ms", "step_ms", "every"), [
    (20.0, 300.0, 1500.0, 1),  # a LoRA adapter at Qwen2-7B width: every step
    (2.0, 5.0, 33.0, 4),  # the article job's 33 ms CPU steps: a 2 ms snapshot is 6 % of a step
    (0.1, 250.0, 100.0, 4),  # a write of 2.5 steps: the writer ends it within two thirds of the slots' distance
    (0.5, 25.0, 33.0, 2),  # a write of most of a step: every other step, not a wait at every step
    (1200.0, 30000.0, 6000.0, 10),  # a full fine-tune's state: the snapshot sets the pace
])
def test_slot_cadence_keeps_the_snapshot_within_the_budget_and_the_writer_ahead(
        blocking_ms: float, write_ms: float, step_ms: float, every: int) -> None:
    assert slot_cadence(blocking_ms, write_ms, step_ms, 0.02) == every


def test_two_slots_must_fit_in_shm_and_in_host_memory_before_the_first_is_written(tmp_path: Path,
                                                                                  disk: CheckpointStore) -> None:
    base = str(tmp_path / "shm")  # a directory on the disk: its free space plays /dev/shm
    os.mkdir(base)
    slots = open_slots(disk, read_only=False, base=base)
    assert slots is not None
    free, _ = shm_room(base)
    assert room_problem(1 << 20, slots, 0.15, base=base) is None
    problem = room_problem(free // 2, slots, 0.15, base=base)
    assert problem is not None and problem.startswith(f"two slots of {free / 2 / 2**20:.1f} MiB do not fit in {base}")
    assert "MiB kept for data loaders and NCCL); give it more (docker run --shm-size=..." in problem
    problem = room_problem(1 << 20, slots, 0.99, base=base)  # 99 % of the host memory kept free: no room for 2 MiB
    assert problem is not None and problem.startswith("two slots of 1.0 MiB do not fit in the host memory left (")
    assert problem.endswith("MiB available, 99% kept free)")
    slots.close()


def test_an_unhealthy_newest_slot_is_persisted_with_the_newest_healthy_one(tmp_path: Path,
                                                                          disk: CheckpointStore) -> None:
    base = str(tmp_path / "shm")
    os.mkdir(base)
    run = Lineage(session=disk.session_id, timeline="t1")
    _started(disk, run)
    _save(disk, 10, run)
    slots = open_slots(disk, read_only=False, base=base)
    assert slots is not None
    _save(slots, 12, run)
    slots.save(CheckpointState(step=13, weights={"w": torch.randn(4, 4)}, rng={"python": 13}),
               SaveRequest(step=13, tiers=ALL_TIERS - {"optimizer"}, reason="memory tier", lineage=run, healthy=False))
    assert persist_newest(slots, disk) == 13  # inside an anomaly: persisted, and the healthy 12 with it
    assert {i.step: i.healthy for i in disk.list(include_unhealthy=True)} == {10: True, 12: True, 13: False}
    assert disk.resolve("auto").step == 12
    slots.close()

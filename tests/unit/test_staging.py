from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from hf_dynamic_ckpt.engine.staging import Headroom, StagingMode, headroom_of, plan_staging
from hf_dynamic_ckpt.sysmem import find_cgroup_dir, read_cgroup_memory

MiB = 1 << 20


def _cgroup(tmp_path: Path, *, max_: str, current: int, inactive_file: int | None = None) -> Path:
    d = tmp_path / "cg"
    d.mkdir(exist_ok=True)
    (d / "memory.max").write_text(max_ + "\n")
    (d / "memory.current").write_text(f"{current}\n")
    if inactive_file is not None:
        (d / "memory.stat").write_text(f"anon 123\nfile 999\ninactive_file {inactive_file}\nactive_file 5\n")
    return d


def test_cgroup_headroom_subtracts_reclaimable_page_cache(tmp_path):
    d = _cgroup(tmp_path, max_=str(1000 * MiB), current=700 * MiB, inactive_file=200 * MiB)
    mem = read_cgroup_memory(d)
    assert mem is not None and (mem.limit_bytes, mem.headroom_bytes) == (1000 * MiB, 500 * MiB)
    h = headroom_of(d)
    assert (h.total_bytes, h.available_bytes, h.source) == (1000 * MiB, 500 * MiB, "cgroup")


def test_cgroup_without_limit_or_files_gives_none(tmp_path):
    assert read_cgroup_memory(_cgroup(tmp_path, max_="max", current=5)) is None
    assert read_cgroup_memory(tmp_path / "missing") is None


def test_host_headroom_prefers_the_tighter_cgroup_limit(tmp_path):
    d = _cgroup(tmp_path, max_=str(64 * MiB), current=32 * MiB)
    h = headroom_of(d)
    assert (h.source, h.total_bytes, h.available_bytes) == ("cgroup", 64 * MiB, 32 * MiB)
    unlimited = _cgroup(tmp_path, max_="max", current=1)
    h2 = headroom_of(unlimited)
    assert h2.source == "host" and h2.total_bytes == psutil.virtual_memory().total


def test_own_cgroup_dir_follows_proc_self_cgroup(tmp_path):
    mount = tmp_path / "sys"
    (mount / "kubepods" / "pod1").mkdir(parents=True)
    (mount / "kubepods" / "pod1" / "memory.max").write_text("100\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    assert find_cgroup_dir(mount, proc, require_limit=False) == mount / "kubepods" / "pod1"
    proc.write_text("4:memory:/x\n")  # cgroup v1 only
    assert find_cgroup_dir(mount, proc, require_limit=False) is None


@pytest.mark.parametrize(
    ("needed", "available", "mode"),
    [
        (0, 0, StagingMode.STREAMING),  # no room above the margin at all
        (100 * MiB, 300 * MiB, StagingMode.BUFFERED),
        (150 * MiB, 300 * MiB, StagingMode.BUFFERED),  # 300 - 15% of 1000 = 150: exactly fits
        (150 * MiB + 1, 300 * MiB, StagingMode.STREAMING),
        (10 * MiB, 100 * MiB, StagingMode.STREAMING),  # available is inside the margin
    ],
)
def test_plan_staging_keeps_the_margin_free(needed, available, mode):
    h = Headroom(total_bytes=1000 * MiB, available_bytes=available, source="cgroup")
    plan = plan_staging(needed, margin=0.15, headroom=h)
    assert plan.mode == mode
    assert plan.needed_bytes == needed


def test_streaming_plan_reason_names_the_numbers():
    h = Headroom(total_bytes=1000 * MiB, available_bytes=400 * MiB, source="cgroup")
    plan = plan_staging(300 * MiB, margin=0.15, headroom=h)
    assert plan.mode == StagingMode.STREAMING
    assert plan.reason == (
        "a buffered snapshot would need 300.0 MiB but only 250.0 MiB are free above the 15% margin of the "
        "cgroup limit (1000.0 MiB, 400.0 MiB available): saving synchronously from live tensors instead"
    )

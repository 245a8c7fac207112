"""The shared cgroup v2 / host memory reader, on a fake cgroup tree in tmp_path."""

from __future__ import annotations

from pathlib import Path

import psutil

from hf_dynamic_ckpt import sysmem
from hf_dynamic_ckpt.sysmem import (
    CgroupMemory,
    find_cgroup_dir,
    inactive_file_bytes,
    read_cgroup_memory,
    read_int,
)


def _cgroup(path: Path, *, max_: str, current: str = "700", stat: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.max").write_text(max_ + "\n")
    (path / "memory.current").write_text(current + "\n")
    if stat is not None:
        (path / "memory.stat").write_text(stat)
    return path


def test_read_int_treats_max_empty_garbage_and_missing_as_no_value(tmp_path: Path) -> None:
    f = tmp_path / "f"
    for text, expected in [("1024\n", 1024), ("max\n", None), ("", None), ("-5", None), ("12 kB", None)]:
        f.write_text(text)
        assert read_int(f) == expected, text
    assert read_int(tmp_path / "missing") is None


def test_working_set_subtracts_inactive_file_and_never_goes_negative(tmp_path: Path) -> None:
    d = _cgroup(tmp_path / "cg", max_="1000", stat="anon 1\ninactive_file 200\nactive_file 5\n")
    mem = read_cgroup_memory(d)
    assert mem == CgroupMemory(limit_bytes=1000, current_bytes=700, inactive_file_bytes=200)
    assert mem.working_set_bytes == 500
    assert CgroupMemory(limit_bytes=10, current_bytes=5, inactive_file_bytes=9).working_set_bytes == 0


def test_inactive_file_is_zero_when_memory_stat_is_missing_or_malformed(tmp_path: Path) -> None:
    d = _cgroup(tmp_path / "cg", max_="1000")
    assert inactive_file_bytes(d) == 0
    (d / "memory.stat").write_text("inactive_file lots\n")
    assert inactive_file_bytes(d) == 0
    mem = read_cgroup_memory(d)
    assert mem is not None and mem.working_set_bytes == 700


def test_read_cgroup_memory_is_none_without_a_limit_or_files(tmp_path: Path) -> None:
    assert read_cgroup_memory(_cgroup(tmp_path / "unlimited", max_="max")) is None
    assert read_cgroup_memory(_cgroup(tmp_path / "no_current", max_="1000", current="")) is None
    assert read_cgroup_memory(tmp_path / "missing") is None


def test_find_cgroup_dir_follows_proc_self_cgroup_then_the_mount(tmp_path: Path) -> None:
    mount = tmp_path / "sys"
    pod = _cgroup(mount / "kubepods" / "pod1", max_="100")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    assert find_cgroup_dir(mount, proc) == pod

    # No limit on the process's own cgroup: only require_limit=False accepts it.
    (pod / "memory.max").write_text("max\n")
    assert find_cgroup_dir(mount, proc) is None
    assert find_cgroup_dir(mount, proc, require_limit=False) == pod

    # Inside a container's cgroup namespace the mount itself carries the limit.
    _cgroup(mount, max_="4096")
    assert find_cgroup_dir(mount, proc) == mount
    proc.write_text("4:memory:/x\n")  # cgroup v1 entries only: the mount is the last candidate
    assert find_cgroup_dir(mount, proc) == mount
    assert find_cgroup_dir(tmp_path / "empty", tmp_path / "no_proc_file") is None


def test_host_memory_matches_psutil() -> None:
    vm = sysmem.host_memory()
    assert vm.total_bytes == psutil.virtual_memory().total
    assert 0 <= vm.available_bytes <= vm.total_bytes

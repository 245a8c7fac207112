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


# -- cgroup v2 hierarchy, cgroup v1, mountinfo -----------------------------------------------------

GiB = 1 << 30
V1_NO_LIMIT = "9223372036854771712"  # what cgroup v1 reports for "no limit"


def _v1(path: Path, *, limit: str = V1_NO_LIMIT, memsw: str | None = None, usage: int = 0,
        stat: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.limit_in_bytes").write_text(limit + "\n")
    if memsw is not None:
        (path / "memory.memsw.limit_in_bytes").write_text(memsw + "\n")
    (path / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (path / "memory.stat").write_text(stat)
    return path


def test_v2_memory_high_and_the_tightest_ancestor_bind(tmp_path: Path) -> None:
    parent = _cgroup(tmp_path / "cg", max_=str(4 * GiB), current=str(3 * GiB), stat="inactive_file 0\n")
    child = _cgroup(parent / "job", max_="max", current=str(1 * GiB), stat="inactive_file 0\n")
    mem = read_cgroup_memory(child)
    # The parent (4 GiB, 3 GiB used by the job and its siblings) leaves less than the unlimited child.
    assert mem is not None and (mem.limit_bytes, mem.working_set_bytes, mem.version) == (4 * GiB, 3 * GiB, 2)
    assert mem.path == parent and mem.headroom_bytes == 1 * GiB
    (child / "memory.high").write_text(str(int(1.5 * GiB)) + "\n")  # throttled above it: a limit too
    mem = read_cgroup_memory(child)
    assert mem is not None and (mem.limit_bytes, mem.path, mem.headroom_bytes) == (int(1.5 * GiB), child, GiB // 2)


def test_v1_limit_memsw_and_hierarchical_limit(tmp_path: Path) -> None:
    stat = "cache 300\nrss 500\nshmem 200\ninactive_file 50\ntotal_inactive_file 100\n"
    job = _v1(tmp_path / "memory" / "slurm" / "job_1", limit=str(2 * GiB), usage=GiB, stat=stat)
    mem = read_cgroup_memory(job)
    # usage_in_bytes counts the children too: so does total_inactive_file. Shared memory stays in.
    assert mem == CgroupMemory(limit_bytes=2 * GiB, current_bytes=GiB, inactive_file_bytes=100)
    assert mem.version == 1 and mem.working_set_bytes == GiB - 100
    _v1(job, limit=str(2 * GiB), memsw=str(GiB + GiB // 2), usage=GiB, stat=stat)  # memory + swap is tighter
    assert read_cgroup_memory(job).limit_bytes == GiB + GiB // 2
    # A limit set above this cgroup that the container cannot see: hierarchical_memory_limit.
    _v1(job, usage=GiB, stat=stat + f"hierarchical_memory_limit {int(1.25 * GiB)}\n"
                                    f"hierarchical_memsw_limit {V1_NO_LIMIT}\n")
    assert read_cgroup_memory(job).limit_bytes == int(1.25 * GiB)


def test_v1_walks_up_to_the_ancestor_with_the_least_headroom(tmp_path: Path) -> None:
    root = _v1(tmp_path / "memory", usage=20 * GiB)
    slurm = _v1(root / "slurm", limit=str(8 * GiB), usage=7 * GiB, stat="total_inactive_file 0\n")
    job = _v1(slurm / "job_1", limit=str(4 * GiB), usage=GiB, stat="total_inactive_file 0\n")
    mem = read_cgroup_memory(job)
    assert mem is not None and mem.path == slurm and mem.headroom_bytes == GiB  # 8 - 7 < 4 - 1
    _v1(slurm, usage=2 * GiB, stat="total_inactive_file 0\n")  # no limit there any more
    mem = read_cgroup_memory(job)
    assert mem is not None and mem.path == job and mem.headroom_bytes == 3 * GiB
    assert read_cgroup_memory(root) is None  # no level with a limit


def test_parse_mountinfo_and_proc_cgroup_of_a_hybrid_host() -> None:
    mountinfo = (
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
        "garbage line\n"
    )
    mounts = sysmem.parse_mountinfo(mountinfo)
    assert mounts == {1: sysmem.CgroupMount(1, Path("/sys/fs/cgroup/memory"), "/"),
                      2: sysmem.CgroupMount(2, Path("/sys/fs/cgroup/unified"), "/")}
    proc = "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpu,cpuacct:/\n0::/\n"
    assert sysmem.parse_proc_cgroup(proc) == {1: "/process_api/abc", 2: "/"}


def _mountinfo(tmp_path: Path, lines: list[str]) -> Path:
    f = tmp_path / "mountinfo"
    f.write_text("".join(f"{i} 1 0:{i} {root} {mp} rw - {fs} {fs} rw{opts}\n"
                         for i, (root, mp, fs, opts) in enumerate(lines)))
    return f


def test_find_memory_cgroup_on_v1_v2_hybrid_and_in_a_namespace(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    job = _v1(v1 / "process_api" / "abc", limit=str(GiB), usage=10)
    _v1(v1)
    unified = tmp_path / "unified"
    (unified / "user.slice").mkdir(parents=True)  # a v2 mount without the memory controller
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/process_api/abc\n0::/user.slice\n")
    info = _mountinfo(tmp_path, [("/", v1, "cgroup", ",memory"), ("/", unified, "cgroup2", "")])
    assert sysmem.find_memory_cgroup(proc, info) == job  # hybrid: v2 has no memory files, v1 does
    assert read_cgroup_memory(job).limit_bytes == GiB

    # Pure v2: the memory controller is on the unified mount.
    pod = _cgroup(unified / "kubepods" / "pod1", max_="max")
    proc.write_text("0::/kubepods/pod1\n")
    assert sysmem.find_memory_cgroup(proc, info) == pod

    # A cgroup namespace with a bind-mounted sub-tree: mount root /kubepods shows pod1 at <mount>/pod1.
    info = _mountinfo(tmp_path, [("/kubepods", unified / "kubepods", "cgroup2", "")])
    assert sysmem.find_memory_cgroup(proc, info) == pod
    # Host paths that are not visible under the mount: the mount is the container's own cgroup.
    _cgroup(unified / "kubepods", max_=str(GiB))
    proc.write_text("0::/elsewhere/pod9\n")
    assert sysmem.find_memory_cgroup(proc, info) == unified / "kubepods"
    assert sysmem.find_memory_cgroup(tmp_path / "missing", info) is None


def test_read_memory_takes_the_tighter_of_cgroup_and_host(tmp_path: Path) -> None:
    vm = psutil.virtual_memory()
    tight = _v1(tmp_path / "tight", limit=str(GiB), usage=GiB // 4, stat="total_inactive_file 0\n")
    r = sysmem.read_memory(tight)
    assert (r.source, r.limit_bytes, r.used_bytes, r.fraction) == ("cgroup", GiB, GiB // 4, 0.25)
    assert r.detail == f"cgroup v1 {tight}"
    roomy = _v1(tmp_path / "roomy", limit=str(vm.total * 4), usage=0)
    r = sysmem.read_memory(roomy)
    assert r.source == "host" and r.limit_bytes == vm.total
    assert sysmem.read_memory(None).source == "host"


def test_process_rss_reads_current_and_peak() -> None:
    current, peak = sysmem.process_rss_bytes()
    assert 0 < current <= peak
    assert abs(current - psutil.Process().memory_info().rss) < 64 << 20


def test_levels_without_a_limit_are_read_without_memory_stat_or_usage(tmp_path: Path, monkeypatch) -> None:
    # The probe runs inside every save: unlimited levels (usually every ancestor) cost two small reads.
    root = _v1(tmp_path / "memory", usage=20 * GiB, stat="total_inactive_file 5\n")
    mid = _v1(root / "pool", usage=9 * GiB, stat="total_inactive_file 5\n")
    job = _v1(mid / "job_1", limit=str(4 * GiB), usage=GiB, stat="total_inactive_file 100\n")
    v2_parent = _cgroup(tmp_path / "v2", max_="max", current=str(5 * GiB), stat="inactive_file 7\n")
    v2_job = _cgroup(v2_parent / "job", max_=str(2 * GiB), current=str(GiB), stat="inactive_file 0\n")
    stats: list[Path] = []
    usages: list[Path] = []
    real_stat, real_int = sysmem.memory_stat, sysmem.read_int
    monkeypatch.setattr(sysmem, "memory_stat", lambda d: stats.append(d) or real_stat(d))
    monkeypatch.setattr(sysmem, "read_int", lambda p: (usages.append(Path(p).parent) if Path(p).name in (
        "memory.usage_in_bytes", "memory.current") else None) or real_int(p))
    assert read_cgroup_memory(job) == CgroupMemory(limit_bytes=4 * GiB, current_bytes=GiB, inactive_file_bytes=100)
    assert stats == [job] and usages == [job]
    stats.clear()
    usages.clear()
    mem = read_cgroup_memory(v2_job)
    assert mem is not None and (mem.limit_bytes, mem.current_bytes, mem.path) == (2 * GiB, GiB, v2_job)
    assert stats == [v2_job] and usages == [v2_job]

"""Host memory as the kernel's OOM killer sees it: the cgroup limit and working set, else the machine.

A job is OOM-killed when its memory cgroup (or any ancestor) reaches its limit, not when the
machine runs out. Both cgroup versions are read:

- **v2** (unified hierarchy, recent Kubernetes and systemd): `memory.max`, and `memory.high`
  (above it the kernel throttles and reclaims hard), on this cgroup and every ancestor.
- **v1** (SLURM, older Kubernetes and Docker nodes): `memory.limit_in_bytes` and
  `memory.memsw.limit_in_bytes` (memory + swap) on this cgroup and every visible ancestor,
  plus `hierarchical_memory_limit` from `memory.stat` (covers ancestors a container cannot see).

Usage is the cgroup's *working set*, as the kubelet and docker count it: `memory.current`
(v2) or `memory.usage_in_bytes` (v1) minus the reclaimable `inactive_file` page cache. It
includes every process of the cgroup (the checkpoint writer process too) and shared memory
(snapshot buffers in `/dev/shm` are charged as `shmem`, which is not reclaimable). The level
with the least headroom (limit - working set) is the one that binds.

The process's cgroup is found from `/proc/self/cgroup` and the mounts in `/proc/self/mountinfo`
(a cgroup namespace makes the mount root the container's own cgroup). Without a limit the
machine's `MemAvailable` (`/proc/meminfo`; psutil elsewhere) applies.

Shared by the save engine's staging decision (`engine/staging.py`) and the training-signal
`MemoryProbe` (`signals/memory.py`). Paths are injectable: tests use a fake cgroup directory.

## Reading the kernel's files
The small kernel files the memory probe reads inside every save are read with one system call each.

The probe (`engine.staging.default_headroom`) reads cgroup limits, usage and `memory.stat`,
`/proc/meminfo` and `/proc/self/statm`: about nine files. Opening, stat-ing, reading and
closing each cost more than the kernel takes to generate its text. `read_kernel_file` keeps
one descriptor per path and reads it with `pread` at offset 0: procfs and cgroupfs generate
the text anew on each read from the start, so the value is as fresh as after an `open`.

Only paths under `/proc/` and `/sys/` are kept open (generated files; a regular file, such as a
test's fake cgroup, could be replaced by a rename, which a kept descriptor would not see). A
descriptor that fails (its cgroup was removed) is closed and the path opened again once. A
forked child starts with no descriptors (`/proc/self/...` opened by the parent names the
parent). At most `MAX_KEPT` are kept; files of `CHUNK` bytes or more are read whole with `open`.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

CHUNK = 1 << 16
"""Bytes read per `pread`; a file this large or larger is read again with `open`."""

MAX_KEPT = 64
"""Most descriptors kept at once (a probe uses about nine); past it, all are closed and opened again as needed."""
KEPT_UNDER = ("/proc/", "/sys/")

_lock = threading.Lock()
_fds: dict[str, int] = {}
_pid = os.getpid()


def read_kernel_file(path: str | os.PathLike[str]) -> str:
    """The text of a small kernel file, from a descriptor kept open across calls.

    Raises:
        `OSError`: the file cannot be opened or read.
        `UnicodeDecodeError`: it is not text.
    """
    global _pid
    key = os.fspath(path)
    if not key.startswith(KEPT_UNDER):
        with open(key, "rb", buffering=0) as f:
            return f.readall().decode()
    with _lock:
        if os.getpid() != _pid:
            _fds.clear()  # inherited from the parent: its /proc/self files
            _pid = os.getpid()
        for attempt in (0, 1):
            fd = _fds.get(key)
            if fd is None:
                if len(_fds) >= MAX_KEPT:
                    _close_all()
                fd = _fds[key] = os.open(key, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.pread(fd, CHUNK, 0)
                break
            except OSError:
                del _fds[key]
                os.close(fd)
                if attempt:
                    raise
    if len(data) >= CHUNK:
        with open(key, "rb", buffering=0) as f:
            data = f.readall()
    return data.decode()


def meminfo() -> tuple[int, int] | None:
    """`(MemTotal, MemAvailable)` in bytes from `/proc/meminfo`; `None` where it lacks either (not Linux,
    kernel < 3.14)."""
    try:
        text = read_kernel_file("/proc/meminfo")
    except (OSError, UnicodeDecodeError):
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            found[key] = int(rest.split()[0]) * 1024  # kB
            if len(found) == 2:
                return found["MemTotal"], found["MemAvailable"]
    return None


def kept() -> list[str]:
    """The paths whose descriptors are kept open now."""
    with _lock:
        return list(_fds)


def close_all() -> None:
    """Close every kept descriptor (the next read opens again)."""
    with _lock:
        _close_all()


def _close_all() -> None:
    for fd in _fds.values():
        os.close(fd)
    _fds.clear()


CGROUP_MOUNT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PROC_SELF_MOUNTINFO = Path("/proc/self/mountinfo")
V1_UNLIMITED = 1 << 60
"""cgroup v1 reports "no limit" as `PAGE_COUNTER_MAX` pages (about 9.2e18 bytes): anything above this is no limit."""


@dataclass(frozen=True)
class CgroupMemory:
    """One reading of the cgroup level whose memory limit binds (the least headroom).

    Attributes:
        limit_bytes (`int`): the smallest limit of that level (`memory.max`/`memory.high` on
            v2; `memory.limit_in_bytes`/`memory.memsw.limit_in_bytes` on v1).
        current_bytes (`int`): its usage (`memory.current` / `memory.usage_in_bytes`, page cache included).
        inactive_file_bytes (`int`): its reclaimable page cache from `memory.stat` (`0` if unreadable).
        version (`int`): cgroup version, `1` or `2`.
        path (`Path`, *optional*): the directory of that level.
    """

    limit_bytes: int
    current_bytes: int
    inactive_file_bytes: int
    version: int = field(default=2, compare=False)
    path: Path | None = field(default=None, compare=False)

    @property
    def working_set_bytes(self) -> int:
        """`usage - inactive_file`, never negative: what counts toward an OOM kill."""
        return max(0, self.current_bytes - self.inactive_file_bytes)

    @property
    def headroom_bytes(self) -> int:
        """`limit - working set`, never negative."""
        return max(0, self.limit_bytes - self.working_set_bytes)


@dataclass(frozen=True)
class HostMemory:
    """The machine's memory from `psutil.virtual_memory()`.

    Attributes:
        total_bytes (`int`): physical memory.
        available_bytes (`int`): what can be allocated without swapping (`MemAvailable`).
    """

    total_bytes: int
    available_bytes: int


def read_int(path: str | Path) -> int | None:
    """A non-negative integer file such as `memory.max`; `None` for `max` (no limit), empty or unreadable."""
    try:
        text = read_kernel_file(path).strip()  # one pread of a kept descriptor: probes run inside saves
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _limit(path: str | Path) -> int | None:
    """A limit file: `None` for `max`, v1's "unlimited" sentinel, missing or garbage."""
    value = read_int(path)
    return value if value is not None and value < V1_UNLIMITED else None


def memory_stat(cgroup_dir: Path) -> dict[str, int]:
    """The integer entries of `cgroup_dir/memory.stat` (`{}` when it cannot be read)."""
    out: dict[str, int] = {}
    try:
        text = read_kernel_file(f"{cgroup_dir}/memory.stat")
    except (OSError, UnicodeDecodeError) as e:
        logger.debug("cannot read %s/memory.stat (%s); counting no page cache", cgroup_dir, e)
        return out
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def inactive_file_bytes(cgroup_dir: Path) -> int:
    """The `inactive_file` entry of `cgroup_dir/memory.stat`, or `0` when it cannot be read."""
    return memory_stat(cgroup_dir).get("inactive_file", 0)


def cgroup_version(cgroup_dir: Path) -> int | None:
    """`2` for a v2 directory with the memory controller (`memory.max`), `1` for a v1 memory
    directory (`memory.limit_in_bytes`), else `None`."""
    if (cgroup_dir / "memory.max").exists():
        return 2
    if (cgroup_dir / "memory.limit_in_bytes").exists():
        return 1
    return None


def _read_level(cgroup_dir: Path, version: int, *, hierarchical: bool) -> CgroupMemory | None:
    """Limit, usage and page cache of one level; `None` without a limit or a usage file. Limits are read
    first: a level without one (usually every ancestor) costs no `memory.stat` (built per read) or usage read.
    Paths are f-strings, not `Path` joins (~8 us each, about what reading the file costs)."""
    stat: dict[str, int] = {}
    if version == 2:
        limits = [_limit(f"{cgroup_dir}/memory.max"), _limit(f"{cgroup_dir}/memory.high")]
    else:
        limits = [_limit(f"{cgroup_dir}/memory.limit_in_bytes"), _limit(f"{cgroup_dir}/memory.memsw.limit_in_bytes")]
        if hierarchical:  # ancestors a container cannot see (use_hierarchy=1; always on recent kernels)
            stat = memory_stat(cgroup_dir)
            limits += [stat.get("hierarchical_memory_limit"), stat.get("hierarchical_memsw_limit")]
    found = [x for x in limits if x is not None and x < V1_UNLIMITED]
    if not found:
        return None
    if version == 2:
        usage = read_int(f"{cgroup_dir}/memory.current")
        inactive = memory_stat(cgroup_dir).get("inactive_file", 0)
    else:
        usage = read_int(f"{cgroup_dir}/memory.usage_in_bytes")
        stat = stat or memory_stat(cgroup_dir)
        # usage_in_bytes is hierarchical (children included): so is total_inactive_file.
        inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    if usage is None:
        return None
    return CgroupMemory(limit_bytes=min(found), current_bytes=usage, inactive_file_bytes=inactive, version=version,
                        path=cgroup_dir)


def cgroup_levels(cgroup_dir: Path) -> list[tuple[Path, int]]:
    """`cgroup_dir` and its ancestors of the same cgroup version, with that version (`[]`: not a cgroup).

    The hierarchy does not change while a process runs: a probe that reads often finds it once and
    passes it to `read_cgroup_memory` / `read_memory` (limits and usage are read every time)."""
    version = cgroup_version(cgroup_dir)
    if version is None:
        return []
    levels = [(cgroup_dir, version)]
    while (parent := levels[-1][0].parent) != levels[-1][0] and cgroup_version(parent) == version:
        levels.append((parent, version))
    return levels


def read_cgroup_memory(cgroup_dir: Path, levels: list[tuple[Path, int]] | None = None) -> CgroupMemory | None:
    """The binding memory limit of a cgroup (v1 or v2) and its ancestors, with that level's usage.

    Walks from `cgroup_dir` up through every parent directory of the same cgroup version and
    returns the level with the least headroom (`limit - working set`): the kernel charges
    every page to each ancestor too, and OOM-kills when any of them reaches its limit.

    Args:
        cgroup_dir (`Path`): a v2 directory (`memory.max`, `memory.high`, `memory.current`,
            `memory.stat`) or a v1 memory directory (`memory.limit_in_bytes`,
            `memory.memsw.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat`).
        levels (`list`, *optional*): `cgroup_levels(cgroup_dir)`, found again when not given.

    Returns:
        `CgroupMemory`, or `None` when no level sets a limit or a file is missing.

    Example:
        ```python
        >>> mem = read_cgroup_memory(Path("/sys/fs/cgroup/memory/slurm/uid_0/job_1"))
        >>> mem.working_set_bytes / mem.limit_bytes if mem else None
        ```
    """
    best: CgroupMemory | None = None
    for level, version in cgroup_levels(cgroup_dir) if levels is None else levels:
        mem = _read_level(level, version, hierarchical=level == cgroup_dir)
        if mem is not None and (best is None or mem.headroom_bytes < best.headroom_bytes):
            best = mem
    return best


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup hierarchy mount from `/proc/self/mountinfo`.

    Attributes:
        version (`int`): `2` (`cgroup2`) or `1` (a `cgroup` mount with the memory controller).
        mount_point (`Path`): where it is mounted.
        root (`str`): the cgroup the mount shows at `mount_point` (`/` unless a namespace or bind mount).
    """

    version: int
    mount_point: Path
    root: str


def parse_mountinfo(text: str) -> dict[int, CgroupMount]:
    """The cgroup v2 mount and the cgroup v1 memory-controller mount in a `mountinfo` text, by version."""
    mounts: dict[int, CgroupMount] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        mount_point = Path(fields[4].replace("\\040", " "))
        if fstype == "cgroup2" and 2 not in mounts:
            mounts[2] = CgroupMount(2, mount_point, fields[3])
        elif fstype == "cgroup" and "memory" in options and 1 not in mounts:
            mounts[1] = CgroupMount(1, mount_point, fields[3])
    return mounts


def parse_proc_cgroup(text: str) -> dict[int, str]:
    """This process's cgroup paths in a `/proc/self/cgroup` text: `{2: "0::" path, 1: memory controller path}`."""
    paths: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    return paths


def _under_mount(mount: CgroupMount, path: str) -> Path:
    """The directory of cgroup `path` under `mount` (the mount may show a sub-tree, e.g. in a namespace)."""
    root = mount.root.rstrip("/")
    rel = path[len(root):] if root and (path == root or path.startswith(root + "/")) else path
    return mount.mount_point / rel.lstrip("/")


def find_memory_cgroup(proc_cgroup: Path = PROC_SELF_CGROUP, mountinfo: Path = PROC_SELF_MOUNTINFO) -> Path | None:
    """This process's memory cgroup directory (v2, else v1), limited or not; `None` when there is none.

    The path comes from `/proc/self/cgroup`, the mount point from `/proc/self/mountinfo`. A
    hybrid host (a v2 mount without the memory controller, plus v1 controllers) gives the v1
    memory directory. When the path is not visible under the mount (a cgroup namespace whose
    `/proc/self/cgroup` shows host paths), the mount point itself is the process's cgroup.

    Args:
        proc_cgroup (`Path`, *optional*, defaults to `/proc/self/cgroup`): injectable for tests.
        mountinfo (`Path`, *optional*, defaults to `/proc/self/mountinfo`): injectable for tests.

    Returns:
        `Path` or `None`: a directory `read_cgroup_memory` can read.
    """
    try:
        paths = parse_proc_cgroup(proc_cgroup.read_text())
        mounts = parse_mountinfo(mountinfo.read_text())
    except OSError as e:
        logger.debug("cannot read %s or %s (%s): no cgroup memory limit", proc_cgroup, mountinfo, e)
        return None
    for version in (2, 1):
        mount, path = mounts.get(version), paths.get(version)
        if mount is None or path is None:
            continue
        for candidate in (_under_mount(mount, path), mount.mount_point):
            if cgroup_version(candidate) == version:
                return candidate
    return None


def find_cgroup_dir(
    root: Path = CGROUP_MOUNT, proc_cgroup: Path = PROC_SELF_CGROUP, *, require_limit: bool = True
) -> Path | None:
    """This process's cgroup v2 directory under a known mount point, or `None`.

    Prefer `find_memory_cgroup` (both versions, mount points from `/proc/self/mountinfo`);
    this one checks the `0::/path` entry of `/proc/self/cgroup` under `root`, then `root` itself.

    Args:
        root (`Path`, *optional*, defaults to `/sys/fs/cgroup`): the cgroup v2 mount.
        proc_cgroup (`Path`, *optional*, defaults to `/proc/self/cgroup`): injectable for tests.
        require_limit (`bool`, *optional*, defaults to `True`): accept only a directory whose
            `memory.max` is a number; `False` accepts any directory that has a `memory.max` file.

    Returns:
        `Path` or `None`: the first candidate that qualifies.
    """
    candidates = []
    try:
        own = parse_proc_cgroup(proc_cgroup.read_text()).get(2)
        if own is not None:
            candidates.append(root / own.lstrip("/"))
    except OSError as e:
        logger.debug("cannot read %s (%s); trying the cgroup mount only", proc_cgroup, e)
    candidates.append(root)
    for path in candidates:
        memory_max = path / "memory.max"
        if (read_int(memory_max) is not None) if require_limit else memory_max.exists():
            return path
    return None


def host_memory() -> HostMemory:
    """The machine's total and available memory (`/proc/meminfo`, else `psutil.virtual_memory()`).

    Raises:
        `ImportError`: no `/proc/meminfo` and psutil is not installed.
    """
    if (found := meminfo()) is not None:
        return HostMemory(total_bytes=found[0], available_bytes=found[1])
    import psutil

    vm = psutil.virtual_memory()
    return HostMemory(total_bytes=int(vm.total), available_bytes=int(vm.available))


@dataclass(frozen=True)
class MemoryReading:
    """The memory limit that applies to this process and its use, from the tighter of cgroup and machine.

    Attributes:
        limit_bytes (`int`): cgroup limit, else the machine's physical memory.
        used_bytes (`int`): cgroup working set, else `total - available`.
        source (`str`): `"cgroup"` or `"host"`.
        detail (`str`): where it was read (e.g. `"cgroup v1 /sys/fs/cgroup/memory/job"`), for messages.
    """

    limit_bytes: int
    used_bytes: int
    source: str
    detail: str

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)

    @property
    def fraction(self) -> float:
        """`used / limit`: what the memory risk signal reports."""
        return self.used_bytes / self.limit_bytes if self.limit_bytes else 0.0


def read_memory(cgroup_dir: Path | None, levels: list[tuple[Path, int]] | None = None) -> MemoryReading | None:
    """The tighter of the cgroup's headroom (when `cgroup_dir` sets a limit) and the machine's.

    Args:
        cgroup_dir (`Path`, *optional*): from `find_memory_cgroup`; `None` reads the machine only.
        levels (`list`, *optional*): `cgroup_levels(cgroup_dir)`, when the caller keeps it.

    Returns:
        `MemoryReading`, or `None` when neither can be read (no cgroup limit and no psutil).
    """
    cg = read_cgroup_memory(cgroup_dir, levels) if cgroup_dir is not None else None
    try:
        vm: HostMemory | None = host_memory()
    except ImportError:
        vm = None
    host = None if vm is None else MemoryReading(vm.total_bytes, vm.total_bytes - vm.available_bytes, "host",
                                                   "host MemAvailable")
    if cg is None:
        return host
    cgroup = MemoryReading(cg.limit_bytes, cg.working_set_bytes, "cgroup", f"cgroup v{cg.version} {cg.path}")
    return cgroup if host is None or cgroup.available_bytes <= host.available_bytes else host


def process_rss_bytes() -> tuple[int, int]:
    """`(current, peak)` resident set size of this process in bytes (Linux `/proc/self/statm`, `ru_maxrss`).

    `peak - current`, read between two training steps, is the memory a step allocates and
    frees again (activations, gradients, optimizer temporaries): buffers held across steps
    must leave room for it. Current is `0` where `/proc` is missing.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        pages = int(read_kernel_file("/proc/self/statm").split()[1])
        current = pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        current = 0
    return current, max(peak, current)  # ru_maxrss is updated lazily: it can lag behind statm

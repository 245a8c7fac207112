"""Host memory as the kernel's OOM killer sees it: cgroup v2 limit and working set, else the machine.

On a Kubernetes node the container's limit (cgroup v2 `memory.max`) is what gets a job
OOM-killed, not the machine's free memory. The container's usage is its *working set*
(`memory.current` minus the reclaimable `inactive_file` page cache), as the kubelet counts it:
checkpoint files just written sit in the page cache and must not count as used memory.

Shared by the save engine's staging decision (`engine/staging.py`) and the training-signal
`MemoryProbe` (`signals/probes.py`). Every path is injectable, so tests use a fake cgroup
directory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_MOUNT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CgroupMemory:
    """One reading of a cgroup v2 directory that sets a memory limit.

    Attributes:
        limit_bytes (`int`): `memory.max`.
        current_bytes (`int`): `memory.current` (page cache included).
        inactive_file_bytes (`int`): reclaimable page cache from `memory.stat` (`0` if unreadable).
    """

    limit_bytes: int
    current_bytes: int
    inactive_file_bytes: int

    @property
    def working_set_bytes(self) -> int:
        """`memory.current - inactive_file`, never negative: what counts toward an OOM kill."""
        return max(0, self.current_bytes - self.inactive_file_bytes)


@dataclass(frozen=True)
class HostMemory:
    """The machine's memory from `psutil.virtual_memory()`.

    Attributes:
        total_bytes (`int`): physical memory.
        available_bytes (`int`): what can be allocated without swapping.
    """

    total_bytes: int
    available_bytes: int


def read_int(path: Path) -> int | None:
    """A non-negative integer file such as `memory.max`; `None` for `max` (no limit), empty or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def inactive_file_bytes(cgroup_dir: Path) -> int:
    """The `inactive_file` entry of `cgroup_dir/memory.stat`, or `0` when it cannot be read."""
    try:
        for line in (cgroup_dir / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "inactive_file":
                return int(value)
    except (OSError, ValueError) as e:
        logger.debug("no inactive_file in %s/memory.stat (%s); counting no page cache", cgroup_dir, e)
    return 0


def find_cgroup_dir(
    root: Path = CGROUP_MOUNT, proc_cgroup: Path = PROC_SELF_CGROUP, *, require_limit: bool = True
) -> Path | None:
    """This process's cgroup v2 directory, or `None`.

    The candidates are the `0::/path` entry of `/proc/self/cgroup` under `root`, then `root`
    itself (inside a container's cgroup namespace the mount is the container's own cgroup).

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
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                candidates.append(root / line[3:].lstrip("/"))
    except OSError as e:
        logger.debug("cannot read %s (%s); trying the cgroup mount only", proc_cgroup, e)
    candidates.append(root)
    for path in candidates:
        memory_max = path / "memory.max"
        if (read_int(memory_max) is not None) if require_limit else memory_max.exists():
            return path
    return None


def read_cgroup_memory(cgroup_dir: Path) -> CgroupMemory | None:
    """Limit, usage and reclaimable page cache of a cgroup v2 directory.

    Args:
        cgroup_dir (`Path`): directory with `memory.max`, `memory.current` and optionally
            `memory.stat`.

    Returns:
        `CgroupMemory`, or `None` when the cgroup sets no limit (`max`) or a file is missing.

    Example:
        ```python
        >>> mem = read_cgroup_memory(Path("/sys/fs/cgroup"))
        >>> mem.working_set_bytes / mem.limit_bytes if mem else None
        ```
    """
    limit = read_int(cgroup_dir / "memory.max")
    current = read_int(cgroup_dir / "memory.current")
    if limit is None or current is None:
        return None
    return CgroupMemory(limit_bytes=limit, current_bytes=current, inactive_file_bytes=inactive_file_bytes(cgroup_dir))


def host_memory() -> HostMemory:
    """The machine's total and available memory (`psutil.virtual_memory()`).

    Raises:
        `ImportError`: psutil is not installed.
    """
    import psutil

    vm = psutil.virtual_memory()
    return HostMemory(total_bytes=int(vm.total), available_bytes=int(vm.available))

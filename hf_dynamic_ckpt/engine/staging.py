"""Memory-aware staging: decide whether a buffered snapshot fits in host memory.

A buffered snapshot holds a second copy of the saved tensors in host memory until the
writer is done. On a Kubernetes node the container's limit (cgroup v2 `memory.max`) is
what gets a job OOM-killed, not the machine's free memory, so the limit wins when set.
The container's usage is its *working set* (`memory.current` minus reclaimable
`inactive_file` page cache), as the kubelet counts it: checkpoint files just written sit
in the page cache and must not count as used memory.

If the extra bytes a snapshot needs do not fit under the limit while keeping
`margin * limit` free, the engine saves in streaming mode instead: synchronously, from
the live tensors, one tensor at a time, never holding a second full copy.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_CGROUP_MOUNT = Path("/sys/fs/cgroup")


class StagingMode(enum.StrEnum):
    BUFFERED = "buffered"  # copy into reusable buffers, write in the background
    STREAMING = "streaming"  # write synchronously from live tensors, no second copy


@dataclass(frozen=True)
class Headroom:
    """Host memory as the save sees it.

    Attributes:
        total_bytes (`int`): the limit that applies (cgroup `memory.max`, else physical memory).
        available_bytes (`int`): what can still be allocated before hitting that limit.
        source (`str`): `"cgroup"` or `"host"`.
    """

    total_bytes: int
    available_bytes: int
    source: str


@dataclass(frozen=True)
class StagingPlan:
    """The staging decision for one save, with its reason (logged by the engine)."""

    mode: StagingMode
    reason: str
    needed_bytes: int
    headroom: Headroom | None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _inactive_file(cgroup_dir: Path) -> int:
    try:
        for line in (cgroup_dir / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "inactive_file":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def own_cgroup_dir(proc_cgroup: Path = Path("/proc/self/cgroup"), mount: Path = _CGROUP_MOUNT) -> Path | None:
    """The cgroup v2 directory of this process (`0::/path` in `/proc/self/cgroup`), if any."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            candidate = mount / line[3:].lstrip("/")
            if (candidate / "memory.max").exists():
                return candidate
            if (mount / "memory.max").exists():  # inside a container's cgroup namespace
                return mount
    return None


def cgroup_headroom(cgroup_dir: Path) -> Headroom | None:
    """Headroom under a cgroup v2 memory limit, or `None` when the cgroup sets no limit.

    Args:
        cgroup_dir (`Path`): directory with `memory.max`, `memory.current` (and optionally
            `memory.stat`); injectable for tests.
    """
    limit = _read_int(cgroup_dir / "memory.max")
    current = _read_int(cgroup_dir / "memory.current")
    if limit is None or current is None:
        return None
    working_set = max(0, current - _inactive_file(cgroup_dir))
    return Headroom(total_bytes=limit, available_bytes=max(0, limit - working_set), source="cgroup")


def host_headroom(cgroup_dir: Path | str | None = None) -> Headroom:
    """The memory a snapshot may use: the tighter of the cgroup limit and the machine.

    Args:
        cgroup_dir (`Path` or `str`, *optional*): cgroup v2 directory to read; by default the
            process's own cgroup (found through `/proc/self/cgroup`).

    Returns:
        `Headroom`: from the cgroup when it sets a limit that is tighter than the host,
        else from `psutil.virtual_memory()`.
    """
    import psutil

    vm = psutil.virtual_memory()
    host = Headroom(total_bytes=int(vm.total), available_bytes=int(vm.available), source="host")
    directory = Path(cgroup_dir) if cgroup_dir is not None else own_cgroup_dir()
    cg = cgroup_headroom(directory) if directory is not None else None
    if cg is None:
        return host
    if cg.available_bytes <= host.available_bytes:
        return cg
    return host


def plan_staging(needed_bytes: int, *, margin: float, headroom: Headroom) -> StagingPlan:
    """Decide between a buffered snapshot and a streaming save.

    Args:
        needed_bytes (`int`): bytes the buffered snapshot would newly allocate (buffers
            already held from earlier saves are free).
        margin (`float`): fraction of `headroom.total_bytes` that must stay free.
        headroom (`Headroom`): from `host_headroom`.

    Returns:
        `StagingPlan`: `BUFFERED` when `needed_bytes <= available - margin * total`.

    Example:
        ```python
        >>> h = Headroom(total_bytes=1000, available_bytes=400, source="cgroup")
        >>> plan_staging(300, margin=0.15, headroom=h).mode
        <StagingMode.STREAMING: 'streaming'>
        ```
    """
    reserve = int(margin * headroom.total_bytes)
    budget = headroom.available_bytes - reserve
    mib = 1 << 20
    if needed_bytes <= budget:
        return StagingPlan(
            StagingMode.BUFFERED,
            f"snapshot needs {needed_bytes / mib:.1f} MiB, {budget / mib:.1f} MiB free above the "
            f"{margin:.0%} margin ({headroom.source})",
            needed_bytes,
            headroom,
        )
    return StagingPlan(
        StagingMode.STREAMING,
        f"a buffered snapshot would need {needed_bytes / mib:.1f} MiB but only {max(budget, 0) / mib:.1f} MiB "
        f"are free above the {margin:.0%} margin of the {headroom.source} limit "
        f"({headroom.total_bytes / mib:.1f} MiB, {headroom.available_bytes / mib:.1f} MiB available): "
        "saving synchronously from live tensors instead",
        needed_bytes,
        headroom,
    )


def env_cgroup_dir() -> Path | None:
    """`HF_DYNAMIC_CKPT_CGROUP_DIR` when set: overrides the cgroup directory (tests, odd mounts)."""
    value = os.environ.get("HF_DYNAMIC_CKPT_CGROUP_DIR")
    return Path(value) if value else None

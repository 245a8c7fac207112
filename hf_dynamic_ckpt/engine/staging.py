"""Memory-aware staging: decide whether a buffered snapshot fits in host memory.

A buffered snapshot holds a second copy of the saved tensors in host memory until the
writer is done. The container's cgroup v2 limit and working set (read by
`hf_dynamic_ckpt.sysmem`) win over the machine's free memory when the limit is tighter.

If the extra bytes a snapshot needs do not fit under the limit while keeping
`margin * limit` free, the engine saves in streaming mode instead: synchronously, from
the live tensors, one tensor at a time, never holding a second full copy.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..sysmem import CGROUP_MOUNT, PROC_SELF_CGROUP, find_cgroup_dir, host_memory, read_cgroup_memory

logger = logging.getLogger(__name__)


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


def own_cgroup_dir(proc_cgroup: Path = PROC_SELF_CGROUP, mount: Path = CGROUP_MOUNT) -> Path | None:
    """The cgroup v2 directory of this process (`0::/path` in `/proc/self/cgroup`), if any.

    Any directory with a `memory.max` file qualifies, limited or not (see `sysmem.find_cgroup_dir`).
    """
    return find_cgroup_dir(mount, proc_cgroup, require_limit=False)


def cgroup_headroom(cgroup_dir: Path) -> Headroom | None:
    """Headroom under a cgroup v2 memory limit, or `None` when the cgroup sets no limit.

    Args:
        cgroup_dir (`Path`): directory with `memory.max`, `memory.current` (and optionally
            `memory.stat`); injectable for tests.
    """
    mem = read_cgroup_memory(cgroup_dir)
    if mem is None:
        return None
    return Headroom(
        total_bytes=mem.limit_bytes,
        available_bytes=max(0, mem.limit_bytes - mem.working_set_bytes),
        source="cgroup",
    )


def host_headroom(cgroup_dir: Path | str | None = None) -> Headroom:
    """The memory a snapshot may use: the tighter of the cgroup limit and the machine.

    Args:
        cgroup_dir (`Path` or `str`, *optional*): cgroup v2 directory to read; by default the
            process's own cgroup (found through `/proc/self/cgroup`).

    Returns:
        `Headroom`: from the cgroup when it sets a limit that is tighter than the host,
        else from `psutil.virtual_memory()`.
    """
    vm = host_memory()
    host = Headroom(total_bytes=vm.total_bytes, available_bytes=vm.available_bytes, source="host")
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


class Stager:
    """Makes the buffered-vs-streaming decision of each save and remembers the last one.

    Args:
        margin (`float`): fraction of the memory limit that must stay free.
        headroom (`Callable[[], Headroom]`): the memory probe (`host_headroom` by default).
    """

    def __init__(self, margin: float, headroom: Callable[[], Headroom]) -> None:
        self.margin = margin
        self.headroom = headroom
        self.last_plan: StagingPlan | None = None

    def plan(self, needed_bytes: int) -> StagingPlan:
        """The plan for a snapshot that newly allocates `needed_bytes` (0: buffered, nothing to probe)."""
        if needed_bytes == 0:
            plan = StagingPlan(StagingMode.BUFFERED, "snapshot buffers already allocated", 0, None)
        else:
            plan = plan_staging(needed_bytes, margin=self.margin, headroom=self.headroom())
            logger.debug("staging: %s", plan.reason)
        self.last_plan = plan
        return plan


def env_cgroup_dir() -> Path | None:
    """`HF_DYNAMIC_CKPT_CGROUP_DIR` when set: overrides the cgroup directory (tests, odd mounts)."""
    value = os.environ.get("HF_DYNAMIC_CKPT_CGROUP_DIR")
    return Path(value) if value else None

"""Host memory as the kernel's OOM killer sees it, and whether a save's snapshot buffers fit in it.

A job is OOM-killed when its memory cgroup (or any ancestor) reaches its limit, not when the machine runs out.
`headroom` reads this cgroup and every ancestor of the same version and returns the level with the least
headroom (limit - working set), or the machine's (`psutil`) when that is tighter. v2 (only where `memory.max`
exists): `memory.max` and `memory.high` (above it the kernel throttles). v1: `memory.limit_in_bytes`,
`memory.memsw.limit_in_bytes` and `memory.stat`'s `hierarchical_memory_limit` / `hierarchical_memsw_limit`
(ancestors a container cannot see). The working set, as the kubelet counts it, is `memory.current` (v2) or
`memory.usage_in_bytes` (v1) less the reclaimable `inactive_file` page cache (`total_inactive_file` in v1,
whose usage counts the children too); it includes every process of the cgroup and shared memory.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

MiB = 1 << 20
MIN_RESERVE_BYTES = 128 * MiB
"""The least memory kept free whatever the margin: every save path needs the store's write buffers
(L1: up to 4 zstd frames of 16 MiB in flight, input and output, about 100-130 MiB measured)."""
CGROUP_DIR_ENV = "HF_DYNAMIC_CKPT_CGROUP_DIR"
_V1_UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as 9223372036854771712


@dataclass(frozen=True)
class Headroom:
    """Host memory as a save sees it: the binding limit (`total_bytes`), what can still be allocated under it,
    where it was read (`source`: `"cgroup"` or `"host"`; `detail`), and what a training step allocates and frees
    again (`transient_bytes`: peak less current RSS), which held buffers must leave room for."""

    total_bytes: int
    available_bytes: int
    source: str
    transient_bytes: int = 0
    detail: str = field(default="", compare=False)

    @property
    def fraction(self) -> float:
        """Memory in use over the limit (the memory signal)."""
        return 1 - self.available_bytes / self.total_bytes if self.total_bytes else 0.0

    def reserve(self, margin: float) -> int:
        """Bytes kept free: `margin * total`, at least `MIN_RESERVE_BYTES`."""
        return max(int(margin * self.total_bytes), MIN_RESERVE_BYTES)

    def budget(self, margin: float) -> int:
        """Bytes that may still be held: `available - reserve - transient` (may be negative)."""
        return self.available_bytes - self.reserve(margin) - self.transient_bytes


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def _int(path: str) -> int | None:
    """A limit or usage file: `None` for `max`, v1's "unlimited", empty, garbage or missing."""
    text = _read(path).strip()
    return int(text) if text.isdigit() and int(text) < _V1_UNLIMITED else None


def _stat(directory: Path) -> dict[str, int]:
    """The integer entries of `memory.stat` (`{}` when unreadable)."""
    pairs = [line.partition(" ") for line in _read(f"{directory}/memory.stat").splitlines()]
    return {key: int(value) for key, _, value in pairs if value.strip().isdigit()}


_FILES = {2: ("memory.max", "memory.high", "memory.current"),  # per cgroup version: two limits, the usage
          1: ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.usage_in_bytes")}


def _version(directory: Path) -> int | None:  # os.path, not Path: the probe runs inside every save
    return next((v for v in (2, 1) if os.path.exists(f"{directory}/{_FILES[v][0]}")), None)


def _level(directory: Path, version: int, *, own: bool) -> tuple[int, int] | None:
    """`(limit, working set)` of one cgroup level, `None` without a limit. Limits are read first: a level without
    one (usually every ancestor) costs no usage or `memory.stat` read."""
    *limit_files, usage_file = _FILES[version]
    limits = [_int(f"{directory}/{name}") for name in limit_files]
    # v1: limits of ancestors the container cannot see (use_hierarchy=1, always on recent kernels)
    stat = _stat(directory) if own and version == 1 else {}
    limits += [stat.get("hierarchical_memory_limit"), stat.get("hierarchical_memsw_limit")]
    found = [x for x in limits if x is not None]
    usage = _int(f"{directory}/{usage_file}") if found else None
    if usage is None:
        return None
    stat = stat or _stat(directory)  # v1's usage counts the children: so does its total_inactive_file (v2: none)
    return min(found), max(0, usage - stat.get("total_inactive_file", stat.get("inactive_file", 0)))


def find_memory_cgroup(proc_cgroup: Path = Path("/proc/self/cgroup"),
                       mountinfo: Path = Path("/proc/self/mountinfo")) -> Path | None:
    """This process's memory cgroup directory (limited or not, `None` without one), from `proc_cgroup` and
    `mountinfo` (injectable for tests); `$HF_DYNAMIC_CKPT_CGROUP_DIR` overrides it. v2 where its directory has
    `memory.max`, else v1's memory controller (a hybrid host); when the path is not visible under the mount (a
    cgroup namespace showing host paths), the mount point itself is the process's cgroup."""
    if os.environ.get(CGROUP_DIR_ENV):
        return Path(os.environ[CGROUP_DIR_ENV])
    paths: dict[int, str] = {}
    mounts: dict[int, tuple[Path, str]] = {}
    try:
        for line in proc_cgroup.read_text().splitlines():
            hid, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            memory = "memory" in controllers.split(",")
            paths.setdefault(2 if hid == "0" and not controllers else 1 if memory else 0, path)
        for line in mountinfo.read_text().splitlines():
            left, sep, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if sep and len(fields) >= 5 and len(tail) >= 3:
                memory = tail[0] == "cgroup" and "memory" in tail[2].split(",")
                where = (Path(fields[4].replace("\\040", " ")), fields[3].rstrip("/"))
                mounts.setdefault(2 if tail[0] == "cgroup2" else 1 if memory else 0, where)
    except OSError as e:
        logger.debug("cannot read %s or %s (%s): no cgroup memory limit", proc_cgroup, mountinfo, e)
        return None
    for version in (2, 1):
        if version not in mounts or version not in paths:
            continue
        (mount, root), path = mounts[version], paths[version]
        if root and (path == root or path.startswith(root + "/")):
            path = path[len(root):]
        for candidate in (mount / path.lstrip("/"), mount):
            if _version(candidate) == version:
                return candidate
    return None


def headroom(cgroup_dir: Path | None) -> Headroom:
    """The memory this process may still use: the binding level of `cgroup_dir` (from `find_memory_cgroup`) and
    its ancestors, or the machine's available memory when that is tighter (or `cgroup_dir` is `None`).

    Example:
        ```python
        >>> room = headroom(find_memory_cgroup())
        >>> room.budget(0.15) > 0  # a snapshot of that many bytes fits above a 15 % margin
        ```
    """
    best: tuple[int, int, Path] | None = None
    version = _version(cgroup_dir) if cgroup_dir is not None else None
    level = cgroup_dir
    while version is not None and level is not None:
        found = _level(level, version, own=level == cgroup_dir)
        if found is not None and (best is None or found[0] - found[1] < best[0] - best[1]):
            best = (*found, level)
        level = level.parent if level.parent != level and _version(level.parent) == version else None
    vm = psutil.virtual_memory()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; updated lazily
    transient = max(0, peak - psutil.Process().memory_info().rss)
    if best is not None and best[0] - best[1] <= vm.available:
        return Headroom(best[0], max(0, best[0] - best[1]), "cgroup", transient, f"cgroup v{version} {best[2]}")
    return Headroom(int(vm.total), int(vm.available), "host", transient, "host MemAvailable")


@dataclass(frozen=True)
class StagingPlan:
    """A save's staging decision: `mode` is `"buffered"` (copy into held buffers, write in the background) or
    `"streaming"` (release the buffers, write synchronously from the live tensors), with its `reason`."""

    mode: str
    reason: str
    needed_bytes: int = 0
    headroom: Headroom | None = None


def plan_staging(needed_bytes: int, *, margin: float, headroom: Headroom, held_bytes: int = 0) -> StagingPlan:
    """Buffered when the `needed_bytes` a snapshot newly allocates fit in `headroom.budget(margin)`, else streaming
    (also when the `held_bytes` of buffers held from earlier saves no longer leave room above the margin)."""
    budget, reserve = headroom.budget(margin), headroom.reserve(margin)
    kept = f"{margin:.0%} margin" if reserve > MIN_RESERVE_BYTES else f"{reserve / MiB:.0f} MiB reserve"
    step = f", {headroom.transient_bytes / MiB:.1f} MiB kept for a training step" if headroom.transient_bytes else ""
    if needed_bytes <= budget:
        if not needed_bytes and held_bytes:
            return StagingPlan("buffered", "snapshot buffers already allocated", 0, headroom)
        return StagingPlan("buffered", f"snapshot needs {needed_bytes / MiB:.1f} MiB, {budget / MiB:.1f} MiB free "
                                       f"above the {kept} ({headroom.source}{step})", needed_bytes, headroom)
    limit = (f"the {headroom.source} limit ({headroom.total_bytes / MiB:.1f} MiB, "
             f"{headroom.available_bytes / MiB:.1f} MiB available{step})")
    if not needed_bytes:
        reason = (f"the {held_bytes / MiB:.1f} MiB of snapshot buffers held leave {budget / MiB:.1f} MiB above the "
                  f"{kept} of {limit}: releasing them and saving synchronously from live tensors")
    else:
        reason = (f"a buffered snapshot would need {needed_bytes / MiB:.1f} MiB but only {max(budget, 0) / MiB:.1f} "
                  f"MiB are free above the {kept} of {limit}: saving synchronously from live tensors instead")
    return StagingPlan("streaming", reason, needed_bytes, headroom)

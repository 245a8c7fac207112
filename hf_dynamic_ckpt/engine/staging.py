"""Memory-aware staging: decide whether a buffered snapshot fits in host memory.

A buffered snapshot holds a second copy of the saved tensors in host memory (pinned for
CUDA sources, shared memory for a writer process: all of it counts against the same
limit) from the save until the next one reuses it. The memory limit is the one the
kernel enforces (`hf_dynamic_ckpt.sysmem`: cgroup v1 or v2, every ancestor, working set
including the writer process and shared memory), else the machine's available memory.

Before every save the engine compares what the snapshot would newly allocate with the
*budget*: available memory, minus the reserve (`margin * limit`, at least `MIN_RESERVE_BYTES`
for the store's own write buffers), minus what a training step allocates
and frees again (this process's peak RSS minus its current RSS: buffers held across steps
must leave room for the next step's activations). When the snapshot does not fit, or the
buffers already held no longer fit, the buffers are released and the save *streams*:
synchronously, from the live tensors, one tensor at a time through the store's writer,
never holding a second copy. The save blocks for the write instead of risking an OOM kill.

When a save only reuses the buffers it holds (every save after the first, and the first after
`prepare`), it allocates nothing: the probe then reads on a background thread while the
snapshot copies into the buffers (`Stager.probe_async`), and the engine discards the copy and
streams if the held buffers turned out not to fit. The probe (cgroup files and
`/proc/meminfo`) costs about as much as copying a LoRA adapter's state.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sysmem import (
    cgroup_levels,
    find_memory_cgroup,
    process_rss_bytes,
    read_memory,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
MIN_RESERVE_BYTES = 128 * MiB
"""The least memory kept free whatever the margin: every save path needs the store's write buffers
(L1: up to 4 zstd frames of 16 MiB in flight, input and output, about 100-130 MiB measured)."""
PROCESS_WRITER_MIN_BUDGET = 4 << 30
"""Under a cgroup limit, the budget below which the engine writes on a thread, not a writer process:
a second interpreter with torch costs a few hundred MiB of the limit (docs/benchmarks.md, `bench_memory.py`),
and it cannot be known at start-up how much a training step will take."""


class StagingMode(enum.StrEnum):
    BUFFERED = "buffered"  # copy into reusable buffers, write in the background
    STREAMING = "streaming"  # write synchronously from live tensors, no second copy


@dataclass(frozen=True)
class Headroom:
    """Host memory as the save sees it.

    Attributes:
        total_bytes (`int`): the limit that applies (cgroup limit, else physical memory).
        available_bytes (`int`): what can still be allocated before hitting that limit.
        source (`str`): `"cgroup"` or `"host"`.
        transient_bytes (`int`, *optional*, defaults to `0`): what a training step allocates
            and frees again (peak minus current RSS); held buffers must leave room for it.
        detail (`str`, *optional*): where the limit was read, for messages.
    """

    total_bytes: int
    available_bytes: int
    source: str
    transient_bytes: int = 0
    detail: str = field(default="", compare=False)

    def reserve(self, margin: float) -> int:
        """Bytes kept free: `margin * total`, at least `MIN_RESERVE_BYTES`."""
        return max(int(margin * self.total_bytes), MIN_RESERVE_BYTES)

    def budget(self, margin: float) -> int:
        """Bytes that may still be held: `available - reserve - transient` (may be negative)."""
        return self.available_bytes - self.reserve(margin) - self.transient_bytes


@dataclass(frozen=True)
class StagingPlan:
    """The staging decision for one save, with its reason (logged by the engine)."""

    mode: StagingMode
    reason: str
    needed_bytes: int
    headroom: Headroom | None


def headroom_of(directory: Path | None, levels: list[tuple[Path, int]] | None = None) -> Headroom:
    """The memory a snapshot may use: the tighter of the cgroup limit of `directory` (v1 or v2, ancestors included;
    `None`: the machine's memory only) and the machine (`psutil`), with `transient_bytes` from this process's RSS
    peak. `levels`: the directory's `sysmem.cgroup_levels`, when the caller keeps them (the engine's probe)."""
    reading = read_memory(directory, levels)
    current, peak = process_rss_bytes()
    transient = max(0, peak - current) if current else 0
    if reading is None:  # no cgroup limit and no psutil: nothing is known, nothing is held back
        return Headroom(total_bytes=0, available_bytes=0, source="host", detail="unknown (psutil missing)")
    return Headroom(total_bytes=reading.limit_bytes, available_bytes=reading.available_bytes, source=reading.source,
                    transient_bytes=transient, detail=reading.detail)


def plan_staging(needed_bytes: int, *, margin: float, headroom: Headroom, held_bytes: int = 0) -> StagingPlan:
    """Decide between a buffered snapshot and a streaming save.

    Args:
        needed_bytes (`int`): bytes the buffered snapshot would newly allocate (buffers
            already held from earlier saves are free).
        margin (`float`): fraction of `headroom.total_bytes` that must stay free.
        headroom (`Headroom`): from `headroom_of`.
        held_bytes (`int`, *optional*, defaults to `0`): buffers held now (already part of the
            used memory); when even they do not fit, the plan streams so that they are released.

    Returns:
        `StagingPlan`: `BUFFERED` when `needed_bytes <= available - reserve - transient`.

    Example:
        ```python
        >>> h = Headroom(total_bytes=1000, available_bytes=400, source="cgroup")
        >>> plan_staging(300, margin=0.15, headroom=h).mode
        <StagingMode.STREAMING: 'streaming'>
        ```
    """
    budget = headroom.budget(margin)
    reserve = headroom.reserve(margin)
    kept = f"{margin:.0%} margin" if reserve > MIN_RESERVE_BYTES else f"{reserve / MiB:.0f} MiB reserve"
    step_mib = headroom.transient_bytes / MiB
    transient = f", {step_mib:.1f} MiB kept for a training step" if headroom.transient_bytes else ""
    if needed_bytes <= budget:
        held = f" ({held_bytes / MiB:.1f} MiB held)" if held_bytes else ""
        return StagingPlan(
            StagingMode.BUFFERED,
            f"snapshot needs {needed_bytes / MiB:.1f} MiB{held}, {budget / MiB:.1f} MiB free above the "
            f"{kept} ({headroom.source}{transient})",
            needed_bytes,
            headroom,
        )
    limit = (f"the {headroom.source} limit ({headroom.total_bytes / MiB:.1f} MiB, "
             f"{headroom.available_bytes / MiB:.1f} MiB available{transient})")
    if needed_bytes == 0:
        reason = (f"the {held_bytes / MiB:.1f} MiB of snapshot buffers held leave {budget / MiB:.1f} MiB above "
                  f"the {kept} of {limit}: releasing them and saving synchronously from live tensors")
    else:
        reason = (f"a buffered snapshot would need {needed_bytes / MiB:.1f} MiB but only "
                  f"{max(budget, 0) / MiB:.1f} MiB "
                  f"are free above the {kept} of {limit}: saving synchronously from live tensors instead")
    return StagingPlan(StagingMode.STREAMING, reason, needed_bytes, headroom)


class Stager:
    """Makes the buffered-vs-streaming decision of each save and remembers the last one.

    Args:
        margin (`float`): fraction of the memory limit that must stay free.
        headroom (`Callable[[], Headroom]`): the memory probe (`default_headroom`).
    """

    def __init__(self, margin: float, headroom: Callable[[], Headroom]) -> None:
        self.margin = margin
        self.headroom = headroom
        self.last_plan: StagingPlan | None = None
        self.streamed = False
        self._prober: ThreadPoolExecutor | None = None

    def plan(self, needed_bytes: int, held_bytes: int = 0, *, headroom: Headroom | None = None) -> StagingPlan:
        """The plan for a snapshot that newly allocates `needed_bytes` while `held_bytes` of buffers are held
        (`headroom`: a probe already read, e.g. by `probe_async`; read now when not given)."""
        if needed_bytes == 0 and held_bytes == 0:
            plan = StagingPlan(StagingMode.BUFFERED, "nothing to stage", 0, None)
        else:
            headroom = headroom if headroom is not None else self.headroom()
            plan = plan_staging(needed_bytes, margin=self.margin, headroom=headroom, held_bytes=held_bytes)
            if needed_bytes == 0 and plan.mode == StagingMode.BUFFERED:  # the held buffers still fit
                plan = StagingPlan(StagingMode.BUFFERED, "snapshot buffers already allocated", 0, plan.headroom)
            logger.debug("staging: %s", plan.reason)
        self.last_plan = plan
        return plan

    def plan_copying(self, needed_bytes: int, held_bytes: int, take: Callable[[], Any]) -> tuple[StagingPlan, Any]:
        """`plan`, and when the snapshot only reuses held buffers, `take()`'s snapshot copied while the
        probe reads (`None` otherwise: the plan must come before an allocation). A streaming plan means
        the caller discards that snapshot."""
        if needed_bytes or not held_bytes:
            return self.plan(needed_bytes, held_bytes), None
        probe = self.probe_async()
        snapshot = take()
        return self.plan(0, held_bytes, headroom=probe.result()), snapshot

    def probe_async(self) -> Future[Headroom]:
        """Read the memory probe on the stager's thread (started on first use) while the caller copies."""
        if self._prober is None:
            self._prober = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_dynamic_ckpt-memprobe")
        return self._prober.submit(self.headroom)

    def close(self) -> None:
        """Stop the probe thread (idempotent; `probe_async` starts a new one)."""
        prober, self._prober = self._prober, None
        if prober is not None:
            prober.shutdown(wait=True)

    def stream(self, step: int, plan: StagingPlan) -> None:
        """Log a streaming save: the run's first at WARNING (it is short of memory), later ones at DEBUG."""
        level = logging.DEBUG if self.streamed else logging.WARNING
        logger.log(level, "save of step %d streams synchronously: %s", step, plan.reason)
        self.streamed = True

    def limited(self) -> Headroom | None:
        """The headroom when a cgroup limit binds (a training step's peak is then worth waiting for), else `None`."""
        headroom = self.headroom()
        return headroom if headroom.source == "cgroup" else None

    def writer_process_fits(self) -> bool:
        """Whether a writer process (a second interpreter) may be started: always without a cgroup
        limit, else only with `PROCESS_WRITER_MIN_BUDGET` to spare."""
        headroom = self.limited()
        if headroom is None or headroom.budget(self.margin) >= PROCESS_WRITER_MIN_BUDGET:
            return True
        logger.info("memory limit (%s, %.1f MiB available, %.0f%% margin): the checkpoint writer runs on a thread, "
                    "not in a second process", headroom.detail or headroom.source, headroom.available_bytes / MiB,
                    self.margin * 100)
        return False


def env_cgroup_dir() -> Path | None:
    """`HF_DYNAMIC_CKPT_CGROUP_DIR` when set: overrides the cgroup directory (tests, odd mounts)."""
    value = os.environ.get("HF_DYNAMIC_CKPT_CGROUP_DIR")
    return Path(value) if value else None


def default_headroom(cgroup_dir: str | os.PathLike[str] | None) -> Callable[[], Headroom]:
    """The engine's memory probe: `headroom_of` `cgroup_dir`, else `$HF_DYNAMIC_CKPT_CGROUP_DIR`,
    else the process's own memory cgroup."""
    directory = Path(cgroup_dir) if cgroup_dir is not None else env_cgroup_dir()
    found = directory if directory is not None else find_memory_cgroup()  # once: ~1 ms, not per save
    levels = cgroup_levels(found) if found is not None else None
    return lambda: headroom_of(found, levels)

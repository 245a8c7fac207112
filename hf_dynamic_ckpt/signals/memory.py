"""`MemoryProbe`: device and host memory in use, sampled every few steps."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from .. import sysmem

logger = logging.getLogger(__name__)


class MemoryProbe:
    """Device and host memory in use, as fractions, sampled every `sample_every` steps.

    Device: the larger of the CUDA caching allocator's reserved bytes and NVML's used bytes
    (other processes and fragmentation included) over the device total. Host: what the
    save engine's staging reads too (`sysmem.headroom`): the working set of the binding
    cgroup limit (v1 or v2, ancestors included; usage minus reclaimable page cache, the
    writer process and shared memory included) over that limit, else the machine's
    `(total - available) / total`, whichever leaves less memory available.

    Args:
        sample_every (`int`, *optional*, defaults to `5`): steps between samples; sampling
            every step is measurably slow with NVML.
        cgroup_dir (`str` or `Path`, *optional*): cgroup directory to read (v1 or v2); `None`
            finds this process's memory cgroup (`sysmem.find_memory_cgroup`); `False` never
            uses cgroups.
        device (`int`, *optional*): CUDA device index; defaults to the current device.
    """

    def __init__(self, sample_every: int = 5, *, cgroup_dir: str | os.PathLike[str] | bool | None = None,
                 device: int | None = None) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every={sample_every} is invalid: expected an integer >= 1.")
        self.sample_every = sample_every
        if cgroup_dir is False:
            self.cgroup_dir: Path | None = None
        elif cgroup_dir is None or cgroup_dir is True:
            self.cgroup_dir = sysmem.find_memory_cgroup()  # limited or not: a limit may be set later
        else:
            self.cgroup_dir = Path(cgroup_dir)
        self.device = device
        self._nvml_handle: Any = None
        self._nvml_failed = False

    def sample(self, step: int) -> tuple[float | None, float | None]:
        """`(device_frac, host_frac)` on steps divisible by `sample_every`, else `(None, None)`."""
        if step % self.sample_every:
            return None, None
        return self.read()

    def read(self) -> tuple[float | None, float | None]:
        """Sample now: `(device_frac, host_frac)`; `None` for what cannot be measured."""
        return self.device_fraction(), self.host_fraction()

    def host_fraction(self) -> float | None:
        """Host memory in use over its limit: the binding cgroup's working set when limited, else the machine's."""
        return sysmem.headroom(self.cgroup_dir).fraction

    def device_fraction(self) -> float | None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        dev = torch.cuda.current_device() if self.device is None else self.device
        total = torch.cuda.get_device_properties(dev).total_memory
        frac = torch.cuda.memory_reserved(dev) / total
        used = self._nvml_used(dev)
        return max(frac, used / total) if used is not None else frac

    def _nvml_used(self, dev: int) -> int | None:
        if self._nvml_failed:
            return None
        try:
            import pynvml

            if self._nvml_handle is None:
                pynvml.nvmlInit()
                uuid = str(torch.cuda.get_device_properties(dev).uuid)
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            return int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).used)
        except Exception as e:  # NVML missing or unusable (containers): the allocator view remains
            logger.debug("NVML unavailable (%s); using the CUDA allocator only", e)
            self._nvml_failed = True
            return None

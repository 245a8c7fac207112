"""On a GPU: the device-memory signal the policy reads (`MemoryProbe.device_fraction`) follows NVML."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

# The one internal import of this check: the probe itself (no public API exposes one reading).
from hf_dynamic_ckpt.signals import MemoryProbe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GIB = 1024**3


def _nvml_used_fraction() -> float:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return float(info.used) / float(info.total)
    finally:
        pynvml.nvmlShutdown()


def test_device_memory_signal_reads_nvml_and_follows_an_allocation(record_property: Any) -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # a CUDA context: what NVML counts beyond the caching allocator
    probe = MemoryProbe(sample_every=1, cgroup_dir=False)
    before = probe.device_fraction()
    assert before is not None
    # NVML sees the context and other processes, the allocator does not: the signal is the larger.
    nvml_before = _nvml_used_fraction()
    assert before >= nvml_before - 0.005, (before, nvml_before)

    total = torch.cuda.get_device_properties(0).total_memory
    size = min(4 * GIB, total // 4)
    block = torch.empty(size, dtype=torch.uint8, device="cuda")
    start = time.perf_counter()
    after = probe.device_fraction()
    read_ms = (time.perf_counter() - start) * 1e3
    assert after is not None
    grew = (after - before) * total
    record_property("signal before / after", f"{before:.4f} / {after:.4f} (NVML before {nvml_before:.4f})")
    record_property("grew by GiB (allocated)", f"{grew / GIB:.2f} ({size / GIB:.2f})")
    record_property("one reading ms", f"{read_ms:.2f}")
    assert grew >= 0.9 * size, (before, after, size)
    del block

"""The sensing layer of one run: the probes a `RunOrchestrator` installs, and the per-step frame.

`Sensors.measure` reads every probe once per optimizer step and reduces the frame across
ranks in one collective (`distributed.reduce_frame`), so the policy on every rank sees the
same numbers; the frame also carries the rank's save blocking time and a fingerprint of the
decisions taken so far, which the reduction compares.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from .. import distributed as dist
from ..config import SmartCkptConfig
from ..signals.frame import SignalFrame
from ..signals.memory import MemoryProbe
from ..signals.preemption import PreemptionFlag
from ..signals.probes import ClipNormRecorder, GradProbe, LossProbe


class Sensors:
    """Loss hook, gradient norms (incl. LoRA layers), memory, preemption flag and pre-clip norm.

    Args:
        config (`SmartCkptConfig`): memory sampling period and preemption signals.
        model (`nn.Module`): the trained model (gradients and LoRA layers are read from it).
        loss_model (`nn.Module`, *optional*): module whose forward output carries `loss`.
        clip_owner (*optional*): object whose `clip_grad_norm_` returns the pre-clip norm.
    """

    def __init__(self, config: SmartCkptConfig, model: nn.Module, *, loss_model: nn.Module | None = None,
                 clip_owner: Any | None = None) -> None:
        self.loss = LossProbe(loss_model if loss_model is not None else model)
        self.grad = GradProbe(model, sum_across_ranks=dist.all_reduce_square_sums)
        self.mem = MemoryProbe(config.policy.memory_sample_every)
        self.flag = PreemptionFlag(config.runtime.preemption_signals)
        self.flag.install()
        self.clip = ClipNormRecorder(clip_owner) if clip_owner is not None else None
        self._last_t: float | None = None

    def measure(self, step: int, *, save_blocking_s: float | None, fingerprint: float) -> SignalFrame:
        """This step's frame, reduced across ranks (identical on every rank).

        Raises:
            `DistributedError`: another rank died, or the ranks' fingerprints differ.
        """
        loss_t = self.loss.pop()
        pre_clip = self.clip.pop() if self.clip is not None else None
        fields = self.grad.frame_fields(pre_clip)
        device_mem, host_mem = self.mem.sample(step)
        now = time.perf_counter()
        step_time = None if self._last_t is None else now - self._last_t
        self._last_t = now
        frame = SignalFrame(
            step=step, loss=None if loss_t is None else float(loss_t), device_mem_frac=device_mem,
            host_mem_frac=host_mem, step_time_s=step_time, save_blocking_s=save_blocking_s,
            clip_norm=self.clip.max_norm if self.clip is not None else None, preempt=self.flag.is_set, **fields,
        )
        return dist.reduce_frame(frame, layer_names=self.grad.layer_names, fingerprint=fingerprint)

    def remove(self) -> None:
        """Remove the hooks and restore the signal handlers and the wrapped `clip_grad_norm_`."""
        self.loss.remove()
        if self.clip is not None:
            self.clip.remove()
        self.flag.uninstall()

"""The sensing layer of one run: the probes a `RunOrchestrator` installs, read once per optimizer step into a frame
that is reduced across ranks in one collective (`distributed.reduce_frame`, which also compares a fingerprint of the
decisions so far), so the policy on every rank sees the same numbers."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

from torch import nn

from .. import distributed as dist
from ..config import SmartCkptConfig
from ..signals import ClipNormRecorder, GradProbe, LossProbe, MemoryProbe, SignalFrame

logger = logging.getLogger(__name__)


class PreemptionFlag:
    """Signal handlers that only set the flag (`is_set`, the frame's `preempt`); the save happens at the next step
    boundary. A previous Python handler is chained (called after the flag is set); the default action (terminate) is
    not: not dying immediately is the point. `install()` (main thread only) and `uninstall()` are idempotent."""

    def __init__(self, signals: Iterable[str | int] = ("SIGTERM", "SIGUSR1")) -> None:
        self.signals = [signal.Signals[s] if isinstance(s, str) else signal.Signals(s) for s in signals]
        self._previous: dict[signal.Signals, Any] = {}
        self.signum: int | None = None
        self.is_set = False

    installed = property(lambda self: bool(self._previous))

    def set(self, signum: int | None = None) -> None:
        """Raise the flag by hand (e.g. from a scheduler's HTTP notice)."""
        self.signum, self.is_set = signum, True

    def clear(self) -> None:
        self.signum, self.is_set = None, False

    def _handler(self, signum: int, frame: Any) -> None:
        # No logging here: a handler may interrupt code that holds the logging lock.
        self.set(signum)
        if callable(previous := self._previous.get(signal.Signals(signum))):
            previous(signum, frame)

    def install(self) -> bool:
        """Install the handlers; returns `False` (and logs) when not on the main thread."""
        if self._previous:
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("PreemptionFlag.install() called off the main thread: preemption signals are not watched.")
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return True

    def uninstall(self) -> None:
        """Put the previous handlers back where ours is still the active one (idempotent)."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handler:  # else another handler replaced ours: it stays
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


class Sensors:
    """Loss hook (on `loss_model`, default `model`), gradient norms (incl. LoRA layers), memory, preemption flag and
    the pre-clip norm of `clip_owner.clip_grad_norm_`."""

    def __init__(self, config: SmartCkptConfig, model: nn.Module, *, loss_model: nn.Module | None = None,
                 clip_owner: Any | None = None) -> None:
        self.loss = LossProbe(loss_model if loss_model is not None else model)
        self.grad = GradProbe(model, sum_across_ranks=dist.all_reduce_square_sums)
        self.mem = MemoryProbe(config.policy.memory_sample_every)
        self.flag = PreemptionFlag(config.runtime.preemption_signals)
        self.flag.install()
        self.clip = ClipNormRecorder(clip_owner) if clip_owner is not None else None
        self._last_t: float | None = None

    def measure(self, step: int, *, save_blocking_s: float | None, fingerprint: float,
                pre_clip_norm: float | None = None, clip_norm: float | None = None,
                slot: tuple[float, float] | None = None) -> SignalFrame:
        """This step's frame, identical on every rank (`DistributedError`: another rank died, or the ranks'
        fingerprints differ). `slot`: this rank's `MemoryTier.plan`; `pre_clip_norm`, `clip_norm`: from elsewhere (a
        DeepSpeed engine's), replacing the recorder's."""
        loss_t = self.loss.pop()
        pre_clip = self.clip.pop() if self.clip is not None else None
        fields = self.grad.frame_fields(pre_clip_norm if pre_clip_norm is not None else pre_clip)
        device_mem, host_mem = self.mem.sample(step)
        self._last_t, last = time.perf_counter(), self._last_t
        frame = SignalFrame(
            step=step, loss=None if loss_t is None else float(loss_t), device_mem_frac=device_mem,
            host_mem_frac=host_mem, step_time_s=None if last is None else self._last_t - last,
            save_blocking_s=save_blocking_s, preempt=self.flag.is_set,
            clip_norm=clip_norm if clip_norm is not None else self.clip.max_norm if self.clip is not None else None,
            slot_every=slot[0] if slot else None, slot_blocked=slot[1] if slot else None, **fields)
        return dist.reduce_frame(frame, layer_names=self.grad.layer_names, fingerprint=fingerprint)

    def remove(self) -> None:
        """Remove the hooks and restore the signal handlers and the wrapped `clip_grad_norm_`."""
        self.loss.remove()
        if self.clip is not None:
            self.clip.remove()
        self.flag.uninstall()

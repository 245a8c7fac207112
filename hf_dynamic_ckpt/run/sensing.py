"""The sensing layer of one run: the probes a `RunOrchestrator` installs, and the per-step frame.

`Sensors.measure` reads every probe once per optimizer step and reduces the frame across
ranks in one collective (`distributed.reduce_frame`), so the policy on every rank sees the
same numbers; the frame also carries the rank's save blocking time and a fingerprint of the
decisions taken so far, which the reduction compares.

`PreemptionFlag` is how a POSIX signal (SIGTERM, SIGUSR1) becomes the frame's `preempt`: the
handler only sets a flag, the save happens at the next step boundary.
"""

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
    """Signal handlers that only set a flag; the save happens at the next step boundary.

    Any previous Python handler is chained (called after the flag is set), so a
    framework's own handler keeps working. The default action (terminate) is *not*
    chained: not dying immediately is the point. `install()` and `uninstall()` are
    idempotent; handlers can only be installed from the main thread.

    Args:
        signals (`Iterable[str | int]`, *optional*, defaults to `("SIGTERM", "SIGUSR1")`).

    Example:
        ```python
        >>> flag = PreemptionFlag()
        >>> flag.install()
        >>> if flag.is_set: ...   # at a step boundary: save once, then exit
        >>> flag.uninstall()
        ```
    """

    def __init__(self, signals: Iterable[str | int] = ("SIGTERM", "SIGUSR1")) -> None:
        self.signals = [signal.Signals[s] if isinstance(s, str) else signal.Signals(s) for s in signals]
        self._previous: dict[signal.Signals, Any] = {}
        self._event = threading.Event()
        self.signum: int | None = None

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def set(self, signum: int | None = None) -> None:
        """Raise the flag by hand (e.g. from a scheduler's HTTP notice)."""
        self.signum = signum
        self._event.set()

    def clear(self) -> None:
        self.signum = None
        self._event.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        # No logging here: a handler may interrupt code that holds the logging lock.
        self.set(signum)
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
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
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            else:
                logger.debug("handler of %s was replaced after install; leaving it", sig.name)
        self._previous = {}

    def __enter__(self) -> PreemptionFlag:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


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

    def measure(self, step: int, *, save_blocking_s: float | None, fingerprint: float,
                pre_clip_norm: float | None = None, clip_norm: float | None = None,
                slot: tuple[float, float] | None = None) -> SignalFrame:
        """This step's frame, reduced across ranks (identical on every rank).

        `slot`: the memory tier's (`slot_every`, `slot_blocked`) on this rank (`MemoryTier.plan`).

        `pre_clip_norm`, `clip_norm`: the step's pre-clip global norm and the clipping threshold from elsewhere (a
        DeepSpeed engine's, read before the loop's `clip_grad_norm_` call); the recorder's value, of an earlier
        call, is dropped then.

        Raises:
            `DistributedError`: another rank died, or the ranks' fingerprints differ.
        """
        loss_t = self.loss.pop()
        pre_clip = self.clip.pop() if self.clip is not None else None
        if pre_clip_norm is not None:
            pre_clip = pre_clip_norm
        fields = self.grad.frame_fields(pre_clip)
        device_mem, host_mem = self.mem.sample(step)
        now = time.perf_counter()
        step_time = None if self._last_t is None else now - self._last_t
        self._last_t = now
        frame = SignalFrame(
            step=step, loss=None if loss_t is None else float(loss_t), device_mem_frac=device_mem,
            host_mem_frac=host_mem, step_time_s=step_time, save_blocking_s=save_blocking_s,
            clip_norm=clip_norm if clip_norm is not None else self.clip.max_norm if self.clip is not None else None,
            preempt=self.flag.is_set, slot_every=slot[0] if slot else None, slot_blocked=slot[1] if slot else None,
            **fields,
        )
        return dist.reduce_frame(frame, layer_names=self.grad.layer_names, fingerprint=fingerprint)

    def remove(self) -> None:
        """Remove the hooks and restore the signal handlers and the wrapped `clip_grad_norm_`."""
        self.loss.remove()
        if self.clip is not None:
            self.clip.remove()
        self.flag.uninstall()

"""Overlapped snapshots: the parameters and optimizer moments are copied while the next forward and backward run.

Forward and backward leave the optimizer's parameters and `state` alone, so their copy waits for the next
`optimizer.step()` (CUDA tensors: queued at the save on a side stream the current stream is not ordered after;
host tensors: copied by the writer's IPC thread before it ships the job); everything else is copied at the save.
Invariants: a step and a `load_state_dict` pre-hook on the innermost optimizer hold the next real
`optimizer.step()` until the copy is done (CUDA: the current stream is ordered after it, no host wait); the engine
waits there too before a second save, an emergency save, `wait()` and `close()`, `RunOrchestrator` before a
rollback and a resume. A deferred tensor changed before its copy was complete or ordered (version counter; not
through `.data`) fails the save, naming `SaveEngine.wait_snapshot()`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..errors import SaveError, fault
from .snapshot import Copies, LiveState, Scope, tensors_in

OVERLAP_MIN_BYTES = 32 << 20
"""`overlap=None` (auto) defers the copy of CUDA parameters whose weights and optimizer state hold at least this
much: a LoRA adapter's few MB copy in about a millisecond. Host parameters are not overlapped in auto: their copy
runs on the cores that train (a 45M full fine-tune on 2 cores: 0.14x the blocking per save but 1.6x its total
cost), where a CUDA copy is a DMA on a side stream."""


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The `torch.optim.Optimizer` that steps (accelerate's `AcceleratedOptimizer` wraps one), else `None`."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    t = getattr(t, "_local_tensor", t)  # a DTensor parameter (FSDP2): its shard
    return (t.data_ptr(), t.numel(), t.dtype)


class PendingCopy:
    """The copies one save left to run beside the next step (`SaveHandle.deferred`): `nbytes` of them, `copy_ms`
    (host copies), `wait_ms` (how long the training thread waited for them at the gate), `error` (the copy failed,
    or a copied tensor changed before it was complete)."""

    def __init__(self, step: int, copies: Copies, events: list[tuple[int, Any]]) -> None:
        self.step, self.nbytes = step, copies.nbytes
        self.error: BaseException | None = None
        self.copy_ms: float | None = None
        self.wait_ms: float | None = None
        self._copies: Copies | None = copies if copies.host[0] or copies.cats else None
        self._events, self._unordered = events, list(events)
        self._watched = copies.host[1] + copies.cuda[1]
        self._versions = [t._version for t in self._watched]
        self._lock = threading.Lock()
        self._done = threading.Event()
        if self._copies is None:
            self._done.set()

    def done(self) -> bool:
        """Whether the host copies are done (CUDA ones may still run; the next step is ordered after them)."""
        return self._done.is_set()

    def run(self) -> None:
        """Run the host copies, once (the writer, before it ships the job); never raises."""
        with self._lock:
            copies, self._copies = self._copies, None
            if copies is None:
                return
            start = time.perf_counter()
            try:
                fault("overlap_copy", step=self.step)
                copies.run_host()
            except BaseException as e:
                self.error = e
            self.copy_ms = (time.perf_counter() - start) * 1e3
            self._done.set()

    def release(self) -> None:
        """At the gate: wait for the host copies, order the current streams after the CUDA ones, check versions."""
        self._done.wait()
        events, self._unordered = self._unordered, []
        for device, event in events:
            torch.cuda.current_stream(device).wait_event(event)
        self._check()

    def synchronize(self) -> None:
        """For the writer: run the host copies, wait for the CUDA ones; raises the error, if any."""
        self.run()
        for _, event in self._events:
            event.synchronize()
        self._check()
        if self.error is not None:
            raise self.error

    def _check(self) -> None:
        """The first caller, once every copy is complete or ordered: a tensor changed in place fails the save."""
        with self._lock:
            watched, self._watched = self._watched, []
            changed = [t for t, v in zip(watched, self._versions) if t._version != v]
            if changed and self.error is None:
                t = changed[0]
                self.error = SaveError(
                    f"{len(changed)} tensor(s) the snapshot of step {self.step} copies in the background (the first "
                    f"{tuple(t.shape)} {t.dtype}) changed in place before their copy was complete, so the snapshot "
                    "would mix two states. Call SaveEngine.wait_snapshot() (RunOrchestrator.wait_snapshot()) before "
                    "changing parameters or optimizer state between a save and the next optimizer step")


class Overlap:
    """An engine's overlap `setting` (`True`: whenever an optimizer step can be gated; `None`, auto: CUDA parameters
    with at least `OVERLAP_MIN_BYTES` of weights and optimizer state; `False`: never) and its step gate. The hooks
    refer to the gate, never to the engine (the engine's finalizer must be able to run)."""

    def __init__(self, setting: bool | None) -> None:
        self.setting = setting
        self.pending: PendingCopy | None = None
        self._optimizer: Any = None
        self._hooks: list[Any] = []

    def deferral(self, optimizer: Any, live: LiveState, nbytes: Callable[[], int]
                 ) -> Callable[[Scope], list[bool]] | None:
        """Which sources of a scope a save of `live` copies later (the optimizer's parameters, its `state`'s tensors);
        `None`: everything now."""
        inner = innermost_optimizer(optimizer)
        if self.setting is False or inner is None or live.optimizer is None:
            return None
        if self.setting is None:
            local = [getattr(p, "_local_tensor", p) for group in inner.param_groups for p in group["params"]]
            if not local or not all(p.is_cuda for p in local) or nbytes() < OVERLAP_MIN_BYTES:
                return None
        if self._optimizer is None or self._optimizer() is not inner:  # the gate goes on this optimizer
            self.close()
            self._optimizer = weakref.ref(inner)
            self._hooks = [inner.register_step_pre_hook(self._on_step),
                           inner.register_load_state_dict_pre_hook(self._on_step)]
        params = {_key(p) for group in inner.param_groups for p in group["params"]}
        state = {id(t) for t in tensors_in(live.optimizer.get("state"), [])}
        return lambda scope: [_key(t) in params if scope.name == "weights" else id(t) in state for t in scope.sources]

    def start(self, step: int, copies: Copies, events: list[tuple[int, Any]]) -> PendingCopy:
        """Arm the gate with the copies left to run (CUDA ones already queued: `events`)."""
        self.pending = PendingCopy(step, copies, events)
        return self.pending

    def _on_step(self, *_: Any) -> None:
        self.wait()

    def wait(self) -> float:
        """Wait for the pending copy (`PendingCopy.release`); returns the milliseconds waited."""
        pending, self.pending = self.pending, None
        if pending is None:
            return 0.0
        start = time.perf_counter()
        pending.release()
        pending.wait_ms = (time.perf_counter() - start) * 1e3
        return pending.wait_ms

    def close(self) -> None:
        """Wait for the pending copy and take the hooks off (idempotent)."""
        self.wait()
        hooks, self._hooks, self._optimizer = self._hooks, [], None
        for handle in hooks:
            handle.remove()

"""Overlapped snapshots: the parameters and optimizer moments are copied while the next step's forward and backward run.

A buffered snapshot of a full fine-tune is one host copy of the weights and the optimizer state (~7 GiB at
Qwen2-7B width: ~1 s, all of it on the training thread). Most of it cannot change before the next
`optimizer.step()`: the forward and backward read the parameters and leave the optimizer state alone
(torchtitan / DCP async staging rely on the same). So, with overlap (`SaveEngine(overlap=...)`):

- copied at the save, on the training thread: what can change before the next optimizer step. RNG, data
  position, scheduler and scaler state (`Snapshotter.collect`), tensors of the optimizer's `param_groups`, and
  every weight that is not one of the optimizer's parameters (buffers such as BatchNorm running statistics,
  which a forward updates; tensors a `weights` callable computed);
- copied later (`Deferral`: the optimizer's parameters, matched by memory, dtype and size, and the per-parameter
  entries of its `state`): on the `CopyThread` (host tensors; torch's copies release the GIL), or queued on a
  side stream that the current stream is *not* ordered after (CUDA tensors), so the next forward does not wait;
- `StepGate`: an optimizer step pre-hook (and a `load_state_dict` pre-hook) on the innermost optimizer holds
  the next real `optimizer.step()` until the copy is done (CUDA: orders the current stream after it, without the
  host waiting). Gradient accumulation's micro-steps never call it. The engine waits at the gate too before
  anything else that writes those tensors: a second save, an emergency save, `prepare`, `close`;
  `RunOrchestrator` before a rollback and a resume; a user who edits parameters between steps calls
  `SaveEngine.wait_snapshot()` (`RunOrchestrator.wait_snapshot()`) first;
- the writer reads the buffers only after the copy (`PendingCopy.synchronize`, through `Snapshot.wait_copies`);
- an in-place change of a deferred tensor before its copy completed (a parameter edited between steps without
  `wait_snapshot()`) is caught: the tensors' version counters are compared once the copy is complete, and the
  save fails (`SaveError`, nothing committed, the previous checkpoint stays the restore point). Changes made
  through `.data` bypass the version counter and are not caught.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import SaveError
from .buffers import CudaCopier
from .live import OPTIMIZER_PREFIX, WEIGHTS_PREFIX
from .plans import Copies, Plan

logger = logging.getLogger(__name__)

OVERLAP_MIN_BYTES = 32 << 20
"""`overlap=None` (auto) overlaps a snapshot of CUDA parameters whose weights and optimizer state hold at least this
much: a LoRA adapter's few MB copy in about a millisecond, less than a thread hand-off and the version checks save.
Host parameters are not overlapped in auto: their copy runs on the cores that train (`scripts/bench_overlap.py`,
2 CPU cores, a 45M-parameter full fine-tune: 0.14x the blocking per save but 1.6x its total cost, the next step
1.11x as long), where a CUDA copy is a DMA on a side stream."""

_STATE_PREFIX = OPTIMIZER_PREFIX + "state/"


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The `torch.optim.Optimizer` that steps (accelerate's `AcceleratedOptimizer` wraps one), else `None`."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _on_cuda(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's parameters are CUDA tensors (auto overlaps only those)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return bool(params) and all(getattr(p, "_local_tensor", p).is_cuda for p in params)


def _key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    t = getattr(t, "_local_tensor", t)  # a DTensor parameter (FSDP2): its shard
    return (t.data_ptr(), t.numel(), t.dtype)


class Overlap:
    """An engine's overlap: whether a save defers (`setting`), the `StepGate` and the `CopyThread`.

    Args:
        setting (`bool | None`): `True` defers whenever an optimizer's step can be gated, `None` (auto) only for
            at least `OVERLAP_MIN_BYTES` of weights and optimizer state, `False` never.
    """

    def __init__(self, setting: bool | None) -> None:
        self.setting = setting
        self.gate = StepGate()
        self.thread = CopyThread()

    def deferral(self, optimizer: Any, nbytes: Callable[[], int]) -> Deferral | None:
        """The `Deferral` of a save whose sources hold `optimizer` and `nbytes()` of weights and optimizer state, or
        `None` (copy everything now): overlap off, too little to copy (auto), no optimizer step to gate."""
        if self.setting is False:
            return None
        inner = innermost_optimizer(optimizer)
        if inner is None:
            return None
        if self.setting is None and (not _on_cuda(inner) or nbytes() < OVERLAP_MIN_BYTES):
            return None
        if not self.gate.hook(inner):
            return None
        return Deferral(inner, self)

    def wait(self) -> float:
        """Wait for the pending copy, if any (`StepGate.wait`)."""
        return self.gate.wait()

    def close(self) -> None:
        """Wait for the pending copy, end the copy thread, remove the hooks (idempotent)."""
        self.gate.wait()
        self.thread.stop()
        self.gate.unhook()


class Deferral:
    """What one save copies later: the optimizer's parameters among the weights, the `state` entries of the optimizer.

    Args:
        optimizer (`torch.optim.Optimizer`): the innermost optimizer, whose step the gate holds.
        overlap (`Overlap`): the engine's gate and copy thread.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, overlap: Overlap) -> None:
        self.params = tuple(_key(p) for group in optimizer.param_groups for p in group["params"])
        self._overlap = overlap

    def fit(self, plan: Plan) -> Plan:
        """`plan`, or the same copies into the same layout split by what is copied later, when its split differs."""
        mask = self._mask(plan)
        return plan if plan.deferred == mask else Plan(plan.blueprint, plan.layout, deferred=mask)

    def _mask(self, plan: Plan) -> tuple[bool, ...]:
        bp = plan.blueprint
        if bp.split is not None and bp.split[0] == self.params:  # worked out at an earlier save, still valid
            return bp.split[1]
        if bp.scope == WEIGHTS_PREFIX:
            params = set(self.params)
            mask = tuple(_key(t) in params for t in bp.unique)
        elif bp.scope == OPTIMIZER_PREFIX:
            mask = tuple(name.startswith(_STATE_PREFIX) for name, _, _ in bp.spec)
        else:
            mask = (False,) * len(bp.unique)
        bp.split = (self.params, mask)
        return mask

    def start(self, plans: Sequence[Plan], copier: Callable[[], CudaCopier], step: int) -> PendingCopy:
        """The later part of `plans`: CUDA copies issued now on the side stream (not ordered before the current
        stream's next work), host copies handed to the `CopyThread`; the gate waits for both."""
        watched = [bp.unique[j] for bp, mask in ((p.blueprint, p.deferred or ()) for p in plans)
                   for j, later in enumerate(mask) if later]
        events: list[tuple[int, Any]] = []
        if any(p.later.cuda for p in plans):
            cuda = copier()
            for p in plans:
                for dst, src in p.later.cuda:
                    cuda.add(dst, src)
            events = cuda.issue()
        host = [p.later for p in plans if p.later.spans or p.later.cats or p.later.singles[0]]
        pending = PendingCopy(step, host, events, watched, nbytes=sum(t.numel() * t.element_size() for t in watched))
        self._overlap.gate.arm(pending)
        if pending.queued:
            self._overlap.thread.submit(pending)
        return pending


class PendingCopy:
    """The later copies of one snapshot: host ones run by `run` (the copy thread), CUDA ones already queued.

    Also the writer's wait (`synchronize`, an entry of `Snapshot.events`): it returns once every copy is complete.
    """

    def __init__(self, step: int, host: list[Copies], events: list[tuple[int, Any]], watched: list[torch.Tensor],
                 *, nbytes: int) -> None:
        self.step = step
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self.wait_ms: float | None = None
        """Time the training thread waited for this copy at the gate (`StepGate.wait`); `None` before."""
        self.copy_ms: float | None = None
        self._host = host
        self._events = events
        self._unordered = list(events)
        self._watched = watched
        self._versions = [t._version for t in watched]
        self._lock = threading.Lock()
        self._done = threading.Event()
        if not host:
            self._done.set()

    @property
    def queued(self) -> bool:
        """Whether host copies are left for the copy thread."""
        return not self._done.is_set()

    def run(self) -> None:
        """Run the host copies (on the copy thread); never raises (the error goes to the writer)."""
        start = time.perf_counter()
        try:
            for part in self._host:
                part.run(None)
            if not self._events:
                self._check()
        except BaseException as e:
            self.error = e
        finally:
            self._host = []
            self.copy_ms = (time.perf_counter() - start) * 1e3
            self._done.set()

    def done(self) -> bool:
        """Whether the host copies are done (CUDA ones may still run: the current stream is ordered after them)."""
        return self._done.is_set()

    def release(self) -> None:
        """At the gate, on the training thread: wait for the host copies, order every current stream after the
        CUDA ones (no host wait), and check that nothing changed the copied tensors meanwhile."""
        self._done.wait()
        events, self._unordered = self._unordered, []
        for index, event in events:
            torch.cuda.current_stream(index).wait_event(event)
        self._check()

    def synchronize(self) -> None:
        """For the writer: block until every copy is complete (the error, if any, is in `error`)."""
        self._done.wait()
        for _, event in self._events:
            event.synchronize()
        self._check()

    def _check(self) -> None:
        """Once every copy is complete or ordered: a tensor changed in place since the save makes the save fail."""
        with self._lock:
            watched, self._watched = self._watched, []
            if not watched or self.error is not None:
                return
            changed = [t for t, v in zip(watched, self._versions) if t._version != v]
            if changed:
                t = changed[0]
                self.error = SaveError(
                    f"{len(changed)} tensor(s) the snapshot of step {self.step} copies in the background (the first "
                    f"{tuple(t.shape)} {t.dtype}) changed in place before their copy was complete, so the snapshot "
                    "would mix two states. Call SaveEngine.wait_snapshot() (RunOrchestrator.wait_snapshot()) before "
                    "changing parameters or optimizer state between a save and the next optimizer step")


class CopyThread:
    """One persistent thread that runs `PendingCopy.run`, started at the first overlapped save."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[PendingCopy | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, pending: PendingCopy) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="hf_dynamic_ckpt-copy", daemon=True)
            self._thread.start()
        self._queue.put(pending)

    def _loop(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            pending.run()

    def stop(self) -> None:
        """Finish the queued copy and end the thread (idempotent; `submit` starts a new one)."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join()


class StepGate:
    """Holds the next optimizer step (and `load_state_dict`) of the hooked optimizer until the pending copy is done.

    The hooks refer to the gate, never to the engine (the engine's finalizer must be able to run).
    """

    def __init__(self) -> None:
        self.pending: PendingCopy | None = None
        self._optimizer: Any = None
        self._hooks: list[Any] = []

    def hook(self, optimizer: torch.optim.Optimizer) -> bool:
        """Put the gate on `optimizer` (once; moved when the optimizer changes); `False` when it takes no hooks."""
        if self._optimizer is not None and self._optimizer() is optimizer:
            return True
        if not hasattr(optimizer, "register_step_pre_hook"):
            return False
        self.wait()
        self.unhook()
        self._optimizer = weakref.ref(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(self._on_step))
        if hasattr(optimizer, "register_load_state_dict_pre_hook"):
            self._hooks.append(optimizer.register_load_state_dict_pre_hook(self._on_step))
        return True

    def _on_step(self, *_: Any) -> None:
        self.wait()

    def arm(self, pending: PendingCopy) -> None:
        self.pending = pending

    def wait(self) -> float:
        """Wait for the pending copy (see `PendingCopy.release`); returns the milliseconds waited."""
        pending, self.pending = self.pending, None
        if pending is None:
            return 0.0
        start = time.perf_counter()
        pending.release()
        pending.wait_ms = (time.perf_counter() - start) * 1e3
        return pending.wait_ms

    def unhook(self) -> None:
        hooks, self._hooks, self._optimizer = self._hooks, [], None
        for handle in hooks:
            handle.remove()

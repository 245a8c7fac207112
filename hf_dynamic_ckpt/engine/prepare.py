"""Snapshot buffers made ready ahead of the first save: `Preparer`.

Fresh host memory costs a page fault per 4 KiB page on first touch, so a snapshot into
new buffers runs at a fraction of memcpy speed (about 1 GB/s instead of 4.5 GB/s here).
`SaveEngine.prepare` works out the buffers a save of the given sources will need (the
blueprints, on the calling thread: it reads the live state), and a background thread
allocates them and touches every page. The training thread adopts the result before its
next save (`finish`), so no buffer is shared with the background thread while in use.

The optimizer's state exists only after its first step (or once a resume loads it); when it
is still empty, a one-shot hook on the optimizer prepares its buffers right after whichever
comes first: its `load_state_dict` (a resume: the buffers are ready before the first step)
or its first step.

The background thread allocates the layouts at the training thread's priority and lowers
its own (`writer_nice`) only for touching the pages, which runs without the GIL: a thread at
a lower priority that holds the GIL makes the training thread wait for it whenever the CPUs
are busy (measured: `Thread.start` waited 0.1-0.6 s for the thread's first bytecodes during
a resume). A preparation started while another one runs does not wait for it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..constants import Tier
from ..state.sources import StateSources
from .buffers import ItemSpec, Layout, spec_bytes
from .live import LiveState, available_tiers, tensors_in
from .plans import Blueprint
from .snapshot import FROZEN_PREFIX, Snapshotter
from .writer import set_priority, writer_priority

logger = logging.getLogger(__name__)


def optimizer_state_empty(sources: StateSources) -> bool:
    """Whether `sources` has an optimizer that has not stepped yet (its state holds no tensor)."""
    inner: Any = sources.optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer  # accelerate's AcceleratedOptimizer wraps one
    return isinstance(inner, torch.optim.Optimizer) and len(inner.state) == 0


class _Run:
    """One background preparation: its jobs, the layouts it made (in job order), its error."""

    def __init__(self, jobs: list[tuple[Blueprint | str, tuple[ItemSpec, ...], bool]], *, shared: bool,
                 priority: int | None) -> None:
        self.jobs = jobs
        self.keys = {(owner.scope if isinstance(owner, Blueprint) else owner, spec) for owner, spec, _ in jobs}
        self.nbytes = sum(spec_bytes(spec) for _, spec, _ in jobs)
        self.ready: list[tuple[Blueprint | str, Layout]] = []
        self.error: BaseException | None = None
        self._shared = shared
        self._priority = priority
        self.thread = threading.Thread(target=self._run, name="hf-dynamic-ckpt-prepare", daemon=True)

    def _run(self) -> None:
        try:
            # Allocation and views: Python code holding the GIL, so at the training thread's priority.
            layouts = [(owner, Layout(spec, shared=self._shared, pinned=pinned)) for owner, spec, pinned in self.jobs]
            set_priority(0, self._priority)  # the page touching (GIL released) yields the CPU to training
            for owner, layout in layouts:
                layout.prefault()
                self.ready.append((owner, layout))
        except BaseException as e:  # the first save allocates what is missing; nothing is lost
            self.error = e


class Preparer:
    """Allocates and pre-faults buffers in background threads; the owner adopts them later.

    Args:
        nice (`int`, *optional*, defaults to `0`): nice increment of the page touching.
    """

    def __init__(self, *, nice: int = 0) -> None:
        self._priority = writer_priority(nice)
        self._runs: list[_Run] = []
        self._hooks: list[Any] = []
        self._wait_for_step = False

    def start(self, snapshotter: Snapshotter, sources: StateSources, tiers: Iterable[Tier], *,
              admit: Callable[[int], bool], wait_for_step: bool = False) -> tuple[int, frozenset[Tier]]:
        """Prepare the buffers a buffered snapshot of `tiers` of `sources` would allocate.

        Reads the live state (training thread); the allocation runs in the background.

        Args:
            snapshotter (`Snapshotter`): whose pool the buffers are for.
            sources (`StateSources`): the live objects.
            tiers (`Iterable[Tier]`): the tiers saves will take (L2 holds no buffers).
            admit (`Callable[[int], bool]`): whether that many bytes may be held now (memory
                budget); `False` prepares nothing.
            wait_for_step (`bool`, *optional*, defaults to `False`): under a memory limit, prepare
                nothing before the optimizer's first step (the memory a step takes is unknown before).

        Returns:
            `tuple[int, frozenset[Tier]]`: bytes being prepared, and the tiers to prepare again
            once the optimizer's state exists (it is still empty; empty set: none).
        """
        self._wait_for_step = wait_for_step
        wanted_tiers = {Tier(t) for t in tiers} & available_tiers(sources) - {Tier.STATE}
        if sources.optimizer is None:
            wanted_tiers.discard(Tier.OPTIMIZER)  # a scheduler or scaler alone holds no buffers
        if wait_for_step and optimizer_state_empty(sources):
            return 0, frozenset(wanted_tiers)
        live = snapshotter.collect(sources, step=0, epoch=0.0, tiers=wanted_tiers)
        optimizer_pending = live.optimizer is not None and not tensors_in(live.optimizer, [])
        return self._start(snapshotter, live, admit), frozenset({Tier.OPTIMIZER} if optimizer_pending else ())

    def _start(self, snapshotter: Snapshotter, live: LiveState, admit: Callable[[int], bool]) -> int:
        self.finish(snapshotter, block=False)  # adopt what is done; a preparation still running is not waited for
        running = {key for run in self._runs for key in run.keys}
        wanted = []
        for scope, bp in snapshotter.blueprints(live).items():
            if (scope, bp.spec) in running:
                continue
            if snapshotter.pool.needed_bytes(scope, bp.spec):
                wanted.append(bp)
            else:  # its layout is held already (e.g. prepared before): plan the copies now
                snapshotter.adopt(bp, snapshotter.pool.layout(scope, bp.spec, pinned=bp.pinned))
        frozen = []
        if snapshotter.pool.shared and live.weights is not None:  # copied once into shared memory
            for name in live.frozen:
                value = live.weights[name]
                assert isinstance(value, torch.Tensor)
                spec = ((FROZEN_PREFIX + name, tuple(value.shape), value.dtype),)
                scope = FROZEN_PREFIX + name
                if (scope, spec) not in running and snapshotter.pool.needed_bytes(scope, spec):
                    frozen.append((scope, spec, value.is_cuda))
        needed = sum(bp.nbytes for bp in wanted) + sum(spec_bytes(spec) for _, spec, _ in frozen)
        # Bytes still being prepared count as held: the budget sees everything that will be.
        if not needed or not admit(needed + sum(run.nbytes for run in self._runs)):
            return 0
        jobs: list[tuple[Blueprint | str, tuple[ItemSpec, ...], bool]] = [(bp, bp.spec, bp.pinned) for bp in wanted]
        jobs += frozen
        run = _Run(jobs, shared=snapshotter.pool.shared, priority=self._priority)
        self._runs.append(run)
        run.thread.start()
        logger.debug("preparing %.1f MiB of snapshot buffers in the background (%d layouts)", needed / 2**20, len(jobs))
        return needed

    def finish(self, snapshotter: Snapshotter, *, block: bool = True) -> None:
        """Hand the prepared buffers to `snapshotter` (training thread), in the order they were started.

        Args:
            snapshotter (`Snapshotter`): whose pool receives them.
            block (`bool`, *optional*, defaults to `True`): wait for every background thread;
                `False` adopts only what is done (up to the first preparation still running).
        """
        while self._runs:
            run = self._runs[0]
            if block:
                run.thread.join()
            elif run.thread.is_alive():
                return
            self._runs.pop(0)
            for owner, layout in run.ready:
                if isinstance(owner, Blueprint):
                    snapshotter.adopt(owner, layout)
                else:
                    snapshotter.pool.install(owner, layout)
            if run.error is not None:
                logger.warning("preparing snapshot buffers failed (%s): the first save allocates them", run.error)

    def after_first_step(self, sources: StateSources, prepare: weakref.WeakMethod[Any],
                         tiers: Iterable[Tier] = (Tier.OPTIMIZER,)) -> None:
        """Call `prepare(sources, tiers)` once the optimizer's state exists.

        The optimizer's state exists only from its first step on, or once a resume loads it
        (`load_state_dict`, e.g. Trainer's optimizer right after it is created); a one-shot hook
        on the innermost optimizer (accelerate's `AcceleratedOptimizer` wraps one) prepares
        right after whichever comes first, and removes both. Under a memory limit
        (`start(..., wait_for_step=True)`) only the step counts: the memory a training step
        takes is measured by it.
        """
        tiers = frozenset(Tier(t) for t in tiers)
        inner: Any = sources.optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer
        if self._hooks or not hasattr(inner, "register_step_post_hook"):
            return

        def hook(*_: Any) -> None:
            hooks, self._hooks = self._hooks, []
            for handle in hooks:
                handle.remove()
            method = prepare()
            if method is None:
                return
            try:
                method(sources, tiers)
            except Exception as e:  # inside optimizer.step() / load_state_dict(): never break training for a head start
                logger.warning("could not prepare the optimizer's snapshot buffers (%s): the first save "
                               "allocates them", e)

        self._hooks.append(inner.register_step_post_hook(hook))
        if not self._wait_for_step and hasattr(inner, "register_load_state_dict_post_hook"):
            self._hooks.append(inner.register_load_state_dict_post_hook(hook))

    def close(self) -> None:
        """Stop waiting for the optimizer's state and let the background threads end."""
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()
        runs, self._runs = self._runs, []
        for run in runs:
            run.thread.join()

"""Snapshot: the only part of a save that blocks training.

A snapshot turns live training objects (`StateSources`) into a `CheckpointState` whose
tensors no later optimizer step can change. Two ways:

- *buffered* (`Snapshotter.take(..., copy=True)`): every tensor of the chosen tiers is
  copied into a CPU buffer that is allocated once and reused by every later save (keyed
  by name, shape and dtype). CUDA tensors go to pinned buffers through non-blocking copies
  on a side stream; the current stream then waits on an event, so the next optimizer step
  is ordered after the copy on the GPU without the host waiting, and the writer waits on
  the same event before it reads the buffers.
- *direct* (`copy=False`): the state refers to the live tensors. Only valid while the
  training thread is blocked until the write is done (synchronous, streaming and
  emergency saves); it never holds a second copy of the state.

Frozen weights (`StateSources.frozen_keys`) are never copied: the first save hands the live
tensor to the store, which stores it content-addressed; later saves pass a `BlobRef`
to that blob as long as the tensor is untouched (same storage, version, shape, dtype).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..constants import Tier
from ..errors import SaveError
from ..state.rng import RawRngState, capture_raw_rng_state
from ..state.sources import StateSources
from ..store import BlobRef, CheckpointState
from .buffers import BufferPool, CudaCopier, Layout
from .live import (
    OPTIMIZER_PREFIX,
    WEIGHTS_PREFIX,
    LiveState,
    clone_small,
    nbytes,
    state_dict_tensor_bytes,
    substitute,
    substitute_optimizer,
    tensor_key,
    tensors_in,
    walk_tensors,
)
from .overlap import Deferral, PendingCopy
from .plans import Blueprint, Plan, make_blueprint

_TENSOR = frozenset({torch.Tensor})
_grad = operator.attrgetter("requires_grad")

FROZEN_PREFIX = "frozen/"
"""Buffer scope of a frozen weight copied once into shared memory (process mode, first save)."""

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """A consistent state ready for `CheckpointStore.save`, plus what the writer needs.

    Attributes:
        state (`CheckpointState`): the state to write.
        copied_bytes (`int`): bytes copied into buffers by this snapshot.
        live_bytes (`int`): bytes of tensors referenced without a copy (direct mode, first
            save of frozen weights).
        blocking_s (`float`): host time the snapshot took.
        pending_blobs (`dict[str, tuple]`): frozen keys handed to the store as tensors this
            time, with the identity they had; the engine turns them into `BlobRef`s once the
            checkpoint is committed.
    """

    state: CheckpointState
    copied_bytes: int = 0
    live_bytes: int = 0
    blocking_s: float = 0.0
    pending_blobs: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)
    deferred: PendingCopy | None = None
    """The copies left to run beside the next step (`overlap.py`), also in `events`; `None` without overlap."""

    def wait_copies(self) -> None:
        """Block until the asynchronous copies of this snapshot (device-to-host, deferred) are complete."""
        for event in self.events:
            event.synchronize()
        self.events = []


class Snapshotter:
    """Reads `StateSources` and produces `Snapshot`s, owning the reusable buffers.

    Args:
        shared (`bool`, *optional*, defaults to `False`): keep buffers in shared memory
            (for a writer process).
        blob_exists (`Callable[[BlobRef], bool]`, *optional*): checks that a blob recorded
            as stored is still on disk before a later save refers to it; by default trusted.

    Example:
        ```python
        >>> snap = Snapshotter()
        >>> live = snap.collect(sources, step=10, epoch=0.5, tiers=ALL_TIERS)
        >>> snapshot = snap.take(live)          # copies; training may step again
        >>> snapshot.wait_copies()              # in the writer, before reading buffers
        ```
    """

    def __init__(self, *, shared: bool = False, blob_exists: Callable[[BlobRef], bool] | None = None) -> None:
        self.pool = BufferPool(shared=shared)
        self._blob_exists = blob_exists
        self._plans: dict[str, Plan] = {}
        self._cuda: CudaCopier | None = None
        # Frozen tensors already committed to the store: name -> (identity, BlobRef).
        self._stored_blobs: dict[str, tuple[tuple[Any, ...], BlobRef]] = {}

    # -- reading the sources ---------------------------------------------------------------
    def collect(
        self,
        sources: StateSources,
        *,
        step: int,
        epoch: float,
        tiers: Iterable[Tier],
        rng: dict[str, Any] | RawRngState | None = None,
        sampler: dict[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> LiveState:
        """Read the sources for the given tiers without copying any large tensor.

        Args:
            sources (`StateSources`): live objects.
            step (`int`): optimizer steps completed.
            epoch (`float`): fractional epoch.
            tiers (`Iterable[Tier]`): tiers to include.
            rng (`dict | RawRngState`, *optional*): RNG state to store instead of capturing it now
                (captured as a `RawRngState`: the writer converts it to JSON, off the training thread).
            sampler (`dict`, *optional*): data position to store instead of `sources.sampler()`.
            extra (`Mapping`, *optional*): JSON-able data for the manifest's `extra` (deep-copied).

        Returns:
            `LiveState`: references to live tensors plus small deep-copied state.
        """
        tiers = frozenset(Tier(t) for t in tiers)
        weights: dict[str, torch.Tensor | BlobRef] | None = None
        frozen: dict[str, tuple[Any, ...]] = {}
        plain = False
        if Tier.WEIGHTS in tiers:
            if sources.weights is None:
                raise SaveError(
                    "tiers include 'weights' but StateSources.weights is None: pass "
                    "StateSources(weights=model.state_dict) or drop Tier.WEIGHTS."
                )
            mapping = sources.weights()
            values = list(mapping.values())
            plain = not sources.frozen_keys and set(map(type, values)) <= _TENSOR and not any(map(_grad, values))
            weights = dict(mapping) if plain else {}
            for name, tensor in () if plain else mapping.items():
                if not isinstance(tensor, torch.Tensor):
                    raise SaveError(
                        f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor: "
                        "StateSources.weights must return a mapping of tensors."
                    )
                if tensor.requires_grad:  # state_dict() tensors are detached already; detach() costs ~1 us
                    tensor = tensor.detach()
                if name in sources.frozen_keys:
                    ident = tensor_key(tensor)
                    stored = self._stored_blobs.get(name)
                    if stored is not None and stored[0] == ident and self._blob_alive(stored[1]):
                        weights[name] = stored[1]
                        continue
                    frozen[name] = ident
                weights[name] = tensor
        optimizer = scheduler = scaler = None
        if Tier.OPTIMIZER in tiers:
            if sources.optimizer is not None:
                optimizer = sources.optimizer.state_dict()
            if sources.scheduler is not None:
                scheduler = clone_small(sources.scheduler.state_dict())
            if sources.scaler is not None:
                scaler = clone_small(sources.scaler.state_dict())
            if optimizer is None and scheduler is None and scaler is None:
                raise SaveError(
                    "tiers include 'optimizer' but StateSources has no optimizer, scheduler or "
                    "scaler: pass them or drop Tier.OPTIMIZER."
                )
        rng_state = sampler_state = None
        if Tier.STATE in tiers:
            if isinstance(rng, RawRngState):  # immutable copies already: the writer converts it (`run_job`)
                rng_state = rng
            elif rng is not None:
                rng_state = clone_small(rng)
            else:
                rng_state = capture_raw_rng_state()
            if sampler is not None:
                sampler_state = clone_small(sampler)
            elif sources.sampler is not None:
                sampler_state = clone_small(sources.sampler())
        return LiveState(
            step=step, epoch=epoch, weights=weights, frozen=frozen, optimizer=optimizer,
            scheduler=scheduler, scaler=scaler, rng=rng_state, sampler=sampler_state,
            extra=clone_small(dict(extra)) if extra is not None else {}, plain=plain,
        )

    def extra_bytes_needed(self, live: LiveState) -> int:
        """Bytes a buffered snapshot of `live` would allocate beyond the buffers already held."""
        return sum(self.pool.needed_bytes(scope, bp.spec) for scope, bp in self.blueprints(live).items())

    def blueprints(self, live: LiveState) -> dict[str, Blueprint]:
        """Per scope of `live` whose held plan does not fit it: the blueprint a snapshot would need."""
        return {scope: bp for scope, (_, bp) in self._resolve(live).items() if bp is not None}

    def adopt(self, blueprint: Blueprint, layout: Layout) -> None:
        """Hold `layout` (allocated and pre-faulted elsewhere) and the plan copying `blueprint` into it."""
        self.pool.install(blueprint.scope, layout)
        self._plans[blueprint.scope] = Plan(blueprint, layout)

    def _resolve(self, live: LiveState) -> dict[str, tuple[Plan | None, Blueprint | None]]:
        # Per scope: the held plan if it still fits the live tensors, else a fresh blueprint.
        if live.resolved is None:
            resolved: dict[str, tuple[Plan | None, Blueprint | None]] = {}
            for scope, (names, tensors) in live.scope_sources().items():
                plan = self._plans.get(scope)
                if plan is not None and plan.blueprint.matches(names, tensors):
                    resolved[scope] = (plan, None)
                elif names is not None:
                    resolved[scope] = (None, make_blueprint(scope, names, tensors, [scope + n for n in names],
                                                            dedupe=True))
                else:
                    item_names = [n for n, _ in walk_tensors(live.optimizer, scope.rstrip("/"))]
                    resolved[scope] = (None, make_blueprint(scope, None, tensors, item_names, dedupe=False))
            live.resolved = resolved
        return live.resolved

    # -- producing a snapshot --------------------------------------------------------------
    def scope_bytes(self, live: LiveState) -> int:
        """Bytes a buffered snapshot of `live` copies into its scopes (weights, optimizer state)."""
        return sum(plan.blueprint.nbytes if plan is not None else bp.nbytes if bp is not None else 0
                   for plan, bp in self._resolve(live).values())

    def take(self, live: LiveState, *, copy: bool = True, defer: Deferral | None = None) -> Snapshot:
        """Make `live` immune to later training steps.

        Args:
            live (`LiveState`): from `collect`.
            copy (`bool`, *optional*, defaults to `True`): copy into the reusable buffers;
                `False` refers to live tensors (only while training waits for the write).
            defer (`Deferral`, *optional*): copy what it names later (`Snapshot.deferred`; `overlap.py`).

        Returns:
            `Snapshot`: the state for the store. With CUDA sources call `wait_copies()`
            before reading its tensors.
        """
        start = time.perf_counter()
        if not copy:
            return self._direct(live, start)
        plans: dict[str, Plan] = {}
        for scope, (plan, bp) in self._resolve(live).items():
            if plan is None:
                assert bp is not None
                plan = self._plans[scope] = Plan(bp, self.pool.layout(scope, bp.spec, pinned=bp.pinned))
            if defer is not None:
                plan = self._plans[scope] = defer.fit(plan)
            plans[scope] = plan
        # With `defer` the later part runs beside the next step (`defer.start`); without it both parts run now (a plan
        # split by an earlier overlapped save keeps its split).
        parts = [part for plan in plans.values() for part in (plan.now, *(() if defer is not None else (plan.later,)))]
        cuda = self._copier() if any(part.cuda for part in parts) else None
        for part in parts:
            part.run(cuda)
        copied = sum(plan.blueprint.nbytes for plan in plans.values())
        live_bytes = 0
        weights: dict[str, torch.Tensor | BlobRef] | None = None
        if live.weights is not None and live.plain:
            weights = dict(zip(live.weights, plans[WEIGHTS_PREFIX].outputs()))
        elif live.weights is not None:
            weights = {}
            outputs = iter(plans[WEIGHTS_PREFIX].outputs())
            frozen_dsts: list[torch.Tensor] = []
            frozen_srcs: list[torch.Tensor] = []
            used: set[str] = set()
            for name, value in live.weights.items():
                if isinstance(value, BlobRef):
                    weights[name] = value
                elif name not in live.frozen:
                    weights[name] = next(outputs)
                elif self.pool.shared:  # a writer process cannot read this process's live tensor
                    scope = FROZEN_PREFIX + name
                    used.add(scope)
                    dst = weights[name] = self.pool.get(scope, value)
                    if value.is_cuda:
                        cuda = cuda or self._copier()
                        cuda.add(dst, value)
                    else:
                        frozen_dsts.append(dst)
                        frozen_srcs.append(value)
                    copied += nbytes(value)
                elif value.is_cuda:  # the store writes CPU tensors: a frozen CUDA tensor moves once
                    weights[name] = value.to("cpu")
                    copied += nbytes(value)
                else:
                    weights[name] = value
                    live_bytes += nbytes(value)
            if frozen_dsts:
                torch._foreach_copy_(frozen_dsts, frozen_srcs)
            for scope in [s for s in self.pool.layouts if s.startswith(FROZEN_PREFIX) and s not in used]:
                self.pool.drop(scope)  # stored as blobs by now: later saves pass BlobRefs
        optimizer = live.optimizer
        if optimizer is not None:
            optimizer = substitute_optimizer(optimizer, plans[OPTIMIZER_PREFIX].outputs())
        events = cuda.finish() if cuda is not None else []
        snapshot = self._snapshot(live, weights, optimizer, copied, live_bytes, start, events)
        if defer is not None:
            snapshot.deferred = defer.start(list(plans.values()), self._copier, live.step)
            snapshot.events.append(snapshot.deferred)
        return snapshot

    def _direct(self, live: LiveState, start: float) -> Snapshot:
        """A snapshot that refers to the live tensors (CUDA ones are moved to the host)."""
        weights: dict[str, torch.Tensor | BlobRef] | None = None
        copied = live_bytes = 0
        if live.weights is not None:
            weights = {}
            for name, value in live.weights.items():
                if isinstance(value, BlobRef):
                    weights[name] = value
                elif value.is_cuda:
                    weights[name] = value.to("cpu")
                    copied += nbytes(value)
                else:
                    weights[name] = value
                    live_bytes += nbytes(value)
        optimizer = live.optimizer
        if optimizer is not None:
            sources = tensors_in(optimizer, [])
            on_host = [t.detach().to("cpu") if t.is_cuda else t.detach() for t in sources]
            optimizer = substitute(optimizer, iter(on_host))
            live_bytes += state_dict_tensor_bytes(optimizer)
        return self._snapshot(live, weights, optimizer, copied, live_bytes, start, [])

    @staticmethod
    def _snapshot(live: LiveState, weights: dict[str, torch.Tensor | BlobRef] | None, optimizer: Any, copied: int,
                  live_bytes: int, start: float, events: list[Any]) -> Snapshot:
        state = CheckpointState(
            step=live.step, epoch=live.epoch, weights=weights,
            dedup_keys=frozenset() if live.plain else frozenset(live.frozen) | frozenset(
                k for k, v in (weights or {}).items() if isinstance(v, BlobRef)
            ),
            optimizer=optimizer, scheduler=live.scheduler, scaler=live.scaler, rng=live.rng,
            sampler=live.sampler, extra=live.extra,
        )
        return Snapshot(
            state=state, copied_bytes=copied, live_bytes=live_bytes,
            blocking_s=time.perf_counter() - start, pending_blobs=dict(live.frozen), events=events,
        )

    def _copier(self) -> CudaCopier:
        if self._cuda is None:
            self._cuda = CudaCopier()  # keeps its side streams across saves
        return self._cuda

    def release(self) -> int:
        """Free every snapshot buffer and the plans into them (the next buffered save allocates again).

        Returns:
            `int`: bytes released. Page-locked buffers go back to the OS, not to the CUDA host cache.
        """
        released = self.pool.nbytes
        self.pool.clear()
        self._plans.clear()
        if released:
            logger.debug("released %.1f MiB of snapshot buffers", released / 2**20)
        if released and torch.cuda.is_available() and torch.cuda.is_initialized():
            empty = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks stay cached otherwise
            if empty is not None:
                empty()
        return released

    # -- frozen blobs ------------------------------------------------------------------------
    def mark_blobs_stored(self, pending: Mapping[str, tuple[Any, ...]], blobs: Mapping[str, Any]) -> None:
        """Record frozen tensors as stored after their checkpoint committed.

        Args:
            pending (`Mapping[str, tuple]`): `Snapshot.pending_blobs` of the committed save.
            blobs (`Mapping[str, dict]`): the manifest's blob table (`{"digest","dtype","shape"}`
                per key), the truth about what the store wrote.
        """
        for name, ident in pending.items():
            entry = blobs.get(name)
            if entry is None:
                continue
            ref = entry if isinstance(entry, BlobRef) else BlobRef(
                digest=str(entry["digest"]), dtype=str(entry["dtype"]), shape=tuple(int(s) for s in entry["shape"])
            )
            self._stored_blobs[name] = (ident, ref)

    def _blob_alive(self, ref: BlobRef) -> bool:
        return self._blob_exists is None or self._blob_exists(ref)

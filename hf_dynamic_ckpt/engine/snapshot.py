"""Snapshot: the only part of a save that blocks training.

`collect` reads the live objects without copying a large tensor; `Snapshotter.take` copies weights and optimizer
state into reusable shared host buffers (one storage per scope, a view per tensor; CUDA sources: pinned, copied on
a side stream ordered by events). Frozen weights are never copied. `Overlap` defers large copies beside the next
step (docs/engine.md)."""

from __future__ import annotations

import copy as _copy
import itertools
import logging
import math
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..constants import Tier
from ..errors import SaveError, fault
from ..state import RawRngState, StateSources, capture_raw_rng_state
from ..store import CheckpointState, frozen_record

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_counter = itertools.count()
_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def new_shared_storage(nbytes: int, *, directory: str = SHM_DIR) -> torch.UntypedStorage | None:
    """A shared-memory storage of `nbytes` bytes, its pages reserved (`None` where that is not possible): like
    `torch.UntypedStorage._new_shared`, but reserved without the GIL held (that stalled training 0.1-0.6 s per
    700 MiB); the file is owner-only, `O_EXCL | O_NOFOLLOW`, unlinked at once."""
    fallocate = getattr(os, "posix_fallocate", None)
    from_fd = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)
    if nbytes <= 0 or fallocate is None or from_fd is None or not os.path.isdir(directory):
        return None
    path = os.path.join(directory, f"hf-dynamic-ckpt-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return None
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        fallocate(fd, 0, nbytes)
        storage: torch.UntypedStorage = from_fd(fd, nbytes)  # maps its own duplicate of the descriptor
    except (OSError, RuntimeError):
        return None
    finally:
        os.close(fd)
    return storage


Allocator = Callable[[int, bool], torch.UntypedStorage]
"""`(nbytes, pinned) -> host storage` for one scope's buffers; `pinned`: CUDA sources, page-lock it if possible."""


def shared_storage(nbytes: int, pinned: bool) -> torch.UntypedStorage:
    """The default `Allocator`: shared memory the writer process maps, page-locked in place for CUDA sources."""
    storage = new_shared_storage(nbytes) or torch.UntypedStorage._new_shared(nbytes)
    if pinned and nbytes:
        try:
            from torch.cuda._pin_memory_utils import pin_memory, unpin_memory

            pin_memory(storage.data_ptr(), nbytes)
            weakref.finalize(storage, unpin_memory, storage.data_ptr())
        except Exception as e:  # copies still work, only synchronously
            logger.warning("could not pin %d bytes of shared snapshot buffers (%s): device-to-host copies will "
                           "block", nbytes, e)
    return storage


Spec = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""(shape, dtype) of each tensor a scope's buffers hold, in copy order."""


def _offsets(spec: Spec) -> tuple[list[int], int, dict[torch.dtype, list[int]]]:
    """Byte offset of each tensor (those of one dtype packed together, each dtype's run 64-byte aligned), the total,
    and the indices of each dtype's tensors."""
    offsets, total, groups = [0] * len(spec), 0, dict[torch.dtype, list[int]]()
    for i, (_, d) in enumerate(spec):
        groups.setdefault(d, []).append(i)
    for dtype, members in groups.items():
        total = -(-total // 64) * 64
        for i in members:
            offsets[i], total = total, total + math.prod(spec[i][0]) * dtype.itemsize
    return offsets, total, groups


class Layout:
    """One scope's buffers over a host `storage` (of at least `_offsets(spec)[1]` bytes): a view per tensor, and per
    dtype the `regions` its views tile, in spec order. `key` names it for the writer process."""

    def __init__(self, spec: Spec, storage: torch.UntypedStorage, *, pinned: bool = False) -> None:
        self.spec, self.pinned, self.key = spec, pinned, next(_counter)
        offsets, self.nbytes, self.groups = _offsets(spec)
        self.flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        ends = [o + math.prod(shape) * d.itemsize for (shape, d), o in zip(spec, offsets)]
        self.views = [self.flat[o:e].view(d).view(shape) for (shape, d), o, e in zip(spec, offsets, ends)]
        self.regions = {d: self.flat[offsets[m[0]]:ends[m[-1]]].view(d) for d, m in self.groups.items()}


# -- walks over nested state dicts ---------------------------------------------------------------------------------
def tensors_in(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append the tensors of a nested state dict to `out`, in walk order (dict order, then list order)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif type(obj) not in _SCALARS:
        values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, list | tuple) else ()
        for v in values:
            tensors_in(v, out)
    return out


def substitute(obj: Any, replacements: Iterator[torch.Tensor]) -> Any:
    """A copy of a nested state dict whose tensors are taken from `replacements`, in walk order. Containers are
    rebuilt and other leaves deep-copied, so later changes to the live state dict cannot reach the snapshot."""
    if type(obj) in _SCALARS:
        return obj
    if isinstance(obj, torch.Tensor):
        return next(replacements)
    if isinstance(obj, Mapping):
        return {k: substitute(v, replacements) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [substitute(v, replacements) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return _copy.deepcopy(obj)


def clone_small(obj: Any) -> Any:
    """Deep copy of a small state dict (scheduler, scaler, sampler, RNG) with tensors cloned to the CPU."""
    return substitute(obj, (t.detach().to("cpu", copy=True) for t in tensors_in(obj, [])))


@dataclass
class LiveState:
    """What the sources hold now, read but not copied (weights and optimizer state alias live tensors)."""

    step: int
    epoch: float
    weights: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    rng: dict[str, Any] | RawRngState | None = None
    sampler: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    frozen: dict[str, Any] = field(default_factory=dict)  # records of the frozen weights (`frozen_record`)

    def state(self, weights: dict[str, Any] | None, optimizer: dict[str, Any] | None) -> CheckpointState:
        return CheckpointState(step=self.step, epoch=self.epoch, weights=weights, optimizer=optimizer,
                               scheduler=self.scheduler, scaler=self.scaler, rng=self.rng, sampler=self.sampler,
                               extra=self.extra, frozen=self.frozen if weights is not None else {})

def collect(sources: StateSources, *, step: int, epoch: float, tiers: Iterable[Tier],
            rng: dict[str, Any] | RawRngState | None = None, sampler: dict[str, Any] | None = None,
            extra: Mapping[str, Any] | None = None, frozen: dict[tuple[Any, ...], Any] | None = None) -> LiveState:
    """Read `sources` for `tiers`: large tensors aliased, small state deep-copied, RNG captured raw unless given,
    frozen weights recorded by checksum (cached in `frozen` by tensor version). Raises `SaveError` when the sources
    cannot provide a tier or a weight is not a tensor."""
    tiers = frozenset(Tier(t) for t in tiers)
    live = LiveState(step=step, epoch=epoch, extra=clone_small(dict(extra)) if extra is not None else {})
    if Tier.WEIGHTS in tiers:
        if sources.weights is None:
            raise SaveError("tiers include 'weights' but StateSources.weights is None: pass "
                            "StateSources(weights=model.state_dict) or drop Tier.WEIGHTS.")
        live.weights = {}
        for name, tensor in sources.weights().items():
            if not isinstance(tensor, torch.Tensor):
                raise SaveError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor: "
                                "StateSources.weights must return a mapping of tensors.")
            if name not in sources.frozen_keys:
                live.weights[name] = tensor.detach() if tensor.requires_grad else tensor
                continue
            key = (name, tensor.data_ptr(), tensor._version, tuple(tensor.shape), tensor.dtype)
            cache = frozen if frozen is not None else {}
            live.frozen[name] = cache[key] if key in cache else cache.setdefault(key, frozen_record(tensor))
    if Tier.OPTIMIZER in tiers:
        if sources.optimizer is None and sources.scheduler is None and sources.scaler is None:
            raise SaveError("tiers include 'optimizer' but StateSources has no optimizer, scheduler or "
                            "scaler: pass them or drop Tier.OPTIMIZER.")
        live.optimizer = sources.optimizer.state_dict() if sources.optimizer is not None else None
        live.scheduler = clone_small(sources.scheduler.state_dict()) if sources.scheduler is not None else None
        live.scaler = clone_small(sources.scaler.state_dict()) if sources.scaler is not None else None
    if Tier.STATE in tiers:
        live.rng = rng if isinstance(rng, RawRngState) else clone_small(rng) if rng is not None \
            else capture_raw_rng_state()
        live.sampler = clone_small(sampler if sampler is not None  # clone_small(None) is None
                                   else sources.sampler() if sources.sampler is not None else None)
    return live


# -- copies --------------------------------------------------------------------------------------------------------
class Scope(NamedTuple):
    """The tensors one scope copies: `sources` (tied weights once), `slots` (each tensor's source), their `spec`."""

    name: str
    sources: list[torch.Tensor]
    slots: list[int]
    spec: Spec


def scopes(live: LiveState) -> list[Scope]:
    """The scopes a buffered snapshot of `live` copies; weights that share memory (tied) are copied once."""
    out = []
    if live.weights is not None:
        sources: list[torch.Tensor] = []
        index: list[int] = []
        seen: dict[tuple[Any, ...], int] = {}
        for t in live.weights.values():
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
            if t.numel() == 0 or key not in seen:
                seen[key] = len(sources)
                sources.append(t)
            index.append(seen[key])
        out.append(("weights", sources, index))
    if live.optimizer is not None:
        sources = tensors_in(live.optimizer, [])
        out.append(("optimizer", sources, list(range(len(sources)))))
    return [Scope(name, ts, slots, tuple((tuple(t.shape), t.dtype) for t in ts)) for name, ts, slots in out]


class Copies:
    """Copies into buffers: a host dtype group of contiguous sources with one `torch.cat(out=region)` (faster than
    `_foreach_copy_` for many small tensors), other host sources with `torch._foreach_copy_`, CUDA ones on a stream."""

    def __init__(self) -> None:
        self.cats: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.host: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.cuda: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dsts, srcs = self.cuda if src.is_cuda else self.host
        dsts.append(dst)
        srcs.append(src)

    @torch.no_grad()  # sources may require grad (ZeRO's fp32 partitions): `cat(out=)` refuses them otherwise; and
    def run_host(self) -> None:  # grad mode is per thread (deferred copies run on the writer's IPC thread)
        for region, flats in self.cats:
            torch.cat(flats, out=region)
        if self.host[0]:
            torch._foreach_copy_(*self.host)

    @torch.no_grad()
    def issue_cuda(self, streams: dict[int, Any]) -> list[tuple[int, Any]]:
        """Queue the CUDA copies on a side stream per device (after the work already queued on the current stream);
        returns `(device, event)` pairs, recorded after them."""
        events = []
        for device in sorted({s.device.index or 0 for s in self.cuda[1]}):
            stream = streams.get(device)
            if stream is None:
                stream = streams[device] = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for dst, src in zip(*self.cuda):
                    if (src.device.index or 0) == device:
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(stream)  # its memory is not handed out again before the copy ran
            event = torch.cuda.Event()
            event.record(stream)
            events.append((device, event))
        return events


class Snapshotter:
    """Copies live state into the buffers (from `allocate`) it holds and reuses across saves."""

    def __init__(self, allocate: Allocator = shared_storage) -> None:
        self.allocate = allocate
        self.layouts: dict[str, Layout] = {}
        self.streams: dict[int, Any] = {}
        """A side stream per CUDA device, kept across saves."""

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(layout.nbytes for layout in self.layouts.values())

    def needed_bytes(self, scopes: list[Scope]) -> int:
        """Bytes a snapshot of `scopes` would newly allocate (0 when the held buffers fit)."""
        return sum(_offsets(s.spec)[1] for s in scopes if s.name not in self.layouts
                   or self.layouts[s.name].spec != s.spec)

    def take(self, live: LiveState, scopes: list[Scope],
             later: Callable[[Scope], list[bool]] | None = None) -> tuple[CheckpointState, list[Any], Copies]:
        """Copy `scopes` into the held buffers (reallocated where their spec changed), except what `later` marks.
        Returns the state, the events of its CUDA copies in flight and the copies left to run."""
        now, deferred, outputs = Copies(), Copies(), {}
        for scope in scopes:
            pinned = any(t.is_cuda for t in scope.sources)
            layout = self.layouts.get(scope.name)
            if layout is None or layout.spec != scope.spec or (pinned and not layout.pinned):
                self.layouts.pop(scope.name, None)  # freed before its replacement is allocated
                nbytes = _offsets(scope.spec)[1]
                try:
                    storage = self.allocate(nbytes, pinned) if nbytes else torch.UntypedStorage(0)
                except (OSError, RuntimeError) as e:
                    raise NoBufferError(f"{nbytes / 2**20:.1f} MiB of {'pinned' if pinned else 'shared'} memory for "
                                        f"the {scope.name} snapshot could not be reserved ({e})") from e
                layout = self.layouts[scope.name] = Layout(scope.spec, storage, pinned=pinned)
            mask = later(scope) if later is not None else [False] * len(scope.sources)
            for dtype, members in layout.groups.items():
                group = [scope.sources[i] for i in members]
                if not any(mask[i] for i in members) and all(not t.is_cuda and t.is_contiguous() for t in group):
                    now.cats.append((layout.regions[dtype], [t.view(-1) for t in group]))
                    continue
                for i in members:
                    (deferred if mask[i] else now).add(layout.views[i], scope.sources[i])
            outputs[scope.name] = [layout.views[i] for i in scope.slots]
        now.run_host()
        events = now.issue_cuda(self.streams)
        for device, event in events:  # the next optimizer step, on the current stream, runs after the copy
            torch.cuda.current_stream(device).wait_event(event)  # (ordered on the GPU; the host does not wait)
        weights = dict(zip(live.weights, outputs["weights"])) if live.weights is not None else None
        optimizer = substitute(live.optimizer, iter(outputs["optimizer"])) if live.optimizer is not None else None
        return live.state(weights, optimizer), [event for _, event in events], deferred

    def release(self) -> int:
        """Free every buffer (the next buffered save allocates again); returns the bytes released."""
        released = self.nbytes
        self.layouts.clear()
        if released:
            logger.debug("released %.1f MiB of snapshot buffers", released / 2**20)
        return released


class NoBufferError(RuntimeError):
    """The snapshot's buffers could not be allocated (`/dev/shm` or pinned memory short): the save streams."""


def direct(live: LiveState) -> CheckpointState:
    """A snapshot that refers to the live tensors (CUDA ones moved to the host), for saves training waits for."""
    weights = {k: v.to("cpu") for k, v in live.weights.items()} if live.weights is not None else None
    moved = (t.detach().to("cpu") for t in tensors_in(live.optimizer, []))
    return live.state(weights, substitute(live.optimizer, moved) if live.optimizer is not None else None)


# -- overlapped snapshots: the optimizer's parameters and `state` are copied beside the next forward and backward --
# Invariants: step and `load_state_dict` pre-hooks on the innermost optimizer hold the next `optimizer.step()` until
# the copy is done (CUDA: stream-ordered); the engine waits before a second save, an emergency save, `wait()`,
# `close()`. A deferred tensor changed before its copy (version counter) fails the save.

OVERLAP_MIN_BYTES = 32 << 20
"""`overlap=None` (auto) defers CUDA parameters with at least this much weights and optimizer state (host copies
would run on the cores that train: 1.6x the total cost on 2 cores)."""


def _key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    t = getattr(t, "_local_tensor", t)  # a DTensor parameter (FSDP2): its shard
    return (t.data_ptr(), t.numel(), t.dtype)


class PendingCopy:
    """The copies one save left to run beside the next step (`SaveHandle.deferred`): `nbytes`, `copy_ms` (host),
    `wait_ms` (the training thread's wait at the gate), `error` (failed, or a tensor changed before its copy)."""

    def __init__(self, step: int, copies: Copies, events: list[tuple[int, Any]]) -> None:
        self._watched = copies.host[1] + copies.cuda[1]
        self.step, self.nbytes = step, sum(t.nbytes for t in self._watched)
        self.error: BaseException | None = None
        self.copy_ms: float | None = None
        self.wait_ms: float | None = None
        self._copies: Copies | None = copies if copies.host[0] or copies.cats else None
        self._events = events
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
        self._done.wait()  # (once: `Overlap.wait` hands the pending copy over)
        for device, event in self._events:
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
    """An engine's overlap `setting` (`True`, `None`: auto, `OVERLAP_MIN_BYTES`, `False`) and its step gate. The
    hooks refer to the gate, never to the engine (the engine's finalizer must be able to run)."""

    def __init__(self, setting: bool | None) -> None:
        self.setting = setting
        self.pending: PendingCopy | None = None
        self._optimizer: Any = None
        self._hooks: list[Any] = []

    def deferral(self, optimizer: Any, live: LiveState, nbytes: Callable[[], int]
                 ) -> Callable[[Scope], list[bool]] | None:
        """Which sources of a scope a save copies later (the optimizer's parameters and `state`); `None`: none."""
        inner = optimizer  # the optimizer that steps (accelerate's `AcceleratedOptimizer` wraps one)
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer
        if self.setting is False or not isinstance(inner, torch.optim.Optimizer) or live.optimizer is None:
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

    def _on_step(self, *_: Any) -> None:  # a hook must return None
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

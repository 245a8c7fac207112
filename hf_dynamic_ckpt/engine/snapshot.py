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

import copy as _copy
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..constants import Tier
from ..errors import SaveError
from ..state.sources import StateSources
from ..store.types import BlobRef, CheckpointState

logger = logging.getLogger(__name__)

_WEIGHTS_PREFIX = "weights/"
_OPTIMIZER_PREFIX = "optimizer/"


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity of a tensor's current contents without reading them (in-place ops bump `_version`)."""
    return (t.device.type, t.device.index, t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.stride())


def _pin_shared(buf: torch.Tensor) -> None:
    """Page-lock a shared-memory buffer in place (as DCP's async staging does) so that
    device-to-host copies into it can be asynchronous; unpinned when the buffer dies."""
    nbytes = buf.numel() * buf.element_size()
    if nbytes == 0:
        return
    try:
        import torch.cuda._pin_memory_utils as pin_utils

        pin_utils.pin_memory(buf.data_ptr(), nbytes)
        weakref.finalize(buf, pin_utils.unpin_memory, buf.data_ptr())
    except Exception as e:  # copies still work, only synchronously
        logger.warning("could not pin a %d-byte shared snapshot buffer (%s): device-to-host copies will block", nbytes, e)


class BufferPool:
    """CPU buffers allocated once and reused across snapshots.

    A buffer is keyed by name; it is reallocated only when the shape or dtype under that
    name changes. Buffers for CUDA sources are pinned (page-locked) so device-to-host copies
    can run asynchronously; `shared=True` puts them in shared memory so a writer process
    can read them without another copy.

    Args:
        shared (`bool`, *optional*, defaults to `False`): allocate in shared memory.
    """

    def __init__(self, *, shared: bool = False) -> None:
        self.shared = shared
        self._buffers: dict[str, torch.Tensor] = {}
        self.generation = 0
        """Bumped on every (re)allocation; lets a writer process know when to remap."""

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        """Bytes currently held by the pool."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        return self._buffers

    def fits(self, name: str, like: torch.Tensor) -> bool:
        """Whether the buffer under `name` can take a copy of `like` without reallocation."""
        buf = self._buffers.get(name)
        return buf is not None and buf.shape == like.shape and buf.dtype == like.dtype

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer for `name`, (re)allocated to the shape and dtype of `like` if needed."""
        buf = self._buffers.get(name)
        if buf is not None and buf.shape == like.shape and buf.dtype == like.dtype:
            return buf
        cuda = like.is_cuda and torch.cuda.is_available()
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=cuda and not self.shared)
        if self.shared:
            buf.share_memory_()
            if cuda:
                _pin_shared(buf)
        self._buffers[name] = buf
        self.generation += 1
        return buf

    def retain_only(self, names: Iterable[str], prefixes: Iterable[str]) -> None:
        """Free buffers under `prefixes` whose names are not in `names` (state that disappeared)."""
        keep = set(names)
        scopes = tuple(prefixes)
        for name in [n for n in self._buffers if n.startswith(scopes) and n not in keep]:
            del self._buffers[name]
            self.generation += 1

    def clear(self) -> None:
        """Free every buffer."""
        if self._buffers:
            self._buffers.clear()
            self.generation += 1


class _CudaCopier:
    """Non-blocking device-to-host copies, batched on one side stream per device."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._pending: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        index = src.device.index if src.device.index is not None else torch.cuda.current_device()
        dsts, srcs = self._pending.setdefault(index, ([], []))
        dsts.append(dst)
        srcs.append(src)

    def finish(self) -> list[Any]:
        """Issue the copies, record one event per device and order its current stream after it."""
        events = []
        for index, (dsts, srcs) in sorted(self._pending.items()):
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            # The side stream must see every kernel already queued that writes the sources.
            stream.wait_stream(torch.cuda.current_stream(index))
            with torch.cuda.stream(stream):
                # A plain loop: device-to-host `copy_(non_blocking=True)` into pinned memory is the
                # documented asynchronous path (the CPU-side batching below is for host copies).
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src, non_blocking=True)
            for src in srcs:
                # The allocator must not hand a source's memory to another tensor before the copy ran.
                src.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
            # The next optimizer step (queued on the current stream) runs after the copy, on
            # the GPU, without the host waiting here.
            torch.cuda.current_stream(index).wait_event(event)
            events.append(event)
        self._pending.clear()
        return events


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

    def wait_copies(self) -> None:
        """Block until the asynchronous device-to-host copies of this snapshot are complete."""
        for event in self.events:
            event.synchronize()
        self.events = []


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _walk_tensors(obj: Any, prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict | Mapping):
        for k, v in obj.items():
            yield from _walk_tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _walk_tensors(v, f"{prefix}/{i}")


def state_dict_tensor_bytes(obj: Any) -> int:
    """Total bytes of the tensors inside a nested state dict."""
    return sum(_nbytes(t) for _, t in _walk_tensors(obj, ""))


def _clone_small(obj: Any) -> Any:
    """Deep copy of a small state dict (scheduler, scaler, sampler) with tensors cloned to CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _clone_small(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_small(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_small(v) for v in obj)
    return _copy.deepcopy(obj)


@dataclass
class LiveState:
    """What the sources hold right now, read but not copied (input of a snapshot).

    `copy_bytes` is what a buffered snapshot copies: the memory-aware staging compares it
    with the host headroom before deciding how to save.
    """

    step: int
    epoch: float
    weights: dict[str, torch.Tensor | BlobRef] | None
    frozen: dict[str, tuple[Any, ...]]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any] | None
    sampler: dict[str, Any] | None
    extra: dict[str, Any]

    def copy_items(self) -> list[tuple[str, torch.Tensor]]:
        """(buffer name, live tensor) for every tensor a buffered snapshot copies."""
        items = self.__dict__.get("_copy_items")
        if items is None:
            items = []
            if self.weights is not None:
                seen: set[tuple[Any, ...]] = set()
                for k, v in self.weights.items():
                    if isinstance(v, torch.Tensor) and k not in self.frozen:
                        key = _storage_key(v)
                        if key is not None and key in seen:
                            continue  # tied to a tensor already listed
                        if key is not None:
                            seen.add(key)
                        items.append((_WEIGHTS_PREFIX + k, v))
            if self.optimizer is not None:
                items += _walk_tensors(self.optimizer, _OPTIMIZER_PREFIX.rstrip("/"))
            self.__dict__["_copy_items"] = items
        return items

    @property
    def copy_bytes(self) -> int:
        return sum(_nbytes(t) for _, t in self.copy_items())

    @property
    def has_cuda(self) -> bool:
        if any(t.is_cuda for _, t in self.copy_items()):
            return True
        return self.weights is not None and any(
            isinstance(v, torch.Tensor) and v.is_cuda for v in self.weights.values()
        )


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
        self._last_used: set[str] = set()
        self._cuda: _CudaCopier | None = None
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
        rng: dict[str, Any] | None = None,
        sampler: dict[str, Any] | None = None,
    ) -> LiveState:
        """Read the sources for the given tiers without copying any large tensor.

        Args:
            sources (`StateSources`): live objects.
            step (`int`): optimizer steps completed.
            epoch (`float`): fractional epoch.
            tiers (`Iterable[Tier]`): tiers to include.
            rng (`dict`, *optional*): RNG state to store instead of capturing it now.
            sampler (`dict`, *optional*): data position to store instead of `sources.sampler()`.

        Returns:
            `LiveState`: references to live tensors plus small deep-copied state.
        """
        tiers = frozenset(Tier(t) for t in tiers)
        weights: dict[str, torch.Tensor | BlobRef] | None = None
        frozen: dict[str, tuple[Any, ...]] = {}
        if Tier.WEIGHTS in tiers:
            if sources.weights is None:
                raise SaveError(
                    "tiers include 'weights' but StateSources.weights is None: pass "
                    "StateSources(weights=model.state_dict) or drop Tier.WEIGHTS."
                )
            weights = {}
            for name, tensor in sources.weights().items():
                if not isinstance(tensor, torch.Tensor):
                    raise SaveError(
                        f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor: "
                        "StateSources.weights must return a mapping of tensors."
                    )
                tensor = tensor.detach()
                if name in sources.frozen_keys:
                    ident = _tensor_key(tensor)
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
                scheduler = _clone_small(sources.scheduler.state_dict())
            if sources.scaler is not None:
                scaler = _clone_small(sources.scaler.state_dict())
            if optimizer is None and scheduler is None and scaler is None:
                raise SaveError(
                    "tiers include 'optimizer' but StateSources has no optimizer, scheduler or "
                    "scaler: pass them or drop Tier.OPTIMIZER."
                )
        rng_state = sampler_state = None
        if Tier.STATE in tiers:
            if rng is not None:
                rng_state = _clone_small(rng)
            else:
                from ..state.rng import capture_rng_state

                rng_state = capture_rng_state()
            if sampler is not None:
                sampler_state = _clone_small(sampler)
            elif sources.sampler is not None:
                sampler_state = _clone_small(sources.sampler())
        extra = _clone_small(sources.extra()) if sources.extra is not None else {}
        return LiveState(
            step=step, epoch=epoch, weights=weights, frozen=frozen, optimizer=optimizer,
            scheduler=scheduler, scaler=scaler, rng=rng_state, sampler=sampler_state, extra=extra,
        )

    def extra_bytes_needed(self, live: LiveState) -> int:
        """Bytes a buffered snapshot of `live` would allocate beyond the buffers already held."""
        return sum(_nbytes(t) for name, t in live.copy_items() if not self.pool.fits(name, t))

    # -- producing a snapshot --------------------------------------------------------------
    def take(self, live: LiveState, *, copy: bool = True) -> Snapshot:
        """Make `live` immune to later training steps.

        Args:
            live (`LiveState`): from `collect`.
            copy (`bool`, *optional*, defaults to `True`): copy into the reusable buffers;
                `False` refers to live tensors (only while training waits for the write).

        Returns:
            `Snapshot`: the state for the store. With CUDA sources call `wait_copies()`
            before reading its tensors.
        """
        start = time.perf_counter()
        weights: dict[str, torch.Tensor | BlobRef] | None = None
        copied = live_bytes = 0
        # Only buffered copies go through the side stream (a direct CUDA tensor moves with
        # `.to("cpu")`), so a direct snapshot need not list its copy items at all.
        cuda = None
        if copy and live.has_cuda:
            if self._cuda is None:
                self._cuda = _CudaCopier()  # keeps its side streams across saves
            cuda = self._cuda
        used: set[str] = set()
        cpu_dsts: list[torch.Tensor] = []
        cpu_srcs: list[torch.Tensor] = []

        def copy_one(name: str, src: torch.Tensor) -> torch.Tensor:
            # Copies are batched: one _foreach_copy_ per device saves ~10 us per tensor.
            nonlocal copied
            used.add(name)
            dst = self.pool.get(name, src)
            if src.is_cuda:
                assert cuda is not None
                cuda.add(dst, src)
            else:
                cpu_dsts.append(dst)
                cpu_srcs.append(src)
            copied += _nbytes(src)
            return dst

        if live.weights is not None:
            weights = {}
            # Tied weights (embeddings / lm_head) share storage: copy once and keep them tied,
            # so the store still sees one tensor under two names.
            tied: dict[tuple[Any, ...], torch.Tensor] = {}
            for name, value in live.weights.items():
                if isinstance(value, BlobRef):
                    weights[name] = value
                elif copy and (name not in live.frozen or self.pool.shared):
                    key = _storage_key(value)
                    if key is not None and key in tied:
                        weights[name] = tied[key]
                        continue
                    dst = weights[name] = copy_one(_WEIGHTS_PREFIX + name, value)
                    if key is not None:
                        tied[key] = dst
                elif value.is_cuda:
                    # The store writes CPU tensors: a frozen or direct CUDA tensor moves once.
                    weights[name] = value.to("cpu")
                    copied += _nbytes(value)
                else:
                    weights[name] = value
                    live_bytes += _nbytes(value)
        optimizer = live.optimizer
        if optimizer is not None:
            optimizer = self._copy_nested(
                optimizer, _OPTIMIZER_PREFIX.rstrip("/"), copy_one if copy else None
            )
            if not copy:
                live_bytes += state_dict_tensor_bytes(optimizer)
        if cpu_dsts:
            torch._foreach_copy_(cpu_dsts, cpu_srcs)
        events = cuda.finish() if cuda is not None else []
        if copy:
            # Only the tiers this snapshot read can tell which of their buffers are stale.
            scopes = [p for p, present in ((_WEIGHTS_PREFIX, live.weights is not None),
                                           (_OPTIMIZER_PREFIX, live.optimizer is not None)) if present]
            if used != self._last_used:  # the common case (same state as last time) costs nothing
                self.pool.retain_only(used, scopes)
                self._last_used = used
        state = CheckpointState(
            step=live.step, epoch=live.epoch, weights=weights,
            dedup_keys=frozenset(live.frozen) | frozenset(
                k for k, v in (weights or {}).items() if isinstance(v, BlobRef)
            ),
            optimizer=optimizer, scheduler=live.scheduler, scaler=live.scaler, rng=live.rng,
            sampler=live.sampler, extra=live.extra,
        )
        return Snapshot(
            state=state, copied_bytes=copied, live_bytes=live_bytes,
            blocking_s=time.perf_counter() - start, pending_blobs=dict(live.frozen), events=events,
        )

    def _copy_nested(
        self, obj: Any, prefix: str, copy_one: Callable[[str, torch.Tensor], torch.Tensor] | None
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            if copy_one is not None:
                return copy_one(prefix, obj.detach())
            return obj.detach().to("cpu") if obj.is_cuda else obj.detach()
        if isinstance(obj, dict | Mapping):
            return {k: self._copy_nested(v, f"{prefix}/{k}", copy_one) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy_nested(v, f"{prefix}/{i}", copy_one) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._copy_nested(v, f"{prefix}/{i}", copy_one) for i, v in enumerate(obj))
        return _copy.deepcopy(obj)

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

    def forget_blobs(self) -> None:
        """Forget every stored blob (e.g. after the store was pruned); the next save rewrites them."""
        self._stored_blobs.clear()

    def _blob_alive(self, ref: BlobRef) -> bool:
        return self._blob_exists is None or self._blob_exists(ref)

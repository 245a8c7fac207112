"""Reusable host buffers a snapshot copies into, and batched device-to-host copies.

`BufferPool` owns the CPU (optionally shared-memory, optionally page-locked) buffers, as
`Layout`s: named views into one flat region per dtype; `CudaCopier` issues the
asynchronous device-to-host copies into them on a side stream.
Neither reads training state: `snapshot.Snapshotter` decides what goes where.

Shared-memory regions (for a writer process) are allocated without holding the GIL
(`new_shared_storage`): `torch.UntypedStorage._new_shared(n)` reserves the pages of a new
shared-memory file with `posix_fallocate` (so that running out of `/dev/shm` is an error, not
a SIGBUS on first touch) while it holds the GIL: allocating the ~700 MiB of snapshot buffers
of a 60M-parameter full fine-tune in the background stalled the training thread for as long
(0.1-0.6 s, measured on `Thread.start` during a resume). Here the file is created, sized and
reserved through `os` calls, which release the GIL, and torch only maps the finished file
(`_new_shared_fd_cpu`, what a storage received from another process uses). The result is a
torch shared storage like `_new_shared`'s: it travels to the writer process by its file
descriptor, and its memory is freed with the storage (the file is unlinked at once).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_counter = itertools.count()


def new_shared_storage(nbytes: int, *, directory: str = SHM_DIR) -> torch.UntypedStorage | None:
    """A shared-memory storage of `nbytes` bytes whose pages are reserved (zero-filled).

    Args:
        nbytes (`int`): size in bytes (> 0).
        directory (`str`, *optional*, defaults to `"/dev/shm"`): the tmpfs the file lives in.

    Returns:
        `torch.UntypedStorage | None`: the storage, or `None` where this platform lacks what
        it needs (no `directory`, no `posix_fallocate`, an older torch) or the memory cannot be
        reserved (e.g. `ENOSPC`: `directory` is too small): the caller then uses
        `torch.UntypedStorage._new_shared`, which raises its usual error for the latter.
    """
    fallocate = getattr(os, "posix_fallocate", None)
    from_fd = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)
    if nbytes <= 0 or fallocate is None or from_fd is None or not os.path.isdir(directory):
        return None
    path = os.path.join(directory, f"hf-dynamic-ckpt-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as e:
        logger.debug("shared memory in %s not available (%s); using torch's allocator", directory, e)
        return None
    try:
        os.unlink(path)  # nothing to clean up after a crash: the memory lives as long as a mapping does
        os.ftruncate(fd, nbytes)
        fallocate(fd, 0, nbytes)
        storage: torch.UntypedStorage = from_fd(fd, nbytes)  # maps it (its own duplicate of the descriptor)
    except (OSError, RuntimeError) as e:
        logger.debug("could not reserve %d bytes of shared memory in %s (%s); using torch's allocator", nbytes,
                     directory, e)
        return None
    finally:
        os.close(fd)
    return storage


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
        logger.warning("could not pin a %d-byte shared snapshot buffer (%s): device-to-host copies will block",
                       nbytes, e)


ItemSpec = tuple[str, tuple[int, ...], torch.dtype]
"""(buffer name, shape, dtype) of one tensor a layout holds."""


def _allocate(numel: int, dtype: torch.dtype, *, shared: bool, pinned: bool) -> torch.Tensor:
    """A flat, uninitialised host tensor: shared memory, page-locked, or plain."""
    if shared:
        nbytes = numel * dtype.itemsize
        try:  # allocated in shared memory directly (share_memory_() would copy a fresh buffer over)
            storage = new_shared_storage(nbytes) or torch.UntypedStorage._new_shared(nbytes)  # the first: GIL released
            buf = torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))
        except (AttributeError, RuntimeError):
            buf = torch.empty(numel, dtype=dtype).share_memory_()
        if pinned:
            _pin_shared(buf)
        return buf
    return torch.empty(numel, dtype=dtype, pin_memory=pinned)


class Layout:
    """Named views into one flat region per dtype: the buffers of one scope (e.g. all weights).

    Many small tensors then live in a few contiguous regions, so a snapshot copies them
    with one `torch.cat(..., out=region)` per dtype instead of one copy each, and a writer
    process maps a few regions instead of thousands of buffers.

    Args:
        spec (`tuple[ItemSpec, ...]`): (name, shape, dtype) per tensor, in copy order.
        shared (`bool`): allocate the regions in shared memory.
        pinned (`bool`): page-lock the regions (device-to-host copies can then be asynchronous).
    """

    def __init__(self, spec: tuple[ItemSpec, ...], *, shared: bool, pinned: bool) -> None:
        self.spec = spec
        self.pinned = pinned
        counts: dict[torch.dtype, int] = {}
        offsets = []
        for _, shape, dtype in spec:
            offsets.append(counts.get(dtype, 0))
            counts[dtype] = counts.get(dtype, 0) + math.prod(shape)
        self.regions = {dtype: _allocate(n, dtype, shared=shared, pinned=pinned) for dtype, n in counts.items()}
        self.views: dict[str, torch.Tensor] = {}
        for (name, shape, dtype), offset in zip(spec, offsets):
            self.views[name] = self.regions[dtype][offset:offset + math.prod(shape)].view(shape)
        self.offsets = dict(zip((name for name, _, _ in spec), offsets))
        """name -> element offset in its dtype's region: how a writer process rebuilds the views."""
        self.nbytes = sum(r.numel() * r.element_size() for r in self.regions.values())

    def prefault(self) -> None:
        """Touch every page now (zero fill), so the first copy into the regions runs at memcpy speed."""
        for region in self.regions.values():
            region.zero_()


def spec_bytes(spec: Iterable[ItemSpec]) -> int:
    """Bytes a layout of `spec` holds."""
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in spec)


class BufferPool:
    """CPU buffers allocated once and reused across snapshots, grouped in layouts by scope.

    A scope (`"weights/"`, `"optimizer/"`) holds one `Layout`; it is reallocated only when
    the list of (name, shape, dtype) under that scope changes. Buffers for CUDA sources are
    pinned (page-locked) so device-to-host copies can run asynchronously; `shared=True` puts
    them in shared memory so a writer process can read them without another copy.

    Args:
        shared (`bool`, *optional*, defaults to `False`): allocate in shared memory.
    """

    def __init__(self, *, shared: bool = False) -> None:
        self.shared = shared
        self._layouts: dict[str, Layout] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self.generation = 0
        """Bumped on every (re)allocation; lets a writer process know when to remap."""

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        """Bytes currently held by the pool."""
        return sum(layout.nbytes for layout in self._layouts.values())

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        """Every buffer by name (views into the layouts' regions)."""
        return self._buffers

    @property
    def layouts(self) -> Mapping[str, Layout]:
        return self._layouts

    def needed_bytes(self, scope: str, spec: tuple[ItemSpec, ...]) -> int:
        """Bytes that holding `spec` under `scope` would newly allocate (0 when it is held already)."""
        layout = self._layouts.get(scope)
        return 0 if layout is not None and layout.spec == spec else spec_bytes(spec)

    def layout(self, scope: str, spec: tuple[ItemSpec, ...], *, pinned: bool = False) -> Layout:
        """The layout of `scope` for `spec`: the one held if it matches, else a new one (the old is freed)."""
        layout = self._layouts.get(scope)
        if layout is not None and layout.spec == spec and (layout.pinned or not pinned):
            return layout
        self.install(scope, Layout(spec, shared=self.shared, pinned=pinned))
        return self._layouts[scope]

    def install(self, scope: str, layout: Layout) -> None:
        """Hold `layout` under `scope` (e.g. one allocated and pre-faulted in the background)."""
        self._remove(scope)
        self._layouts[scope] = layout
        self._buffers.update(layout.views)
        self.generation += 1

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A buffer of its own for `name`, (re)allocated to the shape and dtype of `like` if needed."""
        cuda = like.is_cuda and torch.cuda.is_available()
        return self.layout(name, ((name, tuple(like.shape), like.dtype),), pinned=cuda).views[name]

    def drop(self, scope: str) -> None:
        """Free the layout of `scope`."""
        if self._remove(scope):
            self.generation += 1

    def _remove(self, scope: str) -> bool:
        layout = self._layouts.pop(scope, None)
        if layout is None:
            return False
        for name in layout.views:
            self._buffers.pop(name, None)
        return True

    def clear(self) -> None:
        """Free every buffer."""
        if self._layouts:
            self._layouts.clear()
            self._buffers.clear()
            self.generation += 1


class CudaCopier:
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
        for index, event in self.issue():
            # The next optimizer step (queued on the current stream) runs after the copy, on
            # the GPU, without the host waiting here.
            torch.cuda.current_stream(index).wait_event(event)
            events.append(event)
        return events

    def issue(self) -> list[tuple[int, Any]]:
        """Issue the copies and record one event per device, without ordering any current stream after it:
        (device index, event) pairs; the caller orders the current stream later (`overlap.PendingCopy`)."""
        issued = []
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
            issued.append((index, event))
        self._pending.clear()
        return issued

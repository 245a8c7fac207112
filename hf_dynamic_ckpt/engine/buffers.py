"""Reusable host buffers a snapshot copies into, and batched device-to-host copies.

`BufferPool` owns the CPU (optionally shared-memory, optionally page-locked) buffers;
`CudaCopier` issues the asynchronous device-to-host copies into them on a side stream.
Neither reads training state: `snapshot.Snapshotter` decides what goes where.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)


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

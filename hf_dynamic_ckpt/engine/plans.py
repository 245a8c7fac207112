"""Copy plans: how the tensors of one scope go into its buffers, kept while they stay the same tensors.

Working out a buffered snapshot from scratch costs a few microseconds per tensor (names,
tied-weight detection, views, one copy call each): nothing for a 60M-parameter model, but
several times the copy itself for a LoRA adapter of hundreds of small tensors. A
`Blueprint` records that work for the tensors of one scope (`"weights/"`, `"optimizer/"`);
a `Plan` binds it to the scope's `Layout` of flat per-dtype regions, so a later save with
the same tensors only checks them (`Blueprint.matches`: the same tensor objects at the same
memory with the same shapes, compared list against list in C, ~0.1 us per tensor) and copies
each dtype group with one `torch.cat(flat sources, out=region)`; or, when the group's
sources are consecutive views that exactly tile a span of one storage (a consolidated model,
`state.flat`, or any flat parameter buffer), with one copy of that span (`tiled_span`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .buffers import CudaCopier, ItemSpec, Layout
from .live import storage_key

_data_ptr = torch.Tensor.data_ptr
_shape = operator.attrgetter("shape")


@dataclass(eq=False)
class Blueprint:
    """The source side of a plan: which tensors a scope copies, checked cheaply on every save.

    Attributes:
        scope (`str`): buffer-name prefix of the scope.
        names (`tuple[str, ...] | None`): output key per source (weights); `None` when the
            sources are addressed by position (optimizer state, in walk order).
        sources (`list[torch.Tensor]`): the tensors as last seen (kept alive).
        ptrs / shapes: their data pointers and shapes, compared on every save.
        ids: `id()` of each source (kept alive by `sources`, so stable).
        index (`list[int]`): source -> unique item (tied weights share one buffer).
        unique (`list[torch.Tensor]`): the detached source of each unique item.
        spec (`tuple[ItemSpec, ...]`): (buffer name, shape, dtype) per unique item.
        pinned (`bool`): some source lives on a CUDA device (its buffers are page-locked).
        flats (`list[torch.Tensor | None]`): a flat view of each unique host source that is
            contiguous (what `torch.cat` reads), else `None`.
    """

    scope: str
    names: tuple[str, ...] | None
    sources: list[torch.Tensor]
    ptrs: list[int]
    shapes: list[torch.Size]
    index: list[int]
    unique: list[torch.Tensor]
    spec: tuple[ItemSpec, ...]
    pinned: bool
    flats: list[torch.Tensor | None]

    def __post_init__(self) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in self.unique)
        """Bytes of the unique items (what a snapshot of the scope copies)."""
        self.ids = list(map(id, self.sources))
        self.split: tuple[Any, tuple[bool, ...]] | None = None
        """Set by `overlap.Deferral`: (the optimizer's parameter keys, which unique items are copied later)."""

    def matches(self, names: tuple[str, ...] | None, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` (under `names`) are the tensors this blueprint was made for.

        The same object with the same data pointer and shape is the same tensor (`.data = x`
        or a resize changes one of them); a different object (e.g. a fresh `state_dict()`
        detach) must also agree on dtype, stride and device.
        """
        if len(tensors) != len(self.sources) or names != self.names:
            return False
        if list(map(id, tensors)) == self.ids:  # the same objects (usual): memory and shape, compared in C
            return list(map(_data_ptr, tensors)) == self.ptrs and list(map(_shape, tensors)) == self.shapes
        for t, s, ptr, shape in zip(tensors, self.sources, self.ptrs, self.shapes):
            if t.data_ptr() != ptr or t.shape != shape:
                return False
            if t is not s and (t.dtype != s.dtype or t.stride() != s.stride() or t.device != s.device):
                return False
        return True


def make_blueprint(scope: str, names: tuple[str, ...] | None, tensors: Sequence[torch.Tensor],
                   item_names: Sequence[str], *, dedupe: bool) -> Blueprint:
    """Work out a scope's copies from scratch.

    Args:
        scope (`str`): buffer-name prefix.
        names (`tuple[str, ...] | None`): see `Blueprint.names`.
        tensors (`Sequence[torch.Tensor]`): the sources, in order.
        item_names (`Sequence[str]`): a buffer name per source (starting with `scope`).
        dedupe (`bool`): give sources that share storage (tied weights) one buffer.
    """
    index: list[int] = []
    unique: list[torch.Tensor] = []
    spec: list[ItemSpec] = []
    seen: dict[tuple[Any, ...], int] = {}
    for name, t in zip(item_names, tensors):
        key = storage_key(t) if dedupe else None
        if key is not None and key in seen:
            index.append(seen[key])
            continue
        if key is not None:
            seen[key] = len(unique)
        index.append(len(unique))
        unique.append(t.detach())
        spec.append((name, tuple(t.shape), t.dtype))
    return Blueprint(scope=scope, names=names, sources=list(tensors), ptrs=[t.data_ptr() for t in tensors],
                     shapes=[t.shape for t in tensors], index=index, unique=unique, spec=tuple(spec),
                     pinned=any(t.is_cuda for t in unique),
                     flats=[None if t.is_cuda or not t.is_contiguous() else t.view(-1) for t in unique])


def tiled_span(sources: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view covering `sources` when they are consecutive views that exactly tile a span of one storage.

    Every source must be contiguous, of one dtype and device, and start where the previous
    one ends (in order, no gap, no overlap); empty sources are passed over. The layout of a
    scope packs its views of one dtype the same way (`buffers.Layout`: tight, in spec order),
    so copying the span into the dtype's region is the same bytes as copying each source
    into its view.

    Returns:
        `torch.Tensor | None`: a 1-d view of the span (keeping its storage alive), or `None`.
    """
    live = [t for t in sources if t.numel() > 0]
    if not live:
        return None
    first = live[0]
    storage = first.untyped_storage()
    base, dtype, device = storage.data_ptr(), first.dtype, first.device
    offset = start = first.storage_offset()
    for t in live:
        if (t.dtype != dtype or t.device != device or not t.is_contiguous() or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != base):
            return None
        offset += t.numel()
    span = torch.empty(0, dtype=dtype, device=device).set_(storage, start, (offset - start,), (1,))
    return span


class Copies:
    """One part of a plan's copies: the span copies, the concatenations, the batched single copies, the CUDA copies."""

    def __init__(self) -> None:
        self.spans: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(region, span): host dtype groups copied with one `copy_` (`tiled_span`)."""
        self.cats: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.singles: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.cuda: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __bool__(self) -> bool:
        return bool(self.spans or self.cats or self.singles[0] or self.cuda)

    def add(self, target: torch.Tensor, views: list[torch.Tensor], sources: list[torch.Tensor],
            flats: list[torch.Tensor | None]) -> None:
        """Copies of consecutive items of one dtype into `target`, the slice of the region they tile."""
        span = tiled_span(sources)
        if span is not None and span.numel() == target.numel():
            (self.cuda if span.is_cuda else self.spans).append((target, span))
        elif all(f is not None for f in flats):
            self.cats.append((target, flats))  # type: ignore[arg-type]
        else:
            for view, s in zip(views, sources):
                if s.is_cuda:
                    self.cuda.append((view, s))
                else:
                    self.singles[0].append(view)
                    self.singles[1].append(s)

    def run(self, cuda: CudaCopier | None) -> None:
        """Issue these copies (CUDA ones are only queued on `cuda`)."""
        for region, span in self.spans:
            region.copy_(span)
        for region, flats in self.cats:
            torch.cat(flats, out=region)
        if self.singles[0]:
            torch._foreach_copy_(self.singles[0], self.singles[1])
        if self.cuda:
            assert cuda is not None
            for dst, src in self.cuda:
                cuda.add(dst, src)


class Plan:
    """A blueprint bound to its layout: the copies one snapshot of the scope issues.

    Sources of one dtype that tile a span of one storage (`tiled_span`) are copied with one
    `region.copy_(span)` (host) or one `CudaCopier.add` (CUDA); other host sources of one
    dtype that are all contiguous with one `torch.cat` into the dtype's region; the rest
    with one batched `torch._foreach_copy_`; CUDA sources through the `CudaCopier`
    (asynchronous, into page-locked buffers).

    With `deferred` (a flag per unique item: `overlap.py` sets it on what only an optimizer step changes) the
    copies come in two parts, `now` and `later`: each run of consecutive items of one dtype with the same flag
    is copied as above into the slice of the region it tiles. Without it everything is `now`.
    """

    def __init__(self, blueprint: Blueprint, layout: Layout, deferred: Sequence[bool] | None = None) -> None:
        self.blueprint = blueprint
        self.layout = layout
        self.deferred = tuple(deferred) if deferred is not None else None
        self.views = [layout.views[name] for name, _, _ in blueprint.spec]
        self._outputs = [self.views[j] for j in blueprint.index]
        self.now, self.later = Copies(), Copies()
        groups: dict[torch.dtype, list[int]] = {}
        for j, (_, _, dtype) in enumerate(blueprint.spec):
            groups.setdefault(dtype, []).append(j)
        for dtype, members in groups.items():
            region = layout.regions[dtype]
            for later, run in _runs(members, self.deferred):
                start = layout.offsets[blueprint.spec[run[0]][0]]
                stop = start + sum(self.views[j].numel() for j in run)
                target = region if start == 0 and stop == region.numel() else region[start:stop]
                (self.later if later else self.now).add(target, [self.views[j] for j in run],
                                                        [blueprint.unique[j] for j in run],
                                                        [blueprint.flats[j] for j in run])

    def run(self, cuda: CudaCopier | None) -> None:
        """Issue every copy of this scope, both parts (CUDA ones are only queued on `cuda`)."""
        self.now.run(cuda)
        self.later.run(cuda)

    def outputs(self) -> list[torch.Tensor]:
        """The buffer of each source, in source order (tied sources share one)."""
        return self._outputs


def _runs(members: list[int], deferred: tuple[bool, ...] | None) -> list[tuple[bool, list[int]]]:
    """`members` (of one dtype, in layout order) cut into runs of one `deferred` flag: (flag, run)."""
    if deferred is None:
        return [(False, members)]
    out: list[tuple[bool, list[int]]] = []
    for j in members:
        if out and out[-1][0] == deferred[j]:
            out[-1][1].append(j)
        else:
            out.append((deferred[j], [j]))
    return out

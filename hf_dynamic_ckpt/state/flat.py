"""Trainable parameters and their optimizer state moved into one flat buffer per (device, dtype).

A LoRA run has hundreds of small trainable tensors; a snapshot of them is hundreds of small
copies. `consolidate` moves the trainable parameters (`param.data` re-pointed to views of
one buffer per device and dtype, laid out in the order the weights mapping lists them) and
the optimizer's per-parameter state (`optimizer.state[p][name]` re-pointed to views of one
buffer per device and dtype, in `optimizer.state_dict()` walk order), so that the snapshot
plans (`engine.plans.tiled_span`) copy each scope's dtype group with ONE copy.

Values are copied bit for bit; every tensor keeps its shape, dtype and device; the
`Parameter` objects, their gradients and hooks (DDP's included) stay the same objects.
`FlatState.intact()` tells whether something replaced them since (`optimizer.load_state_dict`
on resume, `model.to(...)`, a re-assigned parameter): `FlatKeeper.keep()` then consolidates
again. The integrations call `keep()` on the training thread between steps.

What is consolidated: trainable parameters (`requires_grad`) that are contiguous, own their
storage (no view of a larger tensor, no storage shared with another tensor) and are plain
tensors (no `DTensor`); the state of a `torch.optim.Optimizer` whose entries are flat dicts of
tensors and scalars. Anything else is left where it is (the plans then copy it as before).
By default (`enabled=None`) only where it pays: at least `MIN_TENSORS` trainable tensors of
at most `MAX_MEAN_BYTES` on average (LoRA and other adapters). A full fine-tune is left as it
is: its tensors are large enough that one copy per tensor costs about what one copy of the
whole costs, while the move would hold its weights and optimizer state twice for a moment
and stall the first step on fresh memory (docs/benchmarks.md, `bench_save.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

MIN_TENSORS = 32
"""Fewest trainable tensors for which consolidation is on by default."""
MAX_MEAN_BYTES = 2**20
"""Largest mean trainable tensor size (bytes) for which consolidation is on by default.

Measured on a 60M Qwen2 full fine-tune (147 tensors, 2.6 MB mean, 733 MB with AdamW): the
snapshot without consolidation is 1.03x a memcpy of the same bytes, so the move (1.5 s on
the first step, on fresh pages) buys nothing there; a LoRA snapshot (21 KB mean) is 3.4x
faster consolidated."""

_SCALARS = (int, float, bool, type(None))
_Key = tuple[torch.device, torch.dtype]


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided


def _own_storage(t: torch.Tensor) -> bool:
    """`t` is contiguous and is its whole storage (a view of nothing larger)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _pack(tensors: list[torch.Tensor]) -> tuple[dict[_Key, torch.Tensor], list[torch.Tensor]]:
    """One buffer per (device, dtype) holding copies of `tensors` in order, and each tensor's view of it."""
    sizes: dict[_Key, int] = {}
    offsets = []
    for t in tensors:
        key = (t.device, t.dtype)
        offsets.append(sizes.get(key, 0))
        sizes[key] = sizes.get(key, 0) + t.numel()
    buffers = {key: torch.empty(n, dtype=key[1], device=key[0]) for key, n in sizes.items()}
    views = []
    for t, offset in zip(tensors, offsets):
        view = buffers[(t.device, t.dtype)][offset:offset + t.numel()].view(t.shape)
        view.copy_(t)
        views.append(view)
    return buffers, views


@dataclass(eq=False)
class FlatState:
    """Where `consolidate` put the tensors, to tell cheaply whether they are still there.

    Attributes:
        params (`list[nn.Parameter]`): the moved parameters, in buffer order.
        param_buffers (`dict`): (device, dtype) -> the flat buffer holding them.
        optimizer (`torch.optim.Optimizer | None`): whose state was moved.
        entries (`list[tuple[dict, str]]`): (state entry, key) of every moved state tensor, in buffer order.
        state_buffers (`dict`): (device, dtype) -> the flat buffer holding the optimizer state.
    """

    params: list[nn.Parameter]
    param_buffers: dict[_Key, torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    entries: list[tuple[dict[str, Any], str]]
    state_buffers: dict[_Key, torch.Tensor]

    def __post_init__(self) -> None:
        self._param_ptrs = [p.data_ptr() for p in self.params]
        self._state_tensors = [entry[key] for entry, key in self.entries]
        self._state_ptrs = [t.data_ptr() for t in self._state_tensors]
        state = getattr(self.optimizer, "state", None)
        self._entry_objs = list(state.values()) if state is not None else []

    @property
    def nbytes(self) -> int:
        """Bytes held in the flat buffers."""
        return sum(b.numel() * b.element_size() for b in (*self.param_buffers.values(), *self.state_buffers.values()))

    def params_intact(self) -> bool:
        """Every moved parameter still points at its place in the buffer."""
        return [p.data_ptr() for p in self.params] == self._param_ptrs

    def state_intact(self) -> bool:
        """The optimizer still holds the same entries, pointing at their places in the buffer."""
        if self.optimizer is None:
            return True
        state = self.optimizer.state
        if len(state) != len(self._entry_objs) or any(a is not b for a, b in zip(state.values(), self._entry_objs)):
            return False
        current = [entry.get(key) for entry, key in self.entries]
        return all(a is b for a, b in zip(current, self._state_tensors)) and [
            t.data_ptr() for t in self._state_tensors] == self._state_ptrs

    def intact(self) -> bool:
        """Nothing replaced the moved tensors since (e.g. `optimizer.load_state_dict`, `model.to`)."""
        return self.params_intact() and self.state_intact()


def trainable_in_order(model: nn.Module, order: Iterable[torch.Tensor] = ()) -> list[nn.Parameter]:
    """`model`'s trainable parameters, those aliased by `order` (the weights mapping's tensors) first, in its order."""
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    by_ptr: dict[tuple[int, tuple[int, ...]], nn.Parameter] = {}
    for p in trainable.values():
        if p.numel() > 0:
            by_ptr.setdefault((p.data_ptr(), tuple(p.shape)), p)
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for t in order:
        found = by_ptr.get((t.data_ptr(), tuple(t.shape))) if t.numel() > 0 else None
        if found is not None and id(found) not in seen:
            seen.add(id(found))
            out.append(found)
    out += [p for i, p in trainable.items() if i not in seen]
    return out


def _movable_params(params: list[nn.Parameter], *, ours: set[int]) -> list[nn.Parameter]:
    # Each must own its storage (or sit in a previous flat buffer of ours), share it with no other one.
    storages: set[int] = set()
    out = []
    for p in params:
        if p.numel() == 0 or not _plain(p) or not p.is_contiguous():
            continue
        base = p.untyped_storage().data_ptr()
        if base not in ours and (not _own_storage(p) or base in storages):
            continue
        storages.add(base)
        out.append(p)
    return out


def _state_entries(optimizer: Any) -> list[tuple[dict[str, Any], str]] | None:
    """(entry, key) of every state tensor in `state_dict()` walk order; `None` when the layout is not flat."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    out = []
    storages: set[int] = set()
    for entry in optimizer.state.values():
        if type(entry) is not dict:
            return None
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                if not _plain(value) or not value.is_contiguous():
                    return None
                if value.numel() == 0:
                    continue
                base = value.untyped_storage().data_ptr()
                if base in storages:
                    return None  # two entries share memory: moving them apart would change what the optimizer does
                storages.add(base)
                out.append((entry, key))
            elif not isinstance(value, _SCALARS):
                return None
    return out


def consolidate(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                order: Iterable[torch.Tensor] = (), previous: FlatState | None = None) -> FlatState | None:
    """Move the trainable parameters and the optimizer's state into one flat buffer per (device, dtype).

    Run it on the training thread between steps (no step may run meanwhile).

    Args:
        model (`nn.Module`): whose trainable parameters move (`param.data` re-pointed).
        optimizer (`torch.optim.Optimizer`, *optional*): whose per-parameter state moves
            (`optimizer.state[p][name]` re-pointed); left alone when its entries are not flat
            dicts of tensors and scalars.
        order (`Iterable[torch.Tensor]`, *optional*): the weights mapping's tensors (what
            `StateSources.weights` returns): the parameters they alias are laid out in this order.
        previous (`FlatState`, *optional*): the last consolidation; a part of it still intact
            is kept as it is (e.g. only the optimizer state was replaced by a resume).

    Returns:
        `FlatState | None`: where everything went; `None` when nothing could be moved.
    """
    if previous is not None and previous.params_intact():
        params, param_buffers = previous.params, previous.param_buffers
    else:
        ours = {b.untyped_storage().data_ptr() for b in (previous.param_buffers.values() if previous else ())}
        params = _movable_params(trainable_in_order(model, order), ours=ours)
        param_buffers, views = _pack([p.detach() for p in params])
        with torch.no_grad():
            for p, view in zip(params, views):
                p.data = view
    entries: list[tuple[dict[str, Any], str]] = []
    state_buffers: dict[_Key, torch.Tensor] = {}
    if previous is not None and previous.optimizer is optimizer and previous.state_intact() and optimizer is not None:
        entries, state_buffers = previous.entries, previous.state_buffers
    elif optimizer is not None:
        found = _state_entries(optimizer)
        if found is None:
            logger.info("consolidation: the optimizer's state of %s is not a flat dict of tensors per parameter; "
                        "left where it is", type(optimizer).__name__)
        else:
            entries = found
            state_buffers, views = _pack([entry[key] for entry, key in entries])
            for (entry, key), view in zip(entries, views):
                entry[key] = view
    if not params and not entries:
        return None
    return FlatState(params=params, param_buffers=param_buffers, optimizer=optimizer if entries else None,
                     entries=entries, state_buffers=state_buffers)


def pays(model: nn.Module) -> bool:
    """Whether consolidation is worth it by default: many small trainable tensors (`MIN_TENSORS`, `MAX_MEAN_BYTES`)."""
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    return len(sizes) >= MIN_TENSORS and sum(sizes) / len(sizes) <= MAX_MEAN_BYTES


class FlatKeeper:
    """Keeps a model's trainable state consolidated: `keep()` between steps moves it again when replaced.

    Args:
        model (`nn.Module`): the trained model (the unwrapped one, whose parameters the optimizer holds).
        optimizer (`torch.optim.Optimizer`, *optional*): its optimizer.
        weights (`Callable[[], Mapping[str, torch.Tensor]]`, *optional*): the weights mapping a
            save reads; its order is the parameters' order in their buffer.
        enabled (`bool`, *optional*): `True` always, `False` never, `None` (default) where it
            pays (`pays`).
        on_move (`Callable[[], Any]`, *optional*): called after each move (e.g. to plan the
            snapshot copies for the new storage ahead of the next save).
    """

    def __init__(self, model: nn.Module, optimizer: Any | None = None, *,
                 weights: Callable[[], Mapping[str, torch.Tensor]] | None = None, enabled: bool | None = None,
                 on_move: Callable[[], Any] | None = None) -> None:
        self.model = model
        self.on_move = on_move
        self.optimizer = optimizer
        self.weights = weights
        from .sharded import is_sharded_model

        # FSDP2 parameters are DTensor shards (never moved); the rest: `enabled`, or where it pays.
        self.enabled = not is_sharded_model(model) and (pays(model) if enabled is None else enabled)
        """Whether `keep` consolidates at all (off for good once it found nothing to move): callers skip it when not."""
        self.state: FlatState | None = None
        self.moves = 0
        """How many times the state was (re)consolidated."""

    def keep(self) -> FlatState | None:
        """Consolidate now unless it is in place already (cheap: pointer checks).

        Waits for the optimizer's state: nothing moves before the first optimizer step, so the
        first move is done once (a parameter whose state appears later moves the state again).
        """
        if not self.enabled:
            return None
        if self.state is not None and self.state.intact():
            return self.state
        opt = self.optimizer
        if opt is not None and isinstance(opt, torch.optim.Optimizer) and not opt.state:
            return None  # no optimizer step yet: move once its state exists (state made later: moved again then)
        order = list(self.weights().values()) if self.weights is not None else []
        self.state = consolidate(self.model, opt, order=order, previous=self.state)
        self.moves += 1
        if self.state is None:
            logger.debug("consolidation: nothing to move (no plain trainable tensor); off for this run")
            self.enabled = False
        else:
            logger.debug("consolidated %d parameters and %d optimizer state tensors into %d flat buffers (%d bytes)",
                         len(self.state.params), len(self.state.entries),
                         len(self.state.param_buffers) + len(self.state.state_buffers), self.state.nbytes)
            if self.on_move is not None:
                self.on_move()
        return self.state

"""What the sources hold right now (`LiveState`), and walks over nested state dicts.

`Snapshotter.collect` builds a `LiveState` from `StateSources` without copying any large
tensor; `Snapshotter.take` copies (or refers to) what it lists. The walks come in pairs: one
lists the tensors of a state dict (`tensors_in`, `optimizer_tensors`), its inverse rebuilds
the state dict around copies of them (`substitute`, `substitute_optimizer`), in the same order.

Per-tensor Python work is what a LoRA snapshot pays beyond the copy, so the per-save walks
here avoid Python loops where the state has the usual shape (`optimizer_tensors`,
`substitute_optimizer`: a `torch.optim` state dict whose per-parameter entries are flat).
"""

from __future__ import annotations

import copy as _copy
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..constants import Tier
from ..state.rng import RawRngState
from ..state.sources import StateSources
from ..store import BlobRef

logger = logging.getLogger(__name__)

WEIGHTS_PREFIX = "weights/"
OPTIMIZER_PREFIX = "optimizer/"


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity of a tensor's current contents without reading them (in-place ops bump `_version`)."""
    return (t.device.type, t.device.index, t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.stride())


def storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def walk_tensors(obj: Any, prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict | Mapping):
        for k, v in obj.items():
            yield from walk_tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from walk_tensors(v, f"{prefix}/{i}")


SCALARS = frozenset({int, float, str, bool, bytes, type(None)})
"""Exact types of immutable leaves of a state dict (looked up by `type(v)`, no isinstance chain)."""


def tensors_in(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append the tensors of a nested state dict to `out`, in `walk_tensors`'s order.

    Runs on every save over every optimizer state tensor: leaves are told apart by exact
    type first (no call, no ABC check per scalar).
    """
    kind = type(obj)
    if kind is dict or (kind not in SCALARS and isinstance(obj, Mapping)):
        values: Iterable[Any] = obj.values()
    elif kind is list or kind is tuple or isinstance(obj, list | tuple):
        values = obj
    else:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        return out
    for v in values:
        t = type(v)
        if t in SCALARS:
            continue
        if t is torch.Tensor or isinstance(v, torch.Tensor):
            out.append(v)
        else:
            tensors_in(v, out)
    return out


def usual_optimizer_layout(sd: Any) -> bool:
    """Whether `sd` is laid out as `torch.optim.Optimizer.state_dict()` lays it out (keys `state`, `param_groups`)."""
    return type(sd) is dict and list(sd) == ["state", "param_groups"] and type(sd["state"]) is dict


def optimizer_tensors(sd: Any) -> list[torch.Tensor]:
    """The tensors of an optimizer state dict in `tensors_in`'s order, with one flat loop when it can.

    For `{"state": {id: {name: tensor or scalar}}, "param_groups": [...]}` (every `torch.optim`
    optimizer): the entries' tensors, then those of `param_groups` (normally none); any other
    layout goes through `tensors_in`.
    """
    if not usual_optimizer_layout(sd):
        return tensors_in(sd, [])
    out: list[torch.Tensor] = []
    append, tensor = out.append, torch.Tensor
    for entry in sd["state"].values():
        if type(entry) is not dict:
            return tensors_in(sd, [])
        for v in entry.values():
            kind = type(v)
            if kind is tensor:
                append(v)
            elif kind not in SCALARS:
                return tensors_in(sd, [])
    return tensors_in(sd["param_groups"], out)


def substitute(obj: Any, replacements: Iterator[torch.Tensor]) -> Any:
    """A copy of a nested state dict whose tensors are taken from `replacements`, in walk order.

    Containers are rebuilt (dict, list; a tuple only if it holds more than scalars), immutable
    scalars shared, anything else deep-copied, so later changes to the live state dict cannot
    reach the snapshot. Runs on every save over every optimizer state tensor: leaves are
    told apart by exact type first (no call, no ABC check per scalar).
    """
    kind = type(obj)
    if kind in SCALARS:
        return obj
    if kind is torch.Tensor or isinstance(obj, torch.Tensor):
        return next(replacements)
    if kind is dict or isinstance(obj, Mapping):
        out: dict[Any, Any] = {}
        for k, v in obj.items():
            t = type(v)
            if t in SCALARS:
                out[k] = v
            elif t is torch.Tensor:
                out[k] = next(replacements)
            else:
                out[k] = substitute(v, replacements)
        return out
    if kind is list or kind is tuple or isinstance(obj, list | tuple):
        if all(type(v) in SCALARS for v in obj):
            return obj if kind is tuple else list(obj)
        items = [substitute(v, replacements) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return _copy.deepcopy(obj)


def substitute_optimizer(sd: Any, replacements: Sequence[torch.Tensor]) -> Any:
    """`substitute(sd, iter(replacements))` for an optimizer state dict, without the generic walk when it can.

    Same result: the per-parameter entries of the copy are new dicts, their scalars shared
    (immutable); `param_groups` goes through `substitute`. Layouts `optimizer_tensors` does
    not walk flat go through `substitute` as a whole.
    """
    if not usual_optimizer_layout(sd):
        return substitute(sd, iter(replacements))
    it = iter(replacements)
    tensor = torch.Tensor
    out: dict[Any, Any] = {}
    for pid, entry in sd["state"].items():
        if type(entry) is not dict:
            return substitute(sd, iter(replacements))
        copied = out[pid] = {}
        for k, v in entry.items():
            kind = type(v)
            if kind is tensor:
                copied[k] = next(it)
            elif kind in SCALARS:
                copied[k] = v
            else:
                return substitute(sd, iter(replacements))
    return {"state": out, "param_groups": substitute(sd["param_groups"], it)}


def state_dict_tensor_bytes(obj: Any) -> int:
    """Total bytes of the tensors inside a nested state dict."""
    return sum(nbytes(t) for _, t in walk_tensors(obj, ""))


def clone_small(obj: Any) -> Any:
    """Deep copy of a small state dict (scheduler, scaler, sampler, RNG) with tensors cloned to CPU.

    Runs inside the blocking part of a save: immutable scalars are shared and a list or
    tuple of scalars is copied in one call (an RNG state holds two lists of ~624 ints,
    which a per-element walk took ~1 ms to copy, about a LoRA adapter's memcpy).
    """
    kind = type(obj)
    if kind in SCALARS:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: clone_small(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if set(map(type, obj)) <= SCALARS:
            return list(obj) if isinstance(obj, list) else tuple(obj)
        items = [clone_small(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return _copy.deepcopy(obj)


@dataclass
class LiveState:
    """What the sources hold right now, read but not copied (input of a snapshot).

    `copy_bytes` is what a buffered snapshot copies; the memory-aware staging weighs what it would
    newly allocate (`Snapshotter.extra_bytes_needed`) against the host headroom.
    """

    step: int
    epoch: float
    weights: dict[str, torch.Tensor | BlobRef] | None
    frozen: dict[str, tuple[Any, ...]]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any] | RawRngState | None
    sampler: dict[str, Any] | None
    extra: dict[str, Any]

    plain: bool = False
    """Every weight is a tensor to copy (no frozen key, no `BlobRef`): the per-save walks take shortcuts."""

    resolved: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    """Set by the `Snapshotter`: per scope, the held plan that still matches or a fresh blueprint."""

    def scope_sources(self) -> dict[str, tuple[tuple[str, ...] | None, list[torch.Tensor]]]:
        """Per buffer scope, the tensors a buffered snapshot copies: `{scope: (names or None, tensors)}`.

        `"weights/"`: every weight tensor that is not frozen, with its name; `"optimizer/"`:
        every tensor of the optimizer's state dict in walk order. Cheap (no per-tensor work
        beyond a type check); tied weights are found later, once per blueprint.
        """
        out: dict[str, tuple[tuple[str, ...] | None, list[torch.Tensor]]] = {}
        if self.weights is not None and self.plain:
            out[WEIGHTS_PREFIX] = (tuple(self.weights), list(self.weights.values()))  # type: ignore[arg-type]
        elif self.weights is not None:
            frozen = self.frozen
            pairs = [(k, v) for k, v in self.weights.items() if isinstance(v, torch.Tensor) and k not in frozen]
            out[WEIGHTS_PREFIX] = (tuple(k for k, _ in pairs), [v for _, v in pairs])
        if self.optimizer is not None:
            out[OPTIMIZER_PREFIX] = (None, optimizer_tensors(self.optimizer))
        return out

    def copy_items(self) -> list[tuple[str, torch.Tensor]]:
        """(buffer name, live tensor) for every tensor a buffered snapshot copies, tied weights once."""
        items: list[tuple[str, torch.Tensor]] = []
        if self.weights is not None:
            seen: set[tuple[Any, ...]] = set()
            for k, v in self.weights.items():
                if isinstance(v, torch.Tensor) and k not in self.frozen:
                    key = storage_key(v)
                    if key is not None and key in seen:
                        continue  # tied to a tensor already listed
                    if key is not None:
                        seen.add(key)
                    items.append((WEIGHTS_PREFIX + k, v))
        if self.optimizer is not None:
            items += walk_tensors(self.optimizer, OPTIMIZER_PREFIX.rstrip("/"))
        return items

    def drop_optimizer_tier(self) -> None:
        """Leave out L1 (optimizer, scheduler, scaler), e.g. when an emergency save runs out of time."""
        self.optimizer = self.scheduler = self.scaler = None
        self.resolved = None

    @property
    def copy_bytes(self) -> int:
        return sum(nbytes(t) for _, t in self.copy_items())


def available_tiers(sources: StateSources) -> set[Tier]:
    """The tiers `sources` can provide: L2 always, L0 with weights, L1 with any of optimizer/scheduler/scaler."""
    tiers = {Tier.STATE}
    if sources.weights is not None:
        tiers.add(Tier.WEIGHTS)
    if sources.optimizer is not None or sources.scheduler is not None or sources.scaler is not None:
        tiers.add(Tier.OPTIMIZER)
    return tiers


def fit_to_deadline(live: LiveState, *, throughput: float, left_s: float, step: int) -> bool:
    """Drop L1 from an emergency save when writing it would not fit in the time left; returns whether it did.

    L0 and L2 are always kept; the estimate is the bytes to write over the measured throughput,
    and L1 must fit in 80 % of `left_s` together with them.
    """
    if live.optimizer is None and live.scheduler is None and live.scaler is None:
        return False
    l0_bytes = sum(nbytes(v) for v in (live.weights or {}).values() if not isinstance(v, BlobRef))
    l1_bytes = state_dict_tensor_bytes(live.optimizer) if live.optimizer is not None else 0
    if (l0_bytes + l1_bytes) / throughput <= 0.8 * left_s:
        return False
    logger.warning(
        "emergency save of step %d: dropping the optimizer tier (%.1f MiB); weights + state need ~%.1f s "
        "of the %.1f s left at %.0f MB/s", step, l1_bytes / 2**20, l0_bytes / throughput, left_s, throughput / 1e6,
    )
    live.drop_optimizer_tier()
    return True

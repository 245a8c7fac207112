"""The live objects a save reads from (`StateSources`), and a cached L0 mapping (`CachedWeights`).

The engine only reads these; what they return aliases live tensors, which a snapshot copies.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

_data_ptr = torch.Tensor.data_ptr


@dataclass
class StateSources:
    """The live objects a save copies from. The engine only reads them.

    Args:
        weights (`Callable[[], Mapping[str, torch.Tensor]]`, *optional*): returns the L0
            tensors under their saved names, e.g. `model.state_dict` or a PEFT adapter dict.
        frozen_keys (`frozenset[str]`, *optional*): weight names that never change between
            saves (frozen base weights): the engine neither copies nor writes them.
        optimizer (`torch.optim.Optimizer`, *optional*): L1; its `state_dict()` aliases live
            tensors, which the snapshot copies.
        scheduler (*optional*): object with `state_dict()` (LR scheduler), L1.
        scaler (*optional*): object with `state_dict()` (AMP `GradScaler`), L1.
        sampler (`Callable[[], dict]`, *optional*): JSON-able data position, L2.

    Example:
        ```python
        >>> sources = StateSources(weights=model.state_dict, optimizer=optimizer)
        ```
    """

    weights: Callable[[], Mapping[str, torch.Tensor]] | None = None
    frozen_keys: frozenset[str] = frozenset()
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    scaler: Any | None = None
    sampler: Callable[[], dict[str, Any]] | None = None


class CachedWeights:
    """A `StateSources.weights` callable that builds its mapping once and reuses it.

    `model.state_dict()` and `peft.get_peft_model_state_dict(model)` walk every module on
    each call (tens of milliseconds on a 60M-parameter model, more than the copy of a LoRA
    adapter). Their tensors alias the live parameters, so the mapping stays valid while no
    parameter or buffer is replaced; that is checked on every call (storage pointer, shape,
    dtype of each), and the mapping is rebuilt when something changed (`model.to(...)`,
    a re-assigned parameter, a resized embedding).

    Args:
        model (`torch.nn.Module`): the model whose parameters the mapping aliases.
        fn (`Callable[[], Mapping[str, torch.Tensor]]`): builds the mapping, e.g.
            `model.state_dict` or `lambda: get_peft_model_state_dict(model)`.

    Example:
        ```python
        >>> sources = StateSources(weights=CachedWeights(model, model.state_dict), optimizer=optimizer)
        ```
    """

    def __init__(self, model: torch.nn.Module, fn: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._model = model
        self._fn = fn
        self._slots: tuple[list[dict[str, Any]], list[str], list[Any]] = ([], [], [])
        self._aliased: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._tables: list[dict[str, Any]] = []
        self._sizes: list[int] = []
        self._cache: dict[str, torch.Tensor] | None = None

    def _record(self) -> None:
        # Flat lists compared in C (`map`) per save: no module traversal (a PEFT model is deep). Every
        # module and parameter/buffer slot is checked by identity; the data pointer only of the tensors
        # the mapping aliases (a `.data =` elsewhere, e.g. on a frozen base weight, leaves it valid).
        held = {t.data_ptr() for t in (self._cache or {}).values() if isinstance(t, torch.Tensor)}
        tables: list[dict[str, Any]] = []
        names: list[str] = []
        objs: list[Any] = []
        self._aliased, self._ptrs, self._tables = [], [], []
        for module in self._model.modules():
            for table in (module._modules, module._parameters, module._buffers):
                self._tables.append(table)
                for name, obj in table.items():  # `None` slots too: a tensor set in one later is noticed
                    tables.append(table)
                    names.append(name)
                    objs.append(obj)
                    if isinstance(obj, torch.Tensor) and obj.data_ptr() in held:
                        self._aliased.append(obj)
                        self._ptrs.append(obj.data_ptr())
        self._slots = (tables, names, objs)
        self._sizes = list(map(len, self._tables))  # a slot added anywhere

    def _valid(self) -> bool:
        tables, names, objs = self._slots
        return (list(map(len, self._tables)) == self._sizes
                and all(map(operator.is_, map(dict.get, tables, names), objs))
                and list(map(_data_ptr, self._aliased)) == self._ptrs)

    def __call__(self) -> Mapping[str, torch.Tensor]:
        if self._cache is None or not self._valid():
            self._cache = dict(self._fn())
            self._record()
        return self._cache



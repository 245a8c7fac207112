"""FSDP2 sharded state as a save reads it: every rank's local shards of L0 and L1, and their chunks.

Under `torch.distributed.fsdp.fully_shard` every parameter (and the optimizer's moments) is a
`DTensor`. A save must not gather them: each rank hands its *local shard* to the engine (the
blocking part of a save stays a copy of that shard) and records where the shard lies in the
global tensor (a chunk: global shape, offset, size, dtype, as DCP's `ChunkStorageMetadata`).
The chunk tables travel to rank 0 with the commit (`store.commit`), which writes them into the
manifest (`extra["sharded"]`, JSON); the store writes the shard files and reads them back
through DCP's load planner, which reshards to any world size.

Only tensors are sharded state: the optimizer's `param_groups` (hyper-parameters) and the
scheduler / scaler are small and identical on every rank, so rank 0 stores them as today.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .. import constants
from ..errors import IncompatibleStateError, SaveError
from .sources import StateSources
from .zero import ZeroExpected, ZeroState

KEY_SHARDED, KEY_RANK_CHUNKS = constants.KEY_SHARDED, constants.KEY_RANK_CHUNKS
PART_WEIGHTS, PART_OPTIMIZER = constants.SHARD_PART_WEIGHTS, constants.SHARD_PART_OPTIMIZER
OPTIMIZER_KEY = constants.SHARD_OPTIMIZER_KEY


def is_dtensor(t: object) -> bool:
    """Whether `t` is a `torch.distributed.tensor.DTensor` (`False` where torch has no distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def is_sharded_model(model: nn.Module) -> bool:
    """Whether `model` holds DTensor parameters (FSDP2 `fully_shard`, or any DTensor parallelism)."""
    return any(is_dtensor(p) for p in model.parameters())


def check_sharding(step: int, manifest: Mapping[str, Any], expected: Mapping[str, Any], *, saved_flat: bool = False
                   ) -> None:
    """A sharded (FSDP2) checkpoint resumes into a sharded model only, an unsharded one into an unsharded model, a
    ZeRO one (`saved_flat`: runs of flattened parameters) into a ZeRO run only (`expected` a `ZeroExpected`).

    Raises:
        `IncompatibleStateError`: the two differ (the same on every rank, before anything is changed).
    """
    extra = manifest.get("extra")
    saved = isinstance(extra, dict) and KEY_SHARDED in extra
    zero = isinstance(expected, ZeroExpected)
    if saved_flat != zero:
        where = "under DeepSpeed ZeRO" if saved_flat else ("sharded by FSDP2" if saved else "without sharding")
        raise IncompatibleStateError(
            f"step {step} was saved {where} and this run {'trains under ZeRO' if zero else 'does not'}: resume it "
            "in the set-up that saved it (any ZeRO stage and number of processes for a ZeRO checkpoint), or export "
            "its weights (`hf-dynamic-ckpt export`) and start a new run from them.")
    if zero:
        return
    live = any(is_dtensor(v) for v in expected.values())
    if saved and not live:
        raise IncompatibleStateError(
            f"step {step} was saved sharded (FSDP2: one file of shards per rank) and this model is not sharded: "
            "resume it with the fully_shard-ed model through SmartCheckpointer or RunOrchestrator.attach + resume "
            "(Trainer's resume_checkpoint does not read sharded checkpoints yet).")
    if live and not saved:
        raise IncompatibleStateError(
            f"step {step} was saved without sharding (one full copy by rank 0) and this model is sharded "
            "(fully_shard): resume it with the unsharded model it was saved from.")


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if is_dtensor(t) else t).detach()  # type: ignore[attr-defined]


def chunk_of(t: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """`(local tensor, chunk)`: this rank's part of `t` and where it lies in the global tensor.

    A plain tensor is whole (offset 0); a `DTensor`'s chunk comes from its mesh and placements
    (`compute_local_shape_and_global_offset`, what DCP's own planner uses).
    """
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()  # type: ignore[attr-defined]
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
        if tuple(local.shape) != tuple(shape):
            raise SaveError(f"a DTensor's local shard has shape {tuple(local.shape)} but its placement says "
                            f"{tuple(shape)}: padded or uneven shards of this kind are not supported.")
        global_shape, offsets = list(t.shape), [int(o) for o in offset]
    else:
        local, global_shape, offsets = t, list(t.shape), [0] * t.dim()
    chunk = {"shape": global_shape, "offset": offsets, "size": [int(s) for s in local.shape],
             "dtype": str(local.dtype).removeprefix("torch.")}
    return local.detach(), chunk


class ShardedState:
    """The save-side view of an FSDP2 model and its optimizer on this rank.

    `weights` is the L0 source (local shards of the trainable parameters, under their FQNs; a
    model without frozen parameters adds its buffers), `optimizer` the L1 source (an object whose
    `state_dict()` holds the local shards of the optimizer state keyed by FQN, and `param_groups`
    with FQNs), `chunks()` this rank's chunk table for the manifest.

    Args:
        model (`nn.Module`): the `fully_shard`-ed model (parameters are DTensors).
        optimizer (`torch.optim.Optimizer`, *optional*): its optimizer (an Accelerate wrapper is unwrapped).
    """

    def __init__(self, model: nn.Module, optimizer: Any | None = None) -> None:
        self.model = model
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self._buffers: set[str] | None = None
        self._chunks: dict[str, tuple[int, tuple[int, ...], dict[str, Any]]] = {}

    def _weights(self) -> dict[str, torch.Tensor]:
        # A walk over named parameters per save (no CachedWeights: a DTensor has no data pointer to compare).
        params = dict(self.model.named_parameters())
        out: dict[str, torch.Tensor] = {name: p for name, p in params.items() if p.requires_grad}
        if len(out) == len(params):  # full fine-tuning: persistent buffers are state too
            if self._buffers is None:
                self._buffers = set(self.model.state_dict().keys()) - set(params)
            out.update((name, b) for name, b in self.model.named_buffers() if name in self._buffers)
        return out

    def _param_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.model.named_parameters()}

    # -- L0 ---------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's local shards of L0 (aliases of the live shards; the snapshot copies them)."""
        return {name: _local(t) for name, t in self._weights().items()}

    # -- L1 ---------------------------------------------------------------------------------
    def _optimizer_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        opt = self.optimizer
        if opt is None:
            return {}
        names = self._param_names()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p)
                if not state:
                    continue
                fqn = names.get(id(p))
                if fqn is None:
                    raise SaveError("an optimizer parameter is not a parameter of the model: a sharded save names "
                                    "optimizer state by the model's parameter names; optimize the model's parameters.")
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        raise SaveError(f"optimizer state {fqn}.{key} is a {type(value).__name__}, not a tensor: "
                                        "sharded saves store tensor optimizer state only (Adam, AdamW, SGD ...).")
                    out.setdefault(fqn, {})[key] = value
        return out

    def optimizer_state_dict(self) -> dict[str, Any]:
        """`{"state": {fqn: {name: local shard}}, "param_groups": [... "params": [fqn, ...]]}`."""
        opt = self.optimizer
        if opt is None:
            return {"state": {}, "param_groups": []}
        names = self._param_names()
        state = {fqn: {k: _local(v) for k, v in per.items()} for fqn, per in self._optimizer_tensors().items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in opt.param_groups]
        return {"state": state, "param_groups": groups}

    @property
    def optimizer_source(self) -> _OptimizerView | None:
        """What `StateSources.optimizer` gets: an object whose `state_dict()` is `optimizer_state_dict()`."""
        return _OptimizerView(self) if self.optimizer is not None else None

    def expected(self) -> dict[str, torch.Tensor]:
        """The L0 names with their global shapes (DTensors), for the model check of a resume."""
        return dict(self._weights())

    def _chunk(self, key: str, t: torch.Tensor) -> dict[str, Any]:
        # A chunk depends on the tensor's mesh and placements only: computed once per live tensor
        # (the same DTensor object with the same shape), not on every save.
        cached = self._chunks.get(key)
        if cached is not None and cached[0] == id(t) and cached[1] == tuple(t.shape):
            return cached[2]
        chunk = chunk_of(t)[1]
        self._chunks[key] = (id(t), tuple(t.shape), chunk)
        return chunk

    # -- chunks -----------------------------------------------------------------------------
    def chunks(self) -> dict[str, dict[str, dict[str, Any]]]:
        """This rank's chunk table: `{"weights": {key: chunk}, "optimizer": {key: chunk}}` (JSON)."""
        table: dict[str, dict[str, dict[str, Any]]] = {PART_WEIGHTS: {}, PART_OPTIMIZER: {}}
        for name, t in self._weights().items():
            table[PART_WEIGHTS][name] = self._chunk(name, t)
        for fqn, per in self._optimizer_tensors().items():
            for key, value in per.items():
                name = OPTIMIZER_KEY.format(fqn=fqn, name=key)
                table[PART_OPTIMIZER][name] = self._chunk(name, value)
        return table


class _OptimizerView:
    """`StateSources.optimizer` of a sharded run (the engine only calls `state_dict()`)."""

    def __init__(self, sharded: ShardedState) -> None:
        self._sharded = sharded
        self.param_groups = sharded.optimizer.param_groups if sharded.optimizer is not None else []

    def state_dict(self) -> dict[str, Any]:
        return self._sharded.optimizer_state_dict()


def sharded_sources(sharded: ShardedState | ZeroState, *, main: bool, scheduler: Any | None, scaler: Any | None,
                    sampler: Callable[[], dict[str, Any]] | None) -> StateSources:
    """`StateSources` of one rank of a sharded run: its shards of L0/L1 on every rank, the scheduler and
    scaler on rank 0 (each save's `extra` carries this rank's chunk table, `KEY_RANK_CHUNKS`)."""
    return StateSources(weights=sharded.weights, optimizer=sharded.optimizer_source,  # type: ignore[arg-type]
                        scheduler=scheduler if main else None, scaler=scaler if main else None, sampler=sampler)

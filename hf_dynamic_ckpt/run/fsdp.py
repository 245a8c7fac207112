"""The run's sharded seams (FSDP2, DeepSpeed ZeRO): what a rank saves (`sources_for`) and the sharded resume
(`load_sharded`: DCP for FSDP2, `state.zero` ranges for ZeRO).

`sources_for` gives every rank of a sharded (`fully_shard`) model its own shards of L0 and L1
(`state.shards.ShardedState`), and keeps rank 0 the only writer of L0/L1 otherwise (DDP).

`resume.plan_resume` verifies the checkpoint on every rank (each shard file's size and checksum,
the model check against the global shapes) and agrees on it; then every rank calls
`load_sharded` (a collective: DCP's load plans are exchanged) before `RunOrchestrator.apply`. The
state dicts come from DCP's
`get_state_dict` / `set_state_dict` (`StateDictOptions`), the chunks from `store.shard_files`'s
`StorageReader` over the JSON chunk table, and DCP's `DefaultLoadPlanner` maps the saved chunks
onto this run's shards: the same world size reads its own files back, another one reshards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..constants import ALL_TIERS, Tier
from ..errors import IncompatibleStateError
from ..state import CachedWeights, StateSources, trainable_state_dict
from ..state.shards import PART_OPTIMIZER, PART_WEIGHTS, ShardedState, is_sharded_model, sharded_sources
from ..state.zero import APPLIED_OPTIMIZER, MASTER, ZeroState, zero_optimizer
from ..store import LoadedCheckpoint
from ..store.shard_files import FlatReader, is_flat, make_reader, sharded_table

logger = logging.getLogger(__name__)

def sources_for(model: nn.Module, *, rank: int, weights: Callable[[], Mapping[str, torch.Tensor]] | None,
                frozen_keys: Iterable[str], optimizer: Any | None, scheduler: Any | None, scaler: Any | None,
                sampler: Callable[[], dict[str, Any]] | None
                ) -> tuple[ShardedState | ZeroState | None, StateSources, frozenset[Tier]]:
    """`(sharded view or None, this rank's StateSources, the tiers this rank writes)` for `RunOrchestrator.attach`."""
    main = rank == 0
    if zero_optimizer(optimizer) is not None:  # DeepSpeed ZeRO: every rank saves its fragments
        zero = ZeroState(model, optimizer, rank=rank)
        sources = sharded_sources(zero, main=main, scheduler=scheduler, scaler=scaler, sampler=sampler)
        return zero, sources, frozenset(ALL_TIERS)
    if is_sharded_model(model):
        sharded = ShardedState(model, optimizer)
        sources = sharded_sources(sharded, main=main, scheduler=scheduler, scaler=scaler, sampler=sampler)
        own = frozenset(ALL_TIERS) if main or optimizer is not None else frozenset({Tier.WEIGHTS, Tier.STATE})
        return sharded, sources, own
    if weights is None:
        weights = CachedWeights(model, partial(trainable_state_dict, model))
    sources = StateSources(
        weights=weights if main else None, frozen_keys=frozenset(frozen_keys),
        optimizer=optimizer if main else None, scheduler=scheduler if main else None,
        scaler=scaler if main else None, sampler=sampler,
    )
    if not main:
        return None, sources, frozenset({Tier.STATE})
    if optimizer is None and scheduler is None and scaler is None:  # a model trained without one (or not at all)
        return None, sources, frozenset(ALL_TIERS) - {Tier.OPTIMIZER}
    return None, sources, frozenset(ALL_TIERS)


MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."


def load_zero(zero: ZeroState, loaded: LoadedCheckpoint) -> None:
    """Read a ZeRO checkpoint's L0 (and L1, when `loaded.optimizer` holds its `param_groups`) into the live
    model and ZeRO optimizer: the ranges of every parameter this rank's fragments cover, from whichever ranks'
    files hold them (the same world size reads its own files). Then `loaded.weights` and `loaded.optimizer` are
    `None` (applied: an integration's usual `apply` restores the scheduler only, `state.zero.applied_optimizer`
    says so).

    Raises:
        `IncompatibleStateError`: the checkpoint was not saved under ZeRO, or lacks what this model needs.
    """
    table = sharded_table(loaded.manifest)
    step = loaded.info.step
    if table is None or not is_flat(table):
        raise IncompatibleStateError(
            f"step {step} was not saved under DeepSpeed ZeRO ({'FSDP2 shards' if table else 'one full copy'}) and "
            "this run trains under ZeRO: resume it in the set-up that saved it, or export it "
            "(`hf-dynamic-ckpt export`) and start a new run from the exported weights.")
    optimizer = loaded.optimizer if isinstance(loaded.optimizer, dict) and "param_groups" in loaded.optimizer \
        else None
    with FlatReader(Path(loaded.info.path), table) as reader:

        def read_into(part: str, key: str, start: int, stop: int, out: torch.Tensor) -> None:
            try:
                reader.read_into(part, key, start, stop, out)
            except KeyError:
                what = "weights" if part == PART_WEIGHTS else "optimizer state"
                raise IncompatibleStateError(f"step {step} holds no {what} {key!r}, which this model and optimizer "
                                             "have: it was saved from another model or optimizer.") from None

        moments = {key.rsplit(".", 1)[1] for key in reader.keys(PART_OPTIMIZER)} - {MASTER}
        zero.load(read_into, optimizer, step=step, moments=moments)
    loaded.weights = None
    loaded.optimizer = None
    loaded.extra[APPLIED_OPTIMIZER] = optimizer is not None
    logger.debug("step %d: ZeRO stage %d state read (saved by %s ranks)", step, zero.stage, table.get("world_size"))


def load_sharded(sharded: ShardedState | ZeroState, loaded: LoadedCheckpoint) -> None:
    """Read a sharded checkpoint's L0 (and L1, when `loaded.optimizer` holds its `param_groups`) into the
    live model and optimizer; then `loaded.weights` is `None` (applied) and `loaded.optimizer` is the
    live optimizer's restored `state_dict()`, so an integration's usual `apply` changes nothing.
    A ZeRO run reads through `load_zero`.

    Raises:
        `IncompatibleStateError`: the checkpoint is not sharded, or DCP cannot map it onto the model.
    """
    if isinstance(sharded, ZeroState):
        load_zero(sharded, loaded)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    table = sharded_table(loaded.manifest)
    if table is None:
        raise IncompatibleStateError(
            f"step {loaded.info.step} was saved without sharding (one full copy by rank 0) and this model is "
            "sharded (fully_shard): resume it with the model it was saved from, or save it again from a "
            "sharded run.")
    if is_flat(table):
        raise IncompatibleStateError(
            f"step {loaded.info.step} was saved under DeepSpeed ZeRO (runs of flattened parameters) and this model is "
            "sharded by FSDP2: resume it under DeepSpeed, or export it (`hf-dynamic-ckpt export`) and start a new "
            "run from the exported weights.")
    model, opt = sharded.model, sharded.optimizer
    saved_weights = {k for r in table["ranks"].values() for k in (r.get(PART_WEIGHTS) or {})}
    groups = (loaded.optimizer or {}).get("param_groups") if isinstance(loaded.optimizer, dict) else None
    with_optimizer = opt is not None and groups is not None
    options = StateDictOptions(strict=False)
    if opt is not None and with_optimizer:
        msd, osd = get_state_dict(model, opt, options=options)
    else:
        msd, osd = get_model_state_dict(model, options=options), {}
    state: dict[str, Any] = {"model": {k: v for k, v in msd.items() if k in saved_weights}}
    missing = sorted(saved_weights - set(state["model"]))
    if missing:
        raise IncompatibleStateError(f"step {loaded.info.step} holds weights the model lacks: {missing[:10]}.")
    prefixes = {PART_WEIGHTS: MODEL_PREFIX}
    if with_optimizer:
        state["optim"] = {"state": osd["state"]}
        prefixes[PART_OPTIMIZER] = OPTIM_PREFIX
    reader = make_reader(Path(loaded.info.path), table, prefixes)
    try:
        dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner())
    except Exception as e:  # DCP wraps rank errors in CheckpointException
        raise IncompatibleStateError(f"step {loaded.info.step}: the saved shards do not fit this model and "
                                     f"optimizer ({type(e).__name__}: {str(e)[:500]}).") from e
    if opt is not None and groups is not None:
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"]["state"], "param_groups": groups}, options=options)
        loaded.optimizer = opt.state_dict()
    else:
        set_model_state_dict(model, state["model"], options=options)
    loaded.weights = None
    logger.debug("step %d: sharded state read through DCP (saved by %s ranks)", loaded.info.step,
                 table.get("world_size"))

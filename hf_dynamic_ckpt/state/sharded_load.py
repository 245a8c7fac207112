"""Resume of a sharded (FSDP2) checkpoint: DCP reads the shards into the live DTensors, at any world size.

`restore.plan_resume` verifies the checkpoint on every rank (each shard file's size and checksum,
the model check against the global shapes) and agrees on it; then every rank calls
`load_sharded` (a collective: DCP's load plans are exchanged). The state dicts come from DCP's
`get_state_dict` / `set_state_dict` (`StateDictOptions`), the chunks from `store.sharded`'s
`StorageReader` over the JSON chunk table, and DCP's `DefaultLoadPlanner` maps the saved chunks
onto this run's shards: the same world size reads its own files back, another one reshards.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import IncompatibleStateError
from ..store.sharded import make_reader, sharded_table
from ..store.types import LoadedCheckpoint
from .sharded import PART_OPTIMIZER, PART_WEIGHTS, ShardedState

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."


def load_sharded(sharded: ShardedState, loaded: LoadedCheckpoint) -> None:
    """Read a sharded checkpoint's L0 (and L1, when `loaded.optimizer` holds its `param_groups`) into the
    live model and optimizer; then `loaded.weights` is `None` (applied) and `loaded.optimizer` is the
    live optimizer's restored `state_dict()`, so an integration's usual `apply` changes nothing.

    Raises:
        `IncompatibleStateError`: the checkpoint is not sharded, or DCP cannot map it onto the model.
    """
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

"""Optimizer, LR-scheduler and AMP-scaler state (L1) put back into live objects."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ..store import LoadedCheckpoint
from .sharded import sharded_optimizer

logger = logging.getLogger(__name__)


def state_numel_bound(params: Iterable[torch.Tensor | None]) -> int | None:
    """The most elements one optimizer-state tensor of these parameters can hold, or `None` if none is known.

    A parameter's own count covers element-wise state (Adam's moments, 8-bit states) and factored state
    (Adafactor's row and column statistics); the square of its largest dimension covers a full-matrix
    preconditioner (Shampoo). An L1 file declaring more cannot belong to this model, and is refused before
    its tensors are allocated (`CheckpointStore.load(l1_max_numel=...)`).
    """
    bound = 0
    for p in params:
        if p is None:
            continue
        shape = tuple(p.shape)
        bound = max(bound, math.prod(shape), max(shape, default=1) ** 2)
    return bound or None


def apply_optimizer_state(loaded: LoadedCheckpoint, *, optimizer: Any | None, scheduler: Any | None,
                          scaler: Any | None = None) -> None:
    """Load L1 straight into the live optimizer / scheduler / scaler (no intermediate files).

    When L1 was lost (`loaded.optimizer is None`), the optimizer stays fresh and the
    scheduler is moved to the checkpoint's step so the learning-rate schedule continues
    where it was; a warning says so. A sharded optimizer's L1 (FSDP2, DeepSpeed ZeRO) is read into its
    shards by the sharded load (`state.sharded.sharded_optimizer`), not here.
    """
    step = loaded.info.step
    if loaded.optimizer is not None and optimizer is not None:
        if not sharded_optimizer(optimizer):
            optimizer.load_state_dict(loaded.optimizer)
    elif optimizer is not None:
        msg = (f"resume from step {step}: optimizer state (L1) not restored; training continues from the saved "
               "weights with a fresh optimizer (moments reset)")
        if not any("optimizer state" in w for w in loaded.warnings):  # restore already said it otherwise
            logger.warning(msg)
        warnings.warn(msg, stacklevel=2)
    if scheduler is not None:
        if loaded.scheduler is not None:
            scheduler.load_state_dict(loaded.scheduler)
            if loaded.optimizer is None and optimizer is not None:
                # A fresh optimizer still holds the schedule's initial rates: set the saved step's.
                for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                    group["lr"] = lr
        else:
            fast_forward_scheduler(scheduler, step)
            logger.warning("resume from step %d: LR scheduler state not saved; schedule moved to step %d", step, step)
    if scaler is not None and loaded.scaler is not None:
        scaler.load_state_dict(loaded.scaler)


def fast_forward_scheduler(scheduler: Any, step: int) -> None:
    """Put a fresh LR scheduler at `step` (its optimizer's learning rates follow)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            # Closed form: every transformers schedule is a LambdaLR, O(1) for any step.
            scheduler.last_epoch = step - 1
            scheduler._step_count = step
            scheduler.step()
            return
        for _ in range(step):
            scheduler.step()

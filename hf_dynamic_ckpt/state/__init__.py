"""What a training framework's objects are turned into for a checkpoint, and back.

`model`: L0 names (adapter-only for PEFT), frozen keys, `apply_weights` / `check_weights`.
`optimizer`: L1 put back into live optimizer / scheduler / scaler.
`rng`: exact per-rank RNG state as JSON (L2). `sources`: `StateSources`, `CachedWeights`.
"""

from __future__ import annotations

from .model import (
    adapter_names,
    apply_weights,
    check_weights,
    expected_weights,
    frozen_weight_keys,
    is_peft_model,
    own_weights,
    split_adapters,
    trainable_state_dict,
)
from .optimizer import apply_optimizer_state, fast_forward_scheduler
from .rng import RawRngState, RngState, capture_raw_rng_state, capture_rng_state, restore_rng_state
from .sources import CachedWeights, StateSources

__all__ = [
    "CachedWeights",
    "RawRngState",
    "RngState",
    "StateSources",
    "adapter_names",
    "apply_optimizer_state",
    "apply_weights",
    "capture_raw_rng_state",
    "capture_rng_state",
    "check_weights",
    "expected_weights",
    "fast_forward_scheduler",
    "frozen_weight_keys",
    "is_peft_model",
    "own_weights",
    "restore_rng_state",
    "split_adapters",
    "trainable_state_dict",
]

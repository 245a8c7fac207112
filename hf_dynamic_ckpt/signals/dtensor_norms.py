"""Gradient norms of sharded (DTensor) parameters without gathering a full tensor.

Under FSDP2 (`torch.distributed.fsdp.fully_shard`) every parameter and gradient is a
`DTensor` whose local shard lives on this rank. A norm is computed from the local shards:
each rank sums the squares of its shards (`local_part` says how much each counts), the ranks'
sums are added (`distributed.all_reduce_square_sums`, one collective) and the square root
gives the norm of the full tensor. Shards replicated over a mesh dimension (HSDP) are divided
by their number of replicas, so each element counts once.
"""

from __future__ import annotations

import torch


def dtensor_type() -> type | None:
    """`torch.distributed.tensor.DTensor`, or `None` where this torch build has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def is_dtensor(t: object) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`(local shard, weight)`: the tensor this rank holds and how often its squares count.

    A plain tensor is its own local part with weight 1 (it is added once, not all-reduced);
    a `DTensor`'s local shard counts `1 / replicas` (1 for FSDP's `Shard(0)`).
    """
    if not is_dtensor(t):
        return t, 1.0
    from torch.distributed.tensor import Replicate

    replicas = 1
    for size, placement in zip(t.device_mesh.shape, t.placements):  # type: ignore[attr-defined]
        if isinstance(placement, Replicate):
            replicas *= int(size)
    return t.to_local(), 1.0 / replicas  # type: ignore[attr-defined]


def full_scalar(value: object) -> float:
    """A norm as a Python float: a `DTensor` (e.g. `clip_grad_norm_`'s result under FSDP2) is made
    whole first (a scalar: `full_tensor()` moves one number)."""
    if is_dtensor(value):
        value = value.full_tensor()  # type: ignore[attr-defined]
    return float(value)  # type: ignore[arg-type]

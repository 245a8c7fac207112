"""Rank helpers and the one collective that makes every rank take the same decision.

Everything here is a no-op (or the identity) without an initialised process group, so
single-process code calls the same functions. Objects are exchanged as JSON bytes, never
pickled (`broadcast_object_list` unpickles what it receives).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import torch

from .errors import DistributedError
from .signals import SignalFrame

# Layout of the packed frame: (field, reduction). Missing values are packed as -inf so
# MAX ignores them; the loss is packed twice (value, present) so SUM knows how many ranks had one.
_MAX_FIELDS = ("grad_norm", "lora_max_ratio", "device_mem_frac", "host_mem_frac", "step_time_s", "lr",
               "save_blocking_s", "clip_norm", "slot_every", "slot_blocked")


def _dist() -> Any:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    d = _dist()
    return d.get_rank() if d else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    d = _dist()
    return d.get_world_size() if d else 1


def is_main() -> bool:
    """Whether this is rank 0."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op alone)."""
    d = _dist()
    if d:
        d.barrier()


def _device() -> torch.device:
    d = _dist()
    if d and d.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_fn(d: Any) -> Any:
    """`all_gather_single` where torch has it (`all_gather_into_tensor` is deprecated there)."""
    return getattr(d, "all_gather_single", None) or d.all_gather_into_tensor


def _encode(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, allow_nan=True).encode()
    except (TypeError, ValueError) as e:
        raise DistributedError(
            f"{what}: {type(obj).__name__} is not JSON-serialisable ({e}); pass plain dicts/lists/numbers."
        ) from e


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a JSON-able object from rank `src` to every rank; returns it on every rank.

    Two tiny collectives (length, then bytes). Without a process group returns `obj`.

    Raises:
        DistributedError: `obj` on `src` is not JSON-serialisable.
    """
    d = _dist()
    if not d:
        return obj
    dev = _device()
    payload = _encode(obj, "broadcast_object") if d.get_rank() == src else b""
    length = torch.tensor([len(payload)], dtype=torch.long, device=dev)
    d.broadcast(length, src=src)
    buf = torch.zeros(int(length.item()), dtype=torch.uint8, device=dev)
    if d.get_rank() == src:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    d.broadcast(buf, src=src)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on every rank; `[obj]` without a process group.

    JSON bytes in uint8 tensors (never pickle, which `all_gather_object` would use): one gather of
    the lengths, one of the padded payloads.

    Raises:
        DistributedError: `obj` is not JSON-serialisable.
    """
    d = _dist()
    if not d or d.get_world_size() == 1:
        return [obj]
    dev = _device()
    world = d.get_world_size()
    payload = _encode(obj, "all_gather_json")
    sizes = torch.empty(world, dtype=torch.int64, device=dev)
    _gather_fn(d)(sizes, torch.tensor([len(payload)], dtype=torch.int64, device=dev))
    longest = int(sizes.max().item())
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    if payload:
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    chunks = torch.empty(world * longest, dtype=torch.uint8, device=dev)
    _gather_fn(d)(chunks, padded)
    rows = chunks.view(world, longest).cpu()
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist()).decode()) for r in range(world)]


def all_reduce_sum(value: float) -> float:
    """Sum of `value` over ranks (float64); `value` itself without a process group."""
    d = _dist()
    if not d or d.get_world_size() == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device())
    d.all_reduce(t, op=d.ReduceOp.SUM)
    return float(t.item())


def all_reduce_square_sums(values: Sequence[float]) -> list[float]:
    """Per bucket, the sum over ranks of this rank's squared gradient-shard norms (`signals.GradProbe`),
    in one float64 `all_reduce`; `values` as they are without a process group. NaN and inf propagate."""
    d = _dist()
    if not d or d.get_world_size() == 1 or not values:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=_device())
    d.all_reduce(t)
    return t.cpu().tolist()


def pack_frame(frame: SignalFrame, layer_names: Sequence[str] = (), fingerprint: float = 0.0) -> torch.Tensor:
    """The frame's reducible fields as one float64 vector (see `reduce_frame`)."""
    loss = frame.loss
    layer = layer_names.index(frame.lora_max_layer) if frame.lora_max_layer in layer_names else -1
    values = [
        loss if loss is not None else 0.0,
        1.0 if loss is not None else 0.0,
        1.0 if frame.any_nonfinite else 0.0,
        1.0 if frame.preempt else 0.0,
    ]
    for name in _MAX_FIELDS:
        v = getattr(frame, name)
        values.append(-math.inf if v is None else float(v))
    # The winning layer rides along as (ratio, index) pairs: index decides ties the same way everywhere.
    values.append(float(layer))
    values.append(float(fingerprint))
    return torch.tensor(values, dtype=torch.float64)


def combine_frames(step: int, rows: torch.Tensor, layer_names: Sequence[str] = ()) -> SignalFrame:
    """Reduce gathered packed frames (one row per rank) into one frame, deterministically."""
    loss_present = rows[:, 1] > 0
    loss = float(rows[loss_present, 0].sum()) if bool(loss_present.any()) else None
    nonfinite = bool(rows[:, 2].max() > 0)
    preempt = bool(rows[:, 3].max() > 0)
    maxes = rows[:, 4 : 4 + len(_MAX_FIELDS)].max(dim=0).values.tolist()
    fields = {name: (None if v == -math.inf else v) for name, v in zip(_MAX_FIELDS, maxes)}
    layer = None
    ratios = rows[:, 4 + _MAX_FIELDS.index("lora_max_ratio")]
    if fields["lora_max_ratio"] is not None and not math.isnan(fields["lora_max_ratio"]):
        winner = int(torch.argmax(ratios))  # first rank with the max: same answer on every rank
        idx = int(rows[winner, -2])
        layer = layer_names[idx] if 0 <= idx < len(layer_names) else None
    if loss is not None and not math.isfinite(loss):
        nonfinite = True
    return SignalFrame(step=step, loss=loss, nonfinite=nonfinite, preempt=preempt, lora_max_layer=layer, **fields)


def check_fingerprints(rows: torch.Tensor, step: int) -> None:
    """Raise the same `DistributedError` on every rank when the ranks' decision fingerprints differ."""
    prints = rows[:, -1]
    if bool((prints != prints[0]).any()):
        seen = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(prints.tolist()))
        raise DistributedError(
            f"step {step}: the ranks have taken different save decisions so far ({seen}); a save one rank "
            "takes alone would leave rank 0 waiting for files that never come. This is a bug: report it with "
            "the ranks' logs. Resume from the last committed checkpoint."
        )


def reduce_frame(frame: SignalFrame, *, layer_names: Sequence[str] = (), fingerprint: float = 0.0) -> SignalFrame:
    """Reduce a frame across ranks in ONE collective so every rank decides the same.

    The frame is packed into a small float64 vector, all-gathered (one `all_gather_into_tensor`),
    and reduced locally by the same code on every rank: SUM for the loss, MAX for the
    gradient norms, the LoRA ratio, memory, step time and learning rate, OR for the
    non-finite and preemption flags. The LoRA layer name travels as an index into
    `layer_names` (identical on every rank: `GradProbe.layer_names`).

    Args:
        frame (`SignalFrame`): this rank's local signals.
        layer_names (`Sequence[str]`, *optional*): names the LoRA layer index refers to.
        fingerprint (`float`, *optional*): a number summarising this rank's save decisions so far
            (e.g. how many it took); every rank must send the same one.

    Returns:
        `SignalFrame`: the reduced frame (identical on every rank); `frame` itself without a
        process group. Local frames must agree on `step`.

    Raises:
        `DistributedError`: the ranks' fingerprints differ (raised identically on every rank).
    """
    d = _dist()
    if not d or d.get_world_size() == 1:
        return frame
    dev = _device()
    local = pack_frame(frame, layer_names, fingerprint).to(dev)
    gathered = torch.empty(d.get_world_size() * local.numel(), dtype=local.dtype, device=dev)
    try:
        _gather_fn(d)(gathered, local)
    except RuntimeError as e:  # gloo/NCCL: a peer died (SIGKILL, OOM) or the group is broken
        raise DistributedError(
            f"step {frame.step}: the per-step signal exchange with the other ranks failed ({e}); another rank "
            "has most likely died. Nothing after the last committed checkpoint is saved; restart the job to "
            "resume from it."
        ) from e
    rows = gathered.view(d.get_world_size(), -1).cpu()
    check_fingerprints(rows, frame.step)
    return combine_frames(frame.step, rows, layer_names)

"""Rank helpers and the one collective that makes every rank take the same decision; no-ops without a process group.
Objects travel as JSON bytes, never pickled (`broadcast_object_list` unpickles what it gets)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import torch

from .errors import DistributedError
from .signals import SignalFrame

# The packed frame (`pack_frame`): loss, loss present (SUM counts the ranks that had one), non-finite, preempt (OR),
# these fields (MAX; a missing one is -inf), the LoRA layer's index, the decision fingerprint.
_MAX_FIELDS = ("grad_norm", "lora_max_ratio", "device_mem_frac", "host_mem_frac", "step_time_s", "lr",
               "save_blocking_s", "clip_norm", "slot_every", "slot_blocked")


def _dist() -> Any:
    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return d.get_rank() if (d := _dist()) else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return d.get_world_size() if (d := _dist()) else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if d := _dist():
        d.barrier()


def _device() -> torch.device:
    d = _dist()
    return torch.device("cuda", torch.cuda.current_device()) if d and d.get_backend() == "nccl" else torch.device("cpu")


def _gather(out: torch.Tensor, local: torch.Tensor) -> None:
    d = torch.distributed  # `all_gather_single` where torch has it (`all_gather_into_tensor` is deprecated there)
    (getattr(d, "all_gather_single", None) or d.all_gather_into_tensor)(out, local)


def _gather_json(obj: Any, what: str) -> list[Any]:
    """Every rank's `obj`: one gather of the JSON lengths, one of the padded payloads."""
    try:
        payload = json.dumps(obj, allow_nan=True).encode()
    except (TypeError, ValueError) as e:
        raise DistributedError(
            f"{what}: {type(obj).__name__} is not JSON-serialisable ({e}); pass plain dicts/lists/numbers.") from e
    dev, world = _device(), world_size()
    sizes = torch.empty(world, dtype=torch.int64, device=dev)
    _gather(sizes, torch.tensor([len(payload)], dtype=torch.int64, device=dev))
    longest = int(sizes.max().item())
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    chunks = torch.empty(world * longest, dtype=torch.uint8, device=dev)
    _gather(chunks, padded)
    rows = chunks.view(world, longest).cpu()
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist()).decode()) for r in range(world)]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s JSON-able `obj` on every rank (`obj` itself without a process group); `DistributedError` when it
    is not JSON-serialisable."""
    return _gather_json(obj if rank() == src else None, "broadcast_object")[src] if _dist() else obj


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on every rank (`[obj]` alone); `DistributedError` when it is not
    JSON-serialisable."""
    return _gather_json(obj, "all_gather_json") if world_size() > 1 else [obj]


def all_reduce_square_sums(values: Sequence[float]) -> list[float]:
    """Per bucket, the sum over ranks of this rank's squared gradient-shard norms (`signals.GradProbe`), in one float64
    `all_reduce`; `values` as they are without a process group. NaN and inf propagate."""
    if world_size() == 1 or not values:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(t)
    return t.cpu().tolist()


def all_reduce_sum(value: float) -> float:
    """Sum of `value` over ranks (float64)."""
    return float(all_reduce_square_sums([float(value)])[0])


def pack_frame(frame: SignalFrame, layer_names: Sequence[str] = (), fingerprint: float = 0.0) -> torch.Tensor:
    """The frame's reducible fields as one float64 vector (see `reduce_frame`)."""
    layer = layer_names.index(frame.lora_max_layer) if frame.lora_max_layer in layer_names else -1
    values = [frame.loss if frame.loss is not None else 0.0, float(frame.loss is not None),
              float(frame.any_nonfinite), float(frame.preempt)]
    values += [-math.inf if (v := getattr(frame, name)) is None else float(v) for name in _MAX_FIELDS]
    return torch.tensor([*values, float(layer), float(fingerprint)], dtype=torch.float64)


def combine_frames(step: int, rows: torch.Tensor, layer_names: Sequence[str] = ()) -> SignalFrame:
    """Reduce gathered packed frames (one row per rank) into one frame, deterministically."""
    present = rows[:, 1] > 0
    loss = float(rows[present, 0].sum()) if bool(present.any()) else None
    maxes = rows[:, 4 : 4 + len(_MAX_FIELDS)].max(dim=0).values.tolist()
    fields = {name: (None if v == -math.inf else v) for name, v in zip(_MAX_FIELDS, maxes)}
    layer = None
    if fields["lora_max_ratio"] is not None and not math.isnan(fields["lora_max_ratio"]):
        # The layer of the first rank with the max ratio: the same answer on every rank.
        idx = int(rows[int(torch.argmax(rows[:, 4 + _MAX_FIELDS.index("lora_max_ratio")])), -2])
        layer = layer_names[idx] if 0 <= idx < len(layer_names) else None
    nonfinite = bool(rows[:, 2].max() > 0) or (loss is not None and not math.isfinite(loss))
    return SignalFrame(step=step, loss=loss, nonfinite=nonfinite, preempt=bool(rows[:, 3].max() > 0),
                       lora_max_layer=layer, **fields)


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
    """Reduce a frame across ranks in ONE all-gather, reduced alike on every rank (SUM loss, MAX the rest, OR the
    flags); differing `fingerprint`s (this rank's save decisions so far) raise one `DistributedError` everywhere."""
    if (world := world_size()) == 1:
        return frame
    local = pack_frame(frame, layer_names, fingerprint).to(_device())
    gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    try:
        _gather(gathered, local)
    except RuntimeError as e:  # gloo/NCCL: a peer died (SIGKILL, OOM) or the group is broken
        raise DistributedError(
            f"step {frame.step}: the per-step signal exchange with the other ranks failed ({e}); another rank "
            "has most likely died. Nothing after the last committed checkpoint is saved; restart the job to "
            "resume from it."
        ) from e
    rows = gathered.view(world, -1).cpu()
    check_fingerprints(rows, frame.step)
    return combine_frames(frame.step, rows, layer_names)

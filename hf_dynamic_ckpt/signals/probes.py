"""Probes that measure one training step cheaply: loss and gradient norms.

Memory has its own module (`memory.py`); the preemption flag (a POSIX signal handler) is `run.sensing.PreemptionFlag`.

Each probe does one job and never synchronises the device more than once per step:
the loss stays a tensor until the decision needs it, gradient norms come from one
fused `torch._foreach_norm` call per (device, dtype) group and one `.tolist()`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .dtensor_norms import full_scalar, is_dtensor, local_part
from .stats import LayerBaselines

__all__ = ["ClipNormRecorder", "GradProbe", "LossProbe", "find_lora_layers"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- loss
def _extract_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


class LossProbe:
    """Sums `outputs.loss` of the step's micro-batches through a forward hook.

    The hook fires only while the module is in training mode, so evaluation forwards do
    not leak into the step loss. The sum stays a (detached) tensor on the model's device:
    no `.item()` per micro-batch, one sync when `pop()`'s caller converts it.

    Args:
        model (`torch.nn.Module`, *optional*): module whose forward returns an output with
            a `loss` (a `ModelOutput` or a dict). `None` creates a probe fed through `add`.

    Example:
        ```python
        >>> probe = LossProbe(model)
        >>> model(**batch).loss.backward()       # one micro-batch
        >>> float(probe.pop())                    # the step's summed loss
        ```
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._sum: torch.Tensor | None = None
        self.micro_batches = 0
        self._handle = model.register_forward_hook(self._hook) if model is not None else None

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training:
            loss = _extract_loss(output)
            if loss is not None:
                self.add(loss)

    def add(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss (for loops that compute the loss outside the model)."""
        loss = loss.detach()
        if loss.numel() != 1:  # DataParallel returns one loss per replica; Trainer averages them
            loss = loss.float().mean()
        loss = loss.reshape(())
        self._sum = loss if self._sum is None else self._sum + loss
        self.micro_batches += 1

    def pop(self) -> torch.Tensor | None:
        """The summed loss since the last `pop()` (a 0-d tensor), or `None`; resets the sum."""
        total, self._sum, self.micro_batches = self._sum, None, 0
        return total

    def remove(self) -> None:
        """Detach the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


# --------------------------------------------------------------------------- gradients
def find_lora_layers(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable LoRA parameters per LoRA layer, found by type (`peft.tuners.lora.LoraLayer`).

    Returns an empty dict when peft is not installed or the model has no LoRA layer.
    """
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional
        return {}
    layers: dict[str, list[nn.Parameter]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        params: list[nn.Parameter] = []
        for attr in LoraLayer.adapter_layer_names:
            sub = getattr(module, attr, None)
            if isinstance(sub, nn.Module):
                params.extend(p for p in sub.parameters() if p.requires_grad)
        if params:
            layers[name] = params
    return layers


class GradProbe:
    """Global and per-LoRA-layer gradient norms, with each layer's own running baseline.

    Call `measure()` once per optimizer step when the gradients are complete. The global
    norm must be the *pre-clip* norm: either call `measure()` before clipping, or pass the
    norm the clipping returned (`pre_clip_norm`, see `ClipNormRecorder`). Clipping scales
    every gradient by the same factor, so the per-layer norms measured after clipping are
    rescaled exactly by `pre_clip_norm / post_clip_norm`. With `pre_clip_norm` given and
    no LoRA layer, nothing is computed at all.

    Each layer's norm is judged by `LayerBaselines` against the layer's own recent history
    (median of its log norms, discounted by its own spread, after a warm-up of `warmup`
    non-zero norms): `lora_max_ratio` is how far the most unusual layer lies above the
    highest baseline it normally reaches.

    Args:
        model (`torch.nn.Module`): the model (a PEFT model for per-layer norms).
        window (`int`, *optional*, defaults to `50`): norms per layer in its robust baseline.
        warmup (`int`, *optional*, defaults to `30`): non-zero norms a layer needs before it counts.
        spread_k (`float`, *optional*, defaults to `4.0`): robust standard deviations of a
            layer's log-norm that are its normal range (see `LayerBaselines`).
        sum_across_ranks (`Callable[[list[float]], list[float]]`, *optional*): adds the ranks' squared norms of
            sharded (FSDP2) gradients; the run passes `distributed.all_reduce_square_sums` (a collective). Without
            it, a sharded gradient counts only this rank's shard.

    Example:
        ```python
        >>> probe = GradProbe(peft_model)
        >>> loss.backward()
        >>> fields = probe.frame_fields()   # grad_norm, lora_max_ratio, lora_max_layer, nonfinite
        ```
    """

    def __init__(self, model: nn.Module, *, window: int = 50, warmup: int = 30, spread_k: float = 4.0,
                 sum_across_ranks: Callable[[list[float]], list[float]] | None = None) -> None:
        self.sum_across_ranks = sum_across_ranks
        self.layers = find_lora_layers(model)
        self.layer_names: list[str] = list(self.layers)
        lora_ids = {id(p): i for i, ps in enumerate(self.layers.values()) for p in ps}
        self._params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        # Parameters of LoRA layers that are frozen (other adapters) still count in the layer set.
        seen = {id(p) for p in self._params}
        self._params += [p for ps in self.layers.values() for p in ps if id(p) not in seen]
        n_layers = len(self.layer_names)
        self._bucket = [lora_ids.get(id(p), n_layers) for p in self._params]
        self._bucket_by_name = {name: lora_ids.get(id(p), n_layers) for name, p in model.named_parameters()}
        self.baselines = LayerBaselines(window=window, warmup=warmup, spread_k=spread_k)
        self.partition_squares: Callable[[], list[float] | None] | None = None
        """Set where the gradients never reach `.grad` (DeepSpeed ZeRO, `state.zero.ZeroGradSquares.pop`): this
        rank's squared norms per bucket (the LoRA layers, then the rest), added across ranks here."""

    def bucket(self, name: str) -> int:
        """The bucket of parameter `name`: its LoRA layer's index, or `len(layer_names)` for the rest."""
        return self._bucket_by_name.get(name, len(self.layer_names))

    def measure(self, pre_clip_norm: float | torch.Tensor | None = None) -> tuple[float | None, dict[str, float]]:
        """Return `(global_norm, {layer: norm})` for the gradients now in `.grad`.

        Args:
            pre_clip_norm (`float` or `torch.Tensor`, *optional*): the norm returned by the
                clipping call of this step; per-layer norms are rescaled to pre-clip values.

        Returns:
            `tuple`: the pre-clip global L2 norm (`None` when no gradient exists; NaN/inf when
            a gradient is not finite) and each LoRA layer's pre-clip L2 norm.
        """
        pre = full_scalar(pre_clip_norm) if pre_clip_norm is not None else None
        if pre is not None and not self.layer_names:
            return pre, {}
        present = [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]
        if not present and self.partition_squares is not None:
            return self._from_partitions(pre)
        if not present:
            return pre, {}
        # FSDP2: DTensor gradients are measured on their local shards; the squares are summed over ranks.
        weights = [1.0] * len(present)
        sharded = [False] * len(present)
        for j, (i, g) in enumerate(present):
            if is_dtensor(g):
                local, weights[j] = local_part(g)
                present[j], sharded[j] = (i, local), True
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, int, torch.Tensor]]] = {}
        for j, (i, g) in enumerate(present):
            groups.setdefault((g.device, g.dtype), []).append((j, i, g))
        target = present[0][1].device
        stacked: list[torch.Tensor] = []
        order: list[int] = []
        for items in groups.values():
            norms = torch.stack(torch._foreach_norm([g for _, _, g in items], 2.0))
            stacked.append(norms.to(device=target, dtype=torch.float64))
            order.extend(j for j, _, _ in items)
        values = (stacked[0] if len(stacked) == 1 else torch.cat(stacked)).tolist()  # the one device sync
        # Summing a few hundred floats in Python is cheaper than more kernel launches.
        n_layers = len(self.layer_names)
        sq = [0.0] * (n_layers + 1)
        sq_sharded = [0.0] * (n_layers + 1)
        for j, v in zip(order, values):
            bucket = self._bucket[present[j][0]]
            if sharded[j]:
                sq_sharded[bucket] += v * v * weights[j]
            else:
                sq[bucket] += v * v
        if any(sharded):  # NaN and inf propagate: a non-finite shard on any rank makes the norm non-finite
            total = self.sum_across_ranks(sq_sharded) if self.sum_across_ranks is not None else sq_sharded
            sq = [a + b for a, b in zip(sq, total)]
        post = math.sqrt(sum(sq))  # NaN and inf propagate: the non-finite flag relies on it
        layer_norms = [math.sqrt(x) for x in sq[:n_layers]]
        if pre is not None and math.isfinite(post) and post > 0.0:
            scale = pre / post
            layer_norms = [v * scale for v in layer_norms]
        return (pre if pre is not None else post), dict(zip(self.layer_names, layer_norms))

    def _from_partitions(self, pre: float | None) -> tuple[float | None, dict[str, float]]:
        """`measure` from `partition_squares` (every rank calls it: the sum across ranks is a collective)."""
        assert self.partition_squares is not None
        n_layers = len(self.layer_names)
        local = self.partition_squares()
        sq = local if local is not None and len(local) == n_layers + 1 else [0.0] * (n_layers + 1)
        if self.sum_across_ranks is not None:
            sq = self.sum_across_ranks(sq)
        post = math.sqrt(sum(sq))
        if not post > 0.0 and math.isfinite(post):
            return pre, {}  # no gradient reached the optimizer this step
        layer_norms = [math.sqrt(x) for x in sq[:n_layers]]
        if pre is not None and math.isfinite(post):
            layer_norms = [v * pre / post for v in layer_norms]
        return (pre if pre is not None else post), dict(zip(self.layer_names, layer_norms))

    def observe(self, layer_norms: Mapping[str, float]) -> tuple[float | None, str | None]:
        """Judge each layer's norm against its own baseline (`LayerBaselines.observe`), then fold it in.

        Returns:
            `tuple`: `(max_ratio, layer)`; `(None, None)` while no layer is warmed up. A
            non-finite layer norm gives `(inf, layer)` and leaves the baselines untouched.
        """
        return self.baselines.observe(layer_norms)

    def frame_fields(self, pre_clip_norm: float | torch.Tensor | None = None) -> dict[str, Any]:
        """`measure()` + `observe()` as `SignalFrame` keyword arguments."""
        global_norm, layer_norms = self.measure(pre_clip_norm)
        ratio, layer = self.observe(layer_norms)
        nonfinite = (global_norm is not None and not math.isfinite(global_norm)) or (
            ratio is not None and not math.isfinite(ratio)
        )
        return {"grad_norm": global_norm, "lora_max_ratio": ratio, "lora_max_layer": layer, "nonfinite": nonfinite}

    def state_dict(self) -> dict[str, Any]:
        """The per-layer baselines (JSON-able), so a resumed run measures the same ratios."""
        # "levels": the key in every probe state saved so far (manifests' `extra["grad_probe"]`), kept so they resume.
        return {"levels": self.baselines.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        baselines = state.get("levels", {})
        if "logs" in baselines:  # older states (EMA baselines) carry no history: the warm-up restarts
            self.baselines.load_state_dict(baselines)


def _removed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("ClipNormRecorder.remove() was called: the wrapped method is the owner's own again.")


class ClipNormRecorder:
    """Wraps a `clip_grad_norm_` method and keeps the pre-clip norm it returns.

    `accelerator.clip_grad_norm_(params, max_norm)` (what `Trainer` calls) returns the
    total norm *before* clipping; recording it gives the pre-clip norm without any extra
    work and without the user writing code. The `max_norm` of the last call is kept too
    (`max_norm`, for `SignalFrame.clip_norm`: the policy judges the first step against it).

    Args:
        owner (`Any`): the object whose method is wrapped (e.g. an `accelerate.Accelerator`).
        attr (`str`, *optional*, defaults to `"clip_grad_norm_"`): the method name.

    Example:
        ```python
        >>> rec = ClipNormRecorder(trainer.accelerator)
        >>> ...                          # training step clips as usual
        >>> probe.frame_fields(pre_clip_norm=rec.pop())
        >>> rec.remove()
        ```
    """

    def __init__(self, owner: Any, attr: str = "clip_grad_norm_") -> None:
        self.owner, self.attr = owner, attr
        self._had_instance_attr = attr in getattr(owner, "__dict__", {})
        self._original: Callable[..., Any] = getattr(owner, attr)
        self.last: Any = None
        self.max_norm: float | None = None  # the clip norm of the last call (`SignalFrame.clip_norm`)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            norm = self._original(*args, **kwargs)
            self.last = norm
            max_norm = kwargs.get("max_norm", args[1] if len(args) > 1 else None)
            try:
                self.max_norm = float(max_norm) if max_norm is not None else None
            except (TypeError, ValueError):
                self.max_norm = None
            return norm

        self._wrapper = wrapper
        setattr(owner, attr, wrapper)

    def pop(self) -> Any:
        """The norm recorded since the last `pop()` (tensor or float), or `None`."""
        norm, self.last = self.last, None
        return norm

    def remove(self) -> None:
        """Restore the original method (idempotent), and let go of the owner: the wrapper and this recorder
        reference each other, and a cycle that holds an `Accelerator` leaves its data loaders (and their persistent
        workers) to the garbage collector, which shuts the workers down in arbitrary order (5 s each)."""
        if self.owner is None:
            return
        if getattr(self.owner, self.attr, None) is self._wrapper:
            if self._had_instance_attr:
                setattr(self.owner, self.attr, self._original)
            else:
                delattr(self.owner, self.attr)
        self.owner = None
        self._original = _removed
        self._wrapper = _removed

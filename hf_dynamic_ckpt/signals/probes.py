"""Probes that measure one training step cheaply, with at most one device sync each: the loss, gradient norms, the
pre-clip norm, memory. The preemption flag (a POSIX signal handler) is `run.sensing.PreemptionFlag`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import sysmem
from .stats import LayerBaselines

logger = logging.getLogger(__name__)


class LossProbe:
    """Sums the step's micro-batch losses (`outputs.loss`) through a forward hook, in training mode only (evaluation
    forwards stay out); the sum stays a detached tensor on the model's device: one sync when `pop()`'s caller reads it.

    Args:
        model (`torch.nn.Module`, *optional*): module whose forward output has a `loss` (a `ModelOutput` or a dict);
            `None`: the loop feeds the probe through `add`.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._sum: torch.Tensor | None = None
        self._handle = model.register_forward_hook(self._hook) if model is not None else None

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if module.training and isinstance(loss, torch.Tensor):
            self.add(loss)

    def add(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss (DataParallel's one loss per replica counts as their mean, as in Trainer)."""
        loss = loss.detach()
        loss = (loss if loss.numel() == 1 else loss.float().mean()).reshape(())
        self._sum = loss if self._sum is None else self._sum + loss

    def pop(self) -> torch.Tensor | None:
        """The summed loss since the last `pop()` (a 0-d tensor), or `None`."""
        total, self._sum = self._sum, None
        return total

    def remove(self) -> None:
        """Detach the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def find_lora_layers(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable LoRA parameters per LoRA layer, found by type (`peft.tuners.lora.LoraLayer`); `{}` without peft."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional
        return {}
    layers: dict[str, list[nn.Parameter]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            subs = [getattr(module, attr, None) for attr in LoraLayer.adapter_layer_names]
            params = [p for sub in subs if isinstance(sub, nn.Module) for p in sub.parameters() if p.requires_grad]
            if params:
                layers[name] = params
    return layers


class GradProbe:
    """The pre-clip global gradient norm and per-LoRA-layer norms, each layer judged by `LayerBaselines` against its
    own history (`lora_max_ratio`: how far the most unusual layer lies above its normal ceiling).

    Call `frame_fields()` once per step with complete gradients. Clipping scales every gradient alike, so with
    `pre_clip_norm` (what the clipping returned) the layer norms measured after it are rescaled by `pre / post`; with it
    and no LoRA layer nothing is computed. FSDP2 gradients count their local shards, the ranks' squares added through
    `sum_across_ranks` (a collective: `distributed.all_reduce_square_sums`). Where gradients never reach `.grad`
    (DeepSpeed ZeRO), `partition_squares` gives this rank's squares per bucket (`state.sharded.ZeroGradSquares`).

    Args:
        model (`torch.nn.Module`): the model (a PEFT model for per-layer norms).
        window, warmup, spread_k (*optional*, defaults to `50`, `30`, `4.0`): each layer's `LayerBaselines`.
        sum_across_ranks (`Callable[[list[float]], list[float]]`, *optional*): per bucket, the sum over ranks.
    """

    def __init__(self, model: nn.Module, *, window: int = 50, warmup: int = 30, spread_k: float = 4.0,
                 sum_across_ranks: Callable[[list[float]], list[float]] | None = None) -> None:
        self.sum_across_ranks = sum_across_ranks
        self.layers = find_lora_layers(model)
        self.layer_names: list[str] = list(self.layers)
        lora = {id(p): i for i, ps in enumerate(self.layers.values()) for p in ps}
        params = [p for p in model.parameters() if p.requires_grad]
        seen = {id(p) for p in params}  # a LoRA layer's frozen parameters (other adapters) count in its layer too
        self._params = params + [p for ps in self.layers.values() for p in ps if id(p) not in seen]
        self._bucket = [lora.get(id(p), len(self.layer_names)) for p in self._params]
        self._bucket_by_name = {name: lora.get(id(p), len(self.layer_names)) for name, p in model.named_parameters()}
        self.baselines = LayerBaselines(window=window, warmup=warmup, spread_k=spread_k)
        self.partition_squares: Callable[[], list[float] | None] | None = None

    def bucket(self, name: str) -> int:
        """The bucket of parameter `name`: its LoRA layer's index, or `len(layer_names)` for the rest."""
        return self._bucket_by_name.get(name, len(self.layer_names))

    def measure(self, pre_clip_norm: float | torch.Tensor | None = None) -> tuple[float | None, dict[str, float]]:
        """`(global_norm, {layer: norm})` of the gradients now in `.grad`, both pre-clip: `None` without gradients,
        NaN / inf where a gradient is not finite."""
        # A DTensor (FSDP2: `clip_grad_norm_`'s result, the gradients) has `full_tensor` / `to_local`.
        pre = None if pre_clip_norm is None else float(getattr(pre_clip_norm, "full_tensor", lambda: pre_clip_norm)())
        n = len(self.layer_names)
        present = [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]
        if (pre is not None and not n) or (not present and self.partition_squares is None):
            return pre, {}
        if not present:  # every rank calls this: the sum across ranks is a collective
            given = self.partition_squares() if self.partition_squares is not None else None
            sq = given if given is not None and len(given) == n + 1 else [0.0] * (n + 1)
            sq = self.sum_across_ranks(sq) if self.sum_across_ranks is not None else sq
            post = math.sqrt(sum(sq))
            if not post > 0.0 and math.isfinite(post):
                return pre, {}  # no gradient reached the optimizer this step
            norms = [math.sqrt(x) * pre / post if pre is not None and math.isfinite(post) else math.sqrt(x)
                     for x in sq[:n]]
            return (pre if pre is not None else post), dict(zip(self.layer_names, norms))
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor, float]]] = {}
        for i, g in present:  # a DTensor counts its local shard, 1 / replicas of it over replicated mesh dimensions
            weight = 1.0 / math.prod(size for size, p in zip(g.device_mesh.shape, g.placements)  # type: ignore[attr-defined]
                                     if p.is_replicate()) if hasattr(g, "to_local") else 0.0
            local = g.to_local() if weight else g  # type: ignore[attr-defined]
            groups.setdefault((local.device, local.dtype), []).append((i, local, weight))
        items = [item for group in groups.values() for item in group]
        stacked = [torch.stack(torch._foreach_norm([g for _, g, _ in group], 2.0)).to(items[0][1].device, torch.float64)
                   for group in groups.values()]
        sq, sharded = [0.0] * (n + 1), [0.0] * (n + 1)
        for (i, _, weight), v in zip(items, (stacked[0] if len(stacked) == 1 else torch.cat(stacked)).tolist()):
            if weight:  # NaN and inf propagate: a non-finite shard on any rank makes the norm non-finite
                sharded[self._bucket[i]] += v * v * weight
            else:
                sq[self._bucket[i]] += v * v
        if any(weight for *_, weight in items):
            total = self.sum_across_ranks(sharded) if self.sum_across_ranks is not None else sharded
            sq = [a + b for a, b in zip(sq, total)]
        post = math.sqrt(sum(sq))  # NaN and inf propagate: the non-finite flag relies on it
        scale = pre / post if pre is not None and math.isfinite(post) and post > 0.0 else 1.0
        norms = [math.sqrt(x) * scale for x in sq[:n]]
        return (pre if pre is not None else post), dict(zip(self.layer_names, norms))

    def observe(self, layer_norms: Mapping[str, float]) -> tuple[float | None, str | None]:
        """`LayerBaselines.observe`: `(max_ratio, layer)`, `(None, None)` while no layer is warmed up."""
        return self.baselines.observe(layer_norms)

    def frame_fields(self, pre_clip_norm: float | torch.Tensor | None = None) -> dict[str, Any]:
        """`measure()` then `observe()`, as `SignalFrame` keyword arguments."""
        global_norm, layer_norms = self.measure(pre_clip_norm)
        ratio, layer = self.observe(layer_norms)
        nonfinite = any(v is not None and not math.isfinite(v) for v in (global_norm, ratio))
        return {"grad_norm": global_norm, "lora_max_ratio": ratio, "lora_max_layer": layer, "nonfinite": nonfinite}

    def state_dict(self) -> dict[str, Any]:
        """The per-layer baselines (JSON), so a resumed run measures the same ratios."""
        return {"levels": self.baselines.state_dict()}  # the key of every probe state saved so far

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "logs" in state.get("levels", {}):  # older states (EMA baselines) have no history: the warm-up restarts
            self.baselines.load_state_dict(state["levels"])


class ClipNormRecorder:
    """Wraps a `clip_grad_norm_` method (`accelerator.clip_grad_norm_`, what `Trainer` calls) and keeps the pre-clip
    norm it returns (`pop()`) and the `max_norm` of its last call (`SignalFrame.clip_norm`): no extra work, no code
    in the loop. `remove()` restores the method."""

    def __init__(self, owner: Any, attr: str = "clip_grad_norm_") -> None:
        self.owner, self.attr = owner, attr
        self._had_instance_attr = attr in getattr(owner, "__dict__", {})
        self._original: Callable[..., Any] = getattr(owner, attr)
        self.last: Any = None
        self.max_norm: float | None = None

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.last = norm = self._original(*args, **kwargs)
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
        """Restore the original method (idempotent) and let go of the owner: the wrapper and this recorder reference
        each other, and a cycle holding an `Accelerator` leaves its data loaders' workers to the garbage collector."""
        if self.owner is None:
            return
        if getattr(self.owner, self.attr, None) is self._wrapper:
            if self._had_instance_attr:
                setattr(self.owner, self.attr, self._original)
            else:
                delattr(self.owner, self.attr)
        self.owner = None
        self._original = self._wrapper = _removed


def _removed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("ClipNormRecorder.remove() was called: the wrapped method is the owner's own again.")


class MemoryProbe:
    """Device and host memory in use, as fractions, every `sample_every` steps (NVML every step costs throughput).

    Device: the larger of the CUDA allocator's reserved bytes and NVML's used bytes (other processes and fragmentation
    included; the NVML device found by UUID) over the device total. Host: `sysmem.headroom`, what the save engine
    reads too: the binding cgroup's working set over its limit, else the machine's, whichever leaves less.

    Args:
        sample_every (`int`, *optional*, defaults to `5`): steps between samples.
        cgroup_dir (`str`, `Path` or `bool`, *optional*): the memory cgroup to read; `None` finds this process's,
            `False` never reads one.
        device (`int`, *optional*): CUDA device index; defaults to the current device.
    """

    def __init__(self, sample_every: int = 5, *, cgroup_dir: str | Path | bool | None = None,
                 device: int | None = None) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every={sample_every} is invalid: expected an integer >= 1.")
        self.sample_every, self.device = sample_every, device
        self.cgroup_dir = (None if cgroup_dir is False else sysmem.find_memory_cgroup() if cgroup_dir in (None, True)
                           else Path(cgroup_dir))  # type: ignore[arg-type]
        self._nvml: Any = None  # the handle, or False once NVML failed (containers): the allocator's view remains

    def sample(self, step: int) -> tuple[float | None, float | None]:
        """`(device_frac, host_frac)` on steps divisible by `sample_every`, else `(None, None)`."""
        return (None, None) if step % self.sample_every else self.read()

    def read(self) -> tuple[float | None, float | None]:
        """`(device_frac, host_frac)` now; `None` for what cannot be measured."""
        return self.device_fraction(), self.host_fraction()

    def host_fraction(self) -> float | None:
        return sysmem.headroom(self.cgroup_dir).fraction

    def device_fraction(self) -> float | None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        dev = torch.cuda.current_device() if self.device is None else self.device
        props = torch.cuda.get_device_properties(dev)
        frac = torch.cuda.memory_reserved(dev) / props.total_memory
        if self._nvml is False:
            return frac
        try:
            import pynvml

            if self._nvml is None:
                pynvml.nvmlInit()
                uuid = str(props.uuid)
                self._nvml = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            return max(frac, int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml).used) / props.total_memory)
        except Exception as e:
            logger.debug("NVML unavailable (%s); using the CUDA allocator only", e)
            self._nvml = False
            return frac

"""Signals: one `SignalFrame` per optimizer step, its probes (at most one device sync each), the robust statistics
the policy judges it with (docs/policy.md section 1; JSON state, so a resume continues exactly), and `Decision`."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import sysmem
from .constants import Tier
from .jsonutil import json_safe

logger = logging.getLogger(__name__)

MAD_TO_STD = 1.4826  # turns a median absolute deviation into a normal standard deviation


class RollingWindow:
    """The last `maxlen` finite values with robust summaries cached until the next `add`."""

    def __init__(self, maxlen: int, values: Iterable[Any] = ()) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen={maxlen} is invalid: expected an integer >= 1.")
        self.maxlen = maxlen
        self._values: deque[float] = deque(maxlen=maxlen)
        self._cache: dict[str, float | None] = {}
        for v in values:
            self.add(float(v))

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float | None) -> None:
        """Append `value` if it is finite."""
        if value is not None and math.isfinite(value):
            self._values.append(float(value))
            self._cache.clear()

    @property
    def values(self) -> list[float]:
        return list(self._values)

    def median(self) -> float | None:
        if "median" not in self._cache:  # statistics.median (one C sort) beats numpy ~6x on ~100 values
            self._cache["median"] = statistics.median(self._values) if self._values else None
        return self._cache["median"]

    def mad(self) -> float | None:
        """Median absolute deviation from the median (unscaled)."""
        if "mad" not in self._cache:
            med = self.median()
            self._cache["mad"] = None if med is None else statistics.median([abs(v - med) for v in self._values])
        return self._cache["mad"]

    def robust_z(self, value: float, *, rel_floor: float = 0.0) -> float | None:
        """Robust z of `value`, its scale at least `rel_floor * |median|` (a flat series makes no huge z-scores)."""
        if len(self._values) < 2 or not math.isfinite(value):
            return None
        med = self.median()
        assert med is not None
        return (value - med) / max(MAD_TO_STD * (self.mad() or 0.0), rel_floor * abs(med), 1e-12)

    def diff_noise(self) -> float | None:
        """Robust standard deviation of the step-to-step noise (a linear trend is not noise)."""
        if len(self._values) < 3:
            return None
        if "diff_noise" not in self._cache:
            diffs = [b - a for a, b in itertools.pairwise(self._values)]
            med = statistics.median(diffs)
            self._cache["diff_noise"] = MAD_TO_STD * statistics.median([abs(d - med) for d in diffs]) / math.sqrt(2.0)
        return self._cache["diff_noise"]


_FRAME_FIELDS = {"loss": "loss", "grad": "grad_norm", "time": "step_time_s"}  # `Windows` name: `SignalFrame` field


class Windows:
    """A `RollingWindow` per name of `sizes` (`loss`, `grad`, `time`), the last `lr` rates and `mem` `(step, memory
    fraction)` samples; `load_state_dict()` restores all or nothing, the sizes stay (the newest values are kept)."""
    loss: RollingWindow
    grad: RollingWindow
    lr: deque[float]
    mem: deque[tuple[int, float]]

    def __init__(self, *, lr: int, mem: int, **sizes: int) -> None:
        self._names = tuple(sizes)
        vars(self).update({n: RollingWindow(size) for n, size in sizes.items()}, lr=deque(maxlen=lr),
                          mem=deque(maxlen=mem))

    def fold(self, frame: SignalFrame) -> None:
        """Add the frame's finite values (after it was measured against the windows)."""
        for n in self._names:
            getattr(self, n).add(getattr(frame, _FRAME_FIELDS[n]))
        if frame.lr is not None and math.isfinite(frame.lr):
            self.lr.append(float(frame.lr))

    def state_dict(self) -> dict[str, Any]:
        return {n: getattr(self, n).values for n in self._names} | {"lr": list(self.lr),
                                                                     "mem": [list(m) for m in self.mem]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        vars(self).update({n: RollingWindow(getattr(self, n).maxlen, state[n]) for n in self._names},
                          lr=deque((float(v) for v in state["lr"]), maxlen=self.lr.maxlen),
                          mem=deque(((int(s), float(m)) for s, m in state["mem"]), maxlen=self.mem.maxlen))


class LayerBaselines:
    """Each LoRA layer's gradient norm against its own last `window` non-zero log norms, once it has `warmup` of
    them (docs/policy.md, "Per-layer LoRA baselines")."""

    def __init__(self, window: int = 50, warmup: int = 30, spread_k: float = 4.0) -> None:
        if warmup < 1 or window < warmup or spread_k < 0:
            raise ValueError(f"window={window}, warmup={warmup}, spread_k={spread_k} are invalid: expected "
                             "1 <= warmup <= window and spread_k >= 0.")
        self.window, self.warmup, self.spread_k = window, warmup, spread_k
        self.logs: dict[str, RollingWindow] = {}

    def excess(self, name: str, norm: float) -> float | None:
        """`norm` over the layer's normal ceiling, `None` while the layer warms up."""
        w = self.logs.get(name)
        if w is None or len(w) < self.warmup or not norm > 0.0:
            return None
        med, mad = w.median(), w.mad()
        assert med is not None and mad is not None
        return math.exp(math.log(norm) - med - self.spread_k * MAD_TO_STD * mad)

    def observe(self, norms: Mapping[str, float]) -> tuple[float | None, str | None]:
        """`(max excess, layer)` of this step's norms (`(None, None)` while none warmed up), then folded in; a
        non-finite norm gives `(inf, layer)` and leaves every baseline untouched."""
        if (bad := next((name for name, norm in norms.items() if not math.isfinite(norm)), None)) is not None:
            return math.inf, bad
        best: tuple[float | None, str | None] = (None, None)
        for name, norm in norms.items():
            ratio = self.excess(name, norm)
            if ratio is not None and (best[0] is None or ratio > best[0]):
                best = (ratio, name)
            if norm > 0.0:  # a zero norm (lora_A before lora_B moved) is no baseline
                self.logs.setdefault(name, RollingWindow(self.window)).add(math.log(norm))
        return best

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "warmup": self.warmup, "spread_k": self.spread_k,
                "logs": {name: w.values for name, w in self.logs.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.logs = {name: RollingWindow(self.window, values[-self.window:])
                     for name, values in state.get("logs", {}).items()}


class Ema:
    """Exponential moving average with bias correction (Adam style); `decay` is the old value's weight, in [0, 1)."""

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} is invalid: expected 0 <= decay < 1.")
        self.decay, self.raw, self.count = decay, 0.0, 0

    def add(self, value: float | None) -> None:
        """Fold in `value` if it is finite."""
        if value is not None and math.isfinite(value):
            self.raw = self.decay * self.raw + (1.0 - self.decay) * float(value)
            self.count += 1

    @property
    def value(self) -> float | None:
        return None if self.count == 0 else self.raw / (1.0 - self.decay**self.count)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "raw": self.raw, "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.decay, self.raw, self.count = float(state["decay"]), float(state["raw"]), int(state["count"])


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """`(slope, intercept)` of the least-squares line through `(x, y)` points; `None` with fewer than two points or
    when every `x` is equal."""
    n = len(points)
    if n < 2:
        return None
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0.0:
        return None
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return slope, my - slope * mx


@dataclass
class SignalFrame:
    """Signals of one optimizer step (docs/policy.md section 1); every field but `step` may be `None`. Under DDP
    reduced across ranks (`distributed.reduce_frame`) first, so every rank decides on the same numbers."""
    step: int  # optimizer steps completed after this update; in `RulePolicy.pre_update` the model holds `step - 1`'s
    loss: float | None = None  # summed over the step's micro-batches (and ranks)
    grad_norm: float | None = None  # pre-clip global L2 norm
    lora_max_ratio: float | None = None  # max over LoRA layers of the layer's norm over its own baseline
    lora_max_layer: str | None = None
    nonfinite: bool = False  # a gradient or the loss is NaN/inf
    device_mem_frac: float | None = None
    host_mem_frac: float | None = None
    step_time_s: float | None = None
    lr: float | None = None  # of the first parameter group, as used by this update
    preempt: bool = False
    save_blocking_s: float | None = None  # this rank's save blocking since its previous frame (MAX over ranks); 0: none
    clip_norm: float | None = None  # the norm the loop clips to (`max_grad_norm`): judges the very first step
    # The memory tier's cadence on this rank and whether it cannot take this step's slot (0: it can, 1: a write still
    # runs, 2: the tier is off); MAX over ranks once reduced, so every rank writes the same slots (`MemoryTier.agree`).
    slot_every: float | None = None
    slot_blocked: float | None = None

    @property
    def mem_frac(self) -> float | None:
        """The larger of the device and host memory fractions, `None` when neither was sampled."""
        return max((v for v in (self.device_mem_frac, self.host_mem_frac) if v is not None), default=None)

    @property
    def any_nonfinite(self) -> bool:
        """`nonfinite`, or a loss / grad norm / LoRA ratio that is NaN or infinite."""
        return self.nonfinite or any(v is not None and not math.isfinite(v)
                                     for v in (self.loss, self.grad_norm, self.lora_max_ratio))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (non-finite floats as `"NaN"`, `"Infinity"`, `"-Infinity"`: `jsonutil.json_safe`)."""
        return json_safe(dataclasses.asdict(self))  # type: ignore[no-any-return]


class LossProbe:
    """Sums the step's training-mode micro-batch losses (`outputs.loss`, a forward hook; without a `model`, `add`)
    as a detached device tensor: one sync when `pop()`'s caller reads it."""

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
    layers = {name: [p for sub in (getattr(module, attr, None) for attr in LoraLayer.adapter_layer_names)
                     if isinstance(sub, nn.Module) for p in sub.parameters() if p.requires_grad]
              for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    return {name: params for name, params in layers.items() if params}


class GradProbe:
    """The pre-clip global gradient norm and per-LoRA-layer norms (judged by a `LayerBaselines`); `frame_fields()`
    once per step. With `pre_clip_norm` the layer norms measured after clipping are rescaled by `pre / post` (nothing
    is computed without LoRA layers). FSDP2 shards' squares are summed by `sum_across_ranks` (a collective); under
    ZeRO `partition_squares` gives this rank's squares per bucket (`sharded.ZeroGradSquares`)."""

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
        """Pre-clip `(global_norm, {layer: norm})` of `.grad` (`None` without gradients; NaN / inf propagate)."""
        # A DTensor (FSDP2: `clip_grad_norm_`'s result, the gradients) has `full_tensor` / `to_local`.
        pre = None if pre_clip_norm is None else float(getattr(pre_clip_norm, "full_tensor", lambda: pre_clip_norm)())
        n = len(self.layer_names)
        present = [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]
        if (pre is not None and not n) or (not present and self.partition_squares is None):
            return pre, {}
        sq, sharded = [0.0] * (n + 1), [0.0] * (n + 1)  # squares per bucket: this rank's whole ones, shards' to sum
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor, float]]] = {}
        for i, g in present:  # a DTensor counts its local shard, 1 / replicas of it over replicated mesh dimensions
            weight = 1.0 / math.prod(size for size, p in zip(g.device_mesh.shape, g.placements)  # type: ignore[attr-defined]
                                     if p.is_replicate()) if hasattr(g, "to_local") else 0.0
            local = g.to_local() if weight else g  # type: ignore[attr-defined]
            groups.setdefault((local.device, local.dtype), []).append((i, local, weight))
        items = [item for group in groups.values() for item in group]
        stacked = [torch.stack(torch._foreach_norm([g for _, g, _ in group], 2.0)).to(items[0][1].device, torch.float64)
                   for group in groups.values()]
        for (i, _, weight), v in zip(items, (stacked[0] if len(stacked) == 1 else torch.cat(stacked)).tolist()
                                     if stacked else []):
            if weight:  # NaN and inf propagate: a non-finite shard on any rank makes the norm non-finite
                sharded[self._bucket[i]] += v * v * weight
            else:
                sq[self._bucket[i]] += v * v
        given = self.partition_squares() if not items and self.partition_squares is not None else None
        sharded = given if given is not None and len(given) == n + 1 else sharded
        if not items or any(weight for *_, weight in items):  # every rank calls this: a collective
            total = self.sum_across_ranks(sharded) if self.sum_across_ranks is not None else sharded
            sq = [a + b for a, b in zip(sq, total)]
        post = math.sqrt(sum(sq))  # NaN and inf propagate: the non-finite flag relies on it
        if not present and not post > 0.0 and math.isfinite(post):
            return pre, {}  # no gradient reached the optimizer this step
        scale = pre / post if pre is not None and math.isfinite(post) and post > 0.0 else 1.0
        norms = [math.sqrt(x) * scale for x in sq[:n]]
        return (pre if pre is not None else post), dict(zip(self.layer_names, norms))

    def frame_fields(self, pre_clip_norm: float | torch.Tensor | None = None) -> dict[str, Any]:
        """`measure()` then `observe()`, as `SignalFrame` keyword arguments."""
        global_norm, layer_norms = self.measure(pre_clip_norm)
        ratio, layer = self.baselines.observe(layer_norms)
        nonfinite = any(v is not None and not math.isfinite(v) for v in (global_norm, ratio))
        return {"grad_norm": global_norm, "lora_max_ratio": ratio, "lora_max_layer": layer, "nonfinite": nonfinite}

    def state_dict(self) -> dict[str, Any]:
        """The per-layer baselines (JSON), so a resumed run measures the same ratios."""
        return {"levels": self.baselines.state_dict()}  # the key of every probe state saved so far

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "logs" in state.get("levels", {}):  # older states (EMA baselines) have no history: the warm-up restarts
            self.baselines.load_state_dict(state["levels"])


class ClipNormRecorder:
    """Wraps a `clip_grad_norm_` method (`accelerator.clip_grad_norm_`) to keep the pre-clip norm it returns (`pop()`)
    and its last `max_norm` (`SignalFrame.clip_norm`); `remove()` restores the method."""

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
        """Restore the original method (idempotent) and let go of the owner (a cycle holding an `Accelerator` would
        leave its data loaders' workers to the garbage collector)."""
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
    """Device (max of the allocator's reserved and NVML's used bytes) and host (`sysmem.headroom`) memory fractions
    every `sample_every` steps. `cgroup_dir`: the memory cgroup (`None`: this process's, `False`: none)."""

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
        return (None, None) if step % self.sample_every else (self.device_fraction(), self.host_fraction())

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


class DecisionKind(enum.StrEnum):
    """Why a save happens, as a value code can branch on (`Decision.reason` stays human text)."""
    NONE = "none"  # no save
    INTERVAL = "interval"  # the regular (possibly risk-shortened) interval elapsed
    RISK_EDGE = "risk_edge"  # smoothed risk rose past risk_threshold
    MEMORY = "memory"  # memory predicted to cross memory_threshold (minimal tiers)
    CAPTURE = "capture"  # pre-update capture of the still-healthy state (pinned)
    PREEMPTION = "preemption"  # SIGTERM/SIGUSR1: one synchronous save, then stop
    TRAIN_END = "train_end"  # the final state when training ends
    MANUAL = "manual"  # asked for outside the policy (save_now, accelerate save_state)
    LEARNED = "learned"  # asked for by the learned double-check model
    ROLLBACK = "rollback"  # no save: a confirmed anomaly, the run returns to a restore point before it


# Smallest consistent restore point: weights plus RNG / data position / step, no optimizer. A resume from it continues
# exactly with a fresh optimizer (the `level_0_only` fallback); a save under memory pressure writes it first.
MINIMAL_TIERS: frozenset[Tier] = frozenset({Tier.WEIGHTS, Tier.STATE})


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one step."""
    save: bool  # take a checkpoint now
    tiers: frozenset[Tier] = frozenset()  # what the checkpoint holds; empty when not saving
    reason: str = ""  # why, in words (logged, stored in the manifest and catalog)
    pin: bool = False  # retention must never delete it
    pre_update: bool = False  # save the state before this step's update: of `frame.step - 1`, with its RNG and data
    skip_update: bool = False  # the caller skips this step's update (and zeroes the gradients): `skip_bad_update`
    risk: float = 0.0  # smoothed risk beta in [0, 1]
    step: int | None = None  # the step of the state to save (`frame.step`, or `frame.step - 1` for a capture)
    healthy: bool = True  # believed sane (no non-finite or bad update, training risk < threshold): restore points are
    interval: float = 0.0  # the current regular interval in steps
    kind: DecisionKind = DecisionKind.NONE  # machine-readable reason; `NONE` when not saving

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (tiers sorted) for logs, the manifest and the decision history."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "tiers": sorted(t.value for t in self.tiers), "risk": round(self.risk, 6),
            "interval": round(self.interval, 3), "kind": self.kind.value}


NO_SAVE = Decision(save=False)

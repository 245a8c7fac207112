"""A training run's live objects turned into a checkpoint's state, and back, on one process (`sharded` does it for
partitioned state).

- What a save reads: `StateSources`, `CachedWeights` (aliasing live tensors, which a snapshot copies).
- L0: `trainable_state_dict` (a PEFT model's adapters only, else the full state dict); `apply_weights` after
  `check_weights`. L1: `apply_optimizer_state`. L2: one rank's exact RNG state as versioned plain JSON (no pickle).
- The parallel setups a save can be trusted in, checked once at `attach` (docs/fsdp.md): a single process, DDP,
  FSDP2 and DeepSpeed ZeRO 1-3; the others are refused with a `ConfigError` naming the supported ones.
"""

from __future__ import annotations

import base64
import logging
import math
import operator
import random
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .constants import ADAPTER_KEY_SEP
from .errors import ConfigError, CorruptCheckpointError, FormatVersionError, IncompatibleStateError
from .store import LoadedCheckpoint

logger = logging.getLogger(__name__)

_MAX_LISTED_KEYS = 10
RNG_FORMAT_VERSION = 1  # of `capture_rng_state`'s JSON; readers refuse newer versions
_data_ptr = torch.Tensor.data_ptr


# ---------------------------------------------------------------------------- what a save reads
@dataclass
class StateSources:
    """The live objects a save copies from (the engine only reads them): `weights` returns the L0 tensors under their
    saved names; `frozen_keys` never change between saves (neither copied nor written); optimizer, scheduler and
    scaler are L1 (`state_dict()` aliases live tensors, which the snapshot copies); `sampler` returns the JSON-able
    data position (L2)."""

    weights: Callable[[], Mapping[str, torch.Tensor]] | None = None
    frozen_keys: frozenset[str] = frozenset()
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    scaler: Any | None = None
    sampler: Callable[[], dict[str, Any]] | None = None


class CachedWeights:
    """A `StateSources.weights` callable that builds its mapping once (`state_dict()` walks every module: tens of
    ms) and reuses it while no module, parameter or buffer of `model` was replaced (checked at every call)."""

    def __init__(self, model: torch.nn.Module, fn: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._model, self._fn = model, fn
        self._cache: dict[str, torch.Tensor] | None = None  # the tables below are recorded with it

    def _record(self) -> None:
        # Flat lists compared in C (`map`) per save: no module traversal (a PEFT model is deep). Every
        # module and parameter/buffer slot is checked by identity; the data pointer only of the tensors
        # the mapping aliases (a `.data =` elsewhere, e.g. on a frozen base weight, leaves it valid).
        held = {t.data_ptr() for t in (self._cache or {}).values() if isinstance(t, torch.Tensor)}
        self._tables: list[dict[str, Any]] = [
            table for m in self._model.modules() for table in (m._modules, m._parameters, m._buffers)]
        # `None` slots too: a tensor set in one later is noticed
        slots = [(table, name, obj) for table in self._tables for name, obj in table.items()]
        self._slots = tuple(map(list, zip(*slots))) if slots else ([], [], [])
        self._aliased = [o for _, _, o in slots if isinstance(o, torch.Tensor) and o.data_ptr() in held]
        self._ptrs = list(map(_data_ptr, self._aliased))
        self._sizes = list(map(len, self._tables))  # a slot added anywhere

    def _valid(self) -> bool:
        tables, names, objs = self._slots
        return (list(map(len, self._tables)) == self._sizes
                and all(map(operator.is_, map(dict.get, tables, names), objs))
                and list(map(_data_ptr, self._aliased)) == self._ptrs)

    def __call__(self) -> Mapping[str, torch.Tensor]:
        if self._cache is None or not self._valid():
            self._cache = dict(self._fn())
            self._record()
        return self._cache


# ---------------------------------------------------------------------------- L0: the model's weights
def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def adapter_names(model: nn.Module) -> list[str]:
    """The PEFT adapters of `model` in a stable order (the active one first); `[]` for other models."""
    if not is_peft_model(model):
        return []
    active = getattr(model, "active_adapter", None)
    return sorted(getattr(model, "peft_config", {}) or {}, key=lambda name: name != active)  # stable


def split_adapters(weights: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Inverse of `trainable_state_dict` for a PEFT model: `{adapter: {peft key: tensor}}` (one adapter: PEFT's
    own key names)."""
    if len(names) <= 1:
        return {names[0] if names else "default": dict(weights)}
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for key, tensor in weights.items():
        adapter, sep, rest = key.partition(ADAPTER_KEY_SEP)
        if not sep or adapter not in out:
            raise IncompatibleStateError(
                f"saved weight {key!r} names no adapter of the model (adapters: {', '.join(names)}); resume with the "
                "adapters the checkpoint was saved with."
            )
        out[adapter][rest] = tensor
    return out


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What L0 holds: a PEFT model's adapters only (several: under ``"<adapter>::<PEFT key>"``), else the full state
    dict. The tensors alias the live parameters."""
    names = adapter_names(model)
    if not names:
        return dict(model.state_dict())
    from peft import get_peft_model_state_dict

    if len(names) == 1:
        return dict(get_peft_model_state_dict(model, adapter_name=names[0]))
    return {f"{name}{ADAPTER_KEY_SEP}{k}": v for name in names
            for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def own_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state-dict entries of a model without adapters that are a CPU parameter's or buffer's own memory: what
    a resume can read the weights file straight into (`plan_resume(into=...)`); empty for a PEFT model (its
    adapters go through PEFT's setter) or a model on another device. A state-dict hook that hands out converted
    copies leaves those keys out: reading into them would not change the model."""
    if adapter_names(model):
        return {}
    own = {t.data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel() and t.device.type == "cpu"}
    return {k: t for k, t in model.state_dict().items() if t.data_ptr() in own}


def frozen_weight_keys(model: nn.Module) -> frozenset[str]:
    """State-dict keys of parameters that do not train (stored once, content-addressed)."""
    if is_peft_model(model):
        return frozenset()
    named = dict(model.named_parameters())
    return frozenset(k for k in model.state_dict() if k in named and not named[k].requires_grad)


def apply_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy saved L0 tensors into the live model in place (`IncompatibleStateError` from `check_weights` first)."""
    names = adapter_names(model)
    check_weights(weights, expected_weights(model))
    if names:
        from peft import set_peft_model_state_dict

        for adapter, state in split_adapters(weights, names).items():
            set_peft_model_state_dict(model, state, adapter_name=adapter)
        return
    model.load_state_dict(dict(weights), strict=False)


def expected_weights(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """`trainable_state_dict(model)` for `check_weights`, buffers checked by name only (a module may resize one
    when it loads a state dict)."""
    out: dict[str, torch.Tensor | None] = dict(trainable_state_dict(model))
    if not adapter_names(model):
        out.update({name: None for name, _ in model.named_buffers() if name in out})
    return out


def _fmt_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    return shown + (f", ... and {len(keys) - _MAX_LISTED_KEYS} more" if len(keys) > _MAX_LISTED_KEYS else "")


def check_weights(saved: Mapping[str, torch.Tensor], expected: Mapping[str, Any]) -> None:
    """Check that `saved` weights fit `expected` (what the model holds; a `None` entry is checked by name only) by key
    names and shapes, else `IncompatibleStateError` listing the missing, unexpected and mismatched keys (sorted, at
    most 10 each)."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = sorted(k for k in set(saved) & set(expected)
                        if expected[k] is not None and tuple(saved[k].shape) != tuple(expected[k].shape))
    shapes = [f"{k} saved {list(saved[k].shape)} vs model {list(expected[k].shape)}" for k in mismatched]
    parts = [f"{what} ({len(keys)}): {_fmt_keys(keys)}" for what, keys in (
        ("missing from the checkpoint", missing), ("unexpected in the checkpoint", unexpected),
        ("shape mismatch", shapes)) if keys]
    if parts:
        raise IncompatibleStateError(
            "saved weights do not fit the model: " + "; ".join(parts)
            + ". Resume with the model (and adapter) configuration the checkpoint was saved from."
        )


# ---------------------------------------------------------------------------- L1: optimizer, scheduler, scaler
def is_dtensor(t: object) -> bool:
    return hasattr(t, "__create_chunk_list__")  # DCP's own test of a DTensor


def zero_optimizer(optimizer: Any) -> Any | None:
    """The DeepSpeed ZeRO optimizer inside `optimizer` (an Accelerate wrapper is unwrapped), or `None`."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if hasattr(candidate, "single_partition_of_fp32_groups") or hasattr(candidate, "fp32_partitioned_groups_flat"):
            return candidate
    return None


def state_numel_bound(params: Iterable[torch.Tensor | None]) -> int | None:
    """The most elements one optimizer-state tensor of these parameters can hold (a parameter's count, or the square
    of its largest dimension: Shampoo), or `None`; an L1 file declaring more is refused before it is allocated."""
    shapes = [tuple(p.shape) for p in params if p is not None]
    return max((max(math.prod(s), max(s, default=1) ** 2) for s in shapes), default=0) or None


def apply_optimizer_state(loaded: LoadedCheckpoint, *, optimizer: Any | None, scheduler: Any | None,
                          scaler: Any | None = None) -> None:
    """Load L1 into the live optimizer / scheduler / scaler. Without L1 the optimizer stays fresh and the scheduler
    moves to the checkpoint's step (with a warning). A sharded optimizer's L1 (a ZeRO optimizer, or `DTensor`
    parameters) is read into its shards by the sharded load, not here."""
    step = loaded.info.step
    if loaded.optimizer is not None and optimizer is not None:
        if zero_optimizer(optimizer) is None and not any(
                is_dtensor(p) for g in getattr(optimizer, "param_groups", []) for p in g["params"]):
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


# ---------------------------------------------------------------------------- L2: RNG
def state_b64(t: torch.Tensor) -> str:  # a generator state as JSON text (RNG and sampler positions)
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def state_unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8).clone()


@dataclass(frozen=True, eq=False)
class RawRngState:
    """The generators' states as captured (copies), converted to JSON by `to_json` off the training thread."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None

    def to_json(self) -> dict[str, Any]:
        version, internal, gauss_next = self.python
        kind, keys, pos, has_gauss, cached_gaussian = self.numpy  # numpy's legacy tuple (its fastest form)
        return {
            "format_version": RNG_FORMAT_VERSION,
            "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
            "numpy": {"kind": kind, "keys": np.asarray(keys).tolist(), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "torch_cpu": state_b64(self.torch_cpu),
            "cuda": [state_b64(t) for t in self.cuda] if self.cuda is not None else None,
        }


RngState = dict[str, Any] | RawRngState  # JSON-able (`capture_rng_state`) or raw (`capture_raw_rng_state`)


def capture_raw_rng_state() -> RawRngState:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return RawRngState(python=random.getstate(), numpy=np.random.get_state(legacy=True),  # type: ignore[arg-type]
                       torch_cpu=torch.get_rng_state(), cuda=cuda)


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON (`"cuda"`: a base64 state per device, `None` when CUDA is not initialised)."""
    return capture_raw_rng_state().to_json()


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore `capture_rng_state`'s states, all or nothing (CUDA ones only where the device count matches, else a
    warning). Raises `FormatVersionError` (a newer format), `CorruptCheckpointError` (a field missing or malformed)."""
    version = state.get("format_version") if isinstance(state, dict) else None
    if not isinstance(version, int):
        raise CorruptCheckpointError(f"RNG state has no integer format_version (got {version!r}); the file is corrupt.")
    if version > RNG_FORMAT_VERSION:
        raise FormatVersionError(
            f"RNG state has format_version {version}, newer than this library's {RNG_FORMAT_VERSION}; "
            "upgrade hf_dynamic_ckpt to resume from it."
        )
    try:
        py = state["python"]
        py_state = (int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"])
        npst = state["numpy"]
        np_state = (str(npst["kind"]), np.asarray(npst["keys"], dtype=np.uint32), int(npst["pos"]),
                    int(npst["has_gauss"]), float(npst["cached_gaussian"]))
        torch_cpu = state_unb64(state["torch_cpu"])
        cuda = state.get("cuda")
        cuda_states = [state_unb64(s) for s in cuda] if cuda else None
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"RNG state is malformed ({type(e).__name__}: {e}); the file is corrupt.") from e
    generators: list[tuple[Callable[[Any], Any], Any, Any]] = [
        (torch.set_rng_state, torch_cpu, torch.get_rng_state()),
        (np.random.set_state, np_state, np.random.get_state(legacy=True)),
        (random.setstate, py_state, random.getstate())]
    try:
        for set_state, new, _ in generators:
            set_state(new)
    except (TypeError, ValueError, IndexError, RuntimeError) as e:
        for set_state, _, old in generators:  # all or nothing: a half-restored set would silently break exactness
            set_state(old)
        raise CorruptCheckpointError(f"RNG state was rejected by its generator ({e}); the file is corrupt.") from e
    if cuda_states:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            logger.warning("RNG state holds %d CUDA generator(s) but %d CUDA device(s) are visible; "
                           "CUDA generators not restored, GPU randomness will differ.", len(cuda_states), have)


# ---------------------------------------------------------------------------- supported parallel setups
SUPPORTED_SETUPS = (  # named by every refusal (docs/fsdp.md)
    "a single process; DDP (torchrun / `accelerate launch --multi_gpu`, Trainer on several processes); "
    "FSDP2 (`torch.distributed.fsdp.fully_shard`, or Accelerate's FSDP plugin with fsdp_version=2), with "
    "`SmartCheckpointer` or the `RunOrchestrator` core; DeepSpeed ZeRO stages 1-3 under Trainer or "
    "`SmartCheckpointer`"
)


def _refuse(what: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"hf_dynamic_ckpt does not support {what}: {why}. Supported setups: {SUPPORTED_SETUPS}. {fix}")


_STAGE0_WHY = ("without ZeRO the engine's mixed-precision optimizer keeps the fp32 master weights in a form this "
               "library does not read, and a save from here would miss them")
_STAGE0_FIX = "Use ZeRO stage 1, 2 or 3 (zero_optimization.stage), which are supported."
_FSDP1_WHY = ("its flat parameters hold one rank's slice of many tensors, and a save from here would store rank 0's "
              "slice as if it were the model")
_FSDP1_FIX = ("Use FSDP2: `fully_shard(module)` (torch >= 2.6), Accelerate's `FullyShardedDataParallelPlugin("
              "fsdp_version=2)`, or Trainer's `fsdp_config={'version': 2}`.")


def check_accelerator(accelerator: Any, *, deepspeed: bool = False) -> None:
    """Refuse an `Accelerator` set up for DeepSpeed without ZeRO (or for DeepSpeed at all unless `deepspeed`: the
    `save_state` hooks cannot work under it, Trainer and `SmartCheckpointer` do), or for FSDP version 1, with a
    `ConfigError` naming the detected setup and the supported ones (`None`: nothing to check)."""
    state = getattr(accelerator, "state", None)
    kind = getattr(accelerator, "distributed_type", None) or getattr(state, "distributed_type", None)
    kind = str(getattr(kind, "value", kind) or "").upper()
    plugin = getattr(state, "deepspeed_plugin", None) or getattr(accelerator, "deepspeed_plugin", None)
    if kind == "DEEPSPEED" or plugin is not None:
        stage = getattr(plugin, "zero_stage", None)
        if not deepspeed:
            raise _refuse("DeepSpeed with the save_state hooks (SmartStateHooks)",
                          "under DeepSpeed, accelerator.save_state runs DeepSpeed's own save_checkpoint (pickles, "
                          "every rank waits) and load_state its load_checkpoint, whatever a hook does",
                          "In a custom loop use SmartCheckpointer (its saves, save_now() and resume(); "
                          "docs/deepspeed.md), or Trainer with SmartCkptCallback.")
        if stage not in (1, 2, 3):
            raise _refuse(f"DeepSpeed without ZeRO (zero_optimization.stage={stage})", _STAGE0_WHY, _STAGE0_FIX)
    if kind == "FSDP":
        plugin = getattr(state, "fsdp_plugin", None) or getattr(accelerator, "fsdp_plugin", None)
        version = getattr(plugin, "fsdp_version", 1)
        if version != 2:
            raise _refuse(f"FSDP version {version} (Accelerate's FSDP plugin)", _FSDP1_WHY, _FSDP1_FIX)


def check_training_args(args: Any) -> None:
    """Refuse `TrainingArguments` with FSDP version 1 (`fsdp=...` without version 2); DeepSpeed is checked on the
    accelerator Trainer builds from them (`check_accelerator`). Raises `ConfigError`; `None`: nothing to check."""
    fsdp = getattr(args, "fsdp", None)
    if fsdp:
        config = getattr(args, "fsdp_config", None) or {}
        # Without `fsdp_config["version"]`, Trainer uses FSDP2 (transformers >= 5, which this library requires).
        version = config.get("version", config.get("fsdp_version", 2)) if isinstance(config, dict) else 2
        if str(version) != "2":
            raise _refuse(f"FSDP version {version} (TrainingArguments.fsdp={fsdp!r})", _FSDP1_WHY, _FSDP1_FIX)


def check_model(model: nn.Module) -> None:
    """Refuse (`ConfigError`) a DeepSpeedEngine as the model (its `module` is the model), and FSDP1
    (`FullyShardedDataParallel` anywhere inside)."""
    for module in model.modules():
        name = type(module).__name__
        if name == "DeepSpeedEngine":
            raise ConfigError("the model given is a DeepSpeedEngine: pass the model it trains (engine.module) and the "
                              "engine's optimizer; hf_dynamic_ckpt reads the ZeRO partitions from the optimizer.")
        if name == "FullyShardedDataParallel":
            raise _refuse("FSDP version 1 (the model contains a FullyShardedDataParallel module)", _FSDP1_WHY,
                          _FSDP1_FIX)


def check_zero(zero: Any) -> None:
    """Refuse (`ConfigError`) the ZeRO set-ups a save cannot read: NVMe offload, ZeRO-3's partial optimizer offload."""
    if getattr(zero, "swap_optimizer", False) or getattr(zero, "params_in_nvme_and_cpu", False) \
            or getattr(zero, "optimizer_swapper", None) is not None:
        raise ConfigError("hf_dynamic_ckpt does not support DeepSpeed ZeRO with NVMe offload (offload_optimizer / "
                          "offload_param device 'nvme'): the optimizer state is not in memory for a save to read. "
                          "Offload to 'cpu' (supported) or keep the state on the device.")
    if getattr(zero, "offload_optimizer", False) and getattr(zero, "partial_offload", 1.0) != 1.0:
        raise ConfigError("hf_dynamic_ckpt does not support DeepSpeed ZeRO-3 with partial optimizer offload "
                          f"(offload_optimizer.ratio={zero.partial_offload}): the state of the sub-groups kept on the "
                          "device lives in a second optimizer this library does not read. Offload all of it (ratio 1) "
                          "or none.")

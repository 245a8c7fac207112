"""The live objects a save reads from (`StateSources`), and a cached L0 mapping (`CachedWeights`).

The engine only reads these; what they return aliases live tensors, which a snapshot copies.

Which parallel setups a save can be trusted in, checked once at `attach` (never a silent wrong save).

Supported: a single process, DDP (every rank holds the whole model; rank 0 writes it), FSDP2
(`torch.distributed.fsdp.fully_shard`: every parameter is a `DTensor`; every rank writes its own
shards, see `state.sharded`), and DeepSpeed ZeRO stages 1-3 (every rank writes its fragments of the
partitioned state, see `state.sharded`). Refused with a `ConfigError` that names these: DeepSpeed
without ZeRO (stage 0: its mixed-precision optimizers keep master weights this library does not
read), the `save_state` hooks under DeepSpeed (`save_state` runs DeepSpeed's own pickled save
whatever a hook does), a DeepSpeedEngine handed over as the model (pass `engine.module`), and FSDP1
(`FullyShardedDataParallel` flat parameters hold one rank's slice of many tensors; a save from here
would store rank 0's slice as if it were the model). Under ZeRO (`check_zero`): NVMe offload (the moments are not
in memory) and ZeRO-3's partial optimizer offload (a second optimizer holds part of the state).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

_data_ptr = torch.Tensor.data_ptr


@dataclass
class StateSources:
    """The live objects a save copies from. The engine only reads them.

    Args:
        weights (`Callable[[], Mapping[str, torch.Tensor]]`, *optional*): returns the L0
            tensors under their saved names, e.g. `model.state_dict` or a PEFT adapter dict.
        frozen_keys (`frozenset[str]`, *optional*): weight names that never change between
            saves (frozen base weights): the engine neither copies nor writes them.
        optimizer (`torch.optim.Optimizer`, *optional*): L1; its `state_dict()` aliases live
            tensors, which the snapshot copies.
        scheduler (*optional*): object with `state_dict()` (LR scheduler), L1.
        scaler (*optional*): object with `state_dict()` (AMP `GradScaler`), L1.
        sampler (`Callable[[], dict]`, *optional*): JSON-able data position, L2.

    Example:
        ```python
        >>> sources = StateSources(weights=model.state_dict, optimizer=optimizer)
        ```
    """

    weights: Callable[[], Mapping[str, torch.Tensor]] | None = None
    frozen_keys: frozenset[str] = frozenset()
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    scaler: Any | None = None
    sampler: Callable[[], dict[str, Any]] | None = None


class CachedWeights:
    """A `StateSources.weights` callable that builds its mapping once and reuses it.

    `model.state_dict()` and `peft.get_peft_model_state_dict(model)` walk every module on
    each call (tens of milliseconds on a 60M-parameter model, more than the copy of a LoRA
    adapter). Their tensors alias the live parameters, so the mapping stays valid while no
    parameter or buffer is replaced; that is checked on every call (storage pointer, shape,
    dtype of each), and the mapping is rebuilt when something changed (`model.to(...)`,
    a re-assigned parameter, a resized embedding).

    Args:
        model (`torch.nn.Module`): the model whose parameters the mapping aliases.
        fn (`Callable[[], Mapping[str, torch.Tensor]]`): builds the mapping, e.g.
            `model.state_dict` or `lambda: get_peft_model_state_dict(model)`.

    Example:
        ```python
        >>> sources = StateSources(weights=CachedWeights(model, model.state_dict), optimizer=optimizer)
        ```
    """

    def __init__(self, model: torch.nn.Module, fn: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._model = model
        self._fn = fn
        self._slots: tuple[list[dict[str, Any]], list[str], list[Any]] = ([], [], [])
        self._aliased: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._tables: list[dict[str, Any]] = []
        self._sizes: list[int] = []
        self._cache: dict[str, torch.Tensor] | None = None

    def _record(self) -> None:
        # Flat lists compared in C (`map`) per save: no module traversal (a PEFT model is deep). Every
        # module and parameter/buffer slot is checked by identity; the data pointer only of the tensors
        # the mapping aliases (a `.data =` elsewhere, e.g. on a frozen base weight, leaves it valid).
        held = {t.data_ptr() for t in (self._cache or {}).values() if isinstance(t, torch.Tensor)}
        tables: list[dict[str, Any]] = []
        names: list[str] = []
        objs: list[Any] = []
        self._aliased, self._ptrs, self._tables = [], [], []
        for module in self._model.modules():
            for table in (module._modules, module._parameters, module._buffers):
                self._tables.append(table)
                for name, obj in table.items():  # `None` slots too: a tensor set in one later is noticed
                    tables.append(table)
                    names.append(name)
                    objs.append(obj)
                    if isinstance(obj, torch.Tensor) and obj.data_ptr() in held:
                        self._aliased.append(obj)
                        self._ptrs.append(obj.data_ptr())
        self._slots = (tables, names, objs)
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


SUPPORTED_SETUPS = (
    "a single process; DDP (torchrun / `accelerate launch --multi_gpu`, Trainer on several processes); "
    "FSDP2 (`torch.distributed.fsdp.fully_shard`, or Accelerate's FSDP plugin with fsdp_version=2), with "
    "`SmartCheckpointer` or the `RunOrchestrator` core; DeepSpeed ZeRO stages 1-3 under Trainer or "
    "`SmartCheckpointer`"
)
"""The setups named by every refusal (see docs/fsdp.md)."""


def _refuse(what: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"hf_dynamic_ckpt does not support {what}: {why}. Supported setups: {SUPPORTED_SETUPS}. {fix}")


_STAGE0_WHY = ("without ZeRO the engine's mixed-precision optimizer keeps the fp32 master weights in a form this "
               "library does not read, and a save from here would miss them")
_STAGE0_FIX = "Use ZeRO stage 1, 2 or 3 (zero_optimization.stage), which are supported."
_FSDP1_WHY = ("its flat parameters hold one rank's slice of many tensors, and a save from here would store rank 0's "
              "slice as if it were the model")
_FSDP1_FIX = ("Use FSDP2: `fully_shard(module)` (torch >= 2.6), Accelerate's `FullyShardedDataParallelPlugin("
              "fsdp_version=2)`, or Trainer's `fsdp_config={'version': 2}`.")


def _accelerator_type(accelerator: Any) -> str:
    state = getattr(accelerator, "state", None)
    kind = getattr(accelerator, "distributed_type", None) or getattr(state, "distributed_type", None)
    return str(getattr(kind, "value", kind) or "").upper()


def check_accelerator(accelerator: Any, *, deepspeed: bool = False) -> None:
    """Refuse an `Accelerator` set up for DeepSpeed without ZeRO (or for DeepSpeed at all unless `deepspeed`: the
    `save_state` hooks cannot work under it, Trainer and `SmartCheckpointer` do), or for FSDP version 1.

    Raises:
        `ConfigError`: naming the detected setup and the supported ones.
    """
    if accelerator is None:
        return
    kind = _accelerator_type(accelerator)
    state = getattr(accelerator, "state", None)
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
    accelerator Trainer builds from them (`check_accelerator`).

    Raises:
        `ConfigError`: naming the detected setup and the supported ones.
    """
    if args is None:
        return
    fsdp = getattr(args, "fsdp", None)
    if fsdp:
        config = getattr(args, "fsdp_config", None) or {}
        default = _trainer_fsdp_default()
        version = config.get("version", config.get("fsdp_version", default)) if isinstance(config, dict) else default
        if str(version) != "2":
            raise _refuse(f"FSDP version {version} (TrainingArguments.fsdp={fsdp!r})", _FSDP1_WHY, _FSDP1_FIX)


def _trainer_fsdp_default() -> int:
    """The FSDP version Trainer uses without `fsdp_config["version"]`: 2 from transformers 5, else 1."""
    try:
        import transformers
    except ImportError:  # pragma: no cover
        return 1
    return 2 if int(transformers.__version__.split(".")[0]) >= 5 else 1


def check_model(model: nn.Module) -> None:
    """Refuse a DeepSpeedEngine as the model (its `module` is the model), and FSDP1 (`FullyShardedDataParallel`
    anywhere inside).

    Raises:
        `ConfigError`: naming the detected wrapper and the supported setups.
    """
    for module in model.modules():
        name = type(module).__name__
        if name == "DeepSpeedEngine":
            raise ConfigError("the model given is a DeepSpeedEngine: pass the model it trains (engine.module) and the "
                              "engine's optimizer; hf_dynamic_ckpt reads the ZeRO partitions from the optimizer.")
        if name == "FullyShardedDataParallel":
            raise _refuse("FSDP version 1 (the model contains a FullyShardedDataParallel module)", _FSDP1_WHY,
                          _FSDP1_FIX)


def check_zero(zero: Any) -> None:
    """Refuse the DeepSpeed ZeRO set-ups a save cannot read: NVMe offload, ZeRO-3's partial optimizer offload.

    Raises:
        `ConfigError`: naming the setting and the way out.
    """
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

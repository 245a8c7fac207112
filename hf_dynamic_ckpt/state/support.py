"""Which parallel setups a save can be trusted in, checked once at `attach` (never a silent wrong save).

Supported: a single process, DDP (every rank holds the whole model; rank 0 writes it), and FSDP2
(`torch.distributed.fsdp.fully_shard`: every parameter is a `DTensor`; every rank writes its own
shards, see `state.shards`). Refused with a `ConfigError` that names these: DeepSpeed ZeRO (the
partitions live inside the DeepSpeed engine; a save from here would store rank 0's partition as
if it were the model) and FSDP1 (`FullyShardedDataParallel` flat parameters, same problem).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import ConfigError

SUPPORTED_SETUPS = (
    "a single process; DDP (torchrun / `accelerate launch --multi_gpu`, Trainer on several processes); "
    "FSDP2 (`torch.distributed.fsdp.fully_shard`, or Accelerate's FSDP plugin with fsdp_version=2), with "
    "`SmartCheckpointer` or the `RunOrchestrator` core"
)
"""The setups named by every refusal (see docs/fsdp.md)."""


def _refuse(what: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"hf_dynamic_ckpt does not support {what}: {why}. Supported setups: {SUPPORTED_SETUPS}. {fix}")


_DEEPSPEED_WHY = ("ZeRO partitions the weights and optimizer state inside the DeepSpeed engine, and a save from "
                  "here would store one rank's partition as if it were the whole state")
_DEEPSPEED_FIX = ("Train without DeepSpeed (FSDP2 shards the same state and is supported), or use DeepSpeed's own "
                  "checkpointing without hf_dynamic_ckpt.")
_FSDP1_WHY = ("its flat parameters hold one rank's slice of many tensors, and a save from here would store rank 0's "
              "slice as if it were the model")
_FSDP1_FIX = ("Use FSDP2: `fully_shard(module)` (torch >= 2.6), Accelerate's `FullyShardedDataParallelPlugin("
              "fsdp_version=2)`, or Trainer's `fsdp_config={'version': 2}`.")


def _accelerator_type(accelerator: Any) -> str:
    state = getattr(accelerator, "state", None)
    kind = getattr(accelerator, "distributed_type", None) or getattr(state, "distributed_type", None)
    return str(getattr(kind, "value", kind) or "").upper()


def check_accelerator(accelerator: Any) -> None:
    """Refuse an `Accelerator` set up for DeepSpeed, or for FSDP version 1.

    Raises:
        `ConfigError`: naming the detected setup and the supported ones.
    """
    if accelerator is None:
        return
    kind = _accelerator_type(accelerator)
    state = getattr(accelerator, "state", None)
    deepspeed = getattr(state, "deepspeed_plugins", None) or getattr(accelerator, "deepspeed_plugin", None)
    if kind == "DEEPSPEED" or deepspeed:
        raise _refuse("DeepSpeed (the accelerator's distributed_type is DEEPSPEED)", _DEEPSPEED_WHY, _DEEPSPEED_FIX)
    if kind == "FSDP":
        plugin = getattr(state, "fsdp_plugin", None) or getattr(accelerator, "fsdp_plugin", None)
        version = getattr(plugin, "fsdp_version", 1)
        if version != 2:
            raise _refuse(f"FSDP version {version} (Accelerate's FSDP plugin)", _FSDP1_WHY, _FSDP1_FIX)


def check_training_args(args: Any) -> None:
    """Refuse `TrainingArguments` with `deepspeed=` or FSDP version 1 (`fsdp=...` without version 2).

    Raises:
        `ConfigError`: naming the detected setup and the supported ones.
    """
    if args is None:
        return
    if getattr(args, "deepspeed", None):
        raise _refuse(f"DeepSpeed (TrainingArguments.deepspeed={args.deepspeed!r})", _DEEPSPEED_WHY,
                      _DEEPSPEED_FIX)
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
    """Refuse a model wrapped by DeepSpeed or by FSDP1 (`FullyShardedDataParallel` anywhere inside).

    Raises:
        `ConfigError`: naming the detected wrapper and the supported setups.
    """
    for module in model.modules():
        name = type(module).__name__
        if name == "DeepSpeedEngine":
            raise _refuse("DeepSpeed (the model is a DeepSpeedEngine)", _DEEPSPEED_WHY, _DEEPSPEED_FIX)
        if name == "FullyShardedDataParallel":
            raise _refuse("FSDP version 1 (the model contains a FullyShardedDataParallel module)", _FSDP1_WHY,
                          _FSDP1_FIX)

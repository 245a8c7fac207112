"""Which parallel setups a save can be trusted in, checked once at `attach` (never a silent wrong save).

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

from typing import Any

from torch import nn

from ..errors import ConfigError

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

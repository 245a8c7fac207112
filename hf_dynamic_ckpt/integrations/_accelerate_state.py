"""The live objects of an `Accelerator` run, as the checkpointer saves and restores them.

Shared by the state-hook pair and `SmartCheckpointer`, so both save the same tiers the
same way: L0 the trainable weights (a PEFT model's adapter only, PEFT key names), L1 the
accelerator's optimizer, scheduler and AMP scaler, L2 each rank's RNG plus the data
position of a `ResumableLoader`. The weight and optimizer helpers are the checkpointer's,
the same ones the Trainer callback uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError
from ..state import apply_optimizer_state, apply_weights, frozen_weight_keys, own_weights, trainable_state_dict
from ..state.rng import restore_rng_state
from ..store import LoadedCheckpoint
from ._accelerate_elastic import KEY_SCHEDULER_PACE, natural_pace
from ._position import ResumableLoader

logger = logging.getLogger(__name__)

KEY_ACCELERATE = "accelerate"
"""Key of this integration's entry in the manifest's `extra`."""
_MODEL_PREFIX = "model_{}."


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Updates already applied, from the per-parameter `step` that Adam-family optimizers keep
    (0 when the optimizer keeps none): hooks created mid-run still file checkpoints correctly."""
    steps = [int(st["step"]) for st in optimizer.state.values() if isinstance(st, dict) and "step" in st]
    return max(steps, default=0)


class AccelerateState:
    """What a checkpoint of an `Accelerator` run reads from, and writes back into.

    Args:
        accelerator (`accelerate.Accelerator`): after `prepare(...)`.
        models (`list[torch.nn.Module]`, *optional*): defaults to the accelerator's models.
        loader (`ResumableLoader`, *optional*): the data position to save and restore.

    Raises:
        `ConfigError`: more than one optimizer or scheduler is prepared (a checkpoint holds one).
    """

    def __init__(self, accelerator: Any, *, models: list[torch.nn.Module] | None = None,
                 loader: ResumableLoader | None = None) -> None:
        self.accelerator = accelerator
        self._models = models
        self.loader = loader
        self.optimizer_steps = 0
        self._step_hook: Any = None
        self.scheduler_pace: int | None = None
        """Steps of the wrapped scheduler per optimizer step (`_accelerate_elastic`), as the checkpoints record it."""
        for kind in ("_optimizers", "_schedulers"):
            objs = getattr(accelerator, kind, [])
            if len(objs) > 1:
                raise ConfigError(
                    f"accelerator prepared {len(objs)} {kind[1:]}: hf_dynamic_ckpt stores one optimizer and one "
                    "scheduler per checkpoint; prepare a single one (parameter groups work)."
                )
        self.scheduler_pace = natural_pace(self.scheduler, int(accelerator.num_processes))
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if isinstance(inner, torch.optim.Optimizer):
            self.optimizer_steps = _steps_taken(inner)
            # The inner optimizer steps only on real updates (not on accumulation micro-steps):
            # counting them gives the optimizer-step number a checkpoint is filed under.
            self._step_hook = inner.register_step_post_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.optimizer_steps += 1

    def close(self) -> None:
        """Stop counting optimizer steps. Idempotent."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    # -- the live objects ------------------------------------------------------------------
    def models(self) -> list[torch.nn.Module]:
        """The unwrapped models (no DDP wrapper), in `prepare` order."""
        models = self._models if self._models is not None else list(self.accelerator._models)
        if not models:
            raise ConfigError("the accelerator has no prepared model: call accelerator.prepare(model, ...) first.")
        return [self.accelerator.unwrap_model(m) for m in models]

    @property
    def optimizer(self) -> Any | None:
        opts = self.accelerator._optimizers
        return opts[0] if opts else None

    @property
    def scheduler(self) -> Any | None:
        scheds = self.accelerator._schedulers
        return scheds[0] if scheds else None

    @property
    def scaler(self) -> Any | None:
        return getattr(self.accelerator, "scaler", None)

    def weights(self) -> dict[str, torch.Tensor]:
        """L0 tensors of every model (the second model's keys prefixed `model_1.`, ...)."""
        return self._of_every_model(trainable_state_dict)

    def read_targets(self) -> dict[str, torch.Tensor]:
        """The models' own tensors a resume reads the weights file into (`state.own_weights`, keys as `weights`)."""
        return self._of_every_model(own_weights)

    def _of_every_model(self, tensors: Callable[[torch.nn.Module], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, model in enumerate(self.models()):
            prefix = "" if i == 0 else _MODEL_PREFIX.format(i)
            out.update({prefix + k: v for k, v in tensors(model).items()})
        return out

    def frozen_keys(self) -> frozenset[str]:
        keys: set[str] = set()
        for i, model in enumerate(self.models()):
            prefix = "" if i == 0 else _MODEL_PREFIX.format(i)
            keys.update(prefix + k for k in frozen_weight_keys(model))
        return frozenset(keys)

    def epoch(self, *, boundary: bool = False) -> float:
        """Fractional epoch of the data position (0.0 without a loader; whole epochs when it has no length)."""
        if self.loader is None:
            return 0.0
        pos = self.loader.boundary_position() if boundary else self.loader.position()
        try:
            length = len(self.loader)
        except TypeError:  # an iterable dataset
            return float(pos["epoch"])
        return pos["epoch"] + pos["batches_seen"] / max(length, 1)

    def extra(self) -> dict[str, Any]:
        return {KEY_ACCELERATE: {"optimizer_steps": self.optimizer_steps,
                                 "num_processes": int(self.accelerator.num_processes),
                                 KEY_SCHEDULER_PACE: self.scheduler_pace}}

    # -- back into the live objects --------------------------------------------------------
    def apply(self, loaded: LoadedCheckpoint) -> None:
        """Load weights, optimizer, scheduler and scaler; arm the loader's exact resume.

        The RNG is not applied here when a loader is attached: the loader re-applies it
        once the first batch of the resumed epoch is fetched.

        Raises:
            `IncompatibleStateError`: the saved weights do not fit the models.
        """
        if loaded.weights is not None:
            models = self.models()
            per_model: list[dict[str, torch.Tensor]] = [{} for _ in models]
            for key, tensor in loaded.weights.items():
                index = 0
                for i in range(1, len(models)):
                    prefix = _MODEL_PREFIX.format(i)
                    if key.startswith(prefix):
                        index, key = i, key[len(prefix):]
                        break
                per_model[index][key] = tensor
            for model, weights in zip(models, per_model):
                apply_weights(model, weights)
        apply_optimizer_state(loaded, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler)
        self.optimizer_steps = loaded.info.step
        if self.loader is not None and loaded.sampler is not None:
            self.loader.resume_from(loaded.sampler, rng=loaded.rng)
        elif loaded.rng is not None:
            restore_rng_state(loaded.rng)
        logger.debug("restored step %d from %s (tiers: %s)", loaded.info.step, loaded.info.path,
                    ", ".join(sorted(t.value for t in loaded.tiers)))

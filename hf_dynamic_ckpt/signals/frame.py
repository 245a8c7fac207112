"""`SignalFrame`: what the sensing layer measured in one optimizer step."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..jsonutil import safe_float


@dataclass
class SignalFrame:
    """Signals of one optimizer step, as the decision policy sees them (docs/policy.md section 1).

    Every field but `step` may be `None` (a probe not wired, a memory sample not due). Under DDP the frame is reduced
    across ranks (`distributed.reduce_frame`) before the policy sees it, so every rank decides on the same numbers.

    Args:
        step (`int`): optimizer steps completed after this step's update (Trainer's `global_step` once the step
            ends); in `RulePolicy.pre_update` the model still holds the state of `step - 1`.
        loss (`float`, *optional*): the step's loss, summed over its micro-batches (and ranks).
        grad_norm (`float`, *optional*): pre-clip global L2 norm of the gradients.
        lora_max_ratio (`float`, *optional*): max over LoRA layers of the layer's norm over its own baseline.
        lora_max_layer (`str`, *optional*): the layer reaching `lora_max_ratio`.
        nonfinite (`bool`, *optional*, defaults to `False`): a gradient or the loss is NaN/inf.
        device_mem_frac, host_mem_frac (`float`, *optional*): accelerator / host (or cgroup) memory in use.
        step_time_s (`float`, *optional*): wall time of the step.
        lr (`float`, *optional*): learning rate of the first parameter group, as used by this update.
        preempt (`bool`, *optional*, defaults to `False`): a preemption signal arrived.
        save_blocking_s (`float`, *optional*): seconds this rank was blocked by its saves since its previous frame
            (MAX over ranks once reduced): the policy's only view of the save cost; `None` or `0`: no save.
        clip_norm (`float`, *optional*): the norm the loop clips to (`max_grad_norm`): judges the very first step.
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lora_max_ratio: float | None = None
    lora_max_layer: str | None = None
    nonfinite: bool = False
    device_mem_frac: float | None = None
    host_mem_frac: float | None = None
    step_time_s: float | None = None
    lr: float | None = None
    preempt: bool = False
    save_blocking_s: float | None = None
    clip_norm: float | None = None

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
        """JSON-able form (non-finite floats as `"NaN"`, `"Infinity"`, `"-Infinity"`: `jsonutil.safe_float`)."""
        return {f.name: safe_float(v) if isinstance(v := getattr(self, f.name), float) else v
                for f in dataclasses.fields(self)}

"""`SignalFrame`: what the sensing layer measured in one optimizer step."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..jsonutil import safe_float


@dataclass
class SignalFrame:
    """Signals of one optimizer step, as seen by the decision policy.

    Every field except `step` may be missing (`None`): a probe that is not wired, or a
    memory sample that is not due this step. Under DDP the frame is reduced across ranks
    (`hf_dynamic_ckpt.distributed.reduce_frame`) before the policy sees it.

    Args:
        step (`int`): optimizer steps completed after this step's update (the Trainer's
            `global_step` once the step ends). In `RulePolicy.pre_update` the update has not
            happened yet, so the state on the model is the state of `step - 1`.
        loss (`float`, *optional*): the step's loss, summed over its micro-batches (and ranks).
        grad_norm (`float`, *optional*): pre-clip global L2 norm of the gradients.
        lora_max_ratio (`float`, *optional*): max over LoRA layers of the layer's gradient
            norm divided by that layer's own running baseline.
        lora_max_layer (`str`, *optional*): the layer reaching `lora_max_ratio`.
        nonfinite (`bool`, *optional*, defaults to `False`): a gradient or the loss is NaN/inf.
        device_mem_frac (`float`, *optional*): accelerator memory in use, fraction of total.
        host_mem_frac (`float`, *optional*): host (or cgroup) memory in use, fraction of the limit.
        step_time_s (`float`, *optional*): wall time of the step.
        lr (`float`, *optional*): learning rate of the first parameter group.
        preempt (`bool`, *optional*, defaults to `False`): a preemption signal arrived.
        save_blocking_s (`float`, *optional*): seconds this rank was blocked by the saves it took
            since its previous frame (MAX over ranks once reduced): the policy's only view of the
            save cost, so that every rank folds the same number. `None` or `0`: no save since then.
        clip_norm (`float`, *optional*): the norm the gradients are clipped to (`max_grad_norm`),
            when the loop clips; lets the policy judge the very first step, before any history.
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
        values = [v for v in (self.device_mem_frac, self.host_mem_frac) if v is not None]
        return max(values) if values else None

    @property
    def any_nonfinite(self) -> bool:
        """`nonfinite`, or a loss / grad norm / LoRA ratio that is NaN or infinite."""
        if self.nonfinite:
            return True
        return any(v is not None and not math.isfinite(v) for v in (self.loss, self.grad_norm, self.lora_max_ratio))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (non-finite floats become `"NaN"`, `"Infinity"`, `"-Infinity"`: `jsonutil.safe_float`)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = safe_float(v) if isinstance(v, float) else v
        return out

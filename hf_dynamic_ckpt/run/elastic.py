"""Elastic resume: the same command on another number of processes continues the same run.

A data-parallel step consumes a *global batch* of ``per_device x world_size x accumulation`` samples: the
micro-batches of the prepared sampler's order, dealt to the ranks in turn. Trainer's sampler and Accelerate's
seedable / generator-driven samplers draw that order independently of the world size, so a run resumed on another
number of processes sees the same samples in every optimizer step, and therefore continues the same run (up to
float reduction order), as long as the global batch is the same. `plan_batch` keeps it: on a resume on another
world size whose global batch would differ it returns the accumulation that restores it
(``runtime.keep_global_batch``, the default), or raises `GlobalBatchError` naming the settings that would; with
``keep_global_batch: false`` it accepts the new global batch and says what changes. On the same world size the
run's settings are used as given.

What cannot be kept is said only where it differs: ranks draw their own dropout masks, and a step's samples are
split over other ranks and micro-batches, so a model that draws random numbers in its forward or backward sees
other masks after a change of world size (`StepRandomness` records whether it does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GlobalBatchError

KEY_BATCH = "batch"
"""Key of the batch geometry in a checkpoint's data position (sampler state)."""
KEY_DRAWS_RANDOM = "draws_random"
"""Key of `StepRandomness.seen` in a checkpoint's data position: a step drew random numbers on this rank."""


@dataclass(frozen=True)
class BatchGeometry:
    """Samples per optimizer step: ``per_device x world_size x accumulation``."""

    per_device: int
    world_size: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.per_device * self.world_size * self.accumulation

    def describe(self) -> str:
        return (f"{self.world_size} process(es) x {self.per_device} per device x {self.accumulation} accumulation "
                f"= {self.global_batch}")

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> BatchGeometry | None:
        """The geometry a checkpoint recorded, or `None` (saved without one, or not three positive integers)."""
        if not isinstance(value, dict):
            return None
        fields = [value.get(f.name) for f in dataclasses.fields(cls)]
        ints = [v for v in fields if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        return cls(*ints) if len(ints) == len(fields) else None


@dataclass(frozen=True)
class BatchPlan:
    """What a resume does with the batch: the accumulation to train with, and the line that says so."""

    accumulation: int
    note: str | None = None  # INFO: the world size changed, the global batch is kept
    warning: str | None = None  # WARNING: the global batch changes (keep_global_batch=false)

    @property
    def keeps_global_batch(self) -> bool:
        return self.warning is None


def plan_batch(saved: BatchGeometry, now: BatchGeometry, *, keep: bool = True, step: int | None = None,
               position_in: str = "steps") -> BatchPlan:
    """The accumulation a run resumed with geometry `now` trains with, from the `saved` one.

    On the world size that saved the checkpoint, `now` as given: a per-device batch or accumulation changed there
    is the user's choice (Trainer resumes with the new batch size, transformers#43708). On another world size, the
    saved global batch, unless `keep` is off.

    Args:
        saved (`BatchGeometry`): what the checkpoint recorded.
        now (`BatchGeometry`): the resumed run's settings as given (its per-device batch, world size, accumulation).
        keep (`bool`, *optional*, defaults to `True`): keep the saved global batch by choosing the accumulation
            (``runtime.keep_global_batch``); `False`: train with `now` as given.
        step (`int`, *optional*): the checkpoint's step, for the messages.
        position_in (`str`, *optional*, defaults to `"steps"`): how the resumed run keeps its data position when it
            accepts another global batch: in optimizer steps (Trainer) or in `"samples"` of its order (Accelerate
            loops), for the warning.

    Raises:
        `GlobalBatchError`: `keep` and no accumulation gives the saved global batch with `now`'s per-device batch
            and world size; the message names the settings that would.
    """
    at = f"step {step}" if step is not None else "the checkpoint"
    if now.world_size == saved.world_size:  # the run's own settings, as Trainer resumes them
        return BatchPlan(now.accumulation)
    if now.global_batch == saved.global_batch:
        return BatchPlan(now.accumulation, note=f"{at} was saved by {saved.describe()} and is resumed by "
                                                f"{now.describe()}: the same samples per optimizer step")
    if not keep:
        if position_in == "samples":
            stays = "the step count and the learning-rate schedule's position stay in optimizer steps, the data " \
                "position in samples of its order"
        else:
            stays = "the step count, the learning-rate schedule's position, max_steps and the data position stay in " \
                "optimizer steps"
            if step is not None:
                stays += f"; the data continues at sample {step * now.global_batch} of its order (the interrupted " \
                    f"run had read {step * saved.global_batch})"
        return BatchPlan(now.accumulation, warning=(
            f"{at} was saved with a global batch of {saved.describe()} and is resumed with {now.describe()} "
            "(runtime.keep_global_batch=false): every optimizer step from here on averages "
            f"{now.global_batch} samples instead of {saved.global_batch}; {stays}"))
    per_rank_step = now.per_device * now.world_size
    if saved.global_batch % per_rank_step:
        raise GlobalBatchError(
            f"{at} was saved with a global batch of {saved.describe()}; with {now.world_size} process(es) x "
            f"{now.per_device} per device no gradient accumulation gives {saved.global_batch} samples per step. "
            f"{_ways(saved.global_batch, now.world_size)}; or accept another global batch with "
            "runtime.keep_global_batch=false.")
    accumulation = saved.global_batch // per_rank_step
    kept = dataclasses.replace(now, accumulation=accumulation)
    changed = f"; gradient_accumulation_steps {now.accumulation} -> {accumulation}" \
        if accumulation != now.accumulation else ""
    return BatchPlan(accumulation, note=f"{at} was saved by {saved.describe()} and is resumed by {kept.describe()}"
                                        f"{changed}: the same samples per optimizer step")


def _ways(global_batch: int, world_size: int) -> str:
    """The per-device batch x accumulation pairs that give `global_batch` on `world_size` processes."""
    if global_batch % world_size:
        sizes = [w for w in range(1, global_batch + 1) if global_batch % w == 0]
        return (f"{global_batch} samples do not divide over {world_size} process(es): resume on a process count "
                f"that divides it ({', '.join(map(str, sizes[:8]))}{', ...' if len(sizes) > 8 else ''})")
    per_rank = global_batch // world_size
    pairs = [f"{b} x {per_rank // b}" for b in range(per_rank, 0, -1) if per_rank % b == 0][:6]
    return (f"Keep it with per_device_train_batch_size x gradient_accumulation_steps = {per_rank}, e.g. "
            f"{', '.join(pairs)}")


class StepRandomness:
    """Whether the forward and backward of a step draw random numbers on this rank (dropout, random masking inside
    the model): compares the CPU (and the current CUDA device's) generator state at `begin` and at `end`. Sticky;
    once seen, nothing more is compared."""

    def __init__(self) -> None:
        self.seen = False
        self._at_begin: list[torch.Tensor] | None = None

    @staticmethod
    def _states() -> list[torch.Tensor]:
        states = [torch.get_rng_state()]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states.append(torch.cuda.get_rng_state())
        return states

    def begin(self) -> None:
        if not self.seen:
            self._at_begin = self._states()

    def end(self) -> None:
        before, self._at_begin = self._at_begin, None
        if before is not None and not self.seen:
            after = self._states()
            self.seen = len(before) != len(after) or not all(torch.equal(a, b) for a, b in zip(before, after))


def world_change_note(saved_world: int, world: int, draws_random: bool | None) -> str | None:
    """What a change of world size does not keep, or `None` when nothing differs (the same world size, or a model
    whose steps draw no random numbers)."""
    if saved_world == world or draws_random is False:
        return None
    why = "its steps draw random numbers (dropout)" if draws_random else \
        "the checkpoint does not say whether its steps draw random numbers"
    return (f"saved by {saved_world} process(es), resumed by {world}, and {why}: each rank draws its own masks, so "
            "the masks of the resumed run differ from the interrupted one's (the samples of each step do not)")


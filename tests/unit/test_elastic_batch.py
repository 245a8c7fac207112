"""The batch a resume on another number of processes trains with (`integrations.position`): kept, refused, or changed on
request, with the exact lines a user reads; and what a change of world size says about random streams."""

from __future__ import annotations

import pytest
import torch

from hf_dynamic_ckpt.errors import ConfigError, GlobalBatchError
from hf_dynamic_ckpt.integrations.position import (
    BatchGeometry,
    StepRandomness,
    plan_batch,
    world_change_note,
)

TWO_BY_TWO = BatchGeometry(per_device=4, world_size=2, accumulation=2)  # 16 samples per step


def test_the_same_settings_change_nothing_and_say_nothing() -> None:
    plan = plan_batch(TWO_BY_TWO, TWO_BY_TWO, step=6)
    assert (plan.accumulation, plan.note, plan.warning) == (2, None, None)


def test_on_the_same_world_size_the_settings_given_are_used() -> None:
    # Trainer resumes with a changed per-device batch as given (transformers#43708): the user's choice, not refused.
    for now in (BatchGeometry(3, 2, 2), BatchGeometry(4, 2, 1), BatchGeometry(8, 2, 2)):
        for keep in (True, False):
            plan = plan_batch(TWO_BY_TWO, now, keep=keep, step=6)
            assert (plan.accumulation, plan.note, plan.warning) == (now.accumulation, None, None)


def test_fewer_processes_with_the_same_command_raise_the_accumulation() -> None:
    plan = plan_batch(TWO_BY_TWO, BatchGeometry(4, 1, 2), step=6)
    assert plan.accumulation == 4 and plan.warning is None
    assert plan.note == ("step 6 was saved by 2 process(es) x 4 per device x 2 accumulation = 16 and is resumed by "
                         "1 process(es) x 4 per device x 4 accumulation = 16; gradient_accumulation_steps 2 -> 4: the "
                         "same samples per optimizer step")


def test_more_processes_lower_it_and_settings_that_already_fit_are_kept() -> None:
    assert plan_batch(BatchGeometry(4, 1, 4), BatchGeometry(4, 2, 4)).accumulation == 2
    assert plan_batch(BatchGeometry(2, 4, 1), BatchGeometry(2, 2, 1)).accumulation == 2  # 4 -> 2 processes
    fits = plan_batch(TWO_BY_TWO, BatchGeometry(4, 1, 4), step=6)  # the user gave the accumulation that keeps it
    assert fits.accumulation == 4 and fits.note == (
        "step 6 was saved by 2 process(es) x 4 per device x 2 accumulation = 16 and is resumed by 1 process(es) x 4 "
        "per device x 4 accumulation = 16: the same samples per optimizer step")


def test_a_global_batch_no_accumulation_gives_is_refused_with_the_settings_that_would() -> None:
    with pytest.raises(GlobalBatchError) as e:
        plan_batch(TWO_BY_TWO, BatchGeometry(3, 1, 2), step=6)
    assert str(e.value) == (
        "step 6 was saved with a global batch of 2 process(es) x 4 per device x 2 accumulation = 16; with 1 "
        "process(es) x 3 per device no gradient accumulation gives 16 samples per step. Keep it with "
        "per_device_train_batch_size x gradient_accumulation_steps = 16, e.g. 16 x 1, 8 x 2, 4 x 4, 2 x 8, 1 x 16; "
        "or accept another global batch with runtime.keep_global_batch=false.")
    assert isinstance(e.value, ConfigError)
    with pytest.raises(GlobalBatchError, match=r"16 samples do not divide over 3 process\(es\): resume on a process "
                                               r"count that divides it \(1, 2, 4, 8, 16\)"):
        plan_batch(TWO_BY_TWO, BatchGeometry(4, 3, 1), step=6)


def test_accepting_another_global_batch_keeps_the_settings_and_warns_what_changes() -> None:
    plan = plan_batch(TWO_BY_TWO, BatchGeometry(4, 1, 2), keep=False, step=6)
    assert plan.accumulation == 2 and plan.warning is not None and plan.note is None
    assert plan.warning == (
        "step 6 was saved with a global batch of 2 process(es) x 4 per device x 2 accumulation = 16 and is resumed "
        "with 1 process(es) x 4 per device x 2 accumulation = 8 (runtime.keep_global_batch=false): every optimizer "
        "step from here on averages 8 samples instead of 16; the step count, the learning-rate schedule's position, "
        "max_steps and the data position stay in optimizer steps; the data continues at sample 48 of its order (the "
        "interrupted run had read 96)")


def test_an_accelerate_loop_that_accepts_another_global_batch_is_told_its_position_stays_in_samples() -> None:
    plan = plan_batch(TWO_BY_TWO, BatchGeometry(4, 1, 2), keep=False, step=6, position_in="samples")
    assert plan.accumulation == 2 and plan.warning is not None
    assert plan.warning.endswith("every optimizer step from here on averages 8 samples instead of 16; the step count "
                                 "and the learning-rate schedule's position stay in optimizer steps, the data "
                                 "position in samples of its order")


def test_a_stored_geometry_reads_back_and_anything_else_is_none() -> None:
    assert BatchGeometry.from_json(TWO_BY_TWO.to_json()) == TWO_BY_TWO
    for bad in (None, [], {"per_device": 4, "world_size": 2}, {"per_device": 4, "world_size": 2, "accumulation": 0},
                {"per_device": True, "world_size": 2, "accumulation": 2}, {**TWO_BY_TWO.to_json(), "world_size": "2"}):
        assert BatchGeometry.from_json(bad) is None, bad


def test_step_randomness_sees_dropout_and_nothing_else() -> None:
    quiet, noisy = StepRandomness(), StepRandomness()
    x = torch.ones(4, 8)
    quiet.begin()
    torch.nn.functional.linear(x, torch.ones(2, 8))
    quiet.end()
    noisy.begin()
    torch.nn.functional.dropout(x, 0.1, training=True)
    noisy.end()
    assert not quiet.seen and noisy.seen
    noisy.begin()  # sticky: nothing compared once seen
    noisy.end()
    assert noisy.seen


def test_a_change_of_world_size_warns_about_masks_only_where_a_step_draws_them() -> None:
    assert world_change_note(2, 2, True) is None
    assert world_change_note(2, 1, False) is None
    assert world_change_note(2, 1, True) == (
        "saved by 2 process(es), resumed by 1, and its steps draw random numbers (dropout): each rank draws its own "
        "masks, so the masks of the resumed run differ from the interrupted one's (the samples of each step do not)")
    assert "does not say whether its steps draw random numbers" in str(world_change_note(1, 2, None))

"""`state.zero.ZeroState` on a stand-in for DeepSpeed's ZeRO optimizer (the attributes it reads, as DeepSpeed 0.19.8
has them): what a capture taken inside the engine's step stores, and what a load of a checkpoint saved before the
first update leaves. The runs under DeepSpeed itself are in tests/distributed/test_deepspeed*.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_dynamic_ckpt.errors import ConfigError
from hf_dynamic_ckpt.state.zero import ZeroState, check_zero

SCALER = {"cur_scale": 2.0, "cur_iter": 5, "last_overflow_iter": -1, "cur_hysteresis": 2}


def stand_in() -> tuple[torch.nn.Linear, SimpleNamespace, torch.optim.AdamW]:
    """A ZeRO-1 optimizer of a Linear: two groups (decay / no decay), one flat fp32 partition each."""
    model = torch.nn.Linear(2, 2)
    flats = [torch.zeros(4, requires_grad=True), torch.zeros(2, requires_grad=True)]
    base = torch.optim.AdamW([{"params": [flats[0]], "lr": 0.1}, {"params": [flats[1]], "lr": 0.2,
                                                                     "weight_decay": 0.0}])
    zero = SimpleNamespace(single_partition_of_fp32_groups=flats, bit16_groups=[[model.weight], [model.bias]],
                           optimizer=base, loss_scaler=SimpleNamespace(**SCALER), partition_gradients=False)
    return model, zero, base


def test_a_capture_inside_the_engines_step_stores_the_state_of_the_step_before() -> None:
    model, zero, base = stand_in()
    state = ZeroState(model, zero, rank=0)
    # Inside DeepSpeed's step: the loss scale is updated already, and the base optimizer's group list is the one
    # group being stepped.
    groups = base.param_groups
    zero.loss_scaler.cur_scale, zero.loss_scaler.cur_iter = 4.0, 6
    base.param_groups = [groups[0]]
    saved = state.optimizer_state_dict()
    assert [(g["params"], g["lr"], g["weight_decay"]) for g in saved["param_groups"]] == [
        (["weight"], 0.1, 0.01), (["bias"], 0.2, 0.0)]
    assert saved["zero"]["loss_scaler"] == SCALER
    base.param_groups = groups
    state.note_boundary()  # the step has ended
    assert state.optimizer_state_dict()["zero"]["loss_scaler"] == {**SCALER, "cur_scale": 4.0, "cur_iter": 6}


def test_a_load_of_a_checkpoint_from_before_the_first_update_leaves_a_fresh_optimizer() -> None:
    # Saved before the optimizer's first step (a capture of step 0): no moments, no step count. The live optimizer
    # (which a rollback finds stepped) goes back to no state, as torch's AdamW has before its first step.
    model, zero, base = stand_in()
    state = ZeroState(model, zero, rank=0)
    for flat in zero.single_partition_of_fp32_groups:
        flat.grad = torch.ones_like(flat)
    base.step()
    assert len(base.state) == 2
    saved = {"param_groups": [{"params": ["weight"], "lr": 0.1, "step": None},
                              {"params": ["bias"], "lr": 0.05, "step": None}],
             "zero": {"loss_scaler": {**SCALER, "cur_scale": 8.0}}}
    state.load(lambda *args: None, saved, step=0, moments=set())
    assert len(base.state) == 0
    assert [g["lr"] for g in base.param_groups] == [0.1, 0.05] and zero.loss_scaler.cur_scale == 8.0
    assert state.optimizer_state_dict()["zero"]["loss_scaler"]["cur_scale"] == 8.0  # the loaded one is the boundary


def test_partial_optimizer_offload_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^hf_dynamic_ckpt does not support DeepSpeed ZeRO-3 with partial optimizer "
                                          r"offload \(offload_optimizer\.ratio=0\.5\): the state of the sub-groups"):
        check_zero(SimpleNamespace(offload_optimizer=True, partial_offload=0.5))
    check_zero(SimpleNamespace(offload_optimizer=True, partial_offload=1.0))  # all offloaded: read like memory


def test_a_scheduler_the_deepspeed_engine_steps_has_no_pace_to_keep() -> None:
    # Accelerate gives the loop a DeepSpeedSchedulerWrapper whose step() does nothing when the engine steps the
    # scheduler itself: an elastic resume must not make it step once per process.
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils.deepspeed import DeepSpeedSchedulerWrapper

    from hf_dynamic_ckpt.integrations.accelerate import natural_pace

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer)
    assert natural_pace(DeepSpeedSchedulerWrapper(scheduler, optimizer), 2) is None
    assert natural_pace(AcceleratedScheduler(scheduler, optimizer), 2) == 2


def test_the_gradient_squares_per_bucket_come_from_the_partitions_stepped_at_every_step() -> None:
    from hf_dynamic_ckpt.state.zero import ZeroGradSquares

    model, zero, base = stand_in()
    for p, at in ((model.weight, 0), (model.bias, 0)):  # each parameter whole in its group's partition
        p._hp_mapping = SimpleNamespace(lp_fragment_address=SimpleNamespace(start=0, numel=p.numel()),
                                        hp_fragment_address=SimpleNamespace(start=at, numel=p.numel()))
    squares = ZeroGradSquares(ZeroState(model, zero, rank=0), lambda name: 0 if name == "weight" else 1, 2)
    assert squares.pop() is None
    flats = zero.single_partition_of_fp32_groups
    for grads in ((torch.tensor([1.0, 2.0, 0.0, 2.0]), torch.tensor([3.0, 4.0])),
                  (torch.tensor([0.5, 0.5, 0.5, 0.5]), torch.tensor([0.0, 2.0]))):
        for flat, grad in zip(flats, grads):
            flat.grad = grad.clone()  # a new gradient tensor each step, as the engine hands them over
        base.step()
        assert squares.pop() == pytest.approx([float(grads[0].square().sum()), float(grads[1].square().sum())])
    squares.remove()
    base.step()
    assert squares.pop() is None

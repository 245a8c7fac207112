"""`sharded.ZeroState` on a stand-in for DeepSpeed's ZeRO optimizer (the attributes it reads, as DeepSpeed 0.19.8
has them): what a save stores, what a capture taken inside the engine's step stores, and what a load puts back into
the partitions, at the same and at another number of ranks. The runs under DeepSpeed itself are in
tests/distributed/test_deepspeed*.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hf_dynamic_ckpt.constants import KEY_RANK_CHUNKS, SHARDED_FORMAT
from hf_dynamic_ckpt.errors import ConfigError
from hf_dynamic_ckpt.sharded import ZeroGradSquares, ZeroState
from hf_dynamic_ckpt.store import CheckpointState
from hf_dynamic_ckpt.store.shard_files import write_shards

SCALER = {"cur_scale": 2.0, "cur_iter": 5, "last_overflow_iter": -1, "cur_hysteresis": 2}
# Per world size and rank, per group (weight: 4 elements, bias: 2): (start in the parameter, elements, where in the
# rank's flat partition, the partition's size). On 2 ranks the weight's partition is 3: rank 1 holds 1 element + 2
# of padding.
LAYOUTS = {1: [[(0, 4, 0, 4), (0, 2, 0, 2)]],
           2: [[(0, 3, 0, 3), (0, 1, 0, 1)], [(3, 1, 0, 3), (1, 1, 0, 1)]]}
WEIGHTS = {"weight": torch.tensor([1.0, 2.0, 3.0, 4.0]), "bias": torch.tensor([5.0, 6.0])}  # the model's (bf16 in life)
TRUTH = {k: {"master": v + 0.25, "exp_avg": -v, "exp_avg_sq": v * v} for k, v in WEIGHTS.items()}


def stand_in(world: int = 1, rank: int = 0) -> tuple[torch.nn.Linear, SimpleNamespace, torch.optim.AdamW]:
    """A ZeRO-1 optimizer of a Linear on `rank` of `world`: two groups (decay / no decay), one flat fp32 partition
    each, every parameter's fragment mapped as DeepSpeed's `_hp_mapping` maps it."""
    model = torch.nn.Linear(2, 2)
    flats = []
    for p, (start, numel, at, size) in zip((model.weight, model.bias), LAYOUTS[world][rank]):
        p._hp_mapping = SimpleNamespace(lp_fragment_address=SimpleNamespace(start=start, numel=numel),
                                        hp_fragment_address=SimpleNamespace(start=at, numel=numel))
        flats.append(torch.zeros(size, requires_grad=True))
    base = torch.optim.AdamW([{"params": [flats[0]], "lr": 0.1}, {"params": [flats[1]], "lr": 0.2,
                                                                     "weight_decay": 0.0}])
    zero = SimpleNamespace(single_partition_of_fp32_groups=flats, bit16_groups=[[model.weight], [model.bias]],
                           optimizer=base, loss_scaler=SimpleNamespace(**SCALER), partition_gradients=False)
    return model, zero, base


def trained(world: int, rank: int) -> tuple[torch.nn.Linear, SimpleNamespace, torch.optim.AdamW]:
    """`stand_in` holding `WEIGHTS` and this rank's fragments of `TRUTH`, after 3 steps."""
    model, zero, base = stand_in(world, rank)
    flats = zero.single_partition_of_fp32_groups
    with torch.no_grad():
        for (name, p), flat, (start, numel, at, _) in zip(model.named_parameters(), flats, LAYOUTS[world][rank]):
            p.copy_(WEIGHTS[name].reshape(p.shape))
            state = base.state[flat]
            state["step"] = torch.tensor(3.0)
            for key, full in TRUTH[name].items():
                target = flat if key == "master" else state.setdefault(key, torch.zeros_like(flat))
                target.narrow(0, at, numel).copy_(full[start:start + numel])
    return model, zero, base


def save(tmp: Path, ranks: list[tuple[torch.nn.Linear, SimpleNamespace, Any]]) -> SimpleNamespace:
    """Every rank's save of its `ZeroState` through the shard files; the loaded checkpoint a resume gets."""
    tables, optimizer = {}, None
    for rank, (model, zero, _) in enumerate(ranks):
        state = ZeroState(model, zero, rank=rank)
        snapshot = CheckpointState(step=6, weights=state.weights(), optimizer=state.optimizer_state_dict(),
                                   extra={KEY_RANK_CHUNKS: state.chunks()})
        rest, _, tables[str(rank)] = write_shards(snapshot, tmp, rank=rank)
        optimizer = optimizer or rest.optimizer  # rank 0's param_groups and loss scale
    manifest = {"world_size": len(ranks),
                "extra": {"sharded": {"format": SHARDED_FORMAT, "world_size": len(ranks), "ranks": tables}}}
    return SimpleNamespace(info=SimpleNamespace(step=6, path=str(tmp)), manifest=manifest, optimizer=optimizer,
                           weights={})


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


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_into_fresh_partitions_of_another_number_of_ranks(tmp_path: Path, before: int,
                                                                                after: int) -> None:
    loaded = save(tmp_path, [trained(before, r) for r in range(before)])
    assert loaded.manifest["extra"]["sharded"]["ranks"]["0"]["optimizer"]["state.weight.master"]["tensor_shape"] == \
        [2, 2]
    for rank in range(after):
        model, zero, base = stand_in(after, rank)  # a new run: the optimizer has made no state yet
        base.param_groups[1]["lr"] = 0.5
        ZeroState(model, zero, rank=rank).load(loaded)
        assert loaded.weights is None  # read into the model: nothing left to apply
        for (name, p), flat, (start, numel, at, size) in zip(model.named_parameters(),
                                                             zero.single_partition_of_fp32_groups,
                                                             LAYOUTS[after][rank]):
            assert torch.equal(p.detach().reshape(-1), WEIGHTS[name])  # stages 1 and 2: every rank holds it whole
            state = base.state[flat]
            assert float(state["step"]) == 3.0
            for key, full in TRUTH[name].items():
                live = flat.detach() if key == "master" else state[key]
                assert torch.equal(live[at:at + numel], full[start:start + numel]), (rank, name, key)
                if key != "master":  # the moments made for the load: zero where no fragment lies (padding)
                    assert torch.equal(live[at + numel:], torch.zeros(size - at - numel))
        assert [g["lr"] for g in base.param_groups] == [0.1, 0.2]


def test_a_load_without_the_optimizer_tier_takes_the_master_weights_from_the_weights(tmp_path: Path) -> None:
    loaded = save(tmp_path, [trained(1, 0)])
    loaded.optimizer = None  # the optimizer tier was lost
    model, zero, base = stand_in()
    ZeroState(model, zero, rank=0).load(loaded)
    assert [flat.detach().tolist() for flat in zero.single_partition_of_fp32_groups] == [[1.0, 2.0, 3.0, 4.0],
                                                                                          [5.0, 6.0]]
    assert len(base.state) == 0  # the moments stay as they were


def test_a_load_of_a_checkpoint_from_before_the_first_update_leaves_a_fresh_optimizer(tmp_path: Path) -> None:
    # Saved before the optimizer's first step (a capture of step 0): no moments, no step count. The live optimizer
    # (which a rollback finds stepped) goes back to no state, as torch's AdamW has before its first step.
    model, zero, base = stand_in()
    base.param_groups[1]["lr"], zero.loss_scaler.cur_scale = 0.05, 8.0
    loaded = save(tmp_path, [(model, zero, base)])
    assert loaded.optimizer["param_groups"][0]["step"] is None
    model, zero, base = stand_in()
    for flat in zero.single_partition_of_fp32_groups:
        flat.grad = torch.ones_like(flat)
    base.step()
    assert len(base.state) == 2
    state = ZeroState(model, zero, rank=0)
    state.load(loaded)
    assert len(base.state) == 0
    assert [g["lr"] for g in base.param_groups] == [0.1, 0.05] and zero.loss_scaler.cur_scale == 8.0
    assert state.optimizer_state_dict()["zero"]["loss_scaler"]["cur_scale"] == 8.0  # the loaded one is the boundary


def test_nvme_and_partial_optimizer_offload_are_refused() -> None:
    model, zero, _ = stand_in()
    zero.offload_optimizer, zero.partial_offload = True, 0.5
    with pytest.raises(ConfigError, match=r"^hf_dynamic_ckpt does not support DeepSpeed ZeRO-3 with partial optimizer "
                                          r"offload \(offload_optimizer\.ratio=0\.5\): the state of the sub-groups"):
        ZeroState(model, zero, rank=0)
    zero.partial_offload = 1.0
    ZeroState(model, zero, rank=0)  # all offloaded: read like memory
    zero.swap_optimizer = True
    with pytest.raises(ConfigError, match=r"^hf_dynamic_ckpt does not support DeepSpeed ZeRO with NVMe offload"):
        ZeroState(model, zero, rank=0)


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
    model, zero, base = stand_in()
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

"""Overlapped snapshots: the parameters and optimizer state are copied beside the next step.

The copy is slowed down on purpose (`slow_copy`: `HF_DYNAMIC_CKPT_FAULT="overlap_copy:sleep=MS"`), so that each test
can see where the training thread is while it runs: back from the save before the copy finished, through the next
forward and backward, and held at the next optimizer step (or a rollback, a second save, ...) until it is done.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_dynamic_ckpt import SmartCkptConfig, Tier
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.errors import SaveError
from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator, restore_live
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest

DELAY_S = 0.5


@pytest.fixture
def slow_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each deferred copy sleeps `DELAY_S` before it copies."""
    monkeypatch.setenv("HF_DYNAMIC_CKPT_FAULT", f"overlap_copy:sleep={DELAY_S * 1e3:.0f}")


class Net(nn.Module):
    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.norm(self.lin(x)))).pow(2).mean()


def _setup(seed: int = 0, batchnorm: bool = False) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(batchnorm)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _backward(model: Net) -> float:
    loss = model(torch.randn(4, 8))
    loss.backward()
    return loss.item()


def _request(step: int) -> SaveRequest:
    return SaveRequest(step=step, epoch=0.0, reason="test")


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _started(store: CheckpointStore, **kw: object) -> SaveEngine:
    engine = SaveEngine(store, **kw)  # type: ignore[arg-type]
    assert engine.start(wait_s=120)  # until then a save is written synchronously, with no copy to overlap
    return engine


def test_the_copy_runs_beside_the_next_forward_and_backward_and_the_optimizer_step_waits(tmp_path: Path,
                                                                                         slow_copy: None):
    model, opt = _setup()
    _backward(model)
    opt.step()
    opt.zero_grad()
    at_save = _state(model)
    moments = {k: v.clone() for k, v in opt.state[model.lin.weight].items()}
    store = CheckpointStore(tmp_path / "s")
    with _started(store, overlap=True) as engine:
        start = time.perf_counter()
        handle = engine.save(StateSources(weights=model.state_dict, optimizer=opt), _request(1))
        returned = time.perf_counter()
        assert handle.deferred is not None and handle.deferred.nbytes > 0
        assert returned - start < DELAY_S / 2 and handle.blocking_ms < DELAY_S * 1e3 / 2
        _backward(model)  # the next step's forward and backward run while the copy does
        assert not handle.deferred.done(), "the copy must still be running beside the step"
        opt.step()  # the step pre-hook holds it until the copy is done
        assert handle.deferred.done() and time.perf_counter() > returned + DELAY_S * 0.9
        assert handle.deferred.wait_ms is not None and handle.deferred.wait_ms > DELAY_S * 1e3 / 4
        assert not torch.equal(model.lin.weight, at_save["lin.weight"])  # the step did run, after the copy
        info = handle.wait()
    loaded = store.load(f"step:{info.step}")
    assert all(torch.equal(loaded.weights[k], v) for k, v in at_save.items())
    saved = loaded.optimizer["state"][0]
    assert all(torch.equal(saved[k], v) for k, v in moments.items())


def test_a_buffer_the_forward_updates_is_saved_as_it_was_at_the_save(tmp_path: Path, slow_copy: None):
    model, opt = _setup(batchnorm=True)
    _backward(model)
    opt.step()
    opt.zero_grad()
    at_save = _state(model)
    store = CheckpointStore(tmp_path / "s")
    with _started(store, overlap=True) as engine:
        handle = engine.save(StateSources(weights=model.state_dict, optimizer=opt), _request(1))
        _backward(model)  # updates running_mean / running_var / num_batches_tracked in place
        assert handle.deferred is not None and not handle.deferred.done()  # the parameters' copy still runs
        assert not torch.equal(model.norm.running_mean, at_save["norm.running_mean"])
        opt.step()
        handle.wait()
    loaded = store.load("step:1")
    for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked", "lin.weight"):
        assert torch.equal(loaded.weights[name], at_save[name]), name


def test_a_parameter_edited_before_the_copy_completed_fails_the_save_and_wait_snapshot_makes_it_safe(
        tmp_path: Path, slow_copy: None):
    model, opt = _setup()
    _backward(model)
    opt.step()
    opt.zero_grad()
    store = CheckpointStore(tmp_path / "s")
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    with _started(store, overlap=True) as engine:
        handle = engine.save(sources, _request(1))
        with torch.no_grad():
            model.out.weight.mul_(0.5)  # a callback editing weights between steps, without waiting
        with pytest.raises(SaveError, match="wait_snapshot"):
            handle.wait()
        assert [i.step for i in store.list()] == []  # nothing of the mixed state was committed

        at_save = _state(model)
        handle = engine.save(sources, _request(2))
        assert engine.wait_snapshot() > 0  # the documented way: wait, then edit
        with torch.no_grad():
            model.out.weight.mul_(0.5)
        handle.wait()
    assert torch.equal(store.load("step:2").weights["out.weight"], at_save["out.weight"])


def test_a_second_save_and_an_emergency_save_wait_for_the_copy(tmp_path: Path, slow_copy: None):
    model, opt = _setup()
    _backward(model)
    opt.step()
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    with _started(CheckpointStore(tmp_path / "s"), overlap=True) as engine:
        first = engine.save(sources, _request(1))
        second = engine.save(sources, _request(2))
        assert first.deferred is not None and first.deferred.done() and first.wait().step == 1
        assert second.blocking_ms > DELAY_S * 1e3 / 2  # it waited for the first copy
        engine.emergency_save(sources, _request(3), deadline_s=30.0)
        assert second.deferred is not None and second.deferred.done()
        assert second.wait().step == 2


def _train(steps: range, model: Net, opt: torch.optim.Optimizer, sched: object, ga: int, *,
           at_step: dict[int, object] | None = None, check_overlap: list[object] | None = None) -> list[float]:
    """`ga` micro-batches per optimizer step; `at_step[s]()` runs at the end of step `s` (a save)."""
    losses = []
    for step in steps:
        for micro in range(ga):
            losses.append(_backward(model))
            if check_overlap and micro == ga - 1:
                pending = check_overlap.pop()
                assert not pending.done(), "every micro-step of the next step runs beside the copy"  # type: ignore
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        opt.zero_grad()
        if at_step and step in at_step:
            at_step[step]()  # type: ignore[operator]
    return losses


@pytest.mark.parametrize("ga", [1, 2])
def test_a_resume_from_an_overlapped_save_is_bit_exact(tmp_path: Path, slow_copy: None, ga: int):
    def make(seed: int) -> tuple[Net, torch.optim.Optimizer, object]:
        model, opt = _setup(seed)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    model, opt, sched = make(0)
    reference = _train(range(1, 7), model, opt, sched, ga)
    final = _state(model)

    config = SmartCkptConfig(root=str(tmp_path / "store"), base_interval=1000, runtime={"overlap_snapshot": True})
    run = RunOrchestrator(config)
    model, opt, sched = make(0)
    run.attach(model, optimizer=opt, scheduler=sched)
    assert run.engine.start(wait_s=120)
    pending: list[object] = []

    def save() -> None:
        event = run.save_now(3, 0.0, blocking=False)
        assert event.handle is not None and event.handle.deferred is not None
        pending.append(event.handle.deferred)

    losses = _train(range(1, 7), model, opt, sched, ga, at_step={3: save}, check_overlap=pending)
    assert not pending  # the step after the save did run beside its copy
    run.close()
    assert losses == reference and all(torch.equal(v, final[k]) for k, v in _state(model).items())

    resumed_run = RunOrchestrator(config)
    model, opt, sched = make(1)  # other initial weights: everything must come from the checkpoint
    resumed_run.attach(model, optimizer=opt, scheduler=sched)
    loaded = resumed_run.resume("step:3")
    assert loaded is not None and loaded.info.step == 3
    restore_live(loaded, model=model, optimizer=opt, scheduler=sched, scaler=None, rng=True)
    resumed = _train(range(4, 7), model, opt, sched, ga)
    resumed_run.close()
    assert resumed == reference[3 * ga:]
    assert all(torch.equal(v, final[k]) for k, v in _state(model).items())


def test_a_rollback_that_lands_while_a_copy_runs_waits_for_it(tmp_path: Path, slow_copy: None):
    config = SmartCkptConfig(root=str(tmp_path / "store"), base_interval=1000, on_anomaly="rollback",
                             runtime={"overlap_snapshot": True})
    run = RunOrchestrator(config)
    model, opt = _setup()
    run.attach(model, optimizer=opt)
    assert run.engine.start(wait_s=120)
    for step in range(3):
        run.step_begin()
        _backward(model)
        run.pre_update(step, epoch=0.0)
        opt.step()
        opt.zero_grad()
        run.step_end(step + 1, 0.0, lr=1e-2)
    at_save = _state(model)
    handle = run.save_now(3, 0.0, blocking=False).handle
    assert handle is not None and handle.deferred is not None
    run.step_begin()
    (model(torch.randn(4, 8)) * float("nan")).backward()  # a non-finite update: confirmed at once
    decision = run.pre_update(3, epoch=0.0)
    assert decision.skip_update and run.rollback_due
    assert not handle.deferred.done()  # the rollback lands while the capture's copy runs
    with torch.no_grad():
        for p in model.parameters():
            p.grad = None
    done = run.rollback()
    assert done is not None and done.to_step == 3
    assert handle.deferred.done() and handle.deferred.error is None
    assert all(torch.equal(v, at_save[k]) for k, v in _state(model).items())
    run.close()


def test_auto_overlaps_only_large_cuda_states_and_never_without_an_optimizer_step_to_hold(tmp_path: Path):
    model, opt = _setup()
    _backward(model)
    opt.step()
    store = CheckpointStore(tmp_path / "s")
    with _started(store, overlap=None) as engine:  # auto: a LoRA-sized state is copied at the save, as before
        assert engine.save(StateSources(weights=model.state_dict, optimizer=opt), _request(1)).deferred is None
    large = nn.Linear(2048, 2048, bias=False)  # 16 MiB of weights + 32 MiB of moments, on the host
    large_opt = torch.optim.AdamW(large.parameters(), lr=1e-2)
    large(torch.randn(2, 2048)).sum().backward()
    large_opt.step()
    with _started(store, overlap=None) as engine:  # auto, host parameters of any size: copied at the save
        handle = engine.save(StateSources(weights=large.state_dict, optimizer=large_opt), _request(4))
        assert handle.deferred is None
    with _started(store, overlap=True) as engine:  # nothing holds the next update until the copy is done
        weights_only = SaveRequest(step=2, epoch=0.0, reason="test", tiers=frozenset({Tier.WEIGHTS, Tier.STATE}))
        assert engine.save(StateSources(weights=model.state_dict), weights_only).deferred is None
        handle = engine.save(StateSources(weights=model.state_dict, optimizer=opt), _request(3))
        assert handle.deferred is not None
    assert handle.done() and not opt._optimizer_step_pre_hooks  # close() waited and took its hooks off

"""SaveEngine.prepare: snapshot buffers allocated and pre-faulted ahead of the first save."""

from __future__ import annotations

import logging

import psutil
import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.engine.staging import Headroom
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(tmp_path / "ckpt")
    yield s
    s.close()


def _model(width: int = 64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt) -> None:
    model(torch.randn(2, model[0].in_features)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state_bytes(model, opt) -> tuple[int, int]:
    weights = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    optim = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    return weights, optim


def test_prepare_allocates_and_touches_the_buffers_before_the_first_save(store):
    weights = {f"w{i}": torch.randn(MiB // 4) for i in range(64)}  # 64 MiB in 64 tensors
    sources = StateSources(weights=lambda: weights)
    engine = SaveEngine(store)
    rss = psutil.Process().memory_info().rss
    assert engine.prepare(sources, {Tier.WEIGHTS}, wait=True) == 64 * MiB
    # Resident, not just reserved: every page was touched (an untouched torch.empty adds ~nothing).
    assert psutil.Process().memory_info().rss - rss >= 0.9 * 64 * MiB
    assert engine.buffer_bytes == 64 * MiB
    generation = engine._snapshotter.pool.generation
    handle = engine.save(sources, SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="first"))
    assert engine.last_plan.reason == "snapshot buffers already allocated"
    assert engine._snapshotter.pool.generation == generation and engine.buffer_bytes == 64 * MiB
    info = handle.wait(60)
    loaded = store.load(info).weights
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    engine.close()


def test_optimizer_buffers_are_prepared_right_after_its_first_step(store, caplog):
    model, opt = _model()

    class Wrapped:  # like accelerate's AcceleratedOptimizer: the hook goes on the inner optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def state_dict(self):
            return self.optimizer.state_dict()

    sources = StateSources(weights=model.state_dict, optimizer=Wrapped(opt))
    engine = SaveEngine(store)
    caplog.set_level(logging.DEBUG, logger="hf_dynamic_ckpt.engine.prepare")
    weight_bytes, _ = _state_bytes(model, opt)
    assert engine.prepare(sources, wait=True) == weight_bytes  # no optimizer state before its first step
    assert engine.buffer_bytes == weight_bytes and len(opt._optimizer_step_post_hooks) == 1
    _step(model, opt)  # the hook prepares the optimizer's buffers now
    assert len(opt._optimizer_step_post_hooks) == 0
    _, optim_bytes = _state_bytes(model, opt)
    assert f"preparing {optim_bytes / MiB:.1f} MiB of snapshot buffers" in caplog.text
    _step(model, opt)
    handle = engine.save(sources, SaveRequest(step=2, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="a"))
    assert engine.last_plan.reason == "snapshot buffers already allocated"
    assert engine.buffer_bytes == weight_bytes + optim_bytes
    loaded = store.load(handle.wait(60))
    assert all(torch.equal(loaded.weights[k], v) for k, v in model.state_dict().items())
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg_sq"], opt.state[model[0].weight]["exp_avg_sq"])
    engine.close()


def test_prepare_stays_within_the_memory_headroom(store):
    model, opt = _model(width=256)
    _step(model, opt)
    tight = Headroom(total_bytes=100 * MiB, available_bytes=10 * MiB, source="cgroup")  # 0.8 MiB > 10 - 15
    engine = SaveEngine(store, headroom=lambda: tight)
    assert engine.prepare(StateSources(weights=model.state_dict, optimizer=opt), wait=True) == 0
    assert engine.buffer_bytes == 0 and engine.last_plan.mode == "streaming"
    engine.close()


def test_prepare_holds_nothing_in_sync_mode(store):
    model, opt = _model()
    _step(model, opt)
    with SaveEngine(store, mode="sync") as engine:
        assert engine.prepare(StateSources(weights=model.state_dict, optimizer=opt), wait=True) == 0
        assert engine.buffer_bytes == 0


def test_prepared_shared_buffers_reach_the_writer_process(store):
    model, opt = _model()
    _step(model, opt)
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    engine = SaveEngine(store, mode="process")
    try:
        weight_bytes, optim_bytes = _state_bytes(model, opt)
        assert engine.prepare(sources, wait=True) == weight_bytes + optim_bytes
        assert all(r.is_shared() for layout in engine._snapshotter.pool.layouts.values()
                   for r in layout.regions.values())
        assert engine.wait_writer_ready(120)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        handle = engine.save(sources, SaveRequest(step=1, tiers=ALL_TIERS, reason="a"), rng={"s": 1})
        _step(model, opt)  # right after the snapshot
        info = handle.wait(120)
        assert handle.writer == "process" and engine.last_plan.reason == "snapshot buffers already allocated"
    finally:
        engine.close()
    loaded = store.load(info).weights
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_closing_the_engine_removes_the_first_step_hook(store):
    model, opt = _model()
    engine = SaveEngine(store)
    engine.prepare(StateSources(weights=model.state_dict, optimizer=opt), wait=True)
    assert len(opt._optimizer_step_post_hooks) == 1
    engine.close()
    assert len(opt._optimizer_step_post_hooks) == 0
    _step(model, opt)  # training goes on without the engine
    assert engine.buffer_bytes == 0

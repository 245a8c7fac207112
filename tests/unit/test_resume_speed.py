"""What a resume does not pay on its way to the first step.

- the save engine and its writer process start after the resumed run's first step (prepare), not with the run;
- snapshot buffers: shared memory reserved without holding the GIL, allocated at the training
  thread's priority (only the page touching runs niced), a second preparation never waits for
  a running one, and the optimizer's buffers are prepared as soon as a resume loads its state.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_engine_prepare import _model, _step
from test_orchestrator import Net, make, train_step

from hf_dynamic_ckpt import SmartCkptConfig
from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.engine.buffers import Layout, new_shared_storage
from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest

MiB = 1 << 20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread nice values are a Linux feature")


@pytest.fixture
def store(tmp_path: Path):
    s = CheckpointStore(tmp_path / "ckpt")
    yield s
    s.close()


def _trained_store(tmp_path: Path, steps: tuple[int, ...] = (2,)) -> dict[int, dict]:
    """A store with a checkpoint at each of `steps` (the optimizer state of each, as saved)."""
    ck, model, opt, sched = make(tmp_path)
    saved = {}
    for step in range(max(steps)):
        train_step(ck, model, opt, sched, step)
        if step + 1 in steps:
            ck.save_now(step + 1, 0.0, reason="manual")
            saved[step + 1] = {"exp_avg": opt.state[model.lin.weight]["exp_avg"].clone()}
    ck.close()
    return saved


# ---------------------------------------------------------------------- writer process: lazily


def test_the_engine_and_writer_process_start_after_the_resume_and_its_first_step(tmp_path: Path) -> None:
    _trained_store(tmp_path)
    ck = RunOrchestrator(SmartCkptConfig(root=str(tmp_path / "store"), base_interval=1000, engine="process"))
    try:
        assert not ck.saver.started  # not at creation
        loaded = ck.resume("step:2", background_optimizer=True)
        assert loaded is not None and not ck.saver.started  # nor while L1 is read
        torch.manual_seed(1)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        ck.attach(model, optimizer=opt, scheduler=sched)
        assert not ck.saver.started  # the read is still to be collected
        ck.complete_resume(loaded)
        assert not ck.saver.started  # the resume only read: the first step runs alone
        train_step(ck, model, opt, sched, 2)
        assert ck.saver.started and ck.engine.mode == "process"
        writer = ck.engine._dispatch.writer
        assert type(writer).__name__ == "ProcessWriter" and writer._proc.is_alive()  # started by prepare
    finally:
        ck.close()


# ---------------------------------------------------------------------- snapshot buffers


def test_shared_buffers_are_reserved_without_torchs_gil_holding_allocator(store, monkeypatch) -> None:
    # torch.UntypedStorage._new_shared fills the pages (posix_fallocate) while it holds the GIL.
    def refuse(nbytes):  # type: ignore[no-untyped-def]
        raise AssertionError("_new_shared holds the GIL while it reserves the pages")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", refuse)
    layout = Layout((("a", (1024, 256), torch.float32), ("b", (7,), torch.int64)), shared=True, pinned=False)
    assert all(r.is_shared() and not r.any() for r in layout.regions.values())
    storage = new_shared_storage(3 * MiB)
    assert storage is not None and storage.is_shared() and storage.nbytes() == 3 * MiB
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"hf-dynamic-ckpt-{os.getpid()}-")]  # unlinked
    # The writer process maps them (file descriptors) and writes what the snapshot put there.
    model, opt = _model()
    _step(model, opt)
    engine = SaveEngine(store, mode="process")
    try:
        sources = StateSources(weights=model.state_dict, optimizer=opt)
        engine.prepare(sources, wait=True)
        assert engine.wait_writer_ready(120)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        handle = engine.save(sources, SaveRequest(step=1, tiers=ALL_TIERS, reason="a"), rng={"s": 1})
        info = handle.wait(120)
        assert handle.writer == "process" and engine.last_plan.reason == "snapshot buffers already allocated"
    finally:
        engine.close()
    loaded = store.load(info).weights
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_new_shared_storage_falls_back_where_it_cannot_reserve(tmp_path: Path) -> None:
    assert new_shared_storage(MiB, directory=str(tmp_path / "missing")) is None
    assert new_shared_storage(0) is None


@linux_only
def test_buffers_are_allocated_at_training_priority_and_touched_niced(store, monkeypatch) -> None:
    # A niced thread holding the GIL (allocation, views) made the training thread wait for it.
    seen: dict[str, int] = {}
    real_init, real_prefault = Layout.__init__, Layout.prefault

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.setdefault("allocate", os.getpriority(os.PRIO_PROCESS, 0))  # this thread's nice value
        real_init(self, *args, **kwargs)

    def prefault(self):  # type: ignore[no-untyped-def]
        seen.setdefault("touch", os.getpriority(os.PRIO_PROCESS, 0))
        real_prefault(self)

    monkeypatch.setattr(Layout, "__init__", init)
    monkeypatch.setattr(Layout, "prefault", prefault)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    model, _opt = _model()
    with SaveEngine(store, mode="thread", writer_nice=3) as engine:
        assert engine.prepare(StateSources(weights=model.state_dict), {Tier.WEIGHTS}, wait=True) > 0
    assert seen == {"allocate": base, "touch": min(19, base + 3)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == base


def test_a_second_preparation_does_not_wait_for_one_still_running(store, monkeypatch) -> None:
    gate = threading.Event()
    timer = threading.Timer(60, gate.set)  # only if the second prepare blocks: the test then fails, not hangs
    timer.start()
    real_prefault = Layout.prefault
    blocked: list[str] = []
    reached = threading.Event()

    def prefault(self):  # type: ignore[no-untyped-def]
        if not blocked:  # the first preparation (the weights) waits for the gate
            blocked.append(threading.current_thread().name)
            reached.set()
            gate.wait()
        real_prefault(self)

    monkeypatch.setattr(Layout, "prefault", prefault)
    model, opt = _model()
    _step(model, opt)
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    engine = SaveEngine(store, mode="thread")
    try:
        weight_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        assert engine.prepare(sources, {Tier.WEIGHTS}) == weight_bytes
        assert reached.wait(30)  # the first preparation is running (held inside its page touching)
        assert engine.prepare(sources, {Tier.WEIGHTS, Tier.OPTIMIZER}) > 0  # the optimizer's, at once
        assert not gate.is_set() and blocked  # returned while the first was still running
        gate.set()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        handle = engine.save(sources, SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="a"))
        assert engine.last_plan.reason == "snapshot buffers already allocated"
        loaded = store.load(handle.wait(60))
        assert all(torch.equal(loaded.weights[k], v) for k, v in expected.items())
        assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    finally:
        timer.cancel()
        gate.set()
        engine.close()


def test_optimizer_buffers_are_prepared_when_a_resume_loads_its_state(store) -> None:
    model, opt = _model()
    _step(model, opt)
    state = opt.state_dict()
    fresh_model, fresh_opt = _model()  # like Trainer's optimizer, created empty on resume
    sources = StateSources(weights=fresh_model.state_dict, optimizer=fresh_opt)
    engine = SaveEngine(store, mode="thread")
    try:
        weight_bytes = sum(v.numel() * v.element_size() for v in fresh_model.state_dict().values())
        assert engine.prepare(sources, wait=True) == weight_bytes  # no optimizer state yet
        assert len(fresh_opt._optimizer_load_state_dict_post_hooks) == 1
        fresh_opt.load_state_dict(state)  # the resume: prepared now, not after the first step
        assert len(fresh_opt._optimizer_load_state_dict_post_hooks) == 0
        assert len(fresh_opt._optimizer_step_post_hooks) == 0  # one-shot: both hooks are gone
        handle = engine.save(sources, SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="a"))
        assert engine.last_plan.reason == "snapshot buffers already allocated"
        loaded = store.load(handle.wait(60))
        assert torch.equal(loaded.optimizer["state"][0]["exp_avg_sq"],
                           fresh_opt.state[fresh_model[0].weight]["exp_avg_sq"])
    finally:
        engine.close()


def test_under_a_memory_limit_only_the_first_step_prepares_the_optimizer(store) -> None:
    from hf_dynamic_ckpt.engine.staging import Headroom

    roomy = Headroom(total_bytes=64 << 30, available_bytes=32 << 30, source="cgroup")  # a limit, with room
    model, opt = _model()
    _step(model, opt)
    state = opt.state_dict()
    fresh_model, fresh_opt = _model()
    engine = SaveEngine(store, mode="thread", headroom=lambda: roomy)
    try:
        assert engine.prepare(StateSources(weights=fresh_model.state_dict, optimizer=fresh_opt), wait=True) == 0
        assert len(fresh_opt._optimizer_load_state_dict_post_hooks) == 0  # the step measures the memory it takes
        fresh_opt.load_state_dict(state)
        assert engine.buffer_bytes == 0 and len(fresh_opt._optimizer_step_post_hooks) == 1
        _step(fresh_model, fresh_opt)
        engine._preparer.finish(engine._snapshotter)
        assert engine.buffer_bytes > 0 and len(fresh_opt._optimizer_step_post_hooks) == 0
    finally:
        engine.close()

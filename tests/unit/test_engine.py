from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.engine import OnBusy, SaveEngine, SaveHandle
from hf_dynamic_ckpt.engine.staging import Headroom
from hf_dynamic_ckpt.errors import FAULT_ENV, ConfigError, SaveError
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest, check_frozen

RNG = {"python": "fixed", "torch": [1, 2, 3]}


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _step(model, opt, sched)
    return model, opt, sched


def _step(model, opt, sched=None):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


def _sources(model, opt, sched=None, **kw):
    return StateSources(weights=model.state_dict, optimizer=opt, scheduler=sched, **kw)


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _assert_state_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_state_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_state_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


class _GatedSave:
    """Holds `store.save` until released, to observe what happens while a write is in flight."""

    def __init__(self, store: CheckpointStore) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._orig = store.save
        store.save = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.gate.wait()
        return self._orig(*args, **kwargs)


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(tmp_path / "ckpt")
    yield s
    s.close()


def test_save_returns_before_write_and_later_steps_do_not_leak_into_it(store):
    model, opt, sched = _model()
    gated = _GatedSave(store)
    expected = {"w": _clone(model.state_dict()), "o": _clone(opt.state_dict()), "s": _clone(sched.state_dict())}
    with SaveEngine(store) as engine:
        handle = engine.save(_sources(model, opt, sched),
                             SaveRequest(step=1, epoch=0.25, tiers=ALL_TIERS, reason="interval"), rng=RNG)
        assert gated.entered.wait(30)
        assert not handle.done() and engine.busy
        assert not (store.task_dir / "step-1").exists()
        for _ in range(3):  # training goes on while the write is held
            _step(model, opt, sched)
        assert not torch.equal(model.state_dict()["0.weight"], expected["w"]["0.weight"])
        gated.gate.set()
        info = handle.wait(60)
    assert info is not None and info.step == 1 and info.tiers == ALL_TIERS
    loaded = store.load("step:1")
    _assert_state_equal(loaded.weights, expected["w"], "weights")
    _assert_state_equal(loaded.optimizer, expected["o"], "optimizer")
    _assert_state_equal(loaded.scheduler, expected["s"], "scheduler")
    assert loaded.rng == RNG
    assert handle.staging == "buffered" and handle.write_ms is not None


def test_rng_captured_by_the_save_is_the_state_at_the_save_not_at_the_write(store, monkeypatch):
    """Without an `rng` argument the snapshot captures the generators raw (`RawRngState`) and the writer
    converts them, off the training thread: draws made meanwhile must not reach the stored state."""
    from hf_dynamic_ckpt.state import RawRngState, restore_rng_state

    converted_on = []
    to_json = RawRngState.to_json
    monkeypatch.setattr(RawRngState, "to_json",
                        lambda self: converted_on.append(threading.get_ident()) or to_json(self))
    model, opt, sched = _model()
    gated = _GatedSave(store)
    with SaveEngine(store, mode="thread") as engine:
        handle = engine.save(_sources(model, opt, sched), SaveRequest(step=1, tiers=ALL_TIERS, reason="interval"))
        expected = torch.rand(8)  # the draws that follow the save ...
        assert gated.entered.wait(30)
        torch.rand(100)  # ... and more while the write is held
        gated.gate.set()
        handle.wait(60)
    assert len(converted_on) == 1 and converted_on[0] != threading.get_ident()
    loaded = store.load("step:1")
    assert isinstance(loaded.rng, dict) and loaded.rng["format_version"] == 1
    restore_rng_state(loaded.rng)
    assert torch.equal(torch.rand(8), expected)


def test_background_failure_surfaces_and_previous_checkpoint_stays(store, monkeypatch, caplog):
    model, opt, _ = _model()
    engine = SaveEngine(store)
    assert engine.save(_sources(model, opt),
                       SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="interval")).wait(60).step == 1

    monkeypatch.setenv(FAULT_ENV, "write@step=2:raise=ENOSPC")
    _step(model, opt)
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine")  # one WARNING per failed save
    handle = engine.save(_sources(model, opt),
                         SaveRequest(step=2, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="interval"))
    with pytest.raises(SaveError, match=r"No space left on device") as excinfo:
        handle.wait(60)
    message = str(excinfo.value)
    assert "save of step 2 (interval) failed" in message
    assert "the previous checkpoint (step 1) stays the restore point" in message
    cause = excinfo.value.__cause__
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    assert any("save of step 2 (interval) failed" in r.getMessage() for r in caplog.records)
    assert isinstance(handle.exception(), SaveError)
    with pytest.raises(SaveError):  # engine.wait() reports the same failure
        engine.wait()
    assert store.resolve("auto").step == 1
    assert sorted(p.name for p in store.task_dir.iterdir() if p.name.startswith("step-")) == ["step-1"]

    monkeypatch.undo()  # disk space is back: training and saving continue
    _step(model, opt)
    info = engine.save(_sources(model, opt),
                       SaveRequest(step=3, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="interval")).wait(60)
    assert info.step == 3 and store.resolve("auto").step == 3
    _assert_state_equal(store.load("step:3").weights, _clone(model.state_dict()))
    engine.close()


def test_on_busy_skip_logs_and_wait_serialises(store, caplog):
    model, opt, _ = _model()
    gated = _GatedSave(store)
    engine = SaveEngine(store, on_busy="skip")
    first = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="interval"))
    assert gated.entered.wait(30)
    caplog.set_level(logging.INFO, logger="hf_dynamic_ckpt.engine.engine")
    skipped = engine.save(_sources(model, opt), SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="risk"))
    assert skipped.done() and skipped.wait() is None
    assert skipped.skipped == "save of step 2 (risk) skipped: step 1 is still writing (on_busy='skip')"
    assert skipped.skipped in caplog.text
    # A blocking save never skips: it waits for the write in flight.
    results: list[SaveHandle] = []
    t = threading.Thread(target=lambda: results.append(
        engine.save(_sources(model, opt), SaveRequest(step=3, tiers={Tier.WEIGHTS}, reason="final"), blocking=True)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not results  # still waiting for step 1
    gated.gate.set()
    t.join(60)
    assert first.wait(60).step == 1 and results[0].done() and results[0].wait().step == 3
    assert [i.step for i in store.list()] == [3, 1]
    engine.close()


def test_wait_policy_is_the_default_and_waits_for_the_write_in_flight(store):
    model, opt, _ = _model()
    gated = _GatedSave(store)
    engine = SaveEngine(store)
    assert engine.on_busy == OnBusy.WAIT
    first = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="interval"))
    assert gated.entered.wait(30)
    out: list[SaveHandle] = []
    t = threading.Thread(target=lambda: out.append(
        engine.save(_sources(model, opt), SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="interval"))))
    t.start()
    t.join(0.3)
    assert t.is_alive()
    gated.gate.set()
    t.join(60)
    assert first.done() and out[0].wait(60).step == 2
    engine.close()


def test_streaming_when_the_snapshot_does_not_fit(store, caplog):
    model, opt, _ = _model()
    tight = Headroom(total_bytes=100 << 20, available_bytes=10 << 20, source="cgroup")
    engine = SaveEngine(store, headroom=lambda: tight)
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine.engine")
    expected = _clone(model.state_dict())
    handle = engine.save(_sources(model, opt),
                         SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="interval"))
    assert handle.done() and handle.staging == "streaming"  # synchronous: nothing left to write
    assert engine.buffer_bytes == 0  # no second copy was made
    assert "save of step 1 streams synchronously: a buffered snapshot would need" in caplog.text
    _step(model, opt)
    _assert_state_equal(store.load(handle.wait()).weights, expected)
    engine.close()


def test_buffered_when_it_fits_and_buffers_are_reused(store):
    model, opt, _ = _model()
    roomy = Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="host")
    engine = SaveEngine(store, headroom=lambda: roomy)
    engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="a")).wait(60)
    held = engine.buffer_bytes
    n_params = len(list(model.parameters()))
    # weights + exp_avg + exp_avg_sq (float32) + one float32 `step` per parameter
    assert held == sum(v.numel() * 4 for v in model.state_dict().values()) * 3 + 4 * n_params
    assert engine.last_plan.mode == "buffered"
    _step(model, opt)
    engine.save(_sources(model, opt), SaveRequest(step=2, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="b")).wait(60)
    assert engine.buffer_bytes == held
    assert engine.last_plan.reason == "snapshot buffers already allocated"
    engine.close()
    assert engine.buffer_bytes == 0


def test_frozen_weights_are_recorded_not_written(store):
    model, _, _ = _model()
    frozen = frozenset({"0.weight", "0.bias"})
    sources = StateSources(weights=model.state_dict, frozen_keys=frozen)
    with SaveEngine(store) as engine:
        engine.save(sources, SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
        with torch.no_grad():
            model[2].weight.add_(1.0)
        handle = engine.save(sources, SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="b"))
        handle.wait(60)
    assert not (store.task_dir / "blobs").exists()
    loaded = store.load("step:2")
    assert set(loaded.frozen) == frozen and not frozen & set(loaded.weights)
    check_frozen(loaded, model.state_dict())  # the model's own frozen weights take their place
    _assert_state_equal(loaded.weights, _clone(model.state_dict()))


def test_emergency_save_drops_optimizer_when_out_of_time(store, caplog):
    model, opt, sched = _model()
    engine = SaveEngine(store)
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine.engine")
    info = engine.emergency_save(_sources(model, opt, sched),
                                 SaveRequest(step=5, epoch=1.0, reason="SIGTERM"), deadline_s=1e-9, rng=RNG)
    assert info.tiers == frozenset({Tier.WEIGHTS, Tier.STATE}) and info.reason == "emergency: SIGTERM"
    assert "emergency save of step 5: dropping the optimizer tier" in caplog.text
    info = engine.emergency_save(_sources(model, opt, sched),
                                 SaveRequest(step=6, reason="SIGTERM"), deadline_s=600.0, rng=RNG)
    assert info.tiers == ALL_TIERS
    loaded = store.load("step:6")
    _assert_state_equal(loaded.optimizer, _clone(opt.state_dict()))
    assert loaded.rng == RNG
    engine.close()


def test_close_is_idempotent_and_refuses_later_saves(store):
    model, opt, _ = _model()
    engine = SaveEngine(store)
    handle = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a"))
    engine.close()
    assert handle.done() and handle.wait().step == 1  # close flushed it
    engine.close()
    with pytest.raises(SaveError, match=r"SaveEngine is closed: create a new SaveEngine to save again."):
        engine.save(_sources(model, opt), SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="a"))


def test_invalid_arguments_name_the_value(store):
    with pytest.raises(ConfigError, match=r"mode='fast' is invalid: expected one of 'thread', 'process', 'sync'."):
        SaveEngine(store, mode="fast")
    with pytest.raises(ConfigError, match=r"on_busy='queue' is invalid: expected 'wait' or 'skip'."):
        SaveEngine(store, on_busy="queue")
    with pytest.raises(ConfigError, match=r"memory_margin=1.5 is invalid"):
        SaveEngine(store, memory_margin=1.5)


def test_skip_policy_refused_with_several_ranks(tmp_path):
    with CheckpointStore(tmp_path / "c", rank=0, world_size=2, session_id="s1") as two_ranks:
        with pytest.raises(ConfigError, match=r"on_busy='skip' is invalid with world_size=2: ranks could disagree"):
            SaveEngine(two_ranks, on_busy="skip")
        SaveEngine(two_ranks).close()  # 'wait' is fine


def test_sync_mode_writes_before_returning(store):
    model, opt, _ = _model()
    with SaveEngine(store, mode="sync") as engine:
        h = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="a"))
        assert h.done() and h.staging == "sync" and engine.buffer_bytes == 0
        assert (store.task_dir / "step-1" / "manifest.json").exists()


def test_handle_wait_timeout(store):
    gated = _GatedSave(store)
    model, opt, _ = _model()
    engine = SaveEngine(store)
    h = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a"))
    with pytest.raises(TimeoutError, match=r"save of step 1 still writing after 0.01 s; call wait\(\) again."):
        h.wait(0.01)
    gated.gate.set()
    assert h.wait(60).step == 1
    engine.close()


def test_writer_thread_runs_at_lower_priority(store):
    seen: list[int] = []
    model, opt, _ = _model()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    orig = store.save

    def save(*a, **k):
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))  # on the writer thread (Linux: per thread)
        return orig(*a, **k)

    store.save = save
    with SaveEngine(store, writer_nice=5) as engine:
        engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
    assert seen == [min(19, base + 5)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the training thread is untouched


def test_process_mode_falls_back_to_thread_when_dev_shm_is_too_small(store, caplog):
    model, opt, _ = _model()
    engine = SaveEngine(store, mode="process")
    engine._dispatch.shm_free = lambda: 1024  # Docker's default /dev/shm is 64 MiB; here: 1 KiB
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine.engine")
    info = engine.save(_sources(model, opt),
                       SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="a")).wait(60)
    assert info.step == 1 and engine.mode == "thread"
    assert "the process writer needs" in caplog.text and "using the thread writer instead" in caplog.text
    assert type(engine._dispatch.writer).__name__ == "ThreadWriter" and not engine._snapshotter.pool.shared
    engine.close()


def test_the_writer_is_chosen_before_anything_is_copied(store, monkeypatch):
    # /dev/shm runs short after a first process-mode save: the next save is a thread-mode save from its start,
    # planned for private buffers (nothing of it goes into the shared ones, which would be allocated again
    # at the save after), and it writes the state at the save.
    import hf_dynamic_ckpt.engine.buffers as buffers

    shared: list[int] = []
    allocate = buffers.new_shared_storage
    monkeypatch.setattr(buffers, "new_shared_storage", lambda n, **k: shared.append(n) or allocate(n, **k))
    model, opt, _ = _model()
    with SaveEngine(store, mode="process") as engine:
        engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
        first = list(shared)
        assert first and engine._snapshotter.pool.shared
        engine._dispatch.shm_free = lambda: 64  # fewer bytes than the optimizer state
        expected = _clone(model.state_dict())
        handle = engine.save(_sources(model, opt), SaveRequest(step=2, tiers=ALL_TIERS, reason="b"))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # after the save returned: not in the snapshot
        info = handle.wait(60)
        held = engine.buffer_bytes
        assert engine.mode == "thread" and not engine._snapshotter.pool.shared and shared == first
        engine.save(_sources(model, opt), SaveRequest(step=3, tiers=ALL_TIERS, reason="c")).wait(60)
        assert engine.buffer_bytes == held  # the second save's buffers were the private pool's: reused
    _assert_state_equal(store.load(info).weights, expected)


def test_tied_embeddings_are_stored_once_through_the_engine(store):
    from examples.toy import tiny_qwen2

    model = tiny_qwen2(seed=0, hidden_size=16, num_layers=1, vocab_size=64, tie_word_embeddings=True)
    with SaveEngine(store) as engine:
        info = engine.save(StateSources(weights=model.state_dict),
                           SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
    loaded = store.load(info).weights
    assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()
    _assert_state_equal(loaded, _clone(model.state_dict()))


def test_process_mode_never_waits_for_the_writer_process_to_start(store, monkeypatch):
    from hf_dynamic_ckpt.engine.writer import ProcessWriter

    # The test decides when the (really spawned) process counts as ready.
    gate = threading.Event()
    monkeypatch.setattr(ProcessWriter, "ready", property(lambda self: gate.is_set() and self._ready_event.is_set()))
    model, opt, _ = _model()
    engine = SaveEngine(store, mode="process")
    assert engine._dispatch.writer is None  # started when first needed (prepare or a save), not by the constructor
    first = engine.save(_sources(model, opt), SaveRequest(step=1, tiers=ALL_TIERS, reason="a"))
    writer = engine._dispatch.writer
    assert type(writer).__name__ == "ProcessWriter" and writer._proc.is_alive()  # started by the first save
    assert first.writer == "thread (process starting)" and not writer.ready
    assert first.wait(60).step == 1 and not writer.ready  # committed without the process
    assert torch.equal(store.load("step:1").weights["0.weight"], model[0].weight.detach())
    startup_thread = engine._dispatch.startup_writer._thread
    with torch.no_grad():
        model[0].weight.add_(1.0)
    gate.set()
    assert engine.wait_writer_ready(120)
    second = engine.save(_sources(model, opt), SaveRequest(step=2, tiers=ALL_TIERS, reason="b"))
    assert second.writer == "process" and second.wait(120).step == 2
    assert engine._dispatch.startup_writer is None and not startup_thread.is_alive()  # the stand-in thread is gone
    assert torch.equal(store.load("step:2").weights["0.weight"], model[0].weight.detach())
    pid = writer.pid
    engine.close()
    import psutil

    assert not psutil.pid_exists(pid)


def test_process_writer_still_starting_is_stopped_at_close(store, monkeypatch):
    from hf_dynamic_ckpt.engine.writer import ProcessWriter

    monkeypatch.setattr(ProcessWriter, "ready", property(lambda self: False))  # never comes up
    engine = SaveEngine(store, mode="process")
    writer = engine._dispatch.ensure()  # what prepare or the first save does
    pid = writer.pid
    assert writer._proc.is_alive()
    engine.close()  # nothing to flush: terminated, not waited for
    import psutil

    assert not psutil.pid_exists(pid)
    assert engine._dispatch.writer is None and engine._dispatch.startup_writer is None


def test_writer_process_starts_at_lower_priority(store):
    import psutil

    base = os.getpriority(os.PRIO_PROCESS, 0)
    engine = SaveEngine(store, mode="process", writer_nice=5)
    try:
        # Set by the parent right after the start: the interpreter's start-up already runs niced.
        assert psutil.Process(engine._dispatch.ensure().pid).nice() == min(19, base + 5)
    finally:
        engine.close()
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the training thread is untouched


def test_writer_process_that_dies_before_it_is_ready_switches_to_the_thread_writer(store, monkeypatch, caplog):
    from hf_dynamic_ckpt.engine.writer import ProcessWriter

    monkeypatch.setattr(ProcessWriter, "ready", property(lambda self: False))
    model, opt, _ = _model()
    engine = SaveEngine(store, mode="process")
    proc = engine._dispatch.ensure()._proc
    pid = proc.pid
    proc.kill()  # e.g. killed by the OOM killer while importing torch
    proc.join(60)
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine.engine")
    handle = engine.save(_sources(model, opt), SaveRequest(step=1, tiers=ALL_TIERS, reason="a"))
    assert handle.wait(60).step == 1 and handle.writer == "thread" and engine.mode == "thread"
    assert f"the writer process {pid} exited before it was ready; writing on a thread instead" in caplog.text
    assert type(engine._dispatch.writer).__name__ == "ThreadWriter"
    engine.close()

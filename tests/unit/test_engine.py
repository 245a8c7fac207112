"""SaveEngine through its public surface: what a save copies, when it returns, how it fails, what it holds.

A background save is written by the writer process: `GatedStore` (importable there) holds or fails its writes
through files in the directory `$HF_DYNAMIC_CKPT_TEST_GATE` names, in whichever process writes.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.engine import OnBusy, SaveEngine, SaveHandle
from hf_dynamic_ckpt.errors import ConfigError, SaveError
from hf_dynamic_ckpt.state import CachedWeights, StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest, check_frozen
from hf_dynamic_ckpt.sysmem import Headroom

RNG = {"python": "fixed", "torch": [1, 2, 3]}
ROOMY = Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="host")


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


GATE_ENV = "HF_DYNAMIC_CKPT_TEST_GATE"


class GatedStore(CheckpointStore):
    """With `$HF_DYNAMIC_CKPT_TEST_GATE` set, a save creates `entered-<step>` there, waits for `go`, and fails with
    ENOSPC while `fail` exists."""

    def save(self, state, *args, **kwargs):  # type: ignore[no-untyped-def]
        gate = os.environ.get(GATE_ENV)
        if gate:
            Path(gate, f"entered-{state.step}").touch()
            while not Path(gate, "go").exists():
                time.sleep(0.01)
            if Path(gate, "fail").exists():
                raise OSError(errno.ENOSPC, "No space left on device")
        return super().save(state, *args, **kwargs)


class Gate:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()

    def entered(self, step: int, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while not (self.path / f"entered-{step}").exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def open(self) -> None:
        (self.path / "go").touch()


@pytest.fixture
def gate(tmp_path, monkeypatch) -> Gate:
    """Holds the writes of engines started after it (the writer process inherits the environment)."""
    monkeypatch.setenv(GATE_ENV, str(tmp_path / "gate"))
    return Gate(tmp_path / "gate")


@pytest.fixture
def store(tmp_path):
    s = GatedStore(tmp_path / "ckpt")
    yield s
    s.close()


def _started(store, **kw) -> SaveEngine:
    """An engine whose writer process takes saves (until then a save writes synchronously)."""
    engine = SaveEngine(store, **kw)
    assert engine.start(wait_s=120)
    return engine


def test_save_returns_before_write_and_later_steps_do_not_leak_into_it(store, gate):
    model, opt, sched = _model()
    expected = {"w": _clone(model.state_dict()), "o": _clone(opt.state_dict()), "s": _clone(sched.state_dict())}
    rng = _clone(RNG)
    with _started(store) as engine:
        handle = engine.save(_sources(model, opt, sched),
                             SaveRequest(step=1, epoch=0.25, tiers=ALL_TIERS, reason="interval"), rng=rng)
        rng["torch"].append(4)  # the caller reuses its dict after the save
        assert gate.entered(1)
        assert not handle.done() and engine.busy
        assert not (store.task_dir / "step-1").exists()
        for _ in range(3):  # training goes on while the write is held
            _step(model, opt, sched)
        assert not torch.equal(model.state_dict()["0.weight"], expected["w"]["0.weight"])
        gate.open()
        info = handle.wait(60)
    assert info is not None and info.step == 1 and info.tiers == ALL_TIERS
    loaded = store.load("step:1")
    _assert_state_equal(loaded.weights, expected["w"], "weights")
    _assert_state_equal(loaded.optimizer, expected["o"], "optimizer")
    _assert_state_equal(loaded.scheduler, expected["s"], "scheduler")
    assert loaded.rng == RNG
    assert handle.staging == "buffered" and handle.writer == "process" and handle.write_ms is not None


def test_rng_captured_by_the_save_is_the_state_at_the_save_not_at_the_write(store, gate, monkeypatch):
    """Without an `rng` argument the snapshot captures the generators raw (`RawRngState`) and the writer
    converts them, off the training thread: draws made meanwhile must not reach the stored state."""
    from hf_dynamic_ckpt.state import RawRngState, restore_rng_state

    converted_on = []
    to_json = RawRngState.to_json
    monkeypatch.setattr(RawRngState, "to_json",
                        lambda self: converted_on.append(threading.get_ident()) or to_json(self))
    model, opt, sched = _model()
    with _started(store) as engine:
        handle = engine.save(_sources(model, opt, sched), SaveRequest(step=1, tiers=ALL_TIERS, reason="interval"))
        expected = torch.rand(8)  # the draws that follow the save ...
        assert gate.entered(1)
        torch.rand(100)  # ... and more while the write is held
        gate.open()
        handle.wait(60)
    assert len(converted_on) == 1 and converted_on[0] != threading.get_ident()
    loaded = store.load("step:1")
    assert isinstance(loaded.rng, dict) and loaded.rng["format_version"] == 1
    restore_rng_state(loaded.rng)
    assert torch.equal(torch.rand(8), expected)


def test_background_failure_surfaces_and_previous_checkpoint_stays(store, gate, caplog):
    model, opt, _ = _model()
    gate.open()
    engine = _started(store)
    tiers = {Tier.WEIGHTS, Tier.OPTIMIZER}
    assert engine.save(_sources(model, opt), SaveRequest(step=1, tiers=tiers, reason="interval")).wait(60).step == 1
    (gate.path / "fail").touch()  # the disk is full
    _step(model, opt)
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine")  # one WARNING per failed save
    handle = engine.save(_sources(model, opt), SaveRequest(step=2, tiers=tiers, reason="interval"))
    with pytest.raises(SaveError, match=r"No space left on device") as excinfo:
        handle.wait(60)
    message = str(excinfo.value)
    assert message.startswith("save of step 2 (interval) failed: OSError: [Errno 28] No space left on device")
    assert "the previous checkpoint (step 1) stays the restore point" in message
    assert "No space left on device" in str(excinfo.value.__cause__)
    assert [r.getMessage() for r in caplog.records if "save of step 2 (interval) failed" in r.getMessage()] \
        == [message]
    assert isinstance(handle.exception(), SaveError)
    with pytest.raises(SaveError):  # engine.wait() reports the same failure
        engine.wait()
    assert store.resolve("auto").step == 1

    (gate.path / "fail").unlink()  # disk space is back: training and saving continue
    _step(model, opt)
    info = engine.save(_sources(model, opt), SaveRequest(step=3, tiers=tiers, reason="interval")).wait(60)
    assert info.step == 3 and store.resolve("auto").step == 3
    _assert_state_equal(store.load("step:3").weights, _clone(model.state_dict()))
    engine.close()


def test_on_busy_skip_logs_and_a_blocking_save_waits(store, gate, caplog):
    model, opt, _ = _model()
    engine = _started(store, on_busy="skip")
    first = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="interval"))
    assert gate.entered(1)
    caplog.set_level(logging.INFO, logger="hf_dynamic_ckpt.engine")
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
    gate.open()
    t.join(60)
    assert first.wait(60).step == 1 and results[0].done() and results[0].wait().step == 3
    assert [i.step for i in store.list()] == [3, 1]
    engine.close()


def test_wait_policy_is_the_default_and_counts_the_wait_as_blocking(store, gate):
    model, opt, _ = _model()
    engine = _started(store)
    assert engine.on_busy == OnBusy.WAIT
    first = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="interval"))
    assert gate.entered(1)
    out: list[SaveHandle] = []
    t = threading.Thread(target=lambda: out.append(
        engine.save(_sources(model, opt), SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="interval"))))
    t.start()
    t.join(0.3)
    assert t.is_alive()
    gate.open()
    t.join(60)
    assert first.done() and out[0].wait(60).step == 2 and out[0].blocking_ms >= 300
    engine.close()


def test_streaming_when_the_snapshot_does_not_fit(store, caplog):
    model, opt, _ = _model()
    tight = Headroom(total_bytes=100 << 20, available_bytes=10 << 20, source="host")
    engine = _started(store, headroom=lambda: tight)
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine")
    expected = _clone(model.state_dict())
    handle = engine.save(_sources(model, opt),
                         SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="interval"))
    assert handle.done() and handle.staging == "streaming"  # synchronous: nothing left to write
    assert engine.buffer_bytes == 0  # no second copy was made
    assert "save of step 1 streams synchronously: a buffered snapshot would need" in caplog.text
    _step(model, opt)
    _assert_state_equal(store.load(handle.wait()).weights, expected)
    engine.close()


def test_buffers_are_reused_across_saves_and_follow_a_shape_change(store):
    model, opt, _ = _model()
    engine = _started(store, headroom=lambda: ROOMY)
    engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="a")).wait(60)
    held = engine.buffer_bytes
    n_params = len(list(model.parameters()))
    # weights + exp_avg + exp_avg_sq (float32) + one float32 `step` per parameter, no more than alignment
    assert 0 <= held - (sum(v.numel() * 4 for v in model.state_dict().values()) * 3 + 4 * n_params) < 64
    assert engine.last_plan.mode == "buffered"
    _step(model, opt)
    engine.save(_sources(model, opt), SaveRequest(step=2, tiers={Tier.WEIGHTS, Tier.OPTIMIZER}, reason="b")).wait(60)
    assert engine.buffer_bytes == held and engine.last_plan.reason == "snapshot buffers already allocated"
    engine.save(_sources(model, opt), SaveRequest(step=3, tiers={Tier.WEIGHTS}, reason="c")).wait(60)
    assert engine.buffer_bytes == held  # a weights-only save keeps the optimizer's buffers
    # A parameter given new memory of the same shape, an optimizer state tensor replaced: same buffers, new values.
    model[0].weight.data = torch.full((16, 8), 3.0)
    opt.state[model[0].weight]["exp_avg"] = torch.full((16, 8), 4.0)
    info = engine.save(_sources(model, opt), SaveRequest(step=4, tiers={Tier.WEIGHTS, Tier.OPTIMIZER},
                                                         reason="d")).wait(60)
    loaded = store.load(info)
    assert torch.equal(loaded.weights["0.weight"], torch.full((16, 8), 3.0)) and engine.buffer_bytes == held
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], torch.full((16, 8), 4.0))
    model[0].weight.data = torch.full((2, 8), 5.0)  # a new shape: the weights' buffers are reallocated
    info = engine.save(_sources(model, opt), SaveRequest(step=5, tiers={Tier.WEIGHTS}, reason="e")).wait(60)
    assert torch.equal(store.load(info).weights["0.weight"], torch.full((2, 8), 5.0))
    assert engine.buffer_bytes == held - 14 * 8 * 4
    engine.close()
    assert engine.buffer_bytes == 0


def test_bf16_non_contiguous_tied_and_many_small_tensors_are_copied_exactly(store):
    torch.manual_seed(0)
    base = torch.randn(6, 4).to(torch.bfloat16)
    emb = torch.randn(10, 4)
    tensors = {"t": base.t(), "s": base[::2], "embed.weight": emb, "lm_head.weight": emb}
    tensors.update({f"a{i}": torch.randn(3, 5) for i in range(200)})
    tensors.update({f"b{i}": torch.randn(7).to(torch.bfloat16) for i in range(50)})
    expected = {k: v.clone() for k, v in tensors.items()}
    with _started(store, headroom=lambda: ROOMY) as engine:
        handle = engine.save(StateSources(weights=lambda: tensors), SaveRequest(step=1, tiers={Tier.WEIGHTS},
                                                                                reason="a"))
        for v in tensors.values():
            v.add_(1)  # the snapshot does not move with the sources
        info = handle.wait(60)
        unique = sum(v.numel() * v.element_size() for k, v in expected.items() if k != "lm_head.weight")
        assert unique <= engine.buffer_bytes < unique + 2 * 64  # tied weights are copied once
    loaded = store.load(info).weights
    _assert_state_equal(loaded, expected)
    assert loaded["lm_head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()


def test_tied_embeddings_of_a_model_are_stored_once(store):
    from examples.toy import tiny_qwen2

    model = tiny_qwen2(seed=0, hidden_size=16, num_layers=1, vocab_size=64, tie_word_embeddings=True)
    with SaveEngine(store, mode="sync") as engine:
        info = engine.save(StateSources(weights=model.state_dict),
                           SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
    loaded = store.load(info).weights
    assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()
    _assert_state_equal(loaded, _clone(model.state_dict()))


def test_parameters_as_weights_and_frozen_weights(store):
    model, opt, _ = _model()
    expected = _clone(model.state_dict())
    frozen = frozenset({"0.bias"})
    with _started(store) as engine:  # Parameters (requires_grad) and detached tensors give the same bytes
        params = engine.save(StateSources(weights=lambda: dict(model.named_parameters()), optimizer=opt),
                             SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
        no_frozen = engine.save(_sources(model, opt, frozen_keys=frozen),
                                SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="b")).wait(60)
    _assert_state_equal(store.load(params).weights, expected)
    loaded = store.load(no_frozen).weights  # frozen weights are neither copied nor written by the engine
    assert set(loaded) == set(expected) - frozen
    _assert_state_equal(loaded, {k: v for k, v in expected.items() if k not in frozen})


def test_small_state_and_overrides_are_deep_copied_at_the_save(store, gate):
    model, opt, sched = _model()
    pos = {"epoch": 0, "batches": [3, 4]}
    extra = {"trainer_state": {"global_step": 5}}
    sources = _sources(model, opt, sched, sampler=lambda: pos)
    with _started(store) as engine:
        handle = engine.save(sources, SaveRequest(step=5, epoch=0.5, tiers=ALL_TIERS, reason="a"),
                             rng={"python": [1, 2]}, extra=extra)
        pos["batches"].append(5)
        extra["trainer_state"]["global_step"] = 6
        lr = sched.get_last_lr()
        _step(model, opt, sched)
        gate.open()
        info = handle.wait(60)
        state_only = engine.save(sources, SaveRequest(step=6, tiers={Tier.STATE}, reason="b"),
                                 sampler={"epoch": 9}).wait(60)
    loaded = store.load(info)
    assert loaded.rng == {"python": [1, 2]} and loaded.sampler == {"epoch": 0, "batches": [3, 4]}
    assert loaded.extra["trainer_state"] == {"global_step": 5}
    assert loaded.scheduler["_last_lr"] == lr != sched.get_last_lr()
    assert (loaded.info.step, info.step) == (5, 5)
    loaded = store.load(state_only)
    assert loaded.sampler == {"epoch": 9} and loaded.weights is None and loaded.optimizer is None


def test_missing_sources_raise_named_errors(store):
    with SaveEngine(store, mode="sync") as engine:
        with pytest.raises(SaveError, match=r"tiers include 'weights' but StateSources.weights is None"):
            engine.save(StateSources(), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a"))
        with pytest.raises(SaveError, match=r"tiers include 'optimizer' but StateSources has no optimizer"):
            engine.save(StateSources(), SaveRequest(step=1, tiers={Tier.OPTIMIZER}, reason="a"))
        with pytest.raises(SaveError, match=r"weight 'w' is a list, not a torch.Tensor"):
            engine.save(StateSources(weights=lambda: {"w": [1.0]}), SaveRequest(step=1, tiers={Tier.WEIGHTS},
                                                                                 reason="a"))


def test_frozen_weights_are_recorded_not_written(store):
    model, _, _ = _model()
    frozen = frozenset({"0.weight", "0.bias"})
    sources = StateSources(weights=model.state_dict, frozen_keys=frozen)
    with SaveEngine(store) as engine:
        engine.save(sources, SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
        with torch.no_grad():
            model[2].weight.add_(1.0)
        engine.save(sources, SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="b")).wait(60)
    assert not (store.task_dir / "blobs").exists()
    loaded = store.load("step:2")
    assert set(loaded.frozen) == frozen and not frozen & set(loaded.weights)
    check_frozen(loaded, model.state_dict())  # the model's own frozen weights take their place
    for name, tensor in loaded.weights.items():
        assert torch.equal(tensor, model.state_dict()[name])
    model[0].weight.data.add_(1.0)  # a frozen weight that changed is caught at resume
    with pytest.raises(Exception, match=r"0\.weight"):
        check_frozen(loaded, model.state_dict())


def test_emergency_save_drops_optimizer_when_out_of_time(store, caplog):
    model, opt, sched = _model()
    engine = SaveEngine(store, mode="sync")
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine")
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


def test_close_is_idempotent_flushes_and_stops_the_writer_process(store, gate):
    model, opt, _ = _model()
    engine = _started(store)
    pid = engine.writer_pid
    handle = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a"))
    assert gate.entered(1) and not handle.done()
    threading.Timer(0.3, gate.open).start()
    engine.close()
    assert handle.done() and handle.wait().step == 1  # close flushed it
    assert not psutil.pid_exists(pid)  # the writer process was stopped and reaped
    engine.close()
    with pytest.raises(SaveError, match=r"SaveEngine is closed: create a new SaveEngine to save again."):
        engine.save(_sources(model, opt), SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="a"))


def test_invalid_arguments_name_the_value(store):
    with pytest.raises(ConfigError, match=r"mode='fast' is invalid: expected 'process' .* or 'sync'"):
        SaveEngine(store, mode="fast")
    with pytest.raises(ConfigError, match=r"mode='thread' is invalid: expected 'process'"):
        SaveEngine(store, mode="thread")
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
        assert h.done() and h.staging == "sync" and h.writer == "sync" and engine.buffer_bytes == 0
        assert (store.task_dir / "step-1" / "manifest.json").exists()


def test_handle_wait_timeout(store, gate):
    model, opt, _ = _model()
    engine = _started(store)
    h = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a"))
    with pytest.raises(TimeoutError, match=r"save of step 1 still writing after 0.01 s; call wait\(\) again."):
        h.wait(0.01)
    gate.open()
    assert h.wait(60).step == 1
    engine.close()


def test_the_writer_process_runs_at_lower_priority(store):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with SaveEngine(store, writer_nice=5) as engine:
        assert engine.start(wait_s=120)  # niced once up: its start-up runs at training's priority, to be up sooner
        assert psutil.Process(engine.writer_pid).nice() == min(19, base + 5)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the training thread is untouched


def test_saves_before_the_writer_process_is_ready_are_written_synchronously(store):
    model, opt, _ = _model()
    with SaveEngine(store) as engine:
        first = engine.save(_sources(model, opt), SaveRequest(step=1, tiers=ALL_TIERS, reason="a"))
        assert first.done() and (first.writer, first.staging) == ("sync", "sync")  # no wait for the start-up
        assert engine.start(wait_s=120)
        expected = _clone(model.state_dict())
        second = engine.save(_sources(model, opt), SaveRequest(step=2, tiers=ALL_TIERS, reason="b"))
        _step(model, opt)
        assert second.wait(60).step == 2 and second.writer == "process"
    assert first.wait().step == 1
    _assert_state_equal(store.load("step:2").weights, expected)


def test_a_writer_process_that_died_leaves_saves_synchronous(store, caplog):
    model, opt, _ = _model()
    engine = _started(store)
    psutil.Process(engine.writer_pid).kill()  # e.g. the OOM killer
    for _ in range(6000):  # until the engine sees it gone (its last threads exit after it shows as a zombie)
        if not engine.start():
            break
        time.sleep(0.01)
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine")
    handle = engine.save(_sources(model, opt), SaveRequest(step=1, tiers=ALL_TIERS, reason="a"))
    assert handle.wait(60).step == 1 and handle.writer == "sync"
    assert "the writer process" in caplog.text and "exited; saves are written synchronously" in caplog.text
    engine.close()


def test_a_slow_snapshot_injected_through_the_fault_hook_is_blocking_time(store, monkeypatch):
    model, opt, _ = _model()
    monkeypatch.setenv("HF_DYNAMIC_CKPT_FAULT", "snapshot@step=2@rank=0:sleep=300")
    with SaveEngine(store, mode="sync") as engine:
        first = engine.save(_sources(model, opt), SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="a"))
        first.wait(60)
        second = engine.save(_sources(model, opt), SaveRequest(step=2, tiers={Tier.WEIGHTS}, reason="a"))
        second.wait(60)
    assert first.blocking_ms < 300 <= second.blocking_ms


def test_snapshot_buffers_in_shared_memory(store, tmp_path, monkeypatch, caplog):
    from hf_dynamic_ckpt.engine.snapshot import new_shared_storage

    # torch.UntypedStorage._new_shared fills the pages (posix_fallocate) while it holds the GIL.
    def refuse(nbytes):  # type: ignore[no-untyped-def]
        raise AssertionError("_new_shared holds the GIL while it reserves the pages")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", refuse)
    storage = new_shared_storage(3 << 20)
    assert storage is not None and storage.is_shared() and storage.nbytes() == 3 << 20
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"hf-dynamic-ckpt-{os.getpid()}-")]  # unlinked
    assert new_shared_storage(1 << 20, directory=str(tmp_path / "missing")) is None
    assert new_shared_storage(0) is None
    model, opt, _ = _model()
    with _started(store) as engine:  # the buffers are the writer process's view of the snapshot: no second copy
        expected = _clone(model.state_dict())
        handle = engine.save(_sources(model, opt), SaveRequest(step=1, tiers=ALL_TIERS, reason="a"), rng=RNG)
        _step(model, opt)
        info = handle.wait(60)
        assert engine.buffer_bytes > 0
    _assert_state_equal(store.load(info).weights, expected)

    def no_space(nbytes: int, pinned: bool) -> torch.UntypedStorage:  # Docker's default /dev/shm is 64 MiB
        raise RuntimeError(f"unable to reserve {nbytes} bytes of shared memory: No space left on device")

    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine")
    with _started(store, allocate=no_space) as engine:
        handle = engine.save(_sources(model, opt), SaveRequest(step=2, tiers=ALL_TIERS, reason="b"), rng=RNG)
        assert handle.done() and handle.staging == "streaming" and engine.buffer_bytes == 0
    assert "of shared memory for the weights snapshot could not be reserved (unable to reserve" in caplog.text
    assert "--shm-size" in caplog.text
    _assert_state_equal(store.load(handle.wait()).weights, _clone(model.state_dict()))


def test_cached_weights_reuses_the_mapping_until_a_parameter_is_replaced():
    model, opt, _ = _model()
    calls = []

    def build():
        calls.append(1)
        return model.state_dict()

    weights = CachedWeights(model, build)
    first = weights()
    assert weights() is first and len(calls) == 1
    _step(model, opt)  # in-place updates are visible through the cached views
    assert torch.equal(weights()["0.weight"], model[0].weight) and len(calls) == 1
    model[0].weight = torch.nn.Parameter(torch.zeros(16, 8))  # storage replaced: rebuild
    fresh = weights()
    assert len(calls) == 2 and fresh is not first
    assert torch.equal(fresh["0.weight"], torch.zeros(16, 8))


def test_cached_weights_checks_data_pointers_of_what_the_mapping_aliases_only():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    calls = []

    def adapters():  # like get_peft_model_state_dict: a subset of the parameters
        calls.append(1)
        return {"1.weight": model[1].weight.detach()}

    weights = CachedWeights(model, adapters)
    first = weights()
    model[0].weight.data = torch.zeros(5, 6)  # a tensor the mapping does not hold moved: still valid
    assert weights() is first and len(calls) == 1
    model[1].weight.data = torch.ones(2, 5)  # what the mapping aliases moved: rebuilt
    assert weights() is not first and len(calls) == 2
    assert torch.equal(weights()["1.weight"], torch.ones(2, 5)) and len(calls) == 2
    model[0] = torch.nn.Linear(6, 5)  # a replaced module: rebuilt
    weights()
    model.register_buffer("extra", torch.zeros(1))  # a new slot: rebuilt
    weights()
    assert len(calls) == 4

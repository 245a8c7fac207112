"""Staging that fits: the budget (margin + a training step's peak), releasing held buffers, prepare under a limit."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import psutil
import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS, MANIFEST_NAME, Tier
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.engine.staging import Headroom, StagingMode, headroom_of, plan_staging
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(tmp_path / "ckpt")
    yield s
    s.close()


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt) -> None:
    model(torch.randn(2, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _manifest(info) -> dict:
    return json.loads((Path(info.path) / MANIFEST_NAME).read_text())


def test_budget_keeps_room_for_a_training_step():
    h = Headroom(total_bytes=1000 * MiB, available_bytes=400 * MiB, source="cgroup", transient_bytes=100 * MiB)
    assert h.budget(0.15) == 150 * MiB  # 400 - 150 (margin) - 100 (a step's peak)
    assert plan_staging(150 * MiB, margin=0.15, headroom=h).mode == StagingMode.BUFFERED
    plan = plan_staging(150 * MiB + 1, margin=0.15, headroom=h)
    assert plan.mode == StagingMode.STREAMING
    assert plan.reason == (
        "a buffered snapshot would need 150.0 MiB but only 150.0 MiB are free above the 15% margin of the cgroup "
        "limit (1000.0 MiB, 400.0 MiB available, 100.0 MiB kept for a training step): saving synchronously from "
        "live tensors instead"
    )


def test_a_small_limit_keeps_at_least_the_write_buffers_free():
    h = Headroom(total_bytes=400 * MiB, available_bytes=200 * MiB, source="cgroup")  # 15 % would be 60 MiB
    assert h.reserve(0.15) == 128 * MiB and h.budget(0.15) == 72 * MiB
    assert plan_staging(72 * MiB, margin=0.15, headroom=h).mode == StagingMode.BUFFERED
    plan = plan_staging(72 * MiB + 1, margin=0.15, headroom=h)
    assert plan.mode == StagingMode.STREAMING
    assert "only 72.0 MiB are free above the 128 MiB reserve of the cgroup limit (400.0 MiB" in plan.reason


def test_held_buffers_that_no_longer_fit_are_released():
    h = Headroom(total_bytes=1000 * MiB, available_bytes=100 * MiB, source="cgroup")
    plan = plan_staging(0, margin=0.15, headroom=h, held_bytes=300 * MiB)
    assert plan.mode == StagingMode.STREAMING
    assert plan.reason == (
        "the 300.0 MiB of snapshot buffers held leave -50.0 MiB above the 15% margin of the cgroup limit "
        "(1000.0 MiB, 100.0 MiB available): releasing them and saving synchronously from live tensors"
    )


def test_v1_cgroup_headroom(tmp_path: Path):
    d = tmp_path / "job"
    d.mkdir()
    (d / "memory.limit_in_bytes").write_text(f"{1000 * MiB}\n")
    (d / "memory.usage_in_bytes").write_text(f"{700 * MiB}\n")
    (d / "memory.stat").write_text(f"shmem {300 * MiB}\ntotal_inactive_file {200 * MiB}\n")
    h = headroom_of(d)
    assert (h.total_bytes, h.available_bytes, h.source) == (1000 * MiB, 500 * MiB, "cgroup")
    assert h.detail == f"cgroup v1 {d}" and h.transient_bytes >= 0


def test_engine_releases_buffers_when_memory_gets_short(store, caplog):
    model, opt = _model()
    _step(model, opt)
    headroom = {"h": Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="cgroup")}
    engine = SaveEngine(store, headroom=lambda: headroom["h"])
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    first = engine.save(sources, SaveRequest(step=1, tiers=ALL_TIERS, reason="a"), rng={"seed": 1})
    first.wait(60)
    held = engine.buffer_bytes
    assert first.staging == "buffered" and held > 0
    # The training's own memory grew: the held buffers now cross the margin.
    headroom["h"] = Headroom(total_bytes=100 * MiB, available_bytes=10 * MiB, source="cgroup")
    _step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    caplog.set_level(logging.DEBUG, logger="hf_dynamic_ckpt.engine")
    second = engine.save(sources, SaveRequest(step=2, tiers=ALL_TIERS, reason="b"), rng={"seed": 1})
    assert second.done() and second.staging == "streaming" and engine.buffer_bytes == 0
    assert f"the {held / MiB:.1f} MiB of snapshot buffers held leave" in caplog.text
    assert f"released {held / MiB:.1f} MiB of snapshot buffers" in caplog.text
    info = second.wait()
    assert _manifest(info)["timings_ms"]["staging"] == "streaming"
    loaded = store.load("step:2")
    assert all(torch.equal(loaded.weights[k], v) for k, v in expected.items())
    # Room again: the next save allocates buffers anew.
    headroom["h"] = Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="cgroup")
    third = engine.save(sources, SaveRequest(step=3, tiers=ALL_TIERS, reason="c"), rng={"seed": 1})
    info = third.wait(60)
    assert third.staging == "buffered" and engine.buffer_bytes == held
    assert _manifest(info)["timings_ms"]["staging"] == "buffered"
    engine.close()


def test_prepare_under_a_limit_waits_for_the_first_step(store):
    model, opt = _model()
    limited = Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="cgroup")
    engine = SaveEngine(store, headroom=lambda: limited)
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    # Before any step the peak of a step is unknown: nothing is allocated yet, not even the weights.
    assert engine.prepare(sources, wait=True) == 0 and engine.buffer_bytes == 0
    _step(model, opt)  # the post-step hook prepares every tier now
    engine._preparer.finish(engine._snapshotter)
    weights = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    optim = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    assert engine.buffer_bytes == weights + optim
    engine.close()


def test_prepare_without_a_limit_starts_at_once(store):
    model, opt = _model()
    roomy = Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="host")
    engine = SaveEngine(store, headroom=lambda: roomy)
    weights = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert engine.prepare(StateSources(weights=model.state_dict, optimizer=opt), {Tier.WEIGHTS}, wait=True) == weights
    engine.close()


def test_no_writer_process_under_a_tight_limit(store, caplog):
    tight = Headroom(total_bytes=2 << 30, available_bytes=1 << 30, source="cgroup", detail="cgroup v1 /x")
    caplog.set_level(logging.INFO, logger="hf_dynamic_ckpt.engine.staging")
    with SaveEngine(store, mode="process", headroom=lambda: tight) as engine:
        assert engine.mode == "thread"
    assert "memory limit (cgroup v1 /x, 1024.0 MiB available, 15% margin): the checkpoint writer runs on a " \
           "thread, not in a second process" in caplog.text


def test_the_default_probe_finds_the_cgroup_once(monkeypatch):
    from hf_dynamic_ckpt.engine import staging

    found: list[int] = []
    monkeypatch.delenv("HF_DYNAMIC_CKPT_CGROUP_DIR", raising=False)
    monkeypatch.setattr(staging, "find_memory_cgroup", lambda: found.append(1))  # no cgroup: the machine's memory
    probe = staging.default_headroom(None)
    readings = [probe() for _ in range(3)]
    assert found == [1]  # parsing /proc/self/mountinfo on every save cost ~1 ms of blocking time
    assert all(h.source == "host" and h.total_bytes == psutil.virtual_memory().total for h in readings)


def test_the_default_probe_walks_the_hierarchy_once_and_reads_limits_every_time(tmp_path, monkeypatch):
    from hf_dynamic_ckpt import sysmem
    from hf_dynamic_ckpt.engine import staging

    parent = tmp_path / "cg"
    job = parent / "job"
    job.mkdir(parents=True)
    for d, limit, current in ((parent, "max", 3 << 30), (job, str(1 << 30), 256 << 20)):
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text("inactive_file 0\n")
    monkeypatch.setenv("HF_DYNAMIC_CKPT_CGROUP_DIR", str(job))
    probe = staging.default_headroom(None)
    walked: list[Path] = []
    real = sysmem.cgroup_version
    monkeypatch.setattr(sysmem, "cgroup_version", lambda d: walked.append(d) or real(d))
    first = probe()
    assert first.source == "cgroup" and first.total_bytes == 1 << 30 and first.available_bytes == 768 << 20
    (job / "memory.max").write_text(f"{512 << 20}\n")  # the limit changed while training: seen at once
    second = probe()
    assert second.total_bytes == 512 << 20 and second.available_bytes == 256 << 20
    assert walked == []  # the levels were found when the probe was made


def test_a_save_into_held_buffers_probes_memory_while_it_copies(store):
    import threading

    model, opt = _model()
    _step(model, opt)
    calls = []

    def headroom():
        calls.append(threading.current_thread().name)
        return Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="cgroup")

    def probe_threads():
        return {t for t in threading.enumerate() if t.name.startswith("hf_dynamic_ckpt-memprobe")}

    others = probe_threads()  # engines of earlier tests that were not closed
    engine = SaveEngine(store, headroom=headroom)
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    calls.clear()  # the constructor's writer-mode check
    engine.save(sources, SaveRequest(step=1, tiers=ALL_TIERS, reason="a"), rng={"seed": 1}).wait(60)
    assert calls == [threading.current_thread().name]  # allocates: the plan comes first, on this thread
    _step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    second = engine.save(sources, SaveRequest(step=2, tiers=ALL_TIERS, reason="b"), rng={"seed": 1})
    assert second.staging == "buffered"
    assert len(calls) == 2 and calls[1].startswith("hf_dynamic_ckpt-memprobe")  # reuses: probed meanwhile
    second.wait(60)
    loaded = store.load("step:2")
    assert all(torch.equal(loaded.weights[k], v) for k, v in expected.items())
    ours = probe_threads() - others
    engine.close()
    assert len(ours) == 1 and not any(t.is_alive() for t in ours)

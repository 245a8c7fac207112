"""Host memory as the OOM killer sees it (cgroup v1 / v2 trees faked in tmp_path) and the staging decision."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import psutil
import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS, MANIFEST_NAME
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest
from hf_dynamic_ckpt.sysmem import Headroom, find_memory_cgroup, headroom, plan_staging

MiB, GiB = 1 << 20, 1 << 30
V1_NO_LIMIT = "9223372036854771712"  # what cgroup v1 reports for "no limit"


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("HF_DYNAMIC_CKPT_CGROUP_DIR", raising=False)


def _v2(path: Path, *, max_: str, current: int | str = 700 * MiB, stat: str | None = "inactive_file 0\n") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.max").write_text(max_ + "\n")
    (path / "memory.current").write_text(f"{current}\n")
    if stat is not None:
        (path / "memory.stat").write_text(stat)
    return path


def _v1(path: Path, *, limit: str = V1_NO_LIMIT, memsw: str | None = None, usage: int = 0, stat: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.limit_in_bytes").write_text(limit + "\n")
    if memsw is not None:
        (path / "memory.memsw.limit_in_bytes").write_text(memsw + "\n")
    (path / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (path / "memory.stat").write_text(stat)
    return path


def _cgroup_room(d: Path) -> tuple[int, int, str]:
    h = headroom(d)
    assert h.source == "cgroup", h
    return h.total_bytes, h.available_bytes, h.detail


def test_the_working_set_is_usage_less_inactive_file_never_negative(tmp_path):
    d = _v2(tmp_path / "cg", max_=str(1000 * MiB), stat=f"anon 1\nfile 999\ninactive_file {200 * MiB}\nactive_file 5\n")
    assert _cgroup_room(d) == (1000 * MiB, 500 * MiB, f"cgroup v2 {d}")
    _v2(d, max_=str(100 * MiB), current=50 * MiB, stat=f"inactive_file {90 * MiB}\n")
    assert _cgroup_room(d)[1] == 100 * MiB
    for stat in (None, "inactive_file lots\n"):  # missing or malformed memory.stat: no page cache counted
        (d / "memory.stat").unlink(missing_ok=True)
        _v2(d, max_=str(1000 * MiB), stat=stat)
        assert _cgroup_room(d)[1] == 300 * MiB


def test_no_limit_or_no_usage_is_the_machine(tmp_path):
    vm = psutil.virtual_memory()
    for max_ in ("max", "", "-5", "12 kB"):
        h = headroom(_v2(tmp_path / "unlimited", max_=max_))
        assert (h.source, h.total_bytes) == ("host", vm.total), max_
    assert headroom(_v2(tmp_path / "no_current", max_="1000", current="")).source == "host"
    assert headroom(tmp_path / "missing").source == "host"
    assert headroom(_v2(tmp_path / "roomy", max_=str(vm.total * 4), current=0)).source == "host"  # the machine binds
    h = headroom(None)
    assert h.source == "host" and h.total_bytes == vm.total and 0 <= h.available_bytes <= h.total_bytes
    assert h.transient_bytes >= 0 and h.fraction == pytest.approx(1 - h.available_bytes / h.total_bytes)


def test_v2_memory_high_and_the_tightest_ancestor_bind(tmp_path):
    parent = _v2(tmp_path / "cg", max_=str(4 * GiB), current=3 * GiB)
    child = _v2(parent / "job", max_="max", current=1 * GiB)
    # The parent (4 GiB, 3 GiB used by the job and its siblings) leaves less than the unlimited child.
    assert _cgroup_room(child) == (4 * GiB, 1 * GiB, f"cgroup v2 {parent}")
    (child / "memory.high").write_text(str(int(1.5 * GiB)) + "\n")  # throttled above it: a limit too
    assert _cgroup_room(child) == (int(1.5 * GiB), GiB // 2, f"cgroup v2 {child}")


def test_v1_limit_memsw_and_hierarchical_limit(tmp_path):
    stat = "cache 300\nrss 500\nshmem 200\ninactive_file 50\ntotal_inactive_file 100\n"
    job = _v1(tmp_path / "memory" / "slurm" / "job_1", limit=str(2 * GiB), usage=GiB, stat=stat)
    # usage_in_bytes counts the children too: so does total_inactive_file. Shared memory stays in.
    assert _cgroup_room(job) == (2 * GiB, GiB + 100, f"cgroup v1 {job}")
    _v1(job, limit=str(2 * GiB), memsw=str(GiB + GiB // 2), usage=GiB, stat=stat)  # memory + swap is tighter
    assert _cgroup_room(job)[0] == GiB + GiB // 2
    # A limit set above this cgroup that the container cannot see: hierarchical_memory_limit.
    _v1(job, usage=GiB, stat=stat + f"hierarchical_memory_limit {int(1.25 * GiB)}\nhierarchical_memsw_limit "
                                    f"{V1_NO_LIMIT}\n")
    assert _cgroup_room(job)[0] == int(1.25 * GiB)


def test_v1_walks_up_to_the_ancestor_with_the_least_headroom(tmp_path):
    root = _v1(tmp_path / "memory", usage=20 * GiB)
    slurm = _v1(root / "slurm", limit=str(8 * GiB), usage=7 * GiB, stat="total_inactive_file 0\n")
    job = _v1(slurm / "job_1", limit=str(4 * GiB), usage=GiB, stat="total_inactive_file 0\n")
    assert _cgroup_room(job) == (8 * GiB, GiB, f"cgroup v1 {slurm}")  # 8 - 7 < 4 - 1
    _v1(slurm, usage=2 * GiB, stat="total_inactive_file 0\n")  # no limit there any more
    assert _cgroup_room(job) == (4 * GiB, 3 * GiB, f"cgroup v1 {job}")
    assert headroom(root).source == "host"  # no level with a limit


def _mountinfo(tmp_path: Path, lines: list[tuple[str, Path, str, str]]) -> Path:
    f = tmp_path / "mountinfo"
    f.write_text("".join(f"{i} 1 0:{i} {root} {mp} rw - {fs} {fs} rw{opts}\n"
                         for i, (root, mp, fs, opts) in enumerate(lines)) + "garbage line\n")
    return f


def test_the_memory_cgroup_on_v1_v2_hybrid_and_in_a_namespace(tmp_path, monkeypatch):
    v1 = tmp_path / "v1"
    job = _v1(v1 / "process_api" / "abc", limit=str(GiB), usage=10)
    _v1(v1)
    unified = tmp_path / "unified"
    (unified / "user.slice").mkdir(parents=True)  # a v2 mount without the memory controller
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/process_api/abc\n3:cpu,cpuacct:/\n0::/user.slice\n")
    info = _mountinfo(tmp_path, [("/", tmp_path, "tmpfs", ""), ("/", v1 / "cpu", "cgroup", ",cpu"),
                                 ("/", v1, "cgroup", ",memory"), ("/", unified, "cgroup2", "")])
    assert find_memory_cgroup(proc, info) == job  # hybrid: v2 has no memory files, v1 does
    assert _cgroup_room(job)[0] == GiB

    # Pure v2: the memory controller is on the unified mount.
    pod = _v2(unified / "kubepods" / "pod1", max_="max")
    proc.write_text("0::/kubepods/pod1\n")
    assert find_memory_cgroup(proc, info) == pod

    # A cgroup namespace with a bind-mounted sub-tree: mount root /kubepods shows pod1 at <mount>/pod1.
    info = _mountinfo(tmp_path, [("/kubepods", unified / "kubepods", "cgroup2", "")])
    assert find_memory_cgroup(proc, info) == pod
    # Host paths that are not visible under the mount: the mount is the container's own cgroup.
    _v2(unified / "kubepods", max_=str(GiB))
    proc.write_text("0::/elsewhere/pod9\n")
    assert find_memory_cgroup(proc, info) == unified / "kubepods"
    assert find_memory_cgroup(tmp_path / "missing", info) is None
    monkeypatch.setenv("HF_DYNAMIC_CKPT_CGROUP_DIR", str(job))  # the override (tests, odd mounts)
    assert find_memory_cgroup(tmp_path / "missing", info) == job


@pytest.mark.parametrize(
    ("needed", "available", "mode"),
    [
        (0, 0, "streaming"),  # no room above the margin at all
        (100 * MiB, 300 * MiB, "buffered"),
        (150 * MiB, 300 * MiB, "buffered"),  # 300 - 15% of 1000 = 150: exactly fits
        (150 * MiB + 1, 300 * MiB, "streaming"),
        (10 * MiB, 100 * MiB, "streaming"),  # available is inside the margin
    ],
)
def test_plan_staging_keeps_the_margin_free(needed, available, mode):
    plan = plan_staging(needed, margin=0.15, headroom=Headroom(1000 * MiB, available, "cgroup"))
    assert (plan.mode, plan.needed_bytes) == (mode, needed)


def test_staging_reasons_name_the_numbers():
    h = Headroom(total_bytes=1000 * MiB, available_bytes=400 * MiB, source="cgroup", transient_bytes=100 * MiB)
    assert h.budget(0.15) == 150 * MiB  # 400 - 150 (margin) - 100 (a step's peak)
    assert plan_staging(150 * MiB, margin=0.15, headroom=h).mode == "buffered"
    assert plan_staging(150 * MiB + 1, margin=0.15, headroom=h).reason == (
        "a buffered snapshot would need 150.0 MiB but only 150.0 MiB are free above the 15% margin of the cgroup "
        "limit (1000.0 MiB, 400.0 MiB available, 100.0 MiB kept for a training step): saving synchronously from "
        "live tensors instead")
    small = Headroom(total_bytes=400 * MiB, available_bytes=200 * MiB, source="cgroup")  # 15 % would be 60 MiB
    assert small.reserve(0.15) == 128 * MiB and small.budget(0.15) == 72 * MiB
    assert plan_staging(72 * MiB, margin=0.15, headroom=small).mode == "buffered"
    assert "only 72.0 MiB are free above the 128 MiB reserve of the cgroup limit (400.0 MiB" in plan_staging(
        72 * MiB + 1, margin=0.15, headroom=small).reason
    held = plan_staging(0, margin=0.15, headroom=Headroom(1000 * MiB, 100 * MiB, "cgroup"), held_bytes=300 * MiB)
    assert (held.mode, held.reason) == ("streaming", (
        "the 300.0 MiB of snapshot buffers held leave -50.0 MiB above the 15% margin of the cgroup limit "
        "(1000.0 MiB, 100.0 MiB available): releasing them and saving synchronously from live tensors"))


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 64)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _staging(info) -> str:
    return json.loads((Path(info.path) / MANIFEST_NAME).read_text())["timings_ms"]["staging"]


def test_the_engine_releases_its_buffers_when_memory_gets_short_and_holds_them_again(tmp_path, caplog):
    model, opt = _model()
    room = {"h": Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="cgroup")}
    store = CheckpointStore(tmp_path / "ckpt")
    engine = SaveEngine(store, headroom=lambda: room["h"])
    assert engine.start(wait_s=120)  # with room for a writer process
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    first = engine.save(sources, SaveRequest(step=1, tiers=ALL_TIERS, reason="a"), rng={"seed": 1})
    assert _staging(first.wait(60)) == "buffered"
    held = engine.buffer_bytes
    assert first.staging == "buffered" and held > 0
    # The training's own memory grew: the held buffers now cross the margin.
    room["h"] = Headroom(total_bytes=100 * MiB, available_bytes=10 * MiB, source="cgroup")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    caplog.set_level(logging.DEBUG, logger="hf_dynamic_ckpt.engine")
    second = engine.save(sources, SaveRequest(step=2, tiers=ALL_TIERS, reason="b"), rng={"seed": 1})
    assert second.done() and second.staging == "streaming" and engine.buffer_bytes == 0
    assert f"save of step 2 streams synchronously: the {held / MiB:.1f} MiB of snapshot buffers held leave" \
        in caplog.text
    assert f"released {held / MiB:.1f} MiB of snapshot buffers" in caplog.text
    assert _staging(second.wait()) == "streaming"
    assert all(torch.equal(store.load("step:2").weights[k], v) for k, v in expected.items())
    room["h"] = Headroom(total_bytes=1 << 40, available_bytes=1 << 39, source="cgroup")  # room again
    third = engine.save(sources, SaveRequest(step=3, tiers=ALL_TIERS, reason="c"), rng={"seed": 1})
    assert _staging(third.wait(60)) == "buffered" and engine.buffer_bytes == held
    engine.close()
    store.close()


def test_the_engine_reads_the_cgroup_the_environment_names_at_every_save(tmp_path, monkeypatch, caplog):
    job = _v2(tmp_path / "cg" / "job", max_=str(1 << 40), current=0)
    monkeypatch.setenv("HF_DYNAMIC_CKPT_CGROUP_DIR", str(job))
    model, opt = _model()
    store = CheckpointStore(tmp_path / "ckpt")
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.engine")
    with SaveEngine(store) as engine:
        assert engine.start(wait_s=120)
        sources = StateSources(weights=model.state_dict, optimizer=opt)
        first = engine.save(sources, SaveRequest(step=1, tiers=ALL_TIERS, reason="a"), rng={"seed": 1})
        first.wait(60)
        (job / "memory.max").write_text(f"{64 * MiB}\n")  # the limit changed while training: seen at once
        second = engine.save(sources, SaveRequest(step=2, tiers=ALL_TIERS, reason="b"), rng={"seed": 1})
    assert (first.staging, second.staging) == ("buffered", "streaming")
    assert f"128 MiB reserve of the cgroup limit ({64:.1f} MiB" in caplog.text
    store.close()

"""Engine lifecycle end to end: hundreds of saves, exit/exception flushes, failures, memory headroom."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest
import torch

from examples.toy import tiny_qwen2
from hf_dynamic_ckpt.constants import ALL_TIERS, MANIFEST_NAME, Tier
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.errors import SaveError
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RNG = {"python": [3, 1, 4]}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _run(script: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_300_saves_do_not_leak_fds_threads_or_buffers(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    with CheckpointStore(tmp_path / "ckpt") as store, SaveEngine(store) as engine:
        assert engine.start(wait_s=120)
        for step in range(1, 11):
            engine.save(sources, SaveRequest(step=step, tiers=ALL_TIERS, reason="warm-up"), rng=RNG)
        engine.wait()
        fds, threads, held = _fds(), threading.active_count(), engine.buffer_bytes
        names = sorted(t.name for t in threading.enumerate())
        for step in range(11, 301):
            with torch.no_grad():
                model.weight.add_(0.001)
            engine.save(sources, SaveRequest(step=step, tiers=ALL_TIERS, reason="interval"), rng=RNG)
        last = engine.wait()
        # Nothing may grow (an unrelated descriptor closed by the GC may make it shrink).
        assert _fds() <= fds and threading.active_count() <= threads, (
            fds, threads, names, sorted(t.name for t in threading.enumerate()))
        assert engine.buffer_bytes == held  # buffers reused
        assert last.step == 300 and len(store.list()) == 300 and engine.writer_pid is not None
        assert torch.equal(store.load("step:300").weights["weight"], model.weight.detach())


def test_process_writer_isolates_snapshots_and_reports_failures(tmp_path):
    model = tiny_qwen2(seed=0, hidden_size=32, num_layers=1, vocab_size=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0)
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    store = CheckpointStore(tmp_path / "ckpt")
    engine = SaveEngine(store)
    assert engine.start(wait_s=120)
    handles, expected = [], []
    for step in range(1, 6):
        expected.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        handles.append(engine.save(sources, SaveRequest(step=step, tiers=ALL_TIERS, reason="interval"), rng=RNG))
        _train_step(model, opt, step)  # mutate right after the snapshot
        if step == 2:
            handles[-1].wait(120)
            fds, threads = _fds(), threading.active_count()
    assert [h.wait(120).step for h in handles] == [1, 2, 3, 4, 5]
    assert {h.writer for h in handles} == {"process"}
    assert (_fds(), threading.active_count()) == (fds, threads)
    for step, weights in enumerate(expected, start=1):
        loaded = store.load(f"step:{step}").weights
        assert all(torch.equal(loaded[k], v) for k, v in weights.items()), step

    # The task directory becomes unwritable for the writer process (a file where the step folder must go).
    (store.task_dir / f"step-6.tmp-{store.session_id}").write_text("in the way")
    failed = engine.save(sources, SaveRequest(step=6, tiers=ALL_TIERS, reason="interval"), rng=RNG)
    with pytest.raises(SaveError, match=r"save of step 6 \(interval\) failed: .*the previous checkpoint \(step 5\)"):
        failed.wait(120)
    assert store.resolve("auto").step == 5
    (store.task_dir / f"step-6.tmp-{store.session_id}").unlink()
    assert engine.save(sources, SaveRequest(step=7, tiers=ALL_TIERS, reason="interval"), rng=RNG).wait(120).step == 7
    pid = engine.writer_pid
    engine.close()
    assert not psutil.pid_exists(pid)  # the writer process was stopped and reaped
    engine.close()
    store.close()


def test_context_manager_flushes_on_exception(tmp_path):
    model = tiny_qwen2(seed=0, hidden_size=32, num_layers=1, vocab_size=128)
    store = CheckpointStore(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="boom"), SaveEngine(store) as engine:
        handle = engine.save(StateSources(weights=model.state_dict),
                             SaveRequest(step=1, tiers={Tier.WEIGHTS}, reason="x"))
        raise RuntimeError("boom")
    assert handle.done() and (store.task_dir / "step-1" / MANIFEST_NAME).exists()
    store.close()


def test_interpreter_exit_after_an_exception_flushes_the_save_in_flight(tmp_path):
    root = tmp_path / "ckpt"
    (tmp_path / "gate").mkdir()
    result = _run(
        """
        import os, pathlib, sys, threading, torch
        sys.path.insert(0, "tests/unit")  # the writer process imports the gated store from there
        from test_engine import GATE_ENV, GatedStore
        from hf_dynamic_ckpt.engine import SaveEngine
        from hf_dynamic_ckpt.state import StateSources
        from hf_dynamic_ckpt.store import SaveRequest
        from hf_dynamic_ckpt.constants import Tier
        os.environ[GATE_ENV] = sys.argv[2]  # the writer process holds the write until <gate>/go exists
        store = GatedStore(sys.argv[1])
        w = {"w": torch.arange(10.0)}
        engine = SaveEngine(store)
        assert engine.start(wait_s=120)
        handle = engine.save(StateSources(weights=lambda: w),
                             SaveRequest(step=7, tiers={Tier.WEIGHTS}, reason="last"))
        assert not handle.done()
        threading.Timer(1.0, pathlib.Path(sys.argv[2], "go").touch).start()  # still writing when the script dies
        raise RuntimeError("training crashed")
        """,
        str(root), str(tmp_path / "gate"),
    )
    assert result.returncode == 1 and "RuntimeError: training crashed" in result.stderr
    manifest = json.loads((root / "default" / "step-7" / MANIFEST_NAME).read_text())
    assert manifest["step"] == 7 and manifest["reason"] == "last"
    with CheckpointStore(root) as store:
        assert torch.equal(store.load("step:7").weights["w"], torch.arange(10.0))


_RSS_SCRIPT = """
import json, os, resource, sys
from pathlib import Path
import psutil, torch
torch.set_num_threads(1)
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest
from hf_dynamic_ckpt.constants import ALL_TIERS

mode, root, cgroup = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
MiB = 1 << 20
store = CheckpointStore(root)
params = [torch.nn.Parameter(torch.randn(4 * MiB)) for _ in range(8)]  # 8 x 16 MiB
opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
for p in params:
    opt.state[p]["momentum_buffer"] = torch.randn_like(p)  # no backward: no gradient high-water mark
weights = {f"p{i}": p for i, p in enumerate(params)}
sources = StateSources(weights=lambda: weights, optimizer=opt)
snapshot_bytes = 2 * sum(p.numel() * 4 for p in params)
base = psutil.Process().memory_info().rss
# A cgroup limit far below a second copy of the state (256 MiB). The streaming save still
# needs a bounded working set: one tensor's byte-grouped copy plus multi-threaded zstd's job
# buffers (about 100 MiB with 2 workers at level 3, independent of the state's size).
limit = base + 160 * MiB
cgroup.mkdir(parents=True, exist_ok=True)
(cgroup / "memory.max").write_text(str(limit if mode == "tight" else 1 << 45))
(cgroup / "memory.current").write_text(str(base))
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
os.environ["HF_DYNAMIC_CKPT_CGROUP_DIR"] = str(cgroup)
engine = SaveEngine(store, memory_margin=0.05)
started = engine.start(wait_s=120)  # not under the tight limit: no room for a second interpreter
handle = engine.save(sources, SaveRequest(step=1, tiers=ALL_TIERS, reason="x"), rng={"seed": 0})
info = handle.wait()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before reading anything back
ok = torch.equal(store.load("step:1").weights["p3"], params[3].detach())
engine.close()
print(json.dumps({"staging": handle.staging, "started": started, "base": base, "limit": limit, "peak": peak,
                  "peak_before": peak_before, "snapshot_bytes": snapshot_bytes, "ok": ok, "step": info.step}))
"""


def test_memory_headroom_streams_and_peak_rss_stays_under_the_limit(tmp_path):
    tight = _run(_RSS_SCRIPT, "tight", str(tmp_path / "a"), str(tmp_path / "cg-a"))
    assert tight.returncode == 0, tight.stderr
    t = json.loads(tight.stdout.strip().splitlines()[-1])
    assert t["staging"] == "sync" and not t["started"] and t["ok"] and t["step"] == 1  # from the live tensors
    assert t["snapshot_bytes"] > t["limit"] - t["base"]
    assert t["peak_before"] <= t["limit"]  # setup itself fits, so the peak below is the save's
    assert t["peak"] <= t["limit"], f"peak RSS {t['peak']} above the cgroup limit {t['limit']}"
    # Control: with room, the buffered path does hold a second copy (so the check above can fail).
    roomy = _run(_RSS_SCRIPT, "roomy", str(tmp_path / "b"), str(tmp_path / "cg-b"))
    assert roomy.returncode == 0, roomy.stderr
    r = json.loads(roomy.stdout.strip().splitlines()[-1])
    assert r["staging"] == "buffered" and r["started"] and r["ok"]
    assert r["peak"] - r["base"] >= r["snapshot_bytes"]

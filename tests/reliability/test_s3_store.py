"""Object-store roots against a real S3-protocol server (moto on 127.0.0.1) through s3fs.

What a user of ``root="s3://..."`` is promised (docs/storage.md): a checkpoint exists iff its
manifest is in the bucket and verifies; an upload that dies leaves the previous checkpoint
the restore point and nothing half-committed visible; transient endpoint errors are retried
(bounded); `reindex` rebuilds the catalog from the bucket; deletions stay inside the root;
credentials never reach a message or a log.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_server import bucket_keys
from store_helpers import tiny_state

from hf_dynamic_ckpt.constants import ALL_TIERS
from hf_dynamic_ckpt.errors import FAULT_ENV, SaveError
from hf_dynamic_ckpt.store import CheckpointStore, Remote, RemoteSpec, RemoteStorageError, Removal, SaveRequest, redact

REPO = Path(__file__).resolve().parents[2]


def open_store(url: str, options: dict[str, Any], cache: Path, **kw: Any) -> CheckpointStore:
    return CheckpointStore(url, task_id="t", storage_options=options, cache_dir=cache, backoff_s=0.01, **kw)


def save(store: CheckpointStore, step: int, **kw: Any) -> Any:
    return store.save(tiny_state(step, **kw), SaveRequest(step=step, reason="interval"))


def assert_equal_state(loaded: Any, step: int) -> None:
    want = tiny_state(step)
    assert torch.equal(loaded.weights["w"], want.weights["w"])
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], want.optimizer["state"][0]["exp_avg"])
    assert loaded.scheduler == {"last_epoch": step} and loaded.sampler == {"batches": step}


# -- save / load -----------------------------------------------------------------------------
def test_save_then_load_from_another_cache_is_bit_exact(s3_root, tmp_path):
    url, options = s3_root
    with open_store(url, options, tmp_path / "node-a") as store:
        for step in (1, 2, 3):
            save(store, step)
    keys = bucket_keys(url, options)
    assert "run/t/step-3/manifest.json" in keys and "run/t/step-3/weights.safetensors" in keys
    # Another machine: an empty cache; only manifests are pulled at open, files on load.
    reader = open_store(url, options, tmp_path / "node-b", cleanup=False)
    assert [i.step for i in reader.list()] == [3, 2, 1]
    assert sorted(os.listdir(tmp_path / "node-b/t/step-3")) == ["manifest.json"]
    loaded = reader.load("auto")
    assert loaded.info.step == 3
    assert_equal_state(loaded, 3)
    assert reader.verify("step:1") == []
    reader.close()


def test_frozen_records_travel_and_a_bucket_of_the_previous_version_with_blobs_resumes(s3_root, tmp_path):
    url, options = s3_root
    with open_store(url, options, tmp_path / "a") as store:
        save(store, 1, frozen=0.5)
    assert not [k for k in bucket_keys(url, options) if "/blobs/" in k]  # frozen weights: recorded, not written
    with open_store(url, options, tmp_path / "b", read_only=True) as reader:
        assert reader.load("step:1").frozen == tiny_state(1, frozen=0.5).frozen
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    legacy = REPO / "tests" / "data" / "legacy_store" / "full"
    for path in sorted(p for p in legacy.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{url.removeprefix('s3://')}/full/{path.relative_to(legacy).as_posix()}")
    with CheckpointStore(url, task_id="full", storage_options=options, cache_dir=tmp_path / "c", read_only=True) as old:
        loaded = old.load("step:5")  # its blob (the frozen weight of that version) is downloaded and verified
        assert set(loaded.info.blobs) == {"embed.weight"} and old.verify("step:6") == []
        assert loaded.weights["embed.weight"].shape == (64, 8)


def test_two_ranks_without_a_shared_directory_commit_through_the_bucket(s3_root, tmp_path):
    # Two "nodes": each rank has its own cache; rank 1's files and done note go through the bucket.
    url, options = s3_root
    kw = {"world_size": 2, "session_id": "sess1", "rank_timeout_s": 30.0}
    rank0 = open_store(url, options, tmp_path / "node0", rank=0, **kw)
    rank1 = open_store(url, options, tmp_path / "node1", rank=1, **kw)
    out: dict[int, Any] = {}

    def run(store: CheckpointStore, rank: int) -> None:
        state = tiny_state(4) if rank == 0 else tiny_state(4).__class__(step=4, rng={"seed": 100 + rank})
        out[rank] = store.save(state, SaveRequest(step=4, reason="interval"))

    threads = [threading.Thread(target=run, args=(s, r)) for r, s in ((1, rank1), (0, rank0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[1] is None and out[0] is not None and out[0].step == 4
    keys = bucket_keys(url, options)
    assert "run/t/step-4/rng-rank1.json" in keys and "run/t/step-4/manifest.json" in keys
    assert not [k for k in keys if ".tmp-" in k]  # the done notes went with the commit
    assert not (tmp_path / "node1/t").exists() or not [p for p in (tmp_path / "node1/t").iterdir() if ".tmp-" in p.name]
    # The same step again (same session): rank 0 answers "already committed" from its cache; rank 1, whose cache
    # never saw the commit, must reach the same answer from the bucket (no done note, no overwritten file).
    out.clear()

    def again(store: CheckpointStore, rank: int) -> None:
        state = tiny_state(4) if rank == 0 else tiny_state(4).__class__(step=4, rng={"seed": 999})
        out[rank] = store.save(state, SaveRequest(step=4, reason="interval"))

    threads = [threading.Thread(target=again, args=(s, r)) for r, s in ((1, rank1), (0, rank0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[1] is None and out[0] is not None and out[0].step == 4
    assert not [k for k in bucket_keys(url, options) if ".tmp-" in k]
    reader = open_store(url, options, tmp_path / "node2", read_only=True)
    assert reader.load("auto", rank=1).rng == {"seed": 101}
    assert reader.verify("step:4") == []
    for s in (reader, rank1, rank0):
        s.close()


# -- crashes and faults ------------------------------------------------------------------------
def test_upload_dying_mid_save_keeps_the_previous_checkpoint_and_gc_removes_the_rest(s3_root, tmp_path,
                                                                                     monkeypatch):
    url, options = s3_root
    store = open_store(url, options, tmp_path / "a", retries=1)
    save(store, 1)
    # The first files land, then the endpoint is gone (for the cleanup too).
    monkeypatch.setenv(FAULT_ENV, "remote@op=put@name=step-2/sampler.json:raise=ECONNREFUSED;"
                                  "remote@op=rm:raise=ECONNREFUSED")
    with pytest.raises(SaveError, match=r"committing step 2 .* failed: .*failed after 2 attempt\(s\): "
                                        r"ConnectionRefusedError: \[Errno 111\] Connection refused \(injected"):
        save(store, 2)
    monkeypatch.delenv(FAULT_ENV)
    keys = bucket_keys(url, options)
    partial = [k for k in keys if k.startswith("run/t/step-2/")]
    assert partial and "run/t/step-2/manifest.json" not in partial  # half an upload, not a checkpoint
    assert [i.step for i in store.list()] == [1]
    assert not (tmp_path / "a/t/step-2").exists()
    reader = open_store(url, options, tmp_path / "b", read_only=True)
    assert [i.step for i in reader.list()] == [1]
    assert_equal_state(reader.load("auto"), 1)
    reader.close()
    store.close()
    # The next writer's open removes the partial upload; step 1 stays.
    with open_store(url, options, tmp_path / "a"):
        keys = bucket_keys(url, options)
    assert not [k for k in keys if k.startswith("run/t/step-2")]
    assert "run/t/step-1/manifest.json" in keys


KILLER = r"""
import os, sys
sys.path.insert(0, sys.argv[4])
from store_helpers import tiny_state
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest
store = CheckpointStore(sys.argv[1], task_id="t", storage_options={"endpoint_url": sys.argv[2]}, cache_dir=sys.argv[3])
store.save(tiny_state(1), SaveRequest(step=1, reason="interval"))
os.environ["HF_DYNAMIC_CKPT_FAULT"] = "remote@op=put@name=step-2/rng-rank0.json:kill"  # dies mid-upload of step 2
store.save(tiny_state(2), SaveRequest(step=2, reason="interval"))
"""


def test_sigkill_during_upload_leaves_the_previous_restore_point(s3_root, s3_endpoint, tmp_path):
    url, options = s3_root
    proc = subprocess.run([sys.executable, "-c", KILLER, url, s3_endpoint, str(tmp_path / "a"),
                           str(Path(__file__).parents[1])], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -9, proc.stderr[-2000:]
    keys = bucket_keys(url, options)
    assert [k for k in keys if k.startswith("run/t/step-2/")] and "run/t/step-2/manifest.json" not in keys
    reader = open_store(url, options, tmp_path / "b", read_only=True)
    assert [i.step for i in reader.list()] == [1]
    assert_equal_state(reader.load("auto"), 1)
    reader.close()
    # A tool's gc cannot tell a dead upload above the newest checkpoint from one in flight: it says so.
    with open_store(url, options, tmp_path / "c", cleanup=False) as tool:
        report = tool.gc()
        assert report.temp_dirs == [] and any(k.startswith("remote:step-2 kept: an upload without a manifest")
                                              for k in report.kept)
    # The writer's next open (nothing of its own in flight) removes it; step 1 stays.
    with open_store(url, options, tmp_path / "a"):
        keys = bucket_keys(url, options)
    assert not [k for k in keys if k.startswith("run/t/step-2")] and "run/t/step-1/manifest.json" in keys


def test_transient_errors_are_retried_and_a_dead_endpoint_is_bounded(s3_root, tmp_path, caplog, monkeypatch):
    url, options = s3_root
    secret_options = {**options, "key": "testing-key-id", "secret": "s3cr3t-secret-value"}  # moto takes any
    store = CheckpointStore(url, task_id="t", storage_options=secret_options, cache_dir=tmp_path / "a", retries=3,
                            backoff_s=0.01)
    # Throttled three times in a row (the 4th attempt goes through), and twice on another call.
    throttled = [f"remote@op=put@name=step-1/weights.safetensors@attempt={a}:raise=ECONNRESET" for a in (1, 2, 3)]
    throttled += [f"remote@op=put@name=step-1/manifest.json@attempt={a}:raise=ECONNRESET" for a in (1, 2)]
    monkeypatch.setenv(FAULT_ENV, ";".join(throttled))
    with caplog.at_level(logging.DEBUG, logger="hf_dynamic_ckpt"):
        save(store, 1)
    assert store.remote.retried == 5
    assert "run/t/step-1/manifest.json" in bucket_keys(url, options)
    assert_equal_state(store.load("step:1"), 1)
    # Bounded: 3 retries, then the save fails with the redacted URL and nothing is committed.
    monkeypatch.setenv(FAULT_ENV, "remote@op=put@name=step-2/weights.safetensors:raise=ECONNRESET")  # for good
    with caplog.at_level(logging.DEBUG, logger="hf_dynamic_ckpt"), \
            pytest.raises(SaveError, match=r"failed after 4 attempt\(s\): ConnectionResetError") as err:
        save(store, 2)
    monkeypatch.delenv(FAULT_ENV)
    assert "run/t/step-2/manifest.json" not in bucket_keys(url, options)
    assert [i.step for i in store.list()] == [1]
    text = caplog.text + str(err.value) + repr(store.spec) + repr(store.remote.spec)
    for secret in ("s3cr3t-secret-value", "testing-secret-value"):
        assert secret not in text
    assert "retry 1/3" in caplog.text
    store.close()


def test_reindex_from_the_bucket_rebuilds_the_catalog_and_cli_lists_it(s3_root, s3_endpoint, tmp_path, monkeypatch,
                                                                        capsys):
    url, options = s3_root
    with open_store(url, options, tmp_path / "a") as store:
        for step in (1, 2):
            save(store, step)
        store.pin("step:1")
    monkeypatch.setenv("HF_DYNAMIC_CKPT_CACHE", str(tmp_path / "cache"))  # a machine that never saw the run
    monkeypatch.setenv("HF_DYNAMIC_CKPT_STORAGE_OPTIONS", json.dumps({"endpoint_url": s3_endpoint}))
    from hf_dynamic_ckpt.cli import main
    from hf_dynamic_ckpt.store import default_cache_dir

    assert main(["reindex", url]) == 0
    assert capsys.readouterr().out.startswith(f"reindexed {url}: 2 checkpoint(s)")
    import sqlite3

    with sqlite3.connect(default_cache_dir(url, 0) / "catalog.db") as db:
        assert sorted(db.execute("SELECT step FROM checkpoints WHERE task_id='t'").fetchall()) == [(1,), (2,)]
    assert main(["verify", url, "step:2", "--task", "t"]) == 0
    assert "OK   t/step-2" in capsys.readouterr().out
    # `python -m hf_dynamic_ckpt.cli ls s3://...`, as a user types it.
    proc = subprocess.run([sys.executable, "-m", "hf_dynamic_ckpt.cli", "ls", url, "--json"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert [(r["task"], r["step"], r["pinned"]) for r in rows] == [("t", 2, False), ("t", 1, True)]


def test_retention_and_gc_delete_only_inside_the_task_prefix(s3_root, tmp_path):
    url, options = s3_root
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    canaries = [f"{bucket}/other/keep.bin", f"{bucket}/run-sibling/t/step-1/manifest.json",
                f"{bucket}/run/other-task/step-1/manifest.json", f"{bucket}/run/t-2/blobs/x.bin", f"{bucket}/keep.txt"]
    for key in canaries:
        fs.pipe_file(key, b"do not touch")
    with open_store(url, options, tmp_path / "a") as store:
        for step in (1, 2, 3, 4):
            save(store, step, frozen=float(step))
        infos = {i.step: i for i in store.list()}
        fs.pipe_file(f"{bucket}/run/t/blobs/{'0' * 64}.safetensors", b"a blob of an earlier version nothing uses")
        report = store.prune([Removal(infos[1], ALL_TIERS), Removal(infos[2], ALL_TIERS)])
        assert sorted(report.removed) == [1, 2] and report.blobs == [f"remote:{'0' * 64}.safetensors"]
        store.gc()
    keys = bucket_keys(url, options)
    assert not [k for k in keys if k.startswith(("run/t/step-1", "run/t/step-2", "run/t/blobs/"))]
    assert [k for k in keys if k.startswith("run/t/step-3")]
    for key in canaries:
        assert fs.cat_file(key) == b"do not touch", key
    remote = Remote(RemoteSpec(url, options), "t")
    for names in ((f"{bucket}/run/other-task/step-1/manifest.json",), ("..", "other-task"), ()):
        with pytest.raises(RemoteStorageError, match=r"is not a plain name|refusing to delete the whole task prefix"):
            remote.remove(*names)


def test_redaction_and_spec_repr_hide_credentials():
    assert redact("https://user:pw@host.example/x?sig=abc&se=1") == "https://***@host.example/x?***"
    assert redact("s3://bucket/run1") == "s3://bucket/run1"
    spec = RemoteSpec("s3://b/r", {"key": "AKIA-should-not-show", "secret": "hidden-secret"})
    assert "AKIA" not in repr(spec) and "hidden" not in repr(spec) and "s3://b/r" in repr(spec)


def test_file_url_root_and_config_accept_urls(tmp_path):
    # file:// goes through the same seam (directories created on demand); no server needed.
    from hf_dynamic_ckpt import SmartCkptConfig

    config = SmartCkptConfig(root="s3://bucket/run1", remote={"storage_options": {"endpoint_url": "http://127.0.0.1:9"}})
    assert config.root == "s3://bucket/run1" and config.remote.storage_options == {"endpoint_url": "http://127.0.0.1:9"}
    url = (tmp_path / "bucket").as_uri() + "/run"
    with CheckpointStore(url, task_id="t", cache_dir=tmp_path / "cache-a") as store:
        save(store, 5)
    assert sorted(os.listdir(tmp_path / "bucket/run/t/step-5")) == [
        "manifest.json", "optimizer.json", "optimizer.tensors.zst", "rng-rank0.json", "sampler.json",
        "weights.safetensors"]
    with CheckpointStore(url, task_id="t", cache_dir=tmp_path / "cache-b", read_only=True) as reader:
        assert_equal_state(reader.load("auto"), 5)


def test_memory_tier_with_a_bucket_root_restores_from_memory_and_persists_into_the_bucket(s3_root, tmp_path):
    # A Trainer run on an s3:// root, the whole job SIGKILLed after step 13, no disk save before (an upload in flight
    # makes the writer process skip slots meanwhile: counted, docs/memory_tier.md): the slots are keyed by the root's
    # local cache on this node; the restart restores step 12 from host memory, bit-exact, and persists it into the
    # bucket.
    import json as _json

    from hf_dynamic_ckpt.store.slots import slots_dir

    url, options = s3_root
    worker = REPO / "tests" / "integration" / "memory_tier_worker.py"
    cache = tmp_path / "cache"

    def run(out: Path, *args: str, killed: bool = False) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, str(worker), "--out", str(out), *args], capture_output=True, text=True,
                              timeout=600, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(REPO), FAULT_ENV: ""})
        (out / "stderr.txt").write_text(proc.stderr)
        assert proc.returncode == (-9 if killed else 0), proc.stderr[-3000:]
        return {} if killed else _json.loads((out / ("resumed.json" if "--resume" in args else "losses.json"))
                                             .read_text())

    uninterrupted = {int(s): loss for s, loss in run(tmp_path / "ref", "--base_interval", "100")["losses"]}
    remote = ("--root", url, "--storage_options", _json.dumps(options), "--cache_dir", str(cache), "--base_interval",
              "100")
    run(tmp_path / "run", *remote, "--kill_at", "13", "--kill_group", killed=True)
    resumed = run(tmp_path / "run", *remote, "--resume")
    assert resumed["resumed_from"] == 12, (tmp_path / "run" / "stderr.txt").read_text()[-3000:]
    slots = Path(resumed["resumed_path"]).parent.parent
    assert slots.parent.name.startswith("hf-dynamic-ckpt-")  # read from host memory
    assert all(loss == uninterrupted[int(s)] for s, loss in resumed["losses"])
    keys = bucket_keys(url, options)
    assert any(k.endswith("/default/step-12/manifest.json") for k in keys), keys
    assert not slots.exists() and not slots_dir(cache / "rank-0", "default").exists()

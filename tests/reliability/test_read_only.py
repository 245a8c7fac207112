"""Read-only stores and concurrent readers.

The failures it guards: `ls`/`verify` on a read-only store crashing with a raw
`sqlite3.OperationalError`; `verify --all` ending in a traceback for checkpoints that
retention deletes during the scan.

The tests run as root here, where `chmod` binds nothing, so "read-only" is checked by what
matters: with `read_only=True` not one byte, inode or timestamp under the root changes
(compared before/after). Where the platform allows it, the same store is also opened on a
real read-only bind mount (`unshare -rm`), and on a chmod-ed tree for non-root users.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import save_state
from store_helpers import tiny_state, tree

from hf_dynamic_ckpt.constants import CATALOG_NAME, Tier
from hf_dynamic_ckpt.errors import FAULT_ENV, CheckpointNotFoundError, DynamicCkptError
from hf_dynamic_ckpt.store import CheckpointStore, Lineage


@pytest.fixture
def root(tmp_path: Path) -> Path:
    store = CheckpointStore(tmp_path / "root", task_id="run", session_id="w")
    for step in (1, 2, 3):
        save_state(store, tiny_state(step, frozen=1.0), reason="interval", healthy=step != 3)
    store.fork(timeline="t2", after_step=1, session="w2", parent=Lineage(session="w2", timeline="t2", parent_step=1))
    store.close()
    return tmp_path / "root"


def _read_everything(store: CheckpointStore) -> dict[str, object]:
    return {
        "list": [i.step for i in store.list(include_unhealthy=True, include_abandoned=True)],
        "auto": store.resolve("auto").step,
        "verify": [store.verify(s) for s in (1, 2, 3)],
        "weights": store.load("step:2", tiers={Tier.WEIGHTS}).frozen == tiny_state(2, frozen=1.0).frozen,
        "gc": store.gc(dry_run=True).abandoned,
    }


def test_read_only_store_changes_nothing_on_disk(root: Path) -> None:
    before = tree(root)
    store = CheckpointStore(root, task_id="run", read_only=True)
    seen = _read_everything(store)
    assert seen == {"list": [3, 2, 1], "auto": 1, "verify": [[], [], []], "weights": True, "gc": []}
    for attempt in (lambda: save_state(store, tiny_state(4), reason="r"), lambda: store.delete("step:1"),
                    lambda: store.pin("step:1"), lambda: store.gc(),
                    lambda: store.fork(timeline="x", after_step=None, session="x")):
        with pytest.raises(DynamicCkptError, match="opened with read_only=True"):
            attempt()
    store.close()
    assert tree(root) == before


def test_read_only_store_works_without_a_catalog(root: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{root / CATALOG_NAME}{suffix}").unlink(missing_ok=True)
    before = tree(root)
    store = CheckpointStore(root, task_id="run", read_only=True)
    assert [i.step for i in store.list(include_unhealthy=True, include_abandoned=True)] == [3, 2, 1]
    assert store.resolve("auto").step == 1 and store.verify("step:1") == []
    store.close()
    assert tree(root) == before and not (root / CATALOG_NAME).exists()


_ON_READ_ONLY_MEDIA = """
import json, os, sys
from hf_dynamic_ckpt.store import CheckpointStore
try:
    open(os.path.join(sys.argv[1], "probe"), "wb").close()
    out = {"writable": True}
except OSError:
    out = {"writable": False}
for kw in ({"read_only": True}, {"cleanup": False}):
    store = CheckpointStore(sys.argv[1], task_id="run", **kw)
    out[next(iter(kw))] = [[i.step for i in store.list(include_unhealthy=True)], store.verify("step:1")]
    store.close()
print(json.dumps(out))
"""


def test_readers_work_on_read_only_media(root: Path) -> None:
    script = textwrap.dedent(_ON_READ_ONLY_MEDIA)
    before = tree(root)
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)
        cmd = [sys.executable, "-c", script, str(root)]
    elif shutil.which("unshare") and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0:
        mount = f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && "
        cmd = ["unshare", "-m", "sh", "-c", mount + f'"{sys.executable}" -c \'{script}\' "{root}"']
    else:
        pytest.skip("no way to make a read-only tree here: running as root without mount namespaces")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    finally:
        if os.geteuid() != 0:
            subprocess.run(["chmod", "-R", "u+w", str(root)], check=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"writable": False, "read_only": [[1], []], "cleanup": [[1], []]}
    assert tree(root) == before


def test_verify_of_a_checkpoint_deleted_during_the_scan_is_a_note(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    import threading

    store = CheckpointStore(root, task_id="run", session_id="v")
    other = store.task_dir / "step-3"
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv(FAULT_ENV, f"read@step=3@name=weights.safetensors:gate={gate}")
    errors: list[BaseException] = []

    def verify() -> None:
        try:
            store.verify("step:3")
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=verify)
    thread.start()
    while not (gate / "read.reached").exists():  # verify is checking step 3's files
        thread.join(0.01)
    shutil.rmtree(other)  # another process deletes the checkpoint mid-scan
    (gate / "read.go").touch()
    thread.join(60)
    monkeypatch.delenv(FAULT_ENV)
    assert len(errors) == 1 and isinstance(errors[0], CheckpointNotFoundError)
    assert re.search(r"step 3 .* was deleted before or while it was verified", str(errors[0]))
    with pytest.raises(CheckpointNotFoundError, match="step 3 has no committed checkpoint"):
        store.verify("step:3")
    assert store.verify("step:2") == [] and torch.equal(store.load("step:2").weights["w"], tiny_state(2).weights["w"])
    store.close()


def _catalog_file(root: Path) -> tuple[bytes, int, list[str]]:
    """catalog.db's bytes and mtime, and which SQLite side files lie next to it."""
    path = root / CATALOG_NAME
    return path.read_bytes(), path.stat().st_mtime_ns, sorted(p.name for p in root.glob(f"{CATALOG_NAME}-*"))


@pytest.mark.parametrize("known", [False, True], ids=["catalog-says-ok", "catalog-says-corrupt"])
def test_reads_of_a_corrupt_checkpoint_leave_the_catalog_file_as_it_was(tmp_path: Path, known: bool,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # A read never writes: `ls`, `show` and `load_checkpoint` find step 2 damaged (the load falls back to step 1) and
    # keep that finding in memory; the catalog file stays byte for byte what the writer left.
    from hf_dynamic_ckpt.cli import main
    from hf_dynamic_ckpt.export import load_checkpoint

    store = CheckpointStore(tmp_path, task_id="run")
    for step in (1, 2):
        save_state(store, tiny_state(step), reason="interval")
    weights = store.task_dir / "step-2" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    if known:
        assert store.verify("step:2") != []  # the writer recorded the finding
    store.close()
    before = _catalog_file(tmp_path)
    for args in (["ls"], ["ls", "--all", "--json"], ["show", "auto"], ["show", "step:2"]):
        assert main([args[0], str(tmp_path), *args[1:]]) == 0
    assert load_checkpoint(tmp_path, "auto", task_id="run").info.step == 1
    assert load_checkpoint(tmp_path, "step:1", task_id="run").info.step == 1
    capsys.readouterr()
    assert _catalog_file(tmp_path) == before

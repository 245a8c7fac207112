"""Containment: nothing a manifest says, and no link planted in the store, makes it touch a file outside.

The failures it guards: `../` and absolute names in a manifest unlinked by ordinary
retention; a `../` task id turned into a path; cleanup and blob collection following a linked
`blobs/` or step directory and deleting outside files; `verify` stat-ing any file a manifest
names. Each test plants one such thing next to a canary file outside the root and runs
load, verify, delete, retention, gc and a fresh open against it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from helpers import save_state
from store_helpers import Canary, file_checksum, read_manifest_json, tiny_state, write_manifest_json

from hf_dynamic_ckpt.constants import OPTIMIZER_NAME, Tier
from hf_dynamic_ckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, DynamicCkptError
from hf_dynamic_ckpt.store import CheckpointStore, Removal


def _store(tmp_path: Path, **kw: object) -> CheckpointStore:
    kw.setdefault("session_id", "s1")
    return CheckpointStore(tmp_path / "root", task_id="run", **kw)  # type: ignore[arg-type]


def _attempt(fn: object, *args: object, **kwargs: object) -> None:
    """Run a store operation; a refusal is fine, touching the canary is not (checked by the caller)."""
    with contextlib.suppress(DynamicCkptError, OSError):
        fn(*args, **kwargs)  # type: ignore[operator]


def _every_operation(store: CheckpointStore, step: int) -> None:
    """Load, verify, delete tiers, retention, gc and a whole delete of `step`, in that order."""
    _attempt(store.load, f"step:{step}")
    _attempt(store.verify, f"step:{step}")
    _attempt(store.delete, f"step:{step}", tiers={Tier.OPTIMIZER})
    infos = [i for i in store.list(include_unhealthy=True, include_abandoned=True) if i.step == step]
    _attempt(store.prune, [Removal(i, frozenset({Tier.OPTIMIZER})) for i in infos])
    _attempt(store.gc)
    _attempt(store.delete, f"step:{step}", force=True)


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_manifest_file_names_outside_the_checkpoint_are_never_touched(tmp_path: Path, form: str) -> None:
    canary = Canary(tmp_path / "outside")
    store = _store(tmp_path)
    save_state(store, tiny_state(1), reason="r")
    info = save_state(store, tiny_state(2), reason="r")
    directory = Path(info.path)
    name = os.path.relpath(canary.path, directory) if form == "relative" else str(canary.path)
    manifest = read_manifest_json(directory)
    manifest["files"][name] = {"size": len(canary.data), "checksum": file_checksum(canary.path), "tier": "optimizer",
                               "rank": None}
    write_manifest_json(directory, manifest)

    problems = store.verify("step:2")
    assert len(problems) == 1 and "is not an allowed file name of a checkpoint" in problems[0]
    assert str(len(canary.data)) + " bytes" not in problems[0]  # verify never stat-ed the outside file
    with pytest.raises(CorruptCheckpointError, match="not an allowed file name"):
        store.load("step:2")
    _every_operation(store, 2)
    store.close()
    _store(tmp_path).close()  # a fresh open (cleanup, catalog sync) too
    assert canary.intact()
    assert (tmp_path / "root" / "run" / "step-1").is_dir()


@pytest.mark.parametrize("table", ["blobs", "frozen"])
def test_blob_digest_that_is_a_path_is_refused(tmp_path: Path, table: str) -> None:
    canary = Canary(tmp_path / "outside", name="x.safetensors")
    store = _store(tmp_path)
    info = save_state(store, tiny_state(1, frozen=1.0), reason="r")
    manifest = read_manifest_json(Path(info.path))
    # A blob record is what an earlier version wrote for a frozen weight; a frozen record names no file at all.
    manifest[table] = {"frozen": {"digest": "../../../outside/x", "dtype": "float32", "shape": [64], "size": 8}}
    write_manifest_json(Path(info.path), manifest)
    with pytest.raises(CorruptCheckpointError, match=f"{table.removesuffix('s')} record of weight 'frozen' is "
                                                     "malformed"):
        store.load("step:1")
    _every_operation(store, 1)
    store.close()
    assert canary.intact()


def test_linked_blob_directory_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    canary = Canary(outside, name="f" * 64 + ".safetensors")
    store = _store(tmp_path)
    save_state(store, tiny_state(1), reason="r")
    save_state(store, tiny_state(2), reason="r")
    (store.task_dir / "blobs").symlink_to(outside, target_is_directory=True)
    store.delete("step:1")  # collects unreferenced blobs: must not walk into the link
    _every_operation(store, 2)
    store.close()
    _store(tmp_path).close()  # cleanup of blob temp files must not follow it either
    assert canary.intact()


def test_linked_step_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    store = _store(tmp_path)
    info = save_state(store, tiny_state(1), reason="r")
    outside = tmp_path / "outside" / "copy"
    import shutil

    shutil.copytree(info.path, outside)
    manifest = read_manifest_json(outside)
    manifest["step"] = 9
    write_manifest_json(outside, manifest)
    canary = Canary(outside, name=OPTIMIZER_NAME, data=(outside / OPTIMIZER_NAME).read_bytes())
    (store.task_dir / "step-9").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointNotFoundError, match="step 9 has no committed checkpoint"):
        store.resolve("step:9")
    assert [i.step for i in store.list(include_unhealthy=True, include_abandoned=True)] == [1]
    _every_operation(store, 9)
    store.close()
    _store(tmp_path).close()
    assert canary.intact() and (outside / "manifest.json").exists()


def test_manifest_task_id_never_becomes_a_path(tmp_path: Path) -> None:
    store = _store(tmp_path)
    save_state(store, tiny_state(1), reason="r")
    info = save_state(store, tiny_state(2), reason="r")
    manifest = read_manifest_json(Path(info.path))
    manifest["task_id"] = "../x"
    write_manifest_json(Path(info.path), manifest)
    store.close()
    store = _store(tmp_path)  # the catalog is synced from the manifests
    assert {i.step: (i.task_id, i.status) for i in store.list(include_unhealthy=True)} == {
        1: ("run", "ok"), 2: ("run", "corrupt")}
    with pytest.raises(CorruptCheckpointError, match=r"says task '../x' step 2, but it lives in 'run'/step-2"):
        store.load("step:2")
    assert store.resolve("auto").step == 1
    store.close()


def test_leftover_links_are_removed_without_touching_their_targets(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    canary = Canary(outside)
    store = _store(tmp_path)
    save_state(store, tiny_state(1, frozen=1.0), reason="r")
    store.close()
    task = tmp_path / "root" / "run"
    (task / "blobs").mkdir()  # the blob store of an earlier version
    (task / "step-3.tmp-old").symlink_to(outside, target_is_directory=True)
    (task / "blobs" / "x.safetensors.tmp-old").symlink_to(canary.path)
    _store(tmp_path, session_id="s2").close()
    assert not os.path.lexists(task / "step-3.tmp-old")
    assert not os.path.lexists(task / "blobs" / "x.safetensors.tmp-old")
    assert canary.intact()


def test_links_in_place_of_checkpoint_files_or_the_task_are_never_followed(tmp_path: Path) -> None:
    canary = Canary(tmp_path / "outside", data=b"x" * 64)
    store = _store(tmp_path)
    info = save_state(store, tiny_state(1), reason="r")
    save_state(store, tiny_state(2), reason="r")
    directory = Path(info.path)
    (directory / "sampler.json").unlink()
    (directory / "sampler.json").symlink_to(canary.path)
    (directory / "PINNED").symlink_to(canary.path)
    assert store.verify("step:1") == ["sampler.json (tier state): not a regular file (a symbolic link or directory is "
                                      "refused)"]
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        store.load("step:1")
    _every_operation(store, 1)
    store.close()
    assert canary.intact() and not (tmp_path / "root" / "run" / "step-1").exists()
    (tmp_path / "linked").symlink_to(tmp_path / "root" / "run", target_is_directory=True)
    with pytest.raises(ConfigError, match="is a symbolic link; the store refuses to work through links"):
        CheckpointStore(tmp_path, task_id="linked")
    assert canary.intact()

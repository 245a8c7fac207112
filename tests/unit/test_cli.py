"""hf-dynamic-ckpt CLI: output and exit codes of ls, show, verify, reindex."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import save_state

from hf_dynamic_ckpt.cli import build_parser, human_size, main
from hf_dynamic_ckpt.constants import CATALOG_NAME, MANIFEST_NAME, WEIGHTS_NAME
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    store = CheckpointStore(tmp_path, task_id="run")
    for step in (10, 20):
        state = CheckpointState(step=step, weights={"w": torch.zeros(256, 8)},
                                optimizer={"state": {}, "param_groups": []}, rng={"s": step})
        save_state(store, state, reason="interval" if step == 10 else "loss_spike", signals={"loss": 2.5 / step},
                   debug_info=[{"step": s, "loss": 0.1 * s, "grad_norm": 1.0} for s in range(step - 3, step + 1)])
    store.pin("step:10")
    store.close()
    return tmp_path


def test_human_size() -> None:
    assert [human_size(n) for n in (0, 1023, 1536, 5 * 1024**2, 3 * 1024**4)] == [
        "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 TiB"]


def test_ls_prints_a_table(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["TASK", "STEP", "REASON", "TIERS", "PROCS", "SIZE", "LOSS", "HEALTHY", "PINNED",
                                "STATUS"]
    assert lines[1].split() == ["run", "20", "loss_spike", "optimizer,state,weights", "1",
                                *human_size(_bytes(root, 20)).split(), "0.125", "yes", "no", "ok"]
    assert lines[2].split()[:3] == ["run", "10", "interval"] and lines[2].split()[-3:] == ["yes", "yes", "ok"]
    # Why each is kept: step 10 is pinned (its reason named), step 20 by retention.
    assert lines[3].startswith("pinned (interval): kept whatever retention says until unpinned")
    assert len(lines) == 4


def _listed(out: str) -> list[str]:
    """The steps of `ls`'s table rows (task `run`), in order."""
    return [line.split()[1] for line in out.splitlines()[1:] if line.split()[:1] == ["run"]]


def _bytes(root: Path, step: int) -> int:
    d = root / "run" / f"step-{step}"
    return sum(p.stat().st_size for p in d.iterdir() if p.name not in (MANIFEST_NAME, "PINNED"))


def test_ls_empty_and_missing_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A folder that holds no store is an error (not "no checkpoints" with exit status 0),
    # and a command that only looks never creates a catalog there.
    for command in (["ls"], ["verify"], ["show", "auto"] and ["ls", "--all"]):
        assert main([command[0], str(tmp_path), *command[1:]]) == 2
        assert f"no hf_dynamic_ckpt store under {tmp_path}: pass the store directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["ls", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == (f"hf-dynamic-ckpt: error: root {tmp_path / 'nope'} does not exist; pass the "
                                       "store directory (the one holding catalog.db) or the training output_dir that "
                                       "holds smart_ckpt/.\n")
    (tmp_path / "afile.txt").write_text("x")
    assert main(["ls", str(tmp_path / "afile.txt")]) == 2
    assert f"error: root {tmp_path / 'afile.txt'} is a file, not a directory; pass the store" in capsys.readouterr().err
    (tmp_path / "afile.txt").unlink()
    CheckpointStore(tmp_path / "empty").close()  # a store without checkpoints: listed as such
    assert main(["ls", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out == f"no checkpoints under {tmp_path / 'empty'}\n"


def test_show_text_and_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(root), "step:20"]) == 0
    out = capsys.readouterr().out
    assert "task / step  run / 20" in out and "reason       loss_spike" in out
    assert "tiers        optimizer, state, weights" in out
    assert f"  {WEIGHTS_NAME}" in out and "rng-rank0.json" in out
    assert "debug_info (last steps):" in out and "grad_norm" in out
    assert "signals:     loss=0.125" in out

    assert main(["show", str(root), "10", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == json.loads((root / "run" / "step-10" / MANIFEST_NAME).read_text())


def test_show_unknown_ref_is_exit_2_with_available_steps(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(root), "step:15"]) == 2
    assert capsys.readouterr().err.strip().endswith("available steps of task 'run': 10, 20.")


def test_show_needs_task_when_there_are_several(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = CheckpointStore(root, task_id="other")
    save_state(other, CheckpointState(step=1, weights={"w": torch.ones(1)}), reason="x")
    other.close()
    assert main(["show", str(root), "step:1"]) == 2
    assert "holds several tasks (other, run); choose one with --task" in capsys.readouterr().err
    assert main(["show", str(root), "step:1", "--task", "other"]) == 0


def test_verify_all_ok_then_corrupt(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(root), "--all"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["OK   run/step-10", "OK   run/step-20", "2 of 2 checkpoint(s) intact"]
    assert captured.err.splitlines() == ["verify [############............] 1/2 run/step-10",
                                         "verify [########################] 2/2 run/step-20"]

    weights = root / "run" / "step-20" / WEIGHTS_NAME
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "OK   run/step-10" and out[1] == "FAIL run/step-20"
    assert out[2].startswith(f"  - {WEIGHTS_NAME} (tier weights): checksum mismatch")
    assert out[-1] == "1 of 2 checkpoint(s) intact, 1 with problems"
    assert main(["verify", str(root), "step:10"]) == 0
    assert main(["verify", str(root), "step:20"]) == 1
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-1] == "corrupt"  # verify recorded it
    assert main(["verify", str(root), "step:20", "--all"]) == 2


def test_reindex_rebuilds_catalog(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{root / CATALOG_NAME}{suffix}").unlink(missing_ok=True)
    assert main(["reindex", str(root)]) == 0
    assert capsys.readouterr().out == f"reindexed {root}: 2 checkpoint(s)\n"
    assert main(["ls", str(root)]) == 0
    assert _listed(capsys.readouterr().out) == ["20", "10"]


def test_parser_is_extensible_and_runs_as_a_module(root: Path) -> None:
    names = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert names == {"ls", "show", "verify", "reindex", "plot", "pin", "unpin", "rm", "gc", "export"}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "hf_dynamic_ckpt.cli", "verify", str(root), "step:10"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == "OK   run/step-10"
    proc = subprocess.run([sys.executable, "-m", "hf_dynamic_ckpt.cli"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and "COMMAND" in proc.stderr


def test_task_or_checkpoint_dir_as_root_is_a_usage_error(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for wrong in (root / "run", root / "run" / "step-10"):
        assert main(["ls", str(wrong)]) == 2
        err = capsys.readouterr().err
        assert err == (f"hf-dynamic-ckpt: error: root {wrong} is a checkpoint or task directory, not a store root; "
                       f"pass {root} (the directory holding catalog.db) and name the checkpoint by its reference and "
                       "task.\n")


def test_output_dir_json_and_version(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    out_dir = tmp_path.parent / f"{tmp_path.name}-train_out"
    shutil.copytree(root, out_dir / "smart_ckpt")
    assert main(["ls", str(out_dir), "--json"]) == 0  # the training output_dir finds its smart_ckpt/
    rows = json.loads(capsys.readouterr().out)
    assert [(r["task"], r["step"], r["pinned"], r["abandoned"]) for r in rows] == [("run", 20, False, False),
                                                                                    ("run", 10, True, False)]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("hf-dynamic-ckpt ")


def test_show_rounds_numbers(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(root), "step:10"]) == 0
    out = capsys.readouterr().out
    assert "loss=0.25" in out and "0.30000000000000004" not in out  # debug_info 0.1 * 3, rounded


def test_pin_unpin_rm_and_gc(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rm", str(root), "step:10"]) == 2
    assert "step 10 is pinned; `hf-dynamic-ckpt unpin` it first or pass --force" in capsys.readouterr().err
    assert main(["unpin", str(root), "step:10"]) == 0
    assert capsys.readouterr().out == "unpinned run/step-10\n"
    assert main(["pin", str(root), "step:20"]) == 0
    assert main(["rm", str(root), "step:10"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("removed step 10 (")
    assert not (root / "run" / "step-10").exists()
    leftover = root / "run" / "step-30.tmp-deadbeef0000"
    leftover.mkdir()
    (leftover / "weights.safetensors").write_bytes(b"x" * 4096)
    assert main(["gc", str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove leftover step-30.tmp-deadbeef0000" in out and "would free 4.0 KiB" in out
    assert leftover.exists()  # dry run
    assert main(["gc", str(root)]) == 0
    assert "freed 4.0 KiB" in capsys.readouterr().out and not leftover.exists()


def test_ls_all_lists_abandoned_checkpoints(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = CheckpointStore(root, task_id="run")
    assert store.fork(timeline="b", after_step=10, session="s2") == [20]
    store.close()
    assert main(["ls", str(root)]) == 0
    assert _listed(capsys.readouterr().out) == ["10"]
    assert main(["ls", str(root), "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines[0].split()[1] == "20" and lines[0].split()[-1] == "abandoned"


def test_read_only_commands_write_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def tree() -> dict[str, int]:
        return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if "catalog.db" not in p.name}

    before = tree()
    for args in (["ls"], ["ls", "--all", "--json"], ["show", "step:10"], ["verify", "--all"]):
        assert main([args[0], str(root), *args[1:]]) == 0
    assert tree() == before


def test_ls_removed_header_agrees_with_the_recorded_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The rows quote the rule each removal recorded (keep_last=4 here); the header must not claim another setting.
    from hf_dynamic_ckpt.policy import plan_retention

    store = CheckpointStore(tmp_path, task_id="run", session_id="s")
    for step in range(1, 7):
        save_state(store, CheckpointState(step=step, weights={"w": torch.full((4,), float(step))}), reason="interval")
    assert store.prune(plan_retention(store.list(), keep_last=4, log_spaced=False, now=1e12)).removed == [1, 2]
    store.close()
    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-4:] == [
        "removed by retention, each with the rule that removed it:",
        "  run: step 1: keep_last=4 (keep_log_spaced=false): only the newest 4 are kept",
        "  run: step 2: keep_last=4 (keep_log_spaced=false): only the newest 4 are kept",
        "  (to keep every checkpoint: train with keep_last: null and storage_levels.level_N.retention_days: null, or "
        "pin it)"]


def _files(top: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `top`: size, mtime_ns, sha256 (directories are left out: SQLite's transient -wal/-shm files
    of an existing catalog touch the root's mtime)."""
    import hashlib

    return {str(p.relative_to(top)): (p.stat().st_size, p.stat().st_mtime_ns,
                                      hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(top.rglob("*")) if p.is_file()}


def test_reads_change_no_file_under_the_output_dir(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # load_checkpoint takes the training output_dir as the commands do, and neither creates a catalog next to the
    # store (after which `ls` said "no checkpoints" and hid out/smart_ckpt).
    import shutil

    from hf_dynamic_ckpt.export import load_checkpoint

    out = root.parent / f"{root.name}-out"
    shutil.copytree(root, out / "smart_ckpt")
    before = _files(out)
    for where in (out, out / "smart_ckpt"):
        assert load_checkpoint(where, "auto", task_id="run").info.step == 20
        assert load_checkpoint(where, "step:10", task_id="run").info.step == 10
        for args in (["ls"], ["ls", "--all", "--json"], ["show", "step:10"], ["verify", "--all"], ["verify", "auto"]):
            assert main([args[0], str(where), *args[1:]]) == 0
        assert _files(out) == before
    capsys.readouterr()
    assert main(["ls", str(out)]) == 0
    assert _listed(capsys.readouterr().out) == ["20", "10"]
    (out / "smart_ckpt" / CATALOG_NAME).chmod(0o444)  # a catalog it may not write: read into memory instead
    try:
        assert load_checkpoint(out, "auto", task_id="run").info.step == 20
        assert _files(out) == before
    finally:
        (out / "smart_ckpt" / CATALOG_NAME).chmod(0o644)


def test_a_path_without_a_store_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hf_dynamic_ckpt.errors import CheckpointNotFoundError, ConfigError
    from hf_dynamic_ckpt.export import export_checkpoint, load_checkpoint

    missing, empty = tmp_path / "nope", tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "afile.txt").write_text("x")
    for load in (lambda r: load_checkpoint(r, "auto"), lambda r: export_checkpoint(r, "auto", tmp_path / "x")):
        with pytest.raises(CheckpointNotFoundError) as e:
            load(missing)
        assert str(e.value) == (f"root {missing} does not exist; pass the store directory (the one holding "
                                "catalog.db) or the training output_dir that holds smart_ckpt/.")
        with pytest.raises(CheckpointNotFoundError) as e:
            load(empty)
        assert str(e.value) == (f"no hf_dynamic_ckpt store under {empty}: pass the store directory (the one holding "
                                "catalog.db) or the training output_dir that holds smart_ckpt/.")
        with pytest.raises(ConfigError, match=r"^root \S+afile.txt is a file, not a directory; pass the store"):
            load(tmp_path / "afile.txt")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["afile.txt", "empty"]

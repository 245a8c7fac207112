"""Crash consistency: a saving process SIGKILLed at random moments never breaks the store.

After every kill: the newest committed checkpoint loads with exactly the tensors saved at
its step, `verify` passes for every committed checkpoint, no temporary directory survives
the next open, and the catalog agrees with the directories (also after `reindex`).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dynamic_ckpt.constants import MANIFEST_NAME, TMP_MARKER
from hf_dynamic_ckpt.store import CheckpointStore, parse_step_dir

TRIALS = 24
SEED = 1234
RUNNER = Path(__file__).with_name("crash_runner.py")

pytestmark = pytest.mark.integration


def _committed(task_dir: Path) -> list[int]:
    """Steps with a committed directory (``step-<N>`` holding a manifest), read off the disk."""
    steps = [parse_step_dir(p.name) for p in task_dir.glob("step-*") if (p / MANIFEST_NAME).exists()]
    return sorted(s for s in steps if s is not None)


def _runner_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("crash_runner", RUNNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trials(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict, Path]]:
    base = tmp_path_factory.mktemp("crash")
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(base / "root"), str(base / "snapshots"), str(TRIALS), str(SEED)],
        capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(facts) == TRIALS
    return [(f, base / "snapshots" / f"trial-{f['trial']}") for f in facts]


def test_every_victim_was_killed_mid_loop(trials: list[tuple[dict, Path]]) -> None:
    assert all(f["killed"] for f, _ in trials), [f for f, _ in trials if not f["killed"]]
    # The store grows over the trials: every even trial's victim committed at least one step.
    newest = [max(_committed(snap / "crash"), default=0) for _, snap in trials]
    assert newest == sorted(newest)
    assert all(newest[k] > (newest[k - 1] if k else 0) for k in range(0, TRIALS, 2))


@pytest.mark.parametrize("trial", range(TRIALS))
def test_store_is_consistent_after_kill(trials: list[tuple[dict, Path]], trial: int) -> None:
    runner = _runner_module()
    _, snap = trials[trial]
    task_dir = snap / runner.TASK
    committed = _committed(task_dir)
    store = CheckpointStore(snap, task_id=runner.TASK)  # a new session: cleans up and syncs
    try:
        assert not [p.name for p in (task_dir.iterdir() if task_dir.exists() else []) if TMP_MARKER in p.name]
        rows = {i.step: i.status for i in store.list(include_unhealthy=True)}
        assert sorted(s for s, status in rows.items() if status == "ok") == committed
        assert all(status == "missing" for s, status in rows.items() if s not in committed)

        for step in committed:
            assert store.verify(f"step:{step}") == [], f"step {step}"
        if committed:
            loaded = store.load("auto")
            assert loaded.info.step == committed[-1]
            expected = runner.expected_state(committed[-1])
            for key, value in expected.weights.items():
                assert loaded.weights[key].dtype == value.dtype and torch.equal(loaded.weights[key], value), key
            assert loaded.frozen == expected.frozen
            exp_state = expected.optimizer["state"][0]
            for key, value in exp_state.items():
                assert torch.equal(loaded.optimizer["state"][0][key], value), key
            assert loaded.scheduler == {"last_epoch": committed[-1]} and loaded.rng == {"s": committed[-1]}

        store.reindex()
        rows = {i.step: i.status for i in store.list(include_unhealthy=True)}
        assert rows == dict.fromkeys(committed, "ok")
        assert not (task_dir / "blobs").exists()  # frozen weights are recorded, never written
    finally:
        store.close()

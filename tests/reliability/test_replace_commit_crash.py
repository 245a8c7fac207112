"""A replace-commit SIGKILLed at any filesystem operation keeps exactly one committed copy.

The failure it guards: a crash between the two renames of a replace-commit (the old copy
moved aside, the new one not yet renamed in) loses the step if the next open removes both
temporary directories. `replace_runner.py` kills a save that replaces step 2 at every one
of its filesystem operations in turn (a deterministic sweep over all its phases: writing
files, done files, manifest, the aside rename, the commit rename, the removal of
the old copy); after each kill the next open must leave one committed step 2 (old or new,
complete and verified) and no temporary entry.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dynamic_ckpt.constants import ASIDE_SUFFIX, MANIFEST_NAME, TMP_MARKER
from hf_dynamic_ckpt.store import CheckpointStore

RUNNER = Path(__file__).with_name("replace_runner.py")
sys.path.insert(0, str(RUNNER.parent))

import replace_runner  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    base = tmp_path_factory.mktemp("replace")
    proc = subprocess.run([sys.executable, str(RUNNER), str(base / "template"), str(base / "snapshots")],
                          capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    return facts, base / "snapshots"


def _outcome(loaded_w: torch.Tensor) -> str:
    if torch.equal(loaded_w, replace_runner.old_state(2).weights["w"]):
        return "old"
    if torch.equal(loaded_w, replace_runner.new_state(2).weights["w"]):
        return "new"
    return "neither"


def test_every_operation_of_a_replace_commit_is_survivable(sweep: tuple[dict, Path]) -> None:
    facts, snapshots = sweep
    assert facts["operations"] >= 15 and all(t["killed"] for t in facts["trials"])
    outcomes = []
    between_renames = 0
    for trial in facts["trials"]:
        root = snapshots / f"trial-{trial['k']}"
        task = root / replace_runner.TASK
        names = {p.name for p in task.iterdir()}
        if "step-2" not in names and any(n.endswith(ASIDE_SUFFIX) for n in names):
            between_renames += 1  # the window where a step can be lost
        store = CheckpointStore(root, task_id=replace_runner.TASK, session_id="check")
        try:
            left = sorted(n for n in (p.name for p in task.iterdir()) if TMP_MARKER in n)
            assert left == [], (trial, left)
            assert [i.step for i in store.list()] == [2, 1], trial
            for step in (1, 2):
                assert store.verify(f"step:{step}") == [], (trial, step)
            loaded = store.load("step:2")
            outcome = _outcome(loaded.weights["w"])
            expected = replace_runner.old_state(2) if outcome == "old" else replace_runner.new_state(2)
            assert loaded.frozen == expected.frozen, trial
            assert loaded.sampler == expected.sampler and loaded.rng == expected.rng, trial
            assert (task / "step-2" / MANIFEST_NAME).is_file()
            outcomes.append(outcome)
        finally:
            store.close()
    assert "neither" not in outcomes
    assert between_renames >= 1  # the sweep did cut between the two renames
    assert outcomes[0] == "old" and outcomes[-1] == "new"  # both sides of the commit point were hit
    assert outcomes == sorted(outcomes, key=lambda o: o == "new")  # old ... old, new ... new

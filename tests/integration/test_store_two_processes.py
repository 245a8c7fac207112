"""Two real processes (world_size=2) commit checkpoints through the file rendezvous only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_dynamic_ckpt.constants import MANIFEST_NAME, Tier
from hf_dynamic_ckpt.store import CheckpointStore

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

WORKER = """
import json, sys, torch
torch.set_num_threads(1)
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, SaveRequest
root, rank = sys.argv[1], int(sys.argv[2])
store = CheckpointStore(root, task_id="ddp", rank=rank, world_size=2, session_id="job42", rank_timeout_s=120)
out = []
for step in (1, 2, 3):
    if rank == 0:
        state = CheckpointState(step=step, weights={"w": torch.full((16,), float(step))},
                                optimizer={"state": {}, "param_groups": [{"lr": 0.1, "params": []}]},
                                rng={"rank": 0, "step": step}, sampler={"batches": [step, step]})
    else:
        state = CheckpointState(step=step, rng={"rank": 1, "step": step})
    info = store.save(state, SaveRequest(step=step, reason="interval"))
    out.append(None if info is None else info.step)
store.close()
print(json.dumps(out))
"""


def test_two_ranks_in_two_processes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert json.loads(outs[0][0]) == [1, 2, 3] and json.loads(outs[1][0]) == [None, None, None]

    store = CheckpointStore(tmp_path, task_id="ddp")
    assert [i.step for i in store.list()] == [3, 2, 1]
    for step in (1, 2, 3):
        assert store.verify(step) == []
        manifest = json.loads((tmp_path / "ddp" / f"step-{step}" / MANIFEST_NAME).read_text())
        assert manifest["world_size"] == 2
        assert {n: e["rank"] for n, e in manifest["files"].items() if n.startswith("rng")} == {
            "rng-rank0.json": 0, "rng-rank1.json": 1}
        for rank in (0, 1):
            loaded = store.load(step, rank=rank, tiers={Tier.WEIGHTS, Tier.STATE})
            assert loaded.rng == {"rank": rank, "step": step}
            assert torch.equal(loaded.weights["w"], torch.full((16,), float(step)))
    assert not [p for p in (tmp_path / "ddp").iterdir() if ".tmp-" in p.name]
    store.close()


OPEN_AT_ONCE = """
import sys, time
from hf_dynamic_ckpt.store import CheckpointStore
base, rank, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
for i in range(24):
    while time.time() < start + 0.2 * i:  # every process opens root i at the same moment
        time.sleep(0.001)
    CheckpointStore(f"{base}/root{i}", task_id="ddp", rank=rank, world_size=3, session_id="job").close()
"""


def test_processes_that_open_one_new_store_at_once_all_open_it(tmp_path: Path) -> None:
    """Ranks of one job create the same store root at the same moment: none is refused as "not writable" (SQLite
    answers the first journal-mode switch "locked" without waiting, and two processes could both make the schema)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    start = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT_ONCE, str(tmp_path), str(r), str(start)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"root{i}" for i in range(24))

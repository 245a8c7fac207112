"""Gradient signals on FSDP2 DTensors: local shards + one all_reduce, equal to the full norms."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "fsdp_signals_worker.py"


def test_grad_probe_on_fsdp2_lora_matches_full_gradients(tmp_path: Path):
    # Before the fix: RuntimeError ".tolist() is not supported for tensor subclasses, got DTensor".
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "norms.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["local_numel"] != r["full_numel"]  # the parameters really are sharded
    assert len(r["layers"]) == 2 and set(r["layers"]) == set(r["ref_layers"])
    # float32 norms of the shards vs float64 of the gathered gradients
    assert math.isclose(r["grad_norm"], r["ref_global"], rel_tol=1e-6)
    for layer, norm in r["ref_layers"].items():
        assert norm > 0 and math.isclose(r["layers"][layer], norm, rel_tol=1e-6), layer
    # With clip_grad_norm_'s DTensor result: the pre-clip norm is that total norm, layers rescaled to pre-clip.
    assert r["clip_type"] == "DTensor"
    assert math.isclose(r["pre_norm"], r["ref_global"], rel_tol=1e-6)
    for layer, norm in r["ref_layers"].items():
        assert math.isclose(r["pre_layers"][layer], norm, rel_tol=1e-6), layer

"""On one GPU: Trainer with FSDP2 (`fsdp_config={"version": 2}`) and `SmartCkptCallback`, under torchrun.

docs/fsdp.md: Trainer's saves take the sharded path (every rank writes its shards; untested on
CPU, where Accelerate has no FSDP), and `resume_checkpoint` refuses a sharded checkpoint with
`IncompatibleStateError` because Trainer shards the model only inside `train()`. This check runs
both: the saves must be committed sharded, and the resume must be either that refusal or exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_runs import worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_trainer_fsdp2_saves_sharded_and_resumes_exactly_or_refuses(tmp_path: Path, record_property: Any) -> None:
    common = ["--device", "cuda", "--mode", "full", "--dropout", "0.0", "--fsdp", "--max_steps", "8",
              "--base_interval", "3"]
    killed = worker(tmp_path, "killed", *common, "--kill_at", "5", killed=True, torchrun=True)
    saved = [e for e in killed["events"] if e["error"] is None and e["path"]]
    assert saved, f"no save committed: {killed['events']}"
    step = Path(saved[0]["path"])
    manifest = json.loads((step / "manifest.json").read_text())
    files = sorted(manifest["files"])
    record_property("step 3 files", ", ".join(files))
    assert "sharded" in manifest.get("extra", {}), f"step 3 was not saved sharded: {files}"
    assert {"weights-rank0.safetensors", "optimizer-rank0.safetensors"} <= set(files), files

    resumed = worker(tmp_path, "resumed", *common, "--resume", "auto", torchrun=True)
    if resumed["error"] is not None:
        record_property("resume", f"refused: {resumed['error'][:160]}")
        assert resumed["error"].startswith("IncompatibleStateError") and "sharded" in resumed["error"], \
            resumed["error"]
        return
    pairs = {s: (killed["losses"].get(s), resumed["losses"].get(s)) for s in ("4", "5")}
    record_property("resume", f"from step {resumed['resumed_from']}, recomputed steps equal: "
                              f"{sum(a is not None and a == b for a, b in pairs.values())}/2")
    assert resumed["resumed_from"] == 3 and all(a is not None and a == b for a, b in pairs.values()), pairs

"""Trainer runs with the trainable state consolidated (`state.flat`, issue 15): the same losses, the
same checkpoint content and a bit-exact kill/resume as without (2-process DDP: tests/distributed/test_flat_ddp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_resume import assert_exact, run_worker

from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.store import CheckpointStore

pytestmark = pytest.mark.integration

LORA = ("--model", "lora", "--max_steps", "8", "--ga", "2", "--base_interval", "5")


def _store_content(run: Path, step: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], bytes]:
    with CheckpointStore(run / "run" / "smart_ckpt", read_only=True) as store:
        loaded = store.load(f"step:{step}", tiers={Tier.WEIGHTS, Tier.OPTIMIZER})
    from hf_dynamic_ckpt.engine.live import tensors_in

    weights = (run / "run" / "smart_ckpt" / "default" / f"step-{step}" / "weights.safetensors").read_bytes()
    return dict(loaded.weights), tensors_in(loaded.optimizer, []), weights


def test_lora_kill_and_resume_with_consolidation_matches_a_plain_run(tmp_path: Path) -> None:
    ref = run_worker(tmp_path / "ref", "ref", *LORA, "--consolidate", "off")
    crash = run_worker(tmp_path / "crash", "crash", *LORA, "--consolidate", "on", "--kill_at", "6", expect_rc=-9)
    resumed = run_worker(tmp_path / "crash", "resume", *LORA, "--consolidate", "on", "--resume", "auto")
    # Consolidated runs train exactly as the plain one, and resume from step 5 bit for bit.
    assert_exact(ref, crash, resumed, expect_step=5, ga=2)
    assert ref["flat"] is None
    assert crash["flat"] == {"moves": 1, "intact": True, "params": 8, "state_tensors": 24}
    # The resume's optimizer.load_state_dict replaced the state: moved (once) after it, still in place at the end.
    assert resumed["flat"] == {"moves": 1, "intact": True, "params": 8, "state_tensors": 24}
    # The checkpoint of step 5 holds the same tensors, and the same L0 file bytes, as the plain run's.
    plain_w, plain_o, plain_file = _store_content(tmp_path / "ref", 5)
    flat_w, flat_o, flat_file = _store_content(tmp_path / "crash", 5)
    assert list(plain_w) == list(flat_w) and all(torch.equal(plain_w[k], flat_w[k]) for k in plain_w)
    assert len(plain_o) == len(flat_o) and all(torch.equal(a, b) for a, b in zip(plain_o, flat_o))
    assert plain_file == flat_file

"""A store written by the previous version (tests/data/legacy_store, see its README) loads bit-exactly: its
container version 3, its blob of a frozen weight and its tied weights; a writer goes on saving into it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import same_state, save_state

from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.errors import CorruptCheckpointError
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore

FIXTURE = Path(__file__).parents[1] / "data" / "legacy_store"


def ramp(n: int, dtype: torch.dtype = torch.float32, scale: float = 8.0, shift: float = 0.0) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.float64) - n / 2) / scale + shift).to(dtype)


def adamw(params: list[torch.Tensor], step: int) -> dict:
    state = {i: {"step": torch.tensor(float(step)), "exp_avg": ramp(p.numel(), scale=1000.0).reshape(p.shape),
                 "exp_avg_sq": ramp(p.numel(), scale=1e6, shift=1e-3).abs().reshape(p.shape)}
             for i, p in enumerate(params)}
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "foreach": None, "maximize": False, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "params": list(range(len(params)))}
    return {"state": state, "param_groups": [group]}


def full_weights(step: int) -> dict[str, torch.Tensor]:
    out = {"embed.weight": ramp(64 * 8, scale=64.0).reshape(64, 8), "layer.weight": ramp(64, shift=step).reshape(8, 8),
           "layer.bias": ramp(8, torch.float16, shift=step), "norm.weight": torch.ones(8)}
    return {**out, "lm_head.weight": out["layer.weight"]}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "store", ignore=shutil.ignore_patterns("README.md"))
    return tmp_path / "store"


def test_a_lora_checkpoint_of_the_previous_version_loads_bit_exactly(root: Path) -> None:
    with CheckpointStore(root, task_id="lora", read_only=True) as store:
        assert [i.step for i in store.list()] == [3] and store.resolve("best").step == 3
        loaded = store.load("auto", mmap=False)
        assert store.verify("step:3") == []
    lora = {"base_model.model.q.lora_A.weight": ramp(32).reshape(4, 8),
            "base_model.model.q.lora_B.weight": ramp(32, torch.bfloat16, 16.0).reshape(8, 4)}
    assert same_state(loaded.weights, lora)
    assert same_state(loaded.optimizer, adamw(list(lora.values()), 3))
    assert loaded.scheduler == {"last_epoch": 3, "_step_count": 4, "base_lrs": [1e-3], "_last_lr": [7e-4]}
    assert loaded.scaler == {"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 3}
    assert loaded.rng == {"python": [3, [1, 2, 3], None], "seed": 3} and loaded.sampler == {"epoch": 0, "batches": 3}
    assert loaded.info.loss == 2.5 and loaded.info.frozen == {} and loaded.frozen == {}


@pytest.mark.parametrize("step", [5, 6])  # step 6: the uncompressed optimizer tier
def test_a_full_model_with_a_blob_and_tied_weights_loads_bit_exactly(root: Path, step: int) -> None:
    with CheckpointStore(root, task_id="full", read_only=True) as store:
        loaded = store.load(f"step:{step}")
        assert store.verify(f"step:{step}") == []
    assert json.loads((root / "full" / f"step-{step}" / "manifest.json").read_text())["format_version"] == 1
    expected = full_weights(step)
    assert same_state(loaded.weights, expected)
    assert loaded.weights["lm_head.weight"] is loaded.weights["layer.weight"]  # stored once, aliased on load
    assert set(loaded.info.blobs) == {"embed.weight"}  # the frozen weight, stored once for the task
    params = [expected["layer.weight"], expected["layer.bias"], expected["norm.weight"]]
    assert same_state(loaded.optimizer, adamw(params, step)) and loaded.scheduler == {"last_epoch": step}
    assert loaded.rng == {"seed": step} and loaded.sampler == {"epoch": 1, "batches": step}


def test_a_damaged_or_missing_blob_is_found(root: Path) -> None:
    [blob] = (root / "full" / "blobs").iterdir()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01
    blob.write_bytes(bytes(data))
    with CheckpointStore(root, task_id="full", read_only=True) as store:
        assert store.verify("step:5") == [f"blob {blob} content does not match its digest (corrupt) (weight "
                                          "'embed.weight', tier weights)"]
        blob.unlink()
        assert store.verify("step:6") == [f"blob {blob} is missing (weight 'embed.weight', tier weights)"]
        with pytest.raises(CorruptCheckpointError, match="is missing"):
            store.load("step:5", tiers={Tier.WEIGHTS})


def test_a_writer_goes_on_saving_and_collects_the_blob_once_nothing_uses_it(root: Path) -> None:
    with CheckpointStore(root, task_id="full") as store:  # the old catalog is gone: rebuilt from the manifests
        weights = {k: v for k, v in full_weights(7).items() if k != "embed.weight"}
        info = save_state(store, CheckpointState(step=7, weights=weights), reason="after the upgrade")
        assert [i.step for i in store.list()] == [7, 6, 5] and info.blobs == {}
        store.delete("step:5")
        assert len(list((root / "full" / "blobs").iterdir())) == 1  # step 6 still uses it
        store.delete("step:6")
        assert list((root / "full" / "blobs").iterdir()) == []
        assert same_state(store.load("auto").weights, weights)

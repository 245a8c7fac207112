"""DeepSpeed without ZeRO (stage 0), the save_state hooks under DeepSpeed and FSDP1 are refused at attach with an
error naming the supported setups.

No rank-0-only save of a partitioned state may ever happen silently: the refusal comes before the
store is opened, so nothing is written. The accelerator state that Accelerate builds
(`distributed_type`, its DeepSpeed or FSDP plugin) is what the library reads, set here as Accelerate
would set it. DeepSpeed ZeRO 1-3 itself is supported: tests/distributed/test_deepspeed.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_dynamic_ckpt import SmartCkptConfig
from hf_dynamic_ckpt.errors import ConfigError
from hf_dynamic_ckpt.state import SUPPORTED_SETUPS

SUPPORTED = "Supported setups: a single process; DDP"


def _accelerator(kind: str, **state: object) -> SimpleNamespace:
    from accelerate.utils import DistributedType

    dtype = DistributedType(kind)
    return SimpleNamespace(distributed_type=dtype, state=SimpleNamespace(distributed_type=dtype, **state),
                           _optimizers=[], _schedulers=[], _models=[])


def test_state_hooks_refuse_deepspeed_before_opening_the_store(tmp_path: Path):
    from hf_dynamic_ckpt.integrations.accelerate import SmartStateHooks

    acc = _accelerator("DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=2))
    with pytest.raises(ConfigError) as e:
        SmartStateHooks(acc, config=SmartCkptConfig(root=str(tmp_path / "s")))
    msg = str(e.value)
    assert msg.startswith("hf_dynamic_ckpt does not support DeepSpeed with the save_state hooks (SmartStateHooks): "
                          "under DeepSpeed, accelerator.save_state runs DeepSpeed's own save_checkpoint (pickles, "
                          "every rank waits) and load_state its load_checkpoint, whatever a hook does.")
    assert msg.endswith("In a custom loop use SmartCheckpointer (its saves, save_now() and resume(); "
                        "docs/deepspeed.md), or Trainer with SmartCkptCallback.")
    assert SUPPORTED in msg and SUPPORTED_SETUPS in msg
    assert "DeepSpeed ZeRO stages 1-3 under Trainer or `SmartCheckpointer`" in msg
    assert not (tmp_path / "s").exists()  # nothing opened, nothing written


def test_smart_checkpointer_refuses_deepspeed_without_zero_before_opening_the_store(tmp_path: Path):
    from hf_dynamic_ckpt import SmartCheckpointer

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = _accelerator("DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=0))
    with pytest.raises(ConfigError, match=r"^hf_dynamic_ckpt does not support DeepSpeed without ZeRO "):
        SmartCheckpointer(acc, model, opt, config=SmartCkptConfig(root=str(tmp_path / "s")))
    assert not (tmp_path / "s").exists()


def test_an_accelerator_that_counts_one_process_of_several_is_refused(tmp_path: Path, monkeypatch):
    # Accelerate under DeepSpeed on a machine without GPUs counts 1 process while the process group has more:
    # every process would checkpoint as rank 0 of a one-process run.
    from hf_dynamic_ckpt import SmartCheckpointer, distributed

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = _accelerator("MULTI_CPU")
    acc.process_index, acc.num_processes, acc._optimizers = 0, 1, [opt]
    with pytest.raises(ConfigError) as e:
        SmartCheckpointer(acc, model, opt, output_dir=str(tmp_path / "s"))
    assert str(e.value) == (
        "the accelerator counts 1 process but the process group has 2: every process would checkpoint as rank 0 "
        "of a one-process run. Accelerate does this for DeepSpeed on a machine without GPUs: create "
        "`PartialState(backend='gloo')` before the `Accelerator`, so that it counts them.")
    assert not (tmp_path / "s").exists()


def test_deepspeed_without_zero_is_refused_for_trainer_too():
    from hf_dynamic_ckpt.state import check_accelerator

    check_accelerator(_accelerator("DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=3)), deepspeed=True)
    with pytest.raises(ConfigError) as e:
        check_accelerator(_accelerator("DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=0)), deepspeed=True)
    msg = str(e.value)
    assert msg.startswith("hf_dynamic_ckpt does not support DeepSpeed without ZeRO (zero_optimization.stage=0): "
                          "without ZeRO the engine's mixed-precision optimizer keeps the fp32 master weights")
    assert msg.endswith("Use ZeRO stage 1, 2 or 3 (zero_optimization.stage), which are supported.")


def test_state_hooks_refuse_fsdp1_plugin(tmp_path: Path):
    from hf_dynamic_ckpt.integrations.accelerate import SmartStateHooks

    acc = _accelerator("FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=1))
    with pytest.raises(ConfigError, match=r"does not support FSDP version 1 \(Accelerate's FSDP plugin\): its flat "
                                          r"parameters .* Use FSDP2: `fully_shard\(module\)`"):
        SmartStateHooks(acc, config=SmartCkptConfig(root=str(tmp_path / "s")))
    assert not (tmp_path / "s").exists()


def _prepared(kind: str, **state: object) -> SimpleNamespace:
    """`_accelerator` with what attaching reads from a prepared one-process accelerator: one model, one optimizer."""
    acc = _accelerator(kind, **state)
    model = torch.nn.Linear(2, 2)
    acc._models, acc._optimizers = [model], [torch.optim.SGD(model.parameters(), lr=0.1)]
    acc.process_index, acc.num_processes, acc.unwrap_model = 0, 1, lambda m: m
    return acc


@pytest.mark.parametrize(("kind", "state"), [("FSDP", {"fsdp_plugin": SimpleNamespace(fsdp_version=2)}),
                                             ("MULTI_CPU", {})], ids=["fsdp2_plugin", "ddp"])
def test_fsdp2_plugin_and_ddp_are_not_refused(tmp_path: Path, kind: str, state: dict[str, object]):
    from hf_dynamic_ckpt.constants import CATALOG_NAME
    from hf_dynamic_ckpt.integrations.accelerate import SmartStateHooks

    # The entry point that refuses FSDP1 (test_state_hooks_refuse_fsdp1_plugin) attaches and opens the store.
    hooks = SmartStateHooks(_prepared(kind, **state), config=SmartCkptConfig(root=str(tmp_path / "s")))
    try:
        assert hooks.store.root == tmp_path / "s" and (tmp_path / "s" / CATALOG_NAME).is_file()
    finally:
        hooks.close()


def test_trainer_fsdp_arguments_are_refused_by_version_only():
    from hf_dynamic_ckpt.state import check_training_args

    check_training_args(SimpleNamespace(deepspeed=None, fsdp="full_shard", fsdp_config={"version": 2}))  # no error
    with pytest.raises(ConfigError, match=r"^hf_dynamic_ckpt does not support FSDP version 1 \(TrainingArguments\."
                                          r"fsdp='full_shard'\): its flat parameters"):
        check_training_args(SimpleNamespace(deepspeed=None, fsdp="full_shard", fsdp_config={"version": 1}))


@pytest.mark.integration
def test_trainer_fsdp_arguments_version_1_refused_version_2_accepted(tmp_path: Path):
    from transformers import TrainingArguments

    from hf_dynamic_ckpt.state import check_training_args

    def args(**kw: object) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True, **kw)

    check_training_args(args())  # transformers 5: FSDP2 is the default
    check_training_args(args(fsdp_config={"version": 2}))
    with pytest.raises(ConfigError, match=r"does not support FSDP version 1 \(TrainingArguments.fsdp=True\).*"
                                          r"Trainer's `fsdp_config=\{'version': 2\}`"):
        check_training_args(args(fsdp_config={"version": 1}))


def test_skip_bad_update_is_refused_under_zero_before_anything_is_attached(tmp_path: Path):
    # Under ZeRO the engine steps inside backward; skipping would mean dropping partitions' gradients there.
    from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator

    model = torch.nn.Linear(2, 2)
    zero = SimpleNamespace(single_partition_of_fp32_groups=[], optimizer=None)  # how a ZeRO optimizer is known
    run = RunOrchestrator(SmartCkptConfig(policy={"skip_bad_update": True}), root=str(tmp_path / "s"))
    try:
        with pytest.raises(ConfigError) as e:
            run.attach(model, optimizer=SimpleNamespace(optimizer=zero))
        assert str(e.value) == (
            "policy.skip_bad_update is not supported under DeepSpeed ZeRO: the engine applies the update inside "
            "backward, and skipping it would mean dropping its partitions' gradients inside DeepSpeed's step. Set "
            "skip_bad_update=False (the default), or on_anomaly='rollback' to undo a bad update.")
        assert run.sensors is None and run.zero is False  # nothing attached
    finally:
        run.close()

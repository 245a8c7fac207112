"""Getting a model out of a checkpoint: every export loads with the standard loaders
and gives the live model's outputs; `load_checkpoint` puts verified weights into a model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hf_dynamic_ckpt import ConfigError, SmartCkptConfig, toy
from hf_dynamic_ckpt.cli import main as cli_main
from hf_dynamic_ckpt.export import export_checkpoint, load_checkpoint
from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator

pytestmark = pytest.mark.integration

TOKENS = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])


def _train(model: torch.nn.Module, root: Path, steps: int = 3) -> RunOrchestrator:
    """A few real optimizer steps, then a save of the last one (thread writer, no policy saves)."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ck = RunOrchestrator(SmartCkptConfig(root=str(root), base_interval=1000, engine="thread",
                                         pre_anomaly_capture=False))
    ck.attach(model, optimizer=opt)
    model.train()
    for step in range(steps):
        model(input_ids=TOKENS, labels=TOKENS).loss.backward()
        ck.pre_update(step)
        opt.step()
        opt.zero_grad()
        ck.step_end(step + 1, 0.0)
    ck.save_now(steps, 0.0)
    ck.close()
    model.eval()
    return ck


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def test_lora_export_loads_with_peft_and_matches_the_live_model(tmp_path: Path) -> None:
    from peft import PeftModel

    model = toy.lora(toy.tiny_qwen2(seed=0), r=4)
    _train(model, tmp_path / "store")
    out = export_checkpoint(tmp_path / "store", "auto", tmp_path / "adapter", format="peft")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(toy.tiny_qwen2(seed=0), str(out)).eval()
    assert torch.equal(_logits(loaded), _logits(model))


def test_full_finetune_export_loads_with_auto_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = toy.tiny_qwen2(seed=0, tie_word_embeddings=True)
    _train(model, tmp_path / "store")
    out = export_checkpoint(tmp_path / "store", "step:3", tmp_path / "hf", format="hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert torch.equal(_logits(loaded), _logits(model))


def test_merged_export_needs_the_base_and_loads_as_a_plain_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = toy.tiny_qwen2(seed=0)
    base.save_pretrained(tmp_path / "base")
    model = toy.lora(base, r=4)
    _train(model, tmp_path / "store")
    with pytest.raises(ConfigError, match="format='merged' needs the base weights: pass base=PATH"):
        export_checkpoint(tmp_path / "store", "auto", tmp_path / "m0", format="merged")
    out = export_checkpoint(tmp_path / "store", "auto", tmp_path / "merged", format="merged", base=tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    expected = copy.deepcopy(model).merge_and_unload().eval()
    torch.testing.assert_close(_logits(loaded), _logits(expected), rtol=1e-5, atol=1e-6)


def test_two_adapters_export_both_by_name(tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel

    model = toy.lora(toy.tiny_qwen2(seed=0), r=4)
    model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    _train(model, tmp_path / "store")
    out = export_checkpoint(tmp_path / "store", "auto", tmp_path / "adapters", format="peft")
    assert (out / "adapter_config.json").is_file() and (out / "second" / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(toy.tiny_qwen2(seed=0), str(out))
    loaded.load_adapter(str(out / "second"), "second")
    for name in ("default", "second"):
        model.set_adapter(name)
        loaded.set_adapter(name)
        assert torch.equal(_logits(loaded.eval()), _logits(model.eval())), name


def test_wrong_format_and_existing_folder_are_clear_errors(tmp_path: Path) -> None:
    _train(toy.lora(toy.tiny_qwen2(seed=0), r=4), tmp_path / "store")
    with pytest.raises(ConfigError, match="format='hf' writes a full model; step 3 holds LoRA adapters only"):
        export_checkpoint(tmp_path / "store", "auto", tmp_path / "x", format="hf")
    with pytest.raises(ConfigError, match="format='onnx' is invalid: expected one of peft, hf, merged"):
        export_checkpoint(tmp_path / "store", "auto", tmp_path / "x", format="onnx")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="exists: choose a new folder or pass overwrite=True"):
        export_checkpoint(tmp_path / "store", "auto", tmp_path / "taken")


def test_cli_export_and_load_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = toy.tiny_qwen2(seed=0)
    _train(model, tmp_path / "store")
    assert cli_main(["export", str(tmp_path / "store"), "auto", str(tmp_path / "out"), "--format", "hf"]) == 0
    assert "exported step 3" in capsys.readouterr().out
    fresh = toy.tiny_qwen2(seed=1)
    loaded = load_checkpoint(tmp_path / "store", "step:3", model=fresh)
    assert loaded.info.step == 3
    fresh.eval()
    assert torch.equal(_logits(fresh), _logits(model))

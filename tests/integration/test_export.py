"""Getting a model out of a checkpoint: every export loads with the standard loaders
and gives the live model's outputs; `load_checkpoint` puts verified weights into a model."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from helpers import save_state

from examples import toy
from hf_dynamic_ckpt import ConfigError, SmartCkptConfig
from hf_dynamic_ckpt.cli import main as cli_main
from hf_dynamic_ckpt.constants import VERSION, WEIGHTS_NAME
from hf_dynamic_ckpt.errors import CorruptCheckpointError
from hf_dynamic_ckpt.export import EXPORT_MARKER, KEY_MODEL, describe_model, export_checkpoint, load_checkpoint
from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore

pytestmark = pytest.mark.integration

TOKENS = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])


def _train(model: torch.nn.Module, root: Path, steps: int = 3) -> RunOrchestrator:
    """A few real optimizer steps, then a save of the last one (written on the training thread, no policy saves)."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ck = RunOrchestrator(SmartCkptConfig(root=str(root), base_interval=1000, engine="sync",
                                         policy={"pre_anomaly_capture": False}))
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
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", EXPORT_MARKER]
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


# -- the export folder: what --overwrite may replace ------------------------------------------------------------
def _store(root: Path, steps: tuple[int, ...], *, unhealthy: tuple[int, ...] = ()) -> None:
    """Checkpoints of a tiny full model (different weights per step), each with its model description."""
    model = toy.tiny_qwen2(seed=0)
    store = CheckpointStore(root, session_id="s")
    for step in steps:
        weights = {k: v.detach().clone() + step for k, v in model.state_dict().items()}
        save_state(store, CheckpointState(step=step, weights=weights, extra={KEY_MODEL: describe_model(model)}),
                   reason="loss_spike" if step in unhealthy else "interval", healthy=step not in unhealthy)
    store.close()


def _files(top: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `top`: size, mtime_ns, sha256."""
    return {str(p.relative_to(top)): (p.stat().st_size, p.stat().st_mtime_ns,
                                      hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(top.rglob("*")) if p.is_file()}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_main(["export", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_overwrite_never_deletes_the_store_its_folder_or_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out, store = tmp_path / "out", tmp_path / "out" / "smart_ckpt"
    _store(store, (24, 32))
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "keep.txt").write_text("mine")
    (tmp_path / "notes.txt").write_text("mine")
    before = _files(tmp_path)
    outside = f"pass a folder outside it, e.g. {out / 'export'}."
    for target, what in ((out, "holds the store"), (store, "is the store"), (store / "default", "is inside the store"),
                         (store / "new", "is inside the store")):
        assert _cli(capsys, str(out), "auto", str(target), "--overwrite", "--format", "hf") == (2, "", (
            f"hf-dynamic-ckpt: error: out={str(target)!r} {what} {store}: an export never writes into or replaces a "
            f"store; {outside}\n"))
        with pytest.raises(ConfigError, match=f"^out={re.escape(repr(str(target)))} {what} "):
            export_checkpoint(out, "auto", target, format="hf", overwrite=True)
    monkeypatch.chdir(tmp_path / "a")
    assert _cli(capsys, str(out), "auto", ".", "--overwrite", "--format", "hf")[2] == (
        "hf-dynamic-ckpt: error: overwrite=True refuses to replace out='.': it is the current directory; nothing was "
        "deleted. Pass a new folder for the export, e.g. ./export.\n")
    monkeypatch.chdir(tmp_path / "a" / "b")
    assert _cli(capsys, str(out), "auto", "..", "--overwrite", "--format", "hf")[2] == (
        "hf-dynamic-ckpt: error: overwrite=True refuses to replace out='..': it is a folder holding the current "
        f"directory ({tmp_path / 'a' / 'b'}); nothing was deleted. Pass a new folder for the export, e.g. ../export.\n")
    assert _cli(capsys, str(out), "auto", "../..", "--overwrite", "--format", "hf")[2].startswith(
        "hf-dynamic-ckpt: error: out='../..' holds the store ")
    monkeypatch.chdir(tmp_path)
    assert _cli(capsys, "out", "auto", "a", "--overwrite", "--format", "hf")[2] == (
        "hf-dynamic-ckpt: error: overwrite=True refuses to replace out='a': it is not a previous export (no "
        "hf_dynamic_ckpt_export.json; it holds b, keep.txt); nothing was deleted. overwrite replaces only a previous "
        "export (a folder holding hf_dynamic_ckpt_export.json and the files it lists): pass a new folder, or empty "
        "this one yourself.\n")
    assert _cli(capsys, "out", "auto", "notes.txt", "--overwrite", "--format", "hf")[2] == (
        "hf-dynamic-ckpt: error: overwrite=True refuses to replace out='notes.txt': it is a file, not a previous "
        "export; nothing was deleted. Pass a new folder, or remove the file yourself.\n")
    assert _files(tmp_path) == before  # nothing deleted, nothing written, the store untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "notes.txt", "out"]


def test_overwrite_replaces_only_a_previous_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, exp = tmp_path / "out", tmp_path / "exp"
    _store(out / "smart_ckpt", (24, 32))
    store_files = _files(out)
    assert _cli(capsys, str(out), "step:24", str(exp), "--format", "hf")[:2] == (
        0, f"exported step 24 (step:24) as hf to {exp}\n")
    written = ["config.json", "generation_config.json", "model.safetensors"]  # as transformers' save_pretrained does
    assert sorted(p.name for p in exp.iterdir()) == sorted([*written, EXPORT_MARKER])
    assert json.loads((exp / EXPORT_MARKER).read_text()) == {
        "export_version": 1, "store": str((out / "smart_ckpt").absolute()), "task": "default", "step": 24,
        "ref": "step:24", "format": "hf", "files": written, "library_version": VERSION}
    assert _cli(capsys, str(out), "auto", str(exp), "--format", "hf")[2] == (
        f"hf-dynamic-ckpt: error: {exp} exists: choose a new folder or pass overwrite=True (--overwrite).\n")
    assert export_checkpoint(out, "auto", exp, format="hf", overwrite=True) == exp
    assert json.loads((exp / EXPORT_MARKER).read_text())["step"] == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "out"]  # no temporary or old folder left
    (exp / "README.md").write_text("my notes")
    kept = _files(exp)
    with pytest.raises(ConfigError) as e:
        export_checkpoint(out, "step:24", exp, format="hf", overwrite=True)
    assert str(e.value) == (
        f"overwrite=True refuses to replace out={str(exp)!r}: it holds files the export did not write (README.md); "
        "nothing was deleted. overwrite replaces only a previous export (a folder holding "
        "hf_dynamic_ckpt_export.json and the files it lists): pass a new folder, or empty this one yourself.")
    assert _files(exp) == kept
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose
    assert export_checkpoint(out, "step:24", tmp_path / "empty", format="hf", overwrite=True) == tmp_path / "empty"
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert _files(out) == store_files  # exporting read the store and changed nothing in it


def test_a_failed_export_leaves_the_previous_one_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, exp = tmp_path / "out", tmp_path / "exp"
    _store(out / "smart_ckpt", (24, 32))
    export_checkpoint(out, "step:24", exp, format="hf")
    previous = _files(exp)
    # The disk fills up while the new export's weights are written (the test hook's `export` point, per file).
    monkeypatch.setenv("HF_DYNAMIC_CKPT_FAULT", "export@name=model.safetensors:raise=ENOSPC")
    with pytest.raises(OSError, match="No space left on device"):
        export_checkpoint(out, "auto", exp, format="hf", overwrite=True)
    assert _files(exp) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "out"]  # the half-written folder is gone


def test_auto_names_the_checkpoints_it_passed_over(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    _store(out / "smart_ckpt", (24, 32, 40, 48, 56), unhealthy=(56,))
    for step in (40, 48):
        weights = out / "smart_ckpt" / "default" / f"step-{step}" / WEIGHTS_NAME
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0xFF
        weights.write_bytes(bytes(data))
    corrupt = (r"failed verification: weights\.safetensors \(tier weights\): checksum mismatch \(xxh3_128:\w+ != "
               r"xxh3_128:\w+\), the file is corrupt")
    expected = [re.escape("skipped step 56: saved as unhealthy (loss_spike); auto, best and fastest never choose one: "
                          "pass step:56 to take it"),
                f"skipped step 48: {corrupt}", f"skipped step 40: {corrupt}"]
    for name in ("e1", "e2"):  # found corrupt by this export, then flagged in the catalog by the first one
        code, stdout, _ = _cli(capsys, str(out), "auto", str(tmp_path / name), "--format", "hf")
        lines = stdout.splitlines()
        assert code == 0 and len(lines) == 4, stdout
        assert all(re.fullmatch(p, line) for p, line in zip(expected, lines)), lines
        assert lines[3] == f"exported step 32 (auto) as hf to {tmp_path / name}"
    with caplog.at_level(logging.WARNING, logger="hf_dynamic_ckpt.export"):
        loaded = load_checkpoint(out, "auto")
    assert loaded.info.step == 32 and loaded.warnings[:3] == lines[:3]
    assert [r.getMessage() for r in caplog.records] == [f"{line} ('auto' chose step 32)" for line in lines[:3]]
    with pytest.raises(CorruptCheckpointError, match="step-48 failed verification, nothing was loaded"):
        load_checkpoint(out, "step:48")  # a checkpoint named exactly is never swapped for another

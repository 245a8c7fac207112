"""SmartCheckpointer in a custom Accelerate loop: SIGKILL mid-run, resume, bit-equal losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from examples import toy
from hf_dynamic_ckpt import SmartCheckpointer, SmartCkptConfig
from hf_dynamic_ckpt.errors import FAULT_ENV, CheckpointNotFoundError, ConfigError

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "accelerate_loop.py"


def run_worker(tmp: Path, *args: str, expect_kill: bool = False, expect_rc: int = 0) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(WORKER), *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=300)
    if expect_kill:
        assert proc.returncode == -9, proc.stderr[-3000:]
    else:
        assert proc.returncode == expect_rc, proc.stderr[-3000:]


def read_losses(path: Path) -> tuple[int | None, dict[int, dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    header, steps = lines[0], [d for d in lines[1:] if "loss" in d]
    return header["resumed_from"], {d["step"]: d for d in steps}


# GA = 2, 16 examples of batch 2: 4 optimizer steps per epoch; 10 steps cross two epoch ends.
COMMON = ["--max_steps", "10", "--grad_accum", "2", "--examples", "16", "--base_interval", "3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run: per-step losses and the final adapter."""
    tmp = tmp_path_factory.mktemp("reference")
    run_worker(tmp, "--output_dir", "ref", "--losses", "ref.jsonl", "--final", "ref.safetensors", *COMMON)
    return tmp


def test_sigkill_then_resume_continues_bit_exactly(tmp_path: Path, reference: Path):
    common = COMMON
    run_worker(tmp_path, "--output_dir", "run", "--losses", "crash.jsonl", "--kill_at_step", "7", *common,
               expect_kill=True)
    crashed_from, crashed = read_losses(tmp_path / "crash.jsonl")
    assert crashed_from is None and max(crashed) == 7  # died right after step 7
    committed = sorted(int(p.name[5:]) for p in (tmp_path / "run/smart_ckpt/default").glob("step-*")
                       if "." not in p.name)
    assert committed and max(committed) < 7

    run_worker(tmp_path, "--output_dir", "run", "--losses", "resume.jsonl", "--resume", "auto",
               "--final", "resumed.safetensors", *common)
    resumed_from, resumed = read_losses(tmp_path / "resume.jsonl")
    _, ref = read_losses(reference / "ref.jsonl")
    assert resumed_from == max(committed)
    assert sorted(resumed) == list(range(resumed_from + 1, 11))
    # Every step after the restore point: identical step loss and micro-batch losses, to the bit.
    for step, row in resumed.items():
        assert row["loss"] == ref[step]["loss"] and row["micro"] == ref[step]["micro"], step
    # The crashed run agrees too on the steps it ran past the restore point.
    for step in range(resumed_from + 1, 8):
        assert crashed[step]["loss"] == ref[step]["loss"]
    final_ref, final = load_file(reference / "ref.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert final_ref.keys() == final.keys() and all(torch.equal(final_ref[k], final[k]) for k in final)


def test_sigterm_saves_at_the_next_boundary_and_resumes_exactly(tmp_path: Path, reference: Path):
    # After the preemption save `ckpt.close()` ends the process with 143 (128 + SIGTERM): requeue, not done.
    run_worker(tmp_path, "--output_dir", "run", "--losses", "term.jsonl", "--sigterm_at_step", "5", *COMMON,
               expect_rc=143)
    lines = [json.loads(line) for line in (tmp_path / "term.jsonl").read_text().splitlines()]
    assert lines[-1] == {"stopped": "preemption", "step": 6, "reason": "emergency: preemption: SIGTERM"}
    manifest = json.loads((tmp_path / "run/smart_ckpt/default/step-6/manifest.json").read_text())
    assert manifest["reason"] == "emergency: preemption: SIGTERM"

    run_worker(tmp_path, "--output_dir", "run", "--losses", "resume.jsonl", "--resume", "auto",
               "--final", "resumed.safetensors", *COMMON)
    resumed_from, resumed = read_losses(tmp_path / "resume.jsonl")
    _, ref = read_losses(reference / "ref.jsonl")
    assert resumed_from == 6 and sorted(resumed) == [7, 8, 9, 10]
    for step, row in resumed.items():
        assert row["loss"] == ref[step]["loss"] and row["micro"] == ref[step]["micro"], step
    final_ref, final = load_file(reference / "ref.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert all(torch.equal(final_ref[k], final[k]) for k in final)


def _loop(tmp_path: Path, *, steps: int, resume: str | None = None, lora_seed: int = 0):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=64, hidden_size=32), r=2, seed=lora_seed)
    data = toy.random_token_dataset(num_examples=12, seq_len=6, vocab_size=64, seed=2).with_format("torch")
    dl = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    config = SmartCkptConfig(root=str(tmp_path / "store"), base_interval=2, keep_last=50, engine="sync",
                             policy={"overhead_budget": 1.0})
    ckpt = SmartCheckpointer(accelerator, model, opt, dataloader=dl, config=config)
    loaded = ckpt.resume(resume)
    adapters: dict[int, dict[str, torch.Tensor]] = {}
    while ckpt.step < steps:
        for batch in ckpt.loader:
            accelerator.backward(model(**batch).loss)
            ckpt.before_update()
            opt.step()
            opt.zero_grad()
            ckpt.after_update()
            adapters[ckpt.step] = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
            if ckpt.step >= steps:
                break
    saved = [i.step for i in ckpt.store.list()]
    ckpt.close()
    return ckpt, loaded, adapters, saved


def test_resume_specs(tmp_path: Path):
    _, loaded, adapters, saved = _loop(tmp_path, steps=6)
    assert loaded is None  # no resume asked: fresh start
    assert 2 in saved and len(saved) >= 2
    # step:N restores exactly that step's adapter, into a differently initialised adapter.
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=64, hidden_size=32), r=2, seed=9)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    config = SmartCkptConfig(root=str(tmp_path / "store"), engine="sync")
    with SmartCheckpointer(accelerator, model, opt, config=config) as again:
        got = again.resume("step:2")
        assert got is not None and got.info.step == 2 and again.step == 2
        current = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        assert all(torch.equal(current[k], v) for k, v in adapters[2].items())
        with pytest.raises(CheckpointNotFoundError, match="99"):
            again.resume("step:99")
        assert again.resume(None) is None


def test_auto_on_empty_store_starts_fresh(tmp_path: Path):
    ckpt, loaded, _, _ = _loop(tmp_path, steps=1, resume="auto")
    assert loaded is None and ckpt.step == 1


def test_rejects_unprepared_optimizer(tmp_path: Path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = toy.tiny_qwen2(seed=0, vocab_size=64, hidden_size=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared_model = accelerator.prepare(model)
    with pytest.raises(ConfigError, match="optimizer is not the accelerator's prepared optimizer"):
        SmartCheckpointer(accelerator, prepared_model, opt, config=SmartCkptConfig(root=str(tmp_path)))


def test_pre_anomaly_capture_resumes_exactly(tmp_path: Path):
    """A gradient explosion at step 13 pins the state of step 12, taken before the update (after
    step 13's batch was fetched): resuming from it replays steps 13.. bit-exactly."""
    common = ["--max_steps", "15", "--surge_at_step", "13", "--base_interval", "50", "--output_dir", "run"]
    run_worker(tmp_path, "--losses", "ref.jsonl", *common)
    _, ref = read_losses(tmp_path / "ref.jsonl")
    assert ref[13]["captures"] == [[12, ref[13]["captures"][0][1], True]]
    assert ref[13]["captures"][0][1].startswith("pre_update grad_surge")
    step12 = tmp_path / "run/smart_ckpt/default/step-12"
    manifest = json.loads((step12 / "manifest.json").read_text())
    assert manifest["pinned"] is True and manifest["step"] == 12
    # The data position is the step boundary, not the batch already fetched for step 13.
    assert json.loads((step12 / "sampler.json").read_text())["batches_seen"] == 12

    run_worker(tmp_path, "--losses", "resume.jsonl", "--resume", "step:12", *common)
    resumed_from, resumed = read_losses(tmp_path / "resume.jsonl")
    assert resumed_from == 12 and sorted(resumed) == [13, 14, 15]
    for step, row in resumed.items():
        assert row["loss"] == ref[step]["loss"] and row["micro"] == ref[step]["micro"], step


def test_a_full_model_resume_reads_the_weights_file_once_into_the_parameters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator

    def build(seed: int) -> tuple:
        accelerator = Accelerator(cpu=True)
        model = toy.tiny_qwen2(seed=seed, vocab_size=64, hidden_size=32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        config = SmartCkptConfig(root=str(tmp_path / "store"), base_interval=2, engine="sync")
        return accelerator, model, opt, SmartCheckpointer(accelerator, model, opt, config=config)

    _, model, opt, ckpt = build(0)
    batch = {"input_ids": torch.arange(12).reshape(2, 6) % 64}
    with ckpt:
        for _ in range(2):
            model(**batch, labels=batch["input_ids"]).loss.backward()
            ckpt.before_update()
            opt.step()
            opt.zero_grad()
            ckpt.after_update()
    saved = load_file(tmp_path / "store" / "default" / "step-2" / "weights.safetensors")
    log = tmp_path / "checked.jsonl"  # files hashed in a pass of their own (not as they are read)
    monkeypatch.setenv(FAULT_ENV, f"read@op=check:log={log}")
    _, model, _, again = build(9)
    with again:
        loaded = again.resume("auto")
        hashed = [json.loads(line)["name"] for line in log.read_text().splitlines()] if log.exists() else []
        assert loaded is not None and loaded.info.step == 2 and "weights.safetensors" not in hashed
        live = model.state_dict()
        assert all(torch.equal(live[k], v) for k, v in saved.items())
        params = {p.data_ptr() for p in model.parameters()}
        assert all(loaded.weights[k].data_ptr() in params for k in saved)  # the parameters, not a file map

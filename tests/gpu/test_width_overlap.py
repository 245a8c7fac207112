"""On a GPU at Qwen2-7B's widths, inside Trainer: what a save costs the training thread, how much of the
device-to-host copy the next step hides, and where the copy's wait sits.

CUDA events are recorded around each step's forward and backward (`on_step_begin` -> `on_pre_optimizer_step`) and
its optimizer step (-> `on_optimizer_step`). A save decided at the end of step k is taken at the start of step k + 1
(after Trainer's logging): its host part is the blocking time. Copied at the save (LoRA: small), the copy is ordered
before step k + 1's kernels; overlapped (a full fine-tune: CUDA parameters of >= 32 MiB), step k + 1's forward and
backward run beside it and only its optimizer step waits. Measured against a plain device-to-host copy of the same
bytes into pinned memory: the share of the copy the step after a save hides, and whether the wait shows before the
forward (it must not, with the overlapped copy) or in the optimizer step.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_runs import copy_ms as d2h_copy_ms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

QWEN2_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_key_value_heads": 4}
STEPS, EVERY, SEQ = 14, 4, 512


def _train(root: Path, mode: str, layers: int) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN2_7B, num_hidden_layers=layers, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model: Any = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if mode == "lora":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(1)
    ids_all = torch.randint(0, config.vocab_size, (STEPS + 2, SEQ), generator=g)
    rows = [{"input_ids": ids, "labels": ids} for ids in ids_all]
    marks: dict[int, dict[str, torch.cuda.Event]] = {}
    events: list[dict[str, Any]] = []

    class Timer(TrainerCallback):
        def _mark(self, state: Any, name: str) -> None:  # global_step counts the steps completed before this one
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.setdefault(state.global_step + 1, {})[name] = event

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._mark(state, "begin")

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._mark(state, "backward")

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._mark(state, "update")

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1:  # saves before the writer process is up write synchronously: measure after
                assert callback.run is not None
                assert callback.run.engine.start(wait_s=120), "the writer process did not start"

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            assert callback.run is not None
            events.extend(e.to_dict() for e in callback.run.events)

    callback = SmartCkptCallback(SmartCkptConfig(root=str(root / "store"), base_interval=EVERY, keep_last=2,
                                                 runtime={"memory_margin": 0.05}, policy={"overhead_budget": 1.0}))
    args = TrainingArguments(output_dir=str(root / "run"), max_steps=STEPS, per_device_train_batch_size=1, bf16=True,
                             learning_rate=1e-5, save_strategy="no", report_to=[], logging_steps=1000,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback, Timer()])
    trainer.train()
    torch.cuda.synchronize()
    steps = {s: (m["begin"].elapsed_time(m["backward"]), m["backward"].elapsed_time(m["update"]))
             for s, m in marks.items() if {"begin", "backward", "update"} <= m.keys()}
    trained = [p for p in model.parameters() if p.requires_grad]
    state_bytes = sum(p.numel() * p.element_size() for p in trained) * 3  # weights + AdamW's two moments
    del trainer, model
    torch.cuda.empty_cache()
    return {"steps": steps, "events": events, "state_bytes": state_bytes}


@pytest.mark.parametrize("mode,layers", [("lora", 2), ("full", 1)])
def test_a_save_at_qwen2_7b_width_blocks_little_and_the_next_step_hides_its_copy(
        tmp_path: Path, mode: str, layers: int, record_property: Any) -> None:
    result = _train(tmp_path, mode, layers)
    saves = [e for e in result["events"] if e["reason"] != "train_end"]
    assert saves and all(e["error"] is None for e in saves), saves
    after = {e["step"] + 1 for e in saves}  # the step whose start took the snapshot
    steps = result["steps"]
    clean = [s for s in steps if s > 2 and s not in after and s - 1 not in after]
    fb_clean = statistics.median(steps[s][0] for s in clean)
    opt_clean = statistics.median(steps[s][1] for s in clean)
    copy_ms = d2h_copy_ms(result["state_bytes"])
    fb_extra = statistics.median(steps[s][0] - fb_clean for s in after if s in steps)
    opt_extra = statistics.median(steps[s][1] - opt_clean for s in after if s in steps)
    hidden = 1 - max(0.0, fb_extra + opt_extra) / copy_ms
    blocking = [e["blocking_ms"] for e in saves]
    record_property("state copied per save (GB), plain D2H copy ms",
                    f"{result['state_bytes'] / 1e9:.2f}, {copy_ms:.1f}")
    record_property("blocking ms per save (host)", ", ".join(f"{b:.1f}" for b in blocking))
    record_property("clean step ms: fwd+bwd / optimizer", f"{fb_clean:.1f} / {opt_clean:.1f}")
    record_property("step after a save, extra ms: fwd+bwd / optimizer", f"{fb_extra:.1f} / {opt_extra:.1f}")
    record_property("share of the copy the next step hides", f"{hidden:.0%}")
    record_property("staging", ",".join(sorted({str(e["staging"]) for e in saves})))
    assert all(e["staging"] == "buffered" for e in saves), "a save streamed or wrote synchronously"
    if mode == "full":  # overlapped: the forward and backward run beside the copy; the optimizer step waits for it
        assert fb_extra < 0.25 * copy_ms + 5.0, f"the step after a save waited before its forward ({fb_extra:.1f} ms)"

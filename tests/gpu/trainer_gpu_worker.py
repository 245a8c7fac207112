"""Worker for the GPU checks (a script, not a test module): one Trainer run of a tiny Qwen2 with `SmartCkptCallback`.

Records each training step's loss as a hex float (exact). `--kill_at N` waits for the saves
in flight, writes the record and SIGKILLs this process at the end of step N; `--resume SPEC`
resumes through `resume_checkpoint` (an error is recorded, not raised: a documented refusal
is a result). `--fsdp` shards the model with Trainer's FSDP2 (run it under torchrun).
`--device cpu` runs the same on the CPU (to try the worker on a machine without a GPU).
Writes `<out>/<tag>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

# Deterministic cuBLAS: set before anything initialises CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

torch.set_num_threads(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--mode", default="lora", choices=["lora", "full"])
    p.add_argument("--bf16", action="store_true", help="Trainer's bf16 mixed precision")
    p.add_argument("--dropout", type=float, default=0.1, help="attention and LoRA dropout (draws from the device RNG)")
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--base_interval", type=int, default=2)
    p.add_argument("--kill_at", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--fsdp", action="store_true", help="Trainer + FSDP2 (fsdp_config version 2); under torchrun")
    opts = p.parse_args()

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint

    # Same kernels for the same inputs in both runs: deterministic algorithms (a warning where an op has
    # none, rather than an error that would hide the resume's result) and eager attention.
    torch.use_deterministic_algorithms(True, warn_only=True)
    model: Any = toy.tiny_qwen2(seed=0, vocab_size=128, hidden_size=64, dropout=opts.dropout,
                                attn_implementation="eager")
    if opts.mode == "lora":
        model = toy.lora(model, r=4, dropout=opts.dropout, seed=0)
    inner = model.base_model.model if opts.mode == "lora" else model
    g = torch.Generator().manual_seed(1)  # a plain list of rows: the GPU machine has no `datasets`
    dataset = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (4 * opts.max_steps, 16),
                                                                          generator=g)]
    record: dict[str, Any] = {"losses": {}, "resumed_from": None, "error": None, "events": []}
    step = {"now": 0}

    def loss_hook(module: Any, inputs: Any, output: Any) -> None:
        if module.training:
            record["losses"][str(step["now"])] = output.loss.detach().double().item().hex()

    inner.register_forward_hook(loss_hook)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(opts.out)

    def dump() -> None:
        ck = callback.run
        record["events"] = [e.to_dict() for e in ck.events] if ck is not None else []
        if rank == 0:
            (out / f"{opts.tag}.json").write_text(json.dumps(record))

    class Steps(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step["now"] = state.global_step + 1

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if opts.kill_at is not None and state.global_step == opts.kill_at:
                # The crash comes once every save taken so far is committed: a known restore point.
                assert callback.run is not None
                callback.run.finish()
                dump()
                os.kill(os.getpid(), signal.SIGKILL)

    fsdp: dict[str, Any] = {}
    if opts.fsdp:
        fsdp = {"fsdp": "full_shard",
                "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}}
    targs = TrainingArguments(
        output_dir=str(out / "run"), max_steps=opts.max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
        warmup_steps=2, lr_scheduler_type="cosine", save_strategy="no", report_to=[], use_cpu=opts.device == "cpu",
        bf16=opts.bf16, logging_steps=1, seed=42, disable_tqdm=True, dataloader_num_workers=0, **fsdp,
    )
    callback = SmartCkptCallback(SmartCkptConfig(base_interval=opts.base_interval, keep_last=100,
                                                 policy={"overhead_budget": 1.0}))
    trainer = Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[callback, Steps()])
    path = None
    if opts.resume:
        try:
            path = resume_checkpoint(trainer, opts.resume)
        except Exception as e:  # a refusal is the result to report
            record["error"] = f"{type(e).__name__}: {e}"
            dump()
            return
        record["resumed_from"] = callback.resumed_from.info.step if callback.resumed_from is not None else None
    trainer.train(resume_from_checkpoint=path)
    dump()


if __name__ == "__main__":
    main()

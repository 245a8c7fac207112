"""Runnable worker for the TRL test (not a test module): a LoRA fine-tune written as most are, with `SFTTrainer`.

TRL's `SFTTrainer` on raw text (it tokenizes, truncates and, with `--packing`, packs), `peft_config` (TRL wraps the
model), TRL's defaults (gradient checkpointing on, bf16 autocast), evaluation every 3 steps, two persistent
data-loader workers, and `SmartCkptCallback()` with every setting at its default. `--kill_at N` SIGKILLs the whole
process group (data-loader workers and the library's writer too: nothing outlives the job) at the end of step N.
Writes `<out>/<tag>.json`: every training micro-batch loss as a hex float, the evaluation losses, and the checkpoint
resumed from (and where it was read). `--trainer dpo` runs the same job as TRL's `DPOTrainer` on preference pairs
cut from the same text (LoRA: the reference model is the base with the adapter off), recording each micro-batch's
DPO loss as `compute_loss` returns it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch

torch.set_num_threads(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--kill_at", type=int, default=None)
    p.add_argument("--packing", action="store_true")
    p.add_argument("--trainer", choices=["sft", "dpo"], default="sft")
    args = p.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, resume_checkpoint

    texts = toy.text_corpus(max_chars=60_000)
    tok = toy.train_tokenizer(texts, vocab_size=384)
    model = toy.tiny_qwen2(seed=0, vocab_size=len(tok), hidden_size=32)
    common = dict(output_dir=os.path.join(args.out, "run"), max_steps=10, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, learning_rate=1e-3, max_length=64, eval_strategy="steps", eval_steps=3,
                  per_device_eval_batch_size=4, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                  dataloader_num_workers=2, dataloader_persistent_workers=True, disable_tqdm=True)
    if args.trainer == "dpo":
        rows = [{"prompt": t[:40], "chosen": t[40:90], "rejected": texts[(i + 7) % len(texts)][40:90]}
                for i, t in enumerate(texts[:72])]
        trainer_cls, config, train, held_out = DPOTrainer, DPOConfig(**common), rows[:64], rows[64:72]
    else:
        rows = [{"text": t} for t in texts[:72]]
        trainer_cls, config, train, held_out = SFTTrainer, SFTConfig(**common, packing=args.packing), rows[:64], \
            rows[64:72]
    losses: list[str] = []

    class Kill(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == args.kill_at:
                with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
                    json.dump({"losses": losses}, f)
                os.killpg(0, signal.SIGKILL)

    callback = SmartCkptCallback()
    trainer = trainer_cls(model=model, args=config, train_dataset=Dataset.from_list(train),
                          eval_dataset=Dataset.from_list(held_out), processing_class=tok,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.1),
                          callbacks=[callback, Kill()])

    def record(mod, inp, out):  # type: ignore[no-untyped-def]
        if mod.training:
            losses.append(out.loss.detach().double().item().hex())

    compute = trainer.compute_loss

    def compute_loss(model, inputs, *a, **kw):  # type: ignore[no-untyped-def]  # DPO's loss is not the model's
        out = compute(model, inputs, *a, **kw)
        if model.training:
            losses.append((out[0] if isinstance(out, tuple) else out).detach().double().item().hex())
        return out

    if args.trainer == "sft":
        trainer.model.register_forward_hook(record)
    else:
        trainer.compute_loss = compute_loss
    ref = resume_checkpoint(trainer, "auto")
    trainer.train(resume_from_checkpoint=ref)
    evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump({"losses": losses, "evals": evals, "resumed": ref,
                   "resumed_path": callback.resumed_from and str(callback.resumed_from.info.path)}, f)


if __name__ == "__main__":
    main()

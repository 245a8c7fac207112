"""Runnable worker for the TRL test (not a test module): a LoRA fine-tune written as most are, with `SFTTrainer`.

TRL's `SFTTrainer` on raw text (it tokenizes, truncates and, with `--packing`, packs), `peft_config` (TRL wraps the
model), TRL's defaults (gradient checkpointing on, bf16 autocast), evaluation every 3 steps, two persistent
data-loader workers, and `SmartCkptCallback()` with every setting at its default. `--kill_at N` SIGKILLs the whole
process group (data-loader workers and the library's writer too: nothing outlives the job) at the end of step N.
Writes `<out>/<tag>.json`: every training micro-batch loss as a hex float, the evaluation losses, and the checkpoint
resumed from (and where it was read).
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
    args = p.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, resume_checkpoint

    texts = toy.text_corpus(max_chars=60_000)
    tok = toy.train_tokenizer(texts, vocab_size=384)
    model = toy.tiny_qwen2(seed=0, vocab_size=len(tok), hidden_size=32)
    config = SFTConfig(output_dir=os.path.join(args.out, "run"), max_steps=10, per_device_train_batch_size=4,
                       gradient_accumulation_steps=2, learning_rate=1e-3, max_length=64, packing=args.packing,
                       eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4, save_strategy="no",
                       report_to=[], use_cpu=True, seed=0, dataloader_num_workers=2,
                       dataloader_persistent_workers=True, disable_tqdm=True)
    losses: list[str] = []

    class Kill(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == args.kill_at:
                with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
                    json.dump({"losses": losses}, f)
                os.killpg(0, signal.SIGKILL)

    callback = SmartCkptCallback()
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts[:64]}),
                         eval_dataset=Dataset.from_dict({"text": texts[64:72]}), processing_class=tok,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.1),
                         callbacks=[callback, Kill()])

    def record(mod, inp, out):  # type: ignore[no-untyped-def]
        if mod.training:
            losses.append(out.loss.detach().double().item().hex())

    trainer.model.register_forward_hook(record)
    ref = resume_checkpoint(trainer, "auto")
    trainer.train(resume_from_checkpoint=ref)
    evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump({"losses": losses, "evals": evals, "resumed": ref,
                   "resumed_path": callback.resumed_from and str(callback.resumed_from.info.path)}, f)


if __name__ == "__main__":
    main()

"""Qwen2-7B LoRA fine-tuning with `Trainer` + `SmartCkptCallback` (signal-driven tiered checkpoints).

Real run (8 GPUs, DDP, bf16):

    accelerate launch --config_file recipes/qwen2_7b_lora/accelerate_config.yaml \
        recipes/qwen2_7b_lora/train.py \
        --model_name_or_path Qwen/Qwen2-7B --dataset data/train.jsonl \
        --output_dir runs/qwen2-7b-lora --bf16 --per_device_train_batch_size 4 \
        --gradient_accumulation_steps 4 --learning_rate 2e-4 --num_train_epochs 3 \
        --logging_steps 10 --save_strategy no --report_to none \
        --smart_ckpt_config recipes/qwen2_7b_lora/checkpoint_config.yaml \
        --resume_from_smart_checkpoint auto

Tiny run (CPU, no download, under a minute):

    python recipes/qwen2_7b_lora/train.py --tiny --use_cpu --output_dir /tmp/qwen-tiny \
        --max_steps 12 --per_device_train_batch_size 2 --logging_steps 1 --report_to none \
        --save_strategy no --resume_from_smart_checkpoint auto
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import torch
from transformers import (
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from examples import toy
from hf_dynamic_ckpt import SmartCkptArguments, SmartCkptCallback, resume_checkpoint

logger = logging.getLogger("recipes.qwen2_7b_lora")
HERE = Path(__file__).resolve().parent


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="Qwen/Qwen2-7B", metadata={"help": "Hub name or local path."})
    dataset: str | None = field(
        default=None,
        metadata={"help": "Local .json/.jsonl file (one {'text': ...} per record) or a hub dataset name."})
    dataset_split: str = field(default="train")
    text_field: str = field(default="text")
    max_seq_length: int = field(default=1024, metadata={"help": "Tokens per training block."})
    lora_r: int = field(default=16)
    lora_alpha: int = field(default=32)
    lora_dropout: float = field(default=0.05)
    lora_target_modules: str = field(default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    tiny: bool = field(
        default=False, metadata={"help": "Tiny Qwen2 from config, tokenizer and data built in code (CPU)."})
    tiny_examples: int = field(default=64, metadata={"help": "--tiny: training blocks of 32 tokens."})
    loss_log: str | None = field(
        default=None, metadata={"help": "Append each logged loss (float.hex) to this JSONL file."})
    simulate_crash_at_step: int | None = field(
        default=None, metadata={"help": "Testing: every rank SIGKILLs itself right after this optimizer step."})


class LossLog(TrainerCallback):
    """Appends `{"step", "loss"}` (exact, float.hex) per logged step on the main process."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, "loss": float(logs["loss"]).hex()}) + "\n")


class CrashAt(TrainerCallback):
    """Kills this process with SIGKILL after optimizer step `step` (no cleanup: a real crash).

    When the step is logged, the kill waits for its log line (`on_log` follows `on_step_end`).
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.armed = False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if control.should_log:
                self.armed = True
            else:
                os.kill(os.getpid(), signal.SIGKILL)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)


def tiny_setup(script: ScriptArguments):
    texts = toy.text_corpus(max_chars=60_000)
    tokenizer = toy.train_tokenizer(texts, vocab_size=384)
    dataset = toy.lm_dataset(tokenizer, texts, seq_len=32, num_examples=script.tiny_examples)
    model = toy.tiny_qwen2(seed=0, vocab_size=len(tokenizer), dropout=0.1)
    targets = [t for t in script.lora_target_modules.split(",") if t]
    model = toy.lora(model, r=4, target_modules=targets, dropout=0.1, seed=0)
    return tokenizer, dataset, model


def real_setup(script: ScriptArguments, args: TrainingArguments):
    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if script.dataset is None:
        raise SystemExit("--dataset is required without --tiny (a .json/.jsonl file or a hub dataset name).")
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    if script.dataset.endswith((".json", ".jsonl")):
        raw = load_dataset("json", data_files=script.dataset, split="train")
    else:
        raw = load_dataset(script.dataset, split=script.dataset_split)
    block = script.max_seq_length

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch[script.text_field]], add_special_tokens=False)

    def group(batch):
        ids = list(chain.from_iterable(batch["input_ids"]))
        n = len(ids) // block * block
        blocks = [ids[i : i + block] for i in range(0, n, block)]
        return {"input_ids": blocks, "attention_mask": [[1] * block for _ in blocks],
                "labels": [list(b) for b in blocks]}

    with args.main_process_first(desc="tokenize"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
        dataset = tokenized.map(group, batched=True, remove_columns=tokenized.column_names)
    model = AutoModelForCausalLM.from_pretrained(
        script.model_name_or_path, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    lora = LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout,
                      target_modules=script.lora_target_modules.split(","), task_type="CAUSAL_LM")
    return tokenizer, dataset, get_peft_model(model, lora)


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments, SmartCkptArguments))
    script, args, smart = parser.parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO if args.process_index == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    torch.set_num_threads(1) if script.tiny else None
    if smart.smart_ckpt_config is None:
        smart.smart_ckpt_config = str(HERE / "checkpoint_config.yaml")
    config = smart.to_config()
    if script.tiny:
        # Steps take milliseconds here: save every few steps and let saves cost what they cost.
        config = config.replace(base_interval=3, keep_last=100, policy={"max_interval": 3, "overhead_budget": 1.0})
        tokenizer, dataset, model = tiny_setup(script)
    else:
        tokenizer, dataset, model = real_setup(script, args)
    callbacks: list[TrainerCallback] = [SmartCkptCallback(config)]
    if script.loss_log:
        callbacks.append(LossLog(script.loss_log))
    if script.simulate_crash_at_step is not None:
        callbacks.append(CrashAt(script.simulate_crash_at_step))
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                      processing_class=tokenizer, callbacks=callbacks)
    resume = resume_checkpoint(trainer, smart.resume_from_smart_checkpoint)
    logger.info("resume_from_smart_checkpoint=%r -> %s", smart.resume_from_smart_checkpoint, resume or "fresh start")
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(args.output_dir, "final"))


if __name__ == "__main__":
    main()

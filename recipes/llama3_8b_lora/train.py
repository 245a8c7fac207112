"""LLaMA-3-8B LoRA fine-tuning in a custom Accelerate loop with `SmartCheckpointer`.

Real run (8 GPUs, DDP, bf16):

    accelerate launch --config_file recipes/llama3_8b_lora/accelerate_config.yaml \
        recipes/llama3_8b_lora/train.py \
        --model_name_or_path meta-llama/Meta-Llama-3-8B --dataset data/train.jsonl \
        --output_dir runs/llama3-8b-lora --per_device_train_batch_size 4 \
        --gradient_accumulation_steps 4 --learning_rate 2e-4 --num_train_epochs 3 \
        --smart_ckpt_config recipes/llama3_8b_lora/checkpoint_config.yaml \
        --resume_from_smart_checkpoint auto

Tiny run (CPU, no download, under a minute):

    python recipes/llama3_8b_lora/train.py --tiny --output_dir /tmp/llama-tiny --max_steps 12 \
        --resume_from_smart_checkpoint auto
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import torch
from transformers import HfArgumentParser, default_data_collator, get_cosine_schedule_with_warmup

from examples import toy
from hf_dynamic_ckpt import SmartCheckpointer, SmartCkptArguments

logger = logging.getLogger("recipes.llama3_8b_lora")
HERE = Path(__file__).resolve().parent


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="meta-llama/Meta-Llama-3-8B", metadata={"help": "Hub name or local path."})
    dataset: str | None = field(
        default=None,
        metadata={"help": "Local .json/.jsonl file (one {'text': ...} per record) or a hub dataset name."})
    dataset_split: str = field(default="train")
    text_field: str = field(default="text")
    max_seq_length: int = field(default=2048)
    lora_r: int = field(default=16)
    lora_alpha: int = field(default=32)
    lora_dropout: float = field(default=0.05)
    lora_target_modules: str = field(default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    tiny: bool = field(
        default=False, metadata={"help": "Tiny LLaMA from config, tokenizer and data built in code (CPU)."})
    tiny_examples: int = field(default=64)
    loss_log: str | None = field(
        default=None,
        metadata={"help": "Append each step's loss, averaged over the ranks (float.hex), to this JSONL file (rank 0)."})
    simulate_crash_at_step: int | None = field(
        default=None, metadata={"help": "Testing: every rank SIGKILLs itself right after this optimizer step."})


@dataclass
class LoopArguments:
    output_dir: str = field(default="runs/llama3-8b-lora")
    per_device_train_batch_size: int = field(default=4)
    gradient_accumulation_steps: int = field(default=1)
    learning_rate: float = field(default=2e-4)
    weight_decay: float = field(default=0.0)
    warmup_steps: int = field(default=0)
    num_train_epochs: int = field(default=1)
    max_steps: int = field(default=-1, metadata={"help": "Stop after this many optimizer steps (-1: the epochs)."})
    max_grad_norm: float = field(default=1.0)
    mixed_precision: str = field(default="no", metadata={"help": "no | bf16 | fp16 (accelerate config may set it)."})
    seed: int = field(default=42)


def tiny_setup(script: ScriptArguments):
    texts = toy.text_corpus(max_chars=60_000)
    tokenizer = toy.train_tokenizer(texts, vocab_size=384)
    dataset = toy.lm_dataset(tokenizer, texts, seq_len=32, num_examples=script.tiny_examples)
    targets = [t for t in script.lora_target_modules.split(",") if t]
    model = toy.lora(toy.tiny_llama(seed=0, vocab_size=len(tokenizer), dropout=0.1), r=4, target_modules=targets,
                     dropout=0.1, seed=0)
    return dataset, model


def real_setup(script: ScriptArguments, accelerator):
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

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
        dataset = tokenized.map(group, batched=True, remove_columns=tokenized.column_names)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=torch.bfloat16)
    lora = LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout,
                      target_modules=script.lora_target_modules.split(","), task_type="CAUSAL_LM")
    return dataset, get_peft_model(model, lora)


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    parser = HfArgumentParser((ScriptArguments, LoopArguments, SmartCkptArguments))
    script, loop, smart = parser.parse_args_into_dataclasses()
    accelerator = Accelerator(cpu=script.tiny, gradient_accumulation_steps=loop.gradient_accumulation_steps,
                              mixed_precision=(None if script.tiny or loop.mixed_precision == "no"
                                               else loop.mixed_precision))
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if script.tiny:
        torch.set_num_threads(1)
    set_seed(loop.seed)
    if smart.smart_ckpt_config is None:
        smart.smart_ckpt_config = str(HERE / "checkpoint_config.yaml")
    config = smart.to_config()
    if script.tiny:
        config = config.replace(base_interval=3, keep_last=100, policy={"max_interval": 3, "overhead_budget": 1.0})
        dataset, model = tiny_setup(script)
    else:
        dataset, model = real_setup(script, accelerator)

    loader = torch.utils.data.DataLoader(dataset.with_format("torch"), batch_size=loop.per_device_train_batch_size,
                                         shuffle=True, collate_fn=default_data_collator)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=loop.learning_rate, weight_decay=loop.weight_decay)
    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes / loop.gradient_accumulation_steps)
    total = loop.max_steps if loop.max_steps > 0 else steps_per_epoch * loop.num_train_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, loop.warmup_steps, total)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    ckpt = SmartCheckpointer(accelerator, model, optimizer, scheduler, loader, config=config,
                             output_dir=loop.output_dir)
    loaded = ckpt.resume(smart.resume_from_smart_checkpoint)
    logger.info("resume_from_smart_checkpoint=%r -> %s", smart.resume_from_smart_checkpoint,
                f"step {loaded.info.step}" if loaded else "fresh start")
    log = open(script.loss_log, "a", encoding="utf-8") if script.loss_log and accelerator.is_main_process else None  # noqa: SIM115

    model.train()
    for _epoch in ckpt.epochs(loop.num_train_epochs if loop.max_steps <= 0 else 10**9):
        for batch in ckpt.loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), loop.max_grad_norm)
                ckpt.before_update()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            decision = ckpt.after_update()
            if decision is None:
                continue
            if decision.kind == "rollback":
                # on_anomaly: rollback: the run is back at a restore point before the anomaly (ckpt.step is its
                # step again) and ckpt.loader goes on with the next batches; a loop's own counters follow ckpt.step.
                logger.warning("rolled back to step %d", ckpt.step)
                continue
            if log is not None:
                # The agreed frame carries the loss summed over the ranks: log their mean.
                step_loss = ckpt.run.last_frame.loss / accelerator.num_processes
                log.write(json.dumps({"step": ckpt.step, "loss": float(step_loss).hex()}) + "\n")
                log.flush()
            if ckpt.step == script.simulate_crash_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt.step >= total or ckpt.should_stop:
                break
        if ckpt.step >= total or ckpt.should_stop:
            break
    ckpt.close()
    if log is not None:
        log.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(os.path.join(loop.output_dir, "final"))
    accelerator.end_training()


if __name__ == "__main__":
    main()

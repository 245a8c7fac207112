"""Worker: a custom Accelerate loop with SmartCheckpointer (tiny LoRA Qwen2, dropout, CPU).

Run alone or under `torchrun --nproc_per_node 2`. Rank 0 appends one JSON line per optimizer
step to --losses: the step, the step's all-reduced loss and this rank's micro-batch losses,
as float.hex (exact). --kill_at_step makes every rank SIGKILL itself right after that step's
save decision (a crash with no cleanup, possibly mid-write). At the end rank 0 writes the
adapter weights to --final (safetensors) for a bitwise comparison. The first line says where the run resumed,
its number of processes and its gradient accumulation (`SmartCheckpointer.gradient_accumulation_steps`, which a
resume on another number of processes sets). --sampler seedable / generator: an epoch order that is the same on
any number of processes (Accelerate's seedable sampler, or a DataLoader generator).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal

import torch

torch.set_num_threads(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--final", default=None)
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--resume", default=None)
    p.add_argument("--kill_at_step", type=int, default=None)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--base_interval", type=int, default=3)
    p.add_argument("--examples", type=int, default=40)
    p.add_argument("--sigterm_at_step", type=int, default=None,
                   help="send SIGTERM to this process after step N (preemption: saved at the next boundary)")
    p.add_argument("--save_state_at", type=int, default=None,
                   help="also call accelerator.save_state('state-<N>') after step N (the hook pair)")
    p.add_argument("--load_state", default=None, help="resume with accelerator.load_state(DIR) instead")
    p.add_argument("--surge_at_step", type=int, default=None,
                   help="multiply the loss of this optimizer step by 1e4 (a gradient explosion)")
    p.add_argument("--poison_batch", type=int, default=None,
                   help="multiply the loss of the N-th batch (1-based) of the first epoch's data by 1e4: bad data, "
                        "whatever step reads it")
    p.add_argument("--skip_batches", default=None,
                   help="A:B: skip the batches A..B (1-based) of the first epoch without training on them: the "
                        "reference of a rollback that skipped them")
    p.add_argument("--on_anomaly", default="capture", choices=["capture", "rollback"])
    p.add_argument("--rollback_skip_batches", type=int, default=0)
    p.add_argument("--root", default=None, help="store root (e.g. s3://bucket/run) instead of <output_dir>/smart_ckpt")
    p.add_argument("--remote_options", default=None, help="JSON storage options of a URL root")
    p.add_argument("--remote_cache_dir", default=None)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--sampler", default="plain", choices=["plain", "seedable", "generator"])
    p.add_argument("--deepspeed", type=int, default=None, choices=[1, 2, 3],
                   help="train under DeepSpeed ZeRO of this stage (run with DS_ACCELERATOR=cpu)")
    p.add_argument("--two_groups", action="store_true", help="two optimizer parameter groups (the LoRA A and B "
                   "weights alternately): under ZeRO two flat partitions")
    p.add_argument("--log_info", action="store_true", help="show the library's INFO lines (the resume's plan)")
    args = p.parse_args()
    if args.log_info:
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("hf_dynamic_ckpt").setLevel(logging.INFO)

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from safetensors.torch import save_file

    from examples import toy
    from hf_dynamic_ckpt import SmartCheckpointer, SmartCkptConfig
    from hf_dynamic_ckpt.state import trainable_state_dict

    seedable = DataLoaderConfiguration(use_seedable_sampler=args.sampler == "seedable")
    plugin = None
    if args.deepspeed is not None:
        from accelerate import PartialState
        from accelerate.utils import DeepSpeedPlugin

        PartialState(backend="gloo")  # else Accelerate counts one process under DeepSpeed without GPUs

        plugin = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": args.grad_accum,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": args.deepspeed},
            "zero_allow_untested_optimizer": True})
    # cpu=True would make Accelerate ignore the plugin: under DeepSpeed the device comes from DS_ACCELERATOR=cpu.
    accelerator = Accelerator(cpu=plugin is None, gradient_accumulation_steps=args.grad_accum,
                              dataloader_config=seedable, deepspeed_plugin=plugin)
    set_seed(0)
    model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=128, hidden_size=32, dropout=args.dropout), r=4,
                     dropout=args.dropout)
    data = toy.random_token_dataset(num_examples=args.examples, seq_len=8, vocab_size=128, seed=1).with_format("torch")
    generator = torch.Generator().manual_seed(7) if args.sampler == "generator" else None
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, generator=generator)
    trained = [q for q in model.parameters() if q.requires_grad]
    groups = [{"params": trained[0::2]}, {"params": trained[1::2]}] if args.two_groups else trained
    optimizer = torch.optim.AdamW(groups, lr=5e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.2, total_iters=args.max_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    remote = {"storage_options": json.loads(args.remote_options) if args.remote_options else None,
              "cache_dir": args.remote_cache_dir}
    config = SmartCkptConfig(base_interval=args.base_interval, keep_last=100, root=args.root,
                             on_anomaly=args.on_anomaly,
                             policy={"overhead_budget": 1.0, "rollback_skip_batches": args.rollback_skip_batches},
                             remote=remote)
    ckpt = SmartCheckpointer(accelerator, model, optimizer, scheduler, loader, config=config,
                             output_dir=args.output_dir)
    if args.load_state:
        accelerator.load_state(args.load_state)
        loaded = ckpt.hooks.last_loaded
    else:
        loaded = ckpt.resume(args.resume)
    main_rank = accelerator.is_main_process
    out = open(args.losses, "a", encoding="utf-8") if main_rank else None  # noqa: SIM115
    if out is not None:
        out.write(json.dumps({"resumed_from": loaded.info.step if loaded else None,
                              "world_size": accelerator.num_processes, "ga": ckpt.gradient_accumulation_steps}) + "\n")
        out.flush()
    micro: list[str] = []
    skip = tuple(int(x) for x in args.skip_batches.split(":")) if args.skip_batches else None
    while ckpt.step < args.max_steps and not ckpt.should_stop:
        for batch in ckpt.loader:
            position = (ckpt.loader.epoch, ckpt.loader.batches_seen)  # of the batch just handed out
            if skip is not None and position[0] == 0 and skip[0] <= position[1] <= skip[1]:
                continue  # the reference: this batch is not in its data stream
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                micro.append(float(loss.detach()).hex())
                if ckpt.step + 1 == args.surge_at_step or position == (0, args.poison_batch):
                    loss = loss * 1e4
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                ckpt.before_update()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            decision = ckpt.after_update()
            if decision is None:
                continue
            if out is not None and decision.kind == "rollback" and ckpt.last_rollback is not None:
                done = ckpt.last_rollback
                out.write(json.dumps({"rollback": [done.from_step, done.to_step], "step": ckpt.step}) + "\n")
                out.flush()
                micro = []
                continue
            if out is not None:
                frame = ckpt.run.last_frame
                out.write(json.dumps({"step": ckpt.step, "loss": float(frame.loss).hex(), "micro": micro,
                                      "save": decision.save, "captures": [
                                          [e.step, e.reason, e.pinned] for e in ckpt.run.events
                                          if e.at_step == ckpt.step and e.step < e.at_step]}) + "\n")
                out.flush()
            micro = []
            if ckpt.step == args.save_state_at:
                accelerator.save_state(f"state-{ckpt.step}")
            if ckpt.step == args.sigterm_at_step:
                os.kill(os.getpid(), signal.SIGTERM)
            if ckpt.step == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt.step >= args.max_steps or ckpt.should_stop:
                break
    if out is not None and ckpt.should_stop:
        out.write(json.dumps({"stopped": "preemption", "step": ckpt.step,
                              "reason": ckpt.run.events[-1].reason}) + "\n")
    ckpt.close()
    unwrapped = accelerator.unwrap_model(model)
    if args.deepspeed == 3:  # the partitions gathered on every rank (a collective)
        import deepspeed

        with deepspeed.zero.GatheredParameters([q for q in unwrapped.parameters() if q.requires_grad]):
            final = {k: v.detach().clone() for k, v in trainable_state_dict(unwrapped).items()}
    else:
        final = {k: v.detach().contiguous() for k, v in trainable_state_dict(unwrapped).items()}
    if main_rank and args.final:
        save_file(final, args.final)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()

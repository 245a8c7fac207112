"""Runnable worker for the memory-limit tests and `scripts/bench_memory.py` (not a test module).

One Trainer full fine-tune of a tiny Llama built from config (about 13M parameters by
default: ~50 MB of weights, ~100 MB of AdamW state), with no saves (`--saves none`),
Trainer's own `save_steps` (`native`) or `SmartCkptCallback` (`smart`). Writes
`<out>/<tag>.json`: the loss of every step (hex floats), the peak RSS of this process and
its children (the writer process), and the smart saves' events and staging paths.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

torch.set_num_threads(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--saves", choices=["none", "native", "smart"], required=True)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--interval", type=int, default=3, help="native save_steps / smart base_interval")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--resume", default=None, help="resume_checkpoint spec (smart runs)")
    p.add_argument("--engine", default=None, help="SmartCkptConfig.engine (default: the config's default)")
    args = p.parse_args()

    from transformers import Trainer, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint

    model = toy.tiny_llama(seed=0, hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab,
                           intermediate_size=2 * args.hidden)
    ds = toy.random_token_dataset(num_examples=4 * args.max_steps, seq_len=32, vocab_size=args.vocab, seed=1)
    losses: list[str] = []

    def hook(mod, inp, out):  # type: ignore[no-untyped-def]
        if mod.training:
            losses.append(out.loss.detach().double().item().hex())

    model.register_forward_hook(hook)
    callbacks = []
    cb = None
    if args.saves == "smart":
        extra = {"engine": args.engine} if args.engine else {}
        cb = SmartCkptCallback(SmartCkptConfig(root=os.path.join(args.out, "ckpt"), base_interval=args.interval,
                                               **extra,
                                               policy={"stability_window": 8, "overhead_budget": 1.0}))
        callbacks.append(cb)
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "run"), max_steps=args.max_steps, per_device_train_batch_size=4,
        learning_rate=1e-3, save_strategy="steps" if args.saves == "native" else "no", save_steps=args.interval,
        report_to=[], use_cpu=True, logging_steps=1, seed=42, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=ds, callbacks=callbacks)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer, args.resume) if args.resume else None)
    train_s = time.perf_counter() - start
    events = []
    if cb is not None and cb.run is not None:
        cb.run.finish()
        events = [e.to_dict() for e in cb.run.events]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump({"losses": losses, "events": events, "peak_rss": peak, "children_peak_rss": children,
                   "weights_bytes": state_bytes, "train_s": train_s,
                   "resumed_from": cb.resumed_from.info.step if cb is not None and cb.resumed_from else None}, f)


if __name__ == "__main__":
    sys.exit(main())

"""Worker: Trainer runs saved and resumed mid-epoch, at an epoch boundary and after a clean exit, in one process.

Run as a script (`tests/integration/test_resume_matrix.py` starts it, alone or under `torchrun`):
a tiny Qwen2 (dropout on; `--model lora` adds a LoRA adapter) trains `EPOCHS` epochs of 12 optimizer
steps with `SmartCkptCallback(base_interval=4)` and the data-loader settings given. Then, in the
same process, for every resume point a new model (other initial weights), `Trainer` and callback
with a store of their own resume from the uninterrupted run's checkpoint of that step
(`resume_checkpoint(trainer, path)`) and train to the end. Last, a run that stops cleanly after
the first epoch (`control.should_training_stop`) and the same command started again with
`resume_checkpoint(trainer, "auto")`. Every training micro-batch's loss is recorded as float.hex,
with a digest of its batch; rank R writes `<out>/rank<R>.json`. `--iterable` trains on the same data as an
iterable dataset without a length (shuffled with a buffer, two shards): Trainer then runs `max_steps` and ends an
epoch when the data runs out. `--sampling group_by_length` uses Trainer's `LengthGroupedSampler`, whose order is drawn
from the global torch generator as each epoch's iterator is created.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

EPOCHS = 2
STEPS_PER_EPOCH = 12
BATCH = 4
RESUME_POINTS = (8, 12, 16)
EVAL_STEPS = 5  # mid-epoch, the epoch boundary, mid-epoch of the second epoch


def _model(kind: str, seed: int) -> torch.nn.Module:
    from examples import toy

    model = toy.tiny_qwen2(seed=0 if kind == "lora" else seed, vocab_size=128, hidden_size=32, dropout=0.1)
    return toy.lora(model, r=4, dropout=0.1, seed=seed) if kind == "lora" else model


def _train(args: argparse.Namespace, out: Path, *, seed: int, resume: str | None, stop_at: int | None = None
           ) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = _model(args.model, seed)
    examples = STEPS_PER_EPOCH * BATCH * args.ga * world
    ds: Any = toy.random_token_dataset(num_examples=examples, seq_len=16, vocab_size=128, seed=1)
    if args.iterable:
        ds = ds.to_iterable_dataset(num_shards=2).shuffle(seed=3, buffer_size=16)
    evaluating = args.eval != "off"
    eval_ds: Any = toy.random_token_dataset(num_examples=16, seq_len=16, vocab_size=128, seed=2) if evaluating else None
    if args.eval == "start":  # and a dict of two eval datasets (one loader each)
        eval_ds = {"a": eval_ds, "b": toy.random_token_dataset(num_examples=8, seq_len=16, vocab_size=128, seed=3)}
    inner = model.base_model.model if args.model == "lora" else model
    micro: list[list[Any]] = []

    def record(mod, inp, kwargs, output):  # type: ignore[no-untyped-def]
        if mod.training:
            ids = kwargs["input_ids"]
            digest = int((ids * torch.arange(1, ids.shape[1] + 1)).sum())
            micro.append([float(output.loss.detach()).hex(), digest])

    inner.register_forward_hook(record, with_kwargs=True)

    class Stop(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == stop_at:
                control.should_training_stop = True

    targs = TrainingArguments(
        output_dir=str(out), num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
        max_steps=EPOCHS * STEPS_PER_EPOCH if args.iterable else -1,
        gradient_accumulation_steps=args.ga, learning_rate=1e-2, warmup_steps=2, lr_scheduler_type="cosine",
        save_strategy="no", report_to=[], use_cpu=True, logging_steps=1, seed=42, disable_tqdm=True,
        dataloader_num_workers=args.workers, dataloader_persistent_workers=args.persistent and args.workers > 0,
        eval_strategy="steps" if evaluating else "no", eval_steps=EVAL_STEPS, per_device_eval_batch_size=BATCH,
        eval_on_start=args.eval == "start", train_sampling_strategy=args.sampling)
    callback = SmartCkptCallback(SmartCkptConfig(base_interval=4, keep_last=None,
                                                 policy={"stability_window": 8, "overhead_budget": 1.0}))
    trainer = Trainer(model=model, args=targs, train_dataset=ds, eval_dataset=eval_ds, callbacks=[callback, Stop()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer, resume))
    resumed = callback.resumed_from.info.step if callback.resumed_from is not None else None
    weights = {k: v.detach().double().sum().item() for k, v in model.named_parameters() if v.requires_grad}
    return {"micro": micro, "resumed_from": resumed, "global_step": trainer.state.global_step,
            "weights": {k: float(v).hex() for k, v in weights.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", choices=["lora", "full"], default="lora")
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--iterable", action="store_true", help="the data as an iterable dataset without a length")
    p.add_argument("--sampling", default="random", help="Trainer's train_sampling_strategy (`group_by_length` draws "
                   "each epoch's order from the global torch generator when its iterator is created)")
    p.add_argument("--points", default=",".join(map(str, RESUME_POINTS)))
    p.add_argument("--clean_exit", action="store_true", help="also: stop after epoch 0, then resume 'auto'")
    p.add_argument("--eval", choices=["off", "steps", "start"], default="off",
                   help="evaluate every EVAL_STEPS steps (`start`: also before the first step, on two eval datasets)")
    args = p.parse_args()
    out = Path(args.out)
    result: dict[str, Any] = {"reference": _train(args, out / "reference", seed=0, resume=None), "resumed": {}}
    store = out / "reference" / "smart_ckpt" / "default"
    for point in (int(x) for x in args.points.split(",") if x):
        result["resumed"][str(point)] = _train(args, out / f"resumed-{point}", seed=7,
                                               resume=str(store / f"step-{point}"))
    if args.clean_exit:
        first = _train(args, out / "clean", seed=0, resume="auto", stop_at=STEPS_PER_EPOCH)
        result["clean_exit"] = {"first": first, "again": _train(args, out / "clean", seed=7, resume="auto")}
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()

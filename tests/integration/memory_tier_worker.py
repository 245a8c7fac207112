"""A Trainer run for the memory-tier tests: tiny Qwen2 + LoRA (dropout on), a save to disk every 5 steps, 0.1 s
steps (a real model's pace: the writer keeps up), optionally SIGKILLed after a step (`--kill_at`, `--kill_group`
kills the writer process too) or resumed with `resume_checkpoint(trainer, "auto")`. Writes its losses as JSON."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import Trainer, TrainerCallback, TrainingArguments

from examples import toy_text
from examples.toy import lora, tiny_qwen2
from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint
from hf_dynamic_ckpt.store.slots import slots_dir


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill_at", type=int, default=0)
    p.add_argument("--kill_group", action="store_true")
    p.add_argument("--kill_once", action="store_true", help="only in torchrun's first attempt (a restart resumes)")
    p.add_argument("--task", default="default")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--memory_tier", default="true")
    p.add_argument("--loop", default="trainer", choices=["trainer", "accelerate"])
    p.add_argument("--base_interval", default="5", help="'none': the interval is the library's (Young/Daly)")
    p.add_argument("--mtbf_hours", type=float, default=None)
    p.add_argument("--root", default=None, help="the store root (e.g. s3://bucket/run); default <out>/run/smart_ckpt")
    p.add_argument("--storage_options", default=None, help="JSON storage options of a URL root")
    p.add_argument("--cache_dir", default=None)
    p.add_argument("--no_wait_writer", action="store_true", help="slots on the training thread until the writer is up")
    p.add_argument("--remove_slots_at", type=int, default=None,
                   help="another process removes the slots' directory after this step")
    args = p.parse_args()
    out = Path(args.out)
    if args.loop == "accelerate":
        return accelerate_loop(args, out)
    losses: list[list[float]] = []
    # A slot every step, as at a real model's pace (a snapshot of ~2 ms against a step of a second; these steps of
    # 0.1 s on a loaded machine could make the budget's cadence 2, `slot_cadence`, tested on its own).
    interval = None if args.base_interval == "none" else int(args.base_interval)
    # A first disk save at step 4 measures the save's cost the interval is derived from (Young/Daly).
    policy = {"mtbf_hours": args.mtbf_hours, "stability_window": 4} if args.mtbf_hours is not None else {}
    remote = {"storage_options": json.loads(args.storage_options or "{}"), "cache_dir": args.cache_dir} \
        if args.root else {}
    callback = SmartCkptCallback(SmartCkptConfig(
        base_interval=interval, task_id=args.task, policy=policy, root=args.root, remote=remote,
        runtime={"memory_tier": args.memory_tier == "true", "memory_every": 1}))
    if args.kill_once and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        args.kill_at = 0

    slots = slots_dir(Path(args.root) if args.root else out / "run" / "smart_ckpt", args.task)
    there: list[bool] = []  # whether the slots' directory exists at each step's end after it was removed
    memory: dict[str, float] = {}  # the memory tier's numbers in the last training log

    class Pace(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            if args.remove_slots_at is not None and state.global_step > args.remove_slots_at:
                there.append(slots.exists())
            if args.remove_slots_at and state.global_step == args.remove_slots_at:
                shutil.rmtree(slots)
            if state.global_step == 1 and not args.no_wait_writer:  # the writer process starts after the first step
                assert callback.run is not None and callback.run.engine.start(wait_s=120)
            time.sleep(0.1)
            if state.global_step == args.kill_at:
                (out / "killed.json").write_text(json.dumps(losses))
                if args.kill_group:  # the launcher's way: every process of the job, the writer too
                    os.killpg(0, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_log(self, a, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                losses.append([state.global_step, logs["loss"]])
                memory.update({k: v for k, v in logs.items() if k.startswith("smart_ckpt/memory")})

    targs = TrainingArguments(output_dir=str(out / "run"), max_steps=16, per_device_train_batch_size=4,
                              learning_rate=1e-3, use_cpu=True, save_strategy="no", report_to=[], logging_steps=1,
                              disable_tqdm=True, seed=0)
    model = lora(tiny_qwen2(vocab_size=128), dropout=0.1)
    data = toy_text.random_token_dataset(num_examples=64, seq_len=16, vocab_size=128, seed=1)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[callback, Pace()])
    ref = resume_checkpoint(trainer, "auto") if args.resume else None
    trainer.train(resume_from_checkpoint=ref)
    (out / ("resumed.json" if args.resume else "losses.json")).write_text(json.dumps(
        {"losses": losses, "resumed_from": ref and int(str(ref).rsplit("-", 1)[1]),
         "resumed_path": callback.resumed_from and str(callback.resumed_from.info.path), "slots_there": there,
         "memory_metrics": memory}))


def accelerate_loop(args: argparse.Namespace, out: Path) -> None:
    """The same job as a custom loop with `SmartCheckpointer` (16 steps of batch 4, loss per step)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from hf_dynamic_ckpt import SmartCheckpointer

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = lora(tiny_qwen2(vocab_size=128), dropout=0.1)
    data = toy_text.random_token_dataset(num_examples=64, seq_len=16, vocab_size=128, seed=1)
    rows = [{k: torch.tensor(data[i][k]) for k in ("input_ids", "attention_mask", "labels")} for i in range(len(data))]
    loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    ckpt = SmartCheckpointer(accelerator, model, opt, None, loader, output_dir=str(out / "run"), config=SmartCkptConfig(
        base_interval=5, runtime={"memory_tier": args.memory_tier == "true", "memory_every": 1}))
    loaded = ckpt.resume("auto") if args.resume else None
    losses: list[list[float]] = []
    for _ in ckpt.epochs(1):
        for batch in ckpt.loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            ckpt.before_update()
            opt.step()
            opt.zero_grad()
            ckpt.after_update()
            step = ckpt.step
            losses.append([step, loss.item()])
            if step == 1:
                assert ckpt.run.engine.start(wait_s=120)
            time.sleep(0.1)
            if step == args.kill_at:
                (out / "killed.json").write_text(json.dumps(losses))
                if args.kill_group:
                    os.killpg(0, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    (out / ("resumed.json" if args.resume else "losses.json")).write_text(json.dumps(
        {"losses": losses, "resumed_from": loaded.info.step if loaded is not None else None,
         "resumed_path": loaded and str(loaded.info.path)}))


if __name__ == "__main__":
    main()

"""Runnable helper of test_restart.py (not a test module): what a notebook user does in one process.

    python tests/reliability/notebook_worker.py OUT

1. A reference run of 10 steps (its own output_dir).
2. The notebook: `trainer.train()` raises at the end of step 6 (a bug in a user callback). The user
   fixes it and builds a new Trainer on the same output_dir and the same model object, then calls
   `resume_checkpoint(new_trainer, "auto")` and trains to the end.
3. One process builds several Trainers that each call `resume_checkpoint` on a stored step (the
   flow of transformers' `test_auto_batch_size_with_resume_from_checkpoint`).

Prints one JSON line: the losses of both runs, the step resumed from, the INFO lines of the
writer lock's hand-overs, and what each extra Trainer's `resume_checkpoint` returned.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

torch.set_num_threads(1)


class Boom(RuntimeError):
    pass


def main() -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint

    out = sys.argv[1]
    ds = toy.random_token_dataset(num_examples=80, seq_len=16, vocab_size=128, seed=1)

    def model_fn() -> torch.nn.Module:
        return toy.lora(toy.tiny_qwen2(seed=0, vocab_size=128, hidden_size=32, dropout=0.1), r=4, dropout=0.1)

    lock_lines: list[str] = []  # the writer lock's lines
    run_lines: list[str] = []

    class Collect(logging.Handler):
        def __init__(self, into: list[str]) -> None:
            super().__init__(level=logging.INFO)
            self.into = into

        def emit(self, record: logging.LogRecord) -> None:
            self.into.append(f"{record.levelname}: {record.getMessage()}")

    for name, into in (("hf_dynamic_ckpt.store.lock", lock_lines), ("hf_dynamic_ckpt.run.orchestrator", run_lines)):
        logging.getLogger(name).addHandler(Collect(into))
        logging.getLogger(name).setLevel(logging.INFO)

    class Record(TrainerCallback):
        def __init__(self, losses: list[str], fail_at: int | None = None) -> None:
            self.losses, self.fail_at = losses, fail_at

        def on_log(self, a, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]).hex())

        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            if self.fail_at is not None and state.global_step == self.fail_at:
                raise Boom(f"a bug in a user callback at step {state.global_step}")

    def trainer_for(model: torch.nn.Module, output_dir: str, record: Record) -> Trainer:
        args = TrainingArguments(output_dir=output_dir, max_steps=10, per_device_train_batch_size=4,
                                 learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, seed=42,
                                 save_strategy="no", disable_tqdm=True)
        config = SmartCkptConfig(base_interval=2, policy={"stability_window": 8, "overhead_budget": 1.0})
        return Trainer(model=model, args=args, train_dataset=ds, callbacks=[SmartCkptCallback(config), record])

    reference: list[str] = []
    ref = trainer_for(model_fn(), os.path.join(out, "ref"), Record(reference))
    ref.train(resume_from_checkpoint=resume_checkpoint(ref, "auto"))

    # The notebook: cell 1 fails at step 6, cell 2 (re-run after the fix) resumes on the same model object.
    model = model_fn()
    first = trainer_for(model, os.path.join(out, "nb"), Record([], fail_at=6))
    raised = None
    try:
        first.train(resume_from_checkpoint=resume_checkpoint(first, "auto"))
    except Boom as e:
        raised = str(e)
    lines_before, run_before = len(lock_lines), len(run_lines)
    resumed_losses: list[str] = []
    second = trainer_for(model, os.path.join(out, "nb"), Record(resumed_losses))
    path = resume_checkpoint(second, "auto")
    cb = next(c for c in second.callback_handler.callbacks if isinstance(c, SmartCkptCallback))
    resumed_from = cb.resumed_from.info.step if cb.resumed_from is not None else None
    handover = lock_lines[lines_before:] + [line for line in run_lines[run_before:] if "this process" in line]
    second.train(resume_from_checkpoint=path)
    hooks = len(model.base_model.model._forward_hooks)  # the first run's probes were removed at the hand-over

    # Several Trainers in one process, each resuming a stored step.
    from hf_dynamic_ckpt.store import CheckpointStore

    store = CheckpointStore(os.path.join(out, "nb", "smart_ckpt"), read_only=True)
    steps = sorted(i.step for i in store.list())
    store.close()
    each = []
    for step in steps:
        t = trainer_for(model_fn(), os.path.join(out, "nb"), Record([]))
        folder = resume_checkpoint(t, f"step:{step}")
        each.append([step, os.path.basename(folder) if folder else None])
    print(json.dumps({"reference": reference, "raised": raised, "resumed_from": resumed_from,
                      "resumed": resumed_losses, "handover": handover, "lock_lines": lock_lines, "hooks": hooks,
                      "each": each}))


if __name__ == "__main__":
    main()

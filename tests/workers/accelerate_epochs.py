"""Worker: a user's epoch loop over Accelerate, saved and resumed at mid-epoch and epoch-end points.

`run_case` is called in-process by `tests/integration/test_resume_matrix.py` (one rank) and by
`main` under `torchrun --nproc_per_node 2` (each rank writes its result to `--out/rank<R>.json`).

One uninterrupted run trains `EPOCHS` epochs with the loop users write,

```
for epoch in range(source.epoch, EPOCHS):
    for batch in source:          # hooks.loader or ckpt.loader
        ...one optimizer step...
```

(with `evaluate`, a pass over a prepared eval loader after step `EVAL_AT` of every epoch, loss recorded)
and saves along the way without changing its course: `accelerator.save_state` right after a
mid-epoch step and right after the last step of epoch 0 (inside the loop), and after epoch 1's
loop has ended; in `checkpointer` mode the policy saves too (every `BATCHES` steps: at epoch ends).
Then, for every save, a fresh model (other adapter initialisation), optimizer, scheduler and loader
resume from it (`load_state`, or `ckpt.resume(path)` for a policy checkpoint) and run the same loop
to the end, saving into a store of their own. The result holds, per step, the loss as float.hex and
a digest of the batch, for the uninterrupted run and for each resumed one.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

EPOCHS = 3
BATCHES = 4  # per epoch and rank
BATCH_SIZE = 2
MID = 2  # a save after the 2nd step of epoch 0, and one after its last step
EVAL_AT = 3  # with evaluation: after this step of every epoch (the "mid" save comes before the first one)
SEQ = 8
VOCAB = 96


class EpochTokens(torch.utils.data.IterableDataset):
    """An iterable dataset without `__len__`: random tokens in an order that depends on the epoch (`set_epoch`,
    which Accelerate's loaders call)."""

    def __init__(self, num_examples: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = torch.randint(0, VOCAB, (num_examples, SEQ), generator=g)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        worker = torch.utils.data.get_worker_info()
        if worker is not None:  # each worker yields its share, as an iterable dataset must
            order = order[worker.id::worker.num_workers]
        for i in order:
            yield {"input_ids": self.rows[i], "labels": self.rows[i]}


def _build(data: str, workers: int, persistent: bool, adapter_seed: int, evaluate: bool = False
           ) -> tuple[Any, ...]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from examples import toy

    accelerator = Accelerator(cpu=True)
    world = accelerator.num_processes
    set_seed(0)
    model = toy.lora(toy.tiny_qwen2(seed=0, vocab_size=VOCAB, hidden_size=32, dropout=0.1), r=4, dropout=0.1,
                     seed=adapter_seed)
    n = BATCHES * BATCH_SIZE * world
    extra: dict[str, Any] = {"num_workers": workers, "persistent_workers": persistent and workers > 0}
    if data == "map":
        ds = toy.random_token_dataset(num_examples=n, seq_len=SEQ, vocab_size=VOCAB, seed=1).with_format("torch")
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH_SIZE, shuffle=True, **extra)
    else:
        loader = torch.utils.data.DataLoader(EpochTokens(n), batch_size=BATCH_SIZE, **extra)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=EPOCHS * BATCHES)
    if not evaluate:
        return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler), None)
    eval_ds = toy.random_token_dataset(num_examples=4 * world, seq_len=SEQ, vocab_size=VOCAB, seed=2)
    eval_loader = torch.utils.data.DataLoader(eval_ds.with_format("torch"), batch_size=BATCH_SIZE, **extra)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler, eval_loader))


def _digest(batch: dict[str, torch.Tensor]) -> int:
    ids = batch["input_ids"]
    return int((ids * torch.arange(1, ids.numel() + 1).reshape(ids.shape)).sum())


def _loop(mode: str, data: str, workers: int, persistent: bool, root: Path, *, adapter_seed: int,
          resume: str | None, saves: dict[str, int] | None, store: str = "store", evaluate: bool = False
          ) -> dict[str, Any]:
    """The user's loop; `saves` (the uninterrupted run) records the step of each save_state folder it writes."""
    from hf_dynamic_ckpt import SmartCheckpointer, SmartCkptConfig
    from hf_dynamic_ckpt.integrations.accelerate import SmartStateHooks

    accelerator, model, optimizer, loader, scheduler, eval_loader = _build(data, workers, persistent, adapter_seed,
                                                                           evaluate)
    config = SmartCkptConfig(root=str(root / store), base_interval=BATCHES, keep_last=None,
                             policy={"overhead_budget": 1.0})
    ckpt = hooks = None
    if mode == "checkpointer":
        ckpt = SmartCheckpointer(accelerator, model, optimizer, scheduler, loader, config=config)
        source = ckpt.loader
    else:
        hooks = SmartStateHooks(accelerator, loader, config=config)
        hooks.register()
        source = hooks.loader
    assert source is not None
    if resume is not None and resume.startswith("step-"):  # a checkpoint directory of the reference's store
        assert ckpt is not None
        ckpt.resume(str(root / "store" / "default" / resume))
    elif resume is not None:
        accelerator.load_state(resume)
    steps: list[list[Any]] = []
    step = ckpt.step if ckpt is not None else 0
    if hooks is not None and hooks.last_loaded is not None:
        step = hooks.last_loaded.info.step
    start_epoch = source.epoch

    def save_state(name: str) -> None:
        if saves is not None:
            accelerator.save_state(str(root / name))
            saves[name] = step

    for epoch in range(source.epoch, EPOCHS):
        for batch in source:
            loss = model(**batch).loss
            accelerator.backward(loss)
            if ckpt is not None:
                ckpt.before_update()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if ckpt is not None:
                ckpt.after_update()
            step += 1
            steps.append([epoch, step, float(loss.detach()).hex(), _digest(batch)])
            if eval_loader is not None and source.batches_seen == EVAL_AT:
                model.eval()
                with torch.no_grad():
                    eval_loss = sum(float(model(**b).loss) for b in eval_loader)
                model.train()
                steps[-1].append(float(eval_loss).hex())
            if epoch == 0 and source.batches_seen == MID:
                save_state("mid")
            if epoch == 0 and source.batches_seen == BATCHES:
                save_state("last-step")
        if epoch == 1:
            save_state("after-loop")
    if ckpt is not None:
        ckpt.close()
    if hooks is not None:
        hooks.close()
    accelerator.wait_for_everyone()  # rank 0 has committed every save
    return {"start_epoch": start_epoch, "steps": steps}


def run_case(mode: str, data: str, workers: int, root: Path, *, persistent: bool = True, evaluate: bool = False
             ) -> dict[str, Any]:
    """The uninterrupted run and one resumed run per save (keys: `reference`, `resumed` by save name).

    An iterable dataset's persistent workers keep the copy of the dataset they started with, so its
    `set_epoch` never reaches them: the order such a run sees is not one a resume can reproduce, and the
    matrix runs iterable data with non-persistent workers."""
    from hf_dynamic_ckpt import CheckpointStore

    saves: dict[str, int] = {}
    reference = _loop(mode, data, workers, persistent, root, adapter_seed=0, resume=None, saves=saves,
                      evaluate=evaluate)
    if mode == "checkpointer":
        with CheckpointStore(root / "store", read_only=True) as store:
            saves.update({f"step-{i.step}": i.step for i in store.list() if i.reason != "save_state"})
        assert len(saves) > 3, "the policy saved nothing"
    resumed: dict[str, Any] = {}
    for name in saves:  # each resumed run saves into a store of its own: the reference's stays as it was
        where = name if name.startswith("step-") else str(root / name)
        resumed[name] = _loop(mode, data, workers, persistent, root, adapter_seed=5, resume=where, saves=None,
                              store=f"store-{name}", evaluate=evaluate)
    return {"reference": reference, "resumed": resumed, "saves": saves}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["hooks", "checkpointer"], required=True)
    p.add_argument("--data", choices=["map", "iterable"], required=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--not_persistent", action="store_true")
    p.add_argument("--evaluate", action="store_true")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    result = run_case(args.mode, args.data, args.workers, Path(args.out), persistent=not args.not_persistent,
                      evaluate=args.evaluate)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()

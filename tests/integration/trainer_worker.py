"""Runnable worker for the Trainer integration tests (not a test module; run as a script).

One training run of a tiny model with `SmartCkptCallback`, recording every training
micro-batch loss as a hex float. Faults are injected from inside: `--kill_at N` sends
SIGKILL to this process at the end of step N, `--sigterm_at N` sends SIGTERM.
Writes `<out>/<tag>.json`: losses, the step resumed from, and the save events.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch

torch.set_num_threads(1)


class PlainLM(torch.nn.Module):
    """A tiny language model that is not a `PreTrainedModel` (embedding, dropout, MLP)."""

    def __init__(self, vocab: int = 128, dim: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.drop = torch.nn.Dropout(0.1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, vocab))

    def forward(self, input_ids, labels=None, attention_mask=None):  # type: ignore[no-untyped-def]
        logits = self.mlp(self.drop(self.emb(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                            labels[:, 1:].reshape(-1))
        return out


def build_model(kind: str, tie: bool = False, dropout: float = 0.1) -> torch.nn.Module:
    from examples import toy

    if kind == "plain":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return PlainLM()
    model = toy.tiny_qwen2(seed=0, vocab_size=128, hidden_size=32, dropout=dropout, tie_word_embeddings=tie)
    if kind == "lora":
        model = toy.lora(model, r=4, dropout=dropout)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--model", default="full", choices=["full", "lora", "plain"])
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--per_device", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1, help="the model's dropout (and LoRA's)")
    p.add_argument("--accept_global_batch", action="store_true", help="runtime.keep_global_batch=false")
    p.add_argument("--final", default=None, help="rank 0 writes the trainable weights here (safetensors) at the end")
    p.add_argument("--examples", type=int, default=40)
    p.add_argument("--base_interval", type=int, default=3)
    p.add_argument("--resume", default=None)
    p.add_argument("--resume_native", default=None, help="trainer.train(resume_from_checkpoint=PATH), no store resume")
    p.add_argument("--kill_at", type=int, default=None)
    p.add_argument("--sigterm_at", type=int, default=None)
    p.add_argument("--spike_at", type=int, default=None, help="multiply this step's loss by 1000")
    p.add_argument("--tie", action="store_true", help="tied input/output embeddings (aliased weights)")
    p.add_argument("--native_save_steps", type=int, default=None, help="keep Trainer's own saves on too")
    p.add_argument("--default_policy", action="store_true",
                   help="SmartCkptConfig(base_interval=...) with every other policy knob at its default")
    p.add_argument("--slow_snapshot_rank", type=int, default=None, help="this rank's snapshots take --slow_ms longer")
    p.add_argument("--slow_ms", type=float, default=300.0)
    p.add_argument("--kill_after_save", type=int, default=None,
                   help="SIGKILL rank KILL_RANK right after the save of this step was handed to the writer")
    p.add_argument("--on_anomaly", default="capture", choices=["capture", "rollback"])
    p.add_argument("--rollback_patience", type=int, default=1)
    p.add_argument("--max_rollbacks", type=int, default=3)
    p.add_argument("--exhausted", default="stop", choices=["stop", "continue"])
    p.add_argument("--poison", default=None,
                   help="W:KIND[@R],...: poison the data of window W (1-based optimizer steps of the original data "
                        "order; of rank R only with @R) with KIND grad (loss x1000), nan or spike (loss x5); the "
                        "anomaly follows the data")
    p.add_argument("--reference_skip", default=None,
                   help="A:B: train on the original data order without windows A..B (sequential sampling): the "
                        "reference a rollback that skipped them must match")
    p.add_argument("--kill_after_rollback", action="store_true", help="SIGKILL right after the first rollback")
    p.add_argument("--delete_store_at", type=int, default=None,
                   help="rm -rf the store root at the end of this step (a cleanup script), as a user would")
    p.add_argument("--workers", type=int, default=0,
                   help="data-loader worker processes (persistent): they outlive a SIGKILLed trainer for a while")
    p.add_argument("--deepspeed", type=int, default=None, choices=[1, 2, 3],
                   help="train under DeepSpeed ZeRO of this stage (run with DS_ACCELERATOR=cpu)")
    p.add_argument("--record_layer_norms", action="store_true",
                   help="record what the gradient probe measures each step: (global norm, {LoRA layer: norm})")
    p.add_argument("--eval_steps", type=int, default=None, help="evaluate every N steps (16 eval rows)")
    p.add_argument("--eval_on_start", action="store_true")
    p.add_argument("--best", action="store_true",
                   help="load_best_model_at_end on eval_loss (Trainer's own saves every eval_steps, 2 kept)")
    p.add_argument("--early_stopping", type=int, default=None, help="EarlyStoppingCallback with this patience")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--memory_every", type=int, default=None, help="runtime.memory_every (default: from its cost)")
    p.add_argument("--wait_writer", action="store_true", help="wait for the writer process after step 1")
    p.add_argument("--rank0_fault", default=None, help="HF_DYNAMIC_CKPT_FAULT for rank 0 alone")
    args = p.parse_args()

    from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint
    from hf_dynamic_ckpt.errors import RollbackError

    rank = int(os.environ.get("RANK", "0"))
    if args.slow_snapshot_rank is not None:
        # A rank whose saves cost more (a slower disk, a busier host): its measured blocking time differs.
        os.environ["HF_DYNAMIC_CKPT_FAULT"] = f"snapshot@rank={args.slow_snapshot_rank}:sleep={args.slow_ms}"
    if args.rank0_fault and rank == 0:
        os.environ["HF_DYNAMIC_CKPT_FAULT"] = args.rank0_fault

    model = build_model(args.model, tie=args.tie, dropout=args.dropout)
    ds = toy.random_token_dataset(num_examples=args.examples, seq_len=16, vocab_size=128, seed=1)
    if args.poison or args.reference_skip:
        ds = _reorder_and_poison(ds, args)
    losses: list[str] = []
    inner = model.base_model.model if args.model == "lora" else model
    state = {"step": 0}

    def spike(mod, inp, out):  # type: ignore[no-untyped-def]
        # A gradient explosion at step --spike_at (registered before the loss recorder and the probes).
        if mod.training and args.spike_at is not None and state["step"] + 1 == args.spike_at:
            if isinstance(out, dict):
                out["loss"] = out["loss"] * 1000.0
            else:
                out.loss = out.loss * 1000.0
        return out

    inner.register_forward_hook(spike)

    def poisoned(mod, inp, kwargs, out):  # type: ignore[no-untyped-def]
        # A bad batch (--poison): its marker token multiplies the loss, whatever step the run is at.
        ids = kwargs.get("input_ids")
        if mod.training and ids is not None:
            first = ids[:, 0]
            for token, factor in POISON_FACTORS.items():
                if bool((first == token).any()):
                    loss = out["loss"] if isinstance(out, dict) else out.loss
                    loss = loss * factor
                    if isinstance(out, dict):
                        out["loss"] = loss
                    else:
                        out.loss = loss
        return out

    inner.register_forward_hook(poisoned, with_kwargs=True)

    def hook(mod, inp, out):  # type: ignore[no-untyped-def]
        if mod.training:
            loss = out["loss"] if isinstance(out, dict) else out.loss
            losses.append(loss.detach().double().item().hex())

    inner.register_forward_hook(hook)

    class Fault(TrainerCallback):
        def on_step_begin(self, a, st, control, **kw):  # type: ignore[no-untyped-def]
            state["step"] = st.global_step
            killer = rank == int(os.environ.get("KILL_RANK", "0"))
            if args.kill_after_save is not None and st.global_step == args.kill_after_save and killer:
                # SmartCkptCallback (first in the list) has just handed step N's save to the writer.
                _dump(args, rank, losses, cb, killed=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            if args.wait_writer and state.global_step == 1:  # saves go through the writer's buffers from step 2 on
                assert cb.run is not None and cb.run.engine.start(wait_s=120)
            if args.kill_at is not None and state.global_step == args.kill_at:
                # The crash comes after the last save committed on every rank: a known restore point.
                cb.run.finish()
                if torch.distributed.is_initialized():
                    torch.distributed.barrier()
                _dump(args, rank, losses, cb, killed=True, after={"rollbacks": rollbacks})
                if rank == int(os.environ.get("KILL_RANK", "0")):
                    os.kill(os.getpid(), signal.SIGKILL)
            if args.delete_store_at is not None and state.global_step == args.delete_store_at and rank == 0:
                import shutil

                store = os.path.join(args.out, "run", "smart_ckpt")
                for _ in range(100):  # as `rm -rf`: files the writer renames or removes meanwhile are no error
                    shutil.rmtree(store, ignore_errors=True)
                    if not os.path.lexists(store):
                        break
                else:
                    shutil.rmtree(store)
            if args.sigterm_at is not None and state.global_step == args.sigterm_at and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    rollback = {"rollback_patience": args.rollback_patience, "max_rollbacks": args.max_rollbacks,
                "on_rollbacks_exhausted": args.exhausted}
    short = {} if args.default_policy else {"stability_window": 8, "overhead_budget": 1.0}
    config = SmartCkptConfig(base_interval=args.base_interval, on_anomaly=args.on_anomaly,
                             policy={**rollback, **short}, runtime={"keep_global_batch": not args.accept_global_batch,
                                                                   "memory_every": args.memory_every})
    cb = SmartCkptCallback(config)
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "run"), max_steps=args.max_steps, per_device_train_batch_size=args.per_device,
        gradient_accumulation_steps=args.ga, learning_rate=args.lr, warmup_steps=2, lr_scheduler_type="cosine",
        save_strategy="steps" if args.native_save_steps or args.best else "no",
        save_steps=args.native_save_steps or (args.eval_steps if args.best else 500),
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps, per_device_eval_batch_size=4,
        eval_on_start=args.eval_on_start, load_best_model_at_end=args.best, metric_for_best_model="eval_loss",
        save_total_limit=2 if args.best else None,
        report_to=[], use_cpu=True, logging_steps=1, seed=42, disable_tqdm=True, dataloader_num_workers=args.workers,
        dataloader_persistent_workers=args.workers > 0,
        train_sampling_strategy="sequential" if args.reference_skip else "random",
        deepspeed=None if args.deepspeed is None else {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": args.deepspeed}, "zero_allow_untested_optimizer": True},
    )
    rollbacks: list[list] = []
    layer_norms: list[list] = []

    class LayerNorms(TrainerCallback):
        def on_train_begin(self, a, st, control, **kw):  # type: ignore[no-untyped-def]
            if not args.record_layer_norms:
                return
            grad = cb.run.sensors.grad
            measure = grad.measure

            def recording(*margs, **mkw):  # type: ignore[no-untyped-def]
                out = measure(*margs, **mkw)
                layer_norms.append([out[0], out[1]])
                return out

            grad.measure = recording

    class Rollbacks(TrainerCallback):
        def on_step_begin(self, a, st, control, **kw):  # type: ignore[no-untyped-def]
            done = cb.last_rollback
            if done is not None and (not rollbacks or rollbacks[-1][:2] != [done.from_step, done.to_step]):
                rollbacks.append([done.from_step, done.to_step, done.reason, len(losses)])
                if args.kill_after_rollback:  # right after it, before any later save: the store as it left it
                    _dump(args, rank, losses, cb, killed=True, after={"rollbacks": rollbacks})
                    os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [cb, Fault(), Rollbacks(), LayerNorms()]
    if args.early_stopping is not None:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=args.early_stopping))
    eval_ds = toy.random_token_dataset(num_examples=16, seq_len=16, vocab_size=128, seed=2) if args.eval_steps else None
    trainer = Trainer(model=model, args=targs, train_dataset=ds, eval_dataset=eval_ds, callbacks=callbacks)
    try:
        native = os.path.join(args.out, "run", args.resume_native) if args.resume_native else None
        trainer.train(resume_from_checkpoint=native or resume_checkpoint(trainer, args.resume))
    except SystemExit as e:  # preempted: the state is committed and the process ends with 128 + signal
        _dump(args, rank, losses, cb, killed=False, after={"exit_code": e.code, "rollbacks": rollbacks})
        raise
    except RollbackError as e:  # on_rollbacks_exhausted=stop
        _dump(args, rank, losses, cb, killed=False, after={"error": str(e), "rollbacks": rollbacks,
                                                           "global_step": trainer.state.global_step})
        return 3
    if args.final:
        import contextlib

        from safetensors.torch import save_file

        trainable = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        gather = contextlib.nullcontext()
        if args.deepspeed == 3:  # the partitions gathered on every rank (a collective)
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([q for _, q in trainable])
        with gather:
            if rank == 0:
                save_file({n: q.detach().clone().contiguous() for n, q in trainable}, args.final)
    _dump(args, rank, losses, cb, killed=False, after={
        "rollbacks": rollbacks, "global_step": trainer.state.global_step,
        "ga": trainer.args.gradient_accumulation_steps,
        "log": {e["step"]: [e["loss"], e.get("grad_norm"), e.get("learning_rate"), e.get("epoch")]
                for e in trainer.state.log_history if "loss" in e},
        "log_steps": [e.get("step") for e in trainer.state.log_history if "loss" in e],
        "forward_hooks": len(inner._forward_hooks),  # the worker's own hooks only
        "sigterm_handler_restored": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "log_keys": sorted({k for entry in trainer.state.log_history for k in entry}),
        "layer_norms": layer_norms,
        "evals": {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e},
        "best": [trainer.state.best_metric, trainer.state.best_global_step,
                 os.path.basename(trainer.state.best_model_checkpoint or "")],
        "trainable": {n: q.detach().double().sum().item().hex() for n, q in model.named_parameters()
                      if q.requires_grad},
    })


POISON_FACTORS = {127: 1000.0, 126: float("nan"), 125: 5.0}
POISON_TOKENS = {"grad": 127, "nan": 126, "spike": 125}


def _original_order(ds, args: argparse.Namespace) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The global batches of dataset indices the run draws in its first epoch (the seedable sampler's order)."""
    from transformers import Trainer, TrainingArguments

    probe = Trainer(model=torch.nn.Linear(1, 1), args=TrainingArguments(
        output_dir=os.path.join(args.out, "order-probe"), per_device_train_batch_size=4, use_cpu=True, seed=42,
        report_to=[], save_strategy="no", remove_unused_columns=False), train_dataset=ds)
    with torch.random.fork_rng(devices=[]):
        batch_sampler = probe.get_train_dataloader().batch_sampler
        inner = getattr(batch_sampler, "batch_sampler", batch_sampler)
        inner.sampler.set_epoch(0)
        return [list(b) for b in inner]


def _reorder_and_poison(ds, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--poison: mark the first example of every rank's first micro-batch of window W (optimizer step W of the
    original order); --reference_skip: the dataset in the original order without the windows A..B, for
    sequential sampling."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batches = _original_order(ds, args)  # rank r's micro-batch m is batches[m * world + r]
    per_window = world * args.ga
    if args.poison:
        marks = {}
        for item in args.poison.split(","):
            window, kind = item.split(":")
            kind, _, only = kind.partition("@")  # W:KIND@R: only rank R's batch of that window
            for r in [int(only)] if only else range(world):
                marks[batches[(int(window) - 1) * per_window + r][0]] = POISON_TOKENS[kind]  # its first micro-batch

        def mark(row, idx):  # type: ignore[no-untyped-def]
            if idx in marks:
                row["input_ids"] = [marks[idx], *row["input_ids"][1:]]
                row["labels"] = [marks[idx], *row["labels"][1:]]
            return row

        ds = ds.map(mark, with_indices=True)
    if args.reference_skip:
        a, b = (int(x) for x in args.reference_skip.split(":"))
        keep = [i for k, batch in enumerate(batches) if not (a - 1) * per_window <= k < b * per_window for i in batch]
        ds = ds.select(keep)
    return ds


def _dump(args: argparse.Namespace, rank: int, losses: list[str], cb, *, killed: bool,  # type: ignore[no-untyped-def]
          after: dict | None = None) -> None:
    ck = cb.run
    events = [e.to_dict() for e in ck.events] if ck is not None else []
    resumed = cb.resumed_from.info.step if cb.resumed_from is not None else None
    path = os.path.join(args.out, f"{args.tag}-rank{rank}.json")
    import psutil

    children = [c.pid for c in psutil.Process().children()]  # data-loader workers, the writer process
    trainer = cb.trainer
    saves_logged = [[e["step"], e["smart_ckpt/saves"]] for e in trainer.state.log_history if "smart_ckpt/saves" in e] \
        if trainer is not None else []
    with open(path, "w") as f:
        json.dump({"losses": losses, "resumed_from": resumed, "events": events,
                   "resumed_path": str(cb.resumed_from.info.path) if cb.resumed_from is not None else None,
                   "killed": killed, **(after or {}),
                   "children": children, "saves_logged": saves_logged,
                   "warnings": list(cb.resumed_from.warnings) if cb.resumed_from is not None else []}, f)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Overhead of saving inside a real `Trainer` run: no saves vs Trainer's own vs SmartCkptCallback.

One model (a Llama built from config, ~42M parameters: hidden 512, 4 layers, vocab 32000),
random tokens, one training thread, the same number of steps and the same requested save
interval `k` in every run:

- `none`:   `save_strategy="no"`;
- `native`: `save_strategy="steps", save_steps=k` (weights + optimizer + scheduler + RNG,
            synchronous);
- `smart`:  `callbacks=[SmartCkptCallback(SmartCkptConfig(base_interval=k))]` (default engine:
            writer process), with `engine.start()` called right after the callback's
            attach (the orchestrator does it after the first step; `--no-prepare` leaves it out).

Variants: `full` (full fine-tune, AdamW: ~0.5 GB of state) and `lora` (r=16 on q/k/v/o).
Each configuration runs `--repeats` times, interleaved; the table reports medians:

- overhead per save = (train time with saves - train time of `none`) / saves, where train
  time is Trainer's own `train_runtime` (it stops before `on_train_end`, so the final save
  SmartCkptCallback takes at the end of training is not in it; the wall time with it is
  reported too), and the ratio smart / native (goal <= 0.2);
- the smart saves' own blocking time (`SaveEvent.blocking_ms`), which is the part of the
  overhead the snapshot explains;
- the same overhead measured inside each run, which the run-to-run noise of a shared
  machine does not reach: what the save steps (a step counted from one on_step_begin to
  the next, so it holds the save) and the steps that ran while a write was in flight took
  beyond the run's median clean step, per save;
- step-time inflation while a background write runs: median time of the steps that started
  while the smart writer was busy over the median of the other steps of the same run (goal
  <= 5 %); the save steps themselves are excluded (their blocking time is counted above).

Run:  python scripts/bench_overhead.py                   (~10 min on 2 CPU cores)
      python scripts/bench_overhead.py --quick           (small model, smoke run)
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _dataset(args: argparse.Namespace) -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch
    ids = torch.randint(0, args.vocab, (n, args.seq), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _model(variant: str, args: argparse.Namespace) -> Any:
    from examples.toy import lora, tiny_llama

    model = tiny_llama(seed=0, hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab)
    if variant == "lora":
        model = lora(model, r=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    return model


class _StepTimer:
    """Times each optimizer step (on_step_begin -> on_step_end, before SmartCkptCallback's
    on_step_end, which takes the snapshot) and notes whether a background write was running."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                timer.begin = time.perf_counter()
                if timer.end is not None:  # after the previous step: callbacks, logging, Trainer's own save
                    timer.gaps[state.global_step] = timer.begin - timer.end
                timer.busy_now = timer.busy()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                timer.end = time.perf_counter()
                timer.steps.append((state.global_step, timer.end - timer.begin, timer.busy_now))

        self.callback = Callback()
        self.steps: list[tuple[int, float, bool]] = []
        self.gaps: dict[int, float] = {}
        """step -> time from its on_step_end to the next on_step_begin (a save of that step happens there)."""
        self.begin = 0.0
        self.end: float | None = None
        self.busy_now = False
        self.busy = lambda: False


def _run(variant: str, mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig

    out = work / f"{variant}-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.batch, max_steps=args.steps, use_cpu=True,
        report_to="none", logging_strategy="no", disable_tqdm=True, learning_rate=1e-4, dataloader_num_workers=0,
        save_strategy="steps" if mode == "native" else "no", save_steps=args.k, seed=0,
    )
    timer = _StepTimer()
    callbacks: list[Any] = [timer.callback]
    smart = None
    if mode == "smart":
        smart = SmartCkptCallback(SmartCkptConfig(base_interval=args.k, root=str(out / "smart_ckpt")))
        callbacks.append(smart)
        if not args.no_prepare:
            class Prepare(TrainerCallback):  # what attach() will do (orchestrator); runs after it
                def on_train_begin(self, *a: Any, **kw: Any) -> None:
                    assert smart is not None and smart.run is not None
                    ck = smart.run
                    ck.engine.start()

            callbacks.append(Prepare())
    trainer = Trainer(model=_model(variant, args), args=targs, train_dataset=_dataset(args), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # no log lines in the table's output
    if smart is not None:
        timer.busy = lambda: smart.run is not None and smart.run.engine.busy
    start = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - start
    res: dict[str, Any] = {"train_s": float(result.metrics["train_runtime"]), "wall_s": wall, "steps": timer.steps,
                           "gaps": timer.gaps}
    if mode == "native":
        res["saves"] = len(list(out.glob("checkpoint-*")))
        res["save_steps"] = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    elif smart is not None:
        assert smart.run is not None
        events = [e for e in smart.run.events if e.reason != "train_end" and e.error is None]
        res["saves"] = len(events)
        res["save_steps"] = [e.step for e in events]
        res["blocking_ms"] = [e.blocking_ms for e in events]
        res["end_save"] = any(e.reason == "train_end" for e in smart.run.events)
    else:
        res["saves"], res["save_steps"] = 0, []
    del trainer
    gc.collect()
    shutil.rmtree(out, ignore_errors=True)
    return res


def _within_run(res: dict[str, Any]) -> float | None:
    """Overhead per save measured inside one run (ms), unaffected by run-to-run noise.

    Each step's time is taken from its on_step_begin to the next one (so it holds the save
    taken at its end, whichever callback takes it); the overhead is what the save steps and
    the steps that ran while a write was in flight took beyond the run's median clean step.
    """
    gaps = res["gaps"]
    total = {s: t + gaps[s] for s, t, _ in res["steps"] if s in gaps}
    busy = {s for s, _, b in res["steps"] if b}
    saves = {s for s in res["save_steps"] if s in total}  # Trainer's save after the last step has no next step
    if not saves:
        return None
    clean = statistics.median(t for s, t in total.items() if s > 2 and s not in saves and s not in busy)
    extra = sum(t - clean for s, t in total.items() if s in saves or (s in busy and s > 2))
    return 1e3 * extra / len(saves)


def _inflation(steps: list[tuple[int, float, bool]], save_steps: list[int]) -> tuple[float | None, int, float]:
    """(median busy step / median other step - 1, number of busy steps, median other step s); warm-up excluded."""
    kept = [(s, t, busy) for s, t, busy in steps if s > 2 and s not in save_steps]
    busy = [t for _, t, b in kept if b]
    clean = [t for _, t, b in kept if not b]
    if not busy or not clean:
        return None, len(busy), statistics.median(clean) if clean else float("nan")
    return statistics.median(busy) / statistics.median(clean) - 1.0, len(busy), statistics.median(clean)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=26)
    p.add_argument("--k", type=int, default=8, help="requested save interval (steps)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default="full,lora")
    p.add_argument("--no-prepare", action="store_true", help="do not call engine.start after attach")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.steps, args.k, args.repeats = 128, 2, 4000, 10, 4, 1
    torch.set_num_threads(1)
    import logging

    logging.getLogger("hf_dynamic_ckpt").setLevel(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="bench_overhead-"))
    started = time.perf_counter()
    rows = []
    try:
        for variant in args.variants.split(","):
            runs: dict[str, list[dict[str, Any]]] = {"none": [], "native": [], "smart": []}
            for rep in range(args.repeats):
                for mode in ("none", "native", "smart"):
                    r = _run(variant, mode, args, work)
                    runs[mode].append(r)
                    print(f"[{variant} {rep}] {mode}: train {r['train_s']:.2f} s, wall {r['wall_s']:.2f} s, "
                          f"saves {r['save_steps']}" + (f", blocking ms {[round(b) for b in r['blocking_ms']]}"
                                                        if mode == "smart" else ""), flush=True)
            rows.append((variant, runs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 training thread, {args.steps} steps, save every "
          f"{args.k} requested, {args.repeats} repeats (medians), prepare={'no' if args.no_prepare else 'yes'}, "
          f"load average {os.getloadavg()[0]:.1f}, total {time.perf_counter() - started:.0f} s")
    print("| variant | train s: none / native / smart | saves native / smart | overhead per save ms: native | "
          "smart | smart / native | same, within-run ms: native / smart (ratio) | smart blocking ms per save | "
          "inflation during writes (n steps) | smart wall s incl. final save |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant, runs in rows:
        med = {m: statistics.median(r["train_s"] for r in rs) for m, rs in runs.items()}
        n_native = runs["native"][0]["saves"]
        n_smart = runs["smart"][0]["saves"]
        per_native = 1e3 * (med["native"] - med["none"]) / max(n_native, 1)
        per_smart = 1e3 * (med["smart"] - med["none"]) / max(n_smart, 1)
        blocking = statistics.median(b for r in runs["smart"] for b in r["blocking_ms"]) if n_smart else float("nan")
        infl = [_inflation(r["steps"], r["save_steps"]) for r in runs["smart"]]
        values = [i for i, _, _ in infl if i is not None]
        n_busy = sum(n for _, n, _ in infl)
        infl_text = f"{statistics.median(values):+.1%} ({n_busy})" if values else f"- ({n_busy})"
        wall = statistics.median(r["wall_s"] for r in runs["smart"])
        within = {m: statistics.median(v for v in (_within_run(r) for r in runs[m]) if v is not None)
                  for m in ("native", "smart") if n_native and n_smart}
        within_text = (f"{within['native']:.0f} / {within['smart']:.0f} ({within['smart'] / within['native']:.3f})"
                       if within else "-")
        print(f"| {variant} | {med['none']:.2f} / {med['native']:.2f} / {med['smart']:.2f} | {n_native} / {n_smart} | "
              f"{per_native:.0f} | {per_smart:.0f} | {per_smart / per_native:.3f} | {within_text} | {blocking:.1f} | "
              f"{infl_text} | {wall:.2f} |")


if __name__ == "__main__":
    main()

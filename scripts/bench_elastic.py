"""Elastic resume time: a checkpoint saved by 2 processes resumed on 1 (the global batch kept) vs on 2.

    python scripts/bench_elastic.py [--repeats 3] [--out bench_out/elastic] [--hidden 512] [--layers 8]

A preparation job (`torchrun --nproc_per_node 2`) fine-tunes a Qwen2 built from config (~60M parameters by
default: 32k vocab, untied embeddings, 8 layers of width 512; 2 sequences of 64 tokens per device, no
accumulation: a global batch of 4) for 3 steps with a `SmartCkptCallback` that saves step 3. Fresh jobs then
resume step 3 with `resume_checkpoint(trainer, "auto")` and train step 4, alternating:

- `same`: 2 processes, the setting it was saved with;
- `elastic`: 1 process with the same command; the library sets the accumulation to 2 (the global batch of 4).

Rank 0 reports, from the `resume_checkpoint` call: `resume` = to the first resumed step's begin (choosing,
verifying and reading the checkpoint, Trainer's own set-up and weight load), and `to step end` = to the end of
that step (the optimizer tier applied at its update; one process now computes both micro-batches, so this
column also holds twice the per-process forward and backward). Medians over `--repeats`; the ratio is
elastic / same, measured in the same run (page cache warm for both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint

    torch.set_num_threads(1)
    model = toy.tiny_qwen2(seed=0, vocab_size=32000, hidden_size=args.hidden, num_layers=args.layers,
                           intermediate_size=3 * args.hidden, num_attention_heads=8, num_key_value_heads=4)
    ds = toy.random_token_dataset(num_examples=64, seq_len=64, vocab_size=32000, seed=1)
    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            marks.setdefault("begin", time.perf_counter())

        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            marks.setdefault("end", time.perf_counter())

    targs = TrainingArguments(output_dir=str(Path(args.out) / "run"), max_steps=args.steps,
                              per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-4,
                              save_strategy="no", report_to=[], use_cpu=True, logging_steps=1, seed=42,
                              disable_tqdm=True)
    cb = SmartCkptCallback(SmartCkptConfig(base_interval=3, policy={"overhead_budget": 1.0}))
    trainer = Trainer(model=model, args=targs, train_dataset=ds, callbacks=[cb, Clock()])
    start = time.perf_counter()
    folder = resume_checkpoint(trainer, "auto" if args.resume else None)
    trainer.train(resume_from_checkpoint=folder)
    if int(os.environ.get("RANK", "0")) == 0 and args.resume:
        print("RESULT " + json.dumps({"resume": marks["begin"] - start, "end": marks["end"] - start,
                                      "ga": trainer.args.gradient_accumulation_steps}), flush=True)


def torchrun(nproc: int, out: Path, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPYCACHEPREFIX": str(out.parent / "pycache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           __file__, "--child", "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench_out/elastic")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    base = Path(args.out).absolute()
    shutil.rmtree(base, ignore_errors=True)
    shape = ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    prep = base / "prep"
    print(f"preparing: 2 processes, 3 steps, save at step 3 ({prep})", file=sys.stderr)
    torchrun(2, prep, *shape, "--steps", "3")
    results: dict[str, list[dict[str, float]]] = {"same": [], "elastic": []}
    for i in range(args.repeats):
        for mode, nproc in (("same", 2), ("elastic", 1)):
            out = base / f"{mode}-{i}"
            shutil.copytree(prep, out)
            stdout = torchrun(nproc, out, *shape, "--steps", "4", "--resume")
            row = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
            print(f"  {mode} #{i + 1}: resume {row['resume']:.2f} s, to step end {row['end']:.2f} s, "
                  f"accumulation {row['ga']}", file=sys.stderr)
            results[mode].append(row)
            shutil.rmtree(out)
    med = {m: {k: statistics.median(r[k] for r in rows) for k in ("resume", "end")} for m, rows in results.items()}
    print(f"{'mode':<34}{'resume s':>10}{'ratio':>8}{'to step end s':>16}{'ratio':>8}")
    for mode, label in (("same", "same size (2 -> 2)"), ("elastic", "elastic (2 -> 1, accumulation 2)")):
        m = med[mode]
        print(f"{label:<34}{m['resume']:>10.2f}{m['resume'] / med['same']['resume']:>8.2f}"
              f"{m['end']:>16.2f}{m['end'] / med['same']['end']:>8.2f}")


if __name__ == "__main__":
    main()

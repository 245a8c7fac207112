"""Record real per-step signal traces of tiny LoRA fine-tunes (CPU), calm and with anomalies.

Each run trains a tiny Qwen2 or Llama (`hf_dynamic_ckpt.toy`, built from config) with a
LoRA adapter on real text (Python docstrings, `toy.text_corpus`) in a plain PyTorch loop
that measures exactly what the checkpointer feeds the policy: the step's loss, the
pre-clip global gradient norm (what `clip_grad_norm_` returns), every LoRA layer's
pre-clip gradient norm (`GradProbe.measure`), and the learning rate this update uses.
Injected anomalies (onset step = the first bad step):

- `bad_batch`: one batch of uniformly random tokens (a corrupt shard);
- `loss_x`: the loss multiplied by a large factor for a few steps (the demo's explosion);
- `lr_surge`: the learning rate x20 for 20 steps (a misconfigured schedule);
- `nan_grad`: a NaN in one gradient (the update is skipped, as `skip_bad_update` would).

Output: `tests/data/traces/<name>.jsonl`, one header object (run settings, layer names,
onsets), then one compact row per step: `[step, loss, grad_norm, lr, [layer norms]]`
with 4 significant digits; non-finite numbers are the strings `"nan"` / `"inf"`.
Read them with `hf_dynamic_ckpt.signals.traces.load_trace`.

Usage: python scripts/record_traces.py [--out tests/data/traces] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hf_dynamic_ckpt import toy
from hf_dynamic_ckpt.signals.probes import GradProbe

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


@dataclass
class Run:
    """One recorded run."""

    name: str
    arch: str = "qwen2"  # or "llama"
    steps: int = 240
    seed: int = 0
    lr: float = 2e-3
    warmup: int = 10
    batch_size: int = 8
    seq_len: int = 64
    hidden_size: int = 64
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    train_head: bool = False  # PEFT modules_to_save=["lm_head"] (the demo's setup)
    lora: bool = True  # False: full fine-tune (every parameter trained, no LoRA layers)
    out_dir: str = ""  # sub-directory of --out (the early-phase traces live in "early/")
    dropout: float = 0.0
    max_grad_norm: float = 1.0
    anomalies: list[tuple[int, str]] = field(default_factory=list)  # (onset step, kind)


RUNS = [
    # The demo's setup (all projections, trained head, lr 1e-2, cosine): its first steps gave
    # the false "lora_surge x24.3" capture.
    Run("calm_demo_qwen2", steps=120, lr=1e-2, warmup=5, hidden_size=96, targets=ALL_TARGETS, train_head=True,
        dropout=0.05),
    Run("anomaly_demo_qwen2", steps=120, lr=1e-2, warmup=5, hidden_size=96, targets=ALL_TARGETS, train_head=True,
        dropout=0.05, anomalies=[(35, "loss_x")]),
    Run("calm_qwen2", steps=250, seed=1, lr=5e-3, train_head=True),
    Run("calm_llama", arch="llama", steps=250, seed=2, lr=5e-3, train_head=True, dropout=0.05),
    Run("anomaly_qwen2", steps=250, seed=3, lr=5e-3, train_head=True, anomalies=[(100, "bad_batch"), (180, "loss_x")]),
    Run("anomaly_llama", arch="llama", steps=250, seed=4, lr=5e-3, train_head=True, dropout=0.05,
        anomalies=[(100, "lr_surge"), (190, "nan_grad")]),
    # The first steps of calm runs (issue 16: capture from the first optimizer step without
    # false positives): both models, full fine-tune and LoRA, with and without warm-up.
    # Short (the early rules only matter while the windows are short), in `early/`.
    *(Run(f"calm_{arch}_{kind}_{'warmup' if warm else 'nowarmup'}", arch=arch, steps=80, seed=10 + i, lr=lr,
          warmup=warm, train_head=kind == "lora", lora=kind == "lora", dropout=0.05 if arch == "llama" else 0.0,
          out_dir="early")
      for i, (arch, kind, lr, warm) in enumerate(
          (a, k, lr, w) for a in ("qwen2", "llama") for k, lr in (("full", 2e-3), ("lora", 5e-3)) for w in (10, 0))),
    # LoRA alone (no trained head: the usual adapter setup), where lora_B = 0 at the start makes
    # the global gradient norm grow fastest in the first steps.
    Run("calm_qwen2_loraonly_nowarmup", steps=80, seed=20, lr=1e-2, warmup=0, out_dir="early"),
    Run("calm_llama_loraonly_nowarmup", arch="llama", steps=80, seed=21, lr=5e-3, warmup=0, dropout=0.05,
        out_dir="early"),
    # The demo's harsher setup (lr 1e-2, all projections, trained head) without warm-up.
    Run("calm_demo_qwen2_nowarmup", steps=80, lr=1e-2, warmup=0, hidden_size=96, targets=ALL_TARGETS, train_head=True,
        dropout=0.05, out_dir="early"),
]

LOSS_FACTOR = 30.0  # the demo's --anomaly_factor
LOSS_STEPS = 4  # the demo's --anomaly_steps
LR_FACTOR = 20.0
LR_STEPS = 20


def _num(v: float) -> float | str:
    return float(f"{v:.4g}") if math.isfinite(v) else str(v)


def record(run: Run, tok: Any, texts: list[str]) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    ds = toy.lm_dataset(tok, texts, seq_len=run.seq_len, num_examples=640).with_format("torch")
    make = toy.tiny_qwen2 if run.arch == "qwen2" else toy.tiny_llama
    base = make(seed=run.seed, vocab_size=len(tok), hidden_size=run.hidden_size, num_layers=2, dropout=run.dropout)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=run.dropout, task_type="CAUSAL_LM", target_modules=list(run.targets),
                     modules_to_save=["lm_head"] if run.train_head else None)
    torch.manual_seed(run.seed)
    model = get_peft_model(base, cfg) if run.lora else base
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=run.lr, weight_decay=0.0)

    def schedule(i: int) -> float:  # linear warmup, then cosine to 0 (the demo's Trainer schedule)
        if i < run.warmup:
            return (i + 1) / run.warmup
        return 0.5 * (1.0 + math.cos(math.pi * (i - run.warmup) / max(1, run.steps - run.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    probe = GradProbe(model)
    gen = torch.Generator().manual_seed(run.seed)
    onsets = dict(run.anomalies)
    rows: list[list[Any]] = []
    order: list[int] = []
    for step in range(1, run.steps + 1):
        if not order:
            order = torch.randperm(len(ds), generator=gen).tolist()
        idx, order = order[: run.batch_size], order[run.batch_size :]
        batch = ds[idx]
        kind = None
        for onset, k in onsets.items():
            span = {"loss_x": LOSS_STEPS, "lr_surge": LR_STEPS}.get(k, 1)
            if onset <= step < onset + span:
                kind = k
        ids = batch["input_ids"]
        if kind == "bad_batch":
            ids = torch.randint(0, len(tok), ids.shape, generator=gen)
        loss = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids).loss
        if kind == "loss_x":
            loss = loss * LOSS_FACTOR
        loss.backward()
        if kind == "nan_grad":
            next(p for p in params if p.grad is not None).grad.view(-1)[0] = math.nan
        pre = torch.nn.utils.clip_grad_norm_(params, run.max_grad_norm)
        grad_norm, layers = probe.measure(pre_clip_norm=pre)
        lr = sched.get_last_lr()[0] * (LR_FACTOR if kind == "lr_surge" else 1.0)
        for g in opt.param_groups:
            g["lr"] = lr
        if kind != "nan_grad":  # a NaN update would end the run; skip it as skip_bad_update does
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        rows.append([step, _num(float(loss.detach())), _num(float(grad_norm or 0.0)), float(f"{lr:.4g}"),
                     [_num(layers[n]) for n in probe.layer_names]])
    header = {"name": run.name, "arch": run.arch, "steps": run.steps, "seed": run.seed, "lr": run.lr,
              "warmup": run.warmup, "schedule": "linear warmup + cosine", "batch_size": run.batch_size,
              "seq_len": run.seq_len, "hidden_size": run.hidden_size, "lora_r": 8 if run.lora else None,
              "targets": list(run.targets) if run.lora else [],
              "train_head": run.train_head, "lora": run.lora, "dropout": run.dropout, "max_grad_norm": run.max_grad_norm,
              "onsets": [[s, k] for s, k in run.anomalies], "layers": probe.layer_names,
              "columns": ["step", "loss", "grad_norm", "lr", "layer_norms"],
              "anomaly_settings": {"loss_x": {"factor": LOSS_FACTOR, "steps": LOSS_STEPS},
                                   "lr_surge": {"factor": LR_FACTOR, "steps": LR_STEPS},
                                   "bad_batch": {"steps": 1}, "nan_grad": {"steps": 1, "update": "skipped"}}}
    return {"header": header, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/data/traces")
    ap.add_argument("--only", nargs="*", help="names of the runs to record (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    texts = toy.text_corpus(max_chars=300_000)
    tok = toy.train_tokenizer(texts, vocab_size=1024)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for run in RUNS:
        if args.only and run.name not in args.only:
            continue
        t0 = time.perf_counter()
        trace = record(run, tok, texts)
        path = out / run.out_dir / f"{run.name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(trace["header"], separators=(",", ":")) + "\n")
            for row in trace["rows"]:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
        print(f"{path}: {len(trace['rows'])} steps, {len(trace['header']['layers'])} LoRA layers, "
              f"{path.stat().st_size / 1024:.1f} KiB, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""Record real per-step signal traces of tiny fine-tunes (CPU), calm and with anomalies.

Each run trains a tiny Qwen2 or Llama (`examples.toy`, built from config), full
fine-tune or LoRA, on real text (Python docstrings, `toy.text_corpus`) in a plain PyTorch
loop that measures exactly what the checkpointer feeds the policy: the step's loss, the
pre-clip global gradient norm (what `clip_grad_norm_` returns), every LoRA layer's
pre-clip gradient norm (`GradProbe.measure`), the learning rate this update uses, and
(corpus runs) the process memory against a simulated cgroup limit and the step's wall time.
Injected anomalies (onset step = the first bad step):

- `bad_batch`: a fraction of one batch's rows replaced by uniformly random tokens (a corrupt shard);
- `loss_x`: the loss multiplied by a factor for a few steps (a loss spike / explosion, the demo's);
- `lora_explosion`: one LoRA layer's gradients multiplied by a factor for a few steps;
- `lr_surge`: the learning rate multiplied by a factor for several steps (a misconfigured schedule);
- `nan_grad`: a NaN in one gradient (the update is skipped, as `skip_bad_update` would);
- `memory_ramp`: host memory allocated (and touched) every step until the process passes 97 %
  of its limit, held, then freed (a leak); its capture onset is the step it crosses 92 %.

Two outputs:
- the named runs (`RUNS`) -> `tests/data/traces/<name>.jsonl`, one header object (run
  settings, layer names, onsets), then one compact row per step `[step, loss, grad_norm, lr,
  [layer norms]]` with 4 significant digits, non-finite numbers as `"nan"` / `"inf"`; read
  them with `examples.traces.load_trace`.
- `--corpus`: the learned model's training corpus (`corpus_runs()`: 216 runs drawn from a
  seed, split by run into train / validation / test; the test runs use model shapes and
  onset steps the others do not) -> `tests/data/traces/corpus.jsonl.gz`, one JSON object per
  run `{"header", "rows", "mem_frac", "step_time_s"}`; read it with
  `examples.corpus.load_corpus`. Runs are cached one file each under
  `--cache` (a re-run records only the missing ones) and packed in name order.

Usage:
    python scripts/record_traces.py [--out tests/data/traces] [--only NAME ...]
    nice -n 10 python scripts/record_traces.py --corpus [--cache /tmp/corpus_cache] [--jobs 1]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from examples import toy
from hf_dynamic_ckpt.signals import GradProbe

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
MEM_CROSS = 0.92  # a memory ramp's capture onset: the step the process crosses this fraction of its limit
MEM_PEAK = 0.97  # the ramp stops allocating here, holds MEM_HOLD steps, then frees everything
MEM_HOLD = 10


@dataclass
class Anomaly:
    """One injected anomaly: `kind` from `onset` for `steps` steps (`factor`: its size)."""

    onset: int
    kind: str
    steps: int = 1
    factor: float = 1.0
    layer: int = 0  # lora_explosion: index of the LoRA layer (probe order)


# The named runs' anomalies keep the settings they were first recorded with.
LOSS_FACTOR = 30.0  # the demo's --anomaly_factor
LOSS_STEPS = 4  # the demo's --anomaly_steps
LR_FACTOR = 20.0
LR_STEPS = 20


def _legacy(onset: int, kind: str) -> Anomaly:
    return {"loss_x": Anomaly(onset, kind, LOSS_STEPS, LOSS_FACTOR),
            "lr_surge": Anomaly(onset, kind, LR_STEPS, LR_FACTOR),
            }.get(kind, Anomaly(onset, kind))


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
    num_layers: int = 2
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    train_head: bool = False  # PEFT modules_to_save=["lm_head"] (the demo's setup)
    lora: bool = True  # False: full fine-tune (every parameter trained, no LoRA layers)
    out_dir: str = ""  # sub-directory of --out (the early-phase traces live in "early/")
    dropout: float = 0.0
    max_grad_norm: float | None = 1.0  # None: no clipping (the pre-clip norm is still measured)
    anomalies: list[tuple[int, str]] = field(default_factory=list)  # named runs: (onset step, kind)
    injected: list[Anomaly] = field(default_factory=list)  # corpus runs: sized anomalies
    mem_start: float | None = None  # corpus runs: memory fraction of the simulated limit at step 1
    split: str = ""  # corpus runs: train / validation / test


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
    # The first steps of calm runs (capture from the first optimizer step without
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

# ---------------------------------------------------------------------- the corpus
CORPUS_KINDS = ("loss_x", "bad_batch", "lora_explosion", "lr_surge", "nan_grad", "memory_ramp")
KIND_CYCLE = ("calm", *CORPUS_KINDS, "calm")  # a quarter of the runs are calm
CORPUS_SEED = 2024
CORPUS_TRAINVAL = 160  # every 5th of them is validation
CORPUS_TEST = 56


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def corpus_runs(seed: int = CORPUS_SEED, n_trainval: int = CORPUS_TRAINVAL, n_test: int = CORPUS_TEST) -> list[Run]:
    """The corpus, drawn from `seed`: one anomaly (or none: a quarter of the runs) per run, kinds in turn.

    Train / validation runs: 2-layer models of width 48 or 64, 160 steps, onsets in [3, 125].
    Test runs (held out): 3-layer models of width 96 (a shape no other run has), 200 steps,
    onsets in [3, 185] (a third of them after step 125, later than any training onset).
    Everything else (architecture, full / LoRA, targets, trained head, lr, batch size,
    warm-up, dropout, clipping, memory headroom, anomaly size and length) is drawn alike.
    """
    rng = random.Random(seed)
    runs = []
    for i in range(n_trainval + n_test):
        test = i >= n_trainval
        split = "test" if test else ("validation" if i % 5 == 4 else "train")
        steps = 200 if test else 160
        kind = KIND_CYCLE[i % len(KIND_CYCLE)]  # balanced kinds in every split
        lora = kind == "lora_explosion" or rng.random() < 0.6
        last = 185 if test else 125
        onset = rng.randint(126, last) if test and rng.random() < 0.35 else rng.randint(3, 125)
        targets = ALL_TARGETS if rng.random() < 0.4 else ("q_proj", "v_proj")
        injected: list[Anomaly] = []
        if kind == "loss_x":
            injected = [Anomaly(onset, kind, rng.randint(1, 4), _log_uniform(rng, 2.0, 100.0))]
        elif kind == "bad_batch":
            injected = [Anomaly(onset, kind, 1, rng.uniform(0.25, 1.0))]  # factor: fraction of corrupted rows
        elif kind == "lora_explosion":
            n_layers = len(targets) * (3 if test else 2)
            injected = [Anomaly(onset, kind, rng.randint(1, 5), _log_uniform(rng, 3.0, 300.0), rng.randrange(n_layers))]
        elif kind == "lr_surge":
            injected = [Anomaly(onset, kind, rng.randint(5, 30), _log_uniform(rng, 2.5, 30.0))]
        elif kind == "nan_grad":
            injected = [Anomaly(onset, kind)]
        elif kind == "memory_ramp":
            onset = rng.randint(3, steps - 90)  # the leak starts here; it crosses 92 % 15-60 steps later
            injected = [Anomaly(onset, kind, rng.randint(15, 60))]
        runs.append(Run(
            f"c{i:03d}_{split[:2]}_{kind}", arch=rng.choice(("qwen2", "llama")), steps=steps, seed=1000 + i,
            lr=_log_uniform(rng, 1e-3, 1.5e-2) if lora else _log_uniform(rng, 3e-4, 4e-3),
            warmup=rng.choice((0, 5, 10)), batch_size=rng.choice((4, 8, 16)),
            hidden_size=96 if test else rng.choice((48, 64)), num_layers=3 if test else 2, targets=targets,
            train_head=lora and rng.random() < 0.5, lora=lora, dropout=rng.choice((0.0, 0.05)),
            max_grad_norm=rng.choice((1.0, 1.0, 0.5, None)), injected=injected, mem_start=rng.uniform(0.5, 0.8),
            split=split))
    return runs


def _num(v: float) -> float | str:
    return float(f"{v:.4g}") if math.isfinite(v) else str(v)


def _active(anomalies: list[Anomaly], step: int) -> Anomaly | None:
    return next((a for a in anomalies if a.onset <= step < a.onset + a.steps and a.kind != "memory_ramp"), None)


def record(run: Run, tok: Any, texts: list[str]) -> dict[str, Any]:
    import psutil
    from peft import LoraConfig, get_peft_model

    anomalies = run.injected or [_legacy(s, k) for s, k in run.anomalies]
    ds = toy.lm_dataset(tok, texts, seq_len=run.seq_len, num_examples=640).with_format("torch")
    make = toy.tiny_qwen2 if run.arch == "qwen2" else toy.tiny_llama
    base = make(seed=run.seed, vocab_size=len(tok), hidden_size=run.hidden_size, num_layers=run.num_layers,
                dropout=run.dropout)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=run.dropout, task_type="CAUSAL_LM",
                     target_modules=list(run.targets), modules_to_save=["lm_head"] if run.train_head else None)
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
    clip = run.max_grad_norm if run.max_grad_norm is not None else math.inf
    proc = psutil.Process()
    extras = bool(run.split)
    limit = 0.0
    held: list[torch.Tensor] = []
    ramp = next((a for a in anomalies if a.kind == "memory_ramp"), None)
    ramp_state = {"per_step": 0.0, "hold": -1}
    rows: list[list[Any]] = []
    mem: list[float | str] = []
    times: list[float] = []
    order: list[int] = []
    for step in range(1, run.steps + 1):
        t0 = time.perf_counter()
        if not order:
            order = torch.randperm(len(ds), generator=gen).tolist()
        idx, order = order[: run.batch_size], order[run.batch_size :]
        batch = ds[idx]
        a = _active(anomalies, step)
        kind = a.kind if a is not None else None
        ids = batch["input_ids"]
        if kind == "bad_batch":
            rows_bad = max(1, round(a.factor * ids.shape[0])) if run.injected else ids.shape[0]  # type: ignore[union-attr]
            ids = ids.clone()
            ids[:rows_bad] = torch.randint(0, len(tok), (rows_bad, ids.shape[1]), generator=gen)
        loss = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids).loss
        if kind == "loss_x":
            loss = loss * a.factor  # type: ignore[union-attr]
        loss.backward()
        if kind == "nan_grad":
            next(p for p in params if p.grad is not None).grad.view(-1)[0] = math.nan
        if kind == "lora_explosion":
            for p in probe.layers[probe.layer_names[a.layer % len(probe.layer_names)]]:  # type: ignore[union-attr]
                if p.grad is not None:
                    p.grad.mul_(a.factor)  # type: ignore[union-attr]
        pre = torch.nn.utils.clip_grad_norm_(params, clip)
        grad_norm, layers = probe.measure(pre_clip_norm=pre)
        lr = sched.get_last_lr()[0] * (a.factor if kind == "lr_surge" else 1.0)  # type: ignore[union-attr]
        for g in opt.param_groups:
            g["lr"] = lr
        if kind != "nan_grad":  # a NaN update would end the run; skip it as skip_bad_update does
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        elapsed = time.perf_counter() - t0
        rows.append([step, _num(float(loss.detach())), _num(float(grad_norm or 0.0)), float(f"{lr:.4g}"),
                     [_num(layers[n]) for n in probe.layer_names]])
        if extras:
            rss = float(proc.memory_info().rss)
            if step == 1:
                limit = rss / float(run.mem_start)  # type: ignore[arg-type]
            frac = rss / limit
            if ramp is not None and step >= ramp.onset:
                if step == ramp.onset:  # allocate so as to cross MEM_CROSS after `ramp.steps` steps
                    ramp_state["per_step"] = max(0.0, MEM_CROSS - frac + 0.01) * limit / ramp.steps
                if ramp_state["hold"] < 0 and frac < MEM_PEAK:
                    held.append(torch.ones(int(ramp_state["per_step"]), dtype=torch.uint8))  # touched: counts in RSS
                elif ramp_state["hold"] < 0:
                    ramp_state["hold"] = step
                elif step - ramp_state["hold"] >= MEM_HOLD and held:
                    held.clear()
                frac = float(proc.memory_info().rss) / limit
            mem.append(_num(frac))
            times.append(float(f"{elapsed:.4g}"))
    header = {"name": run.name, "arch": run.arch, "steps": run.steps, "seed": run.seed, "lr": run.lr,
              "warmup": run.warmup, "schedule": "linear warmup + cosine", "batch_size": run.batch_size,
              "seq_len": run.seq_len, "hidden_size": run.hidden_size, "lora_r": 8 if run.lora else None,
              "targets": list(run.targets) if run.lora else [],
              "train_head": run.train_head, "lora": run.lora, "dropout": run.dropout,
              "max_grad_norm": run.max_grad_norm,
              "onsets": [[a.onset, a.kind] for a in anomalies], "layers": probe.layer_names,
              "columns": ["step", "loss", "grad_norm", "lr", "layer_norms"]}
    if run.split:  # a corpus run (calm ones too)
        header["num_layers"] = run.num_layers
        header["split"] = run.split
        header["trainable_params"] = sum(p.numel() for p in params)
        header["mem_start"] = run.mem_start
        header["anomalies"] = [asdict(a) for a in anomalies]
        if ramp is not None:
            cross = next((i + 1 for i, m in enumerate(mem) if isinstance(m, float) and m >= MEM_CROSS
                          and i + 1 >= ramp.onset), None)
            header["anomalies"][0]["cross"] = cross
    else:
        header["anomaly_settings"] = {"loss_x": {"factor": LOSS_FACTOR, "steps": LOSS_STEPS},
                                      "lr_surge": {"factor": LR_FACTOR, "steps": LR_STEPS},
                                      "bad_batch": {"steps": 1}, "nan_grad": {"steps": 1, "update": "skipped"}}
    out: dict[str, Any] = {"header": header, "rows": rows}
    if extras:
        out["mem_frac"], out["step_time_s"] = mem, times
    return out


def _write_trace(path: Path, trace: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(trace["header"], separators=(",", ":")) + "\n")
        for row in trace["rows"]:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def record_corpus(out: Path, cache: Path, tok: Any, texts: list[str], *, jobs: tuple[int, int] = (0, 1)) -> None:
    """Record the missing corpus runs into `cache` (job `i` of `n` takes every n-th run), then pack them."""
    runs = corpus_runs()
    cache.mkdir(parents=True, exist_ok=True)
    job, n_jobs = jobs
    for i, run in enumerate(runs):
        path = cache / f"{run.name}.json"
        if i % n_jobs != job or path.exists():
            continue
        t0 = time.perf_counter()
        trace = record(run, tok, texts)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")
        tmp.rename(path)
        print(f"{run.name}: {run.steps} steps, {run.arch} h{run.hidden_size} {'lora' if run.lora else 'full'}, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    missing = [r.name for r in runs if not (cache / f"{r.name}.json").exists()]
    if missing:
        print(f"{len(missing)} runs still missing (other jobs): not packed yet")
        return
    target = out / "corpus.jsonl.gz"
    with open(target, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
        for run in runs:  # the drawing order: c000, c001, ...
            gz.write((cache / f"{run.name}.json").read_bytes() + b"\n")
    print(f"{target}: {len(runs)} runs, {target.stat().st_size / 1024:.0f} KiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/data/traces")
    ap.add_argument("--only", nargs="*", help="names of the runs to record (default: all)")
    ap.add_argument("--corpus", action="store_true", help="record the learned model's corpus instead")
    ap.add_argument("--cache", default="/tmp/hf_dynamic_ckpt_corpus", help="corpus: one file per recorded run")
    ap.add_argument("--job", default="0/1", help="corpus: 'i/n' records every n-th run from the i-th")
    args = ap.parse_args()
    torch.set_num_threads(1)
    texts = toy.text_corpus(max_chars=300_000)
    tok = toy.train_tokenizer(texts, vocab_size=1024)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.corpus:
        i, n = (int(v) for v in args.job.split("/"))
        record_corpus(out, Path(args.cache), tok, texts, jobs=(i, n))
        return
    for run in RUNS:
        if args.only and run.name not in args.only:
            continue
        t0 = time.perf_counter()
        trace = record(run, tok, texts)
        path = out / run.out_dir / f"{run.name}.jsonl"
        _write_trace(path, trace)
        print(f"{path}: {len(trace['rows'])} steps, {len(trace['header']['layers'])} LoRA layers, "
              f"{path.stat().st_size / 1024:.1f} KiB, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""Train the learned double-check model on the project's own trace corpus (CPU, a few minutes).

Reads `tests/data/traces/corpus.jsonl.gz` (`scripts/record_traces.py --corpus`), computes the
12 features of every step with the library's own `FeatureExtractor` on the replayed frames
(exactly what the policy computes online), labels every step (`examples.corpus`), and trains
`torch.nn.LSTM(12, 32, num_layers=2)` with two heads: `save_score` (sigmoid, BCE with a
positive weight) and granularity (4 classes, cross-entropy on the labelled steps).

Data: the `train` runs, plus augmented copies of the calm `train` runs with anomalies injected
by `examples.traces.inject_anomaly` (a loss spike x`f`, a NaN gradient, an lr surge, at random
steps: exact up to the onset, which is all a capture reads), LoRA layer explosions (exact: the
layer's norm x f and the global norm from the sum of squares) and approximate corrupt batches
(loss x1.1-1.6 and gradient norms x2-8 for one step, the range measured on the corpus's
`bad_batch` runs). The `validation` runs choose the
epoch (lowest validation save-score loss) and calibrate the veto threshold: half the lowest score the model
gives a validation onset that the rules capture (so no such capture would be vetoed), at most 0.05.
The `test` runs are never read here (`scripts/eval_decision_model.py` reports on them).

Output: `hf_dynamic_ckpt/policy/decision_model.safetensors` (safetensors, float32, with the
feature names, normalisation, thresholds and a training summary in its metadata).

Usage: nice -n 10 python scripts/train_decision_model.py [--epochs 60] [--seed 0] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file
from torch import nn

from examples.corpus import CAPTURE_K, CorpusRun, load_corpus
from examples.traces import RecordedTrace, inject_anomaly
from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.policy import RulePolicy
from hf_dynamic_ckpt.policy.learned import (
    BUILTIN_PATH,
    FEATURE_NAMES,
    MODEL_FORMAT,
    MODEL_VERSION,
    NUM_FEATURES,
    SAVE_THRESHOLD,
    FeatureExtractor,
)

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "traces" / "corpus.jsonl.gz"
HIDDEN = 32
GRANULARITIES = 4
GRANULARITY_WEIGHT = 0.2
# (kind, factor range, steps range) of the augmentations injected into calm training runs.
AUGMENT = (("loss_x", (2.0, 100.0), (1, 4)), ("nan_grad", (1.0, 1.0), (1, 1)), ("lr_surge", (2.5, 30.0), (5, 30)),
           ("lora_explosion", (3.0, 300.0), (1, 5)), ("bad_batch", (2.0, 8.0), (1, 1)))


def _lora_explosion(rows: list[Any], onset: int, steps: int, factor: float, layer: int) -> list[Any]:
    """One LoRA layer's gradient x `factor`: its norm scales, and the global norm follows exactly
    (squared norms add up: g'^2 = g^2 + (factor^2 - 1) n^2)."""
    out = []
    for step, loss, grad, lr, norms in rows:
        if onset <= step < onset + steps:
            n = norms[layer]
            grad = math.sqrt(grad * grad + (factor * factor - 1.0) * n * n)
            norms = [v * factor if i == layer else v for i, v in enumerate(norms)]
        out.append((step, loss, grad, lr, list(norms)))
    return out


def _bad_batch(rows: list[Any], onset: int, factor: float, loss_factor: float) -> list[Any]:
    """An approximate corrupt batch (random tokens measured on the corpus: loss x1.1-1.6, gradient norms x2-8)."""
    return [(step, loss * loss_factor, grad * factor, lr, [v * factor for v in norms]) if step == onset
            else (step, loss, grad, lr, list(norms)) for step, loss, grad, lr, norms in rows]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(NUM_FEATURES, HIDDEN, num_layers=2, batch_first=True)
        self.score = nn.Linear(HIDDEN, 1)
        self.granularity = nn.Linear(HIDDEN, GRANULARITIES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.lstm(x)
        return self.score(h).squeeze(-1), self.granularity(h)


def augmented(run: CorpusRun, rng: random.Random, copies: int) -> list[CorpusRun]:
    """Copies of a calm run with one anomaly injected each (rows replaced, labels follow): loss spikes,
    NaN and lr surges by `inject_anomaly`, LoRA layer explosions exactly, corrupt batches approximately."""
    out = []
    trace = RecordedTrace(name=run.name, header=run.header, rows=run.rows, onsets=[])
    kinds = [a for a in AUGMENT if a[0] != "lora_explosion" or run.header["layers"]]
    for _ in range(copies):
        kind, (lo, hi), (s_lo, s_hi) = rng.choice(kinds)
        onset = rng.randint(3, len(run.rows) - 20)
        factor = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        steps = rng.randint(s_lo, s_hi)
        layer = rng.randrange(max(1, len(run.header["layers"])))
        if kind == "lora_explosion":
            rows = _lora_explosion(run.rows, onset, steps, factor, layer)
        elif kind == "bad_batch":
            rows = _bad_batch(run.rows, onset, factor, rng.uniform(1.1, 1.6))
        else:
            rows = inject_anomaly(trace, onset, kind, factor=factor, steps=steps).rows
        header = {**run.header, "name": f"{run.name}+{kind}@{onset}",
                  "anomalies": [{"onset": onset, "kind": kind, "steps": steps, "factor": factor, "layer": layer}]}
        out.append(CorpusRun(header=header, rows=rows, mem_frac=run.mem_frac, step_time_s=run.step_time_s))
    return out


def tensors(runs: list[CorpusRun]) -> dict[str, torch.Tensor]:
    """Features, targets and masks of `runs`, padded to the longest run."""
    n, length = len(runs), max(len(r.rows) for r in runs)
    x = torch.zeros(n, length, NUM_FEATURES)
    y = torch.zeros(n, length)
    y_mask = torch.zeros(n, length)
    g = torch.zeros(n, length, dtype=torch.long)
    g_mask = torch.zeros(n, length)
    for i, run in enumerate(runs):
        fx = FeatureExtractor()
        feats = [fx.step(f) for f in run.frames()]
        x[i, : len(feats)] = torch.tensor(feats)
        score, gran = run.labels()
        for t, (s, c) in enumerate(zip(score, gran)):
            if s is not None:
                y[i, t], y_mask[i, t] = s, 1.0
            if c is not None:
                g[i, t], g_mask[i, t] = c, 1.0
    return {"x": x, "y": y, "y_mask": y_mask, "g": g, "g_mask": g_mask}


def losses(net: Net, d: dict[str, torch.Tensor], mean: torch.Tensor, std: torch.Tensor,
           pos_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    logit, glogit = net((d["x"] - mean) / std)
    bce = nn.functional.binary_cross_entropy_with_logits(logit, d["y"], reduction="none",
                                                         pos_weight=torch.tensor(pos_weight))
    score_loss = (bce * d["y_mask"]).sum() / d["y_mask"].sum()
    ce = nn.functional.cross_entropy(glogit.reshape(-1, GRANULARITIES), d["g"].reshape(-1), reduction="none")
    gran_loss = (ce * d["g_mask"].reshape(-1)).sum() / d["g_mask"].sum().clamp(min=1.0)
    return score_loss, gran_loss


def scores(net: Net, d: dict[str, torch.Tensor], mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.sigmoid(net((d["x"] - mean) / std)[0])


def calibrate_veto(val: list[CorpusRun], sv: torch.Tensor) -> tuple[float, list[float], list[float]]:
    """The veto threshold: half the lowest score the model gives a validation onset that the rules capture
    (so it vetoes none of them), at most 0.05; with the scores of the rules' true and false captures."""
    cfg = SmartCkptConfig(base_interval=10,
                          policy={"stability_window": 20, "risk_smoothing": 4, "overhead_budget": 1.0})
    true_caps, false_caps = [], []
    for i, run in enumerate(val):
        policy = RulePolicy(cfg)
        onsets = {o for o, _ in run.onsets()}
        for t, frame in enumerate(run.frames()):
            d = policy.pre_update(frame)
            policy.decide(frame)
            if d.save and d.pre_update and not frame.any_nonfinite:  # non-finite captures are never vetoed
                (true_caps if any(0 <= o - frame.step < CAPTURE_K for o in onsets) else false_caps).append(
                    float(sv[i, t]))
    veto = min(0.05, 0.5 * min(true_caps)) if true_caps else 0.02
    return veto, true_caps, false_caps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(CORPUS))
    ap.add_argument("--out", default=str(BUILTIN_PATH))
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pos-weight", type=float, default=8.0, help="weight of a labelled save step in the BCE")
    ap.add_argument("--augment", type=int, default=6, help="injected copies of every calm train run")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    corpus = load_corpus(args.corpus)
    rng = random.Random(args.seed)
    train = [r for r in corpus if r.split == "train"]
    train += [a for r in train if r.kind == "calm" for a in augmented(r, rng, args.augment)]
    val = [r for r in corpus if r.split == "validation"]
    dt, dv = tensors(train), tensors(val)
    steps = dt["x"].reshape(-1, NUM_FEATURES)[dt["y_mask"].reshape(-1) > 0]
    mean, std = steps.mean(0), steps.std(0).clamp(min=1e-3)
    print(f"corpus {args.corpus}: {len(train)} train runs ({len(train) - sum(r.split == 'train' for r in corpus)} "
          f"augmented), {len(val)} validation; features {time.perf_counter() - t0:.1f} s", flush=True)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    best: tuple[float, int, dict[str, torch.Tensor]] = (math.inf, -1, {})
    order = list(range(len(train)))
    for epoch in range(args.epochs):
        net.train()
        rng.shuffle(order)
        for i in range(0, len(order), args.batch):
            idx = torch.tensor(order[i : i + args.batch])
            batch = {k: v[idx] for k, v in dt.items()}
            s_loss, g_loss = losses(net, batch, mean, std, args.pos_weight)
            opt.zero_grad()
            (s_loss + GRANULARITY_WEIGHT * g_loss).backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
        net.eval()
        with torch.no_grad():
            vs, vg = losses(net, dv, mean, std, args.pos_weight)
        val_loss = float(vs)  # the epoch is chosen on the save score (the granularity head fits in a few epochs)
        if val_loss < best[0]:
            best = (val_loss, epoch, {k: v.detach().clone() for k, v in net.state_dict().items()})
        if epoch % 10 == 0 or epoch == args.epochs - 1:
            print(f"epoch {epoch:3d}: validation score loss {val_loss:.4f} (granularity {float(vg):.4f}); "
                  f"best {best[0]:.4f} at {best[1]}", flush=True)
    net.load_state_dict(best[2])
    net.eval()
    sv = scores(net, dv, mean, std)
    pos = sv[(dv["y"] > 0) & (dv["y_mask"] > 0)]
    neg = sv[(dv["y"] == 0) & (dv["y_mask"] > 0)]
    veto, true_caps, false_caps = calibrate_veto(val, sv)
    summary = {"train_runs": len(train), "validation_runs": len(val), "epochs": args.epochs, "best_epoch": best[1],
               "validation_loss": round(best[0], 5), "pos_weight": args.pos_weight, "augment": args.augment,
               "seed": args.seed, "validation_positive_steps_above_threshold": f"{int((pos >= SAVE_THRESHOLD).sum())}/"
               f"{len(pos)}",
               "validation_negative_steps_above_threshold": f"{int((neg >= SAVE_THRESHOLD).sum())}/{len(neg)}",
               "corpus": Path(args.corpus).name, "veto_threshold": round(veto, 6),
               "validation_rule_captures_of_onsets_min_score": round(min(true_caps), 4) if true_caps else None,
               "validation_false_rule_captures_vetoed": f"{sum(s < veto for s in false_caps)}/{len(false_caps)}"}
    out = {k: v.detach().float().contiguous() for k, v in net.state_dict().items()}
    out["features.mean"], out["features.std"] = mean.float(), std.float()
    metadata = {"format": MODEL_FORMAT, "version": MODEL_VERSION, "features": ",".join(FEATURE_NAMES),
                "save_threshold": str(SAVE_THRESHOLD), "veto_threshold": f"{veto:.4g}",
                "granularity": "0 everything, 1 weights only, 2 weights + optimizer, 3 key layers + RNG",
                "training": json.dumps(summary, sort_keys=True)}
    save_file(out, args.out, metadata=metadata)
    print(json.dumps(summary, indent=1))
    print(f"veto threshold {veto:.4g}; wrote {args.out} ({Path(args.out).stat().st_size / 1024:.1f} KiB) in "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

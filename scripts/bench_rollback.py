"""Rollback past an anomaly vs training through it, on the recorded anomaly runs (CPU).

The question: over the recorded anomaly traces (`scripts/record_traces.py`, `RUNS`), how often does
`SmartCkptConfig(on_anomaly="rollback")` bring the run back to the loss it had before the anomaly,
and how often does training through it (`on_anomaly="capture"`, the default) get there too?

Every anomaly of `record_traces.RUNS` is replayed in a custom Accelerate loop with `SmartCheckpointer`
(`before_update()` / `after_update()`), on real text (`toy.text_corpus`, `toy.train_tokenizer`,
`toy.lm_dataset`, as record_traces.py: 64-token blocks, vocabulary 1024) with the recorded run's model
(tiny Qwen2 or Llama built from config, LoRA r=8 with the trained head), AdamW, learning rate, warm-up,
cosine schedule, batch size and clipping. Each configuration and seed is trained twice with the same
seeds and the same data (model, adapter, data order and dropout seeded alike): once with
`on_anomaly="capture"` (trains through) and once with `"rollback"`; the order alternates by seed.
Every other setting is the library's default, except `on_rollbacks_exhausted="continue"` in the
rollback runs (`--exhausted stop` keeps the default: a run that raises `RollbackError` is stopped, not
recovered). Two rows are not in `RUNS`: `lora_explosion` (only in the learned model's corpus) on
`anomaly_qwen2`'s model, the gradients of its first LoRA layer x30 for 4 batches (the corpus draws x3-x300
for 1-5 steps); and `loss_x` on the same model without gradient clipping (`anomaly_qwen2_noclip`, as a
quarter of the corpus runs), where training through a loss spike is not clipped away.

Shortened from the recording, to fit ~15 minutes on two shared cores: onsets later than `--max_onset`
(100) move there (`loss_x` of `anomaly_qwen2`: 180 -> 100; `nan_grad` of `anomaly_llama`: 190 -> 100),
so those onsets meet the learning rate of step 100 of the recorded cosine, which is longer than at
180-190; and every run ends at update `onset + K + HOLD - 2` (141 for onset 100, 76 for the demo's 35)
instead of the recorded 120-250. The schedule keeps the recorded length, so up to the end nothing else
changes. Three seeds per configuration (`--seeds`); `--quick`: two configurations, one seed (~1.5 min).

What the anomalies follow after a rollback (the data stream is numbered by the batches the loop
fetches, 1-based; in a run that trains through, batch N is trained by update N):

- data: `bad_batch` (every row of batch `onset` uniformly random tokens), `loss_x` (the loss of batches
  onset .. onset + 3 x30, applied inside the forward so the checkpointer's loss probe sees it too),
  `lora_explosion`, `nan_grad` (one NaN in a gradient of batch `onset`: a numerical overflow of that
  batch). A rollback goes on with the next batches, so a 4-batch anomaly meets the rolled-back run
  again on each of them. Training through a NaN, with the default `skip_bad_update=False`, applies it:
  clipping spreads it to every gradient and the weights become NaN (the recorded trace skipped it).
- step: `lr_surge`, a misconfigured schedule (`LambdaLR`) that multiplies the rate of updates
  onset .. onset + 19 by 20. A rollback restores the scheduler, so the retrained update meets the same
  surge: the run rolls back `max_rollbacks` (3) times, then trains through it (or stops, `--exhausted
  stop`). A property of the anomaly, not a failure of the run: the table shows what it costs.

Definitions (eval loss: the mean token loss, in eval mode, of the model after an update on
`EVAL_EXAMPLES` (32) held-out blocks spread over the text; it consumes no random numbers):

- pre-anomaly level `L`: the median eval loss after the `PRE_WINDOW` (10) updates before the onset
  (both runs are identical up to there);
- recovered within `K` (40) steps: some update `s`, `onset <= s <= onset + K - 1`, from which the eval
  loss stays within `L * (1 + tol)` for `HOLD` (3) updates in a row; `tol` is `--tol` (5 %) or the
  pre-anomaly noise (the largest relative deviation of those 10 eval losses from `L`), whichever is
  larger; a non-finite loss is never within it. Steps count optimizer updates applied (`ckpt.step`):
  a rolled-back run is measured on its retrained steps, not on the abandoned ones;
- steps to recover: `s - onset + 1` (1: back from the first update of the onset on), median of the
  runs that recovered;
- worst: the highest eval loss from the onset to the end, over `L` ("nan": the run diverged);
- final: the mean eval loss of the last `FINAL_WINDOW` (10) updates; the table gives the median over
  the seeds of rollback / through (a diverged side is named instead);
- seen as: the capture rule that fired at the onset in the run that trains through ("none": the
  policy did not see the anomaly, and a rollback run is the same run);
- rollbacks: decisions of kind `rollback`; skipped: batches fetched minus updates applied; bad applied:
  updates the capture rules flagged as bad and that were applied all the same (rollback run / run
  that trains through; in a rollback run: past `max_rollbacks`); means over the seeds;
- s/rollback: wall time of the `after_update()` calls that rolled back, per rollback; time: wall time
  of the training loop (checkpointer set-up to `close()`, held-out evaluations excluded), rollback
  run / capture run of the same seed, median. On two shared cores this ratio is noisy (+-20 %).

Usage:
    python scripts/bench_rollback.py [--quick] [--seeds 3] [--tol 0.05] [--exhausted stop] [--json PATH]
                                     [--only KIND@RUN ...] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import record_traces as rt  # scripts/record_traces.py: the recorded runs and their anomaly sizes
import torch

K = 40  # recovery window: updates from the onset
HOLD = 3  # consecutive updates within the band that count as recovered
PRE_WINDOW = 10  # updates before the onset whose eval losses give the pre-anomaly level
FINAL_WINDOW = 10  # last updates whose eval losses give the final loss
EVAL_EXAMPLES = 32  # held-out blocks, one in 21 of the text's first 672 (the other 640 are trained on)
TRAIN_EXAMPLES = 640  # as record_traces.py
SIZES = {"loss_x": (rt.LOSS_STEPS, rt.LOSS_FACTOR), "lr_surge": (rt.LR_STEPS, rt.LR_FACTOR),
         "lora_explosion": (rt.LOSS_STEPS, rt.LOSS_FACTOR)}  # the named runs' sizes; the others: one step
FOLLOWS = {"bad_batch": "data", "loss_x": "data", "lora_explosion": "data", "nan_grad": "data", "lr_surge": "step"}
QUICK = ("loss_x@anomaly_demo_qwen2", "lr_surge@anomaly_llama")


@dataclass(frozen=True)
class Case:
    """One anomaly configuration: a recorded run's settings and one of its anomalies (moved to `onset`)."""

    run: rt.Run
    anomaly: rt.Anomaly
    recorded_onset: int

    @property
    def name(self) -> str:
        return f"{self.anomaly.kind}@{self.run.name}"

    @property
    def onset(self) -> int:
        return self.anomaly.onset

    @property
    def end(self) -> int:
        return self.onset + K + HOLD - 2  # the last update trained


@dataclass
class RunResult:
    """One training run (one case, seed and mode)."""

    case: str
    seed: int
    mode: str
    eval_loss: dict[int, float] = field(default_factory=dict)  # step (updates applied) -> eval loss after it
    train_loss: dict[int, float] = field(default_factory=dict)  # step -> the model's own loss on its batch
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    bad_applied: int = 0  # updates the capture rules flagged as bad that were applied all the same
    stopped: str | None = None  # RollbackError message (--exhausted stop)
    batches: int = 0
    steps: int = 0
    wall_s: float = 0.0
    captures: list[list[Any]] = field(default_factory=list)
    rollback_s: float = 0.0  # wall time of the `after_update()` calls that rolled back


def cases(max_onset: int) -> list[Case]:
    """Every anomaly of `record_traces.RUNS`, one case each, plus the LoRA-layer explosion and an unclipped loss_x."""

    def sized(onset: int, kind: str) -> rt.Anomaly:
        steps, factor = SIZES.get(kind, (1, 1.0))
        return rt.Anomaly(min(onset, max_onset), kind, steps, factor, layer=0)

    out = [Case(run, sized(onset, kind), onset) for run in rt.RUNS for onset, kind in run.anomalies]
    qwen = next(r for r in rt.RUNS if r.name == "anomaly_qwen2")
    out.append(Case(qwen, sized(max_onset, "lora_explosion"), max_onset))
    noclip = replace(qwen, name="anomaly_qwen2_noclip", max_grad_norm=None)  # as a quarter of the corpus runs
    out.append(Case(noclip, sized(max_onset, "loss_x"), max_onset))
    return out


# ---------------------------------------------------------------------- one run
def _build(case: Case, seed: int, vocab: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The recorded run's model (seeded), AdamW and warm-up + cosine schedule (with the lr surge, if any)."""
    from peft import LoraConfig, get_peft_model

    from examples import toy

    r = case.run
    make = toy.tiny_qwen2 if r.arch == "qwen2" else toy.tiny_llama
    model = make(seed=seed, vocab_size=vocab, hidden_size=r.hidden_size, num_layers=r.num_layers, dropout=r.dropout)
    if r.lora:
        cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=r.dropout, task_type="CAUSAL_LM",
                         target_modules=list(r.targets), modules_to_save=["lm_head"] if r.train_head else None)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, cfg)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=r.lr, weight_decay=0.0)
    a = case.anomaly

    def schedule(i: int) -> float:  # record_traces.py's: linear warm-up, cosine to 0 over the recorded length
        base = (i + 1) / r.warmup if i < r.warmup else \
            0.5 * (1.0 + math.cos(math.pi * (i - r.warmup) / max(1, r.steps - r.warmup)))
        surge = a.kind == "lr_surge" and a.onset <= i + 1 < a.onset + a.steps  # i + 1: the update this rate drives
        return base * (a.factor if surge else 1.0)

    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def train(case: Case, seed: int, mode: str, data: Any, eval_batch: dict[str, torch.Tensor], vocab: int, *,
          exhausted: str) -> RunResult:
    """Train `case` with `on_anomaly=mode`; the eval loss is measured from `PRE_WINDOW` updates before the onset."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from hf_dynamic_ckpt import SmartCheckpointer, SmartCkptConfig
    from hf_dynamic_ckpt.errors import RollbackError
    from hf_dynamic_ckpt.signals.probes import find_lora_layers

    r, a = case.run, case.anomaly
    res = RunResult(case.name, seed, mode)
    accelerator = Accelerator(cpu=True)
    set_seed(seed)
    model, opt, sched = _build(case, seed, vocab)
    loader = torch.utils.data.DataLoader(data, batch_size=r.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    bad = range(a.onset, a.onset + a.steps) if FOLLOWS[a.kind] == "data" else range(0)  # poisoned batch numbers
    scale = {"factor": 1.0, "raw": math.nan}

    def loss_hook(module: Any, args: Any, output: Any) -> None:  # before the checkpointer's own loss probe
        if module.training:
            scale["raw"] = float(output.loss.detach())
            if scale["factor"] != 1.0:
                output.loss = output.loss * scale["factor"]

    hook = model.register_forward_hook(loss_hook)
    layer = next(iter(find_lora_layers(model).values()), []) if a.kind == "lora_explosion" else []
    params = [p for p in model.parameters() if p.requires_grad]
    clip = r.max_grad_norm if r.max_grad_norm is not None else math.inf
    eval_s = 0.0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        config = SmartCkptConfig(on_anomaly=mode, policy={"on_rollbacks_exhausted": exhausted})
        ckpt = SmartCheckpointer(accelerator, model, opt, sched, loader, config=config, output_dir=tmp)
        try:
            while ckpt.step < case.end:
                for batch in ckpt.loader:
                    res.batches += 1
                    n = res.batches
                    kind = a.kind if n in bad else None
                    ids = batch["input_ids"]
                    if kind == "bad_batch":  # every row uniformly random tokens (the named runs' corrupt shard)
                        g = torch.Generator().manual_seed(seed * 100_003 + n)
                        ids = torch.randint(0, vocab, ids.shape, generator=g)
                    scale["factor"] = a.factor if kind == "loss_x" else 1.0
                    loss = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids).loss
                    accelerator.backward(loss)
                    if kind == "nan_grad":
                        next(p for p in params if p.grad is not None).grad.view(-1)[0] = math.nan
                    for p in layer if kind == "lora_explosion" else []:
                        if p.grad is not None:
                            p.grad.mul_(a.factor)
                    accelerator.clip_grad_norm_(params, clip)
                    pre = ckpt.before_update()
                    if ckpt.run.policy.last_bad_update is not None and not (pre is not None and pre.skip_update):
                        res.bad_applied += 1
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    t_after = time.perf_counter()
                    decision = ckpt.after_update()
                    if decision is not None and decision.kind == "rollback" and ckpt.last_rollback is not None:
                        res.rollback_s += time.perf_counter() - t_after
                        done = ckpt.last_rollback
                        res.rollbacks.append({"batch": n, "from": done.from_step, "to": done.to_step,
                                              "reason": done.reason})
                        for s in [s for s in res.eval_loss if s > ckpt.step]:
                            del res.eval_loss[s], res.train_loss[s]
                        continue
                    step = ckpt.step
                    res.train_loss[step] = scale["raw"]
                    if step >= case.onset - PRE_WINDOW:
                        e0 = time.perf_counter()
                        res.eval_loss[step] = _eval(model, eval_batch)
                        eval_s += time.perf_counter() - e0
                    if step >= case.end:
                        break
        except RollbackError as e:
            res.stopped = str(e)[:300]
        res.steps = ckpt.step
        res.captures = [[e.step, e.reason] for e in ckpt.run.events if e.step < e.at_step]
        ckpt.close()
    res.wall_s = time.perf_counter() - t0 - eval_s
    hook.remove()
    accelerator.free_memory()
    return res


def _eval(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        loss = float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           labels=batch["input_ids"]).loss)
    model.train()
    return loss


# ---------------------------------------------------------------------- measures
@dataclass
class Measure:
    """What one run shows about its recovery (see the module docstring)."""

    level: float
    band: float
    recovered: bool
    steps_to_recover: int | None
    worst: float
    final: float


def measure(res: RunResult, case: Case, tol: float) -> Measure:
    pre = [res.eval_loss[s] for s in range(case.onset - PRE_WINDOW, case.onset) if s in res.eval_loss]
    level = statistics.median(pre)
    noise = max(abs(v / level - 1.0) for v in pre)
    band = level * (1.0 + max(tol, noise))
    within = {s: math.isfinite(v) and v <= band for s, v in res.eval_loss.items()}
    rec = next((s for s in range(case.onset, case.onset + K)
                if all(within.get(s + i, False) for i in range(HOLD))), None)
    after = [v for s, v in res.eval_loss.items() if s >= case.onset]
    worst = math.inf if any(not math.isfinite(v) for v in after) else max(after, default=math.nan) / level
    last = [res.eval_loss.get(s, math.nan) for s in range(case.end - FINAL_WINDOW + 1, case.end + 1)]
    final = statistics.fmean(last) if res.stopped is None and last else math.nan
    return Measure(level, band, rec is not None, None if rec is None else rec - case.onset + 1, worst, final)


# ---------------------------------------------------------------------- table
def _med(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def _fmt(v: float, spec: str = ".2f") -> str:
    if math.isnan(v):
        return "-"
    return "nan" if math.isinf(v) else format(v, spec)  # inf: a diverged run (its loss is not finite)


def _worst(ms: list[Measure]) -> str:
    """Median over the seeds; a diverged run (inf) is counted, a stopped one (nan: nothing after the onset) left out."""
    bad = sum(math.isinf(m.worst) for m in ms)
    if bad == len(ms):
        return "nan"
    return _fmt(_med([m.worst for m in ms]), ".2f") + (f" ({bad} nan)" if bad else "")


def _final_ratio(rb: list[Measure], th: list[Measure]) -> str:
    """Median of rollback / through over the seeds whose two finals are finite; a diverged side is named."""
    ratios = [a.final / b.final for a, b in zip(rb, th, strict=True) if math.isfinite(a.final) and
              math.isfinite(b.final)]
    notes = [f"{n} {side} nan" for side, ms in (("rb", rb), ("thr", th))
             if (n := sum(not math.isfinite(m.final) for m in ms))]
    return ", ".join(([_fmt(statistics.median(ratios), ".3f")] if ratios else []) + notes)


def _rule(res: RunResult, case: Case) -> str:
    """The capture rule that saw the anomaly (its pre-update capture), or `none`."""
    first, last = case.onset - 1, case.onset - 1 + case.anomaly.steps
    reason = next((r for s, r in res.captures if first <= s < last), None)
    return "none" if reason is None else reason.removeprefix("pre_update ").split(" ")[0]


def table(rows: list[dict[str, Any]], tol: float) -> str:
    head = ("anomaly", "recorded run", "follows", "onset", "seen as", "recovered rb", "recovered thr", "steps rb",
            "steps thr", "worst rb", "worst thr", "final rb/thr", "rollbacks", "skipped", "bad applied rb/thr",
            "s/rollback", "time rb/thr")
    lines = []
    for row in rows:
        rb, th = row["rollback"], row["capture"]
        n = len(rb)
        steps = [_fmt(_med([float(m.steps_to_recover) for m in ms if m.steps_to_recover is not None]), ".0f")
                 for ms in (rb, th)]
        per_rollback = sum(row["rollback_s"]) / max(1, sum(row["rollbacks"]))
        lines.append((row["kind"], row["run"], row["follows"], row["onset"], "/".join(sorted(set(row["rule"]))),
                      f"{sum(m.recovered for m in rb)}/{n}", f"{sum(m.recovered for m in th)}/{n}", *steps,
                      _worst(rb), _worst(th), _final_ratio(rb, th), _fmt(statistics.fmean(row["rollbacks"]), ".1f"),
                      _fmt(statistics.fmean(row["skipped"]), ".1f"),
                      f"{statistics.fmean(row['bad rb']):.1f} / {statistics.fmean(row['bad thr']):.1f}"
                      + (f" ({sum(row['stopped'])} stopped)" if any(row["stopped"]) else ""),
                      _fmt(per_rollback, ".2f") if sum(row["rollbacks"]) else "-", _fmt(_med(row["time"]), ".2f")))
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    out = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in lines]
    total = sum(len(r["rollback"]) for r in rows)
    x = sum(m.recovered for r in rows for m in r["rollback"])
    y = sum(m.recovered for r in rows for m in r["capture"])
    out += ["", f"a rollback recovered {x} of {total} runs to the pre-anomaly loss (within {tol:.0%} or its noise) "
                f"within {K} steps, training through recovered {y} of {total}"]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"smoke check: {', '.join(QUICK)}, one seed")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per configuration (each: capture + rollback run)")
    ap.add_argument("--tol", type=float, default=0.05, help="recovered: within L * (1 + tol) (or the noise)")
    ap.add_argument("--max_onset", type=int, default=100, help="later recorded onsets are moved here")
    ap.add_argument("--exhausted", default="continue", choices=["continue", "stop"],
                    help="on_rollbacks_exhausted of the rollback runs")
    ap.add_argument("--only", nargs="*", help="case names (kind@run) to run")
    ap.add_argument("--json", default=None, help="write every run's curves and measures here")
    ap.add_argument("--verbose", action="store_true", help="print the library's warnings (rollbacks)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.ERROR, format="    [%(name)s] %(message)s")
    logging.getLogger("hf_dynamic_ckpt").setLevel(logging.WARNING if args.verbose else logging.ERROR)

    t_start = time.perf_counter()
    import accelerate  # noqa: F401  (imported before any run is timed)
    import peft  # noqa: F401

    from examples import toy
    from hf_dynamic_ckpt import SmartCheckpointer  # noqa: F401

    selected = [c for c in cases(args.max_onset)
                if (c.name in QUICK if args.quick else not args.only or c.name in args.only)]
    seeds = 1 if args.quick else args.seeds
    texts = toy.text_corpus(max_chars=300_000)
    tok = toy.train_tokenizer(texts, vocab_size=1024)
    datasets: dict[int, tuple[Any, dict[str, torch.Tensor]]] = {}
    rows, runs = [], []
    for case in selected:
        r = case.run
        if r.seq_len not in datasets:
            ds = toy.lm_dataset(tok, texts, seq_len=r.seq_len, num_examples=TRAIN_EXAMPLES + EVAL_EXAMPLES)
            every = len(ds) // EVAL_EXAMPLES  # held out: one block in `every`, spread over the whole text
            held_idx = set(range(every // 2, len(ds), every)[:EVAL_EXAMPLES])
            held = ds.select(sorted(held_idx)).with_format("torch")[:]
            train_idx = [i for i in range(len(ds)) if i not in held_idx]
            datasets[r.seq_len] = (ds.select(train_idx).with_format("torch"), held)
        data, held = datasets[r.seq_len]
        onset = f"{case.onset}" + (f" ({case.recorded_onset})" if case.onset != case.recorded_onset else "")
        row: dict[str, Any] = {"kind": case.anomaly.kind, "run": r.name, "follows": FOLLOWS[case.anomaly.kind],
                               "onset": onset, "rollback": [], "capture": [], "rule": [], "rollbacks": [],
                               "skipped": [], "bad rb": [], "bad thr": [], "stopped": [], "rollback_s": [],
                               "time": []}
        for i in range(seeds):
            seed = r.seed + i
            pair = {}
            for mode in ("capture", "rollback") if i % 2 == 0 else ("rollback", "capture"):  # order effects cancel
                res = train(case, seed, mode, data, held, len(tok), exhausted=args.exhausted)
                m = measure(res, case, args.tol)
                pair[mode] = (res, m)
                runs.append({"run": asdict(res), "measure": asdict(m)})
                print(f"  {case.name} seed {seed} {mode:8s}: L {m.level:.3f} recovered {m.recovered} "
                      f"({m.steps_to_recover}) worst {m.worst:.3f} final {m.final:.3f} rollbacks "
                      f"{len(res.rollbacks)} skipped {res.batches - res.steps} bad applied {res.bad_applied}"
                      f"{' stopped' if res.stopped else ''} {res.wall_s:.1f} s", flush=True)
            (rb, rb_m), (th, th_m) = pair["rollback"], pair["capture"]
            row["rollback"].append(rb_m)
            row["capture"].append(th_m)
            row["rule"].append(_rule(th, case))
            row["rollbacks"].append(len(rb.rollbacks))
            row["skipped"].append(rb.batches - rb.steps)
            row["bad rb"].append(rb.bad_applied)
            row["bad thr"].append(th.bad_applied)
            row["stopped"].append(rb.stopped is not None)
            row["rollback_s"].append(rb.rollback_s)
            row["time"].append(rb.wall_s / th.wall_s)
        rows.append(row)
    print()
    print(table(rows, args.tol))
    wall = time.perf_counter() - t_start
    print(f"\n{len(runs)} runs, {wall:.0f} s wall")
    if args.json:
        Path(args.json).write_text(json.dumps({"k": K, "hold": HOLD, "tol": args.tol, "wall_s": wall, "runs": runs},
                                              indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()

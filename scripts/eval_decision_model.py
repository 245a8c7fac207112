"""Evaluate the learned double-check on held-out runs: rules alone vs rules + model vs fixed intervals.

Replays the `test` runs of `tests/data/traces/corpus.jsonl.gz` (model shapes and onset steps
the training runs do not have; `scripts/record_traces.py --corpus`) through `RulePolicy` with
short-run settings (base_interval 10, stability_window 20, risk_smoothing 4; a save blocks
`--blocking` s), once with the rules alone and once with `learned_model` set, and scores the
checkpoints each would have written against fixed intervals with the same number of saves.

Per anomaly kind: capture rate (a healthy checkpoint of a step in [onset - K, onset - 1];
memory ramp: onset = the step memory crosses 92 %) and lead time (onset - the newest such
step). On the calm runs: false saves (saves of any kind but the regular interval) per 1000
steps and pinned false captures. Overall: saves per 1000 steps and bytes written (weights =
4 bytes per trainable parameter, optimizer = AdamW's two moments + 1 KiB, state 4 KiB).
A second table injects anomalies (`examples.traces.inject_anomaly`) into the held-out calm
runs at 8 onsets each, for more onsets per kind. Last: the model's CPU time per step.

Usage: python scripts/eval_decision_model.py [--model builtin] [--split test] [--k 5]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.corpus import CAPTURE_K, CorpusRun, load_corpus
from examples.traces import RecordedTrace, inject_anomaly
from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.policy import DecisionKind, RulePolicy
from hf_dynamic_ckpt.policy.learned import LearnedCheck, load_model
from hf_dynamic_ckpt.signals import SignalFrame

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces" / "corpus.jsonl.gz"
KINDS = ("loss_x", "bad_batch", "lora_explosion", "lr_surge", "nan_grad", "memory_ramp")
INJECTIONS = (("loss_x", 30.0, 4), ("loss_x", 3.0, 1), ("nan_grad", 1.0, 1), ("lr_surge", 5.0, 20))
INJECTED = tuple(f"{kind} x{factor:g}" for kind, factor, _ in INJECTIONS)
# The budget warning (a 50 ms save every 10 steps of a toy step) says nothing about decisions: budget off.
CFG = SmartCkptConfig(base_interval=10, policy={"stability_window": 20, "risk_smoothing": 4, "overhead_budget": 1.0})


@dataclass
class Save:
    step: int
    healthy: bool
    pinned: bool
    kind: str
    tiers: frozenset[Tier]


@dataclass
class Score:
    saves: int = 0
    steps: int = 0
    bytes: float = 0.0
    captured: dict[str, list[bool]] = field(default_factory=lambda: defaultdict(list))
    lead: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    calm_steps: int = 0
    calm_false: int = 0
    calm_pinned: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def tier_bytes(run: CorpusRun, tiers: frozenset[Tier]) -> float:
    n = float(run.header["trainable_params"])
    sizes = {Tier.WEIGHTS: 4 * n, Tier.OPTIMIZER: 8 * n + 1024, Tier.STATE: 4096}
    return sum(sizes[t] for t in tiers)


class Vetoes(logging.Handler):
    """Counts the policy's veto log lines."""

    count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "vetoed by the learned model" in record.getMessage():
            Vetoes.count += 1


def replay(frames: list[SignalFrame], cfg: SmartCkptConfig, blocking: float) -> list[Save]:
    policy = RulePolicy(cfg)
    saves: list[Save] = []
    pending = 0.0
    for f in frames:
        f.save_blocking_s = pending or None
        pending = 0.0
        for d in (policy.pre_update(f), policy.decide(f)):
            if d.save:
                assert d.step is not None
                saves.append(Save(d.step, d.healthy, d.pin, d.kind.value, d.tiers))
                pending += blocking
    return saves


def fixed(n_steps: int, interval: int) -> list[Save]:
    return [Save(s, True, False, DecisionKind.INTERVAL.value, frozenset(Tier))
            for s in range(interval, n_steps + 1, interval)]


def score(run: CorpusRun, onsets: list[tuple[int, str]], n: int, saves: list[Save], out: Score, k: int) -> None:
    out.saves += len(saves)
    out.steps += n
    out.bytes += sum(tier_bytes(run, s.tiers) for s in saves)
    for s in saves:
        out.by_kind[s.kind] += 1
    for onset, kind in onsets:
        window = [s.step for s in saves if s.healthy and onset - k <= s.step <= onset - 1]
        out.captured[kind].append(bool(window))
        if window:
            out.lead[kind].append(onset - max(window))
    if not onsets:
        out.calm_steps += n
        out.calm_false += sum(s.kind != DecisionKind.INTERVAL.value for s in saves)
        out.calm_pinned += sum(s.pinned for s in saves)


def table(title: str, cases: list[tuple[CorpusRun, list[tuple[int, str]], list[SignalFrame]]], kinds: tuple[str, ...],
          model: str, k: int, blocking: float) -> None:
    rules, both = Score(), Score()
    vetoes_before = Vetoes.count
    runs_saves = []
    for run, onsets, frames in cases:
        a = replay([SignalFrame(**vars(f)) for f in frames], CFG, blocking)
        b = replay([SignalFrame(**vars(f)) for f in frames], CFG.replace(policy={"learned_model": model}), blocking)
        score(run, onsets, len(frames), a, rules, k)
        score(run, onsets, len(frames), b, both, k)
        runs_saves.append((run, onsets, len(frames)))
    policies = {"rules alone": rules, "rules + learned model": both}
    for name, ref in (("rules", rules), ("rules + model", both)):
        every = max(1, round(ref.steps / ref.saves))
        f = Score()
        for run, onsets, n in runs_saves:
            score(run, onsets, n, fixed(n, every), f, k)
        policies[f"fixed every {every} (= {name} saves)"] = f
    kinds = tuple(kd for kd in kinds if rules.captured.get(kd))
    print(f"\n{title}: {len(cases)} runs, {sum(len(o) for _, o, _ in cases)} onsets, {rules.calm_steps} calm steps; "
          f"K={k}; capture (lead time in steps)")
    header = ["policy", "saves/1000 steps", "MB written", *kinds, "all", "calm: false saves/1000", "calm: pinned"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, r in policies.items():
        row = [name, f"{1000 * r.saves / r.steps:.1f}", f"{r.bytes / 1e6:.1f}"]
        for kd in kinds:
            c, lead = r.captured[kd], r.lead[kd]
            row.append(f"{sum(c)}/{len(c)} ({sum(lead) / len(lead):.1f})" if lead else f"{sum(c)}/{len(c)}")
        allc = [c for v in r.captured.values() for c in v]
        row.append(f"{100 * sum(allc) / max(1, len(allc)):.0f}%")
        row += [f"{1000 * r.calm_false / max(1, r.calm_steps):.1f}", str(r.calm_pinned)]
        print("| " + " | ".join(row) + " |")
    print(f"rule captures vetoed by the model: {Vetoes.count - vetoes_before}; saves by kind: "
          + "; ".join(f"{name}: " + ", ".join(f"{kd} {n}" for kd, n in sorted(r.by_kind.items()))
                      for name, r in list(policies.items())[:2]))


def injected(calm: list[CorpusRun], seed: int,
             per_run: int) -> list[tuple[CorpusRun, list[tuple[int, str]], list[SignalFrame]]]:
    rng = random.Random(seed)
    cases = []
    for run in calm:
        trace = RecordedTrace(name=run.name, header=run.header, rows=run.rows, onsets=[])
        for _ in range(per_run):
            kind, factor, steps = rng.choice(INJECTIONS)
            onset = rng.randint(3, len(run.rows) - 25)
            shot = inject_anomaly(trace, onset, kind, factor=factor, steps=steps)
            copy = CorpusRun(header=run.header, rows=shot.rows, mem_frac=run.mem_frac, step_time_s=run.step_time_s)
            cases.append((copy, [(onset, f"{kind} x{factor:g}")], copy.frames()[:onset + 1]))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(CORPUS))
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--split", default="test")
    ap.add_argument("--k", type=int, default=CAPTURE_K)
    ap.add_argument("--blocking", type=float, default=0.05, help="seconds a save blocks (the frames' save cost)")
    args = ap.parse_args()
    rules_log = logging.getLogger("hf_dynamic_ckpt.policy.rules")
    rules_log.setLevel(logging.DEBUG)  # the veto line is DEBUG
    rules_log.addHandler(Vetoes())
    rules_log.propagate = False
    runs = [r for r in load_corpus(args.corpus) if r.split == args.split]
    table(f"held-out runs (split={args.split})", [(r, r.onsets(), r.frames()) for r in runs], KINDS, args.model, args.k,
          args.blocking)
    calm = [r for r in runs if r.kind == "calm"]
    table(f"anomalies injected into the {len(calm)} held-out calm runs (8 onsets each, judged up to the onset)",
          injected(calm, 0, 8), INJECTED, args.model, args.k, args.blocking)
    check = LearnedCheck(load_model(args.model))
    frames = [f for r in runs for f in r.frames()]
    t0 = time.process_time()
    for f in frames:
        check.opinion(f)
    model_us = 1e6 * (time.process_time() - t0) / len(frames)
    t0 = time.process_time()
    replay([SignalFrame(**vars(f)) for f in frames[:5000]], CFG, args.blocking)
    rules_us = 1e6 * (time.process_time() - t0) / min(5000, len(frames))
    print(f"\nCPU per step: learned model {model_us:.0f} us (features + LSTM), rule policy alone {rules_us:.0f} us "
          f"({len(frames)} frames, one thread)")


if __name__ == "__main__":
    main()

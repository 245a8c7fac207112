"""Writer-process start-up: how long do the first saves of a fresh process-mode engine block?

Baseline (the behaviour before the fix, emulated): every save goes to the writer process
from the first one on, so a save issued while the previous one still waits for the spawned
interpreter (importing torch, opening the store) blocks until it is up. Ours: saves are
written by a stand-in thread until the process reports ready.

Each run creates a store and a `SaveEngine(mode="process")`, then issues `--saves` saves of
a small model + AdamW state, `--gap` seconds apart (training between saves), and records
each save's blocking time. Prints medians over `--repeats` runs and the ratio ours/baseline.

    .venv/bin/python scripts/bench_writer_startup.py
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch

from hf_dynamic_ckpt.constants import ALL_TIERS
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.engine.writer import ProcessWriter
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest


@contextlib.contextmanager
def _always_ready(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    original = ProcessWriter.ready
    ProcessWriter.ready = property(lambda self: True)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        ProcessWriter.ready = original  # type: ignore[method-assign]


def run(baseline: bool, saves: int, gap: float) -> list[tuple[float, str]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 640)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    out = []
    with tempfile.TemporaryDirectory() as root, _always_ready(baseline), CheckpointStore(root) as store:
        engine = SaveEngine(store, mode="process")
        try:
            for step in range(1, saves + 1):
                handle = engine.save(sources, SaveRequest(step=step, tiers=ALL_TIERS, reason="bench"))
                out.append((handle.blocking_ms, handle.writer))
                end = time.perf_counter() + gap
                while time.perf_counter() < end:  # "training" between saves
                    model(torch.randn(64, 512)).sum().backward()
            engine.wait()
        finally:
            engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--gap", type=float, default=0.5, help="seconds of training between saves")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name, baseline in (("baseline (process from the first save)", True), ("ours (thread until ready)", False)):
        runs = [run(baseline, args.saves, args.gap) for _ in range(args.repeats)]
        results[name] = runs
    print(f"| save # | {' | '.join(results)} | ours / baseline | ours: writer (run 1) |")
    print("|---|---|---|---|---|")
    base_runs, our_runs = results.values()
    for i in range(args.saves):
        b = statistics.median(r[i][0] for r in base_runs)
        o = statistics.median(r[i][0] for r in our_runs)
        print(f"| {i + 1} | {b:.1f} ms | {o:.1f} ms | {o / b:.2f} | {our_runs[0][i][1]} |")
    bt = statistics.median(sum(x[0] for x in r) for r in base_runs)
    ot = statistics.median(sum(x[0] for x in r) for r in our_runs)
    bm = statistics.median(max(x[0] for x in r) for r in base_runs)
    om = statistics.median(max(x[0] for x in r) for r in our_runs)
    print(f"| total | {bt:.1f} ms | {ot:.1f} ms | {ot / bt:.2f} | |")
    print(f"| worst save | {bm:.1f} ms | {om:.1f} ms | {om / bm:.2f} | |")
    print(f"\n(medians of {args.repeats} runs; {args.saves} saves {args.gap} s apart; "
          f"torch {torch.__version__})")


if __name__ == "__main__":
    main()

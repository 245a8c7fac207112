#!/usr/bin/env python
"""Peak memory of saving in a Trainer run, and what a memory limit costs in blocking time.

One Trainer full fine-tune of a Llama built from config (`tests/reliability/memory_worker.py`:
hidden 512, 4 layers, vocab 4096, ~13M parameters: ~52 MiB of weights, ~104 MiB of AdamW
state), the same steps and save interval in every run, each run in a fresh memory cgroup
(v2 or v1, whichever the machine mounts; needs root):

- `none`, `native` (`save_steps`), `smart` (SmartCkptCallback, default engine: writer
  process, buffers prepared after the first step) without a limit: peak RSS of the training
  process, of its children (the writer process) and the cgroup's peak usage as the kernel
  counts it (page cache of the checkpoint files included);
- `smart` and `native` again in a cgroup limited to the `none` run's cgroup peak + `--margin`
  MiB: the smart saves are then written synchronously from the live tensors (no second copy; staging
  `sync` when no writer process starts under the limit, `streaming` when the buffers do not fit);
  their blocking time against the buffered saves of the unlimited run.

Usage:
    sudo python scripts/bench_memory.py [--margin 150] [--steps 6] [--interval 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "reliability")]

from memory_cgroup import MemoryCgroup  # noqa: E402

MiB = 1 << 20


def run(saves: str, out: Path, tag: str, args: argparse.Namespace, limit: int | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(REPO / "tests" / "reliability" / "memory_worker.py"), "--out", str(out), "--tag", tag,
            "--saves", saves, "--max_steps", str(args.steps), "--interval", str(args.interval)]
    with MemoryCgroup(f"hfdc-bench-{tag}") as cg:
        if limit is not None:
            cg.set_limit(limit)
        proc = cg.run(argv, env=env, timeout=3600)
        if proc.returncode != 0 or cg.oom_kills():
            raise SystemExit(f"{tag}: rc={proc.returncode}, OOM kills {cg.oom_kills()}\n{proc.stderr[-2000:]}")
        result = json.loads((out / f"{tag}.json").read_text())
        result["cgroup_peak"] = cg.peak_bytes() or 0
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--margin", type=int, default=150, help="MiB above the no-save cgroup peak")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--interval", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = {}
        for tag in ("none", "native", "smart"):
            results[tag] = run(tag, root / tag, tag, args)
        limit = results["none"]["cgroup_peak"] + args.margin * MiB
        results["native_limited"] = run("native", root / "native_limited", "native_limited", args, limit)
        results["smart_limited"] = run("smart", root / "smart_limited", "smart_limited", args, limit)

    base = results["none"]
    print(f"state: {base['weights_bytes'] / MiB:.0f} MiB of weights (+2x AdamW); limit for the *_limited runs: "
          f"{limit / MiB:.0f} MiB (none's cgroup peak + {args.margin} MiB)")
    print(f"{'run':16} {'peak RSS':>10} {'writer RSS':>11} {'cgroup peak':>12} "
          f"{'RSS / none':>11} {'train s':>8}  stagings")
    for tag, r in results.items():
        stagings = ",".join(str(e.get("staging")) for e in r["events"]) or "-"
        print(f"{tag:16} {r['peak_rss'] / MiB:9.0f}M {r['children_peak_rss'] / MiB:10.0f}M "
              f"{r['cgroup_peak'] / MiB:11.0f}M "
              f"{r['peak_rss'] / base['peak_rss']:11.2f} {r['train_s']:8.1f}  {stagings}")
    full = [e["blocking_ms"] for e in results["smart"]["events"] if e.get("staging") == "buffered"]
    streamed = [e["blocking_ms"] for e in results["smart_limited"]["events"]
                if e.get("staging") in ("streaming", "sync")]
    if full and streamed:
        # A buffered save also waits for the previous write when it comes before that write is done:
        # the fastest buffered save is the snapshot alone.
        f, s = min(full), statistics.median(streamed)
        print(f"blocking per save: buffered snapshot {f:.0f} ms (fastest, unlimited; median with waits "
              f"{statistics.median(full):.0f} ms), synchronous {s:.0f} ms (median, limited): synchronous / snapshot = "
              f"{s / f:.1f}x")
    print("train time limited / unlimited: "
          f"smart {results['smart_limited']['train_s'] / results['smart']['train_s']:.2f}x, "
          f"native {results['native_limited']['train_s'] / results['native']['train_s']:.2f}x")


if __name__ == "__main__":
    main()

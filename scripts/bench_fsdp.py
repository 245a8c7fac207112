#!/usr/bin/env python
"""Sharded save stall: hf_dynamic_ckpt's FSDP2 save vs DCP's `async_save` of the same shards, same run.

Run under torchrun (it starts itself with `--nproc` CPU ranks, gloo, when not launched so):

    python scripts/bench_fsdp.py                  # 2 ranks, ~40M parameters (+ AdamW state)
    python scripts/bench_fsdp.py --quick          # small model, smoke run

One MLP (`--width` x `--layers`) is sharded with `fully_shard` (one unit per layer) and trained
with AdamW for a step so the optimizer state exists. Then, alternating, `--repeats` times each:

- `smart`: `RunOrchestrator.save_now(blocking=False)` (engine in thread mode): the training thread is
  blocked for the snapshot (a copy of this rank's local shards of weights and optimizer state);
  the write and the cross-rank commit run in the background, waited for before the next save;
- `dcp`: `torch.distributed.checkpoint.async_save({"model": msd, "optim": osd})` of the same
  shards (`get_state_dict`, sharded), DCP's own staging + FileSystemWriter in the background;
  the stall is the time until `async_save` returns, the future is waited for before the next save.

The table reports the median stall of each (max over ranks per save) and the ratio smart / dcp,
plus the median end-to-end time (stall + background write until committed / done).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from hf_dynamic_ckpt import SmartCkptConfig
    from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, args.width)).sum().backward()
    opt.step()
    opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    root = Path(args.root)
    ck = RunOrchestrator(SmartCkptConfig(engine="sync", keep_last=2), root=root / "smart")
    ck.attach(model, optimizer=opt)
    ck.engine.wait()

    def max_over_ranks(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    rows: dict[str, list[tuple[float, float]]] = {"smart": [], "dcp": []}
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        event = ck.save_now(i + 1, 0.0, blocking=False)
        stall = (time.perf_counter() - t0) * 1e3
        ck.finish()
        total = (time.perf_counter() - t0) * 1e3
        rows["smart"].append((max_over_ranks(event.blocking_ms if event.blocking_ms else stall),
                              max_over_ranks(total)))
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"dcp-{i}"))
        stall = (time.perf_counter() - t0) * 1e3
        future.result()
        total = (time.perf_counter() - t0) * 1e3
        rows["dcp"].append((max_over_ranks(stall), max_over_ranks(total)))
    ck.close()
    if rank == 0:
        out = {k: {"stall_ms": statistics.median(s for s, _ in v), "total_ms": statistics.median(t for _, t in v)}
               for k, v in rows.items()}
        out["params"] = params
        out["world_size"] = dist.get_world_size()
        print("RESULT " + json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=38)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--root", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.width, args.layers, args.repeats = 256, 4, 3
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               __file__, "--worker", "--root", args.root or tmp, "--width", str(args.width), "--layers",
               str(args.layers), "--repeats", str(args.repeats)]
        repo = str(Path(__file__).resolve().parents[1])  # this checkout's package, not an installed one
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"benchmark failed:\n{proc.stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    size_mb = r["params"] * 4 * 3 / 2**20  # weights + exp_avg + exp_avg_sq, float32
    print(f"FSDP2, {r['world_size']} CPU ranks, {r['params'] / 1e6:.1f}M parameters (~{size_mb:.0f} MiB of state), "
          f"median of {args.repeats}")
    print(f"{'':8} {'stall ms':>10} {'total ms':>10}")
    for k in ("smart", "dcp"):
        print(f"{k:8} {r[k]['stall_ms']:10.1f} {r[k]['total_ms']:10.1f}")
    print(f"stall ratio smart / dcp async_save: {r['smart']['stall_ms'] / r['dcp']['stall_ms']:.2f}")


if __name__ == "__main__":
    main()

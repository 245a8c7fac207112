"""Store-core benchmark: a whole save (commit included) and restore by tier set, vs torch.save/torch.load.

The article reports restore times of L0 1.7 s, L0+L1 3.2 s, L0+L1+L2 4.8 s against 19.6 s
for a full `torch.load`. This measures the same shape on a small Qwen2 trained a few steps
with AdamW (real optimizer state), in one process, against baselines of the same run:

- save: `CheckpointStore.save` (all tiers; L1 zstd; checksums; fsync; manifest; atomic
  rename; catalog row) vs `torch.save({"model", "optimizer", "scheduler"})` + fsync, and vs
  the tier formats alone (the same `save_weights` + `write_tensor_file` + JSON calls into a
  plain directory: what the commit protocol adds is the difference).
- restore: `CheckpointStore.load` with tiers {L0}, {L0, L1}, {L0, L1, L2} (each verifies
  every file it reads: size + XXH3 checksum) and `resume.plan_resume` (the resume's
  read: L0, L1, L2 separately with fallback), vs `torch.load(weights_only=True)` of the baseline
  file; every loaded tensor is touched (summed), so lazy memory maps pay their reads.
  Warm = files in the page cache; cold = pages dropped with `posix_fadvise(DONTNEED)`
  before each load (store files, blobs and the baseline file alike).
- the catalog's `recovery_cost_ms` (a bytes-based estimate) next to the measured cold time.

Cases run round-robin; best of N rounds reported (the machine is shared).

Run:
    .venv/bin/python scripts/bench_restore.py [--layers 4] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dynamic_ckpt.store.commit import write_rank_files
from hf_dynamic_ckpt.store.fs import fsync_file

from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.run.resume import plan_resume
from hf_dynamic_ckpt.state.rng import capture_rng_state
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, SaveRequest


def build_and_train(layers: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=16000, hidden_size=512, intermediate_size=1792, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / 1000))
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, sched


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def touch(obj: Any) -> float:
    """Read every tensor byte (sum), so lazily mapped tensors pay for their reads."""
    if isinstance(obj, torch.Tensor):
        return float(obj.sum()) if obj.is_floating_point() else float(obj.numel())
    if isinstance(obj, dict):
        return sum(touch(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(touch(v) for v in obj)
    return 0.0


def rounds(cases: dict[str, Callable[[], Any]], repeats: int,
           before: Callable[[], None] | None) -> dict[str, tuple[float, float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk to measure")
    args = parser.parse_args()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))

    model, opt, sched = build_and_train(args.layers, args.steps)
    n_params = sum(p.numel() for p in model.parameters())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = CheckpointState(step=args.steps, weights=weights, optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                            rng=capture_rng_state(), sampler={"epoch": 0, "batches": args.steps})
    baseline_obj = {"model": weights, "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "store"
        base = Path(tmp) / "baseline.pt"
        store = CheckpointStore(root, task_id="bench")
        counter = iter(range(10**6))

        def ours_save() -> None:
            step = next(counter)
            store.save(CheckpointState(**{**state.__dict__, "step": step}), SaveRequest(step=step, reason="bench"))

        def formats_only() -> None:
            d = Path(tmp) / f"formats-{next(counter)}"
            d.mkdir()
            write_rank_files(state, d, rank=0, blobs_dir=Path(tmp) / "blobs", level=3, threads=0)
            shutil.rmtree(d)

        def torch_save() -> None:
            with open(base, "wb") as f:
                torch.save(baseline_obj, f)
                fsync_file(f)

        save = rounds({"torch.save + fsync (baseline)": torch_save, "tier formats only, no commit": formats_only,
                       "CheckpointStore.save (all tiers)": ours_save}, args.repeats, None)
        info = store.resolve("auto")
        files = [p for p in Path(info.path).iterdir()] + [base]

        tier_sets = {"L0": {Tier.WEIGHTS}, "L0+L1": {Tier.WEIGHTS, Tier.OPTIMIZER}, "L0+L1+L2": set(Tier)}
        cases: dict[str, Callable[[], Any]] = {
            "torch.load(weights_only) full (baseline)": lambda: touch(torch.load(base, weights_only=True)),
        }
        for label, tiers in tier_sets.items():
            cases[f"store.load {label} (verified)"] = (
                lambda tiers=tiers: touch([store.load(info, tiers=tiers).__dict__[k]
                                           for k in ("weights", "optimizer")]))

        def resume() -> None:
            plan = plan_resume(store, "auto")
            assert plan is not None
            touch([plan.loaded.weights, plan.loaded.optimizer])

        cases["plan_resume (L0, L1, L2)"] = resume
        warm = rounds(cases, args.repeats, None)
        cold = rounds(cases, args.repeats, lambda: drop_cache(files))
        sizes = {"store": sum(p.stat().st_size for p in Path(info.path).iterdir()), "baseline": base.stat().st_size}
        store.close()

    print(f"model: Qwen2 {args.layers} layers, {n_params / 1e6:.1f}M params; AdamW after {args.steps} steps")
    print(f"bytes: store checkpoint {sizes['store'] / 2**20:.1f} MiB, "
          f"torch.save file {sizes['baseline'] / 2**20:.1f} MiB "
          f"(ratio {sizes['store'] / sizes['baseline']:.2f})")
    print()
    print("| save | best s | median s | vs torch.save |")
    print("|---|---|---|---|")
    b = save["torch.save + fsync (baseline)"][0]
    for name, (best, med) in save.items():
        print(f"| {name} | {best:.3f} | {med:.3f} | {best / b:.2f}x |")
    print()
    print("| restore | warm best s | warm vs torch.load | cold best s | cold vs torch.load |")
    print("|---|---|---|---|---|")
    bw, bc = warm["torch.load(weights_only) full (baseline)"][0], cold["torch.load(weights_only) full (baseline)"][0]
    for name in cases:
        print(f"| {name} | {warm[name][0]:.3f} | {warm[name][0] / bw:.2f}x | {cold[name][0]:.3f} | "
              f"{cold[name][0] / bc:.2f}x |")
    print()
    print(f"catalog recovery_cost_ms (estimate): {info.recovery_cost_ms:.0f} ms; measured cold full load: "
          f"{1000 * cold['store.load L0+L1+L2 (verified)'][0]:.0f} ms, "
          f"warm: {1000 * warm['store.load L0+L1+L2 (verified)'][0]:.0f} ms")


if __name__ == "__main__":
    main()

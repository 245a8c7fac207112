"""Benchmark of the store's tier formats against baselines measured in the same run.

A ~60M-parameter Qwen2 (hidden 512, 8 layers, vocab 32000) is trained a few steps with
AdamW on random tokens, so the optimizer state is real. Then, in one process:

- L0 save: ours (`save_weights`: safetensors + XXH3-128 checksum + fsync) vs `torch.save` + fsync vs
  a raw write of the same tensor bytes + fsync (the disk's floor).
- L0 load: ours (`load_weights`, mmap) vs `torch.load(weights_only=True)` (and with
  `mmap=True`), each followed by touching every byte (`t.sum()` per tensor); once from the
  page cache (warm) and once after dropping the file's pages with
  `posix_fadvise(DONTNEED)` (cold). "ours + verify" also checksums the file first, as
  `CheckpointStore.load` does.
- Methods are run round-robin and the best of N rounds is reported (with the median): the
  development machine shares 2 CPUs with other jobs, and the best time is the one least
  disturbed by them.
- L1: optimizer state (`flatten_state`) written with `write_tensor_file` (container v3:
  independent zstd frames decoded in parallel): byte-grouped zstd (ours) vs plain zstd on the
  raw bytes (same container, `byte_group=False`) vs a raw write of the bytes (the floor), ours
  at zstd level 1, ours read with one decode thread, and the opt-in uncompressed container
  (`compression="none"`, memory-mapped on read); size, write and read speed (wall and per
  CPU-second). Reads include touching every byte (`t.sum()`), as the L0 loads do, so the lazily
  mapped uncompressed read is not flattered. Also on a bf16 copy of the state.

Run:
    taskset -c 0,1 .venv/bin/python scripts/bench_store.py [--dir DIR] [--repeats 4] [--only l1]
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

from hf_dynamic_ckpt.store.fs import fsync_file
from hf_dynamic_ckpt.store.hashing import file_checksum
from hf_dynamic_ckpt.store.statetree import flatten_state
from hf_dynamic_ckpt.store.tensorpack import read_tensor_file, resolve_threads, write_tensor_file
from hf_dynamic_ckpt.store.weights import load_weights, save_weights


def build_and_train(steps: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed_rounds(cases: dict[str, Callable[[], Any]], repeats: int,
                 before: dict[str, Callable[[], None]] | None = None) -> dict[str, tuple[float, float, float]]:
    """Runs the cases round-robin `repeats` times; returns {name: (best, median, best CPU)} seconds.

    Round-robin spreads the noise of other processes evenly over the methods compared. CPU
    time (all threads of this process) is what a method costs regardless of contention.
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            if before and name in before:
                before[name]()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: (min(ts), statistics.median(ts), min(cpu[name])) for name, ts in times.items()}


def raw_write(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        for t in tensors.values():
            t = t.contiguous()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        fsync_file(f)


def torch_save(sd: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        fsync_file(f)


def touch(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(float(t.float().sum()) if t.dtype != torch.float32 else float(t.sum()) for t in tensors.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="zstd threads (0 = all usable CPUs)")
    parser.add_argument("--only", choices=("all", "l1"), default="all", help="l1: skip the L0 tables")
    args = parser.parse_args()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))

    scratch = Path(tempfile.mkdtemp(prefix="bench_store_", dir=args.dir))
    try:
        t0 = time.perf_counter()
        model, opt = build_and_train(args.steps)
        n_params = sum(p.numel() for p in model.parameters())
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        print(f"model: Qwen2 hidden 512, 8 layers, vocab 32000: {n_params / 1e6:.1f}M params, "
              f"{args.steps} AdamW steps in {time.perf_counter() - t0:.1f} s; CPUs usable: "
              f"{len(os.sched_getaffinity(0))}, zstd workers: {resolve_threads(args.threads)}, repeats: {args.repeats}")
        r = args.repeats
        mb = 1 << 20

        if args.only == "all":
            l0_tables(sd, scratch, r, mb)
        l1_tables(opt, scratch, r, mb, args.threads)
        print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def l0_tables(sd: dict[str, torch.Tensor], scratch: Path, r: int, mb: int) -> None:
    """L0 save and load tables."""
    l0_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    # ---------------- L0 save
    d_ours, d_torch, f_raw = scratch / "ours", scratch / "torch.pt", scratch / "raw.bin"
    d_ours.mkdir()
    ours_file = d_ours / "weights.safetensors"
    save = timed_rounds({
        "raw write + fsync (floor)": lambda: raw_write(sd, f_raw),
        "ours save_weights (+xxh3, fsync)": lambda: save_weights(sd, d_ours, blobs_dir=None),
        "torch.save + fsync": lambda: torch_save(sd, d_torch),
    }, r)
    sizes = {"raw write + fsync (floor)": f_raw, "ours save_weights (+xxh3, fsync)": ours_file,
             "torch.save + fsync": d_torch}
    base_best, base_med, _ = save["raw write + fsync (floor)"]
    print(f"\nL0 save ({l0_bytes / mb:.0f} MiB fp32 weights), {r} interleaved rounds")
    print(f"{'method':<36}{'best s':>8}{'median s':>10}{'MiB/s':>8}{'vs raw best':>13}{'median':>8}")
    for name, (best, med, _) in save.items():
        print(f"{name:<36}{best:>8.3f}{med:>10.3f}{sizes[name].stat().st_size / mb / best:>8.0f}"
              f"{best / base_best:>12.2f}x{med / base_med:>7.2f}x")

    # ---------------- L0 load
    def ours_load() -> None:
        touch(load_weights(d_ours, {}, blobs_dir=scratch))

    def ours_load_verify() -> None:
        file_checksum(ours_file)
        touch(load_weights(d_ours, {}, blobs_dir=scratch))

    def torch_load(mmap: bool) -> Callable[[], None]:
        return lambda: touch(torch.load(d_torch, weights_only=True, mmap=mmap))

    cases = {"torch.load(weights_only=True)": (torch_load(False), d_torch),
             "torch.load(mmap=True)": (torch_load(True), d_torch),
             "ours load_weights (mmap)": (ours_load, ours_file),
             "ours load + verify xxh3": (ours_load_verify, ours_file)}
    warm = timed_rounds({k: fn for k, (fn, _) in cases.items()}, r)
    cold = timed_rounds({k: fn for k, (fn, _) in cases.items()}, r,
                        before={k: (lambda p=path: drop_cache(p)) for k, (_, path) in cases.items()})
    print(f"\nL0 load + touch every byte, {r} interleaved rounds, best (median) seconds; "
          "cold = file pages dropped with posix_fadvise(DONTNEED)")
    print(f"{'method':<32}{'warm':>16}{'cold':>16}{'speed-up vs torch.load warm':>29}{'cold':>7}")
    bw = warm["torch.load(weights_only=True)"][0]
    bc = cold["torch.load(weights_only=True)"][0]
    for name in cases:
        (w, wm, _), (c, cm, _) = warm[name], cold[name]
        print(f"{name:<32}{w:>8.3f} ({wm:.3f}){c:>8.3f} ({cm:.3f}){bw / w:>28.2f}x{bc / c:>6.2f}x")



def l1_tables(opt: torch.optim.Optimizer, scratch: Path, r: int, mb: int, threads: int) -> None:
    """L1 write/read tables (fp32 state and a bf16 copy)."""
    # ---------------- L1
    structure, tensors = flatten_state(opt.state_dict())
    zeros = sum(int((t == 0).sum()) for t in tensors.values() if t.dim() > 0)
    elems = sum(t.numel() for t in tensors.values() if t.dim() > 0)
    print(f"\nL1 state: {zeros / elems:.1%} of the optimizer-state elements are exactly 0 "
          "(embedding rows of tokens never sampled in the few training steps)")
    f_none, f_plain, f_ours = scratch / "l1_raw.bin", scratch / "l1_plain.zst", scratch / "l1_ours.zst"
    f_l1, f_map = scratch / "l1_ours_level1.zst", scratch / "l1_uncompressed.bin"
    bf16 = {k: (v.to(torch.bfloat16) if v.dim() > 0 else v) for k, v in tensors.items()}
    for label, tens in (("fp32 AdamW state", tensors), ("bf16 copy of the state", bf16)):
        nbytes = sum(t.numel() * t.element_size() for t in tens.values())
        writes = timed_rounds({
            "none": lambda tens=tens: raw_write(tens, f_none),
            "plain": lambda tens=tens: write_tensor_file(tens, f_plain, byte_group=False, threads=threads),
            "ours": lambda tens=tens: write_tensor_file(tens, f_ours, byte_group=True, threads=threads),
            "ours1": lambda tens=tens: write_tensor_file(tens, f_l1, level=1, byte_group=True, threads=threads),
            "map": lambda tens=tens: write_tensor_file(tens, f_map, compression="none", threads=threads),
        }, r)
        reads = timed_rounds({"plain": lambda: touch(read_tensor_file(f_plain, threads=threads)),
                              "ours": lambda: touch(read_tensor_file(f_ours, threads=threads)),
                              "ours_t1": lambda: touch(read_tensor_file(f_ours, threads=1)),
                              "ours1": lambda: touch(read_tensor_file(f_l1, threads=threads)),
                              "map": lambda: touch(read_tensor_file(f_map, threads=threads))}, r)
        reads["none"] = (float("nan"),) * 3
        writes["ours_t1"] = writes["ours"]
        back = read_tensor_file(f_ours)
        assert all(torch.equal(back[k].view(torch.uint8) if back[k].dim() else back[k],
                               tens[k].contiguous().view(torch.uint8) if tens[k].dim() else tens[k]) for k in tens)
        print(f"\nL1 {label}: {nbytes / mb:.0f} MiB raw, {len(tens)} tensors, {r} interleaved rounds, best wall "
              "time; MiB/cpu-s = raw MiB per CPU-second of this process (all threads)")
        print(f"{'method':<34}{'MiB':>7}{'ratio':>7}{'vs zstd':>8}{'write s':>8}{'MiB/s':>7}{'MiB/cpu-s':>10}"
              f"{'read s':>8}{'MiB/s':>7}{'MiB/cpu-s':>10}")
        s_plain = f_plain.stat().st_size
        labels = {"none": ("raw write + fsync (floor)", f_none), "plain": ("plain zstd-3 (byte_group=False)", f_plain),
                  "ours": ("ours byte-grouped zstd-3 (default)", f_ours),
                  "ours_t1": ("  same, read with 1 decode thread", f_ours),
                  "ours1": ("ours byte-grouped zstd-1", f_l1),
                  "map": ("ours compression=none (mmap)", f_map)}
        for key, (name, path) in labels.items():
            size, (w, _, wc), (rd, _, rc) = path.stat().st_size, writes[key], reads[key]
            print(f"{name:<34}{size / mb:>7.1f}{nbytes / size:>7.3f}{size / s_plain:>7.3f}x{w:>8.3f}"
                  f"{nbytes / mb / w:>7.0f}{nbytes / mb / wc:>10.0f}{rd:>8.3f}{nbytes / mb / rd:>7.0f}"
                  f"{nbytes / mb / rc:>10.0f}")
        for p in (f_none, f_plain, f_ours, f_l1, f_map):
            p.unlink()
    del structure


if __name__ == "__main__":
    main()

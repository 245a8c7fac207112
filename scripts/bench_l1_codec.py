#!/usr/bin/env python
"""Which zstd level and thread count lets the L1 (optimizer) tier keep up with the disk?

The state: AdamW after 3 steps of a ~60M-parameter Qwen2 (hidden 512, 8 layers, vocab
32000; the model of `bench_store.py`), flattened as the store does (`flatten_state`), about
480 MB of float32 moments. In one run:

- the disk's floor: a raw write of the same bytes + fsync (what any codec must match);
- `write_tensor_file` (the store's L1 container, byte-grouped floats, independent frames)
  at each zstd level of `--levels` (negative levels are zstd's "fast" modes) and each
  thread count of `--threads`: wall time, raw MiB/s, MiB/s per CPU-second, size, and the
  ratio of its speed to the disk's (goal >= 1);
- a PROTOTYPE codec (`_proposed_write`, not the store's format) that compresses only the
  byte planes that compress: what a container change would gain.

Methods run round-robin, best of `--repeats` rounds (the machine is shared).

Run:  python scripts/bench_l1_codec.py [--dir DIR] [--levels -5,-1,1,3] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dynamic_ckpt.store.checksum import fsync_file
from hf_dynamic_ckpt.store.tensorpack import flatten_state, write_tensor_file

MiB = 1 << 20


def _optimizer_state() -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        ids = torch.randint(0, 32000, (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    _, tensors = flatten_state({"optimizer": opt.state_dict()})
    return tensors


def _raw_write(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        for t in tensors.values():
            f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        fsync_file(f)


def _proposed_write(tensors: dict[str, torch.Tensor], path: Path, *, threads: int) -> None:
    """A PROTOTYPE of a faster L1 codec (not the store's format; for the proposal only).

    The container's byte grouping (`tensorpack._group`: top byte plane, second plane, low
    bytes), then each of the three parts of a 16 MiB frame is compressed only if a 256 KiB
    sample of it compresses below 0.9: on dense AdamW moments the low mantissa bytes and
    usually the second plane are random-like, and zstd spends 1-2 ms per MiB to leave them
    as they are; mostly-zero state (embedding rows no batch touched) still compresses
    everywhere. zstd level 1 with a small match finder (min_match 7, 4 KiB tables: ~1.7x
    faster than level 1's defaults at the same ratio on the exponent plane). Frames in
    parallel threads, xxh3-64 per frame, one fsync: the work the real writer does.
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import xxhash
    import zstandard

    from hf_dynamic_ckpt.store.tensorpack import _group

    params = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, search_log=1, hash_log=12, chain_log=12)
    frames: list[tuple[np.ndarray, int]] = []
    for t in tensors.values():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        item = t.element_size() if t.dtype.is_floating_point and t.numel() > 1 else 1
        step = (16 << 20) // item * item
        frames += [(raw[i:i + step], item) for i in range(0, raw.size, step)]

    def encode(frame: tuple[np.ndarray, int]) -> list[bytes]:
        raw, item = frame
        cctx = zstandard.ZstdCompressor(compression_params=params)
        n = raw.size // item
        grouped = _group(raw, item) if item > 1 else raw
        bounds = [0, n, 2 * n, raw.size] if item > 1 else [0, raw.size]
        out = []
        for lo, hi in itertools.pairwise(bounds):
            part = grouped[lo:hi]
            sample = part[: 256 << 10]
            if len(cctx.compress(sample)) < 0.9 * max(sample.size, 1):
                out.append(cctx.compress(part))
            else:
                out.append(part.tobytes())
        return out

    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=threads) as pool:
        for parts in pool.map(encode, frames):
            h = xxhash.xxh3_64()
            for part in parts:
                h.update(part)
                f.write(part)
        fsync_file(f)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--levels", default="-5,-3,-1,1,3")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    tensors = _optimizer_state()
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    scratch = Path(tempfile.mkdtemp(prefix="bench_l1-", dir=args.dir))
    cases = {"raw write + fsync (disk floor)": lambda path: _raw_write(tensors, path)}
    for level in (int(x) for x in args.levels.split(",")):
        for threads in (int(x) for x in args.threads.split(",")):
            cases[f"zstd level {level}, {threads} thread(s)"] = (
                lambda path, level=level, threads=threads: write_tensor_file(tensors, path, level=level,
                                                                             threads=threads))
    for threads in (int(x) for x in args.threads.split(",")):
        cases[f"PROTOTYPE: compress only compressible planes, {threads} thread(s)"] = (
            lambda path, threads=threads: _proposed_write(tensors, path, threads=threads))
    best: dict[str, tuple[float, float, int]] = {}
    try:
        for _ in range(args.repeats):
            for name, fn in cases.items():
                path = scratch / "l1.bin"
                cpu, start = _cpu_s(), time.perf_counter()
                fn(path)
                wall, used = time.perf_counter() - start, _cpu_s() - cpu
                size = path.stat().st_size
                path.unlink()
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, used, size)
    finally:
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
    disk = raw / MiB / best["raw write + fsync (disk floor)"][0]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {raw / MiB:.0f} MiB of AdamW state, best of "
          f"{args.repeats}, load average {os.getloadavg()[0]:.1f}")
    print("| method | wall ms | raw MiB/s (x disk) | MiB per CPU-s | size MiB (ratio) |")
    print("|---|---|---|---|---|")
    for name, (wall, used, size) in best.items():
        speed = raw / MiB / wall
        print(f"| {name} | {1e3 * wall:.0f} | {speed:.0f} ({speed / disk:.2f}x) | "
              f"{raw / MiB / max(used, 1e-9):.0f} | {size / MiB:.0f} ({size / raw:.3f}) |")


if __name__ == "__main__":
    main()

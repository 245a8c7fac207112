#!/usr/bin/env python
"""Does the L1 (optimizer) tier keep up with the disk? The store writer vs plain zstd and the disk floor.

The state: AdamW after 3 steps of a ~60M-parameter Qwen2 (hidden 512, 8 layers, vocab
32000; the model of `bench_store.py`), flattened as the store does (`flatten_state`), about
480 MB of float32 moments. In one run, round-robin, best of `--repeats` rounds (the machine
is shared):

- the disk's floor: a raw write of the same bytes + fsync (what any codec must match);
- the store's writer (`write_tensor_file`, container v3: frames of raw and zstd parts, the
  store's default level 1) with each thread count of `--threads`, paced (the store's default
  for a local root: no faster than the disk, and slowly compressing parts raw while the disk
  waits for the compressor), as a store's first write (byte-grouped) and as its later writes
  (grouped only if the previous paced write found the disk holding it up: a `PaceMemory`
  carried from write to write, warmed by one untimed write), and not paced (every part that
  compresses compressed, the smallest file); the same with zstd's own
  level-1 match finder (to justify `tensorpack.compression_params`); each level of
  `--levels` other than 1;
- plain zstd level 1 (no byte grouping, not paced, 2 threads);
- reads (`read_tensor_file`, all threads, every byte touched, page cache warm) of the store
  writer's file and of the plain zstd one.

Printed: wall ms, raw MiB/s and its ratio to the disk floor (goal >= 1), raw MiB per
CPU-second of this process, size and its ratio to plain zstd's; read ms and the read speed
relative to plain zstd's.

Run:  python scripts/bench_l1_codec.py [--dir DIR] [--threads 1,2] [--levels 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dynamic_ckpt.store.fs import fsync_file
from hf_dynamic_ckpt.store.statetree import flatten_state
from hf_dynamic_ckpt.store.tensorpack import PaceMemory, read_tensor_file, write_tensor_file

from hf_dynamic_ckpt.store import tensorpack

MiB = 1 << 20
FLOOR = "raw write + fsync (disk floor)"
PLAIN = "plain zstd level 1 (no byte grouping), 2 threads"


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


def _default_match_finder(level: int) -> object:
    import zstandard

    return zstandard.ZstdCompressionParameters.from_level(level, write_checksum=1, write_content_size=1)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    cpu, start = _cpu_s(), time.perf_counter()
    fn()
    return time.perf_counter() - start, _cpu_s() - cpu


def _touch(tensors: dict[str, torch.Tensor]) -> float:
    """Reads every element (as `bench_store.py` does)."""
    return float(sum(float(t.float().sum()) if t.dtype != torch.float32 else float(t.sum()) for t in tensors.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--threads", default="1,2", help="thread counts of the v3 writer")
    p.add_argument("--levels", default="3", help="v3 at these levels too (besides the default 1); '' for none")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    tensors = _optimizer_state()
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    scratch = Path(tempfile.mkdtemp(prefix="bench_l1-", dir=args.dir))

    carried: dict[int, PaceMemory] = {}  # threads -> the memory of a store's later writes
    grouped_later: dict[int, list[bool]] = {}

    def v3(level: int, threads: int, finder: bool = False, paced: bool = False,
           later: bool = False) -> Callable[[Path], object]:
        def write(path: Path) -> object:
            if later:
                pace = carried[threads]
                grouped_later.setdefault(threads, []).append(pace.group)
                return write_tensor_file(tensors, path, level=level, threads=threads, paced=True, pace=pace)
            if not finder:
                return write_tensor_file(tensors, path, level=level, threads=threads, paced=paced,
                                         pace=PaceMemory() if paced else None)
            with mock.patch.object(tensorpack, "compression_params", _default_match_finder):
                return write_tensor_file(tensors, path, level=level, threads=threads)
        return write

    cases: dict[str, Callable[[Path], object]] = {FLOOR: lambda path: _raw_write(tensors, path)}
    for threads in (int(x) for x in args.threads.split(",")):
        cases[f"v3 (store writer): level 1, {threads} thread(s), paced, first write"] = v3(1, threads, paced=True)
        carried[threads] = PaceMemory()
        write_tensor_file(tensors, scratch / "warm.bin", level=1, threads=threads, paced=True, pace=carried[threads])
        (scratch / "warm.bin").unlink()
        cases[f"v3 (store writer): level 1, {threads} thread(s), paced, later writes"] = v3(1, threads, later=True)
        cases[f"v3: level 1, {threads} thread(s), not paced"] = v3(1, threads)
    cases["v3, level 1 with zstd's own match finder, 2 threads"] = v3(1, 2, finder=True)
    for level in (int(x) for x in args.levels.split(",") if x):
        cases[f"v3, level {level}, 2 threads"] = v3(level, 2)
    cases[PLAIN] = lambda path: write_tensor_file(tensors, path, level=1, threads=2, byte_group=False)
    best: dict[str, tuple[float, float, int]] = {}
    reads: dict[str, tuple[float, float]] = {}
    v3_file, plain_file = scratch / "v3.bin", scratch / "plain.bin"
    try:
        for _ in range(args.repeats):
            for name, fn in cases.items():
                path = scratch / "l1.bin"
                wall, used = _timed(lambda fn=fn, path=path: fn(path))
                size = path.stat().st_size
                path.unlink()
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, used, size)
        write_tensor_file(tensors, v3_file, level=1, threads=0)
        write_tensor_file(tensors, plain_file, level=1, threads=0, byte_group=False)
        back = read_tensor_file(v3_file)
        assert all(torch.equal(back[k].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))
                   for k, t in tensors.items()), "v3 round trip is not bit-exact"
        del back
        for _ in range(args.repeats):
            for name, path in (("store writer", v3_file), ("plain zstd", plain_file)):
                wall, used = _timed(lambda path=path: _touch(read_tensor_file(path)))
                if name not in reads or wall < reads[name][0]:
                    reads[name] = (wall, used)
    finally:
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
    disk = raw / MiB / best[FLOOR][0]
    plain_size = best[PLAIN][2]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {raw / MiB:.0f} MiB of AdamW state, best of "
          f"{args.repeats}, load average {os.getloadavg()[0]:.1f}")
    print("| write | wall ms | raw MiB/s (x disk floor) | MiB per CPU-s | size MiB (x raw; x plain zstd) |")
    print("|---|---|---|---|---|")
    for name, (wall, used, size) in best.items():
        speed = raw / MiB / wall
        print(f"| {name} | {1e3 * wall:.0f} | {speed:.0f} ({speed / disk:.2f}x) | "
              f"{raw / MiB / max(used, 1e-9):.0f} | {size / MiB:.1f} ({size / raw:.3f}; {size / plain_size:.3f}) |")
    for threads, flags in grouped_later.items():
        print(f"later writes, {threads} thread(s): byte-grouped in {sum(flags)} of {len(flags)} timed writes")
    print()
    print("| read (all threads, every byte touched, warm cache) | wall ms | raw MiB/s | MiB per CPU-s "
          "| speed / plain zstd |")
    print("|---|---|---|---|---|")
    for name, (wall, used) in reads.items():
        print(f"| {name} | {1e3 * wall:.0f} | {raw / MiB / wall:.0f} | {raw / MiB / max(used, 1e-9):.0f} | "
              f"{reads['plain zstd'][0] / wall:.2f}x |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Does `store/safetensors_io.py` earn its place next to the `safetensors` package?

The store writes and reads its L0 files (`weights.safetensors`, blobs, FSDP2 shards) with its own
serialiser and reader. This compares them, in one run, with what the package offers for the same job:

- write: ours (`write_safetensors`: streaming, fsync, the checksum hashed while the fsync runs) vs
  `safetensors.torch.save_file` + fsync + a separate `file_checksum` pass (what the store would need);
  the two files are checked to be byte-identical. `save_file` + fsync alone (no checksum) tells the
  checksum pass apart from the write itself (ours asks the kernel to write back every 8 MiB as it goes).
- read, warm page cache: ours (`open_tensors(mmap=True)`: header validated, zero-copy views of a private
  map) vs `safetensors.torch.load_file` and `safe_open(...).get_tensor(k)` per key; once only opening
  (what a load costs before anything is touched) and once touching every byte (`t.sum()` per tensor).
  Also ours with `mmap=False` (tensors read into memory).

Two state dicts: a full fine-tune's L0 (a ~60M Qwen2-shaped model, fp32 and a bf16 copy, ~230 MB and
~115 MB) and a LoRA adapter (r=16 on every projection of 24 layers, ~30 MB of small fp32 tensors).
Methods run round-robin; the best of `--repeats` rounds is reported (the machine is shared). Ratios are
the package's time over ours (> 1: ours is faster).

Run:  python scripts/bench_safetensors_io.py [--dir DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
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
from hf_dynamic_ckpt.store.safetensors_io import open_tensors, write_safetensors
from safetensors import safe_open
from safetensors.torch import load_file, save_file

MB = 1e6
METADATA = {"format": "pt"}


def full_state(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Qwen2-shaped L0 (hidden 512, 8 layers, intermediate 1792, vocab 32000, untied head): ~58M parameters."""
    g = torch.Generator().manual_seed(0)
    hidden, inter, vocab, kv = 512, 1792, 32000, 128
    out = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(8):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
                            ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
                            ("mlp.down_proj.weight", (hidden, inter))):
            out[p + name] = torch.randn(*shape, generator=g)
        for name, n in (("self_attn.q_proj.bias", hidden), ("self_attn.k_proj.bias", kv),
                        ("self_attn.v_proj.bias", kv), ("input_layernorm.weight", hidden),
                        ("post_attention_layernorm.weight", hidden)):
            out[p + name] = torch.randn(n, generator=g)
    out["model.norm.weight"] = torch.ones(hidden)
    out["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    return {k: v.to(dtype) for k, v in out.items()}


def lora_state() -> dict[str, torch.Tensor]:
    """PEFT key names, r=16 on q/k/v/o/gate/up/down of 24 layers of hidden 1024, intermediate 2816."""
    g = torch.Generator().manual_seed(1)
    hidden, inter, r = 1024, 2816, 16
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, 256), "v_proj": (hidden, 256), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    out = {}
    for i in range(24):
        for name, (d_in, d_out) in dims.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            base = f"base_model.model.model.layers.{i}.{part}.{name}"
            out[f"{base}.lora_A.weight"] = torch.randn(r, d_in, generator=g)
            out[f"{base}.lora_B.weight"] = torch.randn(d_out, r, generator=g) * 0.01
    return out


def touch(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(float(t.sum()) for t in tensors.values()))


def package_write(tensors: dict[str, torch.Tensor], path: Path, checksum: bool = True) -> str | None:
    save_file(tensors, str(path), METADATA)
    fsync_file(path)
    return file_checksum(path) if checksum else None


def safe_open_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def best_of(cases: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            wall = time.perf_counter() - start
            best[name] = min(best.get(name, wall), wall)
    return best


def run(label: str, tensors: dict[str, torch.Tensor], scratch: Path, repeats: int) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    ours_file, theirs_file = scratch / "ours.safetensors", scratch / "theirs.safetensors"
    checksum = write_safetensors(tensors, ours_file, METADATA)
    assert package_write(tensors, theirs_file) == checksum, "the files differ"
    writes = best_of({"ours": lambda: write_safetensors(tensors, ours_file, METADATA),
                      "package": lambda: package_write(tensors, theirs_file),
                      "package without the checksum pass": lambda: package_write(tensors, theirs_file, False)},
                     repeats)
    reads = best_of({
        "ours (mmap), open": lambda: open_tensors(ours_file, mmap=True, what="L0"),
        "load_file, open": lambda: load_file(str(theirs_file)),
        "safe_open + get_tensor, open": lambda: safe_open_all(theirs_file),
        "ours (mmap), every byte": lambda: touch(open_tensors(ours_file, mmap=True, what="L0")[0]),
        "ours (mmap=False), every byte": lambda: touch(open_tensors(ours_file, mmap=False, what="L0")[0]),
        "load_file, every byte": lambda: touch(load_file(str(theirs_file))),
        "safe_open + get_tensor, every byte": lambda: touch(safe_open_all(theirs_file)),
    }, repeats)
    print(f"\n{label}: {len(tensors)} tensors, {nbytes / MB:.1f} MB")
    print("| write (+ fsync + checksum) | ms | MB/s | package / ours |")
    print("|---|---|---|---|")
    for name, wall in writes.items():
        print(f"| {name} | {1e3 * wall:.1f} | {nbytes / MB / wall:.0f} | {wall / writes['ours']:.2f}x |")
    print("| read (warm page cache) | ms | package / ours |")
    print("|---|---|---|")
    for name, wall in reads.items():
        ref = reads["ours (mmap), open" if name.endswith(", open") else "ours (mmap), every byte"]
        print(f"| {name} | {1e3 * wall:.1f} | {wall / ref:.2f}x |")
    for f in (ours_file, theirs_file):
        f.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    import safetensors

    print(f"torch {torch.__version__}, safetensors {safetensors.__version__}, {os.cpu_count()} CPUs, best of "
          f"{args.repeats}, load average {os.getloadavg()[0]:.1f}")
    scratch = Path(tempfile.mkdtemp(prefix="bench_st-", dir=args.dir))
    try:
        run("full fine-tune L0, fp32", full_state(torch.float32), scratch, args.repeats)
        run("full fine-tune L0, bf16", full_state(torch.bfloat16), scratch, args.repeats)
        run("LoRA adapter, fp32", lora_state(), scratch, args.repeats)
    finally:
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()


if __name__ == "__main__":
    main()

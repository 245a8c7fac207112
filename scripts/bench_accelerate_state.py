"""Accelerate `save_state` / `load_state`: plain Accelerate vs the hf_dynamic_ckpt hook pair.

A ~67M-parameter Qwen2 built from config with a LoRA adapter (r=16 on q/k/v/o), an AdamW
step before every save so the optimizer has state and each save is a new step.
Measured in the same run, median of --repeats:
wall time of `save_state` and `load_state`, and bytes written (Accelerate's directory plus,
for the hooks, the store checkpoint). CPU only; the numbers are for this machine.

    python scripts/bench_accelerate_state.py --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build():
    from accelerate import Accelerator

    from examples import toy

    accelerator = Accelerator(cpu=True)
    model = toy.tiny_qwen2(seed=0, hidden_size=768, num_layers=8, vocab_size=16384, num_attention_heads=12,
                           num_key_value_heads=4, intermediate_size=2048)
    model = toy.lora(model, r=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    data = toy.random_token_dataset(num_examples=8, seq_len=16, vocab_size=16384)
    loader = torch.utils.data.DataLoader(data.with_format("torch"), batch_size=2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    batch = next(iter(loader))

    def train_step() -> None:
        accelerator.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()

    train_step()
    return accelerator, model, train_step, loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from hf_dynamic_ckpt import SmartCkptConfig
    from hf_dynamic_ckpt.integrations.accelerate import SmartStateHooks

    accelerator, model, train_step, loader = build()
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    work = Path(tempfile.mkdtemp(prefix="bench_acc_"))
    rows: dict[str, dict[str, float]] = {}
    try:
        for mode in ("plain", "hooks"):
            hooks = None
            if mode == "hooks":
                hooks = SmartStateHooks(accelerator, loader, config=SmartCkptConfig(root=str(work / "store")))
                hooks.register()
            saves, loads, sizes = [], [], []
            for i in range(args.repeats):
                train_step()  # untimed: each save is of a new optimizer step
                out = work / f"{mode}-{i}"
                t0 = time.perf_counter()
                accelerator.save_state(str(out))
                saves.append(time.perf_counter() - t0)
                size = dir_bytes(out)
                if hooks is not None:
                    size += dir_bytes(work / "store" / "default" / f"step-{hooks.state.optimizer_steps}")
                sizes.append(size)
                t0 = time.perf_counter()
                accelerator.load_state(str(out))
                loads.append(time.perf_counter() - t0)
            if hooks is not None:
                hooks.close()
            rows[mode] = {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                          "bytes": statistics.median(sizes)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows["plain"]
    print(f"model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable (LoRA r=16, q/k/v/o); "
          f"median of {args.repeats}")
    print(f"{'mode':8s} {'save_state s':>13s} {'ratio':>7s} {'load_state s':>13s} {'ratio':>7s} "
          f"{'MB written':>11s} {'ratio':>7s}")
    for mode, r in rows.items():
        print(f"{mode:8s} {r['save_s']:13.3f} {r['save_s'] / base['save_s']:7.3f} {r['load_s']:13.3f} "
              f"{r['load_s'] / base['load_s']:7.3f} {r['bytes'] / 1e6:11.2f} {r['bytes'] / base['bytes']:7.3f}")


if __name__ == "__main__":
    main()

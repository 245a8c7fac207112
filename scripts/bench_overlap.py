#!/usr/bin/env python
"""Overlapped snapshot benchmark: what a full fine-tune's save costs the training loop with and without overlap.

A plain loop, CPU, a ~45M-parameter Llama built from `LlamaConfig` (fp32, AdamW, a real optimizer state),
two `SaveEngine`s in the same run, one with `overlap=False` (the whole copy at the save) and one with
`overlap=True` (parameters and optimizer state copied beside the next step, `engine/overlap.py`), their
writer processes started ahead as a run does. Cycles alternate the two: `--clean-steps` timed steps, a save (its
blocking time), the next step (timed: with overlap it runs beside the copy and waits for it at
`optimizer.step()`), then the write is waited for, untimed. Per variant:

- blocking per save: median `handle.blocking_ms`;
- gate wait: median time the next step waited for the copy at its `optimizer.step()` (overlap only);
- next step: median time of the step right after the save, and its inflation over the clean steps' median;
- cost per save: blocking + (next step - clean step), what the save added to the loop;
and the ratios overlap / no overlap of each, measured in the same run.

Run:  python scripts/bench_overlap.py              (~2-4 min on 2 CPU cores)
      python scripts/bench_overlap.py --quick      (smaller model, smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         vocab_size=args.vocab, max_position_embeddings=args.seq)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> float:
    start = time.perf_counter()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--cycles", type=int, default=4, help="save cycles per variant")
    p.add_argument("--clean-steps", type=int, default=3)
    p.add_argument("--mode", default="process", choices=["thread", "process"], help="writer of both engines")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.seq, args.cycles = 128, 2, 4000, 32, 2
    torch.set_num_threads(args.torch_threads)
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    _step(model, opt, args)  # the optimizer state exists from here
    sources = StateSources(weights=model.state_dict, optimizer=opt)
    work = Path(tempfile.mkdtemp(prefix="bench_overlap-"))
    engines = {name: SaveEngine(CheckpointStore(work / name), mode=args.mode, overlap=name == "overlap")
               for name in ("sync copy", "overlap")}
    for engine in engines.values():
        engine.start(wait_s=120)
    rows: dict[str, dict[str, list[float]]] = {n: {"clean": [], "blocking": [], "next": [], "wait": []}
                                               for n in engines}
    step = 1
    for cycle in range(args.cycles + 1):  # cycle 0 warms both up, untimed
        for name in (list(engines) if cycle % 2 else list(reversed(engines))):
            engine, row = engines[name], rows[name]
            clean = [_step(model, opt, args) for _ in range(args.clean_steps)]
            step += args.clean_steps
            handle = engine.save(sources, SaveRequest(step=step, epoch=0.0, reason="bench"))
            after = _step(model, opt, args)
            step += 1
            engine.wait()
            if cycle:
                row["clean"] += clean
                row["blocking"].append(handle.blocking_ms)
                row["next"].append(after)
                row["wait"].append((handle.deferred.wait_ms or 0.0) if handle.deferred is not None else 0.0)
    for engine in engines.values():
        engine.close()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3  # weights + 2 moments
    print(f"model: {params / 1e6:.1f}M parameters, fp32, AdamW; snapshot ~{nbytes / 2**20:.0f} MiB; "
          f"writer {args.mode}; {args.cycles} cycles; torch threads {args.torch_threads}")
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
    print(f"{'variant':<10} {'clean ms':>9} {'blocking ms':>12} {'gate wait ms':>13} {'next step ms':>13} "
          f"{'inflation':>10} {'cost/save ms':>13}")
    for name, m in med.items():
        m["cost"] = m["blocking"] + m["next"] - m["clean"]
        print(f"{name:<10} {m['clean']:>9.0f} {m['blocking']:>12.1f} {m['wait']:>13.1f} {m['next']:>13.0f} "
              f"{(m['next'] / m['clean'] - 1) * 100:>9.1f}% {m['cost']:>13.0f}")
    a, b = med["overlap"], med["sync copy"]
    print(f"ratios overlap / sync copy: blocking per save {a['blocking'] / b['blocking']:.3f}, next step "
          f"{a['next'] / b['next']:.3f}, cost per save {a['cost'] / b['cost']:.3f} "
          f"(clean steps {a['clean'] / b['clean']:.3f}: the A/A noise)")


if __name__ == "__main__":
    main()

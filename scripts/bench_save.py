#!/usr/bin/env python
"""Save-engine benchmark: blocking time per save, step-time inflation, bytes on disk.

One run, CPU, a ~60M-parameter Qwen2 built from config, full fine-tune and LoRA, AdamW,
one real Trainer step so the optimizer state exists. For each variant:

1. blocking time per save of the same state (weights + optimizer + scheduler + RNG):
   - ours: `SaveEngine.save` (thread writer), until it returns (median of warm saves; the
     first save is reported separately: its buffers come from `engine.prepare()`, called
     before it as the orchestrator does after attach, or are allocated by it with
     `--no-prepare`);
   - HF: `Trainer._save_checkpoint(model, trial=None)` (synchronous, transformers' own);
   - DCP: `torch.distributed.checkpoint.async_save` on a single-process gloo group, until
     it returns (its blocking part; state dicts prepared beforehand, not timed);
   - floor: one `memcpy` (`Tensor.copy_`) of the same number of bytes between two
     preallocated, touched buffers, timed right after each of our saves (median), so that
     load from other processes slows the floor and the saves alike.
2. training-step time while a background write is in flight vs. without, for the thread
   writer and the process writer (cycles of: k clean steps, a save, the steps started while
   it writes, k clean steps; an A/A comparison of the two clean windows gives the noise).
3. bytes on disk per checkpoint, ours vs. HF's.

Run:  python scripts/bench_save.py            (~3-4 min on 2 CPU cores)
      python scripts/bench_save.py --quick    (smaller model, for a smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.toy import lora, tiny_qwen2
from hf_dynamic_ckpt.constants import ALL_TIERS
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.engine.live import state_dict_tensor_bytes
from hf_dynamic_ckpt.state import CachedWeights, StateSources
from hf_dynamic_ckpt.state.flat import consolidate, pays
from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest

MB = 1e6


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build_trainer(kind: str, args: argparse.Namespace, out: Path) -> Any:
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = tiny_qwen2(seed=0, hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab)
    if kind == "lora":
        model = lora(model, r=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (16, args.seq), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.batch, max_steps=1, use_cpu=True,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=1e-4,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.train()  # one step: AdamW state exists
    return trainer


def _sources(trainer: Any, kind: str) -> StateSources:
    model = trainer.model
    if kind == "lora":
        from peft import get_peft_model_state_dict

        build = lambda: get_peft_model_state_dict(model)  # noqa: E731
    else:
        build = model.state_dict
    # CachedWeights: the mapping is built once and re-validated (storage pointers) per save.
    return StateSources(weights=CachedWeights(model, build), optimizer=trainer.optimizer,
                        scheduler=trainer.lr_scheduler)


def _train_step(trainer: Any, args: argparse.Namespace, seed: int) -> float:
    model, opt = trainer.model, trainer.optimizer
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _ours(variants: dict[str, StateSources], root: Path, repeats: int, threads: int, prepare: bool,
          nbytes: int) -> dict[str, dict[str, float]]:
    """Our saves of each variant's sources, interleaved (variant A, floor, variant B, floor, ...): a
    loaded machine slows every variant and the floor alike. Medians, and mins (the quiet-machine view)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src).fill_(0)  # warm, as reused buffers are
    engines = {}
    with contextlib.ExitStack() as stack:
        for name, sources in variants.items():
            store = stack.enter_context(CheckpointStore(root / name, compression_threads=threads))
            engine = engines[name] = stack.enter_context(SaveEngine(store))
            if prepare:  # as the orchestrator does right after attach: buffers allocated and touched ahead
                engine.prepare(sources, wait=True)
        runs: dict[str, dict[str, list[float]]] = {n: {"blocking": [], "write": [], "floor": []} for n in variants}
        infos: dict[str, Any] = {}
        for i in range(repeats + 1):
            for name, sources in variants.items():
                handle = engines[name].save(sources, SaveRequest(step=i + 1, tiers=ALL_TIERS, reason="bench"))
                infos[name] = handle.wait()
                runs[name]["blocking"].append(handle.blocking_ms)
                runs[name]["write"].append(handle.write_ms or 0.0)
                start = time.perf_counter()  # the floor, interleaved
                dst.copy_(src)
                runs[name]["floor"].append((time.perf_counter() - start) * 1e3)
        out: dict[str, dict[str, float]] = {}
        for name, r in runs.items():
            info, store = infos[name], engines[name].store
            out[name] = {
                "memcpy_ms": statistics.median(r["floor"]), "memcpy_min_ms": min(r["floor"]),
                "first_ms": r["blocking"][0], "blocking_ms": statistics.median(r["blocking"][1:]),
                "min_ms": min(r["blocking"][1:]), "max_ms": max(r["blocking"]),
                "write_ms": statistics.median(r["write"][1:]),
                "disk_bytes": _dir_bytes(Path(info.path)) + (_dir_bytes(store.blobs_dir)
                                                             if store.blobs_dir.exists() else 0),
                "buffer_bytes": engines[name].buffer_bytes,
            }
    return out


def _twin(trainer: Any, kind: str) -> StateSources:
    """The same state in separate tensors (a deep copy, its own AdamW), not consolidated."""
    model = copy.deepcopy(trainer.model)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    twin = dict(model.named_parameters())
    opt = type(inner)([{"params": [twin[names[id(p)]] for p in g["params"]]} for g in inner.param_groups])
    opt.load_state_dict(inner.state_dict())
    if kind == "lora":
        from peft import get_peft_model_state_dict

        build = lambda: get_peft_model_state_dict(model)  # noqa: E731
    else:
        build = model.state_dict
    return StateSources(weights=CachedWeights(model, build), optimizer=opt, scheduler=trainer.lr_scheduler)


def _consolidate(trainer: Any) -> None:
    """The trainable parameters and AdamW state in one flat buffer per dtype, as the integrations keep them."""
    model = trainer.model
    flat = consolidate(model, trainer.optimizer, order=_sources(trainer, "lora" if hasattr(model, "peft_config")
                                                                else "full").weights().values())
    assert flat is not None
    print(f"consolidated {len(flat.params)} parameters and {len(flat.entries)} optimizer tensors "
          f"into {len(flat.param_buffers) + len(flat.state_buffers)} buffers", flush=True)


def _hf(trainer: Any, repeats: int) -> dict[str, float]:
    times, size = [], 0
    run_dir = Path(trainer.args.output_dir)
    for i in range(repeats):
        trainer.state.global_step = 1000 + i
        start = time.perf_counter()
        trainer._save_checkpoint(trainer.model, trial=None)
        times.append(time.perf_counter() - start)
        folder = run_dir / f"checkpoint-{1000 + i}"
        size = _dir_bytes(folder)
        shutil.rmtree(folder)
    return {"blocking_ms": 1e3 * statistics.median(times), "disk_bytes": size}


def _dcp(trainer: Any, root: Path, repeats: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer.optimizer
                                        if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(root / f"dcp-{i}"))
        times.append(time.perf_counter() - start)
        future.result()
    return {"first_ms": 1e3 * times[0], "blocking_ms": 1e3 * statistics.median(times[1:])}


def _inflation(trainer: Any, kind: str, root: Path, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """Per cycle: k clean steps, a save, the steps started while it writes, k clean steps.

    Inflation of a cycle = median(steps during the write) / median(clean steps) - 1; the
    A/A line compares the clean steps after the write with those before (the noise floor
    of this machine). Both are reported as the median over cycles.
    """
    sources = _sources(trainer, kind)
    seed = 10_000
    inflations, noise, during_ms, clean_ms = [], [], [], []
    with CheckpointStore(root, compression_threads=args.compression_threads) as store, \
            SaveEngine(store, mode=mode, writer_nice=args.writer_nice) as engine:
        engine.save(sources, SaveRequest(step=1, tiers=ALL_TIERS, reason="warm-up")).wait()  # buffers
        engine.wait_writer_ready()  # process mode: measure the process, not the stand-in thread of its start-up

        def steps(n: int) -> list[float]:
            nonlocal seed
            out = []
            for _ in range(n):
                seed += 1
                out.append(_train_step(trainer, args, seed))
            return out

        for cycle in range(args.cycles):
            pre = steps(args.clean_steps)
            handle = engine.save(sources, SaveRequest(step=cycle + 2, tiers=ALL_TIERS, reason="bench"))
            during = []
            while not handle.done():
                during += steps(1)  # started while the write was in flight
            handle.wait()
            post = steps(args.clean_steps)
            clean = statistics.median(pre + post)
            inflations.append(statistics.median(during) / clean - 1.0)
            noise.append(statistics.median(post) / statistics.median(pre) - 1.0)
            during_ms += during
            clean_ms += pre + post
    return {"clean_ms": 1e3 * statistics.median(clean_ms), "during_ms": 1e3 * statistics.median(during_ms),
            "inflation": statistics.median(inflations), "noise": statistics.median(noise), "n_during": len(during_ms)}


def _bench_variant(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    trainer = _build_trainer(kind, args, work / f"hf-{kind}")
    sources = _sources(trainer, kind)
    weights = sources.weights()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    nbytes += state_dict_tensor_bytes(trainer.optimizer.state_dict())
    params = sum(p.numel() for p in trainer.model.parameters())
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(f"[{kind}] {params / 1e6:.1f}M params ({trainable / 1e6:.2f}M trainable), "
          f"{nbytes / MB:.1f} MB to snapshot", flush=True)
    res: dict[str, Any] = {"kind": kind, "params": params, "trainable": trainable, "bytes": nbytes}
    flat = args.consolidate == "on" or (args.consolidate == "auto" and pays(trainer.model))
    if not args.only_inflation:
        variants = {}
        if args.consolidate == "both":  # the same state twice, as it is and consolidated, saves interleaved
            variants["plain"] = _twin(trainer, kind)
            flat = True
        if flat:
            _consolidate(trainer)
        variants["ours"] = _sources(trainer, kind)
        got = _ours(variants, work / f"ours-{kind}", args.repeats, args.compression_threads, not args.no_prepare,
                    nbytes)
        res["ours"] = got["ours"]
        if "plain" in got:
            res["ours_plain"] = got["plain"]
            print(f"[{kind}] ours, not consolidated {res['ours_plain']}", flush=True)
        res["flat"] = flat
        res["memcpy_ms"] = res["ours"]["memcpy_ms"]  # median of one memcpy after each save (same run)
        print(f"[{kind}] ours{', consolidated' if flat else ''} {res['ours']}", flush=True)
        res["hf"] = _hf(trainer, args.hf_repeats)  # of the consolidated model too (shared storages)
        print(f"[{kind}] hf {res['hf']}", flush=True)
        res["dcp"] = _dcp(trainer, work / f"dcp-{kind}", args.repeats)
        print(f"[{kind}] dcp {res['dcp']}", flush=True)
    elif flat:
        _consolidate(trainer)
    if not args.skip_inflation:
        for mode in args.modes.split(","):
            res[f"infl_{mode}"] = _inflation(trainer, kind, work / f"infl-{kind}-{mode}", mode, args)
            print(f"[{kind}] inflation {mode} {res[f'infl_{mode}']}", flush=True)
    shutil.rmtree(work / f"hf-{kind}", ignore_errors=True)
    return res


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | snapshot MB | memcpy floor ms | ours ms (x floor) | ours first save ms (x floor) | "
        "ours worst save "
        "(x floor) | min save / min floor ms (x) | HF `_save_checkpoint` ms (ours / HF) | DCP `async_save` ms "
        "(ours / DCP) | ours bg write ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [({**r, "ours": r["ours_plain"], "flat": False}) for r in results if "ours_plain" in r]
    for r in [*rows, *results]:
        o, hf, dcp = r["ours"], r["hf"], r["dcp"]
        floor = o["memcpy_ms"]
        lines.append(
            f"| {r['kind']}{' (consolidated)' if r.get('flat') else ''} | {r['bytes'] / MB:.1f} | {floor:.1f} | "
            f"{o['blocking_ms']:.1f} "
            f"({o['blocking_ms'] / floor:.2f}x) | {o['first_ms']:.1f} ({o['first_ms'] / floor:.2f}x) | "
            f"{o['max_ms'] / floor:.2f}x | {o['min_ms']:.1f} / {o['memcpy_min_ms']:.1f} "
            f"({o['min_ms'] / o['memcpy_min_ms']:.2f}x) | {hf['blocking_ms']:.1f} "
            f"({o['blocking_ms'] / hf['blocking_ms']:.3f}) | {dcp['blocking_ms']:.1f} "
            f"({o['blocking_ms'] / dcp['blocking_ms']:.2f}) | {o['write_ms']:.0f} |"
        )
    lines += ["", "| variant | clean step ms | step ms during write, thread (inflation; A/A noise; n) | "
              "step ms during write, process (inflation; A/A noise; n) | disk MB ours | disk MB HF | ours / HF |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        cells = []
        for mode in ("thread", "process"):
            i = r.get(f"infl_{mode}")
            cells.append("-" if i is None else
                         f"{i['during_ms']:.0f} ({i['inflation']:+.1%}; A/A {i['noise']:+.1%}; n={i['n_during']})")
        clean = r.get("infl_thread", {}).get("clean_ms")
        lines.append(
            f"| {r['kind']} | {'-' if clean is None else f'{clean:.0f}'} | {cells[0]} | {cells[1]} | "
            f"{r['ours']['disk_bytes'] / MB:.1f} | {r['hf']['disk_bytes'] / MB:.1f} | "
            f"{r['ours']['disk_bytes'] / r['hf']['disk_bytes']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed saves per method (after one warm-up)")
    p.add_argument("--hf-repeats", type=int, default=2)
    p.add_argument("--cycles", type=int, default=3, help="clean-steps/save cycles per inflation measurement")
    p.add_argument("--clean-steps", type=int, default=3)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="intra-op threads of training (1 leaves a core to the writer on a 2-core box)")
    p.add_argument("--compression-threads", type=int, default=1, help="store zstd threads (0: all CPUs)")
    p.add_argument("--variants", default="full,lora")
    p.add_argument("--skip-inflation", action="store_true")
    p.add_argument("--only-inflation", action="store_true", help="skip the blocking-time comparison")
    p.add_argument("--modes", default="thread,process", help="writer modes for the inflation measurement")
    p.add_argument("--writer-nice", type=int, default=10, help="nice increment of the writer thread/process")
    p.add_argument("--consolidate", default="auto", choices=["auto", "on", "off", "both"],
                   help="trainable state in flat buffers (state.flat) before our saves: auto = where the "
                        "integrations do it by default; both = measure without, then with, in this run")
    p.add_argument("--no-prepare", action="store_true", help="no engine.prepare() before the first save")
    p.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.repeats, args.hf_repeats, args.cycles = 128, 2, 4000, 2, 1, 1
    torch.set_num_threads(args.torch_threads)

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_save-"))
    try:
        results = [_bench_variant(kind, args, work) for kind in args.variants.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()
    print()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads {args.torch_threads}, "
          f"zstd threads {args.compression_threads}, writer nice {args.writer_nice}, prepare "
          f"{'no' if args.no_prepare else 'yes'}, load average {os.getloadavg()[0]:.1f}, "
          f"total {time.perf_counter() - start:.0f} s")
    if not args.only_inflation:
        print(_table(results))


if __name__ == "__main__":
    main()

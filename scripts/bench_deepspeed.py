#!/usr/bin/env python
"""DeepSpeed ZeRO on 2 processes: save blocking and resume, hf_dynamic_ckpt against DeepSpeed's own checkpointing.

    nice -n 10 python scripts/bench_deepspeed.py [--stages 2,3] [--repeats 3] [--hidden 1024] [--layers 2]

One torchrun job per ZeRO stage (2 CPU processes, gloo, `DS_ACCELERATOR=cpu`, one training thread each) trains a
Qwen2 built from `Qwen2Config` (no download; by default 55.3M parameters: a 16000-token vocabulary with untied
embeddings, 2 layers of width 1024, 16 attention heads and 4 key/value heads, MLP 2816; fp32, a full fine-tune with
AdamW) under `Trainer(deepspeed={"zero_optimization": {"stage": S}, ...})` with a
`SmartCkptCallback(SmartCkptConfig(base_interval=B))` (B = `--interval`, 3), for `B * --repeats + 1` steps of
1 x 64 random tokens per process, and measures in the same processes:

- hf_dynamic_ckpt's saves: the policy's interval saves of steps B, 2B, ... (taken at the next step's begin, as
  under any Trainer run). `blocking` is what the library records as the time the training thread was stopped by
  the save (`SaveEvent.blocking_ms`); `hook` is the wall-clock time of `SmartCkptCallback.on_step_begin` in the
  step that took the save (the save with everything the library does around it on the training thread: the
  manifest's `extra`, its collectives), the check on `blocking`. The write that follows runs in the background
  (`write s`, not blocking); it is waited for, outside any timing, before DeepSpeed's next save.
- DeepSpeed's saves: `engine.save_checkpoint(output_dir)` (what Trainer's own save under DeepSpeed calls) at
  steps B - 1, 2B - 1, ...: its wall time, which blocks every rank until its `torch.save` files are written.
  Trainer's `_save_checkpoint` adds `save_model` to it (under ZeRO-2 the whole model as safetensors from rank 0,
  under ZeRO-3 without `stage3_gather_16bit_weights_on_model_save` a second `save_checkpoint`): DeepSpeed's number
  is a lower bound of Trainer's save.

Before each save of either kind the dirty pages of the other are flushed (`os.sync`, not timed), so neither pays
for the other's write-back. Each save is timed on every rank; the table shows the max over the ranks per save and
the median over the saves.

Then `--repeats` resumes of each kind, alternating which goes first, each a new model and a new `Trainer` (a new
DeepSpeed engine) in the same processes, stopped once the state is loaded (a callback raises at train begin):

- ours: `resume_checkpoint(trainer, "auto")` (choose and verify the newest checkpoint, agreed across the ranks;
  start reading the optimizer tier in a background thread; write the Trainer folder), then
  `trainer.train(resume_from_checkpoint=folder)`, whose `SmartCkptCallback.on_train_begin` waits for that read and
  writes every rank's fragments into the engine's partitions;
- DeepSpeed: `trainer.train()`, and at train begin `deepspeed_load_checkpoint(engine, output_dir)`, the function
  Trainer's own resume calls there (`engine.load_checkpoint` of the newest `global_step*` tag, with the optimizer
  and scheduler states).

`load s` is the work that depends on the checkpoint (ours: the `resume_checkpoint` call plus `on_train_begin`;
DeepSpeed: `deepspeed_load_checkpoint`); `to loaded s` runs from the `resume_checkpoint` call (DeepSpeed: from
`trainer.train()`) until the state is in the engine, so it also holds Trainer's set-up and the engine's creation,
which are the same for both (ours reads the optimizer tier in the background meanwhile). The page cache is warm
for both. Bytes: the store's `step-N` folder against DeepSpeed's `global_stepN` folder (`du`, every rank's files).

Ratios are ours / DeepSpeed (below 1: ours is faster or smaller), measured in the same processes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 64


class _Stop(Exception):
    """Raised at train begin once a resume's state is loaded: the resumed Trainer has done its part."""


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _progress(what: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"PROGRESS {what}", flush=True)


def _quiet() -> None:
    """No dirty pages of an earlier save left, and every rank here (not timed)."""
    import torch.distributed as dist

    os.sync()
    dist.barrier()


def _timed(cb: Any, name: str, log: list[tuple[int, float, float]]) -> None:
    """Record (global_step, start, end) of every call of the callback's `name` hook."""
    inner = getattr(cb, name)

    def hook(a: Any, state: Any, control: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(a, state, control, **kw)
        finally:
            log.append((state.global_step, t0, time.perf_counter()))

    setattr(cb, name, hook)


def _model(args: argparse.Namespace) -> Any:
    from examples import toy

    return toy.tiny_qwen2(seed=0, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                          intermediate_size=args.intermediate or int(2.75 * args.hidden),
                          num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 4))


def _trainer(args: argparse.Namespace, out: Path, max_steps: int, callbacks: list[Any]) -> Any:
    from transformers import Trainer, TrainingArguments

    from examples import toy

    targs = TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=1, gradient_accumulation_steps=1,
        learning_rate=1e-4, save_strategy="no", report_to=[], use_cpu=True, logging_steps=1, seed=42,
        disable_tqdm=True, deepspeed={"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                      "zero_optimization": {"stage": args.stage},
                                      "zero_allow_untested_optimizer": True})
    ds = toy.random_token_dataset(num_examples=64, seq_len=SEQ_LEN, vocab_size=args.vocab, seed=1)
    return Trainer(model=_model(args), args=targs, train_dataset=ds, callbacks=callbacks)


def _callback(args: argparse.Namespace) -> Any:
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig

    return SmartCkptCallback(SmartCkptConfig(base_interval=args.interval,
                                             policy={"stability_window": 8, "overhead_budget": 1.0},
                                             runtime={"memory_tier": args.memory_tier == "true"}))


def _saves(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The training run: our interval saves and DeepSpeed's `save_checkpoint` between them, each timed."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    interval = args.interval
    steps = interval * args.repeats + 1
    cb = _callback(args)
    begins: list[tuple[int, float, float]] = []
    ends: list[tuple[int, float, float]] = []
    _timed(cb, "on_step_begin", begins)
    _timed(cb, "on_step_end", ends)
    ds_saves: list[float] = []

    class Saves(TrainerCallback):
        trainer: Any = None

        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            step = state.global_step
            _progress(f"step {step} ended")
            if step % interval == 0 and step < steps:  # ours: held by the policy, taken at the next step's begin
                assert cb.run is not None and cb.run.pending_save is not None, f"no save decided at step {step}"
                _quiet()
            elif step % interval == interval - 1 and step < steps - 1:  # DeepSpeed's, once our last write committed
                assert cb.run is not None
                cb.run.finish()
                _quiet()
                engine = self.trainer.model_wrapped
                t0 = time.perf_counter()
                engine.save_checkpoint(str(out))  # what Trainer's save under DeepSpeed calls, into its folder
                ds_saves.append(time.perf_counter() - t0)
                _progress(f"DeepSpeed save_checkpoint of step {step}: {ds_saves[-1]:.2f} s (rank 0)")
                dist.barrier()
                if dist.get_rank() == 0:  # only the newest tag is kept (the resumes read it)
                    for old in out.glob("global_step*"):
                        if old.name != f"global_step{engine.global_steps}":
                            shutil.rmtree(old)

    saves = Saves()
    trainer = _trainer(args, out, steps, [cb, saves])
    saves.trainer = trainer
    params = sum(p.numel() for p in trainer.model.parameters())
    _progress(f"{params / 1e6:.1f}M parameters; training {steps} steps")
    trainer.train()
    _progress("training done (the last write committed)")
    assert cb.run is not None
    stall_logged = sum(e.get("smart_ckpt/stall_ms", 0.0) for e in trainer.state.log_history) / 1e3
    events = [e for e in cb.run.events if e.kind.value != "train_end"]
    assert [e.step for e in events] == list(range(interval, steps, interval)), [e.step for e in events]
    saved = {e.step for e in events}
    final = [e.step for e in cb.run.events if e.kind.value == "train_end"]
    _progress("our saves: " + ", ".join(f"step {e.step} {e.staging} {e.blocking_ms:.0f} ms" for e in events)
              + f"; last staging plan: {cb.run.engine.last_plan.reason if cb.run.engine.last_plan else None}")
    result = {"params": params, "ours": [e.blocking_ms / 1e3 for e in events],
              "hook": [t1 - t0 for s, t0, t1 in begins if s in saved], "ds": ds_saves,
              "writes": [(e.write_ms or 0.0) / 1e3 for e in events], "stall_logged": stall_logged,
              "plain_begin": statistics.median(t1 - t0 for s, t0, t1 in begins if s not in saved),
              "plain_end": statistics.median(t1 - t0 for s, t0, t1 in ends if s > 1),
              "first_end": next(t1 - t0 for s, t0, t1 in ends if s == 1),
              "newest": final[-1] if final else max(saved)}
    if dist.get_rank() == 0:
        store_step = next(p for p in (out / "smart_ckpt").rglob(f"step-{result['newest']}") if p.is_dir())
        ds_step = next(out.glob("global_step*"))
        result["sizes"] = {
            "ours": _du(store_step), "ds": _du(ds_step), "ours_step": result["newest"], "ds_tag": ds_step.name,
            "ours_files": {p.name: p.stat().st_size for p in sorted(store_step.iterdir()) if p.is_file()},
            "ds_files": {p.name: p.stat().st_size for p in sorted(ds_step.iterdir()) if p.is_file()}}
    return result


def _resume_ours(args: argparse.Namespace, out: Path, newest: int) -> tuple[float, float, list[float]]:
    """`resume_checkpoint(trainer, "auto")` and `train()` up to train begin.

    Returns (load, to loaded, [the `resume_checkpoint` call, `on_train_begin`, from `train()` to train begin])."""
    from transformers import TrainerCallback

    from hf_dynamic_ckpt import resume_checkpoint

    class Stop(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            raise _Stop

    cb = _callback(args)
    train_begin: list[tuple[int, float, float]] = []
    _timed(cb, "on_train_begin", train_begin)  # reads every rank's fragments into the engine
    trainer = _trainer(args, out, newest + 4, [cb, Stop()])
    _quiet()
    t0 = time.perf_counter()
    folder = resume_checkpoint(trainer, "auto")
    t1 = time.perf_counter()
    with contextlib.suppress(_Stop):
        trainer.train(resume_from_checkpoint=folder)
    assert cb.resumed_from is not None and cb.resumed_from.info.step == newest
    _, b0, b1 = train_begin[0]
    assert cb.run is not None
    cb.run.close()
    return (t1 - t0) + (b1 - b0), b1 - t0, [t1 - t0, b1 - b0, b0 - t1]


def _resume_deepspeed(args: argparse.Namespace, out: Path) -> tuple[float, float, list[float]]:
    """`train()`, and at train begin what Trainer's own resume calls there: (load, to loaded, [set-up])."""
    from transformers import TrainerCallback
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    marks: dict[str, float] = {}

    class Load(TrainerCallback):
        trainer: Any = None

        def on_train_begin(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            marks["load0"] = time.perf_counter()
            deepspeed_load_checkpoint(self.trainer.model_wrapped, str(out), load_module_strict=True)
            marks["load1"] = time.perf_counter()
            raise _Stop

    load = Load()
    trainer = _trainer(args, out, 10**6, [load])
    load.trainer = trainer
    tag = (out / "latest").read_text().strip()
    _quiet()
    t0 = time.perf_counter()
    with contextlib.suppress(_Stop):
        trainer.train()
    assert trainer.model_wrapped.global_steps == int(tag.removeprefix("global_step"))
    return marks["load1"] - marks["load0"], marks["load1"] - t0, [marks["load0"] - t0]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(args.root) / "run"  # Trainer's output_dir: the store is out/smart_ckpt, DeepSpeed's tags beside it
    mine = _saves(args, out)
    gc.collect()
    loads: dict[str, list[tuple[float, float, list[float]]]] = {"ours": [], "ds": []}
    for i in range(args.repeats):
        for mode in ("ours", "ds") if i % 2 == 0 else ("ds", "ours"):
            loads[mode].append(_resume_ours(args, out, mine["newest"]) if mode == "ours" else
                               _resume_deepspeed(args, out))
            gc.collect()
            _progress(f"resume #{i + 1}, {mode}: load {loads[mode][-1][0]:.2f} s, to loaded {loads[mode][-1][1]:.2f} s "
                      f"(rank 0)")
    mine["loads"] = loads
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        def worst(values: list[list[float]]) -> list[float]:  # per save / resume, the max over the ranks
            return [max(vals) for vals in zip(*values, strict=True)]

        result = {"stage": args.stage, "params": mine["params"], "world_size": dist.get_world_size(),
                  "saves": {k: worst([r[k] for r in every]) for k in ("ours", "hook", "ds", "writes")},
                  "loads": {m: {"work": worst([[x[0] for x in r["loads"][m]] for r in every]),
                                "total": worst([[x[1] for x in r["loads"][m]] for r in every]),
                                "parts": [worst([r["loads"][m][i][2] for r in every]) for i in range(args.repeats)]}
                            for m in ("ours", "ds")},
                  **{k: max(r[k] for r in every) for k in ("plain_begin", "plain_end", "first_end")},
                  "stall_logged": [r["stall_logged"] for r in every], "blocking_sum": [sum(r["ours"]) for r in every],
                  "sizes": mine["sizes"]}
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()


def run_stage(args: argparse.Namespace, stage: int, root: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           __file__, "--worker", "--stage", str(stage), "--root", str(root), "--repeats", str(args.repeats),
           "--interval", str(args.interval), "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--heads", str(args.heads), "--vocab", str(args.vocab), "--intermediate", str(args.intermediate),
           "--memory_tier", args.memory_tier]
    start = time.perf_counter()
    lines: list[str] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:  # rank 0's progress, as it comes
            lines.append(line)
            if line.startswith("PROGRESS "):
                print(f"  ZeRO-{stage} {time.perf_counter() - start:6.1f} s: {line[len('PROGRESS '):].rstrip()}",
                      file=sys.stderr, flush=True)
        rc = proc.wait(timeout=3600)
        err.seek(0)
        stderr = err.read()
    results = [line for line in lines if line.startswith("RESULT ")]
    if rc != 0 or not results:
        sys.exit(f"ZeRO-{stage} benchmark failed (rc {rc}):\n{''.join(lines)[-2000:]}\n{stderr[-6000:]}")
    lines = results
    result = json.loads(lines[-1][len("RESULT "):])
    result["job_s"] = time.perf_counter() - start
    return result


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def report(results: list[dict[str, Any]], repeats: int) -> None:
    med = statistics.median
    r0 = results[0]
    print(f"Qwen2 from config, {r0['params'] / 1e6:.1f}M parameters (fp32, full fine-tune, AdamW), "
          f"{r0['world_size']} CPU processes (gloo); max over ranks, median of {repeats}")
    print()
    print("| ZeRO | ours: blocking ms (library) | ours: step_begin hook ms (wall) | DeepSpeed save_checkpoint ms "
          "| ratio (blocking) | ratio (hook) | ours: background write s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        s = r["saves"]
        ours, hook, ds = med(s["ours"]) * 1e3, med(s["hook"]) * 1e3, med(s["ds"]) * 1e3
        print(f"| {r['stage']} | {ours:.0f} | {hook:.0f} | {ds:.0f} | {ours / ds:.3f} | {hook / ds:.3f} "
              f"| {med(s['writes']):.2f} |")
    print()
    print("| ZeRO | load s: ours / DeepSpeed | ratio | to loaded s: ours / DeepSpeed | ratio "
          "| bytes: store step / DeepSpeed tag | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        lo, ld = r["loads"]["ours"], r["loads"]["ds"]
        wo, wd, to, td = med(lo["work"]), med(ld["work"]), med(lo["total"]), med(ld["total"])
        sz = r["sizes"]
        print(f"| {r['stage']} | {wo:.2f} / {wd:.2f} | {wo / wd:.3f} | {to:.2f} / {td:.2f} | {to / td:.3f} "
              f"| {_mib(sz['ours'])} / {_mib(sz['ds'])} | {sz['ours'] / sz['ds']:.3f} |")
    print()
    for r in results:
        s = r["saves"]
        print(f"ZeRO-{r['stage']}: per save (ms) ours {[round(x * 1e3) for x in s['ours']]}, hook "
              f"{[round(x * 1e3) for x in s['hook']]}, DeepSpeed {[round(x * 1e3) for x in s['ds']]}; "
              f"step_begin hook without a save {r['plain_begin'] * 1e3:.1f} ms, step_end hook "
              f"{r['plain_end'] * 1e3:.1f} ms (the first step's, which starts the writer and the "
              f"snapshot buffers' background preparation: {r['first_end'] * 1e3:.0f} ms); "
              f"loads (s) ours {[round(x, 2) for x in r['loads']['ours']['work']]}, "
              f"DeepSpeed {[round(x, 2) for x in r['loads']['ds']['work']]}; store step-{r['sizes']['ours_step']} "
              f"vs {r['sizes']['ds_tag']}; job {r['job_s']:.0f} s")
        print(f"ZeRO-{r['stage']}: smart_ckpt/stall_ms logged by Trainer, summed, per rank (s): "
              f"{[round(x, 3) for x in r['stall_logged']]}; SaveEvent.blocking_ms summed: "
              f"{[round(x, 3) for x in r['blocking_sum']]}")
        rc, tb, setup = (med(x[i] for x in r["loads"]["ours"]["parts"]) for i in range(3))
        ds_setup = med(x[0] for x in r["loads"]["ds"]["parts"])
        print(f"ZeRO-{r['stage']}: our load = resume_checkpoint {rc:.2f} s + on_train_begin {tb:.2f} s; from train() "
              f"to train begin (Trainer's set-up, the engine's creation): ours {setup:.2f} s, DeepSpeed's "
              f"{ds_setup:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind, and resumes of each kind, per stage")
    p.add_argument("--interval", type=int, default=3, help="steps between two saves of one kind")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (0: 2.75 x hidden)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--memory_tier", default="true", choices=["true", "false"],
                   help="the library's memory tier (on by default: a slot in /dev/shm at the budget's cadence)")
    p.add_argument("--root", default=None,
                   help="where the checkpoints go, kept (default: a temporary folder, removed after each stage)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--report", default=None, metavar="JSON", help="print the tables of an earlier --json again")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report(saved["results"], saved["repeats"])
        return
    if args.interval < 2:
        sys.exit("--interval must be at least 2 (DeepSpeed saves between two of ours)")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_deepspeed_") as tmp:
        base = Path(args.root).absolute() if args.root else Path(tmp)
        for stage in (int(s) for s in args.stages.split(",")):
            root = base / f"zero{stage}"
            shutil.rmtree(root, ignore_errors=True)
            print(f"ZeRO-{stage}: {root}", file=sys.stderr, flush=True)
            results.append(run_stage(args, stage, root))
            if not args.root:
                shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "repeats": args.repeats, "results": results},
                                              indent=1))
    report(results, args.repeats)


if __name__ == "__main__":
    main()

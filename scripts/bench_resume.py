"""Resume time: hf_dynamic_ckpt's `resume_checkpoint` vs Trainer's native resume of the same state.

    python scripts/bench_resume.py [--kinds lora,full] [--out bench_out/resume] [--repeats 3]

For each kind (a LoRA adapter on a ~60M Qwen2 built from config, and a full fine-tune of
that model), one preparation run trains 3 steps with BOTH a `SmartCkptCallback` and
Trainer's own `save_steps=3`, so the store's step 3 and `checkpoint-3` hold the same state.
A second preparation run (same seeds, same state) writes a store whose optimizer tier is the
uncompressed, memory-mapped container (`storage_levels.level_1.compression: none`). Then fresh
processes resume step 3, native / ours (zstd L1) / ours (uncompressed L1) alternating, and report:

- `startup`: from just before the process is started to the resume call: Python, torch and
  transformers imports, model construction, Trainer set-up (ours also imports hf_dynamic_ckpt
  and builds the `SmartCkptCallback`). It is ~90 % of `total` and does not depend on how the
  state is stored.
- `resume`: from the `trainer.train(...)` call (ours: from `resume_checkpoint`) to the first
  resumed step, i.e. the part that depends on how the state is loaded: the meaningful ratio.
- `total` = `startup` + `resume` (what the issue literally names: process start to the first
  resumed step).
- `to step end`: from the same start as `resume` to the end of the first resumed step. The
  optimizer tier is applied right before the first update (its decode overlaps the first
  forward and backward), so `resume` alone would flatter ours: this column counts the whole
  first step for both.

- `fresh`: the same child without any resume (`trainer.train()` from step 0, no callback of
  ours), from the `train` call to its first step's begin / end: what Trainer's start costs with
  nothing to load (its `accelerator.free_memory()` runs a full `gc.collect()`, ~0.4 s with
  torch and transformers imported on this machine, paid by every run). `over fresh` =
  `resume` - fresh's, and `to step end over fresh` likewise: the work a resume adds.
- `peak MiB`: the child's peak resident memory (`ru_maxrss`) when its first step begins: the model,
  Trainer's set-up and whatever the resume held at once (a second copy of the weights, the
  optimizer state read ahead).

The table prints ratios ours / native (lower is better): medians over `--repeats` runs; page
cache warm for all; Python bytecode cached under `<out>/pycache` (as installed packages have it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREP_STEPS = 3


def build(kind: str):  # type: ignore[no-untyped-def]
    from examples import toy

    # Default ~60M parameters: 32k vocab (untied input/output embeddings = 33M) + 8 layers of
    # width 512. BENCH_HIDDEN / BENCH_LAYERS (set by --hidden / --layers) scale it up.
    hidden = int(os.environ.get("BENCH_HIDDEN", "512"))
    layers = int(os.environ.get("BENCH_LAYERS", "8"))
    model = toy.tiny_qwen2(seed=0, vocab_size=32000, hidden_size=hidden, num_layers=layers,
                           intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=4)
    if kind == "lora":
        model = toy.lora(model, r=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    ds = toy.random_token_dataset(num_examples=64, seq_len=64, vocab_size=32000, seed=1)
    return model, ds


def trainer_for(kind: str, out: Path, *, native_save: bool, smart: bool, max_steps: int, marks: dict,  # type: ignore[no-untyped-def]
                l1_none: bool = False):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig

    class FirstStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            marks.setdefault("first_step", time.time())
            marks.setdefault("peak_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            marks.setdefault("first_step_end", time.time())

    model, ds = build(kind)
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=1e-4,
        save_strategy="steps" if native_save else "no", save_steps=PREP_STEPS, report_to=[], use_cpu=True,
        logging_steps=100, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    callbacks = [FirstStep()]
    if smart:
        extra = {}
        if l1_none:
            extra = {"storage_levels": {"level_1": {"compression": "none"}}}
        callbacks.insert(0, SmartCkptCallback(SmartCkptConfig(root=str(out / store_dir(l1_none)),
                                                              base_interval=PREP_STEPS, **extra,
                                                              policy={"overhead_budget": 1.0})))
    return Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)


def store_dir(l1_none: bool) -> str:
    return "smart_ckpt_l1none" if l1_none else "smart_ckpt"


def child(kind: str, mode: str, out: Path, result: Path) -> None:
    import torch

    torch.set_num_threads(1)
    marks: dict[str, float] = {}
    if mode in ("prepare", "prepare_none"):
        none = mode == "prepare_none"
        trainer_for(kind, out, native_save=not none, smart=True, max_steps=PREP_STEPS, marks=marks,
                    l1_none=none).train()
        return
    from hf_dynamic_ckpt import resume_checkpoint

    trainer = trainer_for(kind, out, native_save=False, smart=mode.startswith("ours"),
                          max_steps=1 if mode == "fresh" else PREP_STEPS + 1, marks=marks, l1_none=mode == "ours_none")
    marks["resume_start"] = time.time()
    if mode == "fresh":
        trainer.train()
        result.write_text(json.dumps({**marks, "global_step": trainer.state.global_step}))
        return
    if mode.startswith("ours"):
        path = resume_checkpoint(trainer, f"step:{PREP_STEPS}")
    else:
        path = str(out / "trainer" / f"checkpoint-{PREP_STEPS}")
    trainer.train(resume_from_checkpoint=path)
    result.write_text(json.dumps({**marks, "global_step": trainer.state.global_step}))


def run_child(kind: str, mode: str, out: Path) -> dict[str, float]:
    result = out / f"{mode}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           # Bytecode cached as in any installed environment (the preparation runs fill the cache), even
           # where PYTHONDONTWRITEBYTECODE is set: else every child compiles each module it imports,
           # the ones a resume imports lazily included.
           "PYTHONPYCACHEPREFIX": str(out.parent / "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", kind, mode, str(out), str(result)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}/{mode} failed:\n{proc.stderr[-4000:]}")
    if mode.startswith("prepare"):
        return {"seconds": time.time() - start}
    marks = json.loads(result.read_text())
    assert marks["global_step"] == (1 if mode == "fresh" else PREP_STEPS + 1), marks
    return {"total": marks["first_step"] - start, "resume": marks["first_step"] - marks["resume_start"],
            "startup": marks["resume_start"] - start, "to_end": marks["first_step_end"] - marks["resume_start"],
            "peak_mib": marks["peak_mib"]}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="lora,full")
    p.add_argument("--out", default="bench_out/resume")
    p.add_argument("--repeats", type=int, default=1, help="resume runs per mode (medians are reported)")
    p.add_argument("--hidden", type=int, default=512, help="model width (512: ~60M parameters)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers")
    p.add_argument("--child", nargs=4, metavar=("KIND", "MODE", "OUT", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, mode, out, result = args.child
        child(kind, mode, Path(out), Path(result))
        return
    # The children build the model from these (they get no --hidden / --layers of their own).
    os.environ["BENCH_HIDDEN"], os.environ["BENCH_LAYERS"] = str(args.hidden), str(args.layers)
    rows = []
    for kind in args.kinds.split(","):
        out = Path(args.out).absolute() / kind
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        run_child(kind, "prepare", out)
        run_child(kind, "prepare_none", out)
        modes = ("fresh", "native", "ours", "ours_none")
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for mode in modes:
                runs[mode].append(run_child(kind, mode, out))
        keys = ("total", "resume", "startup", "to_end", "peak_mib")
        med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in keys} for m in modes}
        size = {"native": dir_bytes(out / "trainer" / f"checkpoint-{PREP_STEPS}"),
                "ours": dir_bytes(out / store_dir(False) / "default" / f"step-{PREP_STEPS}"),
                "ours_none": dir_bytes(out / store_dir(True) / "default" / f"step-{PREP_STEPS}")}
        rows.append((kind, med, size))
    print(f"{'kind':<6} {'mode':<26} {'startup s':>10} {'resume s':>9} {'ratio':>6} {'total s':>8} {'ratio':>6} "
          f"{'to step end s':>13} {'ratio':>6} {'over fresh s':>12} {'ratio':>6} {'end over fresh s':>16} {'ratio':>6} "
          f"{'MB':>7} {'peak MiB':>9} {'ratio':>6}")
    names = {"fresh": "fresh start (no resume)", "native": "native (Trainer)", "ours": "ours, L1 zstd (default)",
             "ours_none": "ours, L1 none (mmap)"}
    for kind, med, size in rows:
        base, fresh = med["native"], med["fresh"]
        for m, v in med.items():
            if m == "fresh":
                print(f"{kind:<6} {names[m]:<26} {v['startup']:>10.2f} {v['resume']:>9.2f} {'':>6} {v['total']:>8.2f} "
                      f"{'':>6} {v['to_end']:>13.2f}{'':>95}{v['peak_mib']:>9.0f}")
                continue
            over, end_over = v["resume"] - fresh["resume"], v["to_end"] - fresh["to_end"]
            base_over, base_end = base["resume"] - fresh["resume"], base["to_end"] - fresh["to_end"]
            print(f"{kind:<6} {names[m]:<26} {v['startup']:>10.2f} {v['resume']:>9.2f} "
                  f"{v['resume'] / base['resume']:>6.2f} "
                  f"{v['total']:>8.2f} {v['total'] / base['total']:>6.2f} {v['to_end']:>13.2f} "
                  f"{v['to_end'] / base['to_end']:>6.2f} {over:>12.2f} {over / base_over:>6.2f} {end_over:>16.2f} "
                  f"{end_over / base_end:>6.2f} {size[m] / 1e6:>7.1f} {v['peak_mib']:>9.0f} "
                  f"{v['peak_mib'] / base['peak_mib']:>6.2f}")


if __name__ == "__main__":
    main()

"""Resume time: hf_dynamic_ckpt's `resume_checkpoint` vs Trainer's native resume of the same state.

    python scripts/bench_resume.py [--kinds lora,full] [--out bench_out/resume]

For each kind (a LoRA adapter on a ~60M Qwen2 built from config, and a full fine-tune of
that model), one preparation run trains 3 steps with BOTH a `SmartCkptCallback` and
Trainer's own `save_steps=3`, so the store's step 3 and `checkpoint-3` hold the same state.
Then two fresh processes resume it, one each way, and report:

- `total`: wall time from just before the process is started to the first resumed training
  step (Python + torch import, model construction, resume, data skip);
- `resume`: from the `trainer.train(...)` call (ours: from `resume_checkpoint`) to the first
  resumed step, i.e. the part that depends on how the state is loaded.

The table prints ratios ours / native (lower is better): medians over `--repeats` runs,
native and ours alternating; page cache warm for both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREP_STEPS = 3


def build(kind: str):  # type: ignore[no-untyped-def]
    from hf_dynamic_ckpt import toy

    # ~60M parameters: 32k vocab (untied input/output embeddings = 33M) + 8 layers of width 512.
    model = toy.tiny_qwen2(seed=0, vocab_size=32000, hidden_size=512, num_layers=8, intermediate_size=1536,
                           num_attention_heads=8, num_key_value_heads=4)
    if kind == "lora":
        model = toy.lora(model, r=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    ds = toy.random_token_dataset(num_examples=64, seq_len=64, vocab_size=32000, seed=1)
    return model, ds


def trainer_for(kind: str, out: Path, *, native_save: bool, smart: bool, max_steps: int, marks: dict):  # type: ignore[no-untyped-def]
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig

    class FirstStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            marks.setdefault("first_step", time.time())

    model, ds = build(kind)
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=1e-4,
        save_strategy="steps" if native_save else "no", save_steps=PREP_STEPS, report_to=[], use_cpu=True,
        logging_steps=100, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    callbacks = [FirstStep()]
    if smart:
        callbacks.insert(0, SmartCkptCallback(SmartCkptConfig(root=str(out / "smart_ckpt"), base_interval=PREP_STEPS,
                                                               overhead_budget=1.0)))
    return Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)


def child(kind: str, mode: str, out: Path, result: Path) -> None:
    import torch

    torch.set_num_threads(1)
    marks: dict[str, float] = {}
    if mode == "prepare":
        trainer_for(kind, out, native_save=True, smart=True, max_steps=PREP_STEPS, marks=marks).train()
        return
    from hf_dynamic_ckpt import resume_checkpoint

    trainer = trainer_for(kind, out, native_save=False, smart=(mode == "ours"), max_steps=PREP_STEPS + 1, marks=marks)
    marks["resume_start"] = time.time()
    if mode == "ours":
        path = resume_checkpoint(trainer, f"step:{PREP_STEPS}")
    else:
        path = str(out / "trainer" / f"checkpoint-{PREP_STEPS}")
    trainer.train(resume_from_checkpoint=path)
    result.write_text(json.dumps({**marks, "global_step": trainer.state.global_step}))


def run_child(kind: str, mode: str, out: Path) -> dict[str, float]:
    result = out / f"{mode}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", kind, mode, str(out), str(result)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}/{mode} failed:\n{proc.stderr[-4000:]}")
    if mode == "prepare":
        return {"seconds": time.time() - start}
    marks = json.loads(result.read_text())
    assert marks["global_step"] == PREP_STEPS + 1, marks
    return {"total": marks["first_step"] - start, "resume": marks["first_step"] - marks["resume_start"]}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="lora,full")
    p.add_argument("--out", default="bench_out/resume")
    p.add_argument("--repeats", type=int, default=1, help="resume runs per mode (medians are reported)")
    p.add_argument("--child", nargs=4, metavar=("KIND", "MODE", "OUT", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, mode, out, result = args.child
        child(kind, mode, Path(out), Path(result))
        return
    rows = []
    for kind in args.kinds.split(","):
        out = Path(args.out).absolute() / kind
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        prep = run_child(kind, "prepare", out)
        runs: dict[str, list[dict[str, float]]] = {"native": [], "ours": []}
        for _ in range(args.repeats):
            for mode in ("native", "ours"):
                runs[mode].append(run_child(kind, mode, out))
        native, ours = ({k: statistics.median(r[k] for r in runs[m]) for k in ("total", "resume")}
                        for m in ("native", "ours"))
        native_bytes = dir_bytes(out / "trainer" / f"checkpoint-{PREP_STEPS}")
        ours_bytes = dir_bytes(out / "smart_ckpt" / "default" / f"step-{PREP_STEPS}")
        rows.append((kind, native, ours, native_bytes, ours_bytes, prep["seconds"]))
    print(f"{'kind':<6} {'native total s':>15} {'ours total s':>13} {'ratio':>6} {'native resume s':>16} "
          f"{'ours resume s':>14} {'ratio':>6} {'native MB':>10} {'ours MB':>8}")
    for kind, native, ours, nb, ob, _ in rows:
        print(f"{kind:<6} {native['total']:>15.2f} {ours['total']:>13.2f} {ours['total'] / native['total']:>6.2f} "
              f"{native['resume']:>16.2f} {ours['resume']:>14.2f} {ours['resume'] / native['resume']:>6.2f} "
              f"{nb / 1e6:>10.1f} {ob / 1e6:>8.1f}")


if __name__ == "__main__":
    main()

"""How many modules of hf_dynamic_ckpt one save and one resume pass through, and how big each part is.

    PYTHONPATH=$PWD .venv/bin/python scripts/trace_paths.py [PACKAGE_DIR] [--json]

PACKAGE_DIR (default: the package next to this script) is both the tree whose lines are counted and
the copy the measurements import (its parent is put first on PYTHONPATH). About a minute on 2 cores.

- Lines: files and lines (`wc -l`) of the `*.py` files of each subpackage, the top-level modules
  grouped as `(top level)`.
- Calls are recorded with `sys.setprofile` and `threading.setprofile` (threads started by the
  measured code count too): a "call" of a *function* (not a module or class body) whose
  `f_globals["__name__"]` is in the package. A call *belongs to* a path when some package function
  on its stack, itself included, is never called in the path's baseline: the path's own code and
  every package module it calls into count; work the baseline does as well (per-step probes and
  policy, callback wiring) does not.
- Save: a Trainer run (tiny LoRA Qwen2, 4 steps, `SmartCkptConfig(base_interval=3,
  engine="sync")`: the synchronous engine, so the whole save runs in the profiled process)
  recorded over steps 3 and 4: the save is decided at the end of step 3 and committed before
  step 4 ends. Baseline: the same window of the same run with `base_interval=10**6` (no save).
  `save: N` counts the modules of the calls that belong to the save.
- Resume: `resume_checkpoint(trainer, "auto")` on that store (newest: the train-end save of
  step 4), then `trainer.train()` to the end of its first step (step 5). Baseline: a run that
  never resumed, recorded the same way (`resume_checkpoint` on an empty store, then `train()` to
  the end of step 5), so what every run does by then (sampling, statistics) is not counted.
  `resume: N` counts every module called inside `resume_checkpoint` (its entry point, shared with
  a fresh start: this includes creating the run's checkpointer, which it does first) plus the
  modules of the calls of `train()` that belong to the resume.
- `steps (no save): N`: for scale, every module the baseline window of the save touches.

Each measurement runs in a fresh interpreter (its first save / first resume, as in a real run);
the train-end saves (`on_train_end`) fall outside every window. Only the public API is used.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

PKG = "hf_dynamic_ckpt"
SAVE_STEP = 3
STEPS = SAVE_STEP + 1  # the save runs end with the step their window ends with
NEVER = 10**6
# (module called, the package functions on its stack, innermost first)
Trace = set[tuple[str, tuple[CodeType, ...]]]


# ---------------------------------------------------------------------------- lines
def count_lines(pkg: Path) -> dict[str, tuple[int, int]]:
    """`{part: (files, lines)}` of the `*.py` files under `pkg`, sorted, plus `total`."""
    files: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).parts
        part = f"{rel[0]}/" if len(rel) > 1 else "(top level)"
        files[part] += 1
        lines[part] += path.read_bytes().count(b"\n")
    out = {part: (files[part], lines[part]) for part in sorted(files)}
    out["total"] = (sum(files.values()), sum(lines.values()))
    return out


# ---------------------------------------------------------------------------- calls (child process)
class Hook:
    """The profile function: while `into` is set, each call of a package function is added to it."""

    def __init__(self) -> None:
        self.into: Trace | None = None

    @staticmethod
    def _ours(frame: FrameType) -> bool:
        name = frame.f_globals.get("__name__", "")
        function = bool(frame.f_code.co_flags & inspect.CO_NEWLOCALS)  # not a module or class body
        return function and (name == PKG or name.startswith(PKG + "."))

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        into = self.into
        if into is None or event != "call" or not self._ours(frame):
            return
        stack: list[CodeType] = []
        f: FrameType | None = frame
        while f is not None:
            if self._ours(f):
                stack.append(f.f_code)
            f = f.f_back
        into.add((frame.f_globals["__name__"], tuple(stack)))


HOOK = Hook()


def modules(trace: Trace, baseline: Trace | None = None) -> list[str]:
    """The modules of `trace`; with a `baseline`, only those of the calls that belong to the path."""
    if baseline is None:
        return sorted({m for m, _ in trace})
    known = {stack[0] for _, stack in baseline}
    return sorted({m for m, stack in trace if any(code not in known for code in stack)})


def run(out: str, base_interval: int, max_steps: int, trace: Trace, start: int | None, stop: int,
        resume: Trace | None = None) -> int:
    """Train with a `SmartCkptCallback`; record into `trace` from the end of step `start` (None: from the
    `train()` call) to the end of step `stop`, then stop training. `resume`: record `resume_checkpoint`
    there first. Returns the last step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint

    class Window(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == start:
                HOOK.into = trace
            if state.global_step == stop:
                HOOK.into = None
                control.should_training_stop = True

    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    config = SmartCkptConfig(base_interval=base_interval, engine="sync")
    trainer = Trainer(model=toy.lora(toy.tiny_qwen2(seed=0)), args=args,
                      train_dataset=toy.random_token_dataset(num_examples=64),
                      callbacks=[SmartCkptCallback(config), Window()])
    HOOK.into = resume
    folder = resume_checkpoint(trainer, "auto") if resume is not None else None
    HOOK.into = trace if start is None else None
    trainer.train(resume_from_checkpoint=folder)
    HOOK.into = None
    return int(trainer.state.global_step)


def measure(kind: str, tmp: str, pkg: Path) -> dict[str, list[str]]:
    """One measurement (`save` or `resume`), in this (fresh) interpreter, of the package `pkg`."""
    import logging

    import torch
    import transformers

    import hf_dynamic_ckpt
    from hf_dynamic_ckpt import CheckpointStore

    if Path(hf_dynamic_ckpt.__file__).parent != pkg:
        sys.exit(f"imported {hf_dynamic_ckpt.__file__}, not the package at {pkg}")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    logging.getLogger(PKG).setLevel(logging.ERROR)
    sys.setprofile(HOOK)
    threading.setprofile(HOOK)
    saved_dir = os.path.join(tmp, "saved")
    if kind == "save":
        saved: Trace = set()
        steps: Trace = set()
        run(saved_dir, SAVE_STEP, STEPS, saved, SAVE_STEP - 1, STEPS)
        run(os.path.join(tmp, "steps"), NEVER, STEPS, steps, SAVE_STEP - 1, STEPS)
        sys.setprofile(None)
        threading.setprofile(None)
        found = [sorted(i.step for i in CheckpointStore(os.path.join(d, "smart_ckpt"), read_only=True).list())
                 for d in (saved_dir, os.path.join(tmp, "steps"))]
        if found != [[SAVE_STEP, STEPS], [STEPS]]:
            sys.exit(f"expected the saves [{SAVE_STEP}, {STEPS}] and [{STEPS}] (train end), found {found}")
        result = {"save": modules(saved, steps), "steps (no save)": modules(steps)}
    else:
        call: Trace = set()
        first: Trace = set()
        fresh: Trace = set()
        last = run(saved_dir, NEVER, STEPS + 3, first, None, STEPS + 1, resume=call)
        run(os.path.join(tmp, "fresh"), NEVER, STEPS + 3, fresh, None, STEPS + 1, resume=fresh)
        sys.setprofile(None)
        threading.setprofile(None)
        if last != STEPS + 1:
            sys.exit(f"the resumed run should have stopped at step {STEPS + 1}, not {last}")
        result = {"resume": sorted(set(modules(call)) | set(modules(first, fresh)))}
    return result


# ---------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", type=Path, default=Path(__file__).resolve().parents[1] / PKG)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "TMP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    pkg = args.package.resolve()
    if args.child:
        kind, tmp = args.child
        Path(tmp, f"{kind}.json").write_text(json.dumps(measure(kind, tmp, pkg)))
        return
    lines = count_lines(pkg)
    path = os.pathsep.join(p for p in (str(pkg.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    paths: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="trace_paths_") as tmp:
        for kind in ("save", "resume"):
            done = subprocess.run([sys.executable, __file__, str(pkg), "--child", kind, tmp], env=env,
                                  capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{kind} measurement failed:\n{done.stdout}{done.stderr}")
            paths.update(json.loads(Path(tmp, f"{kind}.json").read_text()))
    if args.json:
        counts = {k: {"files": f, "lines": n} for k, (f, n) in lines.items()}
        mods = {k: {"count": len(v), "modules": v} for k, v in paths.items()}
        print(json.dumps({"package": str(pkg), "lines": counts, **mods}, indent=1))
        return
    print(f"{pkg}\n{'part':<16}{'files':>6}{'lines':>8}")
    for part, (f, n) in lines.items():
        print(f"{part:<16}{f:>6}{n:>8}")
    print()
    for name in ("save", "resume", "steps (no save)"):
        print(f"{name}: {len(paths[name])} modules")
    for name in ("save", "resume"):
        print(f"\n{name} path:")
        print("\n".join(f"  {m}" for m in paths[name]))


if __name__ == "__main__":
    main()

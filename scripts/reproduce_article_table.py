"""The design article's results table, reproduced side by side on a job anyone can rerun (CPU).

The same fine-tuning job - a tiny Qwen2 (from config) on real text (`examples.toy`:
stdlib docstrings, BPE), once with a LoRA adapter and once as a full fine-tune, `--steps`
optimizer steps with `Trainer` - runs under:

  (a) Trainer's own checkpointing: `save_strategy="steps"`, `save_steps=--save_steps`, resumed
      with `trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))`;
  (b) `SmartCkptCallback` (`save_strategy="no"`), resumed with `resume_checkpoint(trainer, "auto")`,
      with `SmartCkptConfig(base_interval=--save_steps)`: the user's interval kept as the calm
      interval (the migration from `save_steps`), everything else at its default (`--stability_window N`
      shortens the loss window and capture cooldown, 100 steps by default, for runs this short). With
      `--smart_interval mtbf` it gets no `base_interval` and derives the interval itself (Young/Daly
      within the overhead budget), with `mtbf_hours` = this job's real failure rate (what an operator
      knows from their cluster; measured from run (a)'s step time). With the memory tier on (the
      default) that rate is not what the interval uses: the crashes here are process kills on a live
      node, which the slots cover, so the interval follows `policy.node_mtbf_hours` (default 168 h,
      left at it: the user who drops `save_steps`); `mtbf_hours` counts only with `--memory_tier
      false`.

Both see the same injected anomalies (a loss x30 for 3 steps, a batch of random tokens, an
lr x10 for 10 steps, at onsets drawn from `--seed`) and the same crashes: SIGKILL at the end of
steps drawn from `--seed`; each crash restarts the job, which resumes. Rows, per mode:
checkpoints written (to disk; for (b) with the memory tier, the slots a restart persisted,
even if retention removed them later), storage written and kept, mean blocking save stall, mean restore time,
throughput (tokens per second of `train()`, recomputed steps included), anomaly capture (a
checkpoint of a step in [onset - K, onset - 1] kept at the end; for (b) a healthy one, which
`auto` may resume from), and work lost to crashes (steps recomputed). The article's numbers
(Qwen2-7B, 8x A100, `docs/SEED.md`) are printed next to them.

Usage: nice -n 10 python scripts/reproduce_article_table.py [--steps 300] [--out bench_out/article]
(recorded in docs/benchmarks.md: `--steps 120 --save_steps 20 --crash_count 2`, with and without
`--stability_window 20`, about 14 minutes each on 2 loaded cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

K = 5
ARTICLE = {  # (fixed 2000 steps, dynamic + tiered), Qwen2-7B on 8x A100 80 GB
    "checkpoints written": ("150", "87"), "storage written": ("13.2 TB", "4.8 TB"),
    "storage kept": ("13.2 TB", "4.8 TB"),
    "mean blocking save stall": ("19.6 s", "0.82 s"), "mean restore time": ("19.6 s", "3.2 s"),
    "throughput (tokens/s)": ("1240", "1310"), "anomaly capture": ("68 %", "89 %"), "work lost to crashes": ("-", "-"),
}


# ---------------------------------------------------------------------- one training process
def child(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint
    from transformers.utils import logging as hf_logging

    from examples import toy
    from hf_dynamic_ckpt import SmartCkptCallback, SmartCkptConfig, resume_checkpoint

    hf_logging.set_verbosity_error()
    out = Path(a.out)
    log = open(out / "log.jsonl", "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - the process ends with it

    def emit(**row: Any) -> None:
        log.write(json.dumps({"attempt": a.attempt, **row}) + "\n")

    texts = toy.text_corpus(max_chars=300_000)
    tok = toy.train_tokenizer(texts, vocab_size=1024)
    ds = toy.lm_dataset(tok, texts, seq_len=a.seq_len)  # every block (~1700 of 64 tokens)
    model = toy.tiny_qwen2(seed=0, vocab_size=len(tok), hidden_size=a.hidden, num_layers=2, dropout=0.05)
    if a.model == "lora":
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                     modules_to_save=["lm_head"]))
    anomalies = {int(s): k for s, k in (x.split(":") for x in a.anomalies.split(","))}
    crashes = [int(s) for s in a.crashes.split(",") if s]
    state = {"step": 0}

    def active(kind: str, span: int) -> bool:
        return any(k == kind and s <= state["step"] + 1 < s + span for s, k in anomalies.items())

    inner = model.base_model.model if a.model == "lora" else model

    def poison_loss(module: torch.nn.Module, args: Any, output: Any) -> Any:
        if module.training and active("loss_x30", 3):
            output.loss = output.loss * 30.0
        return output

    def bad_batch(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if module.training and active("bad_batch", 1) and "input_ids" in kwargs:
            g = torch.Generator().manual_seed(state["step"])
            ids = torch.randint(0, len(tok), kwargs["input_ids"].shape, generator=g)
            kwargs = {**kwargs, "input_ids": ids, "labels": ids}
        return args, kwargs

    inner.register_forward_hook(poison_loss)
    inner.register_forward_pre_hook(bad_batch, with_kwargs=True)
    timers: dict[str, float] = {"restore_s": 0.0}

    def timed(obj: Any, name: str, key: str) -> None:
        original = getattr(obj, name)

        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kw)
            finally:
                timers[key] = timers.get(key, 0.0) + time.perf_counter() - t0
        setattr(obj, name, wrapper)

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.logged: set[int] = set()

        def on_train_begin(self, args: Any, st: Any, control: Any, lr_scheduler: Any = None, **kw: Any) -> None:
            # The lr surge is part of the schedule (a misconfigured schedule), so a checkpoint's scheduler
            # and optimizer state hold exactly what the run used: update u uses lambda(u - 1).
            surge = [s for s, k in anomalies.items() if k == "lr_x10"]

            def wrap(f: Any) -> Any:
                return lambda i: f(i) * (10.0 if any(s <= i + 1 < s + 10 for s in surge) else 1.0)

            sched = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate may wrap it
            sched.lr_lambdas = [wrap(f) for f in sched.lr_lambdas]

        def on_step_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            state["step"] = st.global_step
            if timers.pop("resumed", 0.0):  # the first step of a resumed attempt: everything restored by now
                # (b): the optimizer tier applied at train begin counts; attaching the probes does not.
                extra = timers.get("train_begin_s", 0.0) - timers.get("attach_s", 0.0)
                emit(event="restored", step=st.global_step, restore_s=timers["restore_s"] + timers["prepare_s"] + extra)

        def on_step_end(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            emit(event="step", step=st.global_step, t=time.perf_counter())
            self.saves()
            if st.global_step in crashes and not (out / f"crashed-{st.global_step}").exists():
                (out / f"crashed-{st.global_step}").touch()
                tier = smart.run.memory if smart is not None and smart.run is not None else None
                emit(event="crash", step=st.global_step, **({} if tier is None or not tier.on else {"memory": {
                    "every": tier.every, "slots": tier.saves, "skipped": tier.skipped, "last_slot": tier.last_step}}))
                log.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        def on_save(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            path = Path(args.output_dir) / f"checkpoint-{st.global_step}"
            emit(event="save", step=st.global_step, bytes=_du(path), blocking_ms=1000 * timers.pop("save_s", 0.0),
                 kind="save_steps")

        def on_train_end(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            self.saves()

        def saves(self) -> None:  # (b): every settled save of the smart checkpointer, once
            ck = smart.run if smart is not None else None
            for e in ck.events if ck is not None else []:
                if e.bytes is not None and id(e) not in self.logged:
                    self.logged.add(id(e))
                    emit(event="save", step=e.step, bytes=e.bytes, blocking_ms=e.blocking_ms, kind=e.kind.value)

    smart = None
    common = dict(output_dir=str(out / "trainer"), max_steps=a.steps, per_device_train_batch_size=a.batch,
                  learning_rate=a.lr, warmup_steps=10, lr_scheduler_type="cosine", report_to=[], use_cpu=True,
                  logging_steps=50, seed=0, disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0)
    callbacks: list[Any] = [Probe()]
    if a.mode == "fixed":
        args = TrainingArguments(save_strategy="steps", save_steps=a.save_steps, **common)  # type: ignore[arg-type]
    else:
        args = TrainingArguments(save_strategy="no", **common)  # type: ignore[arg-type]
        short = {} if a.stability_window is None else {"stability_window": a.stability_window}
        runtime = {"memory_tier": a.memory_tier == "true"}
        smart = SmartCkptCallback(SmartCkptConfig(policy={**short, "mtbf_hours": a.mtbf_hours}, runtime=runtime)
                                  if a.smart_interval == "mtbf"
                                  else SmartCkptConfig(base_interval=a.save_steps, policy=short, runtime=runtime))
        callbacks.insert(0, smart)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
    for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state"):
        timed(trainer, name, "restore_s")
    timed(trainer, "_save_checkpoint", "save_s")
    if smart is not None:  # store and writer start-up are not restore work: open them first
        ck = smart.get_run(args)
        timed(smart, "on_train_begin", "train_begin_s")
        timed(ck, "attach", "attach_s")  # probes and sources: a fresh start does it too
    t0 = time.perf_counter()
    if a.mode == "fixed":
        resume = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
    else:
        resume = resume_checkpoint(trainer, "auto")
    timers["prepare_s"] = time.perf_counter() - t0
    timers["resumed"] = float(resume is not None)
    start = int(Path(resume).name.split("-")[-1]) if resume is not None and a.mode == "fixed" else (
        smart.resumed_from.info.step if smart is not None and smart.resumed_from is not None else 0)
    loaded = smart.resumed_from if smart is not None else None  # (b) may resume from a slot it persisted just now
    emit(event="start", resume_from=start if resume is not None else None, t=time.perf_counter(),
         resume_bytes=loaded.info.bytes if loaded is not None else None)
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    emit(event="end", train_s=time.perf_counter() - t0, step=trainer.state.global_step)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ---------------------------------------------------------------------- the orchestrating parent
def run_job(a: argparse.Namespace, mode: str, model: str, out: Path, *, crashes: list[int], anomalies: dict[int, str],
            mtbf_hours: float) -> list[dict[str, Any]]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--model", model, "--out", str(out),
           "--steps", str(a.steps), "--save_steps", str(a.save_steps), "--batch", str(a.batch),
           "--seq_len", str(a.seq_len), "--smart_interval", a.smart_interval, "--hidden", str(a.hidden),
           "--lr", str(a.lr), "--mtbf_hours", repr(mtbf_hours),
           *([] if a.stability_window is None else ["--stability_window", str(a.stability_window)]),
           "--memory_tier", a.memory_tier,
           "--crashes", ",".join(map(str, crashes)), "--anomalies", ",".join(f"{s}:{k}" for s, k in anomalies.items())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    for attempt in range(len(crashes) + 2):
        proc = subprocess.run([*cmd, "--attempt", str(attempt)], env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        if proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"{mode}/{model} attempt {attempt} failed (rc {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    return rows


def summarize(rows: list[dict[str, Any]], out: Path, mode: str, anomalies: dict[int, str], tokens_per_step: int,
              ) -> dict[str, Any]:
    saves = [r for r in rows if r["event"] == "save"]
    ends = [r for r in rows if r["event"] == "end"]
    starts = {r["attempt"]: r for r in rows if r["event"] == "start"}
    steps_by_attempt: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["event"] == "step":
            steps_by_attempt.setdefault(r["attempt"], []).append(r)
    train_s = 0.0
    for attempt, st in steps_by_attempt.items():
        end = next((e for e in ends if e["attempt"] == attempt), None)
        train_s += end["train_s"] if end is not None else st[-1]["t"] - starts[attempt]["t"]
    executed = sum(len(v) for v in steps_by_attempt.values())
    lost = 0
    crashes = [r for r in rows if r["event"] == "crash"]
    for c in crashes:
        nxt = starts.get(c["attempt"] + 1)
        lost += c["step"] - ((nxt["resume_from"] or 0) if nxt is not None else 0)
    if mode == "fixed":
        kept = {int(p.name.split("-")[1]): True for p in (out / "trainer").glob("checkpoint-*")}
        kept_bytes = sum(_du(p) for p in (out / "trainer").glob("checkpoint-*"))
    else:
        from hf_dynamic_ckpt.store import CheckpointStore

        store = CheckpointStore(out / "trainer" / "smart_ckpt", cleanup=False)
        infos = store.list(include_unhealthy=True)
        kept = {i.step: i.healthy and not getattr(i, "abandoned", False) for i in infos}
        store.close()
        kept_bytes = _du(out / "trainer" / "smart_ckpt")
        for r in starts.values():  # a restored slot is persisted to disk first: a disk checkpoint (retention may
            # have removed it by the end), unless that step was on disk already
            if r["resume_from"] is not None and not any(s["step"] == r["resume_from"] and s["attempt"] < r["attempt"]
                                                        for s in saves):
                saves.append({"attempt": r["attempt"], "step": r["resume_from"], "bytes": r.get("resume_bytes"),
                              "blocking_ms": None, "kind": "persisted_slot"})
        logged = {s["step"] for s in saves}
        saves += [{"step": i.step, "bytes": i.bytes, "blocking_ms": None} for i in infos if i.step not in logged]
    captured = [any(ok and onset - K <= s <= onset - 1 for s, ok in kept.items()) for onset in anomalies]
    stalls = [s["blocking_ms"] for s in saves if s.get("blocking_ms") is not None]
    restores = [r["restore_s"] for r in rows if r["event"] == "restored"]
    return {"checkpoints written": len(saves), "storage written": sum(s["bytes"] or 0 for s in saves),
            "storage kept": kept_bytes, "mean blocking save stall": sum(stalls) / max(1, len(stalls)) / 1000.0,
            "mean restore time": sum(restores) / max(1, len(restores)) if restores else None,
            "throughput (tokens/s)": executed * tokens_per_step / train_s,
            "anomaly capture": (sum(captured), len(captured)),
            "work lost to crashes": lost, "crashes": len(crashes), "steps executed": executed,
            "train_s": train_s}


def fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key.startswith("storage"):
        return f"{v / 2**20:.1f} MiB"
    if key in ("mean blocking save stall", "mean restore time"):
        return f"{1000 * v:.0f} ms"
    if key == "throughput (tokens/s)":
        return f"{v:.0f}"
    if key == "anomaly capture":
        return f"{100 * v[0] / max(1, v[1]):.0f} % ({v[0]}/{v[1]})"
    if key == "work lost to crashes":
        return f"{v} steps"
    return str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="fixed")
    ap.add_argument("--model", default="lora")
    ap.add_argument("--attempt", type=int, default=0)
    ap.add_argument("--crashes", default="")
    ap.add_argument("--anomalies", default="")
    ap.add_argument("--mtbf_hours", type=float, default=24.0)
    ap.add_argument("--out", default="bench_out/article")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save_steps", type=int, default=25)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--crash_count", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--models", default="lora,full")
    ap.add_argument("--stability_window", type=int, default=None,
                    help="(b)'s stability_window (also its capture cooldown); default: the library's 100, "
                         "sized for runs of thousands of steps")
    ap.add_argument("--memory_tier", default="true", choices=["true", "false"],
                    help="(b)'s runtime.memory_tier (on by default: the newest state in host memory every step)")
    ap.add_argument("--smart_interval", default="save_steps", choices=["save_steps", "mtbf"],
                    help="(b)'s calm interval: base_interval=--save_steps, or derived by the library (from "
                         "node_mtbf_hours with the memory tier on, from the job's failure rate with it off)")
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    rng = random.Random(a.seed)
    kinds = ["loss_x30", "bad_batch", "lr_x10"]
    rng.shuffle(kinds)
    span = (a.steps - 40) // len(kinds)  # one anomaly in each third of the run (after 20 steps)
    anomalies = {20 + i * span + rng.randint(0, span // 2): k for i, k in enumerate(kinds)}
    crashes = sorted(rng.sample(range(30, a.steps - 10), a.crash_count))
    tokens = a.batch * a.seq_len
    print(f"job: tiny Qwen2 (hidden {a.hidden}, 2 layers, vocab 1024) on stdlib docstrings, {a.steps} steps of "
          f"{tokens} tokens; anomalies {anomalies}; SIGKILL after steps {crashes}; (a) save_steps={a.save_steps}; "
          f"(b) stability_window={a.stability_window or 'default'}",
          flush=True)
    results: dict[str, dict[str, Any]] = {}
    for model in a.models.split(","):
        out = Path(a.out) / model
        t0 = time.perf_counter()
        fixed_rows = run_job(a, "fixed", model, out / "fixed", crashes=crashes, anomalies=anomalies, mtbf_hours=24.0)
        results[f"{model} (a) save_steps"] = fixed = summarize(fixed_rows, out / "fixed", "fixed", anomalies, tokens)
        step_s = fixed["train_s"] / fixed["steps executed"]
        mtbf_h = step_s * a.steps / (a.crash_count + 1) / 3600.0  # the job's real failure rate
        smart_rows = run_job(a, "smart", model, out / "smart", crashes=crashes, anomalies=anomalies, mtbf_hours=mtbf_h)
        results[f"{model} (b) smart ({a.smart_interval})"] = summarize(smart_rows, out / "smart", "smart", anomalies,
                                                                         tokens)
        print(f"{model}: {time.perf_counter() - t0:.0f} s (step {1000 * step_s:.0f} ms, mtbf_hours={mtbf_h:.5f}); "
              f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    header = ["row", "article fixed 2000", "article dynamic", *results]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key, (art_a, art_b) in ARTICLE.items():
        print("| " + " | ".join([key, art_a, art_b, *(fmt(key, r[key]) for r in results.values())]) + " |")
    print("| crashes / steps executed | - | - | " + " | ".join(f"{r['crashes']} / {r['steps executed']}"
                                                           for r in results.values()) + " |")


if __name__ == "__main__":
    main()

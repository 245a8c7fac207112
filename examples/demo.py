"""The demo: a LoRA fine-tune hits bad data, rolls back past it, is SIGKILLed, and resumes bit-exactly.

    python -m examples.demo --output_dir demo_out        # (what `make demo` runs)

CPU only, a few minutes, nothing downloaded. Three training processes run the same
script (`--child`): an uninterrupted reference run; the run itself, which meets a shard of
bad batches at `--anomaly_at` (their loss is multiplied: an explosion) and which this
process kills with SIGKILL once it passes `--kill_at`; and the restart of the same command
with `--resume_from_smart_checkpoint auto`. With `on_anomaly: rollback` the run does not
train through the explosion: it returns in place to the state captured before it and goes
on with the next data. The report lists every save (step, reason, bytes, blocking time),
the rollbacks, the restore point chosen after the kill, and whether the resumed losses equal
the reference run's to the bit; `<output_dir>/timeline.png` shows it all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_dynamic_ckpt.constants import DEFAULT_TASK_ID, TIMELINE_NAME

if TYPE_CHECKING:
    from hf_dynamic_ckpt.store import CheckpointInfo

SESSIONS_NAME = "demo_sessions.jsonl"
"""In a run's output directory: one line per training process, in start order, with the session id that the
manifests of its checkpoints record (`CheckpointInfo.lineage`)."""


@dataclass
class DemoArguments:
    """Arguments of one training process of the demo (parsed with `HfArgumentParser`)."""

    output_dir: str = field(default="demo_out", metadata={"help": "Trainer output directory of this run."})
    max_steps: int = field(default=90, metadata={"help": "Optimizer steps of the run."})
    anomaly_at: int = field(default=35, metadata={
        "help": "First batch (optimizer step of data) whose loss is multiplied by --anomaly_factor: the bad data, "
                "whatever step reads it."})
    anomaly_steps: int = field(default=4, metadata={"help": "Consecutive poisoned batches (a bad data shard)."})
    anomaly_factor: float = field(default=30.0, metadata={"help": "Loss multiplier of the poisoned step."})
    seed: int = field(default=0)


def train(demo: DemoArguments, smart: Any) -> None:
    """One training process: tiny Qwen2 + LoRA on real text with `SmartCkptCallback`."""
    import torch

    torch.set_num_threads(1)
    import logging

    from transformers import PrinterCallback, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from examples import toy
    from hf_dynamic_ckpt.integrations.trainer import SmartCkptCallback, resume_checkpoint

    # Only the checkpointer's own lines, as a user with `--log_level info` sees them: one per save
    # and the "resumed from" line (Trainer's other INFO output and its log dicts stay quiet).
    hf_logging.set_verbosity_error()
    hf_logging.get_logger("transformers.integrations.smart_ckpt").setLevel(logging.INFO)
    logging.basicConfig(level=logging.WARNING, format="  [child] %(levelname)s %(name)s: %(message)s")
    texts = toy.text_corpus(max_chars=300_000)
    tok = toy.train_tokenizer(texts, vocab_size=1024)
    ds = toy.lm_dataset(tok, texts, seq_len=64, num_examples=640)
    from peft import LoraConfig, get_peft_model

    base = toy.tiny_qwen2(seed=demo.seed, vocab_size=len(tok), hidden_size=96, num_layers=2, dropout=0.05)
    # A random base model learns little through LoRA alone: the output head is trained too
    # (PEFT `modules_to_save`, part of the adapter), so the loss falls visibly in 90 steps.
    lora_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                             modules_to_save=["lm_head"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(demo.seed)
        model = get_peft_model(base, lora_config)

    def poison(module: torch.nn.Module, args: Any, output: Any) -> Any:
        # Runs before the library's loss probe (registered earlier): the spike is what training sees. The bad data
        # are batches of the stream (counted by the callback, rollbacks and resumes included), not step numbers.
        if module.training and demo.anomaly_at <= callback.data_steps + 1 < demo.anomaly_at + demo.anomaly_steps:
            output.loss = output.loss * demo.anomaly_factor
        return output

    inner: torch.nn.Module = model.base_model.model  # type: ignore[assignment]
    inner.register_forward_hook(poison)
    # Short windows so a 90-step run warms the statistics up; the rest is SmartCkptConfig's defaults.
    # The trained output head makes gradient norms noisy (x10 surges): only a larger surge is an anomaly.
    # on_anomaly=rollback (unless --smart_ckpt_on_anomaly says otherwise): a confirmed explosion returns the run to
    # the state captured before it. Two bad steps in a row confirm one (rollback_patience=2): a shard of four bad
    # batches then costs two rollbacks.
    config = smart.to_config().replace(base_interval=10, keep_last=4,
                                       on_anomaly=smart.smart_ckpt_on_anomaly or "rollback",
                                       policy={"stability_window": 20, "risk_smoothing": 4, "grad_surge_ratio": 15.0,
                                               "rollback_patience": 2})
    args = TrainingArguments(
        output_dir=demo.output_dir, max_steps=demo.max_steps, per_device_train_batch_size=8, learning_rate=1e-2,
        warmup_steps=5, lr_scheduler_type="cosine", save_strategy="no", report_to=[], use_cpu=True,
        logging_steps=10, seed=demo.seed, disable_tqdm=True, dataloader_num_workers=0,
    )
    callback = SmartCkptCallback(config)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.remove_callback(PrinterCallback)
    resume = resume_checkpoint(trainer, smart.resume_from_smart_checkpoint)
    # The report tells this process's checkpoints from another's by the session their manifests record.
    Path(demo.output_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(demo.output_dir) / SESSIONS_NAME, "a", encoding="utf-8") as f:
        f.write(json.dumps({"session": callback.get_run(args).session_id,
                            "resume": smart.resume_from_smart_checkpoint}) + "\n")
    trainer.train(resume_from_checkpoint=resume)


# ---------------------------------------------------------------------- the orchestrating parent
def _child_cmd(output_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "examples.demo", "--child", "--output_dir", str(output_dir), *extra]


def _timeline(store: Path) -> list[dict[str, Any]]:
    path = store / DEFAULT_TASK_ID / TIMELINE_NAME
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # the line the kill cut short
            rows.append(json.loads(line))
    return rows


def _run(cmd: list[str], env: dict[str, str], *, kill_at: int | None = None,
         store: Path | None = None) -> tuple[int, int | None]:
    """Run a child; with `kill_at`, SIGKILL it as soon as its timeline passes that step."""
    proc = subprocess.Popen(cmd, env=env)
    killed_after = None
    if kill_at is not None and store is not None:
        while proc.poll() is None:
            steps = [r["step"] for r in _timeline(store) if "step" in r]
            if steps and steps[-1] >= kill_at:
                os.kill(proc.pid, signal.SIGKILL)
                killed_after = steps[-1]
                break
            time.sleep(0.02)
    return proc.wait(), killed_after


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True)
class SaveRow:
    """One line of the report's table: a save the step log records, or a checkpoint only the store has.

    Args:
        step (`int`): the step of the saved state.
        at (`int`, *optional*): the step during which it was taken; `None`: the step log does not list it
            (the save at the end of training comes after the last step's row).
        reason (`str`): why it was taken.
        nbytes (`int`, *optional*): its size in the store now; `None`: not in the store.
        blocking_ms (`float`, *optional*): what training waited for it; `None`: not recorded.
        status (`str`): what became of it, read from the store (`save_table`).
    """

    step: int
    at: int | None
    reason: str
    nbytes: int | None
    blocking_ms: float | None
    status: str


@dataclass(frozen=True)
class ProcessSaves:
    """The saves of one training process of the run (processes in start order).

    Args:
        session (`str`, *optional*): its session id, as its checkpoints' manifests record it; `None`: unknown.
        resumed_from (`int`, *optional*): the step it resumed from; `None`: a fresh start.
        rows (`list[SaveRow]`): its saves, in the order it took them.
    """

    session: str | None
    resumed_from: int | None
    rows: list[SaveRow]


def _split_processes(events: list[dict[str, Any]]) -> list[tuple[int | None, list[dict[str, Any]]]]:
    """The step rows of each process (a `resume` event starts the next one), with the step it resumed from."""
    parts: list[tuple[int | None, list[dict[str, Any]]]] = [(None, [])]
    for r in events:
        if r.get("event") == "resume":
            parts.append((r.get("step"), []))
        elif "event" not in r and "step" in r:
            parts[-1][1].append(r)
    return parts


def _by_abandonment(removal: dict[str, Any] | None) -> bool:
    """Whether a removal record is the store's removal of an abandoned checkpoint (else a retention rule's)."""
    return removal is not None and str(removal.get("rule", "")).startswith("abandoned timeline")


def _gone(removal: dict[str, Any]) -> str:
    return "removed later (abandoned timeline)" if _by_abandonment(removal) else "pruned later (retention)"


def _status(step: int, info: CheckpointInfo | None, *, restore: int | None, killed: bool,
            removal: dict[str, Any] | None) -> str:
    """What became of one save of a process, whose checkpoint in the store (same session and step) is `info`."""
    if info is not None:
        words = ["the restore point" if step == restore else "committed"]
        words += [w for w, on in (("pinned", info.pinned), ("unhealthy", not info.healthy),
                                  ("abandoned (a later run went back before it)", info.abandoned)) if on]
        return ", ".join(words)
    if step == restore:  # the restart loaded it: it was committed
        return "the restore point, " + (_gone(removal) if removal is not None else "no longer in the store")
    if killed and restore is not None and step > restore and not _by_abandonment(removal):
        # `auto` resumes from the newest healthy checkpoint: one of this process past it was never committed (an
        # unhealthy one would be in the store, abandoned, or recorded as removed with the abandoned-timeline rule).
        return "not committed (killed)"
    if removal is not None and (killed or not _by_abandonment(removal)):  # the last run's timeline is the current one
        return "committed, " + _gone(removal)
    return "not in the store"


def save_table(events: list[dict[str, Any]], sessions: list[str], infos: list[CheckpointInfo],
               removed: dict[int, dict[str, Any]]) -> list[ProcessSaves]:
    """The report's table of saves: each save of the step log matched to its checkpoint in the store by identity.

    A save of a process is its checkpoint when the store holds that step *from that process's session*
    (`CheckpointInfo.lineage`); step numbers alone do not tell a killed run's save from the restart's save of the
    same step. Checkpoints of a session that its step log does not list (the save at train end) are added.

    Args:
        events (`list[dict]`): the task's step log (`timeline.jsonl` rows, events included), in order.
        sessions (`list[str]`): the session id of each process, in start order (`SESSIONS_NAME`).
        infos (`list[CheckpointInfo]`): the store's checkpoints, unhealthy and abandoned ones included.
        removed (`dict[int, dict]`): what retention removed, by step (`CheckpointStore.removed`).

    Returns:
        `list[ProcessSaves]`: one per process, in start order.

    Example:
        ```python
        >>> with CheckpointStore(run_store, cleanup=False, read_only=True) as store:
        ...     table = save_table(_timeline(run_store), ["4b2d393de652", "407f88bbdabc"],
        ...                        store.list(include_unhealthy=True, include_abandoned=True), store.removed())
        >>> [(r.step, r.status) for r in table[0].rows][-1]
        (64, 'not committed (killed)')
        ```
    """
    by_identity = {(i.lineage.session, i.step): i for i in infos if i.lineage is not None}
    parts = _split_processes(events)
    table = []
    for n, (resumed_from, rows) in enumerate(parts):
        session = sessions[n] if n < len(sessions) else None
        restore = parts[n + 1][0] if n + 1 < len(parts) else None  # the next process resumed from this one
        saves = [(r["step"], s) for r in rows for s in r.get("saves", [])]
        last = {s["step"]: k for k, (_, s) in enumerate(saves)}
        out = []
        for k, (at, s) in enumerate(saves):
            if last[s["step"]] != k:  # saved again later by the same process (after a rollback): the store has that
                status, info = "replaced by a later save of the same step", None
            else:
                info = by_identity.get((session, s["step"])) if session is not None else None
                status = _status(s["step"], info, restore=restore, killed=n + 1 < len(parts),
                                 removal=removed.get(s["step"]))
            out.append(SaveRow(step=s["step"], at=at, reason=s.get("reason", ""),
                               nbytes=info.bytes if info is not None else None, blocking_ms=s.get("blocking_ms"),
                               status=status))
        unlisted = sorted((i for (owner, step), i in by_identity.items() if owner == session and step not in last),
                          key=lambda i: i.step)
        out += [SaveRow(step=i.step, at=None, reason=i.reason, nbytes=i.bytes, blocking_ms=None,
                        status=_status(i.step, i, restore=restore, killed=False, removal=None)) for i in unlisted]
        table.append(ProcessSaves(session=session, resumed_from=resumed_from, rows=out))
    return table


def format_table(table: list[ProcessSaves], *, killed_after: int | None) -> list[str]:
    """The lines of the report's table of saves (`save_table`), a resume line before each restarted process."""
    lines = ["Saves taken by the run (a restart is a new process: its saves follow the resume line)",
             f"  {'step':>5}  {'at':>4}  {'reason':<64} {'bytes':>10} {'blocking':>10}  status"]
    for n, part in enumerate(table):
        if n > 0:
            lines.append(f"  ---- SIGKILL after step {killed_after}; restart resumed from step {part.resumed_from} "
                         "----")
        for row in part.rows:
            at = "-" if row.at is None else str(row.at)
            blocking = "-" if row.blocking_ms is None else f"{row.blocking_ms:.1f}ms"
            lines.append(f"  {row.step:>5}  {at:>4}  {row.reason[:64]:<64} {_fmt_bytes(row.nbytes):>10} "
                         f"{blocking:>10}  {row.status}")
    return lines


def _sessions(run_dir: Path) -> list[str]:
    path = run_dir / SESSIONS_NAME
    if not path.is_file():
        return []
    return [json.loads(line)["session"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def report(out: Path, *, killed_after: int | None, durations: dict[str, float]) -> bool:
    """Print the demo report; returns whether the resumed losses equal the reference's."""
    from hf_dynamic_ckpt.run.record import plot_timeline
    from hf_dynamic_ckpt.store import CheckpointStore

    run_store, ref_store = out / "run" / "smart_ckpt", out / "reference" / "smart_ckpt"
    rows = _timeline(run_store)
    ref_loss = {r["step"]: r["loss"] for r in _timeline(ref_store) if "step" in r}
    with CheckpointStore(run_store, cleanup=False, read_only=True) as store:
        infos = store.list(include_unhealthy=True, include_abandoned=True)
        table = save_table(rows, _sessions(out / "run"), infos, store.removed())
    print("\n" + "\n".join(format_table(table, killed_after=killed_after)))
    rollbacks = [(k, r) for k, r in enumerate(rows) if r.get("event") == "rollback"]
    if rollbacks:
        print("\nRollbacks (the bad batches were not trained on; the steps past each restore point were abandoned)")
        for k, r in rollbacks:
            loss_at = next((x["loss"] for x in reversed(rows[:k]) if x.get("step") == r["to_step"] and "loss" in x),
                           None)
            print(f"  step {r['from_step']} -> step {r['to_step']}  ({r['reason']})"
                  + (f"; loss at the restore point {loss_at:.3f}" if isinstance(loss_at, float) else ""))
    resumed = _split_processes(rows)[-1][1] if len(table) > 1 else []
    same = [r["step"] for r in resumed if r["step"] in ref_loss and r["loss"] == ref_loss[r["step"]]]
    differ = [r["step"] for r in resumed if r["step"] in ref_loss and r["loss"] != ref_loss[r["step"]]]
    kept = [i for i in infos if not i.abandoned]
    print(f"\nStore {run_store}: {len(kept)} checkpoint(s) kept, {_fmt_bytes(sum(i.bytes for i in kept))} on disk "
          "(LoRA: adapter + optimizer + RNG; the base model is never written)")
    resume_step = table[-1].resumed_from if len(table) > 1 else None
    if resume_step is not None:
        why = next((f" ({r.reason})" for r in reversed(table[-2].rows) if r.step == resume_step), "")
        print(f"Restore point chosen by 'auto': step {resume_step}{why}; "
              f"{(killed_after or resume_step) - resume_step} step(s) recomputed after the crash")
    exact = bool(resumed) and not differ and len(same) == len(resumed)
    verdict = "EXACT (bit-identical)" if exact else f"DIFFERENT at steps {differ[:10]}"
    print(f"Resumed losses vs the uninterrupted reference: {len(same)}/{len(resumed)} steps equal -> {verdict}")
    print("Wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in durations.items()))
    png = plot_timeline(run_store, output=out / "timeline.png",
                        title="demo: tiny Qwen2 + LoRA, bad data rolled back, SIGKILL, resume",
                        risk_threshold=0.68)
    print(f"Timeline: {png}   (also: hf-dynamic-ckpt plot {run_store})")
    return exact


def main(argv: list[str] | None = None) -> int:
    """Entry point: `--child` trains; otherwise run the whole demo and print the report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" in argv:
        argv.remove("--child")
        from transformers import HfArgumentParser

        from hf_dynamic_ckpt.config import SmartCkptArguments

        parser = HfArgumentParser((DemoArguments, SmartCkptArguments))  # type: ignore[arg-type]
        demo, smart = parser.parse_args_into_dataclasses(args=argv)
        train(demo, smart)
        return 0
    p = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default="demo_out")
    p.add_argument("--max_steps", type=int, default=90)
    p.add_argument("--anomaly_at", type=int, default=35)
    p.add_argument("--kill_at", type=int, default=67)
    args = p.parse_args(argv)
    out = Path(args.output_dir).absolute()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    common = ["--max_steps", str(args.max_steps), "--anomaly_at", str(args.anomaly_at)]
    print(f"hf_dynamic_ckpt demo -> {out}\n  tiny Qwen2 (from config) + LoRA r=8, real text (stdlib docstrings, BPE), "
          f"{args.max_steps} steps; 4 bad batches (loss x30) from batch {args.anomaly_at}, rolled back; SIGKILL after "
          f"step {args.kill_at}")
    durations: dict[str, float] = {}
    t0 = time.perf_counter()
    print("[1/3] reference run, uninterrupted ...", flush=True)
    rc, _ = _run(_child_cmd(out / "reference", common), env)
    durations["reference"] = time.perf_counter() - t0
    if rc != 0:
        print(f"reference run failed (exit code {rc})", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    print(f"[2/3] training with SmartCkptCallback; will SIGKILL it after step {args.kill_at} ...", flush=True)
    rc, killed_after = _run(_child_cmd(out / "run", common), env, kill_at=args.kill_at,
                            store=out / "run" / "smart_ckpt")
    durations["killed run"] = time.perf_counter() - t0
    if killed_after is None:
        print(f"the run ended (exit code {rc}) before step {args.kill_at}; nothing to resume", file=sys.stderr)
        return 1
    print(f"      killed (SIGKILL) after step {killed_after}")
    t0 = time.perf_counter()
    print("[3/3] the same command again with --resume_from_smart_checkpoint auto ...", flush=True)
    rc, _ = _run(_child_cmd(out / "run", [*common, "--resume_from_smart_checkpoint", "auto"]), env)
    durations["resumed run"] = time.perf_counter() - t0
    if rc != 0:
        print(f"resumed run failed (exit code {rc})", file=sys.stderr)
        return 1
    return 0 if report(out, killed_after=killed_after, durations=durations) else 1


if __name__ == "__main__":
    sys.exit(main())

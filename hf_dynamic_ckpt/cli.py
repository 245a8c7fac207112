"""`hf-dynamic-ckpt` (or `python -m hf_dynamic_ckpt.cli`): inspect, check, manage and export a store (``--help``).
Exit codes: 0 success, 1 problems found (`verify`), 2 bad usage, no store, or a reference that names nothing. Commands
that only look write nothing (`verify` records changed statuses in the catalog); `pin`, `unpin`, `rm` and `gc` take
the task's writer lock: they refuse to run beside a training run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .constants import BLOBS_DIR, CATALOG_NAME, DEFAULT_TASK_ID, KEY_FILES, VERSION
from .errors import CheckpointNotFoundError, ConfigError, DynamicCkptError
from .run.record import human_size, plot_timeline, read_rollbacks
from .store import CheckpointInfo, CheckpointStore, find_root, task_dirs
from .store.catalog import Catalog

OPTIONS_ENV = "HF_DYNAMIC_CKPT_STORAGE_OPTIONS"
"""JSON object of fsspec storage options for a URL ROOT (e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``)."""


def _options() -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        if isinstance(value := json.loads(os.environ.get(OPTIONS_ENV) or "{}"), dict):
            return value
    raise ConfigError(f"{OPTIONS_ENV} is not a JSON object; set it to one such as "
                      '{"endpoint_url": "http://127.0.0.1:9000"}.')


def _where(args: argparse.Namespace, *, one: bool = False) -> tuple[Path | str, list[str]]:
    """ROOT's store directory or URL, and its tasks: the one asked for, else every one (with `one`: the only one)."""
    root = args.root if "://" in args.root else find_root(args.root)
    if getattr(args, "task", None) is not None:
        return root, [args.task]
    if isinstance(root, Path):
        found = [p.name for p in task_dirs(root)]
    else:
        import fsspec

        (fs, path), entries = fsspec.core.url_to_fs(root, **_options()), []
        with contextlib.suppress(FileNotFoundError):
            entries = fs.ls(path, detail=False)
        found = sorted({n for e in entries if (n := str(e).rstrip("/").rsplit("/")[-1]) and n[0] != "."} - {BLOBS_DIR})
    if one and len(found) > 1:
        raise ConfigError(f"{root} holds several tasks ({', '.join(found)}); choose one with --task.")
    return root, found or [DEFAULT_TASK_ID]


def _open(args: argparse.Namespace, root: Path | str, task: str, mode: str = "read") -> CheckpointStore:
    """The task's store: ``read`` writes nothing, ``write`` takes the writer lock at once or fails, ``gc`` lets `gc`
    take it, ``reindex`` rebuilds the catalog (a URL's: this machine's cache; the others use a temporary one)."""
    if isinstance(root, str):
        args.cache = args.cache or (None if mode == "reindex" else tempfile.mkdtemp(prefix="hf-dynamic-ckpt-"))
    elif mode in ("write", "gc") and not (root / task).is_dir():
        raise ConfigError(f"task {task!r} has no folder under {root}; available: "
                          f"{', '.join(p.name for p in task_dirs(root))}.")
    return CheckpointStore(root, task_id=task, cleanup=mode == "write", read_only=mode == "read", **(
        {"storage_options": _options(), "cache_dir": args.cache} if isinstance(root, str) else {"lock_wait_s": 0.0}))


def _slot_steps(store: CheckpointStore, root: Path | str) -> list[int]:
    """The steps in the memory tier's slots of a local store's task (read only; none when unreadable)."""
    from .store.slots import open_slots

    with contextlib.suppress(Exception):
        if isinstance(root, Path) and (slots := open_slots(store, read_only=True)) is not None:
            with slots:
                return sorted(i.step for i in slots.list(include_unhealthy=True, include_abandoned=True))
    return []


def _fmt(v: Any) -> str:
    """A value as the commands print it: floats to 4 significant digits, booleans as yes / no, `None` as ``-``."""
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "-"}[v]
    return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)


def _time(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(rows: list[list[Any]], indent: str = "") -> None:
    rows = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _print_json(obj: Any) -> int:
    print(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False, default=str))
    return 0


def _status(i: CheckpointInfo) -> str:
    return "abandoned" if i.abandoned and i.status == "ok" else i.status


def _ls(args: argparse.Namespace) -> int:
    root, tasks = _where(args)
    infos: list[CheckpointInfo] = []
    removed, rollbacks, in_memory = [], [], []
    for task in tasks:
        with _open(args, root, task) as store:
            infos += store.list(include_unhealthy=True, include_abandoned=args.all)
            removed += [(task, r) for _, r in sorted(store.removed().items())]
            if steps := _slot_steps(store, root):
                in_memory.append(f"  {task}: step {', '.join(map(str, steps))}")
        rollbacks += [(task, r) for r in read_rollbacks(root, task)] if isinstance(root, Path) else []  # its step log
    if args.json:
        return _print_json([{"task": i.task_id, "step": i.step, "reason": i.reason, "tiers": sorted(i.tiers),
                             "bytes": i.bytes, "loss": i.loss, "healthy": i.healthy, "pinned": i.pinned,
                             "abandoned": i.abandoned, "status": i.status, "saved_at": i.save_time, "path": i.path,
                             "recovery_cost_ms": i.recovery_cost_ms, "world_size": i.world_size} for i in infos])
    if in_memory:
        print("in host memory (the memory tier's slots, docs/memory_tier.md): a live run's, or a killed run's that the "
              "next start (or `hf-dynamic-ckpt gc`) persists:", *in_memory, sep="\n")
    if not infos:
        print(f"no checkpoints under {root}" + (f" for task {args.task!r}" if args.task else ""))
        return 0
    _table([["TASK", "STEP", "REASON", "TIERS", "PROCS", "SIZE", "LOSS", "HEALTHY", "PINNED", "STATUS"], *(
        [i.task_id, i.step, i.reason, ",".join(sorted(i.tiers)) or None, i.world_size, human_size(i.bytes), i.loss,
         i.healthy, i.pinned, _status(i)] for i in infos)])
    if pinned := sorted({i.reason or "-" for i in infos if i.pinned}):
        print(f"pinned ({', '.join(pinned)}): kept whatever retention says until unpinned (`hf-dynamic-ckpt unpin ROOT "
              "step:N`); a save_state checkpoint is unpinned once Accelerate rotates its folder away. The others are "
              "kept by the run's retention (keep_last, log-spaced history; Accelerate's total_limit with the state "
              "hooks).")
    if removed:
        more = "" if args.all or len(removed) <= 3 else f"; the last 3 of {len(removed)} (`--all` lists every one)"
        print(f"removed by retention{more}, each with the rule that removed it:")  # the rules the store recorded
        for task, r in removed if args.all else removed[-3:]:
            only = "" if "weights" in (tiers := r.get("tiers") or []) else f" ({', '.join(tiers)} only)"
            print(f"  {task}: step {r.get('step')}{only}: {r.get('rule')}")
        print("  (to keep every checkpoint: train with keep_last: null and storage_levels.level_N.retention_days: "
              "null, or pin it)")
    if rollbacks:
        print("rollbacks (the steps past each restore point were abandoned; `--all` lists their checkpoints):")
        for task, r in rollbacks:
            when = f" at {_time(float(r['time']))}" if isinstance(r.get("time"), int | float) else ""
            print(f"  {task}: step {r.get('from_step')} -> step {r.get('to_step')}{when} ({r.get('reason')})")
    return 0


def _show(args: argparse.Namespace) -> int:
    root, (task,) = _where(args, one=True)
    with _open(args, root, task) as store:
        info = store.resolve(args.ref)
        m = store.load(info, tiers=()).manifest  # its checksum verified
    if args.json:
        return _print_json(m)
    print(f"checkpoint   {info.path}\ntask / step  {info.task_id} / {m.get('step')} (epoch {_fmt(m.get('epoch'))})\n"
          f"reason       {m.get('reason')}\nsaved at     {_time(float(m.get('created_at', 0.0)))}\n"
          f"tiers        {', '.join(m.get('tiers', [])) or '-'}\nhealthy      {_fmt(info.healthy)}    "
          f"pinned {_fmt(info.pinned)}    status {_status(info)}\n"
          f"world size   {m.get('world_size')}    format version {m.get('format_version')}")
    if lineage := m.get("lineage") or {}:
        parent = lineage.get("parent_step")
        print(f"lineage      timeline {lineage.get('timeline')}, session {lineage.get('session')}, "
              + (f"resumed from step {parent}" if parent is not None else "fresh start"))
    blobs = [int(b.get("size", 0)) for b in (m.get("blobs") or {}).values()]
    print(f"size         {human_size(int(m.get('bytes', 0)))} in the directory"
          + (f" + {human_size(sum(blobs))} shared blobs ({len(blobs)} tensors)" if blobs else "")
          + f"\nrecovery     ~{_fmt(m.get('recovery_cost_ms'))} ms (estimate)\nfiles:")
    _table([["NAME", "TIER", "RANK", "SIZE", "CHECKSUM"], *([name, e.get("tier"), e.get("rank"),
            human_size(int(e.get("size", 0))), str(e.get("checksum"))[:23]]
            for name, e in sorted(m.get(KEY_FILES, {}).items()))], indent="  ")
    if signals := m.get("signals") or {}:
        print("signals:     " + ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(signals.items())))
    if debug := m.get("debug_info") or []:
        keys = sorted({k for d in debug for k in d}, key=lambda k: (k != "step", k))
        print("debug_info (last steps):")
        _table([keys, *([d.get(k) for k in keys] for d in debug)], indent="  ")
    if versions := m.get("versions") or {}:
        print("versions:    " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    return 0


def _verify(args: argparse.Namespace) -> int:
    if args.ref is not None and args.all:
        raise ConfigError("give either REF or --all, not both.")
    root, tasks = _where(args, one=args.ref is not None)
    changed: dict[tuple[str, int], str] = {}  # the statuses verify found otherwise than the catalog
    bad = gone = 0
    with contextlib.ExitStack() as stack:
        targets = []
        for task in tasks:
            store = stack.enter_context(_open(args, root, task))
            infos = ([store.resolve(args.ref)] if args.ref is not None else  # no REF: every one, abandoned too
                     sorted(store.list(include_unhealthy=True, include_abandoned=True), key=lambda i: i.step))
            targets += [(store, i) for i in infos]
        if not targets:
            print(f"no checkpoints under {root}")
            return 0
        for n, (store, info) in enumerate(targets, 1):
            label, total, tty = f"{info.task_id}/step-{info.step}", len(targets), sys.stderr.isatty()
            if total == 1:
                print(f"verifying {label} ({human_size(info.bytes)}) ...", file=sys.stderr)
            try:
                problems = store.verify(info)
            except CheckpointNotFoundError:
                problems = None
            if total > 1:  # a counter: redrawn in place on a terminal, one line per checkpoint otherwise
                text = f"verify [{'#' * (24 * n // total):.<24}] {n}/{total} {label}"
                print("\r" + text.ljust(100)[:100] if tty else text, end="\n" if n == total or not tty else "",
                      file=sys.stderr, flush=True)
            if problems is None:
                gone += 1
                print(f"GONE {label} (deleted while verifying, e.g. by retention; not a problem)")
                continue
            if (status := "corrupt" if problems else "ok") != info.status:
                changed[info.task_id, info.step] = status
            bad += bool(problems)
            print(f"FAIL {label}" if problems else f"OK   {label}", *(f"  - {p}" for p in problems), sep="\n")
    if changed and isinstance(root, Path) and (root / CATALOG_NAME).is_file():  # a later `ls` shows them
        with contextlib.suppress(OSError, sqlite3.Error), contextlib.closing(Catalog(root / CATALOG_NAME)) as catalog:
            for (task, step), status in changed.items():
                catalog.set_status(task, step, status)
    checked = len(targets) - gone
    print(f"{checked - bad} of {checked} checkpoint(s) intact" + (f", {bad} with problems" if bad else "")
          + (f"; {gone} deleted during the scan" if gone else ""))
    return 1 if bad else 0


def _reindex(args: argparse.Namespace) -> int:
    root, tasks = _where(args)
    infos: list[CheckpointInfo] = []
    for task in tasks:
        with _open(args, root, task, "reindex") as store:
            store.reindex()
            infos += store.list(include_unhealthy=True, include_abandoned=True)
    damaged = sum(i.status != "ok" for i in infos)
    print(f"reindexed {root}: {len(infos)} checkpoint(s)" + (f", {damaged} with a damaged manifest" if damaged else ""))
    return 0


def _plot(args: argparse.Namespace) -> int:
    root, tasks = _where(args)
    print(f"wrote {plot_timeline(root, task_id=tasks[0], output=args.output)}")
    return 0


def _pin(args: argparse.Namespace) -> int:
    root, (task,) = _where(args, one=True)
    with _open(args, root, task, "write") as store:
        info = store.unpin(args.ref) if args.command == "unpin" else store.pin(args.ref)
    print(f"{args.command}ned {info.task_id}/step-{info.step}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    root, (task,) = _where(args, one=True)
    with _open(args, root, task, "write") as store:
        for info in [store.resolve(ref) for ref in args.refs]:
            if info.pinned and not args.force:
                raise ConfigError(f"step {info.step} is pinned; `hf-dynamic-ckpt unpin` it first or pass --force.")
            store.delete(info, force=args.force)
            print(f"removed step {info.step} ({human_size(info.bytes)})")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from .store.slots import adopt_newer

    root, (task,) = _where(args, one=True)
    persisted: int | None = None
    with _open(args, root, task, "read" if args.dry_run else "gc") as store:
        report = store.gc(dry_run=args.dry_run)
        slots = _slot_steps(store, root)
        if slots and not args.dry_run:  # the writer lock is ours: the run that wrote them is gone
            persisted = adopt_newer(store)
    if args.json:
        return _print_json({**dataclasses.asdict(report), "dry_run": args.dry_run})
    verb = "would remove" if args.dry_run else "removed"
    for step in report.removed:
        print(f"{verb} step {step}" + (" (abandoned timeline)" if step in report.abandoned else ""))
    for name in report.temp_dirs:
        print(f"{verb} leftover {name}")
    if report.blobs:
        print(f"{verb} {len(report.blobs)} unused blob(s)")
    for why in report.kept:
        print(f"kept: {why}")
    if slots:
        verb = ("would persist what is newer than the disk of" if args.dry_run
                else f"persisted step {persisted} from" if persisted is not None else "removed")
        print(f"{verb} the memory slots of steps {', '.join(map(str, slots))}")
    print(f"{'would free' if args.dry_run else 'freed'} {human_size(report.bytes_freed)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import export_step

    out, step, skipped = export_step(args.root, args.ref, args.out, format=args.format, base=args.base,
                                     task_id=args.task, overwrite=args.overwrite)
    print(*skipped, f"exported step {step} ({args.ref}) as {args.format} to {out}", sep="\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `hf-dynamic-ckpt` argument parser: a sub-command per command, its function in the `func` default."""
    def shared(*flags: str, **kwargs: Any) -> argparse.ArgumentParser:  # a parent parser of one argument
        parent = argparse.ArgumentParser(add_help=False)
        parent.add_argument(*flags, **kwargs)
        return parent

    root = shared("root", metavar="ROOT", help="store directory (holds catalog.db), the training output_dir, or a URL")
    ref = shared("ref", metavar="REF", help="step:N, N, auto, best, fastest, or a checkpoint directory")
    task = shared("--task", default=None, help="the task (needed when ROOT holds several; ls, verify: every task)")
    as_json = shared("--json", action="store_true", help="machine-readable JSON")
    parser = argparse.ArgumentParser(prog="hf-dynamic-ckpt",
                                     description="Inspect, check, manage and export an hf_dynamic_ckpt store.")
    parser.add_argument("--version", action="version", version=f"hf-dynamic-ckpt {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Any, text: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=text, parents=[root, *parents])
        command.set_defaults(func=func, cache=None)
        return command

    add("ls", _ls, "list the checkpoints of a store", task, as_json).add_argument(
        "--all", action="store_true", help="also list abandoned checkpoints (timelines a resume left)")
    add("show", _show, "summarise one checkpoint's manifest", ref, task, as_json)
    verify = add("verify", _verify, "check sizes and checksums of checkpoints (exit code 1 on problems)", task)
    verify.add_argument("ref", metavar="REF", nargs="?", default=None, help="one checkpoint (default: all)")
    verify.add_argument("--all", action="store_true", help="verify every checkpoint (the default without REF)")
    add("reindex", _reindex, "rebuild catalog.db from the manifests")
    add("plot", _plot, "PNG timeline of a run: loss, grad norm, risk, saves, resumes", task).add_argument(
        "--output", "-o", default=None, help="PNG path (default ROOT/TASK/timeline.png)")
    add("pin", _pin, "protect a checkpoint from retention and gc", ref, task)
    add("unpin", _pin, "undo pin", ref, task)
    rm = add("rm", _rm, "delete checkpoints (pinned ones need --force)", task)
    rm.add_argument("refs", metavar="REF", nargs="+", help="step:N, N, or a checkpoint directory")
    rm.add_argument("--force", action="store_true", help="also delete pinned checkpoints")
    add("gc", _gc, "remove what nothing needs: passed abandoned timelines, leftovers, unused blobs", task,
        as_json).add_argument("--dry-run", action="store_true", help="print what would go and the bytes it would free")
    export = add("export", _export, "write a checkpoint as a folder PEFT / transformers load", ref, task)
    export.add_argument("out", metavar="OUT", help="folder to create")
    export.add_argument("--format", choices=("peft", "hf", "merged"), default="peft",
                        help="peft: adapter folder; hf: full model; merged: base + adapter merged (needs --base)")
    export.add_argument("--base", default=None, help="local folder with the base model weights (--format merged)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it is a previous export (holding "
                        "hf_dynamic_ckpt_export.json and nothing else)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-dynamic-ckpt` (``hf-dynamic-ckpt ls out``); returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except DynamicCkptError as e:
        print(f"hf-dynamic-ckpt: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `hf-dynamic-ckpt ls ROOT | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if args.cache is not None:
            shutil.rmtree(args.cache, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

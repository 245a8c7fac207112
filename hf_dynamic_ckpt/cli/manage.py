"""Commands that change a store: `pin`, `unpin`, `rm`, `gc`, and `export` (which only reads the store and writes
elsewhere; its ``--overwrite`` replaces only a previous export, `export.EXPORT_MARKER`).

`pin`, `unpin`, `rm` and `gc` take the task's writer lock, so they refuse to run while a
training run of the task is alive (the error names it). Deleting happens only here, in
retention, and in `gc`: never as a side effect of anything else.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..errors import DynamicCkptError
from ._common import Progress, dump_json, human_size, open_reader, open_writer, root_of, single_task

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _cmd_pin(args: argparse.Namespace) -> int:
    root = root_of(args)
    store = open_writer(root, single_task(root, args.task))
    try:
        info = store.unpin(args.ref) if args.command == "unpin" else store.pin(args.ref)
    finally:
        store.close()
    print(f"{'unpinned' if args.command == 'unpin' else 'pinned'} {info.task_id}/step-{info.step}")
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    root = root_of(args)
    store = open_writer(root, single_task(root, args.task))
    removed = []
    try:
        for ref in args.refs:
            info = store.resolve(ref)
            if info.pinned and not args.force:
                raise DynamicCkptError(f"step {info.step} is pinned; `hf-dynamic-ckpt unpin` it first or pass --force.")
            store.delete(info, force=args.force)
            removed.append((info.step, info.bytes))
    finally:
        store.close()
    for step, size in removed:
        print(f"removed step {step} ({human_size(size)})")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    root = root_of(args)
    task = single_task(root, args.task)
    store = open_reader(root, task) if args.dry_run else open_writer(root, task, cleanup=False)
    try:
        report = store.gc(dry_run=args.dry_run)
    finally:
        store.close()
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        dump_json({"dry_run": args.dry_run, "removed": report.removed, "abandoned": report.abandoned,
                   "trimmed": report.trimmed, "blobs": report.blobs, "temp_dirs": report.temp_dirs,
                   "bytes_freed": report.bytes_freed, "kept": report.kept})
        return 0
    for step in report.removed:
        print(f"{verb} step {step}" + (" (abandoned timeline)" if step in report.abandoned else ""))
    for name in report.temp_dirs:
        print(f"{verb} leftover {name}")
    if report.blobs:
        print(f"{verb} {len(report.blobs)} unused blob(s)")
    for why in report.kept:
        print(f"kept: {why}")
    print(f"{'would free' if args.dry_run else 'freed'} {human_size(report.bytes_freed)}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ..export import export_step

    progress = Progress(1, sys.stderr, label="export")
    out, step, skipped = export_step(root_of(args), args.ref, args.out, format=args.format, base=args.base,
                                     task_id=args.task, overwrite=args.overwrite)
    progress.step(f"step {step}")
    for line in skipped:  # "skipped step 40: failed verification: ...": what auto / best / fastest passed over
        print(line)
    print(f"exported step {step} ({args.ref}) as {args.format} to {out}")
    return 0


def _root_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db) or the training output_dir")


def _add_pin(sub: SubParsers) -> None:
    for name, text in (("pin", "protect a checkpoint from retention and gc"), ("unpin", "undo pin")):
        p = sub.add_parser(name, help=text)
        _root_arg(p)
        p.add_argument("ref", metavar="REF", help="step:N, N, auto, best, fastest, or a checkpoint directory")
        p.add_argument("--task", default=None, help="task of REF (needed when ROOT holds several)")
        p.set_defaults(func=_cmd_pin)


def _add_rm(sub: SubParsers) -> None:
    p = sub.add_parser("rm", help="delete checkpoints (pinned ones need --force)")
    _root_arg(p)
    p.add_argument("refs", metavar="REF", nargs="+", help="step:N, N, or a checkpoint directory")
    p.add_argument("--task", default=None, help="task of REF (needed when ROOT holds several)")
    p.add_argument("--force", action="store_true", help="also delete pinned checkpoints")
    p.set_defaults(func=_cmd_rm)


def _add_gc(sub: SubParsers) -> None:
    p = sub.add_parser("gc", help="remove what nothing needs: passed abandoned timelines, leftovers, unused blobs")
    _root_arg(p)
    p.add_argument("--task", default=None, help="task (needed when ROOT holds several)")
    p.add_argument("--dry-run", action="store_true", help="print what would go and the bytes it would free")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(func=_cmd_gc)


def _add_export(sub: SubParsers) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a folder PEFT / transformers load")
    _root_arg(p)
    p.add_argument("ref", metavar="REF", help="auto | best | fastest | step:N | path")
    p.add_argument("out", metavar="OUT", help="folder to create")
    p.add_argument("--format", choices=("peft", "hf", "merged"), default="peft",
                   help="peft: adapter folder; hf: full model; merged: base + adapter merged (needs --base)")
    p.add_argument("--base", default=None, help="local folder with the base model weights (--format merged)")
    p.add_argument("--task", default=None, help="task id (default: 'default')")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a previous export (holding hf_dynamic_ckpt_export.json and nothing else)")
    p.set_defaults(func=_cmd_export)


COMMANDS = [_add_pin, _add_rm, _add_gc, _add_export]

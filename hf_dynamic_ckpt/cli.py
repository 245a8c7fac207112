"""`hf-dynamic-ckpt`: inspect and check a checkpoint store from the shell.

    hf-dynamic-ckpt ls ROOT [--task T] [--all]
    hf-dynamic-ckpt show ROOT REF [--task T] [--json]
    hf-dynamic-ckpt verify ROOT [REF | --all] [--task T]
    hf-dynamic-ckpt reindex ROOT
    hf-dynamic-ckpt plot ROOT [--task T] [--output PNG]

ROOT is the store directory (the one holding `catalog.db`); REF is ``step:N``, ``N``,
``auto``/``best``/``fastest`` or a checkpoint directory. Exit codes: 0 success, 1 problems
found (`verify`), 2 bad usage or a reference that names nothing.

Adding a subcommand: write ``_add_<name>(subparsers)`` that registers its parser with
``set_defaults(func=...)`` (the function takes the parsed args and returns the exit code)
and append it to `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from .constants import BLOBS_DIR, CATALOG_NAME, DEFAULT_TASK_ID, KEY_FILES, MANIFEST_NAME, STEP_DIR_PREFIX
from .errors import DynamicCkptError
from .store.types import CheckpointInfo


def human_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _root(args: argparse.Namespace) -> Path:
    root = Path(args.root)
    if not root.is_dir():
        raise SystemExit(_usage_error(f"ROOT {root} is not a directory; pass the store directory holding {CATALOG_NAME}."))
    if (root / MANIFEST_NAME).exists() or any(p.name.startswith(STEP_DIR_PREFIX) for p in root.iterdir()):
        store_root = root.parent.parent if (root / MANIFEST_NAME).exists() else root.parent
        raise SystemExit(_usage_error(
            f"ROOT {root} is a checkpoint or task directory, not a store root; pass {store_root} "
            f"(the directory holding {CATALOG_NAME}) and select with REF / --task."))
    return root


def _usage_error(message: str) -> int:
    print(f"hf-dynamic-ckpt: error: {message}", file=sys.stderr)
    return 2


def _tasks(root: Path, task: str | None) -> list[str]:
    """Tasks to look at: the one asked for, else every folder under ROOT that holds checkpoints."""
    if task is not None:
        return [task]
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != BLOBS_DIR
                   and any(c.name.startswith(STEP_DIR_PREFIX) for c in p.iterdir()))
    return found or [DEFAULT_TASK_ID]


def _open(root: Path, task: str) -> Any:
    from .store.store import CheckpointStore

    # cleanup=False: never touch the temporary directories of a run that may be saving now;
    # syncing only adds rows for committed directories and marks vanished ones.
    store = CheckpointStore(root, task_id=task, cleanup=False)
    store.sync_catalog()
    return store


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def _info_row(i: CheckpointInfo) -> list[str]:
    return [
        i.task_id,
        str(i.step),
        i.reason or "-",
        ",".join(sorted(t.value for t in i.tiers)) or "-",
        human_size(i.bytes),
        "-" if i.loss is None else f"{i.loss:.4g}",
        "yes" if i.healthy else "no",
        "yes" if i.pinned else "no",
        i.status,
    ]


# -- ls ---------------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    root = _root(args)
    rows = [["TASK", "STEP", "REASON", "TIERS", "SIZE", "LOSS", "HEALTHY", "PINNED", "STATUS"]]
    for task in _tasks(root, args.task):
        store = _open(root, task)
        try:
            rows += [_info_row(i) for i in store.list(include_unhealthy=True)]
        finally:
            store.close()
    if len(rows) == 1:
        print(f"no checkpoints under {root}" + (f" for task {args.task!r}" if args.task else ""))
        return 0
    _table(rows, sys.stdout)
    return 0


def _add_ls(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ls", help="list the checkpoints of a store")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db)")
    p.add_argument("--task", default=None, help="only this task (default: every task under ROOT)")
    p.set_defaults(func=_cmd_ls)


# -- show -------------------------------------------------------------------------------------
def _fmt_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _show_text(manifest: dict[str, Any], info: CheckpointInfo, out: TextIO) -> None:
    w = out.write
    w(f"checkpoint   {info.path}\n")
    w(f"task / step  {manifest.get('task_id')} / {manifest.get('step')} (epoch {manifest.get('epoch')})\n")
    w(f"reason       {manifest.get('reason')}\n")
    w(f"saved at     {_fmt_time(float(manifest.get('created_at', 0.0)))}\n")
    w(f"tiers        {', '.join(manifest.get('tiers', [])) or '-'}\n")
    w(f"healthy      {'yes' if info.healthy else 'no'}    pinned {'yes' if info.pinned else 'no'}    status {info.status}\n")
    w(f"world size   {manifest.get('world_size')}    format version {manifest.get('format_version')}\n")
    w(f"size         {human_size(int(manifest.get('bytes', 0)))} in the directory")
    blobs = manifest.get("blobs") or {}
    if blobs:
        blob_bytes = sum(int(b.get("size", 0)) for b in {b["digest"]: b for b in blobs.values()}.values())
        w(f" + {human_size(blob_bytes)} shared blobs ({len(blobs)} tensors)")
    w(f"\nrecovery     ~{manifest.get('recovery_cost_ms')} ms (estimate)\n")
    w("files:\n")
    rows = [["  NAME", "TIER", "RANK", "SIZE", "CHECKSUM"]]
    for name, e in sorted(manifest.get(KEY_FILES, {}).items()):
        rank = "-" if e.get("rank") is None else str(e.get("rank"))
        rows.append([f"  {name}", str(e.get("tier")), rank, human_size(int(e.get("size", 0))), str(e.get("checksum"))[:23]])
    _table(rows, out)
    signals = manifest.get("signals") or {}
    if signals:
        w("signals:     " + ", ".join(f"{k}={v}" for k, v in sorted(signals.items())) + "\n")
    debug = manifest.get("debug_info") or []
    if debug:
        keys = sorted({k for d in debug for k in d})
        keys = (["step"] if "step" in keys else []) + [k for k in keys if k != "step"]
        w("debug_info (last steps):\n")
        _table([["  " + keys[0], *keys[1:]]] + [["  " + str(d.get(keys[0], "-")), *(str(d.get(k, "-")) for k in keys[1:])]
                                               for d in debug], out)
    versions = manifest.get("versions") or {}
    if versions:
        w("versions:    " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + "\n")


def _cmd_show(args: argparse.Namespace) -> int:
    from .store.manifest import read_manifest

    root = _root(args)
    store = _open(root, args.task or _single_task(root))
    try:
        info = store.resolve(args.ref)
        manifest = read_manifest(info.path)
    finally:
        store.close()
    if args.json:
        json.dump(manifest, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        _show_text(manifest, info, sys.stdout)
    return 0


def _single_task(root: Path) -> str:
    tasks = _tasks(root, None)
    if len(tasks) > 1:
        raise SystemExit(_usage_error(f"{root} holds several tasks ({', '.join(tasks)}); choose one with --task."))
    return tasks[0]


def _add_show(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("show", help="summarise one checkpoint's manifest")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db)")
    p.add_argument("ref", metavar="REF", help="step:N, N, auto, best, fastest, or a checkpoint directory")
    p.add_argument("--task", default=None, help="task of REF (needed when ROOT holds several)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=_cmd_show)


# -- verify -----------------------------------------------------------------------------------
class _Progress:
    """A counter on stderr: redrawn in place on a terminal, one line per item otherwise."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream, self.n = total, stream, 0
        self.tty = stream.isatty()

    def step(self, label: str) -> None:
        self.n += 1
        width = 24
        done = int(width * self.n / max(self.total, 1))
        bar = "#" * done + "." * (width - done)
        text = f"verify [{bar}] {self.n}/{self.total} {label}"
        if self.tty:
            self.stream.write("\r" + text.ljust(100)[:100])
            if self.n == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _cmd_verify(args: argparse.Namespace) -> int:
    root = _root(args)
    if args.ref is not None and args.all:
        return _usage_error("give either REF or --all, not both.")
    stores: dict[str, Any] = {}
    targets: list[tuple[str, CheckpointInfo]] = []
    try:
        tasks = _tasks(root, args.task) if args.ref is None else [args.task or _single_task(root)]
        for task in tasks:
            stores[task] = _open(root, task)
            if args.ref is None:  # --all, or no REF: every checkpoint
                infos = sorted(stores[task].list(include_unhealthy=True), key=lambda i: i.step)
            else:
                infos = [stores[task].resolve(args.ref)]
            targets += [(task, i) for i in infos]
        if not targets:
            print(f"no checkpoints under {root}")
            return 0
        progress = _Progress(len(targets), sys.stderr) if len(targets) > 1 else None
        bad = 0
        for task, info in targets:
            label = f"{task}/step-{info.step}"
            problems = stores[task].verify(info)
            if progress is not None:
                progress.step(label)
            if problems:
                bad += 1
                print(f"FAIL {label}")
                for p in problems:
                    print(f"  - {p}")
            else:
                print(f"OK   {label}")
    finally:
        for store in stores.values():
            store.close()
    print(f"{len(targets) - bad} of {len(targets)} checkpoint(s) intact" + (f", {bad} with problems" if bad else ""))
    return 1 if bad else 0


def _add_verify(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("verify", help="check sizes and checksums of checkpoints (exit code 1 on problems)")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db)")
    p.add_argument("ref", metavar="REF", nargs="?", default=None, help="one checkpoint (default: all)")
    p.add_argument("--all", action="store_true", help="verify every checkpoint (the default without REF)")
    p.add_argument("--task", default=None, help="only this task")
    p.set_defaults(func=_cmd_verify)


# -- reindex ----------------------------------------------------------------------------------
def _cmd_reindex(args: argparse.Namespace) -> int:
    root = _root(args)
    store = _open(root, _tasks(root, None)[0])
    try:
        n = store.reindex()
        rows = store.catalog.rows()
    finally:
        store.close()
    corrupt = sum(1 for r in rows if r["status"] != "ok")
    print(f"reindexed {root}: {n} checkpoint(s)" + (f", {corrupt} with a damaged manifest" if corrupt else ""))
    return 0


def _add_reindex(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("reindex", help="rebuild catalog.db from the manifests")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db)")
    p.set_defaults(func=_cmd_reindex)


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import plot_timeline

    root = _root(args)
    out = plot_timeline(root, task_id=args.task or _tasks(root, None)[0], output=args.output)
    print(f"wrote {out}")
    return 0


def _add_plot(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plot", help="PNG timeline of a run: loss, grad norm, risk, saves, resumes")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db)")
    p.add_argument("--task", default=None, help="task id (default: the first task under ROOT)")
    p.add_argument("--output", "-o", default=None, help="PNG path (default ROOT/TASK/timeline.png)")
    p.set_defaults(func=_cmd_plot)


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import export_step

    out, step = export_step(_root(args), args.ref, args.out, format=args.format, base=args.base, task_id=args.task,
                            overwrite=args.overwrite)
    print(f"exported step {step} ({args.ref}) as {args.format} to {out}")
    return 0


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a folder PEFT / transformers load")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db)")
    p.add_argument("ref", metavar="REF", help="auto | best | fastest | step:N | path")
    p.add_argument("out", metavar="OUT", help="folder to create")
    p.add_argument("--format", choices=("peft", "hf", "merged"), default="peft",
                   help="peft: adapter folder; hf: full model; merged: base + adapter merged (needs --base)")
    p.add_argument("--base", default=None, help="local folder with the base model weights (--format merged)")
    p.add_argument("--task", default=None, help="task id (default: 'default')")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=_cmd_export)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_ls,
    _add_show,
    _add_verify,
    _add_reindex,
    _add_plot,
    _add_export,
]
"""Functions that register one subcommand each; append to add a command."""


def build_parser() -> argparse.ArgumentParser:
    """The `hf-dynamic-ckpt` argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="hf-dynamic-ckpt", description="Inspect and check an hf_dynamic_ckpt store.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-dynamic-ckpt`; returns the exit code.

    Example:
        ```bash
        hf-dynamic-ckpt ls out/smart_ckpt
        hf-dynamic-ckpt verify out/smart_ckpt --all
        ```
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SystemExit as e:
        return int(e.code or 0)
    except DynamicCkptError as e:
        return _usage_error(str(e))
    except BrokenPipeError:  # `hf-dynamic-ckpt ls ROOT | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""Commands that only look: `ls`, `show`, `verify`, `reindex`, `plot`."""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import sqlite3
import sys
from typing import TYPE_CHECKING, Any, TextIO

from ..constants import CATALOG_NAME, KEY_FILES
from ..errors import CheckpointNotFoundError
from ..run.steplog import read_rollbacks
from ..store import Catalog, CheckpointInfo, read_manifest
from ._common import (
    Progress,
    dump_json,
    human_number,
    human_size,
    info_json,
    open_reader,
    root_of,
    single_task,
    table,
    tasks,
    usage_error,
)

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _status(i: CheckpointInfo) -> str:
    return "abandoned" if i.abandoned and i.status == "ok" else i.status


def _info_row(i: CheckpointInfo) -> list[str]:
    return [i.task_id, str(i.step), i.reason or "-", ",".join(sorted(t.value for t in i.tiers)) or "-",
            str(i.world_size), human_size(i.bytes), "-" if i.loss is None else f"{i.loss:.4g}",
            "yes" if i.healthy else "no", "yes" if i.pinned else "no", _status(i)]


# -- ls ---------------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    root = root_of(args)
    infos: list[CheckpointInfo] = []
    rollbacks: list[tuple[str, dict[str, Any]]] = []
    removed: list[tuple[str, dict[str, Any]]] = []
    for task in tasks(root, args.task):
        store = open_reader(root, task)
        try:
            infos += store.list(include_unhealthy=True, include_abandoned=args.all)
            removed += [(task, r) for _, r in sorted(store.removed().items())]
        finally:
            store.close()
        if not isinstance(root, str):  # a local store: its step log records the rollbacks
            rollbacks += [(task, r) for r in read_rollbacks(root, task)]
    if args.json:
        dump_json([info_json(i) for i in infos])
        return 0
    if not infos:
        print(f"no checkpoints under {root}" + (f" for task {args.task!r}" if args.task else ""))
        return 0
    table([["TASK", "STEP", "REASON", "TIERS", "PROCS", "SIZE", "LOSS", "HEALTHY", "PINNED", "STATUS"],
           *(_info_row(i) for i in infos)], sys.stdout)
    pinned = [i for i in infos if i.pinned]
    if pinned:
        why = ", ".join(sorted({i.reason or "-" for i in pinned}))
        print(f"pinned ({why}): kept whatever retention says until unpinned (`hf-dynamic-ckpt unpin ROOT step:N`); "
              "a save_state checkpoint is unpinned once Accelerate rotates its folder away. The others are kept by "
              "the run's retention (keep_last, log-spaced history; Accelerate's total_limit with the state hooks).")
    if removed:
        shown = removed if args.all else removed[-3:]
        more = "" if args.all or len(removed) <= 3 else f"; the last 3 of {len(removed)} (`--all` lists every one)"
        # Each row names the rule (and its settings) of the run that removed it, as the store recorded it.
        print(f"removed by retention{more}, each with the rule that removed it:")
        for task, r in shown:
            what = "" if "weights" in (r.get("tiers") or []) else f" ({', '.join(r.get('tiers') or [])} only)"
            print(f"  {task}: step {r.get('step')}{what}: {r.get('rule')}")
        print("  (to keep every checkpoint: train with keep_last: null and storage_levels.level_N.retention_days: "
              "null, or pin it)")
    if rollbacks:
        print("rollbacks (the steps past each restore point were abandoned; `--all` lists their checkpoints):")
        for task, r in rollbacks:
            when = f" at {_fmt_time(float(r['time']))}" if isinstance(r.get("time"), int | float) else ""
            print(f"  {task}: step {r.get('from_step')} -> step {r.get('to_step')}{when} ({r.get('reason')})")
    return 0


def _add_ls(sub: SubParsers) -> None:
    p = sub.add_parser("ls", help="list the checkpoints of a store")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db) or the training output_dir")
    p.add_argument("--task", default=None, help="only this task (default: every task under ROOT)")
    p.add_argument("--all", action="store_true", help="also list abandoned checkpoints (timelines a resume left)")
    p.add_argument("--json", action="store_true", help="one JSON list (machine-readable)")
    p.set_defaults(func=_cmd_ls)


# -- show -------------------------------------------------------------------------------------
def _fmt_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _show_text(manifest: dict[str, Any], info: CheckpointInfo, out: TextIO) -> None:
    w = out.write
    w(f"checkpoint   {info.path}\n")
    w(f"task / step  {info.task_id} / {manifest.get('step')} (epoch {human_number(manifest.get('epoch'))})\n")
    w(f"reason       {manifest.get('reason')}\n")
    w(f"saved at     {_fmt_time(float(manifest.get('created_at', 0.0)))}\n")
    w(f"tiers        {', '.join(manifest.get('tiers', [])) or '-'}\n")
    w(f"healthy      {'yes' if info.healthy else 'no'}    pinned {'yes' if info.pinned else 'no'}    "
      f"status {_status(info)}\n")
    w(f"world size   {manifest.get('world_size')}    format version {manifest.get('format_version')}\n")
    lineage = manifest.get("lineage") or {}
    if lineage:
        parent = lineage.get("parent_step")
        w(f"lineage      timeline {lineage.get('timeline')}, session {lineage.get('session')}"
          + (f", resumed from step {parent}" if parent is not None else ", fresh start") + "\n")
    w(f"size         {human_size(int(manifest.get('bytes', 0)))} in the directory")
    blobs = manifest.get("blobs") or {}
    if blobs:
        blob_bytes = sum(int(b.get("size", 0)) for b in {b["digest"]: b for b in blobs.values()}.values())
        w(f" + {human_size(blob_bytes)} shared blobs ({len(blobs)} tensors)")
    w(f"\nrecovery     ~{human_number(manifest.get('recovery_cost_ms'))} ms (estimate)\n")
    w("files:\n")
    rows = [["  NAME", "TIER", "RANK", "SIZE", "CHECKSUM"]]
    for name, e in sorted(manifest.get(KEY_FILES, {}).items()):
        rank = "-" if e.get("rank") is None else str(e.get("rank"))
        rows.append([f"  {name}", str(e.get("tier")), rank, human_size(int(e.get("size", 0))),
                     str(e.get("checksum"))[:23]])
    table(rows, out)
    signals = manifest.get("signals") or {}
    if signals:
        w("signals:     " + ", ".join(f"{k}={human_number(v)}" for k, v in sorted(signals.items())) + "\n")
    debug = manifest.get("debug_info") or []
    if debug:
        keys = sorted({k for d in debug for k in d})
        keys = (["step"] if "step" in keys else []) + [k for k in keys if k != "step"]
        w("debug_info (last steps):\n")
        table([["  " + keys[0], *keys[1:]]] + [["  " + str(d.get(keys[0], "-")),
                                                 *(human_number(d.get(k, "-")) for k in keys[1:])] for d in debug], out)
    versions = manifest.get("versions") or {}
    if versions:
        w("versions:    " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + "\n")


def _cmd_show(args: argparse.Namespace) -> int:
    root = root_of(args)
    store = open_reader(root, single_task(root, args.task))
    try:
        info = store.resolve(args.ref)
        manifest = read_manifest(info.path)  # checksum-verified
    finally:
        store.close()
    if args.json:
        dump_json(manifest)
    else:
        _show_text(manifest, info, sys.stdout)
    return 0


def _add_show(sub: SubParsers) -> None:
    p = sub.add_parser("show", help="summarise one checkpoint's manifest")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db) or the training output_dir")
    p.add_argument("ref", metavar="REF", help="step:N, N, auto, best, fastest, or a checkpoint directory")
    p.add_argument("--task", default=None, help="task of REF (needed when ROOT holds several)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=_cmd_show)


# -- verify -----------------------------------------------------------------------------------
def _cmd_verify(args: argparse.Namespace) -> int:
    root = root_of(args)
    if args.ref is not None and args.all:
        return usage_error("give either REF or --all, not both.")
    stores: dict[str, Any] = {}
    targets: list[tuple[str, CheckpointInfo]] = []
    try:
        names = tasks(root, args.task) if args.ref is None else [single_task(root, args.task)]
        for task in names:
            stores[task] = open_reader(root, task)
            if args.ref is None:  # --all, or no REF: every checkpoint (abandoned ones too)
                infos = sorted(stores[task].list(include_unhealthy=True, include_abandoned=True), key=lambda i: i.step)
            else:
                infos = [stores[task].resolve(args.ref)]
            targets += [(task, i) for i in infos]
        if not targets:
            print(f"no checkpoints under {root}")
            return 0
        progress = Progress(len(targets), sys.stderr) if len(targets) > 1 else None
        if progress is None:
            print(f"verifying {targets[0][0]}/step-{targets[0][1].step} ({human_size(targets[0][1].bytes)}) ...",
                  file=sys.stderr)
        bad = gone = 0
        found: dict[str, dict[int, str]] = {}
        for task, info in targets:
            label = f"{task}/step-{info.step}"
            try:
                problems = stores[task].verify(info)
            except CheckpointNotFoundError:
                problems = None
            if progress is not None:
                progress.step(label)
            if problems is not None and (status := "corrupt" if problems else "ok") != info.status:
                found.setdefault(task, {})[info.step] = status
            if problems is None:
                gone += 1
                print(f"GONE {label} (deleted while verifying, e.g. by retention; not a problem)")
            elif problems:
                bad += 1
                print(f"FAIL {label}")
                for p in problems:
                    print(f"  - {p}")
            else:
                print(f"OK   {label}")
    finally:
        for store in stores.values():
            store.close()
    if not isinstance(root, str):  # the one write of a command that reads: what verify found, for a later `ls`
        for task, statuses in found.items():
            try:  # best effort: a read-only or locked catalog keeps its rows, the manifests stay the truth
                Catalog.record_statuses(root / CATALOG_NAME, task, statuses)
            except sqlite3.Error as e:
                logger.debug("catalog %s not updated with the verify findings (%s)", root / CATALOG_NAME, e)
    checked = len(targets) - gone
    print(f"{checked - bad} of {checked} checkpoint(s) intact" + (f", {bad} with problems" if bad else "")
          + (f"; {gone} deleted during the scan" if gone else ""))
    return 1 if bad else 0


def _add_verify(sub: SubParsers) -> None:
    p = sub.add_parser("verify", help="check sizes and checksums of checkpoints (exit code 1 on problems)")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db) or the training output_dir")
    p.add_argument("ref", metavar="REF", nargs="?", default=None, help="one checkpoint (default: all)")
    p.add_argument("--all", action="store_true", help="verify every checkpoint (the default without REF)")
    p.add_argument("--task", default=None, help="only this task")
    p.set_defaults(func=_cmd_verify)


# -- reindex / plot ----------------------------------------------------------------------------
def _cmd_reindex(args: argparse.Namespace) -> int:
    from ..store import CheckpointStore

    root = root_of(args)
    if isinstance(root, str):  # a URL: the training cache's catalog (rank 0's) is rebuilt from the bucket
        from ._common import url_store

        n, rows = 0, []
        for task in tasks(root, None):
            store = url_store(root, task, cache="writer", cleanup=False)
            try:
                n += store.reindex()
                rows += store.catalog.rows(task)
            finally:
                store.close()
    else:
        store = CheckpointStore(root, task_id=tasks(root, None)[0], cleanup=False)
        try:
            n = store.reindex()
            rows = store.catalog.rows()
        finally:
            store.close()
    corrupt = sum(1 for r in rows if r["status"] != "ok")
    print(f"reindexed {root}: {n} checkpoint(s)" + (f", {corrupt} with a damaged manifest" if corrupt else ""))
    return 0


def _add_reindex(sub: SubParsers) -> None:
    p = sub.add_parser("reindex", help="rebuild catalog.db from the manifests")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db) or the training output_dir")
    p.set_defaults(func=_cmd_reindex)


def _cmd_plot(args: argparse.Namespace) -> int:
    from ..extras.plot import plot_timeline

    root = root_of(args)
    out = plot_timeline(root, task_id=args.task or tasks(root, None)[0], output=args.output)
    print(f"wrote {out}")
    return 0


def _add_plot(sub: SubParsers) -> None:
    p = sub.add_parser("plot", help="PNG timeline of a run: loss, grad norm, risk, saves, resumes")
    p.add_argument("root", metavar="ROOT", help="store directory (holds catalog.db) or the training output_dir")
    p.add_argument("--task", default=None, help="task id (default: the first task under ROOT)")
    p.add_argument("--output", "-o", default=None, help="PNG path (default ROOT/TASK/timeline.png)")
    p.set_defaults(func=_cmd_plot)


COMMANDS = [_add_ls, _add_show, _add_verify, _add_reindex, _add_plot]

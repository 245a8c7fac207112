"""The run's own record: its saves (`SaveEvent`, `SaveLog`, the `smart_ckpt/*` metrics), one row per step
(`StepLog`, ``<root>/<task>/timeline.jsonl``, strict JSON so ``jq`` reads it) and the timeline figure
(`plot_timeline`, the ``plot`` command; matplotlib is imported only there). The catalog and the manifests hold the
committed facts; this is what the training loop saw."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import DEFAULT_TASK_ID, TIMELINE_NAME, Tier
from ..errors import CheckpointNotFoundError, DynamicCkptError
from ..jsonutil import safe_float
from ..signals import Decision, DecisionKind, SignalFrame
from ..store import CheckpointStore

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..engine import SaveHandle

logger = logging.getLogger(__name__)

METRIC_PREFIX = "smart_ckpt/"


def human_size(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units; ``"? B"`` for an unknown size)."""
    if n is None:
        return "? B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class SaveEvent:
    """One save as the training loop saw it. `at_step`: the step during which it was taken (`step + 1` for a
    pre-update capture); `bytes`, `write_ms`, `path` once committed (rank 0); `error`: why it failed or was skipped;
    `staging`: `"buffered"` (copied, written in the background), `"streaming"` (written from the live tensors: memory
    was short) or `"sync"` (a blocking save)."""

    step: int
    at_step: int
    reason: str
    tiers: frozenset[Tier]
    pinned: bool
    blocking_ms: float
    kind: DecisionKind = DecisionKind.MANUAL
    bytes: int | None = None
    write_ms: float | None = None
    path: str | None = None
    error: str | None = None
    handle: SaveHandle | None = field(default=None, repr=False)
    staging: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "handle"}
        return out | {"kind": self.kind.value, "tiers": sorted(t.value for t in self.tiers),
                      "blocking_ms": round(self.blocking_ms, 3),
                      "write_ms": None if self.write_ms is None else round(self.write_ms, 3)}


class SaveLog:
    """The run's `SaveEvent`s, with the counters behind the `smart_ckpt/*` metrics. Blocking time accumulates twice:
    until `metrics()` reports it (`stall_ms`) and until the next frame carries it to the policy (`take_blocking_s`;
    an overlapped copy's wait at the next optimizer step counts once it happened)."""

    def __init__(self) -> None:
        self.events: list[SaveEvent] = []
        self.failed = self.earlier_saves = self.earlier_failed = 0  # earlier: the run's before this process
        self._start = 0  # index of the first event of the current timeline
        self._stall_ms = self._blocking_s = 0.0
        self._overlapped: list[Any] = []  # `PendingCopy`s whose wait at the optimizer step is not counted yet

    def add(self, event: SaveEvent) -> SaveEvent:
        self.events.append(event)
        self._stall_ms += event.blocking_ms
        self._blocking_s += event.blocking_ms / 1e3
        if (deferred := getattr(event.handle, "deferred", None)) is not None:
            self._overlapped.append(deferred)
        return event

    def take_blocking_s(self) -> float | None:
        """Blocking seconds since the previous call (`None` when no save blocked in between): the saves' own, and
        the time the training thread waited for an overlapped copy (`PendingCopy.wait_ms`) once it did."""
        waited_ms = sum(c.wait_ms for c in self._overlapped if c.wait_ms is not None)
        self._overlapped = [c for c in self._overlapped if c.wait_ms is None]
        self._stall_ms += waited_ms
        value, self._blocking_s = self._blocking_s + waited_ms / 1e3, 0.0
        return value if value > 0 else None

    def find(self, step: int | None = None) -> SaveEvent | None:
        """The newest successful (or still writing) save of `step` (any step: `None`) in the current timeline."""
        return next((e for e in reversed(self.events[self._start:]) if e.error is None and step in (None, e.step)),
                    None)

    def counts_for_save(self) -> dict[str, int]:
        """The run's save counters as a save being taken now stores them (itself included)."""
        done = sum(e.error is None for e in self.events)
        return {"saves": self.earlier_saves + done + 1, "failed_saves": self.earlier_failed + self.failed}

    def continue_counts(self, counts: dict[str, Any]) -> None:
        """Continue the run's counters from a resumed checkpoint's (`counts_for_save`): no drop at a restart."""
        for key, name in (("saves", "earlier_saves"), ("failed_saves", "earlier_failed")):
            if isinstance(value := counts.get(key), int) and value >= 0:
                setattr(self, name, value)

    def restart(self) -> None:
        """The run restarted from an earlier step (a retry, a rollback): earlier saves still count in
        `smart_ckpt/saves`, but `find` and `last_save_step` see only the current timeline's."""
        self._start = len(self.events)

    def metrics(self, *, risk: float | None, interval: float | None, held_step: int | None = None) -> dict[str, float]:
        """The `smart_ckpt/*` metrics of docs/trainer.md (`stall_ms`: since the last call; the counts: of the run).
        `held_step`: a save decided for that step, written after the step's logging, counts as taken."""
        done = [e for e in self.events if e.error is None]
        last = held_step if held_step is not None else getattr(self.find(), "step", None)
        out = {"saves": float(self.earlier_saves + len(done) + (held_step is not None)),
               "failed_saves": float(self.earlier_failed + self.failed),
               "streamed_saves": float(sum(e.staging == "streaming" for e in done)),
               "stall_ms": round(self._stall_ms, 3), "risk": round(risk, 6) if risk is not None else 0.0,
               "last_save_step": None if last is None else float(last),
               "interval": round(interval, 3) if interval else None}
        self._stall_ms = 0.0
        return {METRIC_PREFIX + k: v for k, v in out.items() if v is not None}


class StepLog:
    """The run's step log, ``<task_dir>/timeline.jsonl``, written by rank 0 only (line-buffered): rows while
    attached (`open`), events (a resume) also before."""

    def __init__(self, task_dir: Path, *, rank: int) -> None:
        self.task_dir, self.rank, self._seen = task_dir, rank, 0
        self._file: Any = None

    def open(self) -> None:
        if self.rank == 0 and self._file is None:
            self.task_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.task_dir / TIMELINE_NAME, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def step(self, frame: SignalFrame, decision: Decision, events: list[SaveEvent], *, beta: float | None = None
             ) -> None:
        """One row for the step `frame.step`, with the saves of `events` (the whole log; only entries appended since
        the previous row are looked at) taken during it; `beta`: the step's raw risk (`risk` is the smoothed one)."""
        if self._file is None:
            return
        saves = [e for e in events[self._seen:] if e.at_step == frame.step]
        self._seen = len(events)
        row: dict[str, Any] = {
            "step": frame.step, "loss": safe_float(frame.loss), "grad_norm": safe_float(frame.grad_norm),
            "lora_max_ratio": safe_float(frame.lora_max_ratio), "lr": safe_float(frame.lr),
            "risk": round(decision.risk, 6), "beta": None if beta is None else round(beta, 6),
            "mem": safe_float(frame.mem_frac), "step_time_s": safe_float(frame.step_time_s), "time": time.time(),
        }
        if saves:
            row["saves"] = [{"step": e.step, "reason": e.reason, "kind": e.kind.value, "pinned": e.pinned,
                             "blocking_ms": round(e.blocking_ms, 3)} for e in saves]
        self._file.write(json.dumps(row) + "\n")

    def event(self, kind: str, **data: Any) -> None:
        """A non-step line (rank 0), e.g. ``event("resume", step=56, ref="auto")``; opens the file for it when
        not attached."""
        if self.rank != 0:
            return
        attached = self._file is not None
        self.open()
        self._file.write(json.dumps({"event": kind, "time": time.time(), **data}) + "\n")
        if not attached:
            self.close()


def _log_rows(root: str | os.PathLike[str], task_id: str) -> list[dict[str, Any]] | None:
    """The step log's JSON objects (a line cut by a crash is skipped), or `None` when the task has none."""
    path = Path(root) / task_id / TIMELINE_NAME
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return [row for row in rows if isinstance(row, dict)]


def read_step_log(root: str | os.PathLike[str], task_id: str = DEFAULT_TASK_ID) -> list[list[dict[str, Any]]]:
    """The step log as segments: one list of step rows per stretch of training, split where the run restarted
    from an earlier step. A segment after a resume starts with ``{"resume_from": step}``, after a rollback with
    ``{"rollback_to": step, "rollback_from": step, "reason": ...}``. `CheckpointNotFoundError`: no step log."""
    rows = _log_rows(root, task_id)
    if rows is None:
        raise CheckpointNotFoundError(f"{Path(root) / task_id / TIMELINE_NAME} does not exist: ROOT must be a store "
                                      "written by SmartCkptCallback / SmartCheckpointer (pass the directory holding "
                                      "catalog.db, and --task if not 'default').")
    segments: list[list[dict[str, Any]]] = [[]]
    for row in rows:
        if row.get("event") == "resume":
            segments.append([{"resume_from": row.get("step")}])
        elif row.get("event") == "rollback":
            segments.append([{"rollback_to": row.get("to_step"), "rollback_from": row.get("from_step"),
                              "reason": row.get("reason")}])
        elif "step" in row:
            segments[-1].append(row)
    return [s for s in segments if any("step" in r for r in s)]


def read_rollbacks(root: str | os.PathLike[str], task_id: str = DEFAULT_TASK_ID) -> list[dict[str, Any]]:
    """The rollbacks the step log records, oldest first: ``{"from_step", "to_step", "reason", "time"}`` each."""
    return [{k: row.get(k) for k in ("from_step", "to_step", "reason", "time")}
            for row in _log_rows(root, task_id) or () if row.get("event") == "rollback"]


# ---------------------------------------------------------------------------- the figure
SAVE_STYLES: dict[str, tuple[str, str]] = {
    "interval": ("tab:green", "o"), "capture": ("magenta", "*"), "preemption": ("tab:orange", "X"),
    "risk_edge": ("tab:purple", "^"), "memory": ("tab:brown", "D"), "train_end": ("black", "s"),
    "manual": ("tab:cyan", "P"), "learned": ("tab:olive", "v"),
}
"""Colour and marker of each save kind (`DecisionKind` value); any other kind is drawn like `interval`."""
ROLLBACK_COLOUR = "tab:red"
SEGMENT_STYLES = {"run": ("tab:blue", "-", "run"), "rollback": ("tab:orange", "--", "after a rollback"),
                  "resume": ("tab:red", "-.", "after a resume")}
"""Colour, line style and label of each kind of segment: the first, one after a rollback, one after a resume."""
_LEGACY_KINDS = {"pre_update": "capture", "emergency": "preemption", "risk_edge": "risk_edge",
                 "memory_ramp": "memory", "train_end": "train_end"}  # reason prefix -> kind, where only a reason is


def _kind(save: dict[str, Any]) -> str:
    """A save's `DecisionKind` value (a checkpoint of the store, or an older step log, has only its reason)."""
    if isinstance(save.get("kind"), str):
        return save["kind"]
    return next((k for p, k in _LEGACY_KINDS.items() if str(save.get("reason", "")).startswith(p)), "interval")


def timeline_figure(root: str | os.PathLike[str], *, task_id: str = DEFAULT_TASK_ID, title: str | None = None,
                    risk_threshold: float | None = None) -> Figure:
    """The figure `plot_timeline` writes: loss, gradient norm and risk panels over steps of the store at `root`
    (`risk_threshold`: a dashed line on the risk panel). Its artists carry a `gid` (`fig.findobj`): ``"risk"`` (a line
    per segment), ``"save:<kind>"`` (a marker per save), ``"rollback-band"`` / ``"rollback-label"`` (one per rollback,
    each in its own lane), ``"resume-label"``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(13, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.3]})
    ax_loss, ax_grad, ax_risk = axes
    top = ax_loss.get_xaxis_transform()  # x in steps, y in axes fraction
    saves: list[tuple[str, int]] = []
    rollbacks = resumes = 0
    for i, seg in enumerate(read_step_log(root, task_id)):
        rows, head = [r for r in seg if "step" in r], seg[0]
        steps = [r["step"] for r in rows]
        kind = "run" if i == 0 else "rollback" if head.get("rollback_to") is not None else "resume"
        colour, style, label = SEGMENT_STYLES[kind]
        for ax, key, kw in ((ax_loss, "loss", {"lw": 1.4, "label": label}), (ax_grad, "grad_norm", {"lw": 1.2}),
                            (ax_risk, "risk", {"lw": 1.2, "gid": "risk"}),
                            (ax_risk, "beta", {"lw": 0.8, "alpha": 0.45, "gid": "beta"})):
            if key != "beta" or any(r.get("beta") is not None for r in rows):  # beta: the step's own risk
                ax.plot(steps, [float("nan") if r.get(key) is None else float(r[key]) for r in rows], style,
                        color=colour, **kw)
        if kind == "resume":
            for ax in axes:
                ax.axvline(head["resume_from"], color="black", ls="--", lw=1)
            # Stacked from the bottom, below the data: a run resumed twice keeps both labels readable.
            ax_loss.annotate(f"resume @ {head['resume_from']}", (head["resume_from"], 0.015 + 0.07 * resumes),
                             xycoords=top, xytext=(3, 0), textcoords="offset points", va="bottom", fontsize=8,
                             gid="resume-label")
            resumes += 1
        elif kind == "rollback":
            start, end = head["rollback_to"], head.get("rollback_from") or head["rollback_to"]
            # Each rollback in its own lane under the save markers (two rollbacks of the same steps stay two bands);
            # the lower panels shade the steps that were undone.
            lane = 0.86 - 0.08 * rollbacks
            ax_loss.axvspan(start, end, ymin=lane, ymax=lane + 0.06, color=ROLLBACK_COLOUR, alpha=0.35, lw=0,
                            gid="rollback-band", label="rollback: restore point .. step it was confirmed at")
            ax_loss.annotate(f"rollback {rollbacks + 1}: {end} -> {start}", (end, lane + 0.03), xycoords=top,
                             xytext=(4, 0), textcoords="offset points", va="center", fontsize=8, color="darkred",
                             gid="rollback-label")
            for ax in (ax_grad, ax_risk):
                ax.axvspan(start, end, color=ROLLBACK_COLOUR, alpha=0.06, lw=0)
            rollbacks += 1
        saves += [(_kind(save), save["step"]) for r in rows for save in r.get("saves", [])]
    try:  # the store's checkpoints the step log does not list (the train-end one)
        with CheckpointStore(root, task_id=task_id, read_only=True) as store:
            infos = store.list(include_unhealthy=True, include_abandoned=True)
    except (DynamicCkptError, OSError) as e:
        logger.warning("plot: the checkpoints of %s are not readable (%s); only the step log's saves are marked",
                       root, e)
        infos = []
    listed = {step for _, step in saves}
    saves += [(_kind({"reason": i.reason}), i.step) for i in sorted(infos, key=lambda c: c.step)
              if i.step not in listed]
    for kind, step in saves:
        colour, marker = SAVE_STYLES.get(kind, SAVE_STYLES["interval"])
        for ax, alpha in ((ax_loss, 0.45), (ax_risk, 0.3)):
            ax.axvline(step, color=colour, alpha=alpha, lw=1.1, ls=":" if kind == "capture" else "-", zorder=1)
        # The markers sit in a strip along the top, above the bands, so none hides behind a band's edge.
        ax_loss.plot([step], [0.96], marker=marker, color=colour, markersize=11 if kind == "capture" else 7,
                     markeredgecolor="black", markeredgewidth=0.5, ls="", transform=top, clip_on=False, zorder=6,
                     gid=f"save:{kind}", label=f"save: {kind}")
    if risk_threshold is not None:
        ax_risk.axhline(risk_threshold, color="grey", ls=":", lw=1)
    ax_loss.set(ylabel="loss (step, log scale)", yscale="log")
    lo, hi = ax_loss.get_ylim()
    if 0 < lo < hi and math.isfinite(hi):  # room at the top for the markers and bands, at the bottom for resumes
        up, down = min(0.5, 0.12 + 0.08 * rollbacks), min(0.3, 0.07 * resumes)
        span = math.log(hi / lo) / (1.0 - up - down)
        ax_loss.set_ylim(lo / math.exp(span * down), hi * math.exp(span * up))
    ax_grad.set(ylabel="grad norm (pre-clip)", yscale="log")
    ax_risk.set(ylabel="risk: beta (thin),\nsmoothed", ylim=(-0.05, 1.05), xlabel="optimizer step")
    # Outside the panel: inside, it would cover whichever steps the run's curves happen to reach there.
    legend = {label: h for h, label in zip(*ax_loss.get_legend_handles_labels())}  # one entry per label
    ax_loss.legend(legend.values(), legend.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   borderaxespad=0.0)
    fig.suptitle(title or f"{Path(root).name}/{task_id}: loss, gradient norm, risk and checkpoints")
    fig.tight_layout()
    return fig


def plot_timeline(root: str | os.PathLike[str], *, task_id: str = DEFAULT_TASK_ID,
                  output: str | os.PathLike[str] | None = None, title: str | None = None,
                  risk_threshold: float | None = None) -> Path:
    """Draw `timeline_figure` into a PNG: `output`, by default ``<root>/<task>/timeline.png``; returns its path
    (``plot_timeline("out/smart_ckpt")`` -> ``out/smart_ckpt/default/timeline.png``)."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(root, task_id=task_id, title=title, risk_threshold=risk_threshold)
    output = Path(output) if output is not None else Path(root) / task_id / "timeline.png"
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output

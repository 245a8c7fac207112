"""Timeline plot of a run: loss, gradient norm, risk, and where checkpoints were taken.

Reads `<root>/<task>/timeline.jsonl` (written by `RunOrchestrator`, one line per optimizer
step plus `resume` and `rollback` events) and the committed checkpoints of the store (the
save at the end of training comes after the last step's row). A run that crashed and resumed
shows as segments: the steps recomputed after a resume are drawn again, from the restore
point on, so a person can see what was lost and that the replay matches. A rollback starts
a segment too; each rollback is a band of its own, from the restore point to the step the
anomaly was confirmed at. The risk panel shows each step's raw risk (`beta` in the step log: an
anomaly at once, thin) and the policy's smoothed risk (`risk`: what the interval follows, which
discounts a single step's).

    hf-dynamic-ckpt plot ROOT [--task T] [--output timeline.png]
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import DEFAULT_TASK_ID
from ..run.steplog import read_step_log

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

SAVE_STYLES: dict[str, tuple[str, str]] = {
    "interval": ("tab:green", "o"), "capture": ("magenta", "*"), "preemption": ("tab:orange", "X"),
    "risk_edge": ("tab:purple", "^"), "memory": ("tab:brown", "D"), "train_end": ("black", "s"),
    "manual": ("tab:cyan", "P"), "learned": ("tab:olive", "v"),
}
"""Colour and marker of each save kind (`DecisionKind` value); any other kind is drawn like `interval`."""
ROLLBACK_COLOUR = "tab:red"
SEGMENT_STYLES = {"run": ("tab:blue", "-"), "rollback": ("tab:orange", "--"), "resume": ("tab:red", "-.")}
"""Colour and line style of each kind of segment: the first, one after a rollback, one after a resume."""


def _value(v: Any) -> float:
    return float(v) if v is not None else float("nan")


def _save_kind(save: dict[str, Any]) -> str:
    """The save's `DecisionKind` value (older step logs, and the store's checkpoints, have only the reason text)."""
    kind = save.get("kind")
    if isinstance(kind, str):
        return kind
    reason = str(save.get("reason", ""))
    legacy = {"pre_update": "capture", "emergency": "preemption", "risk_edge": "risk_edge", "memory_ramp": "memory",
              "train_end": "train_end"}
    return next((k for prefix, k in legacy.items() if reason.startswith(prefix)), "interval")


def _unlisted_checkpoints(root: str | os.PathLike[str], task_id: str, listed: set[int]) -> list[dict[str, Any]]:
    """The store's checkpoints whose step the step log lists no save of (the save at train end comes after the
    last step's row), as ``{"step", "reason"}``."""
    from ..errors import DynamicCkptError
    from ..store import CheckpointStore

    try:
        with CheckpointStore(root, task_id=task_id, cleanup=False, read_only=True) as store:
            infos = store.list(include_unhealthy=True, include_abandoned=True)
    except (DynamicCkptError, OSError) as e:
        logger.warning("plot: the checkpoints of %s are not readable (%s); only the step log's saves are marked",
                       root, e)
        return []
    return [{"step": i.step, "reason": i.reason} for i in sorted(infos, key=lambda i: i.step) if i.step not in listed]


def _reserve(ax: Any, *, top: float, bottom: float) -> None:
    """Widen a log-scale axis so the data keep clear of the top and bottom fractions (the markers' lanes)."""
    lo, hi = ax.get_ylim()
    if not (0 < lo < hi and math.isfinite(hi)):
        return
    span = math.log(hi / lo) / (1.0 - top - bottom)
    ax.set_ylim(lo / math.exp(span * bottom), hi * math.exp(span * top))


def timeline_figure(root: str | os.PathLike[str], *, task_id: str = DEFAULT_TASK_ID, title: str | None = None,
                    risk_threshold: float | None = None) -> Figure:
    """The figure `plot_timeline` writes: loss, gradient norm and risk panels over steps.

    Its artists carry a `gid` a caller can find them by (`fig.findobj`): ``"risk"`` (one line per segment),
    ``"save:<kind>"`` (one marker per save: the step log's, and checkpoints of the store it does not list),
    ``"rollback-band"`` / ``"rollback-label"`` (one per rollback, each in its own lane), ``"resume-label"``.

    Args:
        root (`str` or `os.PathLike`): the store directory.
        task_id (`str`, *optional*, defaults to `"default"`): the run.
        title (`str`, *optional*): figure title.
        risk_threshold (`float`, *optional*): drawn as a dashed line on the risk panel.

    Returns:
        `matplotlib.figure.Figure`: the figure (close it with `matplotlib.pyplot.close`).

    Example:
        ```python
        >>> fig = timeline_figure("out/smart_ckpt")
        >>> sorted({a.get_gid() for a in fig.findobj() if str(a.get_gid()).startswith("save:")})
        ['save:capture', 'save:interval', 'save:train_end']
        ```
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    segments = read_step_log(root, task_id)
    fig, axes = plt.subplots(3, 1, figsize=(13, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.3]})
    ax_loss, ax_grad, ax_risk = axes
    top = ax_loss.get_xaxis_transform()  # x in steps, y in axes fraction
    saves: list[tuple[str, int]] = []
    rollbacks = resumes = 0
    for i, seg in enumerate(segments):
        rows = [r for r in seg if "step" in r]
        steps = [r["step"] for r in rows]
        head = seg[0]
        kind = "run" if i == 0 else "rollback" if head.get("rollback_to") is not None else "resume"
        colour, style = SEGMENT_STYLES[kind]
        label = {"run": "run", "rollback": "after a rollback", "resume": "after a resume"}[kind]
        ax_loss.plot(steps, [_value(r.get("loss")) for r in rows], style, color=colour, lw=1.4, label=label)
        ax_grad.plot(steps, [_value(r.get("grad_norm")) for r in rows], style, color=colour, lw=1.2)
        ax_risk.plot(steps, [_value(r.get("risk")) for r in rows], style, color=colour, lw=1.2, gid="risk")
        if any(r.get("beta") is not None for r in rows):  # the step's own risk: what an anomaly looks like at once
            ax_risk.plot(steps, [_value(r.get("beta")) for r in rows], style, color=colour, lw=0.8, alpha=0.45,
                         gid="beta")
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
                            gid="rollback-band")
            ax_loss.annotate(f"rollback {rollbacks + 1}: {end} -> {start}", (end, lane + 0.03), xycoords=top,
                             xytext=(4, 0), textcoords="offset points", va="center", fontsize=8, color="darkred",
                             gid="rollback-label")
            for ax in (ax_grad, ax_risk):
                ax.axvspan(start, end, color=ROLLBACK_COLOUR, alpha=0.06, lw=0)
            rollbacks += 1
        saves += [(_save_kind(save), save["step"]) for r in rows for save in r.get("saves", [])]
    listed = {step for _, step in saves}
    saves += [(_save_kind(c), c["step"]) for c in _unlisted_checkpoints(root, task_id, listed)]
    for kind, step in saves:
        colour, marker = SAVE_STYLES.get(kind, SAVE_STYLES["interval"])
        line = ":" if kind == "capture" else "-"
        ax_loss.axvline(step, color=colour, alpha=0.45, lw=1.1, ls=line, zorder=1)
        ax_risk.axvline(step, color=colour, alpha=0.3, lw=1, ls=line, zorder=1)
        # The markers sit in a strip along the top, above the bands, so none hides behind a band's edge.
        ax_loss.plot([step], [0.96], marker=marker, color=colour, markersize=11 if kind == "capture" else 7,
                     markeredgecolor="black", markeredgewidth=0.5, ls="", transform=top, clip_on=False, zorder=6,
                     gid=f"save:{kind}")
    handles = [Line2D([], [], color=c, ls=s, label=lbl) for lbl, (c, s) in
               (("run", SEGMENT_STYLES["run"]), ("after a rollback", SEGMENT_STYLES["rollback"]),
                ("after a resume", SEGMENT_STYLES["resume"])) if any(h.get_label() == lbl for h in ax_loss.lines)]
    for kind in dict.fromkeys(k for k, _ in saves):
        colour, marker = SAVE_STYLES.get(kind, SAVE_STYLES["interval"])
        handles.append(Line2D([], [], color=colour, marker=marker, ls="", markeredgecolor="black",
                              markeredgewidth=0.5, label=f"save: {kind}"))
    if rollbacks:
        handles.append(Line2D([], [], color=ROLLBACK_COLOUR, alpha=0.35, lw=6,
                              label="rollback: restore point .. step it was confirmed at"))
    if risk_threshold is not None:
        ax_risk.axhline(risk_threshold, color="grey", ls=":", lw=1)
    ax_loss.set_ylabel("loss (step, log scale)")
    ax_loss.set_yscale("log")
    _reserve(ax_loss, top=min(0.5, 0.12 + 0.08 * rollbacks), bottom=min(0.3, 0.07 * resumes))
    ax_grad.set_ylabel("grad norm (pre-clip)")
    ax_grad.set_yscale("log")
    ax_risk.set_ylabel("risk: beta (thin),\nsmoothed")
    ax_risk.set_ylim(-0.05, 1.05)
    ax_risk.set_xlabel("optimizer step")
    # Outside the panel: inside, it would cover whichever steps the run's curves happen to reach there.
    ax_loss.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.suptitle(title or f"{Path(root).name}/{task_id}: loss, gradient norm, risk and checkpoints")
    fig.tight_layout()
    return fig


def plot_timeline(root: str | os.PathLike[str], *, task_id: str = DEFAULT_TASK_ID,
                  output: str | os.PathLike[str] | None = None, title: str | None = None,
                  risk_threshold: float | None = None) -> Path:
    """Draw loss, gradient norm and risk over steps with save, rollback and resume markers into a PNG.

    Args:
        root (`str` or `os.PathLike`): the store directory.
        task_id (`str`, *optional*, defaults to `"default"`): the run.
        output (`str` or `os.PathLike`, *optional*): PNG path; defaults to `<root>/<task>/timeline.png`.
        title (`str`, *optional*): figure title.
        risk_threshold (`float`, *optional*): drawn as a dashed line on the risk panel.

    Returns:
        `Path`: the PNG written.

    Example:
        ```python
        >>> plot_timeline("out/smart_ckpt")
        PosixPath('out/smart_ckpt/default/timeline.png')
        ```
    """
    import matplotlib.pyplot as plt

    fig = timeline_figure(root, task_id=task_id, title=title, risk_threshold=risk_threshold)
    output = Path(output) if output is not None else Path(root) / task_id / "timeline.png"
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    logger.debug("wrote %s", output)
    return output

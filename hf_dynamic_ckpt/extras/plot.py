"""Timeline plot of a run (`hf-dynamic-ckpt plot ROOT [--task T] [-o PNG]`): loss, gradient norm, risk, saves.

Reads the task's step log (`run.record.read_step_log`: one row per optimizer step, split into segments where the
run resumed or rolled back) and the committed checkpoints of the store (the save at the end of training comes after
the last step's row). The steps a resume recomputed are drawn again from the restore point on, so a person sees what
was lost and that the replay matches; each rollback is a band of its own, from the restore point to the step the
anomaly was confirmed at. The risk panel shows each step's raw risk (`beta`, thin) and the policy's smoothed risk.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import DEFAULT_TASK_ID
from ..errors import DynamicCkptError
from ..run.record import read_step_log
from ..store import CheckpointStore

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


def _checkpoints(root: str | os.PathLike[str], task_id: str) -> list[dict[str, Any]]:
    """The store's checkpoints as ``{"step", "reason"}`` (none, with a warning, when they cannot be read)."""
    try:
        with CheckpointStore(root, task_id=task_id, read_only=True) as store:
            infos = store.list(include_unhealthy=True, include_abandoned=True)
    except (DynamicCkptError, OSError) as e:
        logger.warning("plot: the checkpoints of %s are not readable (%s); only the step log's saves are marked",
                       root, e)
        return []
    return [{"step": i.step, "reason": i.reason} for i in sorted(infos, key=lambda i: i.step)]


def timeline_figure(root: str | os.PathLike[str], *, task_id: str = DEFAULT_TASK_ID, title: str | None = None,
                    risk_threshold: float | None = None) -> Figure:
    """The figure `plot_timeline` writes: loss, gradient norm and risk panels over steps.

    Its artists carry a `gid` to find them by (`fig.findobj`): ``"risk"`` (a line per segment), ``"save:<kind>"``
    (a marker per save), ``"rollback-band"`` / ``"rollback-label"`` (one per rollback, each in its own lane),
    ``"resume-label"``.

    Args:
        root (`str` or `os.PathLike`): the store directory.
        task_id (`str`, *optional*, defaults to `"default"`): the run.
        title (`str`, *optional*): figure title.
        risk_threshold (`float`, *optional*): drawn as a dashed line on the risk panel.

    Returns:
        `matplotlib.figure.Figure`: the figure (close it with `matplotlib.pyplot.close`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(3, 1, figsize=(13, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.3]})
    ax_loss, ax_grad, ax_risk = axes
    top = ax_loss.get_xaxis_transform()  # x in steps, y in axes fraction
    saves: list[tuple[str, int]] = []
    kinds: list[str] = []
    rollbacks = resumes = 0
    for i, seg in enumerate(read_step_log(root, task_id)):
        rows, head = [r for r in seg if "step" in r], seg[0]
        steps = [r["step"] for r in rows]
        kind = "run" if i == 0 else "rollback" if head.get("rollback_to") is not None else "resume"
        colour, style, label = SEGMENT_STYLES[kind]
        kinds.append(kind)
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
                            gid="rollback-band")
            ax_loss.annotate(f"rollback {rollbacks + 1}: {end} -> {start}", (end, lane + 0.03), xycoords=top,
                             xytext=(4, 0), textcoords="offset points", va="center", fontsize=8, color="darkred",
                             gid="rollback-label")
            for ax in (ax_grad, ax_risk):
                ax.axvspan(start, end, color=ROLLBACK_COLOUR, alpha=0.06, lw=0)
            rollbacks += 1
        saves += [(_kind(save), save["step"]) for r in rows for save in r.get("saves", [])]
    listed = {step for _, step in saves}
    saves += [(_kind(c), c["step"]) for c in _checkpoints(root, task_id) if c["step"] not in listed]
    for kind, step in saves:
        colour, marker = SAVE_STYLES.get(kind, SAVE_STYLES["interval"])
        for ax, alpha in ((ax_loss, 0.45), (ax_risk, 0.3)):
            ax.axvline(step, color=colour, alpha=alpha, lw=1.1, ls=":" if kind == "capture" else "-", zorder=1)
        # The markers sit in a strip along the top, above the bands, so none hides behind a band's edge.
        ax_loss.plot([step], [0.96], marker=marker, color=colour, markersize=11 if kind == "capture" else 7,
                     markeredgecolor="black", markeredgewidth=0.5, ls="", transform=top, clip_on=False, zorder=6,
                     gid=f"save:{kind}")
    handles = [Line2D([], [], color=c, ls=s, label=lbl) for k, (c, s, lbl) in SEGMENT_STYLES.items() if k in kinds]
    handles += [Line2D([], [], color=SAVE_STYLES.get(k, SAVE_STYLES["interval"])[0], ls="", markeredgecolor="black",
                       marker=SAVE_STYLES.get(k, SAVE_STYLES["interval"])[1], markeredgewidth=0.5, label=f"save: {k}")
                for k in dict.fromkeys(k for k, _ in saves)]
    if rollbacks:
        handles.append(Line2D([], [], color=ROLLBACK_COLOUR, alpha=0.35, lw=6,
                              label="rollback: restore point .. step it was confirmed at"))
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
    ax_loss.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.suptitle(title or f"{Path(root).name}/{task_id}: loss, gradient norm, risk and checkpoints")
    fig.tight_layout()
    return fig


def plot_timeline(root: str | os.PathLike[str], *, task_id: str = DEFAULT_TASK_ID,
                  output: str | os.PathLike[str] | None = None, title: str | None = None,
                  risk_threshold: float | None = None) -> Path:
    """Draw `timeline_figure` into a PNG: `output`, by default ``<root>/<task>/timeline.png``; returns its path.

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
    return output

"""Timeline plot of a run: loss, gradient norm, risk, and where checkpoints were taken.

Reads `<root>/<task>/timeline.jsonl` (written by `RunOrchestrator`, one line per optimizer
step plus `resume` and `rollback` events) and the committed checkpoints of the store. A run
that crashed and resumed shows as segments: the steps recomputed after a resume are drawn
again, from the restore point on, so a person can see what was lost and that the replay
matches. A rollback starts a segment too, over a shaded band from the restore point to the
step the anomaly was confirmed at.

    hf-dynamic-ckpt plot ROOT [--task T] [--output timeline.png]
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .constants import DEFAULT_TASK_ID
from .run.steplog import read_timeline

logger = logging.getLogger(__name__)

SAVE_COLOURS = {"capture": "tab:red", "preemption": "tab:orange", "risk_edge": "tab:purple", "memory": "tab:brown"}
DEFAULT_SAVE_COLOUR = "tab:green"


def _value(v: Any) -> float:
    return float(v) if v is not None else float("nan")


def _save_kind(save: dict[str, Any]) -> str:
    """The save's `DecisionKind` value (older step logs have only the reason text)."""
    kind = save.get("kind")
    if isinstance(kind, str):
        return kind
    reason = str(save.get("reason", ""))
    legacy = {"pre_update": "capture", "emergency": "preemption", "risk_edge": "risk_edge", "memory_ramp": "memory"}
    return next((k for prefix, k in legacy.items() if reason.startswith(prefix)), "interval")


def plot_timeline(root: str | os.PathLike[str], *, task_id: str = DEFAULT_TASK_ID,
                  output: str | os.PathLike[str] | None = None, title: str | None = None,
                  risk_threshold: float | None = None) -> Path:
    """Draw loss, gradient norm and risk over steps with save and resume markers into a PNG.

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    segments = read_timeline(root, task_id)
    output = Path(output) if output is not None else Path(root) / task_id / "timeline.png"
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.3]})
    ax_loss, ax_grad, ax_risk = axes
    styles = ["-", "--", ":", "-."]
    seen_reasons: set[str] = set()
    for i, seg in enumerate(segments):
        rows = [r for r in seg if "step" in r]
        steps = [r["step"] for r in rows]
        head = seg[0]
        if i == 0:
            label = "run"
        elif head.get("rollback_to") is not None:
            label = f"after rollback to step {head['rollback_to']} (from {head.get('rollback_from')})"
        else:
            label = f"after resume from step {head.get('resume_from')}"
        style = styles[i % len(styles)]
        ax_loss.plot(steps, [_value(r.get("loss")) for r in rows], style, lw=1.4, label=label)
        ax_grad.plot(steps, [_value(r.get("grad_norm")) for r in rows], style, lw=1.2)
        ax_risk.plot(steps, [_value(r.get("risk")) for r in rows], style, lw=1.2)
        if i > 0 and head.get("resume_from") is not None:
            for ax in axes:
                ax.axvline(head["resume_from"], color="black", ls="--", lw=1)
            ax_loss.annotate(f"resume @ {head['resume_from']}", (head["resume_from"], 1.0),
                             xycoords=("data", "axes fraction"), va="top", fontsize=8)
        if i > 0 and head.get("rollback_to") is not None:
            for ax in axes:
                ax.axvspan(head["rollback_to"], head.get("rollback_from") or head["rollback_to"], color="red",
                           alpha=0.12, lw=0)
            ax_loss.annotate(f"rollback {head.get('rollback_from')} -> {head['rollback_to']}",
                             (head["rollback_to"], 0.92), xycoords=("data", "axes fraction"), va="top", fontsize=8,
                             color="darkred")
        for r in rows:
            for save in r.get("saves", []):
                kind = _save_kind(save)
                colour = SAVE_COLOURS.get(kind, DEFAULT_SAVE_COLOUR)
                lbl = None if kind in seen_reasons else f"save: {kind}"
                seen_reasons.add(kind)
                ax_loss.axvline(save["step"], color=colour, alpha=0.55, lw=1.2, label=lbl)
                ax_risk.axvline(save["step"], color=colour, alpha=0.35, lw=1)
    if risk_threshold is not None:
        ax_risk.axhline(risk_threshold, color="grey", ls=":", lw=1)
    ax_loss.set_ylabel("loss (step, log scale)")
    ax_loss.set_yscale("log")
    ax_grad.set_ylabel("grad norm (pre-clip)")
    ax_grad.set_yscale("log")
    ax_risk.set_ylabel("risk")
    ax_risk.set_ylim(-0.05, 1.05)
    ax_risk.set_xlabel("optimizer step")
    ax_loss.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or f"{Path(root).name}/{task_id}: loss, gradient norm, risk and checkpoints")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    logger.debug("wrote %s", output)
    return output

"""The timeline plot draws what the step log and the store record, each thing once and apart from the others.

Checked on the figure's artists (found by their `gid`), not on pixels: one legend entry per kind, one band per
rollback (two rollbacks of the same steps included), a marker per save (the train-end checkpoint, which the step
log does not list, included), the capture marker apart from the band it starts, resume labels that do not
overlap, and the risk panel equal to the recorded risk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
import torch

from hf_dynamic_ckpt.cli import main
from hf_dynamic_ckpt.constants import TIMELINE_NAME
from hf_dynamic_ckpt.run.record import ROLLBACK_COLOUR, timeline_figure
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, Lineage, SaveRequest


def _row(step: int, risk: float, *saves: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "loss": 6.0 if risk < 0.5 else 180.0, "grad_norm": 1.0, "risk": risk}
    if saves:
        row["saves"] = list(saves)
    return row


def _risk(step: int) -> float:
    return 0.4 if 20 <= step <= 24 else 0.9 if step in (35, 36) else 0.0


SEGMENTS: list[tuple[dict[str, Any] | None, list[int]]] = [
    (None, list(range(1, 37))),
    ({"event": "rollback", "from_step": 36, "to_step": 34, "reason": "loss_spike z=2101.9; 2 bad steps in a row"},
     [35, 36]),
    ({"event": "rollback", "from_step": 36, "to_step": 34, "reason": "loss_spike z=2041.0; 2 bad steps in a row"},
     list(range(35, 41))),
    ({"event": "resume", "step": 38, "spec": "auto"}, list(range(39, 43))),
    ({"event": "resume", "step": 40, "spec": "auto"}, list(range(41, 46))),
]


def _saves(step: int, segment: int) -> list[dict[str, Any]]:
    if step == 10:
        return [{"step": 10, "reason": "interval 10", "kind": "interval", "pinned": False, "blocking_ms": 1.0}]
    if step == 35 and segment == 0:
        return [{"step": 34, "reason": "pre_update loss_spike z=2101.9", "kind": "capture", "pinned": True,
                 "blocking_ms": 1.0}]
    if step == 40 and segment == 2:
        return [{"step": 40, "reason": "interval 10", "kind": "interval", "pinned": False, "blocking_ms": 1.0}]
    return []


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A store with checkpoints 10, 34, 40 and the train-end one of step 45, and the step log of that run."""
    root = tmp_path / "smart_ckpt"
    with CheckpointStore(root) as store:
        for step, reason in ((10, "interval 10"), (34, "pre_update loss_spike z=2101.9"), (40, "interval 10"),
                             (45, "train_end")):
            state = CheckpointState(step=step, weights={"w": torch.zeros(4)}, rng={"python": [step]})
            store.save(state, SaveRequest(step=step, tiers=state.tiers, reason=reason,
                                          lineage=Lineage(session="s1", timeline="t1")))
    lines = []
    for n, (event, steps) in enumerate(SEGMENTS):
        if event is not None:
            lines.append(event)
        lines += [_row(s, _risk(s), *_saves(s, n)) for s in steps]
    (root / "default" / TIMELINE_NAME).write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return root


def _gid(fig: Any, prefix: str) -> list[Any]:
    return [a for a in fig.findobj() if str(a.get_gid()).startswith(prefix)]


def test_each_thing_once_and_apart(root: Path) -> None:
    fig = timeline_figure(root, risk_threshold=0.68)
    try:
        fig.canvas.draw()
        ax_loss, _, ax_risk = fig.axes
        labels = [t.get_text() for t in ax_loss.get_legend().get_texts()]
        assert len(labels) == len(set(labels)), labels
        assert {"run", "after a rollback", "after a resume", "save: interval", "save: capture",
                "save: train_end"} <= set(labels), labels

        # One band per rollback, each in its own lane, with its from -> to steps.
        bands = _gid(fig, "rollback-band")
        boxes = [b.get_window_extent() for b in bands]
        assert len(bands) == 2 and boxes[0].x0 == boxes[1].x0 and not boxes[0].overlaps(boxes[1]), boxes
        assert [t.get_text() for t in _gid(fig, "rollback-label")] == ["rollback 1: 36 -> 34",
                                                                       "rollback 2: 36 -> 34"]

        # A marker per save: the step log's and the train-end checkpoint only the store has.
        markers = sorted((a.get_gid(), float(a.get_xdata()[0])) for a in _gid(fig, "save:"))
        assert markers == [("save:capture", 34.0), ("save:interval", 10.0), ("save:interval", 40.0),
                           ("save:train_end", 45.0)], markers
        capture = next(a for a in _gid(fig, "save:capture"))
        assert capture.get_marker() != "o" and capture.get_color() != ROLLBACK_COLOUR
        assert capture.get_zorder() > max(b.get_zorder() for b in bands)
        assert not any(capture.get_window_extent().overlaps(box) for box in boxes)

        # A run resumed twice: two labels that do not overlap.
        resumes = _gid(fig, "resume-label")
        assert [t.get_text() for t in resumes] == ["resume @ 38", "resume @ 40"]
        assert not resumes[0].get_window_extent().overlaps(resumes[1].get_window_extent())

        # The risk panel is the recorded risk of every segment, non-zero where the step log's is.
        risk_lines = _gid(fig, "risk")
        assert all(line.axes is ax_risk for line in risk_lines) and len(risk_lines) == len(SEGMENTS)
        for line, (_, steps) in zip(risk_lines, SEGMENTS, strict=True):
            assert list(line.get_xdata()) == steps
            assert list(line.get_ydata()) == [_risk(s) for s in steps]
    finally:
        plt.close(fig)


def test_the_plot_command_writes_the_png(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "t.png"
    assert main(["plot", str(root), "-o", str(png)]) == 0
    assert capsys.readouterr().out == f"wrote {png}\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(root.parent)]) == 0  # the training output_dir; the default PNG goes under the task
    assert (root / "default" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

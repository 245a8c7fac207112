"""Recorded signal traces: load them and replay them as the `SignalFrame`s a run produced.

`scripts/record_traces.py` writes one JSONL file per run: a header object (run settings,
`layers`, `onsets` = `[[step, kind], ...]`), then `[step, loss, grad_norm, lr, [layer
norms]]` per step, non-finite numbers as `"nan"` / `"inf"`. The per-layer norms are the
raw pre-clip norms, so a replay goes through the same `LayerLevels` the `GradProbe` uses
and policy calibrations can be checked against real runs. Pure Python (no torch).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .frame import SignalFrame
from .stats import LayerLevels


@dataclass
class RecordedTrace:
    """One recorded run.

    Args:
        name (`str`): the run's name.
        header (`dict`): the run settings as recorded.
        rows (`list[tuple[int, float, float, float, list[float]]]`): `(step, loss, grad_norm,
            lr, layer norms)` per optimizer step.
        onsets (`list[tuple[int, str]]`): `(first bad step, kind)` of each injected anomaly.
    """

    name: str
    header: dict[str, Any]
    rows: list[tuple[int, float, float, float, list[float]]] = field(default_factory=list)
    onsets: list[tuple[int, str]] = field(default_factory=list)

    @property
    def layers(self) -> list[str]:
        return list(self.header.get("layers", []))


def _f(v: Any) -> float:
    return float(v)  # float("nan") / float("inf") parse the strings the recorder writes


def load_trace(path: str | os.PathLike[str]) -> RecordedTrace:
    """Read a trace written by `scripts/record_traces.py`.

    Raises:
        `ConfigError`: the file is not a trace (no header, or a malformed row).
    """
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    try:
        header = json.loads(lines[0])
        if not isinstance(header, dict) or "layers" not in header:
            raise ValueError("the first line is not a header object with 'layers'")
        rows = []
        for line in lines[1:]:
            step, loss, grad, lr, norms = json.loads(line)
            rows.append((int(step), _f(loss), _f(grad), _f(lr), [_f(v) for v in norms]))
    except (IndexError, ValueError, TypeError) as e:
        raise ConfigError(f"{os.fspath(path)} is not a signal trace ({e}); record one with scripts/record_traces.py.") from e
    onsets = [(int(s), str(k)) for s, k in header.get("onsets", [])]
    return RecordedTrace(name=str(header.get("name", os.path.basename(os.fspath(path)))), header=header, rows=rows,
                         onsets=onsets)


def replay_frames(trace: RecordedTrace, levels: LayerLevels | None = None, *,
                  step_time_s: float | None = None) -> list[SignalFrame]:
    """The `SignalFrame`s the checkpointer would have built for the recorded run.

    Args:
        trace (`RecordedTrace`): from `load_trace`.
        levels (`LayerLevels`, *optional*): per-layer judge (defaults to `GradProbe`'s defaults).
        step_time_s (`float`, *optional*): step time to put in every frame.

    Returns:
        `list[SignalFrame]`, one per recorded step, with `lora_max_ratio` from `levels`.
    """
    levels = levels if levels is not None else LayerLevels()
    names = trace.layers
    frames = []
    for step, loss, grad, lr, norms in trace.rows:
        ratio, layer = levels.observe(dict(zip(names, norms)))
        nonfinite = not math.isfinite(grad) or (ratio is not None and not math.isfinite(ratio))
        frames.append(SignalFrame(step=step, loss=loss, grad_norm=grad, lora_max_ratio=ratio, lora_max_layer=layer,
                                  nonfinite=nonfinite, lr=lr, step_time_s=step_time_s))
    return frames

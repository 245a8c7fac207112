"""Recorded signal traces: load them and replay them as the `SignalFrame`s a run produced.

`scripts/record_traces.py` writes one JSONL file per run: a header object (run settings,
`layers`, `onsets` = `[[step, kind], ...]`), then `[step, loss, grad_norm, lr, [layer
norms]]` per step, non-finite numbers as `"nan"` / `"inf"`. The per-layer norms are the
raw pre-clip norms, so a replay goes through the same `LayerBaselines` the `GradProbe` uses
and policy calibrations can be checked against real runs. Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from hf_dynamic_ckpt.errors import ConfigError
from hf_dynamic_ckpt.signals import LayerBaselines, SignalFrame


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
        raise ConfigError(f"{os.fspath(path)} is not a signal trace ({e}); record one with "
                          "scripts/record_traces.py.") from e
    onsets = [(int(s), str(k)) for s, k in header.get("onsets", [])]
    return RecordedTrace(name=str(header.get("name", os.path.basename(os.fspath(path)))), header=header, rows=rows,
                         onsets=onsets)


def replay_frames(trace: RecordedTrace) -> list[SignalFrame]:
    """The `SignalFrame`s the checkpointer would have built for the recorded run.

    Args:
        trace (`RecordedTrace`): from `load_trace`.

    Returns:
        `list[SignalFrame]`, one per recorded step, with `lora_max_ratio` from a `LayerBaselines` with
        `GradProbe`'s defaults.
    """
    baselines = LayerBaselines()
    names = trace.layers
    clip = trace.header.get("max_grad_norm")
    clip = float(clip) if isinstance(clip, (int, float)) and clip > 0 else None
    frames = []
    for step, loss, grad, lr, norms in trace.rows:
        ratio, layer = baselines.observe(dict(zip(names, norms)))
        nonfinite = not math.isfinite(grad) or (ratio is not None and not math.isfinite(ratio))
        frames.append(SignalFrame(step=step, loss=loss, grad_norm=grad, lora_max_ratio=ratio, lora_max_layer=layer,
                                  nonfinite=nonfinite, lr=lr, clip_norm=clip))
    return frames


INJECTIONS = ("loss_x", "nan_grad", "lr_surge")


def inject_anomaly(trace: RecordedTrace, onset: int, kind: str, *, factor: float = 100.0,
                   steps: int = 1) -> RecordedTrace:
    """A copy of a calm `trace` with an anomaly injected at step `onset` (for `steps` steps).

    Exact up to and including the onset step, which is all a pre-update capture reads:
    a run with the same seed sees the same batches before the onset, and multiplying the
    loss by `factor` (`"loss_x"`) multiplies every pre-clip gradient norm of that step by
    `factor` too. `"nan_grad"` makes the step's gradient norms NaN; `"lr_surge"` multiplies
    the learning rate. After the onset the recorded calm values continue, which the real
    anomalous run would not (its weights moved differently): judge only the onset with it.

    Args:
        trace (`RecordedTrace`): a calm trace (no onsets of its own).
        onset (`int`): the first anomalous step.
        kind (`str`): one of `INJECTIONS`.
        factor (`float`, *optional*, defaults to `100.0`): loss or learning-rate multiplier.
        steps (`int`, *optional*, defaults to `1`): consecutive anomalous steps.

    Returns:
        `RecordedTrace`: the copy, with `onsets == [(onset, kind)]`.

    Raises:
        `ConfigError`: an unknown `kind`, or `onset` outside the trace.
    """
    if kind not in INJECTIONS:
        raise ConfigError(f"kind={kind!r} is invalid: expected one of {', '.join(INJECTIONS)}.")
    if not any(r[0] == onset for r in trace.rows):
        raise ConfigError(f"onset={onset} is outside the trace {trace.name!r} "
                          f"(steps {trace.rows[0][0]}..{trace.rows[-1][0]}).")
    rows = []
    for step, loss, grad, lr, norms in trace.rows:
        if onset <= step < onset + steps:
            if kind == "loss_x":
                loss, grad, norms = loss * factor, grad * factor, [n * factor for n in norms]
            elif kind == "nan_grad":
                grad, norms = math.nan, [math.nan for _ in norms]
            else:
                lr = lr * factor
        rows.append((step, loss, grad, lr, list(norms)))
    return dataclasses.replace(trace, name=f"{trace.name}+{kind}@{onset}", rows=rows, onsets=[(onset, kind)])

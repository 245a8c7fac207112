"""The learned model's trace corpus: recorded runs, their frames and their per-step labels.

`scripts/record_traces.py --corpus` records 216 short real fine-tunes (tiny Qwen2 / Llama,
full and LoRA, several lr, batch sizes, seeds, with and without clipping; a quarter calm,
the rest with one injected anomaly each) into `tests/data/traces/corpus.jsonl.gz`: one JSON
object per run, `{"header", "rows", "mem_frac", "step_time_s"}`, the rows in the format of
`examples.traces` (`[step, loss, grad_norm, lr, [LoRA layer norms]]`). The header names the
run's split (`train` / `validation` / `test`, by run) and its anomalies.

Labels, per step `t` (the frame of step `t` is judged before its update, so saving then keeps
the state of step `t - 1`); `K = CAPTURE_K`:
- an anomaly with onset `o` (loss spike, bad batch, LoRA gradient explosion, lr surge, NaN):
  `1` at `t = o` (granularity `everything`), unlabelled from `o + 1` until `RECOVERY` steps
  after it ends (the state is already affected; what the model does there is not judged);
- a memory ramp crossing `MEM_CROSS` at step `x`: `1` for `t` in `[x - K, x - 1]` (granularity
  `key layers + RNG`: the smallest consistent set while memory is short), unlabelled from `x`;
- `0` everywhere else (calm steps, and the ramp's early steps: a save there is not a capture).
"""

from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_dynamic_ckpt.errors import ConfigError
from hf_dynamic_ckpt.signals import LayerBaselines, SignalFrame

CAPTURE_K = 5  # a capture is a healthy checkpoint of a step in [onset - K, onset - 1]
RECOVERY = 10  # steps after an anomaly ends that stay unlabelled
MEMORY_EVERY = 5  # memory sampled every this many steps, as the default `memory_sample_every`
EVERYTHING, KEY_LAYERS_RNG = 0, 3  # granularity classes (`learned.Granularity`) the labels use


@dataclass
class CorpusRun:
    """One recorded corpus run.

    Args:
        header (`dict`): the run settings (`split`, `anomalies`, `layers`, `trainable_params`, ...).
        rows (`list`): `(step, loss, grad_norm, lr, layer norms)` per optimizer step.
        mem_frac (`list[float]`): memory in use per step, fraction of the simulated limit.
        step_time_s (`list[float]`): wall time of each step.
    """

    header: dict[str, Any]
    rows: list[tuple[int, float, float, float, list[float]]]
    mem_frac: list[float]
    step_time_s: list[float]

    @property
    def name(self) -> str:
        return str(self.header["name"])

    @property
    def split(self) -> str:
        return str(self.header["split"])

    @property
    def anomalies(self) -> list[dict[str, Any]]:
        return list(self.header.get("anomalies", []))

    @property
    def kind(self) -> str:
        """The run's anomaly kind, `"calm"` without one."""
        return str(self.anomalies[0]["kind"]) if self.anomalies else "calm"

    def onsets(self) -> list[tuple[int, str]]:
        """`(capture onset, kind)`: the first bad step, for a memory ramp the step it crosses 92 %."""
        out = []
        for a in self.anomalies:
            onset = a.get("cross") if a["kind"] == "memory_ramp" else a["onset"]
            if onset is not None:
                out.append((int(onset), str(a["kind"])))
        return out

    def frames(self) -> list[SignalFrame]:
        """The frames the checkpointer would have built (as `examples.traces.replay_frames`, plus memory
        every `MEMORY_EVERY` steps and the step time)."""
        baselines = LayerBaselines()
        names = list(self.header["layers"])
        clip = self.header.get("max_grad_norm")
        clip = float(clip) if isinstance(clip, int | float) and clip > 0 else None
        frames = []
        for (step, loss, grad, lr, norms), mem, t in zip(self.rows, self.mem_frac, self.step_time_s):
            ratio, layer = baselines.observe(dict(zip(names, norms)))
            nonfinite = not math.isfinite(grad) or (ratio is not None and not math.isfinite(ratio))
            frames.append(SignalFrame(step=step, loss=loss, grad_norm=grad, lora_max_ratio=ratio, lora_max_layer=layer,
                                      nonfinite=nonfinite, lr=lr, step_time_s=t, clip_norm=clip,
                                      host_mem_frac=mem if step % MEMORY_EVERY == 0 else None))
        return frames

    def labels(self) -> tuple[list[float | None], list[int | None]]:
        """Per step: the save target (1 / 0 / `None` = unlabelled) and the granularity target (`None`: none)."""
        n = len(self.rows)
        score: list[float | None] = [0.0] * n
        gran: list[int | None] = [None] * n
        for a in self.anomalies:
            if a["kind"] == "memory_ramp":
                x = a.get("cross")
                if x is None:
                    continue
                for t in range(max(1, x - CAPTURE_K), n + 1):
                    score[t - 1] = 1.0 if t < x else None
                    gran[t - 1] = KEY_LAYERS_RNG if t < x else None
                continue
            o, end = int(a["onset"]), int(a["onset"]) + int(a["steps"]) + RECOVERY
            score[o - 1], gran[o - 1] = 1.0, EVERYTHING
            for t in range(o + 1, min(end, n + 1)):
                score[t - 1] = None
        return score, gran


def _f(v: Any) -> float:
    return float(v)  # the recorder writes "nan" / "inf" for non-finite numbers


def parse_run(obj: dict[str, Any]) -> CorpusRun:
    """One corpus line (already JSON-decoded) as a `CorpusRun`."""
    header = obj["header"]
    rows = [(int(s), _f(loss), _f(g), _f(lr), [_f(v) for v in norms]) for s, loss, g, lr, norms in obj["rows"]]
    mem, times = [_f(v) for v in obj["mem_frac"]], [_f(v) for v in obj["step_time_s"]]
    if not isinstance(header, dict) or "layers" not in header or "split" not in header or not (
            len(rows) == len(mem) == len(times)):
        raise ValueError("a run needs a header with 'layers' and 'split' and equally long rows, mem_frac, step_time_s")
    return CorpusRun(header=header, rows=rows, mem_frac=mem, step_time_s=times)


def load_corpus(path: str | os.PathLike[str]) -> list[CorpusRun]:
    """Read a corpus written by `scripts/record_traces.py --corpus` (gzip JSON lines).

    Raises:
        `ConfigError`: the file is not a corpus (names the line).
    """
    runs = []
    with gzip.open(Path(path), "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                runs.append(parse_run(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{os.fspath(path)} line {i} is not a corpus run ({type(e).__name__}: {e}); "
                                  "record one with scripts/record_traces.py --corpus.") from e
    return runs

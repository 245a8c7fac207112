"""On a GPU: the absolute stall and restore at Qwen2-7B's widths, through `scripts/bench_real_width.py`.

LoRA r=16 on all seven projections over a bf16 base with as many of the 28 layers as the GPU
holds, and a bf16 full fine-tune of one layer (its checkpoint is ~8 GB: more layers would not fit
the check's time or disk). The bench's resume part runs: a preparation run that saves at step 4
(Trainer's; ours also at step 2 for LoRA), then Trainer's native resume and
`resume_checkpoint("step:4")`, each a fresh process. Recorded: the stall of each save (host time
of the snapshot, the device-to-host copy running on a side stream), its share of a step, the time
to the end of the first resumed step (ours and Trainer's), and the bytes per tier. Asserted: every
run finished and both resumes gave the preparation run's losses to the bit.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_runs import REPO, run, tail

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BENCH = REPO / "scripts" / "bench_real_width.py"


def _bench(out: Path, mode: str, max_layers: int, prep_interval: int, timeout: float) -> dict[str, Any]:
    report = out / f"{mode}.json"
    proc = run([sys.executable, str(BENCH), "--device", "cuda", "--model", "qwen2-7b", "--mode", mode,
                "--layers", "auto", "--max-layers", str(max_layers), "--parts", "resume", "--repeats", "1",
                "--no-fresh", "--prep-steps", "4", "--prep-interval", str(prep_interval), "--out", str(out / "work"),
                "--json", str(report)], cwd=REPO, timeout=timeout)
    assert proc.returncode == 0 and report.exists(), \
        f"bench failed ({proc.returncode}):\n{tail(proc)}\n{proc.stdout[-3000:]}"
    return json.loads(report.read_text())["summaries"][0]  # type: ignore[no-any-return]


def _check(summary: dict[str, Any], record_property: Any) -> None:
    r = summary["resume"]
    stall = r["prep_blocking_ms"]
    step = r["prep_median_step_s"]
    record_property("layers (params, trainable)", f"{summary['layers']} ({summary['params'] / 1e9:.2f}B, "
                                                  f"{summary['trainable'] / 1e6:.1f}M)")
    record_property("stall ms per save", ", ".join(f"{b:.1f}" for b in stall))
    record_property("stall / median step", f"{statistics.median(stall) / 1e3 / step:.2%} of {step * 1e3:.0f} ms"
                    if stall else "-")
    record_property("staging", ",".join(r["prep_staging"]))
    t, w = r["to_step_end_s"], r["work_s"]
    record_property("to first step end s: Trainer's / ours",
                    f"{t['native_resume'][0]:.2f} / {t['ours_resume'][0]:.2f}")
    record_property("less the next step s: Trainer's / ours",
                    f"{w['native_resume'][0]:.2f} / {w['ours_resume'][0]:.2f}")
    ratio = r["ratio_work"]
    record_property("resume work (less a steady step): ours / Trainer's", "-" if ratio is None else f"{ratio:.3f}")
    ours, native = r["bytes"]["ours"], r["bytes"]["native"]
    record_property("MB per tier (ours / Trainer's)", ", ".join(
        f"{tier} {ours[tier] / 1e6:.1f} / {native[tier] / 1e6:.1f}" for tier in ("weights", "optimizer", "state")))
    assert stall, "the preparation run committed no save"
    assert all(r["exact"]["native_resume"]), "Trainer's native resume did not reproduce the losses"
    assert all(r["exact"]["ours_resume"]), "resume_checkpoint did not reproduce the losses to the bit"


def test_lora_stall_and_restore_at_qwen2_7b_width(tmp_path: Path, record_property: Any) -> None:
    _check(_bench(tmp_path, "lora", 28, prep_interval=2, timeout=120), record_property)


def test_full_finetune_stall_and_restore_at_qwen2_7b_width(tmp_path: Path, record_property: Any) -> None:
    # One save before the restore point: each ~8 GB write takes seconds of the check's five minutes.
    _check(_bench(tmp_path, "full", 1, prep_interval=4, timeout=150), record_property)

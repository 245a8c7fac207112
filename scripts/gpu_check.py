#!/usr/bin/env python
"""The GPU checks of hf_dynamic_ckpt, on one CUDA device within a time budget: a table and an exit status.

Runs the tests marked `gpu` in `tests/gpu/` under a time budget (`--budget`, shared by the checks
through `GPU_CHECK_DEADLINE`; every child run is cut to what is left) and prints one row per check
with what it measured, in priority order (a spent budget cuts from the end):

- Trainer at Qwen2-7B's widths (LoRA, 2 layers; full fine-tune, 1 layer; bf16): blocking per save, how much of the
  device-to-host copy the next step hides, and that the overlapped copy's wait sits in the optimizer step (CUDA
  events around each step's forward + backward and its optimizer step);
- pinned-memory snapshot on a side stream: host time vs the copy's device time, bandwidth, how much
  of the copy the next step hides, exact contents after the next step changed the weights;
- the NVML device-memory signal the policy reads follows an allocation;
- the CUDA RNG is stored and restored: a run with dropout killed and resumed, losses bit-equal;
- a bf16 Trainer run killed with SIGKILL and resumed bit-exact;
- Trainer + FSDP2 on one GPU (torchrun): sharded saves, and the resume exact or refused as documented;
- the absolute stall and restore at Qwen2-7B's widths (`scripts/bench_real_width.py --device cuda`):
  LoRA with as many of the 28 layers as fit, and a full fine-tune of one layer.

The tests skip themselves without CUDA, and the CPU test runs (`make test`) never select them.

Exit status: 0 every check passed; 1 a check failed, errored, was skipped or did not finish within
the budget; 77 no CUDA device, nothing run (77 is the "skipped" status of automake-style test
harnesses, so a CI job can tell "no GPU here" from "a GPU check failed"); 2 bad arguments.

    python scripts/gpu_check.py               # or: make gpu-check
    python scripts/gpu_check.py -k snapshot   # only the checks whose test name matches (pytest -k)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_GPU = 77
DEADLINE_ENV = "GPU_CHECK_DEADLINE"  # read by tests/gpu/gpu_runs.py
LABELS = {
    "test_a_save_at_qwen2_7b_width_blocks_little_and_the_next_step_hides_its_copy":
        "Qwen2-7B width in Trainer: blocking, copy hidden, where it waits",
    "test_cuda_rng_is_stored_and_restored_for_an_exact_resume": "CUDA RNG in an exact resume",
    "test_bf16_trainer_run_killed_and_resumed_bit_exact": "bf16 Trainer run killed, resumed bit-exact",
    "test_device_memory_signal_reads_nvml_and_follows_an_allocation": "NVML device-memory signal",
    "test_snapshot_is_pinned_asynchronous_exact_and_its_overlap_is_measured": "pinned snapshot on a side stream",
    "test_lora_stall_and_restore_at_qwen2_7b_width": "Qwen2-7B width, LoRA: stall and restore",
    "test_full_finetune_stall_and_restore_at_qwen2_7b_width": "Qwen2-7B width, full fine-tune: stall and restore",
    "test_trainer_fsdp2_saves_sharded_and_resumes_exactly_or_refuses": "Trainer + FSDP2 on one GPU",
}
ORDER = ["test_width_overlap.py", "test_cuda_resume.py", "test_nvml_signal.py", "test_cuda_snapshot.py",
         "test_width_qwen2_7b.py", "test_trainer_fsdp2_gpu.py"]
"""The checks in priority order: what the budget cuts comes from the end."""


def cuda_device() -> str | None:
    """The first CUDA device's name, or `None` without one (or with a CPU-only build of torch)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(0))


def results(xml_path: Path) -> list[tuple[str, str, float, list[tuple[str, str]]]]:
    """(check, outcome with its message, seconds, measurements) per test case of a JUnit XML report."""
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = case.get("name", "?")
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                message = (node.get("message") or "").strip().splitlines()
                outcome = f"{tag.upper()}: {message[0][:200] if message else ''}"
                break
        props = [(p.get("name", ""), p.get("value", "")) for p in case.iter("property")]
        rows.append((LABELS.get(name.split("[")[0], name), outcome, float(case.get("time", 0.0)), props))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all checks (default 420)")
    p.add_argument("-k", default=None, help="pytest -k expression: run only the matching checks")
    args = p.parse_args()
    device = cuda_device()
    if device is None:
        import torch

        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, {build}): nothing was run. Run it on a machine "
              f"with an NVIDIA GPU and a CUDA build of torch in this environment. Exit status {NO_GPU}.",
              file=sys.stderr)
        return NO_GPU
    started = time.time()
    deadline = started + args.budget
    env = {**os.environ, "PYTHONPATH": str(REPO), DEADLINE_ENV: str(deadline)}
    rows: list[tuple[str, str, float, list[tuple[str, str]]]] = []
    codes: list[int] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for name in ORDER:  # one pytest per file: a check that hangs costs the ones after it, not the report
            left = deadline - time.time()
            if left < 20:
                rows.append((name, "NOT RUN: the budget is spent", 0.0, []))
                continue
            report = Path(tmp) / f"{name}.xml"
            cmd = [sys.executable, "-m", "pytest", f"tests/gpu/{name}", "-m", "gpu", "-q", "-rfEs", "-p",
                   "no:cacheprovider", f"--junitxml={report}", "-o", "junit_family=xunit1",
                   f"--basetemp={Path(tmp) / 'runs' / name}", *(["-k", args.k] if args.k else [])]
            try:
                codes.append(subprocess.run(cmd, cwd=REPO, env=env, timeout=left + 15).returncode)
            except subprocess.TimeoutExpired:
                rows.append((name, f"FAILED: did not finish within the budget ({left:.0f} s left)", left, []))
                continue
            found = results(report) if report.exists() else []
            rows += found or ([] if codes[-1] == 5 else [(name, f"FAILED: pytest exit status {codes[-1]}", 0.0, [])])
            print(f"gpu_check: {name} done at {time.time() - started:.0f} s", flush=True)
    print(f"\nGPU checks on {device} ({time.time() - started:.0f} s of a {args.budget:.0f} s budget)")
    print(f"{'check':60s} {'seconds':>8s}  result")
    for label, outcome, seconds, props in rows:
        print(f"{label:60s} {seconds:8.1f}  {outcome}")
        for key, value in props:
            print(f"    {key}: {value}")
    failed = [label for label, outcome, _, _ in rows if outcome != "passed"]
    if not rows or failed:
        print(f"\nNOT PASSED: {', '.join(failed) if failed else 'no check ran'}")
        return 1
    print(f"\nall {len(rows)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

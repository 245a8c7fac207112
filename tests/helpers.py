"""What the tests share: bit-exact tensors and deep state equality (one copy, not five), `save_state`, and
helpers for subprocess workers.

`tests/conftest.py` puts this directory on `sys.path`, so test modules at any depth use
``from helpers import bit_equal, assert_identical``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def same_state(a: Any, b: Any) -> bool:
    """Nested dict/list/tuple equality with bit-exact tensors (containers compared by type)."""
    if isinstance(a, torch.Tensor):
        return bit_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return bool(a == b)


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Deep equality that also checks types (int vs bool vs float, tuple vs list, key types) and NaN."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert bit_equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{path}: key {k!r}"
            assert_identical(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


def model_state_equal(a: torch.nn.Module | dict[str, torch.Tensor],
                      b: torch.nn.Module | dict[str, torch.Tensor]) -> bool:
    """Two models (or state dicts) hold bit-identical tensors under the same names."""
    sa = a.state_dict() if isinstance(a, torch.nn.Module) else a
    sb = b.state_dict() if isinstance(b, torch.nn.Module) else b
    return sa.keys() == sb.keys() and all(bit_equal(sa[k].detach(), sb[k].detach()) for k in sa)


# ---------------------------------------------------------------------- torchrun workers
REPO = Path(__file__).resolve().parents[1]


def torchrun_worker(worker: Path, cwd: Path, *args: str, nproc: int = 2, timeout: float = 400,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `worker` under `torchrun --standalone` (gloo on CPU, one intra-op thread; `env` added to the environment)
    and return the result."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(worker)]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


TRAINER_WORKER = REPO / "tests" / "integration" / "trainer_worker.py"


def trainer_torchrun(out: Path, tag: str, *args: str, expect_ok: bool = True, nproc: int = 2,
                     env: dict[str, str] | None = None, timeout: float = 300) -> list[dict]:
    """`tests/integration/trainer_worker.py` on `nproc` processes (the last one is the one `--kill_at` kills):
    every rank's ``<out>/<tag>-rank<R>.json``, each with the job's stderr under ``"stderr"``."""
    extra = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KILL_RANK": str(nproc - 1), **(env or {})}
    # --standalone: torchrun picks a free rendezvous port itself (no race with other jobs on the machine).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(TRAINER_WORKER), "--out", str(out), "--tag", tag, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **extra}, timeout=timeout)
    detail = f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if expect_ok:
        assert proc.returncode == 0, detail
    else:
        assert proc.returncode != 0, "the crashed job should fail"
    missing = [r for r in range(nproc) if not (out / f"{tag}-rank{r}.json").is_file()]
    assert not missing, f"ranks {missing} wrote no result\n{detail}"
    results = [json.loads((out / f"{tag}-rank{r}.json").read_text()) for r in range(nproc)]
    for r in results:
        r["stderr"] = proc.stderr
    return results


def traceback_tail(proc: subprocess.CompletedProcess[str]) -> str:
    """The first worker traceback (what torchrun's summary hides), else the end of stderr."""
    err = proc.stderr
    at = err.find("Traceback")
    return err[at : at + 4000] if at >= 0 else err[-3000:]


def run_worker(worker: Path, cwd: Path, *args: str, nproc: int = 2, killed: bool = False,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`torchrun_worker`, checked: it succeeded, or (`killed`) every rank SIGKILLed itself (`--kill_at_step`)."""
    proc = torchrun_worker(worker, cwd, *args, nproc=nproc, env=env)
    if killed:
        assert proc.returncode != 0 and ("Signal 9 (SIGKILL)" in proc.stderr or "exitcode  : -9" in proc.stderr), \
            traceback_tail(proc)
    else:
        assert proc.returncode == 0, traceback_tail(proc)
    return proc


def read_loss_log(path: Path, key: str = "step") -> tuple[int | None, dict[int, dict]]:
    """A worker's JSONL loss log: (the step it resumed from, {step: record} for records holding `key`)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0]["resumed_from"], {d["step"]: d for d in lines[1:] if key in d}


def save_state(store: Any, state: Any, *, reason: str, replace: bool = False, **fields: Any) -> Any:
    """`store.save(state, request)` with a `SaveRequest` of the state's step, epoch and tiers and `reason`; `fields`
    are the request's other fields (`pinned`, `healthy`, `signals`, `debug_info`, ...)."""
    from hf_dynamic_ckpt.store import SaveRequest

    request = SaveRequest(step=int(state.step), epoch=state.epoch, tiers=state.tiers, reason=reason, **fields)
    return store.save(state, request, replace=replace)

"""2-process DDP (torchrun, gloo, `use_cpu=True`): crash on one rank, resume bit-exactly.

Both ranks run `tests/integration/trainer_worker.py`. Rank 1 SIGKILLs itself after step
7 (once the saves of steps 3 and 6 are committed on every rank); torchrun then tears the
job down. The restart with `auto` continues from step 6 on both ranks, bit for bit. With
rank 1's RNG file of step 6 removed, step 6 is never chosen: every rank falls back to
step 3, the newest checkpoint complete on all ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import trainer_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

ARGS = ("--model", "full", "--max_steps", "9", "--ga", "1", "--examples", "48")


def torchrun(out: Path, tag: str, *args: str, expect_ok: bool = True) -> list[dict]:
    return trainer_torchrun(out, tag, *args, expect_ok=expect_ok)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    base = tmp_path_factory.mktemp("ddp")
    ref = torchrun(base / "ref", "ref", *ARGS)
    crash = torchrun(base / "crash", "crash", *ARGS, "--kill_at", "7", expect_ok=False)
    assert all(c["killed"] for c in crash)
    for r in range(2):
        assert crash[r]["losses"] == ref[r]["losses"][:7]
    step6 = base / "crash" / "run" / "smart_ckpt" / "default" / "step-6"
    assert sorted(p.name for p in step6.glob("rng-rank*.json")) == ["rng-rank0.json", "rng-rank1.json"]
    return base, ref


def test_ddp_crash_on_one_rank_resumes_exactly(crashed: tuple[Path, list[dict]]) -> None:
    base, ref = crashed
    out = base / "resume"
    shutil.copytree(base / "crash", out)
    resumed = torchrun(out, "resume", *ARGS, "--resume", "auto")
    for r in range(2):
        assert resumed[r]["resumed_from"] == 6
        assert resumed[r]["losses"] == ref[r]["losses"][6:]
    assert ref[0]["losses"] != ref[1]["losses"]  # the ranks saw different data


def test_checkpoint_missing_one_ranks_files_is_never_chosen(crashed: tuple[Path, list[dict]]) -> None:
    base, ref = crashed
    out = base / "missing"
    shutil.copytree(base / "crash", out)
    (out / "run" / "smart_ckpt" / "default" / "step-6" / "rng-rank1.json").unlink()
    # Rank 0 lists the candidates after rank 1 has failed to read step 6 (which records it as corrupt in the
    # catalog): the ranks still agree on what they tried, and rank 0 says why step 6 was skipped.
    resumed = torchrun(out, "resume", *ARGS, "--resume", "auto", "--rank0_fault", "resume:sleep=3000")
    for r in range(2):
        assert resumed[r]["resumed_from"] == 3
        assert resumed[r]["losses"] == ref[r]["losses"][3:]
    assert "step 6 is not complete on every rank: rank 1: " in resumed[0]["stderr"]


def test_ddp_sigterm_on_one_rank_saves_on_all_and_continues_exactly(crashed: tuple[Path, list[dict]],
                                                                     tmp_path: Path) -> None:
    _, ref = crashed
    # Rank 0 alone gets SIGTERM after step 4; the flag travels in the step-5 reduction, so both
    # ranks save step 5 (rank 0 commits once rank 1's RNG file is written) and stop cleanly.
    stopped = torchrun(tmp_path, "term", *ARGS, "--base_interval", "100", "--sigterm_at", "4", expect_ok=False)
    assert all(r["exit_code"] == 143 for r in stopped)  # 128 + SIGTERM on every rank: the job is requeued
    for r in range(2):
        assert [e["step"] for e in stopped[r]["events"] if e["reason"].startswith("emergency")] == [5]
        assert len(stopped[r]["losses"]) == 5
    step5 = tmp_path / "run" / "smart_ckpt" / "default" / "step-5"
    assert sorted(p.name for p in step5.glob("rng-rank*.json")) == ["rng-rank0.json", "rng-rank1.json"]
    resumed = torchrun(tmp_path, "resume", *ARGS, "--base_interval", "100", "--resume", "auto")
    for r in range(2):
        assert resumed[r]["resumed_from"] == 5
        assert resumed[r]["losses"] == ref[r]["losses"][5:]

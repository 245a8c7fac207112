"""Retention: pinned never dropped, last N kept, log-spaced history, per-tier expiry."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.policy import plan_retention, tier_retention_from_config
from hf_dynamic_ckpt.store import CheckpointInfo, Removal

DAY = 86400.0


def info(step: int, *, pinned: bool = False, healthy: bool = True, age_days: float = 0.0,
         tiers: frozenset[Tier] = ALL_TIERS, now: float = 1e9) -> CheckpointInfo:
    return CheckpointInfo(task_id="t", step=step, path=f"/x/step-{step}", reason="interval", tiers=tiers, bytes=1,
                          loss=None, gpu_mem_percent=None, save_time=now - age_days * DAY, recovery_cost_ms=None,
                          healthy=healthy, pinned=pinned, status="ok")


def test_log_spaced_retention_over_10000_steps_is_logarithmic_and_keeps_pinned() -> None:
    keep_last, pinned_steps = 3, {1230, 5550, 7770}
    kept: list[CheckpointInfo] = []
    max_count: dict[int, int] = {}
    deleted_whole: list[int] = []
    for step in range(10, 10001, 10):
        kept.append(info(step, pinned=step in pinned_steps))
        plan = plan_retention(kept, keep_last=keep_last, now=1e9)
        assert all(r.tiers == ALL_TIERS for r in plan)
        gone = {id(r.info) for r in plan}
        deleted_whole += [r.info.step for r in plan]
        kept = [i for i in kept if id(i) not in gone]
        max_count[step] = len(kept)
    steps = sorted(i.step for i in kept)
    assert pinned_steps <= set(steps)  # never drops pinned
    assert not pinned_steps & set(deleted_whole)
    assert steps[-keep_last:] == [9980, 9990, 10000]
    assert steps[0] == 10  # the first checkpoint is never thinned
    # O(log n): bounded by keep_last + pinned + one per power-of-two age bucket.
    for step, count in max_count.items():
        bound = keep_last + len(pinned_steps) + math.floor(math.log2(step)) + 2
        assert count <= bound, (step, count, bound)
    assert max_count[10000] <= 3 + 3 + 15
    assert len(deleted_whole) == 1000 - max_count[10000]  # everything else was pruned


def test_without_log_spacing_only_last_n_and_pinned_survive() -> None:
    infos = [info(s, pinned=s == 20) for s in range(10, 110, 10)]
    plan = plan_retention(infos, keep_last=2, log_spaced=False, now=1e9)
    assert sorted(r.info.step for r in plan) == [10, 30, 40, 50, 60, 70, 80]


def test_newest_healthy_is_kept_even_beyond_keep_last() -> None:
    infos = [info(10), info(20), info(30, healthy=False), info(40, healthy=False)]
    plan = plan_retention(infos, keep_last=1, log_spaced=False, now=1e9)
    assert sorted(r.info.step for r in plan) == [10, 30]


def test_per_tier_retention_drops_old_optimizer_before_weights() -> None:
    retention = tier_retention_from_config(SmartCkptConfig())
    assert retention == {Tier.WEIGHTS: 30, Tier.OPTIMIZER: 7, Tier.STATE: 90}
    infos = [
        info(100, age_days=40),               # weights expired: whole checkpoint goes
        info(200, age_days=10),               # optimizer (7 d) expired, weights (30 d) not
        info(300, age_days=10, tiers=frozenset({Tier.WEIGHTS, Tier.STATE})),  # no L1 to drop
        info(400, age_days=50, pinned=True),  # pinned: untouched
        info(500, age_days=3),
        info(600, age_days=20),               # newest (keep_last): nothing expires on it
    ]
    plan = plan_retention(infos, keep_last=1, log_spaced=False, tier_retention=retention, now=1e9)
    assert [(r.info.step, r.tiers) for r in plan] == [(100, ALL_TIERS), (200, ALL_TIERS), (300, ALL_TIERS),
                                                      (500, ALL_TIERS)]  # thinning alone: only last + pinned
    # Log-spaced: ages behind step 600 are 500, 400, 300, 100 -> buckets 9, 9, 9, 7. Step 100's weights
    # expired, so the oldest *surviving* checkpoint of bucket 9 (step 200) is kept, without its optimizer.
    plan = plan_retention(infos, keep_last=1, tier_retention=retention, now=1e9)
    assert [(r.info.step, r.tiers) for r in plan] == [
        (100, ALL_TIERS),
        (200, frozenset({Tier.OPTIMIZER})),
        (300, ALL_TIERS),
    ]


def test_retention_rejects_bad_keep_last_and_handles_empty() -> None:
    assert plan_retention([], keep_last=3, now=0.0) == []
    with pytest.raises(ValueError, match="keep_last=0"):
        plan_retention([info(1)], keep_last=0, now=0.0)


def test_abandoned_checkpoints_wait_for_the_live_timeline_to_pass_them() -> None:
    def abandoned(step: int, *, pinned: bool = False) -> CheckpointInfo:
        return dataclasses.replace(info(step, pinned=pinned), abandoned=True)

    # A run crashed after 50 and resumed from 20: 30, 40 (pinned) and 50 are an abandoned timeline.
    old = [info(10), info(20), abandoned(30), abandoned(40, pinned=True), abandoned(50)]
    # They never count as "newest" (so 10 and 20 stay the protected newest) and are not thinned yet.
    assert plan_retention(old, keep_last=2, log_spaced=False, now=1e9) == []
    assert plan_retention([*old, info(25)], keep_last=2, log_spaced=False, now=1e9) == [
        Removal(old[0], ALL_TIERS, "keep_last=2 (keep_log_spaced=false): only the newest 2 are kept")]
    # Once the live timeline has committed a greater step they go, whole; the pinned one never.
    plan = plan_retention([*old, info(25), info(35)], keep_last=2, log_spaced=False, now=1e9)
    assert [(r.info.step, r.info.abandoned, r.tiers) for r in plan] == [(10, False, ALL_TIERS), (20, False, ALL_TIERS),
                                                                  (30, True, ALL_TIERS)]
    plan = plan_retention([*old, info(25), info(60)], keep_last=3, now=1e9)
    assert [(r.info.step, r.info.abandoned) for r in plan] == [(30, True), (50, True)]
    # Expired tiers do not touch an abandoned checkpoint before that either.
    aged = [info(100), dataclasses.replace(info(200, age_days=40), abandoned=True)]
    assert plan_retention(aged, keep_last=1, tier_retention={Tier.WEIGHTS: 30.0}, now=1e9) == []


def test_every_planned_removal_names_its_rule() -> None:
    infos = [info(s) for s in (4, 8, 12, 16, 20, 24, 25)]
    plan = plan_retention(infos, keep_last=3, now=1e9)
    assert [(r.info.step, r.rule) for r in plan] == [
        (8, "keep_last=3 and log-spaced history (keep_log_spaced): one checkpoint per power-of-two age bucket is kept, "
            "and step 8 (17 steps behind step 25) shares its bucket with the older step 4"),
        (16, "keep_last=3 and log-spaced history (keep_log_spaced): one checkpoint per power-of-two age bucket is "
             "kept, and step 16 (9 steps behind step 25) shares its bucket with the older step 12"),
    ]
    plan = plan_retention(infos, keep_last=2, log_spaced=False, now=1e9)
    assert {r.rule for r in plan} == {"keep_last=2 (keep_log_spaced=false): only the newest 2 are kept"}
    aged = [info(s, age_days=10.0) for s in (1, 2, 3)]
    plan = plan_retention(aged, keep_last=1, tier_retention={Tier.OPTIMIZER: 7.0}, now=1e9)
    assert [(r.info.step, r.tiers, r.rule) for r in plan] == [
        (s, frozenset({Tier.OPTIMIZER}), "the optimizer tier is older than storage_levels.level_1.retention_days=7")
        for s in (1, 2)]


def test_keep_last_none_keeps_every_checkpoint_and_tiers_still_expire_by_age() -> None:
    infos = [info(s) for s in range(1, 200)]
    assert plan_retention(infos, keep_last=None, now=1e9) == []
    aged = [info(s, age_days=10.0) for s in (1, 2, 3)]
    plan = plan_retention(aged, keep_last=None, tier_retention={Tier.OPTIMIZER: 7.0}, now=1e9)
    # Only tiers expire, never those of the newest checkpoint.
    assert [(r.info.step, r.tiers) for r in plan] == [(s, frozenset({Tier.OPTIMIZER})) for s in (1, 2)]
    assert SmartCkptConfig(keep_last=None).keep_last is None
    with pytest.raises(ValueError, match="keep_last=0 is invalid: expected an integer >= 1, or null"):
        SmartCkptConfig(keep_last=0)

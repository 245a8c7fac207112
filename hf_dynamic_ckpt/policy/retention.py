"""What to keep (separate from when to save): pinned, the newest N, log-spaced history, per-tier expiry, abandoned
timelines (docs/policy.md section 5). Log spacing keeps the *oldest* checkpoint of each power-of-two age bucket
`[2^k, 2^(k+1))` behind the newest: a checkpoint only ever moves to higher buckets, so the first one is never thinned
and the number kept grows like `log2(steps)`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..config import SmartCkptConfig
from ..constants import ALL_TIERS, Tier
from ..store import CheckpointInfo, Removal

SECONDS_PER_DAY = 86400.0
_TIER_KEY = {Tier.WEIGHTS: "level_0", Tier.OPTIMIZER: "level_1", Tier.STATE: "level_2"}


def tier_retention_from_config(config: SmartCkptConfig) -> dict[Tier, float | None]:
    """`{tier: retention_days}` from `config.storage_levels` (L0 weights, L1 optimizer, L2 state)."""
    return {tier: getattr(config.storage_levels, key).retention_days for tier, key in _TIER_KEY.items()}


def plan_retention(infos: Iterable[CheckpointInfo], *, keep_last: int | None, log_spaced: bool = True,
                   tier_retention: Mapping[Tier, float | None] | None = None, now: float) -> list[Removal]:
    """What to delete of `infos` (the task's committed checkpoints, any order), oldest first, each with its `rule`.
    Pure: reads only the infos given, deletes nothing. The newest `keep_last` are kept whole (`None`: every live one,
    only `tier_retention`, days per tier, still removes tiers by age at `now`); `log_spaced` keeps the oldest of each
    power-of-two age bucket too. A removal with `Tier.WEIGHTS` (then `ALL_TIERS`) is the whole checkpoint, else only
    those tiers' files. Pinned checkpoints never appear; an abandoned one appears (whole) once a live checkpoint of a
    greater step exists."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} is invalid: expected an integer >= 1, or None (keep every one).")
    infos = list(infos)
    ordered = sorted((i for i in infos if not i.abandoned), key=lambda i: i.step, reverse=True)  # the live ones
    newest = ordered[0].step if ordered else -1
    # keep_last=None keeps every checkpoint: nothing is thinned, only tiers expire by age (never the newest's).
    protected = {id(i) for i in ordered[:1 if keep_last is None else keep_last]}
    # Keep the newest healthy checkpoint too: it is the restore point `auto` resolves to.
    if (healthy := next((i for i in ordered if i.healthy), None)) is not None:
        protected.add(id(healthy))
    days = tier_retention or {}  # the tiers older than their retention, of each checkpoint that may lose any
    expired = {id(i): frozenset(t for t in i.tiers if (d := days.get(t)) is not None and (now - i.save_time) /
                                SECONDS_PER_DAY > d) for i in ordered if id(i) not in protected and not i.pinned}
    # Checkpoints whose weights expired go first, so thinning never keeps one that is about to vanish.
    dead = {k for k, tiers in expired.items() if Tier.WEIGHTS in tiers}
    oldest_in_bucket = {_bucket(newest - i.step): i for i in ordered if id(i) in expired and id(i) not in dead} if \
        log_spaced and keep_last is not None else {}  # newest -> oldest: the last one seen in a bucket stays
    keep = {id(i) for i in oldest_in_bucket.values()} | {id(i) for i in ordered if keep_last is None}
    plan: list[Removal] = []
    for info in reversed(ordered):
        tiers = expired.get(id(info))
        if tiers is None:  # pinned or protected
            continue
        if id(info) in dead:
            plan.append(Removal(info, ALL_TIERS, _expiry_rule(Tier.WEIGHTS, tier_retention)))
        elif id(info) not in keep:
            age = newest - info.step
            rule = (f"keep_last={keep_last} and log-spaced history (keep_log_spaced): one checkpoint per power-of-two "
                    f"age bucket is kept, and step {info.step} ({age} steps behind step {newest}) shares its bucket "
                    f"with the older step {oldest_in_bucket[_bucket(age)].step}") if log_spaced else \
                f"keep_last={keep_last} (keep_log_spaced=false): only the newest {keep_last} are kept"
            plan.append(Removal(info, ALL_TIERS, rule))
        elif tiers:
            plan.append(Removal(info, tiers, "; ".join(_expiry_rule(t, tier_retention) for t in sorted(tiers))))
    plan += [Removal(i, ALL_TIERS, f"abandoned timeline: the run went back before step {i.step} and has saved "
                                   f"past it since (step {newest})")
             for i in infos if i.abandoned and not i.pinned and ordered and newest > i.step]
    return sorted(plan, key=lambda p: p.info.step)


def _expiry_rule(tier: Tier, tier_retention: Mapping[Tier, float | None] | None) -> str:
    days = (tier_retention or {}).get(tier)
    return (f"the {tier.value} tier is older than storage_levels.{_TIER_KEY[tier]}.retention_days={days:g}"
            if days is not None else f"the {tier.value} tier expired")


def _bucket(age_steps: int) -> int:
    return max(0, age_steps).bit_length()  # floor(log2(age)) + 1, and 0 for age 0

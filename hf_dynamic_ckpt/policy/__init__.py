"""Decision policy: when to save (`RulePolicy`, with the optional learned double-check of `learned`), what
(`Decision.tiers`), what to keep (retention)."""

from __future__ import annotations

from ..signals import MINIMAL_TIERS, NO_SAVE, Decision, DecisionKind
from .retention import plan_retention, tier_retention_from_config
from .rules import RulePolicy

__all__ = ["MINIMAL_TIERS", "NO_SAVE", "Decision", "DecisionKind", "RulePolicy", "plan_retention",
           "tier_retention_from_config"]

"""The demo's table of saves matches each save to its checkpoint by the session that wrote it, not by step number.

The situation `make demo` met on a loaded machine, built deterministically: the killed run decided a save of
step 64 that its writer never committed, the restart resumed from step 54 and committed its own step 64. The
table must show the killed run's 64 as not committed, and the restart's 64 (with its size) among the restart's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from examples.demo import format_table, save_table
from hf_dynamic_ckpt.constants import ALL_TIERS
from hf_dynamic_ckpt.store import CheckpointState, CheckpointStore, Lineage, Removal, SaveRequest

KILLED, RESTARTED = "killedrun0001", "restarted0002"
INTERVAL = "interval 10 (base 10 from base_interval, alpha 1.00, beta 0.00)"
RETENTION = "keep_last=4 and log-spaced history (keep_log_spaced)"


def _commit(store: CheckpointStore, step: int, lineage: Lineage, *, reason: str = INTERVAL, kind: str = "interval",
            pinned: bool = False, width: int = 4) -> None:
    state = CheckpointState(step=step, weights={"w": torch.full((width,), float(step))}, rng={"python": [step]},
                            sampler={"batches": step})
    store.save(state, SaveRequest(step=step, tiers=state.tiers, reason=reason, kind=kind, pinned=pinned,
                                  lineage=lineage))


def _row(step: int, *saves: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "loss": 6.0, "grad_norm": 1.0, "risk": 0.0, "time": float(step)}
    if saves:
        row["saves"] = list(saves)
    return row


def _save(step: int, *, reason: str = INTERVAL, kind: str = "interval", pinned: bool = False) -> dict[str, Any]:
    return {"step": step, "reason": reason, "kind": kind, "pinned": pinned, "blocking_ms": 3.0}


def _events() -> list[dict[str, Any]]:
    """The step log: the killed run (a rollback 36 -> 34, saves 10 34 44 54 64, killed after 67), the restart."""
    interval = {10: _save(10), 44: _save(44), 54: _save(54), 64: _save(64), 74: _save(74), 84: _save(84)}
    capture = _save(34, reason="pre_update loss_spike z=2101.9", kind="capture", pinned=True)
    killed = [_row(s, *([interval[s]] if s in interval else [])) for s in range(1, 35)]
    killed += [_row(35, capture), _row(36), {"event": "rollback", "from_step": 36, "to_step": 34, "reason": "x"}]
    killed += [_row(s, *([interval[s]] if s in interval else [])) for s in range(35, 68)]
    restarted = [_row(s, *([interval[s]] if s in interval else [])) for s in range(55, 91)]
    return [*killed, {"event": "resume", "step": 54, "spec": "auto"}, *restarted]


def test_rows_match_the_checkpoints_of_their_own_process(tmp_path: Path) -> None:
    root = tmp_path / "smart_ckpt"
    before, after = Lineage(session=KILLED, timeline="t1"), Lineage(session=KILLED, timeline="t2", parent_step=34)
    restart = Lineage(session=RESTARTED, timeline="t3", parent_step=54, parent_timeline="t2")
    with CheckpointStore(root) as store:
        _commit(store, 10, before)
        _commit(store, 34, before, reason="pre_update loss_spike z=2101.9", kind="capture", pinned=True)
        _commit(store, 44, after)
        _commit(store, 54, after)
        # The killed run's step 64 never reached the store; the restart commits its own 64 (of another size).
        for step in (64, 74, 84):
            _commit(store, step, restart, width=64)
        _commit(store, 90, restart, reason="train_end", kind="train_end", width=64)
        infos = {i.step: i for i in store.list(include_unhealthy=True)}
        store.prune([Removal(infos[10], ALL_TIERS, RETENTION), Removal(infos[54], ALL_TIERS, RETENTION)])
        infos_now = store.list(include_unhealthy=True, include_abandoned=True)
        table = save_table(_events(), [KILLED, RESTARTED], infos_now, store.removed())

    by_identity = {(i.lineage.session, i.step): i for i in infos_now if i.lineage is not None}
    assert [p.session for p in table] == [KILLED, RESTARTED] and [p.resumed_from for p in table] == [None, 54]
    killed, restarted = table
    assert [(r.step, r.at, r.status) for r in killed.rows] == [
        (10, 10, "committed, pruned later (retention)"),
        (34, 35, "committed, pinned"),
        (44, 44, "committed"),
        (54, 54, "the restore point, pruned later (retention)"),
        (64, 64, "not committed (killed)"),
    ]
    assert [(r.step, r.at, r.status) for r in restarted.rows] == [
        (64, 64, "committed"), (74, 74, "committed"), (84, 84, "committed"), (90, None, "committed")]
    assert restarted.rows[-1].reason == "train_end" and restarted.rows[-1].blocking_ms is None
    # Each row against the store: a size exactly when its own process's checkpoint is there, and that one's size.
    for part in table:
        for row in part.rows:
            info = by_identity.get((part.session, row.step))
            assert row.nbytes == (info.bytes if info is not None else None), (part.session, row)
    assert (KILLED, 64) not in by_identity and (RESTARTED, 64) in by_identity  # the step number alone would match

    lines = format_table(table, killed_after=67)
    resume = next(k for k, line in enumerate(lines) if "restart resumed from step 54" in line)
    rows_64 = [k for k, line in enumerate(lines) if line.split()[:2] == ["64", "64"]]
    assert len(rows_64) == 2 and rows_64[0] < resume < rows_64[1], lines
    assert lines[rows_64[0]].endswith("not committed (killed)") and lines[rows_64[1]].endswith("committed"), lines
    assert lines[rows_64[0]].split()[-5] == "-"  # no size for a checkpoint that does not exist
    assert lines[-1].split()[:2] == ["90", "-"] and lines[-1].endswith("committed"), lines


def test_a_save_the_restart_abandoned_and_removed_was_committed(tmp_path: Path) -> None:
    """A killed run's checkpoint past the restore point that the store removed as abandoned was committed."""
    events = [_row(10, _save(10)), _row(20, _save(20)), {"event": "resume", "step": 10, "spec": "auto"},
              _row(20, _save(20)), _row(30, _save(30))]
    removed = {20: {"step": 20, "rule": "abandoned timeline: the run went back before it and has saved past it since"}}
    table = save_table(events, [KILLED, RESTARTED], [], removed)
    assert [r.status for r in table[0].rows] == ["the restore point, no longer in the store",
                                                 "committed, removed later (abandoned timeline)"]
    assert [r.status for r in table[1].rows] == ["not in the store", "not in the store"]

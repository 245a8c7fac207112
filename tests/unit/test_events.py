"""SaveLog metrics: what the `smart_ckpt/*` numbers count."""

from __future__ import annotations

from hf_dynamic_ckpt.constants import Tier
from hf_dynamic_ckpt.run.record import SaveEvent, SaveLog


def _event(step: int, staging: str, error: str | None = None) -> SaveEvent:
    return SaveEvent(step=step, at_step=step, reason="interval", tiers=frozenset({Tier.WEIGHTS}), pinned=False,
                     blocking_ms=10.0, error=error, staging=staging)


def test_streamed_saves_count_only_successful_saves_written_from_the_live_tensors() -> None:
    log = SaveLog()
    for event in (_event(1, "buffered"), _event(2, "streaming"), _event(3, "streaming", error="disk full"),
                  _event(4, "sync"), _event(5, "streaming")):
        log.add(event)
    metrics = log.metrics(risk=0.25, interval=4.0)
    assert metrics["smart_ckpt/streamed_saves"] == 2.0
    assert metrics["smart_ckpt/saves"] == 4.0 and metrics["smart_ckpt/last_save_step"] == 5.0
    assert metrics["smart_ckpt/stall_ms"] == 50.0  # every save's blocking time, failed ones included
    assert log.metrics(risk=None, interval=None)["smart_ckpt/stall_ms"] == 0.0  # reported once


def test_the_wait_for_an_overlapped_copy_counts_as_blocking_once_it_happened() -> None:
    # An overlapped snapshot blocks where the next optimizer step waits for its copy, after the save returned:
    # the policy's overhead budget (the frame's save_blocking_s) and stall_ms see that wait, once.
    class Copy:
        wait_ms: float | None = None

    class Handle:
        deferred = Copy()

    log = SaveLog()
    event = _event(1, "buffered")
    event.handle = Handle()  # type: ignore[assignment]
    log.add(event)
    assert log.take_blocking_s() == 0.01  # the save's own 10 ms; the copy runs beside the next step
    Handle.deferred.wait_ms = 250.0  # the next optimizer step waited for it
    assert log.take_blocking_s() == 0.25
    assert log.take_blocking_s() is None  # counted once
    assert log.metrics(risk=None, interval=None)["smart_ckpt/stall_ms"] == 260.0

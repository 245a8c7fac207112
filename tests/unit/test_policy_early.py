"""Capture from the first optimizer step, no false positives on calm starts, and
windows that continue from the restored state after a resume.

Decision replays on recorded calm runs (`tests/data/traces/` and `tests/data/traces/early/`:
both tiny models, full fine-tune and LoRA, with and without warm-up) with an anomaly injected
by `inject_anomaly`, which is exact up to the onset step (the only step a capture reads).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest

from examples.traces import RecordedTrace, inject_anomaly, load_trace, replay_frames
from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.policy import Decision, DecisionKind, RulePolicy
from hf_dynamic_ckpt.signals import SignalFrame

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
CALM = sorted(TRACES.glob("calm_*.jsonl")) + sorted((TRACES / "early").glob("calm_*.jsonl"))
SHORT = SmartCkptConfig(base_interval=10,
                        policy={"stability_window": 20, "risk_smoothing": 4})  # the demo's short-run settings
CONFIGS = {"short": SHORT, "defaults": SmartCkptConfig(base_interval=10)}
# (kind, factor, anomalous steps): the reported x100 loss, the demo's x30 loss for 4 steps, a NaN
# gradient, a learning rate x20 for 20 steps (a misconfigured schedule).
ANOMALIES = [("loss_x", 100.0, 1), ("loss_x", 30.0, 4), ("nan_grad", 1.0, 1), ("lr_surge", 20.0, 20)]


def surge(trace: RecordedTrace) -> float:
    return 15.0 if "demo" in trace.name else 5.0  # the demo's trained head: calm grad norms jump x7


def replay(policy: RulePolicy, frames: list[SignalFrame]) -> list[tuple[int, Decision]]:
    out = []
    for f in frames:
        for d in (policy.pre_update(f), policy.decide(f)):
            if d.save:
                out.append((f.step, d))
    return out


def test_early_traces_cover_both_models_full_and_lora_with_and_without_warmup() -> None:
    early = [load_trace(p) for p in sorted((TRACES / "early").glob("*.jsonl"))]
    combos = {(t.header["arch"], t.header["lora"], t.header["warmup"] > 0) for t in early}
    assert combos == {(a, lora, w) for a in ("qwen2", "llama") for lora in (True, False) for w in (True, False)}
    assert sum(p.stat().st_size for p in (TRACES / "early").glob("*.jsonl")) < 60_000


@pytest.mark.parametrize("path", CALM, ids=lambda p: p.stem)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_calm_runs_take_no_capture_and_every_save_is_healthy(path: Path, cfg_name: str) -> None:
    trace = load_trace(path)
    config = CONFIGS[cfg_name].replace(policy={"grad_surge_ratio": surge(trace)})
    events = replay(RulePolicy(config), replay_frames(trace))
    assert [(at, d.reason) for at, d in events if d.pin or d.kind != DecisionKind.INTERVAL] == []
    assert [d.step for _, d in events if not d.healthy] == []
    assert len(events) == len(trace.rows) // 10  # the base interval, untouched by the early rules


@pytest.mark.parametrize("path", CALM, ids=lambda p: p.stem)
@pytest.mark.parametrize(("kind", "factor", "steps"), ANOMALIES, ids=lambda v: str(v))
def test_anomaly_at_each_of_steps_2_to_10_is_captured_before_its_update(path: Path, kind: str, factor: float,
                                                                         steps: int) -> None:
    calm = load_trace(path)
    head = dataclasses.replace(calm, rows=calm.rows[:10])  # a capture reads nothing after its onset
    for cfg in CONFIGS.values():
        for onset in range(2, 11):
            trace = inject_anomaly(head, onset, kind, factor=factor, steps=steps)
            events = replay(RulePolicy(cfg.replace(policy={"grad_surge_ratio": surge(calm)})), replay_frames(trace))
            captures = [(at, d) for at, d in events if d.kind == DecisionKind.CAPTURE]
            assert captures, (onset, kind, [d.reason for _, d in events])
            at, d = captures[0]
            assert (at, d.step, d.pin, d.pre_update, d.healthy) == (onset, onset - 1, True, True, True), d.reason
            # The early rules name themselves while the windows are short; the regular ones after.
            if kind != "nan_grad" and onset <= 8:
                assert d.reason.startswith(("pre_update early_grad x", "pre_update early_loss x",
                                            "pre_update early_lr x")), d.reason


def test_early_reasons_name_the_rule_and_the_history_behind_it() -> None:
    calm = load_trace(TRACES / "calm_qwen2.jsonl")  # grad norms 0.4495, 0.4812, 0.468, 0.4399; lr 5e-4 x step
    reasons = {}
    for kind, factor in (("loss_x", 100.0), ("lr_surge", 20.0)):
        for onset in (2, 4):
            events = replay(RulePolicy(SHORT), replay_frames(inject_anomaly(calm, onset, kind, factor=factor)))
            reasons[kind, onset] = next(d.reason for _, d in events if d.pin)
    assert reasons["loss_x", 2] == "pre_update early_grad x107.1 (median of 1 step)"  # 48.12 / 0.4495
    assert reasons["loss_x", 4] == "pre_update early_grad x94.0 (median of 3 steps)"  # 43.99 / 0.468
    assert reasons["lr_surge", 2] == "pre_update early_lr x40.0"  # warm-up doubled the rate too
    assert reasons["lr_surge", 4] == "pre_update early_lr x26.7"


def test_early_bars_double_below_three_values_and_loss_rule_fires_without_gradients() -> None:
    def first_capture(values: list[float], **fields: object) -> str | None:
        policy = RulePolicy(SHORT)
        for step, v in enumerate(values, start=1):
            f = SignalFrame(step=step, loss=v, **fields)  # type: ignore[arg-type]
            d = policy.pre_update(f)
            policy.decide(f)
            if d.save:
                return f"{step}: {d.reason}"
        return None

    assert first_capture([2.0, 12.0]) is None  # x6 < 2 x 4 with one value seen
    assert first_capture([2.0, 17.0]) == "2: pre_update early_loss x8.5 (median of 1 step)"
    assert first_capture([2.0, 2.0, 2.0, 7.0]) is None  # x3.5 < 4
    assert first_capture([2.0, 2.0, 2.0, 8.0]) == "4: pre_update early_loss x4.0 (median of 3 steps)"
    assert first_capture([-1.0, -1.0, -1.0, 50.0]) is None  # no ratio to a non-positive baseline


def test_first_step_grad_norm_orders_of_magnitude_above_the_clip_norm_is_captured() -> None:
    policy = RulePolicy(SHORT)
    assert not policy.pre_update(SignalFrame(step=1, loss=7.0, grad_norm=99.0, clip_norm=1.0)).save
    policy = RulePolicy(SHORT)
    d = policy.pre_update(SignalFrame(step=1, loss=7.0, grad_norm=250.0, clip_norm=1.0))
    assert (d.save, d.step, d.pin, d.reason) == (True, 0, True,
                                                 "pre_update first_step grad_norm 250 = x250 the clip norm 1")
    policy = RulePolicy(SHORT)  # without a clip norm nothing is known at step 1
    assert not policy.pre_update(SignalFrame(step=1, loss=7.0, grad_norm=1e6)).save


@pytest.mark.parametrize("after", [1, 2, 3])
@pytest.mark.parametrize("name", ["calm_qwen2.jsonl", "early/calm_llama_full_nowarmup.jsonl"])
def test_anomaly_right_after_a_resume_is_captured_from_the_restored_windows(name: str, after: int) -> None:
    calm = load_trace(TRACES / name)
    resume_at = 40
    trace = inject_anomaly(calm, resume_at + after, "loss_x", factor=30.0, steps=4)
    frames = replay_frames(trace)
    whole = replay(RulePolicy(SHORT), frames)
    first = RulePolicy(SHORT)
    part = replay(first, frames[:resume_at])
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))  # what the checkpoint stores
    resumed = RulePolicy(SHORT)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # the round trip is exact
    part += replay(resumed, frames[resume_at:])
    assert [(at, d.to_dict()) for at, d in part] == [(at, d.to_dict()) for at, d in whole]
    captures = [d for _, d in part if d.kind == DecisionKind.CAPTURE]
    assert [d.step for d in captures] == [resume_at + after - 1]
    assert not captures[0].reason.startswith("pre_update early_")  # the windows continued: the regular rules judged it
    # A policy that forgot its windows would only have the early rules, from a history of `after - 1` steps.
    fresh = replay(RulePolicy(SHORT), [SignalFrame(step=f.step, loss=f.loss, grad_norm=f.grad_norm, lr=f.lr)
                                       for f in frames[resume_at:]])
    assert all(d.reason.startswith("pre_update early_") for _, d in fresh if d.pin)


def test_version_1_state_warms_up_again_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.policy")
    policy = RulePolicy(SHORT)
    replay(policy, [SignalFrame(step=s, loss=2.0, grad_norm=1.0) for s in range(1, 30)])
    policy.load_state_dict({"version": 1, "loss": {"maxlen": 20, "values": [2.0]}, "risk": [0.5]})
    assert policy.state_dict() == RulePolicy(SHORT).state_dict()
    assert [r.getMessage() for r in caplog.records] == [
        "policy state version 1 (an older release) is not restored: the statistics warm up again from the next step "
        "(early rules guard the first steps)."]
    d = policy.pre_update(SignalFrame(step=31, loss=2.0, grad_norm=1.0))  # warm-up: early rules, from nothing
    assert not d.save and math.isclose(policy.risk, 0.0)

"""RulePolicy through its public API: frame-only inputs, the saved state (round trip, format), kinds, health."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from test_policy import calm, run

from examples.traces import load_trace, replay_frames
from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.errors import ConfigError
from hf_dynamic_ckpt.policy import Decision, DecisionKind, RulePolicy
from hf_dynamic_ckpt.signals import SignalFrame

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
STATE_V2 = Path(__file__).resolve().parents[1] / "data" / "policy_state_v2.json"
DEMO = SmartCkptConfig(base_interval=10,
                       policy={"stability_window": 20, "risk_smoothing": 4, "grad_surge_ratio": 15.0})  # demo.py's


def eventful_frames() -> list[SignalFrame]:
    """600 steps with a grad surge, a memory episode, a loss explosion, a memory ramp, save costs in some frames."""
    frames = []
    for s in range(1, 601):
        extra: dict[str, object] = {}
        if s == 150:
            extra["grad_norm"] = 40.0
        if 250 <= s < 275:
            extra["device_mem_frac"] = 0.97
        if 400 <= s < 404:
            extra.update(loss=60.0, grad_norm=30.0)
        if 450 <= s < 560 and s % 5 == 0:  # a leak: memory ramps towards the threshold
            extra["device_mem_frac"] = min(0.95, 0.5 + 0.004 * (s - 450))
        if s % 37 == 0:
            extra["save_blocking_s"] = 0.02 + 0.001 * (s % 5)
        frames.append(calm(s, seed=4, **extra))
    return frames


# ------------------------------------------------------------------ agreed inputs
def test_same_frames_same_decisions_whatever_each_rank_measures_locally() -> None:
    """Under DDP every rank feeds the same reduced frame; a rank-local save cost must change nothing."""
    cfg = SmartCkptConfig(policy={"mtbf_hours": 0.2, "stability_window": 20})  # derived interval: the save cost matters
    frames = eventful_frames()
    rank0, rank1 = RulePolicy(cfg), RulePolicy(cfg)
    d0, d1 = [], []
    for f in frames:
        for policy, out in ((rank0, d0), (rank1, d1)):
            for d in (policy.pre_update(f), policy.decide(f)):
                out.append(d.to_dict())
    assert d0 == d1
    assert rank0.state_dict() == rank1.state_dict()
    # The cost in the frames does matter: a different cost gives other intervals.
    other = [dataclasses.replace(f, save_blocking_s=30.0 if f.save_blocking_s else None) for f in frames]
    assert [d["step"] for d in map(Decision.to_dict, _saves(RulePolicy(cfg), other))] != \
           [d["step"] for d in d0 if d["save"]]


def _saves(policy: RulePolicy, frames: list[SignalFrame]) -> list[Decision]:
    return [d for f in frames for d in (policy.pre_update(f), policy.decide(f)) if d.save]


# ------------------------------------------------------------------ health
def test_saves_inside_the_demo_explosion_are_unhealthy_and_the_capture_is_the_restore_point(
        caplog: pytest.LogCaptureFixture) -> None:
    """The demo's loss x30 at steps 35-38: its risk_edge save at 38 (loss 178.2) was marked healthy."""
    caplog.set_level(logging.DEBUG, logger="hf_dynamic_ckpt.policy")
    trace = load_trace(TRACES / "anomaly_demo_qwen2.jsonl")
    ((onset, kind),) = trace.onsets
    assert kind == "loss_x"
    saves = _saves(RulePolicy(DEMO), replay_frames(trace))
    inside = [d for d in saves if d.step is not None and onset <= d.step < onset + 4]
    assert [(d.step, d.kind, d.healthy) for d in inside] == [(37, DecisionKind.INTERVAL, False),
                                                             (38, DecisionKind.RISK_EDGE, False)]
    capture = next(d for d in saves if d.kind == DecisionKind.CAPTURE)
    assert (capture.step, capture.pin, capture.healthy) == (onset - 1, True, True)
    # What `auto` sees right after the window: the newest healthy checkpoint is the pinned capture.
    healthy = [d.step for d in saves if d.healthy and d.step is not None and d.step < onset + 4]
    assert max(healthy) == onset - 1
    assert all(d.healthy for d in saves if d.step is not None and d.step < onset - 1)
    messages = [r.getMessage() for r in caplog.records if "marked unhealthy" in r.getMessage()]
    assert messages[0] == ("step 37: the checkpoint of step 37 is marked unhealthy (this step's update was bad: "
                           "grad_surge x38.9)")
    assert messages[1] == ("step 38: the checkpoint of step 38 is marked unhealthy (this step's update was bad: "
                           "grad_surge x57.8)")


def test_a_save_while_the_training_risk_is_high_is_unhealthy(caplog: pytest.LogCaptureFixture) -> None:
    """Gradients x4.8 for a while: no capture rule fires (below 5x), but the smoothed risk rises."""
    caplog.set_level(logging.DEBUG, logger="hf_dynamic_ckpt.policy")
    policy = RulePolicy(SmartCkptConfig(base_interval=1000, policy={"max_interval": 1000}))
    frames = [calm(s, **({"grad_norm": 4.8} if 61 <= s < 76 else {})) for s in range(1, 120)]
    saves = _saves(policy, frames)
    assert [(d.step, d.kind, d.healthy) for d in saves] == [(69, DecisionKind.RISK_EDGE, False)]
    assert [r.getMessage() for r in caplog.records if "marked unhealthy" in r.getMessage()] == [
        "step 69: the checkpoint of step 69 is marked unhealthy (training risk 0.73 >= risk_threshold 0.68)"]


def test_memory_risk_does_not_make_a_checkpoint_unhealthy() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=1000, policy={"max_interval": 1000}))
    saves = _saves(policy, [calm(s, device_mem_frac=0.97 if s > 30 else 0.5) for s in range(1, 60)])
    assert [(d.kind, d.healthy) for d in saves] == [(DecisionKind.RISK_EDGE, True)]


def test_a_bad_update_that_was_skipped_leaves_a_healthy_state() -> None:
    frames = [calm(s, **({"loss": 60.0, "grad_norm": 30.0, "preempt": True} if s == 40 else {})) for s in range(1, 41)]
    for skip, healthy in ((False, False), (True, True)):
        policy = RulePolicy(SmartCkptConfig(base_interval=100, policy={"skip_bad_update": skip}))
        decisions = [(policy.pre_update(f), policy.decide(f)) for f in frames]
        pre, post = decisions[-1]
        assert pre.save and pre.healthy and pre.skip_update is skip
        assert (post.save, post.step, post.healthy) == (True, 40, healthy)


# ------------------------------------------------------------------ state
def test_the_state_round_trip_is_exact_at_every_split() -> None:
    cfg = SmartCkptConfig(policy={"stability_window": 30, "mtbf_hours": 0.05, "risk_smoothing": 5})
    frames = eventful_frames()
    whole = RulePolicy(cfg)
    whole_decisions = [d.to_dict() for f in frames for d in (whole.pre_update(f), whole.decide(f))]
    for split in (1, 5, 151, 260, 402, 599):
        first = RulePolicy(cfg)
        decisions = [d.to_dict() for f in frames[:split] for d in (first.pre_update(f), first.decide(f))]
        text = json.dumps(first.state_dict(), allow_nan=False)  # strict JSON
        state = json.loads(text)
        assert set(state) == {"version", "levels", "cadence", "smoother", "capture", "preemption", "edge", "memory",
                              "health", "suppressed", "history", "decisions"}
        assert state["version"] == 2
        resumed = RulePolicy(cfg)
        resumed.load_state_dict(state)
        assert json.dumps(resumed.state_dict(), allow_nan=False) == text
        decisions += [d.to_dict() for f in frames[split:] for d in (resumed.pre_update(f), resumed.decide(f))]
        assert decisions == whole_decisions, split


def test_unknown_or_malformed_state_raises_and_changes_nothing() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=4))
    run(policy, [calm(s) for s in range(1, 30)])
    good = json.loads(json.dumps(policy.state_dict()))
    with pytest.raises(ConfigError,
                       match=r"^policy state version=7 is not supported: expected 2 \(or 1, which restarts"):
        policy.load_state_dict({**good, "version": 7})
    bad = json.loads(json.dumps(good))
    bad["levels"] = {"loss": [1.0]}  # no grad window: written by something else
    with pytest.raises(ConfigError, match=r"^policy state is malformed \(KeyError: 'grad'\)"):
        policy.load_state_dict(bad)
    bad = json.loads(json.dumps(good))
    bad["edge"] = {"armed": "yes"}
    with pytest.raises(ConfigError, match=r"^policy state: edge\.armed='yes' is invalid: expected bool\.$"):
        policy.load_state_dict(bad)
    bad = json.loads(json.dumps(good))
    bad["capture"]["last_step"] = True
    with pytest.raises(ConfigError, match=r"^policy state: capture\.last_step=True is invalid: expected int or "):
        policy.load_state_dict(bad)
    bad = json.loads(json.dumps(good))
    del bad["capture"]["last_step"]
    with pytest.raises(ConfigError, match=r"^policy state is malformed \(KeyError: 'last_step'\)"):
        policy.load_state_dict(bad)
    assert policy.state_dict() == good


def test_a_state_saved_by_the_previous_release_resumes_exactly() -> None:
    """Manifests on disk hold `RulePolicy.state_dict()` version 2: one written by the release before this layout of the
    code (30 calm steps, base_interval=4, then saved) loads, is written back unchanged, and decides as it would have."""
    saved = json.loads(STATE_V2.read_text())
    policy = RulePolicy(SmartCkptConfig(base_interval=4))
    policy.load_state_dict(saved["state"])
    assert json.dumps(policy.state_dict()) == json.dumps(saved["state"])
    frames = [SignalFrame(**f) for f in saved["next_frames"]]
    assert [d.to_dict() for f in frames for d in (policy.pre_update(f), policy.decide(f))] == saved["next_decisions"]


def test_every_decision_carries_its_kind() -> None:
    prefixes = {DecisionKind.INTERVAL: "interval ", DecisionKind.RISK_EDGE: "risk_edge ",
                DecisionKind.MEMORY: "memory_ramp ", DecisionKind.CAPTURE: "pre_update ",
                DecisionKind.PREEMPTION: "preemption"}
    frames = [*eventful_frames(), calm(601, preempt=True)]
    frames += [calm(s) for s in range(602, 640)]
    policy = RulePolicy(SmartCkptConfig(base_interval=25, policy={"stability_window": 30}))
    seen = set()
    for f in frames:
        for d in (policy.pre_update(f), policy.decide(f)):
            if d.save:
                assert d.reason.startswith(prefixes[d.kind]), (d.kind, d.reason)
                seen.add(d.kind)
            else:
                assert d.kind == DecisionKind.NONE, d
    assert seen == set(prefixes)


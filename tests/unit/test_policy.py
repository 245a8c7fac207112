"""RulePolicy on given signal sequences: intervals, anomaly capture, memory, budget, resume."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import random

import pytest

from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.policy import MINIMAL_TIERS, Decision, DecisionKind, RulePolicy
from hf_dynamic_ckpt.signals import SignalFrame


def calm(step: int, *, seed: int = 0, scale: float = 1.0, **extra: object) -> SignalFrame:
    rng = random.Random(seed * 100003 + step)
    fields = {"loss": scale * (2.0 + 0.02 * rng.gauss(0, 1)), "grad_norm": 1.0 + 0.05 * rng.gauss(0, 1),
              "step_time_s": 0.1, "lr": 1e-4}
    fields.update(extra)
    return SignalFrame(step=step, **fields)  # type: ignore[arg-type]


def run(policy: RulePolicy, frames: list[SignalFrame]) -> list[tuple[int, str, Decision]]:
    """Drive the policy like the checkpointer does: pre_update, then decide, per step."""
    out = []
    for f in frames:
        pre = policy.pre_update(f)
        if pre.save:
            out.append((f.step, "pre", pre))
        d = policy.decide(f)
        if d.save:
            out.append((f.step, "post", d))
    return out


def saved_steps(events: list[tuple[int, str, Decision]]) -> list[int]:
    return [d.step for _, _, d in events]  # type: ignore[misc]


# ------------------------------------------------------------------ regular interval
def test_stable_loss_saves_at_base_interval() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=20))
    events = run(policy, [calm(s) for s in range(1, 201)])
    steps = saved_steps(events)
    assert len(steps) == 10
    for i, s in enumerate(steps, start=1):
        assert abs(s - 20 * i) <= 1, steps
    assert all(d.reason.startswith("interval") and d.tiers == ALL_TIERS and not d.pin for _, _, d in events)


def test_base_interval_four_saves_every_four_steps() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=4))
    assert saved_steps(run(policy, [calm(s) for s in range(1, 21)])) == [4, 8, 12, 16, 20]


def test_no_saves_before_min_interval() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=2, policy={"min_interval": 10}))
    # Sustained high memory drives the smoothed risk to 1: still nothing closer than min_interval.
    frames = [calm(s, device_mem_frac=0.97 if s > 30 else 0.5) for s in range(1, 101)]
    steps = saved_steps(run(policy, frames))
    assert steps[0] == 10
    assert all(b - a >= 10 for a, b in itertools.pairwise(steps)), steps


def test_young_daly_base_from_measured_cost() -> None:
    cfg = SmartCkptConfig(policy={"mtbf_hours": 1.0, "stability_window": 50, "max_interval": 5000})
    policy = RulePolicy(cfg)
    events = run(policy, [calm(s) for s in range(1, 51)])
    assert saved_steps(events) == [50]  # bootstrap: one stability window, to measure the cost
    assert run(policy, [calm(51, save_blocking_s=0.5)]) == []  # the save of step 50 blocked 0.5 s
    # T = sqrt(2 * 0.5 s * 3600 s) = 60 s = 600 steps of 0.1 s
    assert policy.current_interval().base == pytest.approx(600.0)
    events = run(policy, [calm(s) for s in range(52, 1300)])
    assert saved_steps(events) == [650, 1250]


def test_interval_shrinks_with_risk_not_grows() -> None:
    cfg = SmartCkptConfig(base_interval=100, policy={"risk_gain": 4.0})
    policy = RulePolicy(cfg)
    run(policy, [calm(s) for s in range(1, 30)])
    calm_interval = policy.current_interval().steps
    run(policy, [calm(s, device_mem_frac=0.99) for s in range(30, 45)])
    assert policy.risk == pytest.approx(1.0)
    assert policy.current_interval().steps == pytest.approx(calm_interval / 5.0)  # T_base * alpha / (1 + k * beta)


def test_alpha_is_scale_free() -> None:
    """The same noisy sequence in different loss units gives the same decisions."""

    def noisy(scale: float) -> list[SignalFrame]:
        rng = random.Random(7)
        return [SignalFrame(step=s, loss=scale * (2.0 + 0.6 * rng.gauss(0, 1)), step_time_s=0.1) for s in range(1, 400)]

    a, b = RulePolicy(SmartCkptConfig(base_interval=50)), RulePolicy(SmartCkptConfig(base_interval=50))
    ea, eb = run(a, noisy(1.0)), run(b, noisy(1000.0))
    assert a.alpha == pytest.approx(b.alpha)
    assert a.alpha < 1.0  # noise 0.6/2 = 30 % > stability_cv: saves come more often
    assert saved_steps(ea) == saved_steps(eb)
    assert len(ea) > 399 // 50


# ------------------------------------------------------------------ pre-anomaly capture
@pytest.mark.parametrize(
    ("anomaly", "reason"),
    [
        ({"loss": 20.0}, "loss_spike"),
        ({"grad_norm": 10.0}, "grad_surge"),
        ({"lora_max_ratio": 10.0, "lora_max_layer": "model.layers.0.self_attn.q_proj"}, "lora_surge"),
        ({"grad_norm": math.nan, "nonfinite": True}, "nonfinite"),
        ({"lr": 1e-3}, "lr_surge x10.0"),
    ],
)
def test_anomaly_at_step_k_captures_state_before_update(anomaly: dict[str, object], reason: str) -> None:
    k = 137
    policy = RulePolicy(SmartCkptConfig(base_interval=50))
    frames = [calm(s, **(anomaly if s == k else {})) for s in range(1, 160)]
    events = run(policy, frames)
    captures = [(at, d) for at, kind, d in events if kind == "pre"]
    assert len(captures) == 1
    at, d = captures[0]
    assert at == k and d.step == k - 1
    assert d.pre_update and d.pin and d.healthy and d.tiers == ALL_TIERS
    assert reason in d.reason
    assert not d.skip_update


def test_linear_warmup_is_not_an_lr_surge() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=1000, policy={"max_interval": 1000}))
    events = run(policy, [calm(s, lr=1e-4 * min(1.0, s / 100)) for s in range(1, 300)])
    assert events == []


def test_skip_bad_update_is_requested_when_configured() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=50, policy={"skip_bad_update": True}))
    run(policy, [calm(s) for s in range(1, 40)])
    d = policy.pre_update(calm(40, grad_norm=math.inf, nonfinite=True))
    assert d.save and d.skip_update and d.pin
    # The update was skipped: what is saved afterwards is still healthy.
    assert policy.decide(calm(40, grad_norm=math.inf, nonfinite=True)).healthy


def test_nan_update_applied_pauses_saves_until_finite_again() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=5))
    run(policy, [calm(s) for s in range(1, 20)])
    bad = calm(20, grad_norm=math.nan, nonfinite=True)
    capture = policy.pre_update(bad)
    assert capture.save and capture.healthy and capture.step == 19
    after = [policy.decide(bad)]
    for s in range(21, 36):  # NaN weights -> NaN loss: no capture, no save of the poisoned state
        f = calm(s, loss=math.nan, grad_norm=math.nan, nonfinite=True)
        assert not policy.pre_update(f).save
        after.append(policy.decide(f))
    assert not any(d.save for d in after)
    assert not any(d.healthy for d in after)
    final = policy.decide(calm(36, loss=math.nan, grad_norm=math.nan, nonfinite=True, preempt=True))
    assert final.save and final.reason == "preemption" and not final.healthy
    assert policy.decide(calm(37)).healthy  # finite signals again (e.g. after a rollback)


def test_isolated_noise_adds_at_most_one_save_per_window() -> None:
    window = 100
    cfg = SmartCkptConfig(base_interval=25, policy={"stability_window": window})
    rng = random.Random(3)
    spikes = set()
    s = 120
    while s < 1000:  # one-step spikes every 15..40 steps, after the statistics warmed up
        spikes.add(s)
        s += rng.randint(15, 40)
    noisy = [calm(s, **({"loss": 9.0, "grad_norm": 6.0} if s in spikes else {})) for s in range(1, 1001)]
    clean_steps = saved_steps(run(RulePolicy(cfg), [calm(s) for s in range(1, 1001)]))
    noisy_events = run(RulePolicy(cfg), noisy)
    noisy_steps = saved_steps(noisy_events)
    assert any(kind == "pre" for _, kind, _ in noisy_events)  # the noise was seen ...
    for start in range(0, 1000, window):  # ... but never a storm
        n_clean = sum(start <= x < start + window for x in clean_steps)
        n_noisy = sum(start <= x < start + window for x in noisy_steps)
        assert n_noisy <= n_clean + 1, (start, clean_steps, noisy_steps)


def test_sustained_risk_fires_once_per_episode_with_hysteresis() -> None:
    cfg = SmartCkptConfig(base_interval=1000, policy={"max_interval": 1000, "capture_cooldown": 1000})
    policy = RulePolicy(cfg)
    frames = []
    for s in range(1, 301):
        hot = 50 <= s < 90 or 200 <= s < 240  # two episodes of LoRA-layer surges
        frames.append(calm(s, **({"lora_max_ratio": 8.0, "lora_max_layer": "l0"} if hot else {})))
    events = run(policy, frames)
    edges = [(at, d) for at, kind, d in events if d.reason.startswith("risk_edge")]
    assert [at for at, _ in edges] == [57, 207]  # debounced: 8th hot step, smoothed beta 0.7 >= 0.68
    assert all(d.tiers == ALL_TIERS for _, d in edges)


# ------------------------------------------------------------------ memory, budget, preemption
def test_memory_ramp_saves_before_threshold_is_crossed_for_good() -> None:
    cfg = SmartCkptConfig(base_interval=1000,
                          policy={"max_interval": 1000, "memory_threshold": 0.92, "memory_sample_every": 5})
    policy = RulePolicy(cfg)
    frames = []
    for s in range(1, 301):
        mem = min(0.95, 0.40 + 0.55 * s / 250) if s % 5 == 0 else None  # sampled every 5 steps
        frames.append(calm(s, device_mem_frac=mem))
    events = run(policy, frames)
    crossed = min(s for s in range(5, 301, 5) if min(0.95, 0.40 + 0.55 * s / 250) >= 0.92)
    mem_saves = [(at, d) for at, _, d in events if d.reason.startswith("memory_ramp")]
    assert len(mem_saves) == 1
    at, d = mem_saves[0]
    assert at < crossed
    assert d.tiers == MINIMAL_TIERS == frozenset({Tier.WEIGHTS, Tier.STATE})


def drive_with_cost(cfg: SmartCkptConfig, blocking_s: float, steps: int = 400) -> list[Decision]:
    """Decide per step; every save blocks `blocking_s`, reported by the next frame (`save_blocking_s`)."""
    policy, out, blocked = RulePolicy(cfg), [], None
    for s in range(1, steps + 1):
        d = policy.decide(calm(s, save_blocking_s=blocked))
        blocked = blocking_s if d.save else None
        if d.save:
            out.append(d)
    return out


# An interval the user sets is kept over the overhead budget (widened, base_interval=4 would save at
# 4, 104, 204, 304 here); one warning names an interval that would fit.
def test_explicit_interval_is_kept_over_budget_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hf_dynamic_ckpt.policy")
    cheap = [d.step for d in drive_with_cost(SmartCkptConfig(base_interval=4, policy={"overhead_budget": 0.02}), 0.001)]
    assert not caplog.records
    expensive = drive_with_cost(SmartCkptConfig(base_interval=4, policy={"overhead_budget": 0.02}), 0.2)  # 50 % > 2 %
    assert cheap == [d.step for d in expensive] == list(range(4, 401, 4))
    assert expensive[-1].reason == "interval 4 (base 4 from base_interval, alpha 1.00, beta 0.00)"
    # One warning, once two save costs are known, with the interval that would fit the budget.
    assert [r.getMessage() for r in caplog.records] == [
        "step 9: base_interval=4: a save blocks training 0.200 s every 4 steps of 0.100 s, 50.0% of training time, "
        "above overhead_budget=2.0%. The interval you set is kept; base_interval=100 would stay within the budget "
        "(or raise policy.overhead_budget, or leave base_interval unset to let the library choose)."]


def test_derived_interval_is_widened_to_the_budget_and_says_so() -> None:
    # Young/Daly with C = 0.2 s, MTBF = 3.6 s: sqrt(2 * 0.2 * 3.6) = 1.2 s = 12 steps of 0.1 s;
    # the budget needs 0.2 s / (2 % of 0.1 s) = 100 steps between saves.
    cfg = SmartCkptConfig(policy={"mtbf_hours": 0.001, "stability_window": 20, "overhead_budget": 0.02})
    saves = drive_with_cost(cfg, 0.2)
    assert [d.step for d in saves] == [20, 120, 220, 320]
    assert saves[0].reason == ("interval 20 (base 20 from stability_window until a save cost is measured, "
                               "alpha 1.00, beta 0.00)")
    assert saves[1].reason == ("interval 100 (base 12 from Young/Daly, widened by overhead_budget 2.0%, alpha 1.00, "
                               "beta 0.00)")
    # Within the budget the Young/Daly interval stands: C = 0.002 s -> sqrt(2 * 0.002 * 3600) = 3.8 s = 38 steps.
    saves = drive_with_cost(cfg.replace(policy={"mtbf_hours": 1.0}), 0.002)
    assert [d.step for d in saves][:3] == [20, 58, 96]
    assert saves[1].reason == "interval 38 (base 38 from Young/Daly, alpha 1.00, beta 0.00)"


def test_interval_reason_says_when_risk_shortened_it() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=20, policy={"min_interval": 1}))
    events = run(policy, [calm(s, device_mem_frac=0.97 if s > 25 else 0.5) for s in range(1, 60)])
    reasons = [d.reason for _, _, d in events if d.kind == DecisionKind.INTERVAL]
    assert reasons[0] == "interval 20 (base 20 from base_interval, alpha 1.00, beta 0.00)"
    assert reasons[-1] == "interval 4 (base 20 from base_interval, shortened by risk, alpha 1.00, beta 1.00)"


def test_preemption_saves_everything_exactly_once() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=1000, policy={"max_interval": 1000}))
    events = run(policy, [calm(s, preempt=s >= 33) for s in range(1, 60)])
    assert [(at, d.reason, d.tiers) for at, _, d in events] == [(33, "preemption", ALL_TIERS)]


# ------------------------------------------------------------------ history and resume
def test_debug_info_has_last_ten_steps() -> None:
    policy = RulePolicy(SmartCkptConfig(base_interval=7))
    run(policy, [calm(s) for s in range(1, 31)])
    info = policy.debug_info()
    assert [e["step"] for e in info] == list(range(21, 31))
    assert set(info[0]) == {"step", "loss", "grad_norm", "lr"}
    assert json.loads(json.dumps(info)) == info


def test_state_dict_round_trip_decides_the_same() -> None:
    cfg = SmartCkptConfig(policy={"stability_window": 40, "mtbf_hours": 0.05})
    frames = []
    for s in range(1, 601):
        extra: dict[str, object] = {}
        if s == 250:
            extra = {"grad_norm": 30.0}
        if 400 <= s < 420:
            extra = {"device_mem_frac": 0.97}
        frames.append(calm(s, seed=1, **extra))

    def drive(policy: RulePolicy, fs: list[SignalFrame], blocked: list[float]) -> list[dict[str, object]]:
        out = []
        for f in fs:  # each save blocks 0.05 s; the next frame reports the step's total (the same frames both ways)
            f = dataclasses.replace(f, save_blocking_s=sum(blocked) or None)
            blocked.clear()
            for d in (policy.pre_update(f), policy.decide(f)):
                if d.save:
                    out.append(d.to_dict())
                    blocked.append(0.05)
        return out

    whole = drive(RulePolicy(cfg), frames, [])
    first = RulePolicy(cfg)
    blocked: list[float] = []
    part = drive(first, frames[:300], blocked)
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))  # strict JSON
    resumed = RulePolicy(cfg)
    resumed.load_state_dict(state)
    part += drive(resumed, frames[300:], blocked)
    assert part == whole
    assert len(whole) >= 5


def test_each_save_and_each_suppressed_trigger_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hf_dynamic_ckpt.policy.rules")
    policy = RulePolicy(SmartCkptConfig(base_interval=30, policy={"capture_cooldown": 50}))
    frames = [calm(s, **({"grad_norm": 20.0} if s in (40, 45, 50) else {})) for s in range(1, 61)]
    events = run(policy, frames)
    saves = [r.getMessage() for r in caplog.records if ": save step " in r.getMessage()]
    suppressed = [r.getMessage() for r in caplog.records if "suppressed" in r.getMessage()]
    assert len(saves) == len(events) == 2  # interval at 30, capture at 40 (state 39); next interval 69 > 60
    assert saves[1] == "step 40: save step 39 (pre_update grad_surge x20.0) tiers=optimizer,state,weights pinned"
    assert len(suppressed) == 1  # the surges at 45 and 50 fall in the cooldown: one line, not two
    assert suppressed[0].startswith("step 45: pre-update capture (grad_surge x")
    assert suppressed[0].endswith("suppressed: capture cooldown (5 of 50 steps since the capture at step 40)")
    assert [e["step"] for e in policy.decisions] == [30, 39]


def test_memory_jitter_around_a_plateau_does_not_repeat_ramp_saves() -> None:
    cfg = SmartCkptConfig(base_interval=2000, policy={"max_interval": 2000})
    policy = RulePolicy(cfg)
    rng = random.Random(5)
    frames = []
    for s in range(1, 1001):
        mem = None
        if s % 5 == 0:  # ramp to a plateau just under the threshold, with +-1 % jitter
            mem = min(0.90, 0.5 + 0.002 * s) + 0.01 * rng.uniform(-1, 1)
        frames.append(calm(s, device_mem_frac=mem))
    events = run(policy, frames)
    assert sum(d.reason.startswith("memory_ramp") for _, _, d in events) <= 1


def test_early_extreme_spike_is_captured_but_early_growth_is_not() -> None:
    """Before 20 values are known only an extreme jump captures (a doubled loss, a grad x r^2)."""
    policy = RulePolicy(SmartCkptConfig(base_interval=100))
    growing = [calm(s, grad_norm=1.0 * 1.25**s) for s in range(1, 15)]  # grads grow x1.25 a step
    assert run(policy, growing) == []
    events = run(policy, [calm(15, loss=2000.0, grad_norm=1000.0)])
    assert [(at, kind, d.step, d.pin) for at, kind, d in events] == [(15, "pre", 14, True)]

"""The learned double-check: features, the numpy LSTM, the model file, its role next to the rules.

Role tests use small hand-made model files (`constant_model`: zero LSTM weights, a fixed score
and granularity), so they check what the policy does with an opinion, not what the shipped
model happens to score. The shipped model is checked as a file; the training corpus (examples/corpus.py) in
tests/examples/test_corpus.py.
"""

from __future__ import annotations

import configparser
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.constants import ALL_TIERS
from hf_dynamic_ckpt.errors import ConfigError
from hf_dynamic_ckpt.policy import MINIMAL_TIERS, DecisionKind, RulePolicy
from hf_dynamic_ckpt.policy.learned import (
    BUILTIN_PATH,
    CLIP,
    FEATURE_NAMES,
    MODEL_FORMAT,
    MODEL_VERSION,
    DecisionModel,
    FeatureExtractor,
    Granularity,
    LearnedCheck,
    load_model,
)
from hf_dynamic_ckpt.signals import SignalFrame

REPO = Path(__file__).resolve().parents[2]
H = 32


def metadata(**extra: str) -> dict[str, str]:
    return {"format": MODEL_FORMAT, "version": MODEL_VERSION, "features": ",".join(FEATURE_NAMES), **extra}


def zero_tensors(hidden: int = H) -> dict[str, np.ndarray]:
    t: dict[str, np.ndarray] = {}
    for layer in range(2):
        n_in = len(FEATURE_NAMES) if layer == 0 else hidden
        t[f"lstm.weight_ih_l{layer}"] = np.zeros((4 * hidden, n_in), np.float32)
        t[f"lstm.weight_hh_l{layer}"] = np.zeros((4 * hidden, hidden), np.float32)
        t[f"lstm.bias_ih_l{layer}"] = np.zeros(4 * hidden, np.float32)
        t[f"lstm.bias_hh_l{layer}"] = np.zeros(4 * hidden, np.float32)
    t["score.weight"] = np.zeros((1, hidden), np.float32)
    t["score.bias"] = np.zeros(1, np.float32)
    t["granularity.weight"] = np.zeros((4, hidden), np.float32)
    t["granularity.bias"] = np.zeros(4, np.float32)
    t["features.mean"] = np.zeros(len(FEATURE_NAMES), np.float32)
    t["features.std"] = np.ones(len(FEATURE_NAMES), np.float32)
    return t


def constant_model(path: Path, score: float, granularity: int = 0, **meta: str) -> str:
    """A model file whose every opinion is `score` with `granularity` (zero LSTM weights)."""
    t = zero_tensors()
    t["score.bias"][0] = math.log(score / (1.0 - score))
    t["granularity.bias"][granularity] = 5.0
    save_file(t, str(path), metadata=metadata(**meta))
    return str(path)


def calm(n: int, start: int = 1, **kw: float) -> list[SignalFrame]:
    """A calm run: loss ~2 and grad norm ~1 with a small deterministic wobble, lr 1e-3, clip 1."""
    return [SignalFrame(step=s, loss=2.0 + 0.01 * math.sin(s), grad_norm=1.0 + 0.05 * math.sin(0.7 * s), lr=1e-3,
                        clip_norm=1.0, step_time_s=0.1, **kw) for s in range(start, start + n)]


def drive(policy: RulePolicy, frames: list[SignalFrame]) -> list[tuple[int, str, object]]:
    out = []
    for f in frames:
        for when, d in (("pre", policy.pre_update(f)), ("post", policy.decide(f))):
            if d.save:
                out.append((f.step, when, d))
    return out


CFG = SmartCkptConfig(base_interval=1000, policy={"stability_window": 20, "risk_smoothing": 4})


# ---------------------------------------------------------------------- features
def test_twelve_documented_scale_free_features() -> None:
    assert len(FEATURE_NAMES) == 12 == len(CLIP)
    card = (REPO / "docs" / "decision_model.md").read_text(encoding="utf-8")
    assert all(f"`{name}`" in card for name in FEATURE_NAMES)

    def run(scale: float) -> list[list[float]]:
        fx = FeatureExtractor()
        out = []
        for i, f in enumerate(calm(60, host_mem_frac=0.5)):
            loss = f.loss * (30.0 if i == 45 else 1.0)  # type: ignore[operator]
            g = SignalFrame(step=f.step, loss=loss * scale, grad_norm=f.grad_norm * scale,  # type: ignore[operator]
                            lr=f.lr * scale, clip_norm=scale, step_time_s=0.1 * scale,  # type: ignore[operator]
                            lora_max_ratio=1.5, host_mem_frac=0.5 + 0.001 * i)
            out.append(fx.step(g))
        return out

    # Powers of two scale every value exactly: the features must not change by one bit.
    base = run(1.0)
    assert run(8.0) == base and run(0.25) == base
    spike = math.log(30.0 * (2.0 + 0.01 * math.sin(46)) / 2.0)
    assert base[45][FEATURE_NAMES.index("loss_ratio")] == pytest.approx(spike, rel=0.01)
    assert base[0][FEATURE_NAMES.index("history")] == 0.0 and base[59][FEATURE_NAMES.index("history")] == 1.0


def test_features_of_a_nonfinite_frame_and_clipping() -> None:
    fx = FeatureExtractor()
    for f in calm(10):
        fx.step(f)
    x = fx.step(SignalFrame(step=11, loss=math.nan, grad_norm=math.inf, lr=1e-3, clip_norm=1.0))
    assert x[FEATURE_NAMES.index("nonfinite")] == 1.0
    assert x[FEATURE_NAMES.index("loss_ratio")] == 0.0 and x[FEATURE_NAMES.index("grad_ratio")] == 0.0
    y = fx.step(SignalFrame(step=12, loss=2e9, grad_norm=1.0, lr=1e-3))  # x1e9: clipped to the trained range
    assert y[FEATURE_NAMES.index("loss_ratio")] == CLIP[FEATURE_NAMES.index("loss_ratio")][1]


def test_feature_state_round_trip_is_exact() -> None:
    frames = calm(40, host_mem_frac=0.6)
    a, b = FeatureExtractor(), FeatureExtractor()
    for f in frames[:25]:
        a.step(f)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.step(f) for f in frames[25:]] == [b.step(f) for f in frames[25:]]


# ---------------------------------------------------------------------- the LSTM
def test_numpy_lstm_equals_torch_lstm() -> None:
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(12, H, num_layers=2, batch_first=True).double()
    score, gran = torch.nn.Linear(H, 1).double(), torch.nn.Linear(H, 4).double()
    tensors = {k: v.detach().numpy() for k, v in lstm.state_dict().items()}
    tensors = {f"lstm.{k}": v for k, v in tensors.items()}
    tensors |= {"score.weight": score.weight.detach().numpy(), "score.bias": score.bias.detach().numpy(),
                "granularity.weight": gran.weight.detach().numpy(), "granularity.bias": gran.bias.detach().numpy(),
                "features.mean": np.full(12, 0.5), "features.std": np.full(12, 2.0)}
    model = DecisionModel(tensors)
    x = torch.randn(1, 30, 12, dtype=torch.float64)
    with torch.no_grad():
        h, _ = lstm((x - 0.5) / 2.0)
        want_score = torch.sigmoid(score(h)).squeeze(-1)[0].numpy()
        want_gran = torch.softmax(gran(h), -1)[0].numpy()
    state = model.initial_state()
    for t in range(30):
        s, logits, state = model.step(x[0, t].tolist(), state)
        assert s == pytest.approx(want_score[t], abs=1e-12)
        assert np.exp(logits) / np.exp(logits).sum() == pytest.approx(want_gran[t], abs=1e-12)


def test_model_file_errors(tmp_path: Path) -> None:
    bad = metadata()
    bad["features"] = "loss,grad"
    t = zero_tensors()
    save_file(t, str(tmp_path / "feat.safetensors"), metadata=bad)
    with pytest.raises(ConfigError, match=r"was trained on features \['loss', 'grad'\], this library computes"):
        load_model(tmp_path / "feat.safetensors")
    t["score.bias"][0] = np.nan
    save_file(t, str(tmp_path / "nan.safetensors"), metadata=metadata())
    with pytest.raises(ConfigError, match=r"tensor score\.bias holds NaN or infinite values; retrain it"):
        load_model(tmp_path / "nan.safetensors")
    t = zero_tensors()
    del t["granularity.bias"]
    save_file(t, str(tmp_path / "missing.safetensors"), metadata=metadata())
    with pytest.raises(ConfigError, match=r"tensors \['granularity.bias'\] are missing"):
        load_model(tmp_path / "missing.safetensors")
    t = zero_tensors()
    t["score.weight"] = np.zeros((1, 16), np.float32)
    save_file(t, str(tmp_path / "shape.safetensors"), metadata=metadata())
    with pytest.raises(ConfigError, match=r"tensor score.weight has shape \[1, 16\], expected \[1, 32\]"):
        load_model(tmp_path / "shape.safetensors")
    # A pickle is never unpickled: it is not safetensors, so it is refused before anything runs.
    pickled = tmp_path / "model.safetensors"
    torch.save({"x": torch.zeros(2)}, pickled)
    with pytest.raises(ConfigError, match="is not a readable safetensors file"):
        load_model(pickled)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_model(tmp_path / "gone.safetensors")


def test_config_learned_model_values(tmp_path: Path) -> None:
    assert SmartCkptConfig().policy.learned_model is None
    assert SmartCkptConfig(policy={"learned_model": "builtin"}).policy.learned_model == "builtin"
    path = constant_model(tmp_path / "m.safetensors", 0.5)
    assert SmartCkptConfig(policy={"learned_model": Path(path)}).policy.learned_model == path
    expected = "expected 'builtin', the path of an existing .safetensors decision model, or null (rules only)."
    for value in ("model.pt", str(tmp_path / "nope.safetensors"), "", 1):
        with pytest.raises(ConfigError) as e:
            SmartCkptConfig(policy={"learned_model": value})  # type: ignore[arg-type]
        assert str(e.value) == f"policy.learned_model={value!r} is invalid: {expected}"


# ---------------------------------------------------------------------- the shipped model
def test_builtin_model_file_is_small_safetensors_in_package_data() -> None:
    raw = BUILTIN_PATH.read_bytes()
    assert 10_000 < len(raw) < 100_000
    (n,) = struct.unpack("<Q", raw[:8])  # safetensors: a little-endian header length, a JSON header, raw data
    header = json.loads(raw[8 : 8 + n])
    assert header["__metadata__"]["format"] == MODEL_FORMAT
    assert header["__metadata__"]["features"].split(",") == list(FEATURE_NAMES)
    model = load_model("builtin")
    assert model.hidden == 32 and 0.0 < model.veto_threshold <= 0.05
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert "policy/decision_model.safetensors" in cfg["options.package_data"]["hf_dynamic_ckpt"]


# ---------------------------------------------------------------------- the role
def test_the_model_runs_once_per_step(tmp_path: Path) -> None:
    policy = RulePolicy(CFG.replace(policy={"learned_model": constant_model(tmp_path / "m.safetensors", 0.5)}))
    assert policy.learned is not None
    calls = []
    original = policy.learned.model.step
    policy.learned.model.step = lambda x, s: calls.append(1) or original(x, s)  # type: ignore[method-assign]
    frames = calm(12)
    for f in frames[:6]:
        policy.pre_update(f)
        policy.decide(f)
    for f in frames[6:]:  # a loop without pre_update: decide runs it
        policy.decide(f)
    assert len(calls) == 12


def test_early_capture_when_the_model_asks(tmp_path: Path) -> None:
    cfg = CFG.replace(policy={"learned_model": constant_model(tmp_path / "m.safetensors", 0.9), "capture_cooldown": 5})
    events = drive(RulePolicy(cfg), calm(12))
    assert [(at, when) for at, when, _ in events] == [(1, "pre"), (6, "pre"), (11, "pre")]
    for at, _, d in events:
        assert (d.kind, d.step, d.pin, d.pre_update, d.healthy, d.tiers) == (  # type: ignore[attr-defined]
            DecisionKind.LEARNED, at - 1, True, True, True, ALL_TIERS)
        assert d.reason == "learned save_score 0.90, granularity everything"  # type: ignore[attr-defined]
    # Below the threshold (0.68): nothing but the rules.
    model = constant_model(tmp_path / "n.safetensors", 0.6)
    assert drive(RulePolicy(CFG.replace(policy={"learned_model": model})), calm(12)) == []


def test_memory_granularity_saves_after_the_update_with_the_cheaper_tiers(tmp_path: Path) -> None:
    model = constant_model(tmp_path / "m.safetensors", 0.9, Granularity.KEY_LAYERS_RNG)
    cfg = CFG.replace(policy={"learned_model": model, "capture_cooldown": 5})
    events = drive(RulePolicy(cfg), calm(12))
    assert [(at, when) for at, when, _ in events] == [(1, "post"), (6, "post"), (11, "post")]
    assert all(d.step == at and not d.pin and d.tiers == MINIMAL_TIERS and d.kind == DecisionKind.LEARNED  # type: ignore[attr-defined]
               for at, _, d in events)


def surge(kind: str) -> list[SignalFrame]:
    frames = calm(50)
    f = frames[39]
    if kind == "grad":  # x10 grad norm, ordinary loss: a soft trigger
        f.grad_norm = 10.0
    elif kind == "nan":
        f.grad_norm, f.nonfinite = math.nan, True
    else:  # a loss explosion: x100 loss and gradient
        f.loss, f.grad_norm = 200.0, 100.0
    return frames


@pytest.mark.parametrize(("kind", "rule"), [("grad", "grad_surge x9.9"), ("nan", "nonfinite"),
                                            ("explosion", "grad_surge x99.1")])
def test_veto_removes_soft_captures_never_hard_ones(tmp_path: Path, kind: str, rule: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    rules = [(at, d.reason) for at, _, d in drive(RulePolicy(CFG), surge(kind))]  # type: ignore[attr-defined]
    assert rules == [(40, f"pre_update {rule}")]
    never = constant_model(tmp_path / "zero.safetensors", 0.001)
    with caplog.at_level("DEBUG", logger="hf_dynamic_ckpt.policy.rules"):
        policy = RulePolicy(CFG.replace(policy={"learned_model": never}))  # type: ignore[dict-item]
        vetoed = [(at, d.reason) for at, _, d in drive(policy, surge(kind))]
    if kind == "grad":
        assert vetoed == []
        assert f"step 40: pre-update capture ({rule}) vetoed by the learned model (save_score 0.00, granularity " \
               "everything)" in caplog.text
    else:  # NaN and loss explosion: the pinned capture of the state before stays
        assert vetoed == rules


def test_veto_threshold_comes_from_the_file(tmp_path: Path) -> None:
    mild = constant_model(tmp_path / "m.safetensors", 0.03, veto_threshold="0.05")
    assert drive(RulePolicy(CFG.replace(policy={"learned_model": mild})), surge("grad")) == []
    kept = constant_model(tmp_path / "k.safetensors", 0.03, veto_threshold="0.01")
    assert len(drive(RulePolicy(CFG.replace(policy={"learned_model": kept})), surge("grad"))) == 1


def test_state_round_trip_continues_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)  # a random model whose score crosses 0.68 now and then
    t = {k: (rng.normal(0, 0.4, v.shape) if k.startswith(("lstm", "score", "granularity")) else v).astype(np.float32)
         for k, v in zero_tensors().items()}
    t["score.bias"][0] = 0.5
    save_file(t, str(tmp_path / "r.safetensors"), metadata=metadata())
    cfg = CFG.replace(base_interval=10, policy={"learned_model": str(tmp_path / "r.safetensors")})
    frames = surge("grad") + calm(40, start=51, host_mem_frac=0.7)
    whole = RulePolicy(cfg)
    want = drive(whole, frames)
    assert any(d.kind == DecisionKind.LEARNED for _, _, d in want)  # type: ignore[attr-defined]
    for split in (1, 17, 39, 40, 63):
        first = RulePolicy(cfg)
        got = drive(first, frames[:split])
        second = RulePolicy(cfg)
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got += drive(second, frames[split:])
        assert got == want, split
        assert json.dumps(second.state_dict()) == json.dumps(whole.state_dict())


def test_rules_only_state_loads_into_a_policy_with_the_model(tmp_path: Path) -> None:
    rules = RulePolicy(CFG)
    drive(rules, calm(30))
    with_model = RulePolicy(CFG.replace(policy={"learned_model": constant_model(tmp_path / "m.safetensors", 0.5)}))
    with_model.load_state_dict(rules.state_dict())
    assert with_model.baselines.loss.values == rules.baselines.loss.values
    assert isinstance(with_model.learned, LearnedCheck) and with_model.learned.features.seen == 0
    bad = with_model.state_dict()
    bad["learned"]["lstm"] = [[0.0] * 8] * 4
    with pytest.raises(ConfigError, match="does not fit a 2-layer LSTM of 32 units"):
        with_model.load_state_dict(bad)


def test_every_rank_takes_the_same_decisions_from_the_same_frames(tmp_path: Path) -> None:
    """The model reads only the reduced frame: two ranks' policies agree on every decision and end in the
    same state (LSTM state included) even when each measured a different save cost locally."""
    cfg = CFG.replace(base_interval=10, policy={"learned_model": "builtin"})
    frames = surge("grad") + calm(40, start=51, host_mem_frac=0.7)
    ranks = [RulePolicy(cfg), RulePolicy(cfg)]
    decisions: list[list[object]] = [[], []]
    for f in frames:
        for r, policy in enumerate(ranks):
            g = SignalFrame(**vars(f))
            decisions[r] += [policy.pre_update(g), policy.decide(g)]
    assert decisions[0] == decisions[1]
    assert json.dumps(ranks[0].state_dict()) == json.dumps(ranks[1].state_dict())

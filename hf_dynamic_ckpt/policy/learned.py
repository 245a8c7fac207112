"""The learned double-check next to the rules: 12 scale-free features of the frames and a 2-layer LSTM over them, its
role (early save, cheaper tiers, veto of a *soft* rule capture, never of a hard one) as docs/decision_model.md says."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import ALL_TIERS, Tier
from ..errors import ConfigError
from ..signals import MINIMAL_TIERS, Decision, DecisionKind, RollingWindow, SignalFrame, Windows, linear_fit

# The 12 scale-free inputs in order (docs/decision_model.md; a model file names the ones it learnt) and the (low, high)
# each is clipped to: one absurd value (a x1e6 loss) cannot leave the range the model was trained on.
_FEAT = {"loss_ratio": (-3.0, 8.0), "loss_change": (-4.0, 40.0), "loss_noise": (-8.0, 2.0), "grad_ratio": (-5.0, 10.0),
         "grad_vs_clip": (-8.0, 10.0), "lora_ratio": (-3.0, 10.0), "lr_ratio": (-5.0, 5.0), "mem_frac": (0.0, 1.5),
         "mem_trend": (-0.5, 1.0), "step_time_ratio": (-3.0, 3.0), "nonfinite": (0.0, 1.0), "history": (0.0, 1.0)}
FEATURE_NAMES: tuple[str, ...] = tuple(_FEAT)
CLIP: tuple[tuple[float, float], ...] = tuple(_FEAT.values())
NUM_FEATURES = len(FEATURE_NAMES)
WINDOW = 20  # finite values each ratio's baseline is taken over
MEM_POINTS, MEM_HORIZON = 6, 50  # the memory trend: a line through the last 6 samples, extrapolated 50 steps
HISTORY_FULL = 50  # steps after which the `history` feature is 1
NOISE_FLOOR = 1e-4  # relative loss noise below this reads as this (log of 0 is -inf)
BUILTIN, BUILTIN_PATH = "builtin", Path(__file__).with_name("decision_model.safetensors")
MODEL_FORMAT, MODEL_VERSION = "hf_dynamic_ckpt.decision_model", "1"
SAVE_THRESHOLD = 0.68  # the article's: save when save_score > 0.68
DEFAULT_VETO_THRESHOLD = 0.02  # below this score a soft rule capture is vetoed (the file may set its own)
HARD_LOSS_RATIO = 10.0  # a loss this many times its running median is an explosion: never vetoed
MAX_MODEL_BYTES = 4 * 2**20  # a decision model is tens of KB; refuse to read anything far bigger
LAYERS = 2


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _log_ratio(value: float | None, baseline: float | None) -> float:
    """log(value / baseline); 0 without a positive, finite value and baseline (a ratio without history)."""
    if not _finite(value) or baseline is None or not baseline > 0.0 or not value > 0.0:  # type: ignore[operator]
        return 0.0
    return math.log(value / baseline)  # type: ignore[operator]


class FeatureExtractor(Windows):
    """Streaming features, one call per step: each frame measured against the windows *before* it is folded in."""
    time: RollingWindow

    def __init__(self) -> None:
        super().__init__(loss=WINDOW, grad=WINDOW, time=WINDOW, lr=WINDOW, mem=MEM_POINTS)
        self.prev_loss: float | None = None
        self.seen = 0

    def step(self, frame: SignalFrame) -> list[float]:
        """The frame's 12 features against the windows, then the frame folded into them."""
        loss, grad, mem = frame.loss, frame.grad_norm, frame.mem_frac
        baseline, noise = self.loss.median(), self.loss.diff_noise()
        if _finite(mem):
            self.mem.append((frame.step, float(mem)))  # type: ignore[arg-type]
        points = self.mem
        fit = linear_fit(points) if len(points) >= 3 else None
        f = [_log_ratio(loss, baseline),
             (loss - self.prev_loss) / abs(baseline)  # type: ignore[operator]
             if _finite(loss) and _finite(self.prev_loss) and baseline else 0.0,
             math.log(max(noise / abs(baseline), NOISE_FLOOR)) if noise is not None and baseline else 0.0,
             _log_ratio(grad, self.grad.median()), _log_ratio(grad, frame.clip_norm),
             _log_ratio(frame.lora_max_ratio, 1.0), _log_ratio(frame.lr, max(self.lr, default=None)),
             points[-1][1] if points else 0.0, fit[0] * MEM_HORIZON if fit is not None else 0.0,
             _log_ratio(frame.step_time_s, self.time.median()), 1.0 if frame.any_nonfinite else 0.0,
             min(1.0, self.seen / HISTORY_FULL)]
        self.fold(frame)
        self.prev_loss = loss if _finite(loss) else self.prev_loss
        self.seen += 1
        return [min(hi, max(lo, v)) for v, (lo, hi) in zip(f, CLIP)]

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"prev_loss": self.prev_loss, "seen": self.seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        prev, seen = None if state["prev_loss"] is None else float(state["prev_loss"]), int(state["seen"])
        super().load_state_dict(state)  # all or nothing: a malformed state raises before anything of self changes
        self.prev_loss, self.seen = prev, seen


class Granularity(enum.IntEnum):
    """The article's granularity classes and the tier set each one saves."""
    EVERYTHING = 0
    WEIGHTS_ONLY = 1
    WEIGHTS_OPTIMIZER = 2
    KEY_LAYERS_RNG = 3  # trainable weights (the adapter: the key layers) + RNG / data position

    @property
    def tiers(self) -> frozenset[Tier]:
        return (ALL_TIERS, frozenset({Tier.WEIGHTS}), frozenset({Tier.WEIGHTS, Tier.OPTIMIZER}), MINIMAL_TIERS)[self]


@dataclass(frozen=True)
class Opinion:
    """The model's answer for one step."""
    score: float
    granularity: Granularity

    @property
    def save(self) -> bool:
        return self.score >= SAVE_THRESHOLD

    def describe(self) -> str:
        return f"save_score {self.score:.2f}, granularity {self.granularity.name.lower()}"


class DecisionModel:
    """The trained weights (numpy, float64; named as `torch.nn.LSTM(12, H, num_layers=2)`'s, plus `score.*`,
    `granularity.*`, `features.mean` / `features.std`) and one LSTM step; `ConfigError` for a bad tensor."""

    def __init__(self, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None, *,
                 source: str = "decision model") -> None:
        self.metadata = dict(metadata or {})
        w = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
        hidden = w["lstm.weight_hh_l0"].shape[-1] if "lstm.weight_hh_l0" in w else 0
        expected = {"features.mean": (NUM_FEATURES,), "features.std": (NUM_FEATURES,), "score.weight": (1, hidden),
                    "score.bias": (1,), "granularity.weight": (len(Granularity), hidden),
                    "granularity.bias": (len(Granularity),)}
        for i in range(LAYERS):
            expected |= {f"lstm.weight_ih_l{i}": (4 * hidden, hidden if i else NUM_FEATURES),
                         f"lstm.weight_hh_l{i}": (4 * hidden, hidden),
                         f"lstm.bias_ih_l{i}": (4 * hidden,), f"lstm.bias_hh_l{i}": (4 * hidden,)}
        if missing := sorted(set(expected) - set(w)):
            raise ConfigError(f"{source} is not a decision model: tensors {missing} are missing; write one with "
                              "scripts/train_decision_model.py.")
        for name, shape in expected.items():
            if w[name].shape != shape:
                raise ConfigError(f"{source}: tensor {name} has shape {list(w[name].shape)}, expected {list(shape)} "
                                  f"(a 2-layer LSTM over {NUM_FEATURES} features).")
            if not np.all(np.isfinite(w[name])):
                raise ConfigError(f"{source}: tensor {name} holds NaN or infinite values; retrain it.")
        if np.any(w["features.std"] <= 0.0):
            raise ConfigError(f"{source}: features.std must be > 0 everywhere.")
        self.hidden = hidden
        # One tanh per layer: sigmoid(z) = 0.5 + 0.5 * tanh(z / 2), so the input, forget and output
        # gate rows (torch's order: i, f, g, o) are halved and mapped back with `_a * t + _c`.
        half = np.ones(4 * hidden)
        half[: 2 * hidden], half[3 * hidden :] = 0.5, 0.5
        # The standardisation (x - mean) / std is folded into the first layer's input weights and bias.
        w_in = w["lstm.weight_ih_l0"] / w["features.std"]
        folded = {0: (w_in, w["lstm.bias_ih_l0"] - w_in @ w["features.mean"])}
        self._w, self._b = [], []
        for i in range(LAYERS):
            w_ih, b_ih = folded.get(i, (w[f"lstm.weight_ih_l{i}"], w[f"lstm.bias_ih_l{i}"]))
            self._w.append(half[:, None] * np.concatenate([w_ih, w[f"lstm.weight_hh_l{i}"]], axis=1))
            self._b.append(half * (b_ih + w[f"lstm.bias_hh_l{i}"]))
        self._a, self._c = half.copy(), np.where(half == 0.5, 0.5, 0.0)
        self.w_score, self.b_score = w["score.weight"][0], float(w["score.bias"][0])
        self.w_gran, self.b_gran = w["granularity.weight"], w["granularity.bias"]
        self.veto_threshold = float(self.metadata.get("veto_threshold", DEFAULT_VETO_THRESHOLD))

    def initial_state(self) -> list[np.ndarray]:
        """`[h0, c0, h1, c1]`, zeros."""
        return [np.zeros(self.hidden) for _ in range(2 * LAYERS)]

    def step(self, features: list[float], state: list[np.ndarray]) -> tuple[float, np.ndarray, list[np.ndarray]]:
        """One LSTM step: `(save_score, granularity logits, new state)`; `state` is not changed."""
        x = np.asarray(features, dtype=np.float64)
        n = self.hidden
        new: list[np.ndarray] = []
        for i in range(LAYERS):
            act = self._a * np.tanh(self._w[i] @ np.concatenate([x, state[2 * i]]) + self._b[i]) + self._c
            c = act[n : 2 * n] * state[2 * i + 1] + act[:n] * act[2 * n : 3 * n]  # f * c + i * g
            x = act[3 * n :] * np.tanh(c)  # o * tanh(c)
            new += [x, c]
        score = 0.5 + 0.5 * math.tanh(0.5 * (float(self.w_score @ x) + self.b_score))
        return score, self.w_gran @ x + self.b_gran, new


def load_model(spec: str | os.PathLike[str]) -> DecisionModel:
    """Load a decision model (`"builtin"`: the packaged one, or a `.safetensors` path); `ConfigError`: the file is
    missing, too large, not safetensors, or not a decision model."""
    path = BUILTIN_PATH if os.fspath(spec) == BUILTIN else Path(spec)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"learned_model={os.fspath(spec)!r}: {path} cannot be read ({e.strerror}); use 'builtin', "
                          "the path of a model written by scripts/train_decision_model.py, or null.") from e
    path = path.resolve()
    if size > MAX_MODEL_BYTES:
        raise ConfigError(f"learned_model {path} is {size} bytes: a decision model is tens of KB "
                          f"(limit {MAX_MODEL_BYTES}); this is not one.")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="np") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"learned_model {path} is not a readable safetensors file ({e}).") from e
    if metadata.get("format") != MODEL_FORMAT or metadata.get("version") != MODEL_VERSION:
        raise ConfigError(f"learned_model {path}: metadata format={metadata.get('format')!r} "
                          f"version={metadata.get('version')!r}, expected {MODEL_FORMAT!r} version {MODEL_VERSION}.")
    names = metadata.get("features", "").split(",")
    if tuple(names) != FEATURE_NAMES:
        raise ConfigError(f"learned_model {path} was trained on features {names}, this library computes "
                          f"{list(FEATURE_NAMES)}: retrain it with scripts/train_decision_model.py.")
    return DecisionModel(tensors, metadata, source=f"learned_model {path}")


class LearnedCheck:
    """The model's per-step state (part of the policy state) and the rules of its role (`review`, `capture` in
    `pre_update`; `after_update` in `decide`)."""

    def __init__(self, model: DecisionModel) -> None:
        self.model, self.features, self.state = model, FeatureExtractor(), model.initial_state()
        self._cached: tuple[int, Opinion] | None = None
        self.last_save: int | None = None  # step of the model's own last early save (its own cooldown)

    def opinion(self, frame: SignalFrame) -> Opinion:
        """The model's score and granularity for this step's frame (the LSTM steps once per step)."""
        if self._cached is not None and self._cached[0] == frame.step:
            return self._cached[1]
        score, logits, self.state = self.model.step(self.features.step(frame), self.state)
        self._cached = (frame.step, Opinion(score=score, granularity=Granularity(int(np.argmax(logits)))))
        return self._cached[1]

    def review(self, frame: SignalFrame, rule: str | None, loss_baseline: float | None
               ) -> tuple[str | None, Opinion | None, str | None]:
        """`RulePolicy.pre_update`'s question: `(the capture rule after a veto, the opinion when it asks
        for an early capture, the veto's log line)`."""
        op = self.opinion(frame)
        if rule is not None:
            # Never vetoed: non-finite values, or a loss explosion (>= `HARD_LOSS_RATIO` x its baseline).
            hard = rule == "nonfinite" or frame.any_nonfinite or (
                frame.loss is not None and loss_baseline is not None and loss_baseline > 0
                and frame.loss >= HARD_LOSS_RATIO * loss_baseline)
            if not hard and op.score < self.model.veto_threshold:
                return None, None, f"pre-update capture ({rule}) vetoed by the learned model ({op.describe()})"
            return rule, None, None
        early = op.save and op.granularity != Granularity.KEY_LAYERS_RNG and not frame.any_nonfinite
        return None, op if early else None, None

    def capture(self, frame: SignalFrame, op: Opinion, risk: float, interval: float, cooldown: int) -> Decision | None:
        """The early pre-update capture the model asked for (pinned, like a rule's), unless within its cooldown."""
        return Decision(save=True, tiers=op.granularity.tiers, reason=f"learned {op.describe()}", pin=True,
                        pre_update=True, risk=risk, step=frame.step - 1, healthy=True, interval=interval,
                        kind=DecisionKind.LEARNED) if self._cooled(frame.step, cooldown) else None

    def after_update(self, frame: SignalFrame, decision: Decision, *, may_save: bool, cooldown: int) -> Decision:
        """A cheaper tier set for a risk-edge save, or an early save with the model's cheaper granularity (memory
        pressure) when `may_save` and outside the model's cooldown."""
        op = self.opinion(frame)
        tiers = op.granularity.tiers
        if decision.save and decision.kind == DecisionKind.RISK_EDGE and tiers < decision.tiers:
            return dataclasses.replace(decision, tiers=tiers, reason=f"{decision.reason}; learned {op.describe()}")
        if not decision.save and op.save and op.granularity == Granularity.KEY_LAYERS_RNG and may_save \
                and self._cooled(frame.step, cooldown):
            return Decision(save=True, tiers=tiers, reason=f"learned {op.describe()}", risk=decision.risk,
                            step=frame.step, healthy=True, interval=decision.interval, kind=DecisionKind.LEARNED)
        return decision

    def _cooled(self, step: int, cooldown: int) -> bool:
        """Whether an early save at `step` is outside the model's own cooldown (then it is recorded)."""
        if self.last_save is not None and step - self.last_save < cooldown:
            return False
        self.last_save = step
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"features": self.features.state_dict(), "lstm": [v.tolist() for v in self.state],
                "last_save": self.last_save}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        lstm = [np.asarray(v, dtype=np.float64) for v in state["lstm"]]
        if len(lstm) != 2 * LAYERS or any(v.shape != (self.model.hidden,) or not np.all(np.isfinite(v)) for v in lstm):
            raise ConfigError(f"policy state of the learned model: lstm state {json.dumps(state['lstm'])[:80]} does "
                              f"not fit a {LAYERS}-layer LSTM of {self.model.hidden} units (another model wrote it).")
        if (last := state["last_save"]) is not None and (not isinstance(last, int) or isinstance(last, bool)):
            raise ConfigError(f"policy state of the learned model: last_save={last!r} is invalid: expected an int "
                              "or null.")
        self.features.load_state_dict(state["features"])
        self.state, self.last_save, self._cached = lstm, last, None

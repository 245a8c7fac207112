"""Probes and statistics: loss hook, gradient norms (global / per LoRA layer), memory, frames."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import LlamaConfig, LlamaForCausalLM

from hf_dynamic_ckpt import distributed
from hf_dynamic_ckpt.errors import DistributedError
from hf_dynamic_ckpt.signals import (
    ClipNormRecorder,
    Ema,
    GradProbe,
    LayerBaselines,
    LossProbe,
    MemoryProbe,
    RollingWindow,
    SignalFrame,
    linear_fit,
)


def tiny_lora_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(model, lora)
    for name, p in model.named_parameters():  # B starts at zero: make every LoRA grad non-zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.train()
    return model


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


# ------------------------------------------------------------------ statistics
def test_rolling_window_robust_summaries_ignore_outliers_and_nan() -> None:
    w = RollingWindow(5)
    for v in [1.0, 2.0, math.nan, 3.0, 4.0, 100.0, 5.0]:
        w.add(v)
    assert w.values == [2.0, 3.0, 4.0, 100.0, 5.0]
    assert w.median() == 4.0
    assert w.mad() == 1.0
    assert w.robust_z(4.0 + 1.4826 * 6) == pytest.approx(6.0)
    restored = RollingWindow(5, w.values)
    assert restored.values == w.values and restored.median() == 4.0


def test_diff_noise_ignores_a_linear_trend() -> None:
    w = RollingWindow(50)
    for i in range(50):
        w.add(10.0 - 0.1 * i)  # steady descent, no noise
    assert w.diff_noise() == pytest.approx(0.0, abs=1e-12)


def test_ema_bias_correction_and_state() -> None:
    e = Ema(0.9)
    assert e.value is None
    e.add(5.0)
    assert e.value == pytest.approx(5.0)
    e.add(math.inf)
    assert e.count == 1
    e2 = Ema(0.5)
    e2.load_state_dict(e.state_dict())
    assert e2.value == e.value and e2.decay == 0.9


def test_linear_fit() -> None:
    assert linear_fit([(0, 1.0), (10, 2.0), (20, 3.0)]) == pytest.approx((0.1, 1.0))
    assert linear_fit([(5, 1.0)]) is None


def test_frame_to_dict_is_json_safe() -> None:
    f = SignalFrame(step=3, loss=math.nan, grad_norm=math.inf, host_mem_frac=0.5, device_mem_frac=0.7)
    d = f.to_dict()
    assert d["loss"] == "NaN" and d["grad_norm"] == "Infinity" and d["step"] == 3
    assert f.any_nonfinite and f.mem_frac == 0.7


# ------------------------------------------------------------------ loss
def test_loss_probe_sums_training_micro_batches_only() -> None:
    model = tiny_lora_model()
    probe = LossProbe(model)
    losses = [model(**batch(i)).loss for i in range(3)]  # three micro-batches of one step
    model.eval()
    with torch.no_grad():
        model(**batch(9))  # evaluation forward: not part of the step
    model.train()
    total = probe.pop()
    assert isinstance(total, torch.Tensor) and not total.requires_grad
    assert torch.equal(total, losses[0].detach() + losses[1].detach() + losses[2].detach())
    assert probe.pop() is None
    probe.remove()
    model(**batch(0))
    assert probe.pop() is None


# ------------------------------------------------------------------ gradients
def test_grad_probe_finds_lora_layers_by_type_and_matches_manual_norms() -> None:
    model = tiny_lora_model()
    probe = GradProbe(model)
    expected_layers = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    assert probe.layer_names == expected_layers and len(expected_layers) == 4
    model(**batch(1)).loss.backward()
    global_norm, layer_norms = probe.measure()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    expected = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    assert global_norm == pytest.approx(expected, rel=1e-5)
    for name, norm in layer_norms.items():
        module = model.get_submodule(name)
        manual = math.sqrt(sum(float(p.grad.square().sum()) for n, p in module.named_parameters() if "lora_" in n))
        assert norm == pytest.approx(manual, rel=1e-5)


def test_grad_probe_recovers_pre_clip_norms_after_clipping() -> None:
    model = tiny_lora_model()
    probe = GradProbe(model)
    model(**batch(2)).loss.backward()
    before_global, before_layers = probe.measure()
    recorder = ClipNormRecorder(torch.nn.utils, "clip_grad_norm_")
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=before_global / 10)
    finally:
        recorder.remove()
    pre = recorder.pop()
    assert float(pre) == pytest.approx(before_global, rel=1e-5)
    clipped_global, _ = probe.measure()
    assert clipped_global == pytest.approx(before_global / 10, rel=1e-4)  # grads really were clipped
    after_global, after_layers = probe.measure(pre_clip_norm=pre)
    assert after_global == pytest.approx(before_global, rel=1e-5)
    for name in before_layers:
        assert after_layers[name] == pytest.approx(before_layers[name], rel=1e-4)
    assert torch.nn.utils.clip_grad_norm_ is not recorder._wrapper  # original restored


def test_grad_probe_flags_surging_layer_and_nonfinite() -> None:
    model = tiny_lora_model()
    probe = GradProbe(model, warmup=3, spread_k=4.0)
    for _ in range(5):
        ratio, _ = probe.baselines.observe(dict.fromkeys(probe.layer_names, 1.0))
    assert ratio == pytest.approx(1.0)
    target = probe.layer_names[2]
    ratio, layer = probe.baselines.observe({n: (10.0 if n == target else 1.0) for n in probe.layer_names})
    assert layer == target and ratio == pytest.approx(10.0)
    assert probe.baselines.logs[target].median() == pytest.approx(0.0)  # the robust baseline ignores the one surge
    state = json.loads(json.dumps(probe.state_dict()))
    fresh = GradProbe(model, warmup=3, spread_k=4.0)
    fresh.load_state_dict(state)
    assert fresh.baselines.logs[target].values == probe.baselines.logs[target].values
    surge = {n: 10.0 for n in probe.layer_names}
    assert fresh.baselines.observe(surge) == probe.baselines.observe(surge)

    model(**batch(3)).loss.backward()
    next(p for p in model.parameters() if p.grad is not None).grad[0] = math.nan
    fields = probe.frame_fields()
    assert fields["nonfinite"] is True and math.isnan(fields["grad_norm"])


def test_grad_probe_without_lora_uses_the_clip_norm_without_computing() -> None:
    model = torch.nn.Linear(4, 4)
    probe = GradProbe(model)
    assert probe.layer_names == []
    assert probe.measure(pre_clip_norm=3.5) == (3.5, {})  # no .grad exists: nothing was read
    model(torch.ones(2, 4)).sum().backward()
    norm, layers = probe.measure()
    assert layers == {}
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert norm == pytest.approx(float(torch.linalg.vector_norm(full)))


def test_clip_recorder_keeps_the_clip_norm_of_the_last_call() -> None:
    class Owner:
        def clip_grad_norm_(self, parameters: object, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
            return torch.tensor(7.5)

    owner = Owner()
    rec = ClipNormRecorder(owner)
    assert rec.max_norm is None
    owner.clip_grad_norm_([], 1.0)
    assert (float(rec.pop()), rec.max_norm) == (7.5, 1.0)
    owner.clip_grad_norm_([], max_norm=0.5)
    assert rec.max_norm == 0.5
    rec.remove()
    assert "clip_grad_norm_" not in vars(owner)


def test_injected_anomaly_is_exact_up_to_the_onset_and_checked() -> None:
    from examples.traces import RecordedTrace, inject_anomaly
    from hf_dynamic_ckpt.errors import ConfigError

    calm = RecordedTrace(name="t", header={"layers": ["a"]}, rows=[(s, 2.0, 1.0, 1e-3, [0.5]) for s in range(1, 6)])
    shot = inject_anomaly(calm, 3, "loss_x", factor=30.0, steps=2)
    assert shot.rows == [(1, 2.0, 1.0, 1e-3, [0.5]), (2, 2.0, 1.0, 1e-3, [0.5]), (3, 60.0, 30.0, 1e-3, [15.0]),
                         (4, 60.0, 30.0, 1e-3, [15.0]), (5, 2.0, 1.0, 1e-3, [0.5])]
    assert (shot.onsets, shot.name, calm.onsets) == ([(3, "loss_x")], "t+loss_x@3", [])
    nan = inject_anomaly(calm, 2, "nan_grad").rows[1]
    assert math.isnan(nan[2]) and math.isnan(nan[4][0])
    assert inject_anomaly(calm, 5, "lr_surge", factor=20.0).rows[4][3] == pytest.approx(0.02)
    with pytest.raises(ConfigError, match=r"^kind='spike' is invalid: expected one of loss_x, nan_grad, lr_surge\.$"):
        inject_anomaly(calm, 2, "spike")
    with pytest.raises(ConfigError, match=r"^onset=9 is outside the trace 't' \(steps 1\.\.5\)\.$"):
        inject_anomaly(calm, 9, "loss_x")


# ------------------------------------------------------------------ memory
def _cgroup(tmp_path: Path, limit: str, current: int, inactive_file: int) -> Path:
    (tmp_path / "memory.max").write_text(limit + "\n")
    (tmp_path / "memory.current").write_text(f"{current}\n")
    (tmp_path / "memory.stat").write_text(f"anon 1\ninactive_file {inactive_file}\nactive_file 5\n")
    return tmp_path


def test_memory_probe_reads_cgroup_working_set(tmp_path: Path) -> None:
    probe = MemoryProbe(sample_every=5, cgroup_dir=_cgroup(tmp_path, "1000", 700, 200))
    assert probe.host_fraction() == pytest.approx(0.5)
    assert probe.sample(3) == (None, None)
    device, host = probe.sample(10)
    assert host == pytest.approx(0.5)
    assert device is None or 0.0 <= device <= 1.0


def test_memory_probe_falls_back_to_machine_without_cgroup_limit(tmp_path: Path) -> None:
    import psutil

    probe = MemoryProbe(cgroup_dir=_cgroup(tmp_path, "max", 700, 0))
    vm = psutil.virtual_memory()
    assert probe.host_fraction() == pytest.approx((vm.total - vm.available) / vm.total, abs=0.05)
    with pytest.raises(ValueError, match="sample_every=0"):
        MemoryProbe(sample_every=0)


# ------------------------------------------------------------------ frame reduction (single process)
def test_frame_reduction_rules_and_no_op_without_process_group() -> None:
    names = ["a", "b", "c"]
    f0 = SignalFrame(step=7, loss=1.5, grad_norm=2.0, lora_max_ratio=1.2, lora_max_layer="a",
                     device_mem_frac=0.5, step_time_s=0.2, lr=1e-3)
    f1 = SignalFrame(step=7, loss=2.5, grad_norm=9.0, lora_max_ratio=6.0, lora_max_layer="c",
                     host_mem_frac=0.9, step_time_s=0.3, lr=1e-3, preempt=True)
    rows = torch.stack([distributed.pack_frame(f0, names), distributed.pack_frame(f1, names)])
    out = distributed.combine_frames(7, rows, names)
    assert out == SignalFrame(step=7, loss=4.0, grad_norm=9.0, lora_max_ratio=6.0, lora_max_layer="c",
                              nonfinite=False, device_mem_frac=0.5, host_mem_frac=0.9, step_time_s=0.3,
                              lr=1e-3, preempt=True)
    f1.grad_norm = math.nan
    rows = torch.stack([distributed.pack_frame(f0, names), distributed.pack_frame(f1, names)])
    assert distributed.combine_frames(7, rows, names).nonfinite
    assert distributed.reduce_frame(f0) is f0
    assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
    assert distributed.broadcast_object({"x": [1, 2]}) == {"x": [1, 2]}
    distributed.barrier()


def test_differing_decision_fingerprints_raise_one_error_naming_every_rank() -> None:
    names = ["a"]
    frame = SignalFrame(step=9, loss=1.0, grad_norm=2.0)
    agreed = torch.stack([distributed.pack_frame(frame, names, fingerprint=3.0)] * 3)
    distributed.check_fingerprints(agreed, 9)  # the same decisions so far: no error
    rows = torch.stack([distributed.pack_frame(frame, names, fingerprint=f) for f in (3.0, 3.0, 4.0)])
    with pytest.raises(DistributedError) as e:
        distributed.check_fingerprints(rows, 9)
    assert str(e.value) == (
        "step 9: the ranks have taken different save decisions so far (rank 0: 3, rank 1: 3, rank 2: 4); a save "
        "one rank takes alone would leave rank 0 waiting for files that never come. This is a bug: report it with "
        "the ranks' logs. Resume from the last committed checkpoint.")
    # The frame itself still reduces: the fingerprint is not one of its fields.
    assert distributed.combine_frames(9, rows, names) == distributed.combine_frames(9, agreed, names)


def test_layer_baselines_discount_a_noisy_layers_own_spread() -> None:
    """A layer that swings widely must jump further than a steady one to count as a surge."""
    baselines = LayerBaselines(window=50, warmup=30, spread_k=4.0)
    for i in range(40):  # "steady" moves +-5 %, "noisy" x0.5..x2 (log-spread ~0.7)
        baselines.observe({"steady": 1.0 + 0.05 * (-1) ** i, "noisy": 2.0 ** ((i % 3) - 1)})
    steady, noisy = baselines.excess("steady", 10.0), baselines.excess("noisy", 10.0)
    assert steady is not None and noisy is not None
    assert steady > 5.0 > noisy
    young = LayerBaselines(warmup=30)
    for _ in range(29):
        young.observe({"a": 1.0})
    assert young.observe({"a": 100.0}) == (None, None)  # still warming up: no ratio yet
    assert young.observe({"a": 100.0})[0] == pytest.approx(100.0)
    assert young.observe({"a": math.nan}) == (math.inf, "a")

"""Computed memory and checkpoint sizes of the recipes' real models (no download, no GPU).

Builds Qwen2-7B and LLaMA-3-8B from their published config values on PyTorch's `meta`
device (shapes only, no memory), wraps them with the recipes' LoRA settings, and prints
parameter counts and the byte sizes that follow from them. Every number is computed, not
measured; activations and allocator overhead are not included.

Three tables:

1. memory and checkpoint sizes of the recipes' setup (LoRA r=16 over a bf16 base, fp32 adapter);
2. bytes per checkpoint tier of the whole model (28 / 32 layers) for LoRA and a full fine-tune,
   each with bf16 or fp32 trained weights, with two floors that follow from the bytes: the
   device-to-host copy of a snapshot at 20 GB/s (pinned memory) and the write at 2 GB/s;
3. with `--measured`, the figures of `scripts/bench_real_width.py --json` (a few layers at the real
   widths, on the machine that ran it) scaled up to the whole model: bytes per tier by trainable
   parameter, the snapshot stall by staged byte, the step time by matmul parameter (the
   forward and backward FLOPs of a token), and the stall's share of a step.

    python recipes/estimate_sizes.py
    python recipes/estimate_sizes.py --json
    python recipes/estimate_sizes.py --measured bench_out/real_width/qwen2-7b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

# Values of the published config.json files (Qwen/Qwen2-7B, meta-llama/Meta-Llama-3-8B).
MODELS = {
    "qwen2_7b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3_8b": (LlamaConfig, LlamaForCausalLM, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)),
}
ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
LORA_R = 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = 1024**3
MIB = 1024**2
D2H_BYTES_PER_S = 20e9  # a pinned device-to-host copy over PCIe 4/5 x16, in practice
WRITE_BYTES_PER_S = 2e9  # one local NVMe drive, sequential
# (setup, bytes per trained parameter in L0, in L1): L1 is AdamW's exp_avg + exp_avg_sq, which torch keeps
# in the parameter's dtype; the per-parameter `step` counters, the scheduler and L2 (RNG per rank, data
# position, manifest: tens of KB) are left out.
SETUPS = [
    ("LoRA r=16, bf16 adapter + bf16 moments", "lora", 2, 4),
    ("LoRA r=16, fp32 adapter + fp32 moments (PEFT's default)", "lora", 4, 8),
    ("full, bf16 weights + bf16 moments", "full", 2, 4),
    ("full, fp32 master weights + fp32 moments", "full", 4, 8),
]


def counts(config_cls: Any, model_cls: Any, values: dict[str, Any], r: int = LORA_R,
           targets: list[str] = LORA_TARGETS) -> dict[str, int]:
    """Parameters of the model (on `meta`): base, matmul (all but the input embedding) and the LoRA adapter."""
    with torch.device("meta"):
        model = model_cls(config_cls(**values))
        base = sum(p.numel() for p in model.parameters())
        matmul = base - model.get_input_embeddings().weight.numel()
        peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                      task_type="CAUSAL_LM"))
    adapter = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return {"base": base, "matmul": matmul, "adapter": adapter}


def estimate(name: str, r: int = LORA_R, targets: list[str] = LORA_TARGETS) -> dict[str, float]:
    config_cls, model_cls, values = MODELS[name]
    n = counts(config_cls, model_cls, values, r, targets)
    base, adapter = n["base"], n["adapter"]
    static_lora = base * 2 + adapter * (4 + 4 + 8)
    return {
        "base_params": base,
        "adapter_params (LoRA r=16, 7 projections)": adapter,
        "base_weights_bf16_GiB (per GPU, DDP)": base * 2 / GIB,
        "adapter_fp32_MiB": adapter * 4 / MIB,
        "adapter_grads_fp32_MiB": adapter * 4 / MIB,
        "adamw_state_fp32_MiB (exp_avg+exp_avg_sq)": adapter * 8 / MIB,
        "static_train_memory_GiB (no activations)": static_lora / GIB,
        "ckpt_L0_adapter_MiB (weights.safetensors)": adapter * 4 / MIB,
        "ckpt_L1_optimizer_MiB (before zstd)": adapter * 8 / MIB,
        "full_ft_ckpt_GB (bf16 weights + fp32 AdamW)": base * (2 + 8) / 1e9,
        "lora_ckpt_vs_full_ft_ckpt_ratio": (adapter * 12) / (base * 10),
    }


def tiers(name: str) -> list[dict[str, Any]]:
    """Bytes per tier and the copy / write floors of every setup in `SETUPS`, for the whole model."""
    config_cls, model_cls, values = MODELS[name]
    n = counts(config_cls, model_cls, values)
    rows = []
    for setup, kind, l0, l1 in SETUPS:
        trained = n["adapter"] if kind == "lora" else n["base"]
        total = trained * (l0 + l1)
        rows.append({"setup": setup, "trained_params": trained, "L0_bytes": trained * l0, "L1_bytes": trained * l1,
                     "d2h_floor_s": total / D2H_BYTES_PER_S, "write_floor_s": total / WRITE_BYTES_PER_S})
    return rows


def _bytes(n: float) -> str:
    if n != n:  # NaN: not measured
        return "-"
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / MIB:,.1f} MiB"


def _seconds(s: float) -> str:
    if s != s:
        return "-"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def scaled(path: str) -> tuple[str, list[dict[str, Any]]]:
    """The figures of a `bench_real_width.py --json` file, scaled from its layers to the whole model."""
    data = json.loads(Path(path).read_text())
    config_cls, model_cls = ARCHS[data["arch"]]
    values = {**data["config"], "tie_word_embeddings": False}
    full = counts(config_cls, model_cls, {**values, "num_hidden_layers": data["full_layers"]})
    title = f"{data['model']} ({path}): measured on {data['device']} with batch {data['batch']} x {data['seq']} tokens"
    rows = []
    nan = float("nan")
    for s in data["summaries"]:
        layers, mode = s["layers"], s["mode"]
        measured = counts(config_cls, model_cls, {**values, "num_hidden_layers": layers})
        key = "adapter" if mode == "lora" else "base"
        grow = full[key] / measured[key]  # trained parameters: what L0, L1 and the snapshot buffers hold
        flops = full["matmul"] / measured["matmul"]  # a token's forward and backward work
        resume = s.get("resume", {})
        ours = resume.get("bytes", {}).get("ours", {"weights": nan, "optimizer": nan, "state": nan})
        # The trio's saves when it ran, else the resume's preparation run's.
        stalls = s.get("blocking_ms") or resume.get("prep_blocking_ms") or []
        blocking = statistics.median(stalls) / 1e3 if stalls else nan
        steps = s.get("median_step_s")
        step = statistics.median(steps) if steps else resume.get("prep_median_step_s", nan)
        write = statistics.median(s["write_ms"]) / 1e3 if s.get("write_ms") else nan
        rows.append({
            "mode": mode, "measured_layers": layers, "full_layers": data["full_layers"],
            "L0_bytes": ours["weights"] * grow, "L1_bytes": ours["optimizer"] * grow, "L2_bytes": ours["state"],
            "measured_blocking_s": blocking, "blocking_s": blocking * grow, "measured_step_s": step,
            "step_s": step * flops, "measured_share": blocking / step, "share": blocking * grow / (step * flops),
            "write_s": write * grow, "staging": s.get("staging") or resume.get("prep_staging", []),
        })
    return title, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--measured", nargs="*", default=[], metavar="JSON",
                        help="bench_real_width.py --json files to scale up to the whole model")
    args = parser.parse_args()
    rows = {name: estimate(name) for name in MODELS}
    per_tier = {name: tiers(name) for name in MODELS}
    measured = [scaled(path) for path in args.measured]
    if args.json:
        print(json.dumps({**rows, "tiers": per_tier, "measured": dict(measured)}, indent=2))
        return
    keys = list(next(iter(rows.values())))
    print(f"{'quantity (computed, not measured)':46s}" + "".join(f"{n:>16s}" for n in rows))
    for k in keys:
        fmt = "{:>16,.0f}" if "params" in k else "{:>16,.5f}" if "ratio" in k else "{:>16,.2f}"
        print(f"{k:46s}" + "".join(fmt.format(rows[n][k]) for n in rows))
    for name, table in per_tier.items():
        layers = MODELS[name][2]["num_hidden_layers"]
        print(f"\n{name}, all {layers} layers: bytes per checkpoint tier (computed; L2 is tens of KB), D2H floor "
              f"at {D2H_BYTES_PER_S / 1e9:.0f} GB/s pinned, write floor at {WRITE_BYTES_PER_S / 1e9:.0f} GB/s")
        print(f"{'setup':58s}{'trained params':>16s}{'L0 weights':>14s}{'L1 optimizer':>14s}{'D2H floor':>12s}"
              f"{'write floor':>13s}")
        for r in table:
            print(f"{r['setup']:58s}{r['trained_params']:>16,}{_bytes(r['L0_bytes']):>14s}{_bytes(r['L1_bytes']):>14s}"
                  f"{_seconds(r['d2h_floor_s']):>12s}{_seconds(r['write_floor_s']):>13s}")
    for title, table in measured:
        print(f"\n{title}; scaled to the whole model (bytes and stall by trained parameters, step by matmul "
              "parameters; the stall is that machine's host copy, not a GPU's)")
        print(f"{'mode':6s}{'layers':>10s}{'L0':>12s}{'L1':>12s}{'stall':>20s}{'step':>19s}{'stall / step':>20s}"
              f"{'write':>10s}  staging")
        for r in table:
            print(f"{r['mode']:6s}{r['measured_layers']:>4d} -> {r['full_layers']:<4d}{_bytes(r['L0_bytes']):>12s}"
                  f"{_bytes(r['L1_bytes']):>12s}{_seconds(r['measured_blocking_s']):>10s} -> "
                  f"{_seconds(r['blocking_s']):<9s}"
                  f"{_seconds(r['measured_step_s']):>8s} -> {_seconds(r['step_s']):<8s}"
                  f"{r['measured_share']:>9.2%} -> {r['share']:<8.2%}{_seconds(r['write_s']):>10s}  "
                  f"{','.join(r['staging'])}")


if __name__ == "__main__":
    main()

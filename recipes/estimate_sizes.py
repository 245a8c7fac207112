"""Computed memory and checkpoint sizes of the recipes' real models (no download, no GPU).

Builds Qwen2-7B and LLaMA-3-8B from their published config values on PyTorch's `meta`
device (shapes only, no memory), wraps them with the recipes' LoRA settings, and prints
parameter counts and the byte sizes that follow from them. Every number is computed, not
measured; activations and allocator overhead are not included.

    python recipes/estimate_sizes.py
"""

from __future__ import annotations

import argparse
import json

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
LORA_R = 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = 1024**3
MIB = 1024**2


def estimate(name: str, r: int = LORA_R, targets: list[str] = LORA_TARGETS) -> dict[str, float]:
    config_cls, model_cls, values = MODELS[name]
    with torch.device("meta"):
        model = model_cls(config_cls(**values))
        base = sum(p.numel() for p in model.parameters())
        peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, task_type="CAUSAL_LM"))
    adapter = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    rows = {name: estimate(name) for name in MODELS}
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    keys = list(next(iter(rows.values())))
    print(f"{'quantity (computed, not measured)':46s}" + "".join(f"{n:>16s}" for n in rows))
    for k in keys:
        fmt = "{:>16,.0f}" if "params" in k else "{:>16,.5f}" if "ratio" in k else "{:>16,.2f}"
        print(f"{k:46s}" + "".join(fmt.format(rows[n][k]) for n in rows))


if __name__ == "__main__":
    main()

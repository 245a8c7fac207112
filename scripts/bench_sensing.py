"""Step time with sensing on vs off: the cost of the probes and the policy per step.

Sensing "on" = what the checkpointer adds to a training step: the loss forward hook,
the pre-clip norm recorded from `clip_grad_norm_`, per-LoRA-layer gradient norms (one
fused `torch._foreach_norm`), a memory sample every 5 steps, the preemption flag, and
the policy's `pre_update` + `decide`. Both modes run the same training step (forward,
backward, clip to 1.0, AdamW), interleaved step by step (on, off, on, off, ...) so that
load from other processes hits both alike.

Times are CPU time of the training thread (`time.thread_time`, torch limited to one
thread), which other processes on a shared machine do not inflate. Two overheads are
reported: A/B (median step time on / off - 1) and direct (time inside the sensing and
policy calls after backward / median step time off; the loss hook inside the forward
is only in the A/B figure).

Usage: python scripts/bench_sensing.py [--steps 20] [--threads 1] [--skip-large]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.distributed import reduce_frame
from hf_dynamic_ckpt.policy import RulePolicy
from hf_dynamic_ckpt.run.sensing import PreemptionFlag
from hf_dynamic_ckpt.signals import SignalFrame
from hf_dynamic_ckpt.signals.probes import ClipNormRecorder, GradProbe, LossProbe, MemoryProbe


def build(kind: str) -> tuple[torch.nn.Module, int, int, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind.startswith("tiny-"):
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        batch, seq = 4, 32
    else:
        cfg = LlamaConfig(vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=12,
                          num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
        batch, seq = 2, 128
    model = LlamaForCausalLM(cfg)
    if kind == "tiny-full":
        return model, batch, seq, "full fine-tune"
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return model, batch, seq, "LoRA r=8 q,v"


def bench(kind: str, steps: int) -> dict[str, object]:
    model, batch, seq, mode = build(kind)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    grad_probe = GradProbe(model)
    memory = MemoryProbe(sample_every=5)
    flag = PreemptionFlag()
    policy = RulePolicy(SmartCkptConfig(base_interval=10_000, policy={"max_interval": 10_000}))
    times: dict[bool, list[float]] = {True: [], False: []}
    sensing: list[float] = []

    clock = time.thread_time  # CPU time of this thread: robust to other processes on a shared machine

    def step(i: int, on: bool) -> None:
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        if on:  # attached for this step only; attaching is a one-time cost in real use, not timed
            loss_probe = LossProbe(model)
            recorder = ClipNormRecorder(torch.nn.utils, "clip_grad_norm_")
        t0 = clock()
        work = 0.0
        out = model(input_ids=ids, labels=ids)  # with sensing on, the loss hook runs in here
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if on:
            s0 = clock()
            fields = grad_probe.frame_fields(pre_clip_norm=recorder.pop())
            loss = loss_probe.pop()
            dev, host = memory.sample(i)
            frame = SignalFrame(step=i, loss=float(loss) if loss is not None else None, device_mem_frac=dev,
                                host_mem_frac=host, lr=opt.param_groups[0]["lr"], preempt=flag.is_set, **fields)
            frame = reduce_frame(frame, layer_names=grad_probe.layer_names)
            policy.pre_update(frame)
            work += clock() - s0
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on:
            s0 = clock()
            frame.step_time_s = clock() - t0
            policy.decide(frame)
            work += clock() - s0
            sensing.append(work)
        times[on].append(clock() - t0)
        if on:
            loss_probe.remove()
            recorder.remove()

    for i in range(1, 4):  # warm-up, both paths
        step(i, i % 2 == 0)
    times, sensing[:] = {True: [], False: []}, []
    for i in range(4, 4 + 2 * steps):
        step(i, i % 2 == 0)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in params)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    work = statistics.median(sensing)
    return {"model": kind, "mode": mode, "params": total, "trainable": trainable, "tokens": batch * seq,
            "off_ms": 1e3 * off, "on_ms": 1e3 * on, "ab": on / off - 1, "work_ms": 1e3 * work, "direct": work / off,
            "lora_layers": len(grad_probe.layer_names)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kinds = ["tiny-full", "tiny-lora"] + ([] if args.skip_large else ["llama-55m-lora"])
    rows = [bench(k, args.steps if k.startswith("tiny") else max(6, args.steps // 2)) for k in kinds]
    print(f"torch {torch.__version__}, threads={args.threads}, device=cpu, cuda={torch.cuda.is_available()}")
    print("| model | params (trainable) | LoRA layers | tokens/step | step off ms | step on ms | A/B overhead "
          "| sensing ms | direct overhead |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} ({r['mode']}) | {r['params'] / 1e6:.2f}M ({r['trainable'] / 1e6:.3f}M) | "
              f"{r['lora_layers']} | {r['tokens']} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | {100 * r['ab']:+.2f}% | "
              f"{r['work_ms']:.3f} | {100 * r['direct']:.2f}% |")


if __name__ == "__main__":
    main()

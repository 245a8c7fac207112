"""Runnable worker for the fast memory-limit test (not a test module): a plain torch training loop.

An MLP of `--mib` MiB of float32 weights trained with AdamW (so ~3x that in state), with
a forward pass whose activations a step allocates and frees. `--saves none` trains only;
`--saves engine` saves every `--every` steps through `SaveEngine`, then checks that the
last checkpoint loads back bit-equal to the live state. Writes `<out>/<tag>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

torch.set_num_threads(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--saves", choices=["none", "engine"], required=True)
    p.add_argument("--mib", type=int, default=64, help="MiB of float32 weights")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--mode", default="process")
    args = p.parse_args()

    from hf_dynamic_ckpt.constants import ALL_TIERS
    from hf_dynamic_ckpt.engine import SaveEngine
    from hf_dynamic_ckpt.state import StateSources
    from hf_dynamic_ckpt.store import CheckpointStore, SaveRequest

    width = 1024
    layers = max(1, args.mib * (1 << 20) // (4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(256, width)  # activations: 1 MiB per layer, kept for backward

    engine = store = None
    if args.saves == "engine":
        store = CheckpointStore(os.path.join(args.out, "ckpt"))
        engine = SaveEngine(store, mode=args.mode)
        sources = StateSources(weights=model.state_dict, optimizer=opt)
    handles = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        model(data).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if engine is not None and step % args.every == 0:
            handles.append(engine.save(sources, SaveRequest(step=step, tiers=ALL_TIERS, reason="interval"),
                                       rng={"seed": 0}))
    result: dict = {"train_s": time.perf_counter() - start}
    if engine is not None and store is not None:
        infos = [h.wait() for h in handles]
        result["saves"] = [{"step": i.step, "staging": h.staging, "blocking_ms": h.blocking_ms}
                           for i, h in zip(infos, handles)]
        result["writer_pid"] = engine.writer_pid
        engine.close()
        loaded = store.load(f"step:{infos[-1].step}")
        live = model.state_dict()
        result["weights_equal"] = all(torch.equal(loaded.weights[k], v) for k, v in live.items())
        state = opt.state_dict()["state"]
        result["optimizer_equal"] = all(
            torch.equal(loaded.optimizer["state"][i][k], v) for i, st in state.items() for k, v in st.items()
        )
        store.close()
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["children_peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())

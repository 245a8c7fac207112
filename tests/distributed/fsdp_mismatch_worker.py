"""Worker of test_fsdp_resume.py: sharded <-> unsharded resumes are refused before anything changes.

One process, a one-rank gloo group: saves step 1 and 2 sharded (fully_shard) in store `sharded`
and unsharded in store `plain`, then resumes `step:1` of each into the other kind of model.
Prints one JSON line: the errors and whether step 2 stayed unabandoned.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def train_and_save(root: str, *, sharded: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    from hf_dynamic_ckpt import SmartCkptConfig
    from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator

    model = mlp()
    if sharded:
        fully_shard(model[0])
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ck = RunOrchestrator(SmartCkptConfig(engine="sync", runtime={"preemption_signals": ()}), root=root)
    ck.attach(model, optimizer=opt)
    for step in (1, 2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.save_now(step, 0.0)
    ck.close()


def resume(root: str, *, sharded: bool) -> dict[str, object]:
    from torch.distributed.fsdp import fully_shard

    from hf_dynamic_ckpt import SmartCkptConfig
    from hf_dynamic_ckpt.run.orchestrator import RunOrchestrator

    model = mlp()
    if sharded:
        fully_shard(model[0])
        fully_shard(model)
    ck = RunOrchestrator(SmartCkptConfig(engine="sync", runtime={"preemption_signals": ()}), root=root)
    ck.attach(model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))
    try:
        ck.resume("step:1", expected=model.state_dict())  # what the integrations pass (the model check)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    listed = {i.step: i.abandoned for i in ck.store.list(include_abandoned=True)}
    ck.close()
    return {"error": error, "abandoned": listed}


def main(tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    train_and_save(f"{tmp}/sharded", sharded=True)
    train_and_save(f"{tmp}/plain", sharded=False)
    out = {"into_plain": resume(f"{tmp}/sharded", sharded=False),
           "into_sharded": resume(f"{tmp}/plain", sharded=True)}
    print("RESULT " + json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

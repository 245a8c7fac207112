"""Worker: a custom Accelerate loop with SmartCheckpointer on an FSDP2 (`fully_shard`) model (CPU, gloo).

Run under `torchrun --nproc_per_node N` (N = 1 too: a one-rank mesh). The model (a small MLP)
is sharded with `torch.distributed.fsdp.fully_shard` before `accelerator.prepare(optimizer, loader,
scheduler)` (the model itself is not prepared: Accelerate would wrap it in DDP on CPU). Every rank
sees the same batches (the loader is not sharded, dropout seeded alike), so runs at different world
sizes train the same model up to float reduction order. Rank 0 appends one JSON line per optimizer step to
--losses (float.hex, exact). --kill_at_step: every rank SIGKILLs itself right after that step's
save decision. --dcp_save_at / --dcp_resume: the reference, DCP's own `dcp.save` / `dcp.load`
(default FileSystemWriter/Reader) of the same model + optimizer state. --final: rank 0 writes the
full (gathered) trainable weights as safetensors at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal

import torch

torch.set_num_threads(1)


def build() -> torch.nn.Module:
    """A small MLP with uneven shards (15 rows over 2 ranks) and an empty shard (1 row over 2 ranks)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(15, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    for index in (0, 3, 5):
        fully_shard(model[index])
    fully_shard(model)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--final", default=None)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--resume", default=None)
    p.add_argument("--kill_at_step", type=int, default=None)
    p.add_argument("--base_interval", type=int, default=3)
    p.add_argument("--examples", type=int, default=32)
    p.add_argument("--dcp_save_at", type=int, default=None, help="also dcp.save the state after step N (reference)")
    p.add_argument("--dcp_resume", default=None, help="resume with dcp.load from this folder (reference)")
    p.add_argument("--accelerate_fsdp", action="store_true",
                   help="shard with Accelerate's FSDP plugin (fsdp_version=2) instead of fully_shard; needs a GPU")
    p.add_argument("--log_info", action="store_true", help="show the library's INFO lines (the resume's plan)")
    p.add_argument("--memory_tier", default="true", choices=["true", "false"])
    p.add_argument("--memory_every", type=int, default=None, help="runtime.memory_every (default: from its cost)")
    p.add_argument("--wait_writer", action="store_true", help="wait for the writer process after step 1")
    args = p.parse_args()
    if args.log_info:
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("hf_dynamic_ckpt").setLevel(logging.INFO)

    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from safetensors.torch import save_file

    from hf_dynamic_ckpt import SmartCheckpointer, SmartCkptConfig

    if args.accelerate_fsdp:  # Accelerate's CPU backend ignores the FSDP plugin: this path needs CUDA
        from accelerate.utils import FullyShardedDataParallelPlugin

        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        set_seed(0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(15, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    else:
        accelerator = Accelerator(cpu=True)
        set_seed(0)
        model = build()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.examples, 8, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=5e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.2, total_iters=args.max_steps)
    if args.accelerate_fsdp:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    config = SmartCkptConfig(base_interval=args.base_interval, keep_last=100, policy={"overhead_budget": 1.0},
                             runtime={"memory_tier": args.memory_tier == "true", "memory_every": args.memory_every})
    ckpt = SmartCheckpointer(accelerator, model, optimizer, scheduler, loader, config=config,
                             output_dir=args.output_dir)
    resumed_from = None
    if args.dcp_resume:
        resumed_from = dcp_load(model, optimizer, scheduler, ckpt, args.dcp_resume)
    else:
        loaded = ckpt.resume(args.resume)
        resumed_from = loaded.info.step if loaded else None
    main_rank = accelerator.is_main_process
    out = open(args.losses, "a", encoding="utf-8") if main_rank else None  # noqa: SIM115
    if out is not None:
        out.write(json.dumps({"resumed_from": resumed_from, "world_size": accelerator.num_processes,
                              "resumed_path": str(loaded.info.path) if not args.dcp_resume and loaded else None})
                  + "\n")
        out.flush()
    while ckpt.step < args.max_steps and not ckpt.should_stop:
        for inputs, targets in ckpt.loader:
            inputs, targets = inputs.to(accelerator.device), targets.to(accelerator.device)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            ckpt.before_update()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            decision = ckpt.after_update()
            if out is not None:
                frame = ckpt.run.last_frame
                out.write(json.dumps({"step": ckpt.step, "loss": float(loss.detach()).hex(),
                                      "grad_norm": frame.grad_norm, "save": decision.save}) + "\n")
                out.flush()
            if ckpt.step == 1 and args.wait_writer:
                assert ckpt.run.engine.start(wait_s=120)
            if ckpt.step == args.dcp_save_at:
                dcp_save(model, optimizer, scheduler, ckpt, f"dcp-{ckpt.step}")
            if ckpt.step == args.kill_at_step:
                if args.final:  # the weights this run reached, for the comparison with the resumed run
                    full = full_weights(model)
                    if main_rank:
                        save_file(full, args.final)
                torch.distributed.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt.step >= args.max_steps or ckpt.should_stop:
                break
    ckpt.close()
    if args.final:
        full = full_weights(model)
        if main_rank:
            save_file(full, args.final)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    trainable = {n for n, q in model.named_parameters() if q.requires_grad}
    return {k: v.detach().contiguous() for k, v in sd.items() if k in trainable}


def dcp_save(model, optimizer, scheduler, ckpt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hf_dynamic_ckpt.state import capture_rng_state

    inner = getattr(optimizer, "optimizer", optimizer)
    msd, osd = get_state_dict(model, inner)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    rank = torch.distributed.get_rank()
    with open(os.path.join(path, f"rng-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(capture_rng_state(), f)  # what the smart save stores per rank, so both resumes match
    if ckpt.accelerator.is_main_process:
        with open(os.path.join(path, "extra.json"), "w", encoding="utf-8") as f:
            json.dump({"step": ckpt.step, "scheduler": scheduler.state_dict(),
                       "loader": ckpt.loader.boundary_position(), "scheduler_pace": ckpt.state.scheduler_pace}, f)


def dcp_load(model, optimizer, scheduler, ckpt, path: str) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)
    msd, osd = get_state_dict(model, inner)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "extra.json"), encoding="utf-8") as f:
        extra = json.load(f)
    scheduler.load_state_dict(extra["scheduler"])
    ckpt.state.optimizer_steps = extra["step"]
    # As a smart resume on another number of processes: the scheduler keeps the saved run's pace, and a rank the
    # saving run did not have continues rank 0's random streams.
    if extra["scheduler_pace"] != ckpt.state.scheduler_pace:
        from hf_dynamic_ckpt.integrations.accelerate import keep_pace

        keep_pace(scheduler, extra["scheduler_pace"])
    rng_file = os.path.join(path, f"rng-{torch.distributed.get_rank()}.json")
    if not os.path.exists(rng_file):
        rng_file = os.path.join(path, "rng-0.json")
    with open(rng_file, encoding="utf-8") as f:
        rng = json.load(f)
    ckpt.loader.resume_from(extra["loader"], rng=rng)
    ckpt.run.note_boundary(ckpt.step)
    return int(extra["step"])


if __name__ == "__main__":
    main()

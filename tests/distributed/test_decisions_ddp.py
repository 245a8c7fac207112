"""Two gloo processes with different local signals take identical decisions, and ranks whose decisions
have diverged all stop at their next exchange with one error."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_dynamic_ckpt import distributed
from hf_dynamic_ckpt.config import SmartCkptConfig
from hf_dynamic_ckpt.errors import DistributedError
from hf_dynamic_ckpt.policy import RulePolicy
from hf_dynamic_ckpt.signals import SignalFrame

pytestmark = pytest.mark.distributed

LAYERS = ["base_model.model.layers.0.q_proj", "base_model.model.layers.1.v_proj"]


def local_frame(rank: int, step: int) -> SignalFrame:
    """Each rank sees something different: only rank 1 has the surge, only rank 0 the memory ramp."""
    loss = 1.0 + 0.1 * rank + 0.01 * math.sin(step + rank)
    grad = 1.0 + 0.05 * math.cos(3 * step + rank)
    fields: dict[str, object] = {"loss": loss, "grad_norm": grad, "step_time_s": 0.1 + 0.01 * rank, "lr": 1e-4}
    if rank == 1 and step == 60:
        fields["grad_norm"] = 25.0
    if rank == 1 and step == 90:
        fields.update(lora_max_ratio=9.0, lora_max_layer=LAYERS[1])
    if rank == 0 and step % 5 == 0:
        fields["device_mem_frac"] = min(0.97, 0.5 + 0.004 * step)
    if rank == 1 and step == 150:
        fields["preempt"] = True
    return SignalFrame(step=step, **fields)  # type: ignore[arg-type]


def simulate(rank: int, *, reduce: bool) -> list[dict[str, object]]:
    policy = RulePolicy(SmartCkptConfig(base_interval=25, policy={"stability_window": 20}))
    out = []
    for step in range(1, 181):
        frame = local_frame(rank, step)
        if reduce:
            frame = distributed.reduce_frame(frame, layer_names=LAYERS)
        for d in (policy.pre_update(frame), policy.decide(frame)):
            if d.save:
                out.append({"at": step, **d.to_dict()})
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        assert distributed.world_size() == 2 and distributed.rank() == rank
        token = distributed.broadcast_object({"session": "abc", "n": [1, 2]} if rank == 0 else None)
        result = {"decisions": simulate(rank, reduce=True), "token": token, "is_main": distributed.is_main()}
        distributed.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_with_different_signals_decide_identically(tmp_path: Path) -> None:
    local = [simulate(r, reduce=False) for r in (0, 1)]
    assert local[0] != local[1]  # without the reduction the ranks would disagree (and deadlock a save)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["decisions"] == r1["decisions"]
    assert r0["token"] == r1["token"] == {"session": "abc", "n": [1, 2]}
    assert (r0["is_main"], r1["is_main"]) == (True, False)
    reasons = [d["reason"] for d in r0["decisions"]]
    # Rank 1's surge and LoRA-layer surge and rank 0's memory ramp all reached both ranks.
    assert any(r.startswith("pre_update grad_surge") for r in reasons)
    assert any(r.startswith("pre_update lora_surge") and LAYERS[1] in r for r in reasons)
    assert any(r.startswith("memory_ramp") for r in reasons)
    assert [d["at"] for d in r0["decisions"] if d["reason"] == "preemption"] == [150]


ALONE_AT = 30  # the step after which rank 1 has taken a save that rank 0 has not


def _diverging_worker(rank: int, port: int, out_dir: str) -> None:
    """The decision loop of `simulate(reduce=True)`, sending the number of saves taken as the fingerprint
    (what `RunOrchestrator` sends); rank 1 takes one save alone after step `ALONE_AT`."""
    torch.set_num_threads(1)
    # A collective left waiting would fail after 30 s (a different error), never hang the test.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    policy = RulePolicy(SmartCkptConfig(base_interval=25, policy={"stability_window": 20}))
    saves: list[int] = []
    result: dict[str, object] = {"error": None}
    try:
        for step in range(1, 61):
            start = time.monotonic()
            try:
                frame = distributed.reduce_frame(local_frame(rank, step), layer_names=LAYERS,
                                                 fingerprint=float(len(saves)))
            except DistributedError as e:
                result = {"error": str(e), "at": step, "wait_s": time.monotonic() - start}
                break
            for d in (policy.pre_update(frame), policy.decide(frame)):
                if d.save:
                    saves.append(step)
            if rank == 1 and step == ALONE_AT:
                saves.append(step)
        result["saves"] = saves
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def test_ranks_whose_decisions_diverged_raise_the_same_error_at_the_next_exchange(tmp_path: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_diverging_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    agreed = r0["saves"]
    expected = (
        f"step {ALONE_AT + 1}: the ranks have taken different save decisions so far (rank 0: {len(agreed)}, "
        f"rank 1: {len(agreed) + 1}); a save one rank takes alone would leave rank 0 waiting for files that never "
        "come. This is a bug: report it with the ranks' logs. Resume from the last committed checkpoint."
    )
    # Both ranks, rank 0 included, stop at the very next exchange with the same error, without waiting on a timeout.
    assert r0["error"] == r1["error"] == expected
    assert r0["at"] == r1["at"] == ALONE_AT + 1
    assert agreed and r1["saves"] == [*agreed, ALONE_AT]  # the same decisions until rank 1 saved alone
    assert r0["wait_s"] < 10 and r1["wait_s"] < 10

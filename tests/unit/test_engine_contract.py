"""The engine's side of its contracts with the store: typed hand-offs and abort.

`ContractStore` implements the store interface the engine relies on (`spec` / `from_spec`, `save(state, request, *,
timings, cancel)`, `world_size`, `rank`) and commits nothing; with `world_size > 1` its rank 0 waits for the other
ranks the way the real store does, until `cancel()` says to give up. The writer process opens it from its spec
(spawn imports this module there) and records what it was handed under `spec.root`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.errors import DistributedError, SaveError
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import Lineage, SaveRequest


@dataclasses.dataclass(frozen=True)
class Spec:
    root: str
    world_size: int = 1
    rank: int = 0
    compression_threads: int = 0


@dataclasses.dataclass
class Info:
    """What the engine reads of a committed save (`CheckpointInfo`'s `step` and `bytes`), and what the test checks."""

    step: int
    reason: str
    pinned: bool
    healthy: bool
    bytes: int = 1


def _request_json(request: SaveRequest) -> str:
    data = dataclasses.asdict(request)
    data["tiers"] = sorted(t.value for t in request.tiers)
    return json.dumps(data, sort_keys=True)


class ContractStore:
    """The store interface the engine relies on, no files committed; records what it was handed under `spec.root`."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.root = Path(spec.root)
        self.world_size, self.rank = spec.world_size, spec.rank
        self.received: list[tuple[object, object]] = []
        self.waiting = threading.Event()

    @classmethod
    def from_spec(cls, spec: Spec, *, cleanup: bool = True) -> ContractStore:
        opened = {"spec": dataclasses.asdict(spec), "cleanup": cleanup}
        (Path(spec.root) / "opened.json").write_text(json.dumps(opened, sort_keys=True))
        return cls(spec)

    def save(self, state, request, *, timings=None, cancel=None) -> Info | None:
        self.received.append((state, request))
        with (self.root / "requests.jsonl").open("a") as f:
            f.write(_request_json(request) + "\n")
        if self.spec.world_size > 1 and self.spec.rank == 0:
            self.waiting.set()
            (self.root / "waiting").touch()
            missing = list(range(1, self.spec.world_size))
            if cancel is None:
                raise DistributedError(f"step {state.step}: rank(s) {missing} never wrote (no cancel given)")
            while not cancel():
                threading.Event().wait(0.01)
            raise DistributedError(f"step {state.step}: cancelled while waiting for rank(s) {missing}; "
                                   "nothing was committed")
        return Info(step=state.step, reason=request.reason, pinned=request.pinned, healthy=request.healthy)

    def close(self) -> None:
        pass


def _store(tmp_path: Path, **kw) -> ContractStore:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return ContractStore(Spec(root=str(tmp_path), **kw))


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


REQUEST = SaveRequest(step=3, epoch=0.5, tiers=ALL_TIERS, reason="interval: every 3 steps", kind="interval",
                      pinned=True, healthy=False, signals={"loss": 1.5}, debug_info=({"step": 2, "loss": 1.6},),
                      lineage=Lineage(session="s1", timeline="t1", parent_step=None))


def test_the_request_reaches_the_store_unchanged(tmp_path):
    store = _store(tmp_path)
    model, opt = _model()
    with SaveEngine(store, mode="sync") as engine:
        info = engine.save(StateSources(weights=model.state_dict, optimizer=opt), REQUEST, rng={"s": 1}).wait(60)
    (state, request), = store.received
    assert request is REQUEST  # the same object: not unpacked and re-packed on the way
    assert (state.step, state.epoch, state.tiers) == (3, 0.5, ALL_TIERS)
    assert info.reason == "interval: every 3 steps" and info.pinned and not info.healthy


def test_the_writer_process_opens_the_store_from_its_spec_and_gets_the_request(tmp_path):
    from hf_dynamic_ckpt.engine.writer import writer_threads

    store = _store(tmp_path)
    model, opt = _model()
    with SaveEngine(store) as engine:
        assert engine.start(wait_s=120)
        handle = engine.save(StateSources(weights=model.state_dict, optimizer=opt), REQUEST, rng={"s": 1})
        assert handle.wait(120).step == 3 and handle.writer == "process"
    opened = json.loads((tmp_path / "opened.json").read_text())
    # The one difference: the store asks for every CPU; the writer process compresses on those training leaves.
    assert opened == {"spec": {**dataclasses.asdict(store.spec), "compression_threads": writer_threads()},
                      "cleanup": False}
    assert (tmp_path / "requests.jsonl").read_text().splitlines() == [_request_json(REQUEST)]
    assert store.received == []  # written by the child's store, not the parent's


def test_the_writer_compresses_on_the_cpus_training_leaves(tmp_path, monkeypatch):
    from hf_dynamic_ckpt.engine.writer import beside_training, writer_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert writer_threads(training_threads=4) == 12
    assert writer_threads(training_threads=4, local_world_size=2) == 4  # 8 CPUs per rank
    assert writer_threads(training_threads=16) == 1  # never 0: the write must go on
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's: 4 CPUs per rank
    assert writer_threads(training_threads=1) == 3
    # A count set on the store is kept; synchronous saves (training waits) keep every CPU: the store's own spec.
    assert beside_training(Spec(root=str(tmp_path), compression_threads=5)).compression_threads == 5


def test_abort_ends_a_rank_0_save_waiting_for_other_ranks(tmp_path):
    store = _store(tmp_path, world_size=2)
    model, opt = _model()
    engine = SaveEngine(store)
    try:
        assert engine.start(wait_s=120)
        sources = StateSources(weights=model.state_dict, optimizer=opt)
        handle = engine.save(sources, SaveRequest(step=3, reason="interval"), rng={"s": 1})
        for _ in range(6000):  # the writer process is inside the store's wait for rank 1
            if (tmp_path / "waiting").exists():
                break
            threading.Event().wait(0.01)
        assert not handle.done()
        engine.abort("rank 1 failed: CUDA error")
        with pytest.raises(SaveError) as excinfo:
            handle.wait(60)
        message = str(excinfo.value)
        assert message.startswith("save of step 3 (interval) aborted (rank 1 failed: CUDA error): ")
        assert "cancelled while waiting for rank(s) [1]; nothing was committed" in message
        assert message.endswith("Nothing of it was committed; the previous checkpoint (none written by this engine) "
                                "stays the restore point.")
        assert not engine.busy
        engine.abort("again")  # nothing in progress: no effect
    finally:
        engine.close()


def test_abort_reaches_a_blocking_save_and_spares_later_ones(tmp_path):
    store = _store(tmp_path, world_size=2)
    model, opt = _model()
    engine = SaveEngine(store)
    assert engine.start(wait_s=120)
    errors: list[BaseException] = []

    def blocking_save() -> None:
        try:
            engine.save(StateSources(weights=model.state_dict), SaveRequest(step=4, tiers={Tier.WEIGHTS}, reason="x"),
                        blocking=True).wait()
        except SaveError as e:
            errors.append(e)

    t = threading.Thread(target=blocking_save)
    t.start()
    assert store.waiting.wait(60)
    engine.abort("stopping")
    t.join(60)
    assert not t.is_alive() and len(errors) == 1
    assert str(errors[0]).startswith("save of step 4 (x) aborted (stopping): ")
    # A save started after the abort (in the background, by the writer process) is not aborted: it waits again.
    (tmp_path / "waiting").unlink()
    later = engine.save(StateSources(weights=model.state_dict, optimizer=opt), SaveRequest(step=5, reason="y"))
    for _ in range(6000):
        if (tmp_path / "waiting").exists():
            break
        threading.Event().wait(0.01)
    assert (tmp_path / "waiting").exists() and not later.done() and later.writer == "process"
    engine.abort("done")
    with pytest.raises(SaveError, match=r"save of step 5 \(y\) aborted \(done\)"):
        later.wait(60)
    engine.close()

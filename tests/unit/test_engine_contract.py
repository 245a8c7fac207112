"""The engine's side of its contracts with the store: typed hand-offs, info.blobs, abort, module shape.

`ContractStore` implements the store interface the engine relies on (`spec`/`from_spec`,
`save(state, request, *, timings, cancel)`, `CheckpointInfo.blobs`, `blobs.exists`) and
commits nothing; with `world_size > 1` its rank 0 waits for the other ranks the way the
real store does, until `cancel()` says to give up. It is importable by the writer process
(spawn re-creates this module there), so process mode is checked against it too.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch

from hf_dynamic_ckpt.constants import ALL_TIERS, Tier
from hf_dynamic_ckpt.engine import SaveEngine
from hf_dynamic_ckpt.errors import DistributedError, SaveError
from hf_dynamic_ckpt.state import StateSources
from hf_dynamic_ckpt.store import BlobRef, CheckpointInfo, Lineage, SaveRequest, StoreSpec

ENGINE_DIR = Path(__file__).resolve().parents[2] / "hf_dynamic_ckpt" / "engine"


def _request_json(request: SaveRequest) -> str:
    data = dataclasses.asdict(request)
    data["tiers"] = sorted(t.value for t in request.tiers)
    return json.dumps(data, sort_keys=True)


class _Blobs:
    def __init__(self, root: Path) -> None:
        self.root = root

    def exists(self, digest: str) -> bool:
        return not (self.root / f"gone-{digest}").exists()


class ContractStore:
    """The store interface the engine relies on, no files committed; records what it was handed under `spec.root`."""

    fill_blobs = True

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.root = Path(spec.root)
        self.world_size = spec.world_size
        self.blobs = _Blobs(self.root)
        self.received: list[tuple[object, object]] = []
        self.waiting = threading.Event()

    @classmethod
    def from_spec(cls, spec: StoreSpec, *, cleanup: bool = True) -> ContractStore:
        opened = {"spec": {**dataclasses.asdict(spec), "codec": spec.codec.value}, "cleanup": cleanup}
        (Path(spec.root) / "opened.json").write_text(json.dumps(opened, sort_keys=True))
        return cls(spec)

    def save(self, state, request, *, timings=None, cancel=None) -> CheckpointInfo | None:
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
        blobs = {}
        if self.fill_blobs:
            for key in state.dedup_keys:
                v = state.weights[key]
                shape = list(v.shape)
                blobs[key] = {"digest": v.digest if isinstance(v, BlobRef) else f"d-{key}",
                              "dtype": str(v.dtype).removeprefix("torch."), "shape": shape, "size": 1}
        return CheckpointInfo(task_id=self.spec.task_id, step=state.step, path=str(self.root / f"step-{state.step}"),
                              reason=request.reason, tiers=state.tiers, bytes=1, loss=None, gpu_mem_percent=None,
                              save_time=0.0, recovery_cost_ms=None, healthy=request.healthy, pinned=request.pinned,
                              status="ok", blobs=blobs)

    def close(self) -> None:
        pass


def _store(tmp_path: Path, **kw) -> ContractStore:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return ContractStore(StoreSpec(root=str(tmp_path), session_id="s1", **kw))


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


@pytest.mark.parametrize("mode", ["thread", "sync"])
def test_the_request_reaches_the_store_unchanged(tmp_path, mode):
    store = _store(tmp_path)
    model, opt = _model()
    with SaveEngine(store, mode=mode) as engine:
        info = engine.save(StateSources(weights=model.state_dict, optimizer=opt), REQUEST, rng={"s": 1}).wait(60)
    (state, request), = store.received
    assert request is REQUEST  # the same object: not unpacked and re-packed on the way
    assert (state.step, state.epoch, state.tiers) == (3, 0.5, ALL_TIERS)
    assert info.reason == "interval: every 3 steps" and info.pinned and not info.healthy


def test_the_writer_process_opens_the_store_from_the_same_spec_and_gets_the_request(tmp_path):
    from hf_dynamic_ckpt.engine.dispatch import writer_threads

    store = _store(tmp_path, compression_level=5, codec="none", rank_timeout_s=42.0)
    model, opt = _model()
    engine = SaveEngine(store, mode="process")
    try:
        assert engine.wait_writer_ready(120)
        handle = engine.save(StateSources(weights=model.state_dict, optimizer=opt), REQUEST, rng={"s": 1})
        assert handle.wait(120).step == 3 and handle.writer == "process"
    finally:
        engine.close()
    opened = json.loads((tmp_path / "opened.json").read_text())
    # The one difference: the store asks for every CPU; the writer process compresses on those training leaves.
    assert store.spec.compression_threads == 0
    spec = {**dataclasses.asdict(store.spec), "codec": "none", "compression_threads": writer_threads()}
    assert opened == {"spec": spec, "cleanup": False}
    assert (tmp_path / "requests.jsonl").read_text().splitlines() == [_request_json(REQUEST)]
    assert store.received == []  # written by the child's store, not the parent's


def test_frozen_blob_bookkeeping_reads_info_blobs(tmp_path):
    store = _store(tmp_path)
    model, _ = _model()
    frozen = frozenset({"0.weight", "0.bias"})
    sources = StateSources(weights=model.state_dict, frozen_keys=frozen)
    with SaveEngine(store) as engine:
        for step in (1, 2):
            engine.save(sources, SaveRequest(step=step, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
        (first, _), (second, _) = store.received
        assert all(isinstance(first.weights[k], torch.Tensor) for k in frozen)
        assert second.weights["0.weight"] == BlobRef("d-0.weight", "float32", (3, 4))
        assert second.weights["0.bias"] == BlobRef("d-0.bias", "float32", (3,))
        assert isinstance(second.weights["1.weight"], torch.Tensor)
        (tmp_path / "gone-d-0.bias").touch()  # the blob disappeared (e.g. gc): written again
        engine.save(sources, SaveRequest(step=3, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
    third = store.received[2][0]
    assert isinstance(third.weights["0.bias"], torch.Tensor) and isinstance(third.weights["0.weight"], BlobRef)


def test_empty_info_blobs_means_unknown_and_frozen_weights_are_handed_over_again(tmp_path):
    store = _store(tmp_path)
    store.fill_blobs = False
    model, _ = _model()
    sources = StateSources(weights=model.state_dict, frozen_keys=frozenset({"0.weight"}))
    with SaveEngine(store) as engine:
        for step in (1, 2):
            engine.save(sources, SaveRequest(step=step, tiers={Tier.WEIGHTS}, reason="a")).wait(60)
    assert [type(s.weights["0.weight"]) for s, _ in store.received] == [torch.Tensor, torch.Tensor]
    assert [s.dedup_keys for s, _ in store.received] == [frozenset({"0.weight"})] * 2


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_abort_ends_a_rank_0_save_waiting_for_other_ranks(tmp_path, mode):
    store = _store(tmp_path, world_size=2)
    model, opt = _model()
    engine = SaveEngine(store, mode=mode)
    try:
        assert engine.wait_writer_ready(120)
        sources = StateSources(weights=model.state_dict, optimizer=opt)
        handle = engine.save(sources, SaveRequest(step=3, reason="interval"), rng={"s": 1})
        for _ in range(6000):  # the writer (thread or process) is inside the store's wait for rank 1
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
    # A save started after the abort is not aborted: it waits for rank 1 again.
    store.waiting.clear()
    later = engine.save(StateSources(weights=model.state_dict, optimizer=opt), SaveRequest(step=5, reason="y"))
    assert store.waiting.wait(60) and not later.done()
    engine.abort("done")
    with pytest.raises(SaveError, match=r"save of step 5 \(y\) aborted \(done\)"):
        later.wait(60)
    engine.close()


def _engine_imports() -> dict[str, set[str]]:
    """Module -> engine modules it imports (relative imports anywhere in the file, lazy ones too)."""
    graph: dict[str, set[str]] = {}
    for path in ENGINE_DIR.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        graph[path.stem] = deps
    return graph


def test_engine_modules_form_no_import_cycle_and_stay_small():
    graph = _engine_imports()
    assert "engine" not in graph["writer"] and "engine" not in graph["jobs"]
    state: dict[str, int] = {}

    def visit(mod: str, trail: tuple[str, ...]) -> None:
        assert state.get(mod) != 1, f"import cycle: {' -> '.join((*trail, mod))}"
        if state.get(mod) == 2:
            return
        state[mod] = 1
        for dep in graph.get(mod, ()):
            if dep in graph:
                visit(dep, (*trail, mod))
        state[mod] = 2

    for mod in graph:
        visit(mod, ())
    sizes = {p.name: len(p.read_text().splitlines()) for p in ENGINE_DIR.glob("*.py")}
    # 420: SaveEngine.save decides the writer (process or thread) before it copies anything, in one module.
    assert all(n <= 420 for n in sizes.values()), sizes
    assert not any("__dict__[" in p.read_text() or "__dict__.pop" in p.read_text() for p in ENGINE_DIR.glob("*.py"))
